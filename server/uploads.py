"""Records written for HTTP clients: uploads that a later label may teach (``POST /v1/predict?id=…``: the image
goes to the image topic), and labels and deletions from the admin routes (``POST /v1/labels/{id}``,
``DELETE /v1/samples/{id}``: a label or a tombstone on the labels topic, as a labelling tool would write them, or,
where labels come with their images, a correction or a tombstone on the image topic).

An upload with an id is answered at once, as any other, and then written to the image topic as an image without a
label (``mepo_stream.records.upload_headers``): the id, and the top-1 label the answer gave. The learner reads it as
it reads every image, keeps its feature until the label with that id comes on the labels topic, and scores the
answer that was given against it. Going through the topic, rather than into the learner's memory, gives the upload
the stream's guarantees: it survives a crash, and it is learned once. The answer waits for the broker's
acknowledgement, so an upload that was answered is never lost; when the broker is unreachable the answer is 503.
Learners and replicas alike forward their uploads.
"""

from __future__ import annotations

import threading

from kafka import KafkaProducer
from kafka.producer.future import RecordMetadata

from mepo_stream.kafka import KafkaConfig, open_producer
from mepo_stream.records import label_headers, upload_headers


class LabelsOff(RuntimeError):
    """An upload with an id, where labels do not come later (no --kafka.labels_topic): answered 409."""


class UploadForwarder:
    """Writes uploads with an id to the image topic; its producer opens on the first one."""

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
        """Write a label for ``id`` to the labels topic (None: a tombstone, which deletes the id) and wait for the
        broker to have it; where it landed. Without a labels topic, ``inline`` (corrections on, labels with their
        images) writes it to the image topic instead, keyed by the id: on its image's partition, where the image
        was keyed by its id too (``--replay.partition_by id``)."""
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
