"""The Open Inference Protocol as standard clients speak it with their defaults, against a learner and a replica:
``tritonclient.http`` with the binary tensor data extension on (its default) and off, ``tritonclient.grpc``, and
the requests KServe's SDK clients send (written out here: the SDK brings kubernetes and pandas); hostile gRPC
messages; and the bound on the request bytes all HTTP requests in flight may hold together."""

from __future__ import annotations

import base64
import io
import json
import math
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from PIL import Image
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pbg

from mepo_stream.images import ImageLimits
from mepo_stream.sampler import SiBlurryConfig
from producers.siblurry import ReplayConfig, produce
from server.broker import free_port
from server.config import ServeConfig, replica_of
from server.oip import raw_request_limit, serialize_bytes
from tests.helpers import DATA, NO_BROKER, LiveServer, http_client, serve_process, settings, wait_for

LEARNED = 32
TOP_K = 3
LIMITS = ImageLimits(size=32, max_bytes=64 * 1024)  # small images: an oversize gRPC message stays small


def jpeg(color: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), color).save(buf, format="JPEG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def servers(broker, tmp_path_factory) -> Iterator[dict[str, tuple[ServeConfig, httpx.Client]]]:
    """A learner that has learned a few classes and a replica of it, each with HTTP and gRPC."""
    tmp = tmp_path_factory.mktemp("oip")
    learner = settings(broker, tmp / "learner", grpc_port=free_port(), limits=LIMITS)
    learner = replace(learner, kafka=replace(learner.kafka, snapshot_topic=f"snapshots-{learner.kafka.group_id}"))
    replica = replica_of(learner, grpc_port=free_port(), checkpoint_dir=tmp / "replica")
    with LiveServer(learner) as learner_http, LiveServer(replica) as replica_http:
        produce(DATA, SiBlurryConfig(seed=1), learner.kafka, ReplayConfig(limit=LEARNED))
        wait_for(lambda: learner_http.get("/v1/status").json()["samples_seen"] >= LEARNED, what="learning")
        version = learner_http.get("/v1/status").json()["model_version"]
        wait_for(lambda: replica_http.get("/v1/status").json()["model_version"] == version, what="the replica")
        yield {"learner": (learner, learner_http), "replica": (replica, replica_http)}


def v1_top_k(http: httpx.Client, image: bytes) -> list[dict]:
    answer = http.post("/v1/predict", params={"top_k": TOP_K}, content=image, headers={"content-type": "image/jpeg"})
    return answer.json()["predictions"][0]["top_k"]


def assert_same_answer(labels: np.ndarray, probabilities: np.ndarray, v1: list[dict]) -> None:
    assert labels.tolist() == [c["label"] for c in v1]
    np.testing.assert_allclose(probabilities, [c["probability"] for c in v1], atol=1e-5)


def v1_novelty(http: httpx.Client, image: bytes) -> tuple[float, bool]:
    answer = http.post("/v1/predict", content=image, headers={"content-type": "image/jpeg"}).json()["predictions"][0]
    return answer["novelty"], answer["novel"]


def assert_same_novelty(result, row: int, http: httpx.Client, image: bytes) -> None:
    """The novelty outputs (FP32 [N], BOOL [N]) of an OIP answer's ``row`` are /v1/predict's for the image."""
    novelty, novel = v1_novelty(http, image)
    assert math.isfinite(novelty) and result.as_numpy("novelty").shape == result.as_numpy("novel").shape
    np.testing.assert_allclose(result.as_numpy("novelty")[row], novelty, rtol=1e-5)
    assert bool(result.as_numpy("novel")[row]) is novel


@pytest.mark.parametrize("role", ["learner", "replica"])
@pytest.mark.parametrize("binary_outputs", [None, True, False])
def test_tritonclient_http_with_binary_inputs_gets_the_v1_answer(servers, role, binary_outputs):
    """The call every Triton example makes: ``set_data_from_numpy`` with its default ``binary_data=True``; the
    outputs left to the default (all raw), or asked for raw or in JSON."""
    cfg, http = servers[role]
    client = triton_http.InferenceServerClient(str(http.base_url).removeprefix("http://"))
    images = [jpeg("red"), jpeg("blue")]
    tensor = triton_http.InferInput("image", [2], "BYTES")
    tensor.set_data_from_numpy(np.array(images, dtype=np.object_))
    outputs = None if binary_outputs is None else [triton_http.InferRequestedOutput(name, binary_data=binary_outputs)
                                                   for name in ("label", "probability")]
    result = client.infer(cfg.model_name, [tensor], outputs=outputs, parameters={"top_k": TOP_K})
    for row, image in enumerate(images):
        assert_same_answer(result.as_numpy("label")[row], result.as_numpy("probability")[row], v1_top_k(http, image))
        if binary_outputs is None:  # every output: the novelty ones too
            assert_same_novelty(result, row, http, image)


@pytest.mark.parametrize("role", ["learner", "replica"])
def test_tritonclient_reads_the_extensions_and_each_one_answers(servers, role):
    """``GET /v2`` lists what the server implements, and each listed extension answers Triton's client."""
    cfg, http = servers[role]
    client = triton_http.InferenceServerClient(str(http.base_url).removeprefix("http://"))
    extensions = client.get_server_metadata()["extensions"]
    assert {"binary_tensor_data", "model_configuration", "statistics"} <= set(extensions)
    calls = {"model_configuration": lambda: client.get_model_config(cfg.model_name)["name"] == cfg.model_name,
             "statistics": lambda: client.get_inference_statistics(cfg.model_name)["model_stats"][0]["name"]
             == cfg.model_name,
             "binary_tensor_data": lambda: client.infer(cfg.model_name, [binary_image()]).as_numpy("label") is not None}
    assert {name: calls[name]() for name in extensions} == dict.fromkeys(extensions, True)


def binary_image() -> triton_http.InferInput:
    tensor = triton_http.InferInput("image", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([jpeg("red")], dtype=np.object_), binary_data=True)
    return tensor


@pytest.mark.parametrize("role", ["learner", "replica"])
def test_tritonclient_http_without_binary_data_and_one_output_asked(servers, role):
    cfg, http = servers[role]
    client = triton_http.InferenceServerClient(str(http.base_url).removeprefix("http://"))
    tensor = triton_http.InferInput("image", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([base64.b64encode(jpeg("green"))], dtype=np.object_), binary_data=False)
    result = client.infer(cfg.model_name, [tensor], outputs=[triton_http.InferRequestedOutput("label", False)],
                          parameters={"top_k": TOP_K})
    assert result.as_numpy("probability") is None
    assert result.as_numpy("label")[0].tolist() == [c["label"] for c in v1_top_k(http, jpeg("green"))]


@pytest.mark.parametrize("role", ["learner", "replica"])
def test_tritonclient_grpc_gets_the_v1_answer(servers, role):
    cfg, http = servers[role]
    client = triton_grpc.InferenceServerClient(f"127.0.0.1:{cfg.grpc_port}")
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(cfg.model_name)
    metadata = client.get_model_metadata(cfg.model_name, as_json=True)
    assert metadata["inputs"][0] == {"name": "image", "datatype": "BYTES", "shape": ["-1"]}
    assert client.get_server_metadata(as_json=True)["name"] == "mepo-stream"
    tensor = triton_grpc.InferInput("image", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([jpeg("red")], dtype=np.object_))
    result = client.infer(cfg.model_name, [tensor], parameters={"top_k": TOP_K})
    assert_same_answer(result.as_numpy("label")[0], result.as_numpy("probability")[0], v1_top_k(http, jpeg("red")))
    assert_same_novelty(result, 0, http, jpeg("red"))
    assert [o["name"] for o in metadata["outputs"]] == ["label", "probability", "novelty", "novel"]


def test_a_replica_answers_the_novelty_its_learner_answers(servers):
    """The score is made of the sums the snapshot carries, and the threshold travels with it: a replica at the
    learner's version answers each image with the learner's novelty score, flag and threshold."""
    answers = {role: http.post("/v1/predict", files=[("files", ("a.jpg", jpeg(c), "image/jpeg"))
                                                     for c in ("red", "navy", "white")]).json()
               for role, (_, http) in servers.items()}
    learner, replica = answers["learner"], answers["replica"]
    assert learner["model_version"] == replica["model_version"]
    assert learner["novelty_threshold"] == replica["novelty_threshold"]
    for mine, theirs in zip(learner["predictions"], replica["predictions"], strict=True):
        assert math.isfinite(mine["novelty"]) and mine["novelty"] == pytest.approx(theirs["novelty"], rel=1e-5)
        assert mine["novel"] is theirs["novel"]


def infer_request(cfg: ServeConfig, items: list[bytes], datatype: str = "BYTES", shape: list[int] | None = None,
                  model: str | None = None) -> pb.ModelInferRequest:
    tensor = pb.ModelInferRequest.InferInputTensor(name="image", datatype=datatype,
                                                   shape=[len(items)] if shape is None else shape)
    return pb.ModelInferRequest(model_name=model or cfg.model_name, inputs=[tensor],
                                raw_input_contents=[serialize_bytes(items)])


def test_hostile_grpc_messages_get_clear_statuses_and_the_server_goes_on(servers):
    cfg, http = servers["learner"]
    stub = pbg.GRPCInferenceServiceStub(grpc.insecure_channel(
        f"127.0.0.1:{cfg.grpc_port}", options=[("grpc.max_send_message_length", -1)]))
    too_big = b"\xff" * (raw_request_limit(cfg) + 1)
    hostile = {
        "oversize": (infer_request(cfg, [too_big]), grpc.StatusCode.RESOURCE_EXHAUSTED),
        "wrong datatype": (infer_request(cfg, [jpeg("red")], datatype="FP32"), grpc.StatusCode.INVALID_ARGUMENT),
        "shape against data": (infer_request(cfg, [jpeg("red")], shape=[2]), grpc.StatusCode.INVALID_ARGUMENT),
        "not an image": (infer_request(cfg, [b"plain text"]), grpc.StatusCode.INVALID_ARGUMENT),
        "raw bytes cut short": (pb.ModelInferRequest(
            model_name=cfg.model_name, inputs=[pb.ModelInferRequest.InferInputTensor(
                name="image", datatype="BYTES", shape=[1])], raw_input_contents=[b"\x09\x00\x00\x00ab"]),
            grpc.StatusCode.INVALID_ARGUMENT),
        "another model": (infer_request(cfg, [jpeg("red")], model="nope"), grpc.StatusCode.NOT_FOUND),
    }
    for name, (request, code) in hostile.items():
        with pytest.raises(grpc.RpcError) as error:
            stub.ModelInfer(request, timeout=30)
        assert error.value.code() == code, (name, error.value.code(), error.value.details())
        assert error.value.details(), name
    answer = stub.ModelInfer(infer_request(cfg, [jpeg("red")]), timeout=30)  # it still serves
    assert [o.name for o in answer.outputs] == ["label", "probability", "novelty", "novel"]
    assert answer.raw_output_contents
    counted = re.findall(r'mepo_predict_requests_total\{protocol="grpc",status="(\d+)"\} (\S+)',
                         http.get("/metrics").text)
    assert {status for status, n in counted if float(n) > 0} >= {"200", "400", "404"}


def test_grpc_answers_unavailable_before_the_first_class(broker, tmp_path):
    cfg = settings(broker, tmp_path, grpc_port=free_port())
    with LiveServer(cfg):
        stub = pbg.GRPCInferenceServiceStub(grpc.insecure_channel(f"127.0.0.1:{cfg.grpc_port}"))
        with pytest.raises(grpc.RpcError) as error:
            stub.ModelInfer(infer_request(cfg, [jpeg("red")]), timeout=30)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert not stub.ModelReady(pb.ModelReadyRequest(name=cfg.model_name), timeout=30).ready


# --- bounded memory of the request bodies in flight -------------------------------------------------------------
def rss_bytes(pid: int) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) * 1024


