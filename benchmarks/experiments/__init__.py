"""Experiments outside the performance table: accuracy studies and equivalence with the reference code, run by hand
(their results in ``benchmarks/results/`` and the docs they write or are cited in)."""
