"""The reference-equivalence harness by concern; ``benchmarks.experiments.reference_equivalence`` runs it."""
