"""Records written for HTTP clients: uploads that a later label may teach (``POST /v1/predict?id=…``), and labels
and deletions from the admin routes, on the topics a labelling tool would write them to.

An upload with an id is written to the image topic without a label, with the top-1 label it was answered, which its
label later scores; the answer waits for the broker's acknowledgement, so an answered upload is never lost (else 503).
"""

from __future__ import annotations

import threading

from kafka import KafkaProducer
from kafka.producer.future import RecordMetadata

from mepo_stream.kafka import KafkaConfig, open_producer
from mepo_stream.records import label_headers, upload_headers


class LabelsOff(RuntimeError):
    """An upload with an id, where labels do not come later: answered 409."""


class UploadForwarder:
    """Writes uploads and labels; its producer opens on the first one (learners and replicas alike)."""

    timeout_s = 10.0

    def __init__(self, kafka: KafkaConfig):
        self.kafka = kafka
        self._producer: KafkaProducer | None = None
        self._lock = threading.Lock()

    def send(self, id: str, image: bytes, content_type: str, prediction: int | None) -> None:
        """Write one upload and wait for the broker to have it (a ``KafkaError`` when it cannot)."""
        if self.kafka.labels_topic is None:
            raise LabelsOff("an upload with an id waits for a label on the labels topic: start the learner with "
                            "--kafka.labels_topic")
        headers = upload_headers(id, prediction, content_type)
        self._producer_now().send(self.kafka.topic, value=image, key=id.encode(), headers=headers).get(self.timeout_s)

    def send_label(self, id: str, label: int | None, inline: bool = False) -> RecordMetadata:
        """Write a label for ``id`` (None: a tombstone) to the labels topic, or with ``inline`` to the image topic;
        returns where the broker put it."""
        topic = self.kafka.labels_topic or (self.kafka.topic if inline else None)
        if topic is None:
            raise LabelsOff("labels and deletions by id go to the labels topic (--kafka.labels_topic), or, with "
                            "--corrections.enabled, to the image topic")
        value, headers = (None, []) if label is None else (b"", label_headers(id, label))
        return self._producer_now().send(topic, value=value, key=id.encode(), headers=headers).get(self.timeout_s)

    def _producer_now(self) -> KafkaProducer:
        with self._lock:
            if self._producer is None:
                self._producer = open_producer(self.kafka, max_request_size=4 * 1024 * 1024)
            return self._producer

    def close(self) -> None:
        if self._producer is not None:
            self._producer.close()
