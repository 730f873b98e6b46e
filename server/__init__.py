"""The streaming service: a Kafka learner and a FastAPI prediction API in one process (``mepo serve``)."""