def test_bodies_in_flight_stay_under_their_bound_and_the_rest_get_503_with_retry_after(broker, tmp_path):
    """Sixteen chunked /v2 JSON bodies of about 19 MB at once, against a 20 MB limit per request and 40 MB for
    all in flight: the server refuses what does not fit with 503 and Retry-After, answers the rest (422: random
    bytes are no image), and its resident memory grows by less than the bound stated here, where the 16 bodies
    buffered together would take over 300 MB."""
    cfg = settings(broker, tmp_path, max_files=2, max_inflight_bytes=40 * 2**20,
                   limits=replace(LIMITS, max_bytes=int(7.4 * 2**20)))
    body = b'{"inputs": [{"name": "image", "shape": [2], "datatype": "BYTES", "data": ["' + \
        base64.b64encode(np.random.default_rng(0).bytes(int(7.2 * 2**20))) + b'", "' + \
        base64.b64encode(b"x" * int(7.2 * 2**20)) + b'"]}]}'
    assert 19 * 2**20 < len(body) < 20 * 2**20
    process = serve_process(cfg, tmp_path / "serve.log")
    try:
        http = http_client(cfg)

        def ready() -> bool:
            try:
                return process.running() and http.get("/readyz").status_code == 200
            except httpx.TransportError:
                return False

        wait_for(ready, 120, "the server")
        before, peak, done = rss_bytes(process.pid), [0], threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], rss_bytes(process.pid))
                time.sleep(0.01)

        def post(_: int) -> httpx.Response:
            chunks = (body[i:i + 2**20] for i in range(0, len(body), 2**20))  # chunked: no Content-Length
            return httpx.post(f"http://127.0.0.1:{cfg.port}/v2/models/{cfg.model_name}/infer", content=chunks,
                              timeout=120)

        watcher = threading.Thread(target=sample)
        watcher.start()
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(post, range(16)))
        done.set()
        watcher.join()
    finally:
        process.terminate()
        process.wait(30)
    statuses = sorted(a.status_code for a in answers)
    assert set(statuses) <= {422, 503} and 503 in statuses and 422 in statuses, statuses
    assert all(a.headers.get("retry-after") == "1" and a.json()["reason"] == "overloaded"
               for a in answers if a.status_code == 503)
    growth = peak[0] - before
    assert growth < 200 * 2**20, f"resident memory grew by {growth / 2**20:.0f} MB"


