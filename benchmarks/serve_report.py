"""A measured run of the streaming service: learn a Si-Blurry stream from Kafka while clients predict.

Starts the embedded broker and ``mepo serve`` (a separate process, as users run it), replays a stream with
``mepo produce``, injects bad records, and while the learner trains sends single-image ``POST /v1/predict``
requests one after another. At the end it reads ``/v1/status`` and ``/metrics`` and writes a JSON report:
samples learned per second, A_AUC and A_last, predict latency p50/p99 while learning, dead-lettered records.

Usage:
    python benchmarks/serve_report.py --train_per_class 50 --img_size 84
"""

from __future__ import annotations

import io
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from kafka import KafkaProducer
from PIL import Image

from mepo_stream.data import DataConfig, list_files
from mepo_stream.records import KafkaConfig, record_headers
from server.broker import EmbeddedBroker, free_port

BAD_KINDS = 5


def _bad_records(kafka: KafkaConfig, copies: int) -> int:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), "red").save(buf, format="JPEG")
    good, headers = buf.getvalue(), record_headers(0, 10**6, 0, "bad", "bench")
    cases = [(b"NOTANIMG" * 25, headers), (good[:50], headers), (good, [h for h in headers if h[0] != "label"]),
             (good, record_headers(10**4, 10**6, 0, "bad", "bench")), (b"", headers)]
    producer = KafkaProducer(**kafka.client_options(), acks="all")
    for _ in range(copies):
        for value, h in cases:
            producer.send(kafka.topic, value=value, key=b"bad", headers=h)
    producer.flush()
    producer.close()
    return copies * len(cases)


def main(dataset: str = "cifar10", train_per_class: int = 50, test_per_class: int = 20, img_size: int = 84,
         model: str = "vit_small_patch14_dinov2", weights: str | None = "dinov2", mepo: str | None = None,
         bad_copies: int = 4, eval_period: int = 250, timeout: float = 1800,
         out: Path = Path("benchmarks/results/serve_report.json")) -> dict:
    """Run the service on a stream and write the report.

    Args:
        dataset: Bundled dataset or ImageFolder root.
        train_per_class: Stream images per class.
        test_per_class: Test images per class for the any-time accuracy.
        img_size: Backbone resolution.
        model: timm ViT name.
        weights: Backbone weights (dinov2, a file, or null).
        mepo: Optional MePo bundle.
        bad_copies: Copies of each of the 5 kinds of bad record to inject.
        eval_period: Any-time evaluation period in samples.
        timeout: Give up after this many seconds.
        out: JSON report path.
    """
    data = DataConfig(dataset, train_per_class=train_per_class, test_per_class=test_per_class)
    expected = len(list_files(data, "train").files)
    work = out.parent / "serve_report_work"
    work.mkdir(parents=True, exist_ok=True)
    (work / "learner.pt").unlink(missing_ok=True)
    port = free_port()
    with EmbeddedBroker(log_path=work / "broker.log") as broker:
        kafka = KafkaConfig(bootstrap_servers=broker.bootstrap)
        cli = [sys.executable, "-m", "mepo_stream.cli"]
        serve = cli + ["serve", "--cfg.kafka.bootstrap_servers", broker.bootstrap, "--cfg.data.dataset", dataset,
                       "--cfg.data.test_per_class", str(test_per_class), "--cfg.backbone.name", model,
                       "--cfg.backbone.weights", str(weights) if weights else "null",
                       "--cfg.backbone.img_size", str(img_size), "--cfg.checkpoint_dir", str(work),
                       "--cfg.eval_period", str(eval_period), "--cfg.port", str(port)]
        serve += ["--cfg.mepo", mepo] if mepo else []
        server = subprocess.Popen(serve, stdout=open(work / "serve.log", "wb"), stderr=subprocess.STDOUT)
        http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    if http.get("/readyz").status_code in (200, 503):
                        break
                except httpx.TransportError:
                    time.sleep(0.5)
            subprocess.run(cli + ["produce", "--data.dataset", dataset, "--data.train_per_class", str(train_per_class),
                                  "--kafka.bootstrap_servers", broker.bootstrap], check=True, capture_output=True)
            n_bad = _bad_records(kafka, bad_copies)
            image = next(iter(list_files(data, "test").files)).read_bytes()
            latencies, first, start = [], None, time.monotonic()
            while time.monotonic() < deadline:
                status = http.get("/v1/status").json()
                if first is None and status["samples_seen"] > 0:
                    first = (time.monotonic(), status["samples_seen"])
                done = status["samples_seen"] >= expected and status["dead_lettered"] >= n_bad
                if done and status["a_last"] is not None:
                    break
                if status["classes_seen"]:
                    t = time.perf_counter()
                    r = http.post("/v1/predict", content=image, headers={"content-type": "image/jpeg"})
                    if r.status_code == 503:  # the first snapshot with a class is not published yet
                        continue
                    assert r.status_code == 200, r.text
                    latencies.append(time.perf_counter() - t)
                time.sleep(0.05)
            end = time.monotonic()
            status = http.get("/v1/status").json()
            metrics = http.get("/metrics").text
        finally:
            http.close()
            server.terminate()
            server.wait(120)
    q = statistics.quantiles(latencies, n=100) if len(latencies) >= 2 else [float("nan")] * 99
    learned_after_first = status["samples_seen"] - (first[1] if first else 0)
    report = {
        "benchmark": "serve_report", "dataset": dataset, "stream_samples": expected, "img_size": img_size,
        "model": model, "mepo": mepo,
        "samples_learned": status["samples_seen"],
        "samples_per_s": round(learned_after_first / (end - first[0]), 3) if first else None,
        "a_auc": status["anytime_accuracy"]["a_auc"], "a_last": status["a_last"],
        "anytime_accuracy": status["anytime_accuracy"]["accuracy"],
        "prequential_accuracy": status["prequential_accuracy"]["cumulative"],
        "predict_requests_while_learning": len(latencies),
        "predict_latency_p50_s": round(q[49], 4), "predict_latency_p99_s": round(q[98], 4),
        "bad_records_injected": n_bad, "dead_lettered": status["dead_lettered"],
        "wall_time_s": round(end - start, 1),
        "metrics_lines": sum(1 for line in metrics.splitlines() if line.startswith("mepo_")),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
