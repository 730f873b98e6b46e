"""``--consumer librdkafka``: where it is refused, and the settings librdkafka gets in its own names (what it does
against the real broker is the consumer contract's, ``tests/test_consumer_contract.py``)."""

import pytest

from mepo_stream.errors import ConfigError
from mepo_stream.kafka import KafkaConfig
from server.learner.consumer import TIMING
from server.learner.librdkafka import check_available, librdkafka_settings


def test_without_confluent_kafka_the_refusal_names_the_extra(monkeypatch):
    check_available()  # installed here (the test extra)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"mepo-stream\[librdkafka\]"):
        check_available()


def test_settings_carry_the_group_the_security_and_never_commit_on_their_own():
    kafka = KafkaConfig(bootstrap_servers="k1:9092,k2:9092", group_id="g", security_protocol="SASL_SSL",
                        sasl_mechanism="SCRAM-SHA-512", sasl_plain_username="learner", sasl_plain_password="pw",
                        ssl_cafile="/ca.pem")
    settings = librdkafka_settings(kafka, **TIMING)
    assert settings["bootstrap.servers"] == "k1:9092,k2:9092" and settings["group.id"] == "g"
    assert (settings["security.protocol"], settings["sasl.mechanism"], settings["sasl.username"],
            settings["sasl.password"], settings["ssl.ca.location"]) == ("SASL_SSL", "SCRAM-SHA-512", "learner", "pw",
                                                                       "/ca.pem")
    assert settings["enable.auto.commit"] is False and settings["auto.offset.reset"] == "earliest"
    assert "ssl.key.location" not in settings  # an unset field is left to librdkafka's default


def test_librdkafka_takes_those_settings():
    """librdkafka refuses a setting it does not know, or a value of the wrong type, when the consumer is made."""
    from server.learner.librdkafka import LibrdkafkaConsumer

    LibrdkafkaConsumer(KafkaConfig(bootstrap_servers="127.0.0.1:1"), **TIMING).close(timeout_s=5)
