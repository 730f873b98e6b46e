"""The HTTP API as clients speak it, against a real server and broker: the Open Inference Protocol through
Triton's own Python client, malformed /v2 input, body limits on every path, metrics, and offline /docs."""

from __future__ import annotations

import base64
import gc
import io
import json
import math
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from mepo_stream.anytime import ProtocolConfig
from mepo_stream.images import ImageLimits
from mepo_stream.sampler import SiBlurryConfig
from producers.siblurry import ReplayConfig, produce
from server.broker import free_port
from server.config import ServeConfig
from tests.helpers import DATA, NO_BROKER, ROOT, LiveServer, code_blocks, http_client, serve_process, settings, wait_for

STREAM_LIMIT = 32


def jpeg(color: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), color).save(buf, format="JPEG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def live(broker, tmp_path_factory) -> Iterator[tuple[ServeConfig, httpx.Client]]:
    """One server (in this process, uvicorn in a thread) that has learned a few classes, shared by the module."""
    cfg = settings(broker, tmp_path_factory.mktemp("live"), grpc_port=free_port())
    with LiveServer(cfg) as http:
        produce(DATA, SiBlurryConfig(seed=1), cfg.kafka, ReplayConfig(limit=STREAM_LIMIT))
        wait_for(lambda: http.get("/v1/status").json()["samples_seen"] >= STREAM_LIMIT, what="a model to query")
        yield cfg, http


def test_a_running_service_keeps_its_startup_heap_out_of_full_collections(broker, tmp_path):
    """The modules, the model and the app live as long as the service: while it runs they are frozen, so a full
    collection (it holds the interpreter lock that learning steps and requests need) scans only what the service
    allocates as it runs; stopping gives them back to the collector."""
    with LiveServer(settings(broker, tmp_path)) as http:
        assert http.get("/livez").status_code == 200
        frozen = gc.get_freeze_count()
    assert frozen > 0 and gc.get_freeze_count() == 0


def test_tritonclient_speaks_to_the_server_and_gets_the_v1_answer(live):
    import tritonclient.http as triton

    cfg, http = live
    image = jpeg("red")
    client = triton.InferenceServerClient(str(http.base_url).removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(cfg.model_name)
    assert client.get_model_metadata(cfg.model_name)["inputs"][0]["datatype"] == "BYTES"
    assert client.get_model_config(cfg.model_name)["input"][0]["name"] == "image"
    assert client.get_model_repository_index()[0]["name"] == cfg.model_name
    tensor = triton.InferInput("image", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([base64.b64encode(image)], dtype=np.object_), binary_data=False)
    result = client.infer(cfg.model_name, [tensor], parameters={"top_k": 3})
    v1 = http.post("/v1/predict", params={"top_k": 3}, content=image,
                   headers={"content-type": "image/jpeg"}).json()["predictions"][0]["top_k"]
    assert result.as_numpy("label").tolist() == [[c["label"] for c in v1]]
    np.testing.assert_allclose(result.as_numpy("probability")[0], [c["probability"] for c in v1], atol=1e-5)
    stats = client.get_inference_statistics(cfg.model_name)["model_stats"][0]
    assert stats["name"] == cfg.model_name and stats["inference_stats"]["success"]["count"] >= 2


def test_the_docs_client_examples_run_against_a_live_server(live, tmp_path, monkeypatch, capsys):
    """docs/http-api.md's curl lines and Python clients (HTTP and gRPC), pointed at this server and a real image."""
    cfg, http = live
    page = (ROOT / "docs" / "http-api.md").read_text()
    address = str(http.base_url).removeprefix("http://").rstrip("/")
    (tmp_path / "cat.jpg").write_bytes(jpeg("red"))
    monkeypatch.chdir(tmp_path)
    curls = [line for block in code_blocks(page, "bash") for line in block.splitlines() if "curl " in line]
    assert len(curls) == 3
    answers = [json.loads(subprocess.run(line.replace("127.0.0.1:8000", address), shell=True, capture_output=True,
                                         text=True, check=True).stdout) for line in curls]
    assert all(answers) and answers[2]["outputs"][0]["shape"] == [1, 3]  # the inference protocol's, top 3
    clients = code_blocks(page, "python")
    assert len(clients) == 2
    for python in clients:
        exec(python.replace("127.0.0.1:8000", address).replace("127.0.0.1:8001", f"127.0.0.1:{cfg.grpc_port}"), {})
        assert "[[" in capsys.readouterr().out  # it printed the [1, 3] labels (the client's errors fail the test)


def test_json_without_content_type_is_read(live):
    """curl -d and Triton's client send JSON with no Content-Type header."""
    cfg, http = live
    r = http.post(f"/v2/models/{cfg.model_name}/infer", content=json.dumps(_request()).encode())
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["shape"][0] == 1


def _request(**change) -> dict:
    tensor = {"name": "image", "shape": [1], "datatype": "BYTES", "data": [base64.b64encode(jpeg("green")).decode()]}
    return {"inputs": [{**tensor, **change.pop("tensor", {})}], **change}


MALFORMED = {
    "top_k string": _request(parameters={"top_k": "abc"}),
    "top_k null": _request(parameters={"top_k": None}),
    "top_k list": _request(parameters={"top_k": [1]}),
    "top_k 1e400": json.dumps(_request(parameters={"top_k": 1})).replace('"top_k": 1', '"top_k": 1e400').encode(),
    "top_k negative": _request(parameters={"top_k": -1}),
    "top_k zero": _request(parameters={"top_k": 0}),
    "top_k huge": _request(parameters={"top_k": 10**30}),
    "top_k float": _request(parameters={"top_k": 2.5}),
    "top_k bool": _request(parameters={"top_k": True}),
    "wrong datatype": _request(tensor={"datatype": "FP32"}),
    "wrong shape": _request(tensor={"shape": [2]}),
    "shape not a list": _request(tensor={"shape": "1"}),
    "missing inputs": {"parameters": {}},
    "empty inputs": {"inputs": []},
    "not base64": _request(tensor={"data": ["%%% not base64 %%%"]}),
    "data not a string": _request(tensor={"data": [17]}),
    "base64 of no image": _request(tensor={"data": [base64.b64encode(b"plain text").decode()]}),
    "no images": _request(tensor={"shape": [0], "data": []}),
    "not JSON": b"{not json",
    "JSON not an object": b"[1, 2]",
}


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_v2_requests_get_a_4xx_in_the_error_model(live, name):
    cfg, http = live
    body = MALFORMED[name]
    r = http.post(f"/v2/models/{cfg.model_name}/infer",
                  content=body if isinstance(body, bytes) else json.dumps(body).encode())
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert set(r.json()) == {"error", "reason"}, r.text


def test_a_label_not_a_json_integer_of_a_class_is_refused_naming_it_and_never_written(broker, tmp_path):
    """A boolean, a string or a float for a label, or a negative one, is a typo in an operator's script, not a
    relabelling: each gets a 422 naming ``label`` and writes nothing (the valid label sent after them, with the same
    id and so to the same partition, is the labels topic's first record there). The served schema bounds a label
    by the running learner's classes, as the route does."""
    from tests.test_labels_later import later

    cfg = later(settings(broker, tmp_path, protocol=ProtocolConfig(eval_period=0)))
    admin = {"authorization": f"Bearer {cfg.admin_token}"}
    with LiveServer(cfg) as http:
        for body in ({"label": False}, {"label": "3"}, {"label": 3.0}, {"label": -1}):
            refused = http.post("/v1/labels/sample-7", json=body, headers=admin)
            assert refused.status_code == 422 and refused.json()["error"].startswith("body.label: "), (body,
                                                                                                      refused.text)
        written = http.post("/v1/labels/sample-7", json={"label": 3}, headers=admin)
        label = http.get("/openapi.json").json()["components"]["schemas"]["NewLabel"]["properties"]["label"]
        past = http.post("/v1/labels/sample-7", json={"label": label["maximum"] + 1}, headers=admin)
    assert written.status_code == 202, written.text
    assert (written.json()["topic"], written.json()["offset"]) == (cfg.kafka.labels_topic, 0)
    assert (label["minimum"], label["maximum"]) == (0, 9)  # CIFAR-10's ten classes
    assert past.status_code == 422 and past.json()["reason"] == "label_out_of_range"


def test_v2_requests_failed_ones_included_are_counted_in_the_metrics(live):
    cfg, http = live

    def counted(protocol: str) -> dict[str, float]:
        text = http.get("/metrics").text
        return {m[0]: float(m[1]) for m in re.findall(
            rf'mepo_predict_requests_total{{protocol="{protocol}",status="(\d+)"}} (\S+)', text)}

    before, before_v1 = counted("v2"), counted("v1")
    assert http.post(f"/v2/models/{cfg.model_name}/infer", json=_request()).status_code == 200
    assert http.post(f"/v2/models/{cfg.model_name}/infer", json={"inputs": []}).status_code == 422
    assert http.post(f"/v2/models/{cfg.model_name}/infer", json=_request(tensor={"shape": [2]})).status_code == 400
    after = counted("v2")
    assert {s: after.get(s, 0) - before.get(s, 0) for s in ("200", "400", "422")} == {"200": 1, "400": 1, "422": 1}
    assert http.post("/v1/predict", content=b"{}", headers={"content-type": "application/json"}).status_code == 415
    assert counted("v1").get("415", 0) - before_v1.get("415", 0) == 1  # /v1 counted as before, protocol="v1"


def test_docs_reference_only_local_assets_that_are_served(live):
    _, http = live
    for page in ("/docs", "/redoc"):
        html = http.get(page).text
        urls = re.findall(r'(?:src|href)="([^"]+)"', html) + re.findall(r"url: '([^']+)'", html)
        assert urls and all(u.startswith("/") and not u.startswith("//") for u in urls), (page, urls)
        assert all(http.get(u).status_code == 200 for u in urls), urls


def _rss_kib(pid: int) -> int:
    return int(re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text()).group(1))


def _chunks(total: int, byte: bytes = b"\xff", size: int = 1 << 20) -> Iterator[bytes]:
    """``total`` bytes made lazily, one ``size`` chunk at a time: the client never holds the body (a generator
    body is sent chunked, without Content-Length)."""
    chunk = byte * size
    for _ in range(total // size):
        yield chunk


def _then(first: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    yield first
    yield from rest


BIG = 300 * 1024 * 1024


def test_body_limits_hold_on_every_path_with_or_without_content_length(broker, tmp_path):
    """A server process with a 200 KB image limit (16 images: ~3.4 MB multipart, ~4.3 MB JSON) refuses each kind
    of oversize body with 413, a 300 MB chunked upload among them, and its memory barely moves."""
    cfg = settings(broker, tmp_path, limits=ImageLimits(size=32, max_bytes=200_000, max_pixels=4_000_000))
    server = serve_process(cfg, tmp_path / "serve.log")
    http = http_client(cfg, timeout=120)
    try:
        wait_for(lambda: server.running() and http.get("/livez").status_code == 200, what="the server",
                 ignore=(httpx.TransportError,))
        boundary = "b0undary"
        head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"files\"; filename=\"a.jpg\"\r\n"
                "Content-Type: image/jpeg\r\n\r\n").encode()
        multipart = {"content-type": f"multipart/form-data; boundary={boundary}"}
        json_head = b'{"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "data": ["'
        binary_head = b'{"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "parameters": ' \
            b'{"binary_data_size": 314572800}}]}'
        binary = {"inference-header-content-length": str(len(binary_head))}  # Triton's binary tensor extension
        v1, v2 = "/v1/predict", f"/v2/models/{cfg.model_name}/infer"
        cases = {
            "raw, Content-Length": (v1, lambda: b"\xff" * 300_000, {"content-type": "image/jpeg"}),
            "raw, chunked 300 MB": (v1, lambda: _chunks(BIG), {"content-type": "image/jpeg"}),
            "multipart, Content-Length": (v1, lambda: head + b"\xff" * 5_000_000, multipart),
            "multipart, chunked 300 MB": (v1, lambda: _then(head, _chunks(BIG)), multipart),
            "JSON, Content-Length": (v2, lambda: json_head + b"A" * 5_000_000, {"content-type": "application/json"}),
            "JSON, chunked 300 MB": (v2, lambda: _then(json_head, _chunks(BIG, b"A")),
                                     {"content-type": "application/json"}),
            "JSON, no Content-Type, chunked 300 MB": (v2, lambda: _then(json_head, _chunks(BIG, b"A")), {}),
            "binary extension, chunked 300 MB": (v2, lambda: _then(binary_head, _chunks(BIG)), binary),
        }
        rss0 = _rss_kib(server.pid)
        for name, (path, body, headers) in cases.items():
            r = http.post(path, content=body(), headers=headers)
            assert r.status_code == 413 and r.json()["reason"] == "too_large", (name, r.status_code, r.text[:300])
        growth_mib = (_rss_kib(server.pid) - rss0) / 1024
        print(f"\nserver RSS growth over the oversize bodies (five of 300 MB, chunked): {growth_mib:.1f} MiB")
        assert growth_mib < 64 and math.isfinite(growth_mib)
    finally:
        http.close()
        server.terminate()
        server.wait(60)


def test_every_json_answer_has_a_typed_model_in_the_schema(tmp_path):
    """Each route's 2xx JSON answer is a pydantic model in the OpenAPI schema (so the fuzz test checks real
    answers against it), not an untyped object; status and readiness are one model per role, told apart by
    ``role``."""
    from server.web.app import create_app

    def typed(body: dict) -> bool:
        body = body.get("items", body)
        return "$ref" in body or ("discriminator" in body and all("$ref" in b for b in body["oneOf"]))

    schema = create_app(settings(NO_BROKER, tmp_path)).openapi()
    untyped = []
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            for status, answer in operation["responses"].items():
                body = answer.get("content", {}).get("application/json", {}).get("schema")
                if status.startswith("2") and body is not None and not typed(body):
                    untyped.append(f"{method.upper()} {path} {status}: {body}")
    assert not untyped
    for path, models in {"/v1/status": "Status", "/readyz": "Readiness"}.items():
        body = schema["paths"][path]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
        assert body["discriminator"] == {"propertyName": "role", "mapping": {
            "learner": f"#/components/schemas/Learner{models}", "replica": f"#/components/schemas/Replica{models}"}}