def kserve_rest_infer(http: httpx.Client, cfg: ServeConfig, image: bytes) -> httpx.Response:
    """The request KServe's ``InferenceRESTClient`` (protocol v2) sends for one BYTES tensor that
    ``InferInput.set_data_from_numpy`` filled with its default ``binary_data=True``: a JSON header with a request
    id, the input's ``binary_data_size``, a request-level ``top_k`` and no outputs asked for, then the raw bytes,
    as ``application/octet-stream`` with ``Inference-Header-Content-Length`` (kserve 0.21,
    ``InferRequest.to_rest`` and ``InferenceRESTClient.infer``)."""
    raw = serialize_bytes([image])
    header = json.dumps({"id": "kserve-1", "model_name": cfg.model_name, "parameters": {"top_k": TOP_K},
                         "inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": len(raw)}}]}).encode()
    return http.post(f"/v2/models/{cfg.model_name}/infer", content=header + raw,
                     headers={"Inference-Header-Content-Length": str(len(header)),
                              "content-type": "application/octet-stream"})


def kserve_grpc_infer(cfg: ServeConfig, image: bytes) -> triton_grpc.InferResult:
    """The ``ModelInferRequest`` KServe's ``InferenceGRPCClient`` sends for the same tensor (``InferRequest.to_grpc``):
    a request id, ``top_k`` as an ``int64_param``, no outputs asked for, the tensor in ``raw_input_contents``."""
    stub = pbg.GRPCInferenceServiceStub(grpc.insecure_channel(f"127.0.0.1:{cfg.grpc_port}"))
    request = pb.ModelInferRequest(
        model_name=cfg.model_name, id="kserve-1", parameters={"top_k": pb.InferParameter(int64_param=TOP_K)},
        inputs=[pb.ModelInferRequest.InferInputTensor(name="image", datatype="BYTES", shape=[1])],
        raw_input_contents=[serialize_bytes([image])])
    return triton_grpc.InferResult(stub.ModelInfer(request, timeout=30))


