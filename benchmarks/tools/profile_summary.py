"""Summarise a py-spy profile of the service: each function's share of the learner loop's samples.

    py-spy record --rate 50 --format raw -o runs/profile.txt -- \
        .venv/bin/python -m mepo_stream.cli demo --until_done true --data.train_per_class 100
    .venv/bin/python -m benchmarks.tools.profile_summary runs/profile.txt

Only the learner's stacks count: its loop's thread (``LearnerLoop._consume``: Kafka, claims, bookkeeping) and the
model thread's work for it (``LearnerState``'s steps, snapshots and evaluations, ``server.model_thread``); the HTTP
server, the broker client's threads and start-up are left out. Shares are inclusive (a function's own time and its
callees').
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

LOOP = "_consume (server/learner/stream.py"
MODEL = ("_worker (concurrent/futures/thread.py", "(server/learner/state.py")
OURS = re.compile(r"\((server|mepo_stream)/")


def shares(raw: str) -> tuple[int, list[tuple[str, float]]]:
    """Samples in the learner loop, and (function, inclusive share) for the project's functions, largest first."""
    inclusive, total = Counter(), 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if LOOP not in stack and not all(frame in stack for frame in MODEL):
            continue
        total += int(count)
        for frame in {re.sub(r":\d+\)$", ")", f) for f in stack.split(";")}:
            inclusive[frame] += int(count)
    return total, [(f, n / total) for f, n in inclusive.most_common() if OURS.search(f)]


def main(path: str) -> None:
    total, rows = shares(Path(path).read_text())
    print(f"{total} samples in the learner loop")
    for frame, share in rows:
        if share >= 0.003:
            print(f"{100 * share:5.1f} %  {frame}")


if __name__ == "__main__":
    main(sys.argv[1])
