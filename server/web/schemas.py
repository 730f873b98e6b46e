"""The typed answers of the /v1 routes, declared as their return types, so FastAPI validates each answer against the
served schema (the Open Inference Protocol's are ``server.web.routers.inference_v2``'s).

Example:
    >>> Label(label=3, name="cat", probability=0.91).model_dump()
    {'label': 3, 'name': 'cat', 'probability': 0.91}
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from server.status import Readiness, Status

__all__ = ["Readiness", "Status"]  # the operations routes' answers, which the roles build (server.status)


class Label(BaseModel):
    """One of an image's top-k classes."""

    label: int = Field(description="The class's original label")
    name: str = Field(description="The class's name")
    probability: float = Field(ge=0, le=1)


class FilePrediction(BaseModel):
    filename: str = Field(description="The upload's file name (``body`` for a raw image body)")
    top_k: list[Label] = Field(description="Most probable classes first, over the classes seen so far")
    novelty: float | None = Field(description="How likely the image is of a class not learned yet: higher is more "
                                              "likely (the score the learner's --novelty.score names)")
    novel: bool | None = Field(description="The score is above the threshold calibrated on the stream to "
                                           "--novelty.false_alarm: answered as a class not learned yet")


class PredictResponse(BaseModel):
    """``POST /v1/predict``: the predictions and the model version that made them."""

    model_config = ConfigDict(protected_namespaces=())
    model_version: int = Field(description="The version of the model that answered")
    samples_seen: int = Field(description="Samples that model had learned")
    novelty_threshold: float | None = Field(description="Above it an image is answered as novel (null: not "
                                                        "calibrated yet, nothing is)")
    predictions: list[FilePrediction]


class Liveness(BaseModel):
    status: Literal["ok"]


class Action(BaseModel):
    """What an admin action did (``checkpoint requested``, ``paused``, ``resumed``)."""

    status: str
