"""Prequential (test-then-train) accuracy and drift detection on the live stream, with river.

Each mini-batch is predicted *before* the learner trains on it; **not** the paper's A_AUC (``mepo_stream.anytime``).
Checkpoints hold plain tensors and lists, never pickled river objects, replayed into fresh ones on restore.

Example:
    >>> monitor = StreamMonitor(MonitorConfig(rolling_window=2))
    >>> monitor.update([1, 2, 3], [1, 2, 0], samples_seen=3)
    []
    >>> round(monitor.cumulative, 3), monitor.rolling
    (0.667, 0.5)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from river import drift, metrics, utils

from mepo_stream.errors import ConfigError
from server.config import MonitorConfig

MAX_REPLAY = 20_000  # most errors replayed into a restored detector
DETECTORS: dict[str, Callable[[], Any]] = {"ADWIN": drift.ADWIN, "PageHinkley": drift.PageHinkley, "KSWIN": drift.KSWIN}


class StreamMonitor:
    def __init__(self, cfg: MonitorConfig = MonitorConfig()):
        if cfg.detector not in DETECTORS:
            raise ConfigError(f"unknown drift detector {cfg.detector!r}; use one of {sorted(DETECTORS)}")
        self.cfg = cfg
        self._fresh()

    def _fresh(self) -> None:
        cfg = self.cfg
        self.accuracy = metrics.Accuracy()
        self.rolling_accuracy = utils.Rolling(metrics.Accuracy, window_size=cfg.rolling_window)
        self.detector = DETECTORS[cfg.detector]()
        self.correct, self.total = 0, 0
        # deques, not lists re-sliced per sample: the update stays O(1) however long the stream
        self.recent: deque[int] = deque(maxlen=cfg.rolling_window)  # last rolling_window outcomes, 1 = correct
        self.errors: deque[int] = deque(maxlen=MAX_REPLAY)  # errors since the last detection (the detector's window)
        self.events: list[dict] = []

    @property
    def cumulative(self) -> float:
        return self.accuracy.get()

    @property
    def rolling(self) -> float:
        return self.rolling_accuracy.get()  # type: ignore[operator]  # river types Rolling.get as an object

    def _observe(self, correct: int) -> bool:
        self.accuracy.update(1, correct)
        self.rolling_accuracy.update(1, correct)
        self.detector.update(1 - correct)
        self.correct, self.total = self.correct + correct, self.total + 1
        self.recent.append(correct)
        self.errors.append(1 - correct)
        detected = self.detector.drift_detected
        if detected:  # the detector dropped its old data: keep what it still holds (ADWIN: its width)
            keep = int(getattr(self.detector, "width", 0))
            while len(self.errors) > keep:
                self.errors.popleft()
        return detected

    def update(self, y_true: list[int], y_pred: list[int], samples_seen: int) -> list[dict]:
        """Record predictions made before learning; returns the drift events this batch raised."""
        new = []
        for t, p in zip(y_true, y_pred, strict=True):
            if self._observe(int(t == p)):
                new.append({"samples_seen": samples_seen, "detector": self.cfg.detector,
                            "rolling_accuracy": self.rolling})
        self.events = (self.events + new)[-self.cfg.max_events :]
        return new

    def state_dict(self) -> dict:
        return {"correct": self.correct, "total": self.total,
                "recent": torch.tensor(list(self.recent), dtype=torch.int8),
                "errors": torch.tensor(list(self.errors), dtype=torch.int8), "events": self.events}

    def load_state_dict(self, state: dict) -> None:
        self._fresh()
        correct, total = int(state["correct"]), int(state["total"])
        if correct:  # the cumulative accuracy with the same counts, as two weighted updates
            self.accuracy.update(1, 1, w=correct)
        if total - correct:
            self.accuracy.update(1, 0, w=total - correct)
        self.recent.extend(state["recent"].tolist())
        for c in self.recent:
            self.rolling_accuracy.update(1, c)
        self.errors.extend(state["errors"].tolist())
        for e in self.errors:
            self.detector.update(e)
        self.correct, self.total, self.events = correct, total, list(state["events"])
