import random

import pytest
from river import metrics, utils

from server.config import MonitorConfig
from server.learner.monitor import StreamMonitor


def outcomes(n: int, error_rate: float, seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    y = [rng.randrange(5) for _ in range(n)]
    return y, [t if rng.random() >= error_rate else (t + 1) % 5 for t in y]


def test_matches_rivers_own_metrics():
    y, p = outcomes(500, 0.3, 1)
    monitor = StreamMonitor(MonitorConfig(rolling_window=50))
    for i in range(0, 500, 32):
        monitor.update(y[i:i + 32], p[i:i + 32], samples_seen=i + 32)
    acc, rolling = metrics.Accuracy(), utils.Rolling(metrics.Accuracy, window_size=50)
    for t, q in zip(y, p, strict=True):
        acc.update(t, q)
        rolling.update(t, q)
    assert monitor.cumulative == pytest.approx(acc.get()) and monitor.rolling == pytest.approx(rolling.get())


def test_drift_is_detected_when_the_error_rate_jumps():
    monitor = StreamMonitor()
    y, p = outcomes(1500, 0.1, 2)
    assert monitor.update(y, p, samples_seen=1500) == []
    y, p = outcomes(1500, 0.6, 3)
    events = monitor.update(y, p, samples_seen=3000)
    assert events and events[0]["detector"] == "ADWIN" and monitor.events == events


def test_state_round_trip_restores_the_metrics():
    y, p = outcomes(3000, 0.2, 4)
    monitor = StreamMonitor(MonitorConfig(rolling_window=100))
    monitor.update(y, p, samples_seen=3000)
    restored = StreamMonitor(MonitorConfig(rolling_window=100))
    restored.load_state_dict(monitor.state_dict())
    assert restored.cumulative == pytest.approx(monitor.cumulative)
    assert restored.rolling == pytest.approx(monitor.rolling)
    assert restored.events == monitor.events and restored.total == 3000


def test_unknown_detector():
    with pytest.raises(ValueError, match="drift detector"):
        StreamMonitor(MonitorConfig(detector="nope"))


def test_the_replay_state_keeps_only_the_latest_outcomes(monkeypatch):
    monkeypatch.setattr("server.learner.monitor.MAX_REPLAY", 100)
    monitor = StreamMonitor(MonitorConfig(rolling_window=10, detector="PageHinkley"))
    y, p = outcomes(1000, 0.2, 5)
    monitor.update(y, p, samples_seen=1000)
    state = monitor.state_dict()
    correct = [int(t == q) for t, q in zip(y, p, strict=True)]
    assert state["recent"].tolist() == correct[-10:]
    assert state["errors"].tolist() == [1 - c for c in correct[-100:]]
