"""The Kafka client cost experiment keeps running on the real broker and measures every client installed."""

import importlib.util
import json
import math

import pytest

from benchmarks.experiments.kafka_client_cost import main


@pytest.mark.slow
def test_each_installed_client_reads_the_whole_topic_and_the_model_runs_beside_its_intake(tmp_path):
    result = main(records=200, model_batches=2, out=tmp_path / "cost.json")
    assert json.loads((tmp_path / "cost.json").read_text())["benchmark"] == "kafka_client_cost"
    clients = {"kafka-python"} | ({"confluent-kafka"} if importlib.util.find_spec("confluent_kafka") else set())
    assert clients <= set(result) and len(result["model_alone_samples_per_s"]) == 2
    for name in clients:
        cost = result[name]
        assert set(cost) == {"consume_us_per_record", "intake_records_per_s", "model_beside_samples_per_s",
                             "intake_beside_records_per_s", "model_kept"}
        assert all(math.isfinite(v) and v > 0 for v in cost.values())
