"""Host methods, found by name. Each is a small module subclassing ``ContinualMethod``; each method's
hyperparameters live in one config dataclass, grouped in ``MethodsConfig``.

Example:
    >>> sorted(METHODS)
    ['coda_p', 'deep_l2p', 'dualprompt', 'frozen', 'linear_probe', 'misa', 'mvp', 'seq_ft', 'seq_ft_sl']
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mepo_stream.methods.base import ContinualMethod, Readout
from mepo_stream.methods.coda import CodaConfig, CodaPrompt
from mepo_stream.methods.finetune import FineTuneConfig, LinearProbe, SequentialFineTune
from mepo_stream.methods.l2p import DeepL2P, L2PConfig
from mepo_stream.methods.misa import MISA, MISAConfig
from mepo_stream.methods.mvp import MVP, MVPConfig

__all__ = ["METHODS", "MISA", "CodaConfig", "CodaPrompt", "ContinualMethod", "DeepL2P", "FineTuneConfig",
           "L2PConfig", "MISAConfig", "MVP", "MVPConfig", "MethodsConfig", "Readout", "create_method"]


@dataclass(frozen=True)
class MethodsConfig:
    """Per-method hyperparameters (defaults: the paper's and the reference's values)."""

    misa: MISAConfig = MISAConfig()
    """MISA: DualPrompt-style prompt layout."""
    dualprompt: MISAConfig = MISAConfig(tuning="prefix", g_length=5, e_length=5)
    """DualPrompt with the paper's prefix tuning (length 5; g at blocks 0-1, e at blocks 2-4)."""
    deep_l2p: L2PConfig = L2PConfig()
    """Deep L2P: keyed prompt pool with prefix tuning."""
    coda_p: CodaConfig = CodaConfig()
    """CODA-P: attention-composed prompt components."""
    mvp: MVPConfig = MVPConfig()
    """MVP: instance-wise logit masking and contrastive key matching."""
    seq_ft: FineTuneConfig = FineTuneConfig(backbone_lr_scale=1.0)
    """Sequential fine-tuning of the whole model."""
    seq_ft_sl: FineTuneConfig = FineTuneConfig(backbone_lr_scale=0.01)
    """Sequential fine-tuning with a slow learner (SLCA's backbone/head learning-rate ratio)."""


# name -> (class, the MethodsConfig field holding its config, or None)
METHODS: dict[str, tuple[Callable[..., ContinualMethod], str | None]] = {
    "misa": (MISA, "misa"),
    "deep_l2p": (DeepL2P, "deep_l2p"),
    "coda_p": (CodaPrompt, "coda_p"),
    "mvp": (MVP, "mvp"),
    "dualprompt": (MISA, "dualprompt"),
    "linear_probe": (LinearProbe, None),
    "frozen": (LinearProbe, None),  # the frozen backbone's feature, for the statistics classifiers
    "seq_ft": (SequentialFineTune, "seq_ft"),
    "seq_ft_sl": (SequentialFineTune, "seq_ft_sl"),
}


def create_method(name: str, backbone, n_classes: int, alignment=None,
                  method_config: MethodsConfig = MethodsConfig(), readout: Readout = Readout()) -> ContinualMethod:
    """Instantiate the host method ``name`` around ``backbone`` with its config from ``method_config`` (the bare
    host of a unit test; a model to learn with comes from ``mepo_stream.model.create_model``)."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(sorted(METHODS))}")
    cls, field = METHODS[name]
    return cls(backbone, n_classes, alignment, None if field is None else getattr(method_config, field), readout)