@pytest.mark.parametrize("role", ["learner", "replica"])
@pytest.mark.parametrize("transport", ["rest", "grpc"])
def test_the_kserve_sdk_requests_get_the_v1_answer(servers, role, transport):
    """KServe's own clients' requests, with their defaults (binary input over REST, answered in JSON since no
    output asks to be raw): the answer echoes the request id and matches ``/v1/predict``."""
    cfg, http = servers[role]
    v1 = v1_top_k(http, jpeg("blue"))
    if transport == "grpc":
        result = kserve_grpc_infer(cfg, jpeg("blue"))
        assert result.get_response().id == "kserve-1"
        assert_same_answer(result.as_numpy("label")[0], result.as_numpy("probability")[0], v1)
        return
    answer = kserve_rest_infer(http, cfg, jpeg("blue"))
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/json", answer.text
    body = answer.json()
    outputs = {out["name"]: np.array(out["data"]).reshape(out["shape"]) for out in body["outputs"]}
    assert body["id"] == "kserve-1" and set(outputs) == {"label", "probability", "novelty", "novel"}
    assert_same_answer(outputs["label"][0], outputs["probability"][0], v1)


# --- the parts that need no learner: driven directly ------------------------------------------------------------
def test_raw_bytes_with_more_elements_than_the_shape_says_are_refused_with_400_on_both_transports(tmp_path):
    """Three raw ``BYTES`` elements under shape [2]: HTTP's binary extension answers 400 and gRPC's
    INVALID_ARGUMENT (400), each naming the bytes left over, before any image is decoded."""
    from server.grpc_service import InferenceService
    from server.web.dependencies import ApiError
    from server.web.routers.inference_v2 import parse_infer

    raw = serialize_bytes([jpeg("red"), jpeg("green"), jpeg("blue")])
    extra = len(serialize_bytes([jpeg("blue")]))
    header = json.dumps({"inputs": [{"name": "image", "shape": [2], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": len(raw)}}]}).encode()
    with pytest.raises(ApiError) as http_error:
        parse_infer(header + raw, str(len(header)))
    assert http_error.value.status_code == 400 and http_error.value.reason == "invalid_request"
    assert f"{extra} bytes follow the 2 BYTES elements" in http_error.value.detail
    request = pb.ModelInferRequest(inputs=[pb.ModelInferRequest.InferInputTensor(name="image", datatype="BYTES",
                                                                                   shape=[2])],
                                   raw_input_contents=[raw])
    with pytest.raises(ApiError) as grpc_error:
        InferenceService.images_of(request)
    assert grpc_error.value.status_code == 400 and f"{extra} bytes follow" in grpc_error.value.detail
    as_said = serialize_bytes([jpeg("red"), jpeg("green")])  # the same request with the shape's two: accepted
    header = header.replace(str(len(raw)).encode(), str(len(as_said)).encode())
    assert len(parse_infer(header + as_said, str(len(header)))[1]) == 2
    said = pb.ModelInferRequest(inputs=request.inputs, raw_input_contents=[as_said])
    assert len(InferenceService.images_of(said)) == 2


class NoModel:
    """A ``ServingModel`` stand-in that records whether a request ever reached the model."""

    def __init__(self):
        from server.metrics import ServerMetrics

        self.metrics, self.calls = ServerMetrics(), []

    def predict(self, images):
        self.calls.append(len(images))
        raise LookupError("no classes learned yet")


def test_grpc_refuses_an_oversize_message_in_the_transport_and_an_oversize_image_in_the_app(tmp_path):
    """Two RESOURCE_EXHAUSTED refusals told apart: a message over the raw request limit is refused by gRPC itself
    (its own "larger than max" detail; the service never runs: not counted, no decode), and an image over
    ``--limits.max_bytes`` inside a message under that limit is refused by the app (its own detail, counted 413)
    before the model sees it."""
    from server.grpc_service import serve_grpc

    cfg = settings(NO_BROKER, tmp_path, grpc_port=free_port(), limits=LIMITS, max_files=2)
    service = NoModel()
    server = serve_grpc(service, cfg, workers=2)
    try:
        stub = pbg.GRPCInferenceServiceStub(grpc.insecure_channel(
            f"127.0.0.1:{cfg.grpc_port}", options=[("grpc.max_send_message_length", -1)]))
        refusals = {}
        for name, size in (("transport", raw_request_limit(cfg) + 1), ("app", LIMITS.max_bytes + 1)):
            with pytest.raises(grpc.RpcError) as error:
                stub.ModelInfer(infer_request(cfg, [b"\xff" * size]), timeout=30)
            refusals[name] = (error.value.code(), error.value.details())
    finally:
        server.stop(grace=None)
    assert refusals["transport"][0] == refusals["app"][0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in refusals["transport"][1], refusals
    assert "larger than max" not in refusals["app"][1] and str(LIMITS.max_bytes) in refusals["app"][1], refusals
    counted = {labels: c for labels, c in (
        ((s.labels["protocol"], s.labels["status"]), s.value)
        for m in service.metrics.registry.collect() if m.name == "mepo_predict_requests"
        for s in m.samples if s.name.endswith("_total"))}
    assert counted == {("grpc", "413"): 1.0}, counted  # the app's refusal only: the transport's never reached it
    assert service.calls == []
