"""HTTP routes: ``predict`` (v1), ``inference_v2`` (Open Inference Protocol), ``ops`` (health, status, admin)."""
