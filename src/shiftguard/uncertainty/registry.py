"""The uncertainty estimators by name: what ``[[models]] estimator = "..."`` of a run config builds.

==================  ==========================  =====================================
name                class                       source
==================  ==========================  =====================================
ensemble            :class:`DeepEnsemble`       [Kirchhof, URL App. B.10]
mc_dropout          :class:`MCDropout`          [Kirchhof, URL App. B.11]
sngp                :class:`SNGP`               [Kirchhof, URL App. B.8]
hetxl               :class:`HETXL`              [Kirchhof, URL App. B.7]
loss_prediction     :class:`LossPredictionL2`   [Kirchhof, URL App. B.9, eq. 8]
==================  ==========================  =====================================

Every entry is called as ``constructor(backbone, **kwargs)`` and returns an
:class:`~shiftguard.uncertainty.estimator.UncertaintyEstimator`, trained with
``Trainer(model, loss="model")``.

Examples:
    >>> from shiftguard.models import build_model
    >>> from shiftguard.uncertainty import build_estimator
    >>> model = build_estimator("MC-dropout", build_model("mlp", hidden=(16,)), rate=0.2, num_samples=4)
    >>> type(model).__name__, model.default_uncertainty
    ('MCDropout', 'entropy')
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from shiftguard.registry import Registry
from shiftguard.uncertainty.ensemble import DeepEnsemble
from shiftguard.uncertainty.estimator import UncertaintyEstimator
from shiftguard.uncertainty.hetxl import HETXL
from shiftguard.uncertainty.loss_prediction import LossPredictionL2
from shiftguard.uncertainty.mc_dropout import MCDropout
from shiftguard.uncertainty.sngp import SNGP

__all__ = ["ESTIMATOR_REGISTRY", "ESTIMATOR_NAMES", "build_estimator"]

#: ``name -> constructor(backbone, **kwargs)``; names match ignoring case, ``-`` and ``_``.
ESTIMATOR_REGISTRY: Registry[Callable[..., UncertaintyEstimator]] = Registry("estimator", argument="estimator")
ESTIMATOR_REGISTRY.register("ensemble", DeepEnsemble, aliases=("deep_ensemble",))
ESTIMATOR_REGISTRY.register("mc_dropout", MCDropout)
ESTIMATOR_REGISTRY.register("sngp", SNGP)
ESTIMATOR_REGISTRY.register("hetxl", HETXL)
ESTIMATOR_REGISTRY.register("loss_prediction", LossPredictionL2, aliases=("losspred",))

#: Every name :func:`build_estimator` accepts, sorted.
ESTIMATOR_NAMES = tuple(ESTIMATOR_REGISTRY.names())


def build_estimator(name: str, backbone: nn.Module, **kwargs) -> UncertaintyEstimator:
    """Wrap ``backbone`` in the estimator ``name`` (see :data:`ESTIMATOR_NAMES`); ``kwargs`` go to
    its constructor.

    Raises:
        ValueError: an unknown ``name`` (the message lists :data:`ESTIMATOR_NAMES` and suggests the
            closest); a keyword the constructor does not take (named, with the estimator).
        TypeError / ValueError: invalid values, raised by the constructor naming the argument.
    """
    constructor = ESTIMATOR_REGISTRY.get(name)
    try:
        return constructor(backbone, **kwargs)
    except TypeError as exc:
        if "unexpected keyword argument" in str(exc):
            raise ValueError(f"estimator {ESTIMATOR_REGISTRY.canonical(name)!r}: {exc}") from None
        raise
