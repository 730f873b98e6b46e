"""One image over each protocol the server speaks, against the backbone's own forward; and the memory that large
request bodies in flight take at the default limits.

Once the stream is learned (the learner idle), one JPEG is predicted ``requests`` times over each of: ``/v1/predict``
(the image as the raw body), the Open Inference Protocol over HTTP with Triton's binary tensor data extension (the
image raw after a JSON header, the outputs raw: ``tritonclient.http``'s default), the same in JSON (the image in
base64), and the Open Inference Protocol over gRPC (``raw_input_contents``, through the generated stub). Each
client keeps one connection open, and the four take turns in blocks, so that all see the same machine. The floor is
the backbone's forward of the decoded image in the learner's precision (``predict_latency.backbone_forward``).

Then ``flood`` clients at once each send a chunked JSON body just under the per-request limit (16 images of 13 MB
in base64, 213 MB at the defaults): the server keeps at most ``--max_inflight_bytes`` of them (512 MB by default)
and answers the others 503 with Retry-After; its resident memory is sampled throughout.

Example:
    python -m benchmarks.rows.protocol_latency --spec.train_per_class 10
"""

from __future__ import annotations

import base64
import http.client
import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import httpx
from starlette.datastructures import Headers
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pbg

from benchmarks.rows.predict_latency import backbone_forward, sample_jpeg
from benchmarks.tools.service import ServiceSpec, quantiles, rss_bytes, running_service, write_result
from benchmarks.tools.table import Row, fmt
from mepo_stream.data import list_files
from mepo_stream.images import decode_image
from server.broker import free_port
from server.config import ServeConfig
from server.oip import serialize_bytes
from server.web.middleware import body_limit

MODEL = ServeConfig.model_name


class HttpPost:
    """One keep-alive connection of the standard library (the least client overhead), posting one fixed body."""

    def __init__(self, url: str, path: str, body: bytes, headers: dict[str, str]):
        self.connection = http.client.HTTPConnection(urlsplit(url).hostname, urlsplit(url).port, timeout=120)
        self.path, self.body, self.headers = path, body, headers

    def __call__(self) -> float:
        try:
            return self._post()
        except (ConnectionError, http.client.RemoteDisconnected):  # idle past the server's keep-alive: reconnect
            self.connection.close()
            return self._post()

    def _post(self) -> float:
        start = time.perf_counter()
        self.connection.request("POST", self.path, body=self.body, headers=self.headers)
        response = self.connection.getresponse()
        response.read()
        if response.status != 200:
            raise RuntimeError(f"POST {self.path} answered {response.status}")
        return time.perf_counter() - start


def clients(url: str, grpc_port: int, jpeg: bytes) -> dict[str, Callable[[], float]]:
    """Each protocol's timed single-image request."""
    raw = serialize_bytes([jpeg])
    binary_header = json.dumps({"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                                            "parameters": {"binary_data_size": len(raw)}}],
                                "parameters": {"binary_data_output": True}}).encode()
    json_body = json.dumps({"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                                        "data": [base64.b64encode(jpeg).decode()]}]}).encode()
    stub = pbg.GRPCInferenceServiceStub(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))
    request = pb.ModelInferRequest(model_name=MODEL, inputs=[pb.ModelInferRequest.InferInputTensor(
        name="image", datatype="BYTES", shape=[1])], raw_input_contents=[raw])

    def grpc_call() -> float:
        start = time.perf_counter()
        stub.ModelInfer(request, timeout=120)
        return time.perf_counter() - start

    infer = f"/v2/models/{MODEL}/infer"
    return {
        "v1": HttpPost(url, "/v1/predict", jpeg, {"content-type": "image/jpeg"}),
        "oip_http_binary": HttpPost(url, infer, binary_header + raw, {
            "content-type": "application/octet-stream", "inference-header-content-length": str(len(binary_header))}),
        "oip_http_json": HttpPost(url, infer, json_body, {"content-type": "application/json"}),
        "oip_grpc": grpc_call,
    }


def take_turns(calls: dict[str, Callable[[], float]], requests: int, block: int = 20) -> dict[str, list[float]]:
    """``requests`` timings of each call, in alternating blocks (the machine's speed drifts between minutes)."""
    for call in calls.values():
        call()  # warm: connections, first-use paths
    times: dict[str, list[float]] = {name: [] for name in calls}
    while min(map(len, times.values())) < requests:
        for name, call in calls.items():
            times[name] += [call() for _ in range(min(block, requests - len(times[name])))]
    return times


def large_body(limit: int, images: int, chunk: int = 1 << 20) -> Iterator[bytes]:
    """A JSON /v2 body of ``images`` base64 strings just under ``limit`` bytes in all, streamed in chunks (never
    held whole by the client)."""
    each = (limit - 4096) // images // 4 * 4  # base64 characters per image
    yield b'{"inputs": [{"name": "image", "shape": [%d], "datatype": "BYTES", "data": [' % images
    for i in range(images):
        yield b'"'
        for start in range(0, each, chunk):
            yield b"A" * min(chunk, each - start)
        yield b'"' + (b", " if i < images - 1 else b"")
    yield b"]}]}"


def flood(url: str, pid: int, clients_n: int, limit: int, images: int) -> dict:
    """``clients_n`` large bodies at once; the server's peak resident memory above its idle level, and the
    answers (503: refused while the others were in flight; an error: the connection closed on a refused body)."""
    before, peak, done = rss_bytes(pid), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_bytes(pid))
            time.sleep(0.02)

    def post(_: int) -> str:
        try:
            return str(httpx.post(f"{url}/v2/models/{MODEL}/infer", content=large_body(limit, images),
                                  timeout=600).status_code)
        except httpx.TransportError as e:
            return type(e).__name__

    watcher = threading.Thread(target=sample)
    watcher.start()
    start = time.perf_counter()
    with ThreadPoolExecutor(clients_n) as pool:
        answers = list(pool.map(post, range(clients_n)))
    done.set()
    watcher.join()
    return {"clients": clients_n, "body_bytes": limit - 4096, "answers": {a: answers.count(a) for a in set(answers)},
            "rss_idle_mb": round(before / 2**20, 1), "rss_peak_growth_mb": round((peak[0] - before) / 2**20, 1),
            "max_inflight_mb": ServeConfig.max_inflight_bytes / 2**20, "wall_s": round(time.perf_counter() - start, 1),
            "unbounded_would_hold_mb": round(clients_n * (limit - 4096) / 2**20, 1)}


