"""The served OpenAPI schema: FastAPI's, with the bounds only the running app knows (the model's name, the images a
request may hold, the class count), so clients and the fuzz test see the routes' refusals coming.

Example (no service yet: no class count, so no label bound):
    >>> from server.config import ServeConfig
    >>> from server.web.app import create_app
    >>> schema = create_app(ServeConfig(max_files=4)).openapi()
    >>> schema["paths"]["/v2/models/{name}"]["get"]["parameters"][0]["schema"]["enum"]
    ['mepo']
    >>> upload = schema["paths"]["/v1/predict"]["post"]["requestBody"]["content"]["multipart/form-data"]
    >>> upload["schema"]["properties"]["files"]["maxItems"]
    4
    >>> "maximum" in schema["components"]["schemas"]["NewLabel"]["properties"]["label"]
    False
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI

from server.config import ServeConfig
from server.web.routers.samples import NewLabel

Schema = dict[str, Any]
MODEL = "/v2/models/{name}"
"""The model routes' path: ``name`` is the one parameter they share."""


def serve_bounded_schema(app: FastAPI) -> None:
    """Make ``app.openapi`` FastAPI's schema, built once, with the bounds of the settings and the running service."""
    built = app.openapi  # FastAPI's own: builds the schema on its first call and keeps it

    def openapi() -> Schema:
        schema = copy.deepcopy(built())
        settings: ServeConfig = app.state.settings
        bound_model_name(schema, settings.model_name)
        bound_images(schema, settings.max_files)
        service = getattr(app.state, "service", None)
        if service is not None and service.class_names:  # a replica before its first snapshot knows none
            label = schema["components"]["schemas"][NewLabel.__name__]["properties"]["label"]
            label["maximum"] = len(service.class_names) - 1  # a label names one of the classes (more is a 422)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def bound_model_name(schema: Schema, name: str) -> None:
    """The model routes serve one model: any other name is a 404."""
    for path, operations in schema["paths"].items():
        if path.startswith(MODEL):
            for operation in operations.values():
                for parameter in operation.get("parameters", []):
                    if (parameter["in"], parameter["name"]) == ("path", "name"):
                        parameter["schema"]["enum"] = [name]


def bound_images(schema: Schema, max_files: int) -> None:
    """At most ``--max_files`` images a request (more is a 413): multipart files, and a /v2 input's items."""
    upload = schema["paths"]["/v1/predict"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    upload["properties"]["files"]["maxItems"] = max_files
    infer = schema["paths"][f"{MODEL}/infer"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    tensor = infer["properties"]["inputs"]["items"]["properties"]
    tensor["data"]["maxItems"] = max_files
    tensor["shape"]["items"]["maximum"] = max_files
