"""A measured run of the streaming service: learn a Si-Blurry stream from Kafka while clients predict.

Starts the embedded broker and ``mepo serve`` (a separate process, as users run it), replays a stream with
``mepo produce``, injects bad records, and while the learner trains sends single-image ``POST /v1/predict``
requests one after another. At the end it reads ``/v1/status`` and ``/metrics`` and writes a JSON report:
samples learned per second, A_AUC and A_last, predict latency p50/p99 while learning, dead-lettered records.

Usage:
    python -m benchmarks.experiments.serve_report --spec.train_per_class 50 --spec.img_size 84
"""

from __future__ import annotations

import io
import time
from dataclasses import replace
from pathlib import Path

from kafka import KafkaProducer
from PIL import Image

from benchmarks.rows.predict_latency import sample_jpeg
from benchmarks.tools.service import ServiceSpec, quantiles, running_service, write_result
from mepo_stream.kafka import KafkaConfig
from mepo_stream.records import record_headers


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


def _watch_while_learning(service, image: bytes, expected: int, n_bad: int, timeout: float) -> tuple:
    """Predict an image over and over while the stream is learned; returns the latencies, (time, samples) at the
    first learned sample, start and end times, and the final status."""
    latencies, first, start = [], None, time.monotonic()
    while time.monotonic() < start + timeout:
        status = service.status()
        if first is None and status["samples_seen"] > 0:
            first = (time.monotonic(), status["samples_seen"])
        done = status["samples_seen"] >= expected and status["dead_lettered"] >= n_bad
        if done and status["a_last"] is not None:
            break
        if status["classes_seen"]:
            t = time.perf_counter()
            r = service.http.post("/v1/predict", content=image, headers={"content-type": "image/jpeg"})
            if r.status_code == 503:  # the first snapshot with a class is not published yet
                continue
            assert r.status_code == 200, r.text
            latencies.append(time.perf_counter() - t)
        time.sleep(0.05)
    return latencies, first, start, time.monotonic(), service.status()


def main(spec: ServiceSpec = ServiceSpec(train_per_class=50), test_per_class: int = 20, bad_copies: int = 4,
         eval_period: int = 250, timeout: float = 1800, work: Path = Path("benchmarks/results/work/serve_report"),
         out: Path = Path("benchmarks/results/serve_report.json")) -> dict:
    """Run the service on a stream and write the report.

    Args:
        spec: Stream, model and MePo bundle of the service.
        test_per_class: Test images per class for the any-time accuracy.
        bad_copies: Copies of each of the 5 kinds of bad record to inject.
        eval_period: Any-time evaluation period in samples.
        timeout: Give up after this many seconds.
        work: Broker and service logs and the service's checkpoint.
        out: JSON report path.
    """
    spec = replace(spec, extra=(*spec.extra, "--data.test_per_class", str(test_per_class),
                                "--protocol.eval_period", str(eval_period)))
    with running_service(spec, work, produce_first=False) as service:
        expected = service.stream_length
        service.produce()
        n_bad = _bad_records(KafkaConfig(bootstrap_servers=service.bootstrap), bad_copies)
        watch = _watch_while_learning(service, sample_jpeg(spec), expected, n_bad, timeout)
        latencies, first, start, end, status = watch
        metrics = service.http.get("/metrics").text
    learned_after_first = status["samples_seen"] - (first[1] if first else 0)
    latency = quantiles(latencies)
    return write_result({
        "benchmark": "serve_report", "spec": spec.as_json(), "stream_samples": expected,
        "samples_learned": status["samples_seen"],
        "samples_per_s": round(learned_after_first / (end - first[0]), 3) if first else None,
        "a_auc": status["anytime_accuracy"]["a_auc"], "a_last": status["a_last"],
        "anytime_accuracy": status["anytime_accuracy"]["accuracy"],
        "prequential_accuracy": status["prequential_accuracy"]["cumulative"],
        "predict_requests_while_learning": len(latencies),
        "predict_latency_p50_s": round(latency["p50_s"], 4), "predict_latency_p99_s": round(latency["p99_s"], 4),
        "bad_records_injected": n_bad, "dead_lettered": status["dead_lettered"],
        "wall_time_s": round(end - start, 1),
        "metrics_lines": sum(1 for line in metrics.splitlines() if line.startswith("mepo_")),
    }, out, *spec.placement())


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
