"""The learner role: the Kafka loop, the stream book, the model state and its checkpoints, the publisher."""
