"""Kafka producers that replay datasets as labelled image streams (``mepo produce``)."""
