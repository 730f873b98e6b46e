"""The reference-equivalence harness by concern; ``benchmarks.reference_equivalence`` runs it."""
