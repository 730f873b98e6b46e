"""When each label of a replayed stream comes (``mepo produce --replay.label_delay``), shared by the producer that
sends them and ``mepo demo``, which counts the labels that will come to know when the stream is learned.

A label comes ``delay`` records after its image (fixed, or drawn uniformly up to ``delay_max``), or never (a share
``loss`` of them). The draws follow the stream's seed, so a replay sends the same labels at the same places.

Example:
    >>> label_schedule(5, delay=2, delay_max=None, loss=0.0, seed=1)
    [2, 3, 4, 5, 6]
    >>> sum(due is None for due in label_schedule(1000, 50, 200, loss=0.3, seed=1))  # about 30 % never come
    295
"""

from __future__ import annotations

import torch

from mepo_stream.errors import ConfigError


def label_schedule(n: int, delay: int, delay_max: int | None, loss: float, seed: int) -> list[int | None]:
    """For each of ``n`` images in stream order, the stream position after which its label is sent (None: never);
    positions past the stream's end mean "after the last image"."""
    if delay < 0 or (delay_max is not None and delay_max < delay):
        raise ConfigError(f"--replay.label_delay {delay} and --replay.label_delay_max {delay_max}: need "
                          f"0 <= label_delay <= label_delay_max")
    if not 0.0 <= loss < 1.0:
        raise ConfigError(f"--replay.label_loss {loss} is not a share in [0, 1)")
    g = torch.Generator().manual_seed(seed)
    delays = torch.randint(delay, (delay_max or delay) + 1, (n,), generator=g)  # [n]
    lost = torch.rand(n, generator=g) < loss  # [n]
    return [None if gone else position + int(d) for position, (d, gone) in enumerate(zip(delays, lost, strict=True))]