def main(spec: ServiceSpec = ServiceSpec(), requests: int = 100, flood_clients: int = 16,
         work: Path = Path("benchmarks/results/work/protocols"),
         out: Path = Path("benchmarks/results/protocol_latency.json")) -> dict:
    """Time one image over each protocol against the backbone's forward; flood the server with large bodies.

    Args:
        spec: Stream, model and MePo bundle of the service under test.
        requests: Timed requests per protocol (the learner idle).
        flood_clients: Clients sending a body at the per-request limit at once (0: skip).
        work: Broker and service logs and the service's checkpoint.
        out: JSON result path.
    """
    jpeg = sample_jpeg(spec)
    image = decode_image(jpeg, spec.limits)[None]  # [1, 3, S, S] uint8, as the service decodes it
    floor_call = backbone_forward(spec, len(list_files(spec.data, "train").classes))
    floor = quantiles([floor_call(image) for _ in range(requests + 5)][5:])
    grpc_port = free_port()
    spec = replace(spec, extra=(*spec.extra, "--protocol.eval_period", "0", "--grpc_port", str(grpc_port)))
    with running_service(spec, work) as service:
        service.wait_learned(service.stream_length)
        times = take_turns(clients(service.url, grpc_port, jpeg), requests)
        limit = body_limit(ServeConfig(), Headers({"content-type": "application/json"}))
        flooded = flood(service.url, service.process.pid, flood_clients, limit, ServeConfig.max_files) \
            if flood_clients else None
    result = {"benchmark": "protocol_latency", "spec": spec.as_json(), "backbone_forward_idle": floor}
    for name, seconds in times.items():
        q = quantiles(seconds)
        result[name] = {**q, "ratio_p50_backbone": q["p50_s"] / floor["p50_s"]}
    result["flood"] = flooded
    return write_result(result, out, *spec.placement())


def table_rows(r: dict) -> list[Row]:
    """The table's rows: each protocol against the backbone's own forward, and the flood's memory (if run)."""
    floor = fmt(r["backbone_forward_idle"]["p50_s"], "ms")
    names = {"v1": "/v1/predict (the image as the body)", "oip_http_binary": "OIP over HTTP, binary tensor data",
             "oip_http_json": "OIP over HTTP, JSON and base64", "oip_grpc": "OIP over gRPC (raw_input_contents)"}
    rows: list[Row] = [(f"Predict latency p50, one image, learner idle, {what} (bare: the backbone's own forward)",
                        fmt(r[name]["p50_s"], "ms"), floor, r[name]["ratio_p50_backbone"], "–", None)
                       for name, what in names.items()]
    if f := r["flood"]:  # null with --flood_clients 0
        answers = ", ".join(f"{n} × {a}" for a, n in sorted(f["answers"].items()))
        rows.append((f"Server memory, {f['clients']} bodies of {f['body_bytes'] / 2**20:.0f} MB at once "
                     f"(answers: {answers}; bare: what they take unbounded)", f"+{f['rss_peak_growth_mb']:.0f} MB",
                     f"{f['unbounded_would_hold_mb']:.0f} MB", f["rss_peak_growth_mb"] / f["unbounded_would_hold_mb"],
                     "bounded", None))
    return rows


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
