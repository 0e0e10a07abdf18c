"""Training objectives for embedding models, all called as ``loss(embeddings, labels) -> scalar``.

==================  ==========================================================  =========================
name (build_loss)   class                                                       source
==================  ==========================================================  =========================
watershed           :class:`WatershedLoss`                                      [QACT, App. D, eq. (11)]
dr                  :class:`DRLoss` (prototypes; ``mode="proxies"`` too)        [Kim, Art. II, eq. (5)]
proxydr             :class:`ProxyDRLoss` (``dynamic=True`` for adaptive scale)   [Kim, Art. IV, eq. (8)]
recall_at_k         :class:`RecallAtKSurrogate` (``simix=True`` for SiMix)      [Patel, Ch. 5, eq. (5.5)-(5.10)]
smooth_ap           :class:`SmoothAPLoss`                                       Brown et al. 2020 ([Patel] baseline)
mcinfonce           :class:`MCInfoNCELoss`                                      [Kirchhof, App. B, eq. (7)]
nivmf_proxy         :class:`NivMFProxyLoss` (EL-nivMF)                          [Kirchhof, App. A, eq. (4)-(6)]
hib / elk           :class:`HIBLoss` / :class:`ELKLoss`                         [Kirchhof, App. B, eq. (54)/(55)]
spce                :class:`SPCELoss` (``fit`` + ``predict_proba``, eq. (6.8))   [Patel, Ch. 6, eq. (6.7)]
tightness           :class:`TightnessLoss` (``base=`` representation loss)       [Patel, Ch. 6, eq. (6.9)-(6.11)]
esupcon             :class:`ESupConLoss` (prototypes, ``predict_proba``)         [Patel, Ch. 6, eq. (6.12)-(6.15)]
infonce             :class:`InfoNCELoss` (NT-Xent on instance ids)               [Kirchhof, URL App. B.2]
corr                :class:`CORRLoss` (fixed proxies from a ``hierarchy=``)       [Kim, Art. IV, eq. (11)]
normalized_softmax  :class:`NormFaceLoss` (``dynamic``/AdaCos, ``ema_alpha``)    [Kim, Art. IV, eq. (5), (9)-(10)]
cross_entropy, triplet, proxy_nca, proxy_nca_pp, proxy_anchor, normface, supcon   pytorch-metric-learning wrappers
==================  ==========================================================  =========================

Losses with learnable parameters (proxies, rho, temperatures, a classifier) own them: pass
``loss.parameters()`` to the optimiser alongside the model's.  See ``docs/losses.md``.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

from torch import nn

from shiftguard._deprecation import positional_dims
from shiftguard.losses.base import EmbeddingLoss
from shiftguard.losses.contrastive import (
    ESupConLoss,
    ESupConTerms,
    MomentumMeanClassifier,
    SPCELoss,
    TightnessLoss,
)
from shiftguard.losses.distance_ratio import DRLoss, ProxyDRLoss, dr_log_probs, sd_softmax_log_probs
from shiftguard.losses.hierarchy import CORRLoss, EMAProxies, NormFaceLoss, hierarchy_proxies
from shiftguard.losses.infonce import InfoNCELoss
from shiftguard.losses.pml import PML_LOSSES, CrossEntropyLoss, PMLLoss, make_pml_loss
from shiftguard.losses.probabilistic import ELKLoss, HIBLoss, MCInfoNCELoss, NivMFProxyLoss
from shiftguard.losses.recall_at_k import RecallAtKSurrogate
from shiftguard.losses.smooth_ap import SmoothAPLoss
from shiftguard.losses.watershed import WatershedLoss
from shiftguard.registry import Registry

__all__ = [
    "EmbeddingLoss",
    "WatershedLoss",
    "DRLoss",
    "ProxyDRLoss",
    "RecallAtKSurrogate",
    "SmoothAPLoss",
    "MCInfoNCELoss",
    "HIBLoss",
    "ELKLoss",
    "NivMFProxyLoss",
    "PMLLoss",
    "CrossEntropyLoss",
    "dr_log_probs",
    "sd_softmax_log_probs",
    "build_loss",
    "LOSS_NAMES",
    "LOSS_REGISTRY",
    "SPCELoss",
    "TightnessLoss",
    "MomentumMeanClassifier",
    "ESupConLoss",
    "ESupConTerms",
    "InfoNCELoss",
    "CORRLoss",
    "NormFaceLoss",
    "EMAProxies",
    "hierarchy_proxies",
]

#: The losses :func:`build_loss` builds by name: ``name -> builder(*, num_classes, embedding_dim, **kw)``.
#: Names are matched ignoring case, ``-`` and ``_``; ``recall@k`` is an alias of ``recall_at_k``.
LOSS_REGISTRY: Registry[Callable[..., nn.Module]] = Registry("loss", argument="name")


def _need_dims(name: str, num_classes, embedding_dim) -> None:
    if num_classes is None or embedding_dim is None:
        raise ValueError(f"num_classes and embedding_dim: both are required for loss {name!r}")


def _dr(*, num_classes, embedding_dim, **kw):
    if kw.get("mode") == "proxies":
        return DRLoss(num_classes=num_classes, embedding_dim=embedding_dim, **kw)
    return DRLoss(**kw)


def _proxydr(*, num_classes, embedding_dim, **kw):
    _need_dims("proxydr", num_classes, embedding_dim)
    return ProxyDRLoss(num_classes, embedding_dim, **kw)


def _nivmf_proxy(*, num_classes, embedding_dim, **kw):
    _need_dims("nivmf_proxy", num_classes, embedding_dim)
    return NivMFProxyLoss(num_classes, embedding_dim, **kw)


def _spce(*, num_classes, embedding_dim, **kw):
    _need_dims("spce", num_classes, embedding_dim)
    return SPCELoss(num_classes, embedding_dim, **kw)


def _tightness(*, num_classes, embedding_dim, base=None, **kw):
    """``base`` may be a loss name: it is built with the same dimensions and ``validate_args`` and
    trained beside ``l_tt``."""
    _need_dims("tightness", num_classes, embedding_dim)
    if isinstance(base, str):
        base = build_loss(
            base, num_classes=num_classes, embedding_dim=embedding_dim, validate_args=kw.get("validate_args", True)
        )
    return TightnessLoss(num_classes, embedding_dim, base=base, **kw)


def _esupcon(*, num_classes, embedding_dim, **kw):
    _need_dims("esupcon", num_classes, embedding_dim)
    return ESupConLoss(num_classes, embedding_dim, **kw)


def _corr(*, num_classes, embedding_dim, **kw):
    """``hierarchy=`` places the proxies; without it, a flat hierarchy of ``num_classes`` classes."""
    if kw.get("hierarchy") is None:
        _need_dims("corr", num_classes, embedding_dim)
    return CORRLoss(num_classes=num_classes, embedding_dim=embedding_dim, **kw)


def _normalized_softmax(*, num_classes, embedding_dim, **kw):
    _need_dims("normalized_softmax", num_classes, embedding_dim)
    return NormFaceLoss(num_classes, embedding_dim, **kw)


def _without_dims(cls: type) -> Callable[..., nn.Module]:
    """A builder for a loss without per-class parameters: the dimensions are not passed on."""

    def build(*, num_classes, embedding_dim, **kw):
        return cls(**kw)

    return build


LOSS_REGISTRY.register("watershed", _without_dims(WatershedLoss))
LOSS_REGISTRY.register("dr", _dr)
LOSS_REGISTRY.register("proxydr", _proxydr)
LOSS_REGISTRY.register("recall_at_k", _without_dims(RecallAtKSurrogate), aliases=("recall@k",))
LOSS_REGISTRY.register("smooth_ap", _without_dims(SmoothAPLoss))
LOSS_REGISTRY.register("mcinfonce", _without_dims(MCInfoNCELoss))
LOSS_REGISTRY.register("hib", _without_dims(HIBLoss))
LOSS_REGISTRY.register("elk", _without_dims(ELKLoss))
LOSS_REGISTRY.register("nivmf_proxy", _nivmf_proxy)
LOSS_REGISTRY.register("spce", _spce)
LOSS_REGISTRY.register("tightness", _tightness)
LOSS_REGISTRY.register("esupcon", _esupcon)
LOSS_REGISTRY.register("infonce", _without_dims(InfoNCELoss))
LOSS_REGISTRY.register("corr", _corr)
LOSS_REGISTRY.register("normalized_softmax", _normalized_softmax)
for _name in PML_LOSSES:
    LOSS_REGISTRY.register(_name, functools.partial(make_pml_loss, _name))
del _name

#: Every name :func:`build_loss` accepts, sorted.
LOSS_NAMES = tuple(LOSS_REGISTRY.names())


def build_loss(
    name: str, *args: Optional[int], num_classes: Optional[int] = None, embedding_dim: Optional[int] = None, **kw
) -> nn.Module:
    """Build a loss by name (see :data:`LOSS_NAMES`); extra keywords go to its constructor.

    ``build_loss(name, *, num_classes=None, embedding_dim=None, **kw)``. ``name`` is matched ignoring
    case, ``-`` and ``_`` (``recall@k`` names ``recall_at_k``). ``num_classes`` and ``embedding_dim``
    are keyword-only (the order of every loss constructor, ``ProxyDRLoss(num_classes, embedding_dim)``)
    and required by losses that own per-class parameters (proxies or a classifier): ``proxydr``,
    ``nivmf_proxy``, ``spce``, ``tightness``, ``esupcon``, ``cross_entropy``, ``proxy_nca``,
    ``proxy_anchor``, ``normface`` and ``dr`` with ``mode="proxies"``; other losses ignore them.
    ``tightness`` takes ``base=<loss name>`` (built with the same dimensions). Every loss takes
    ``validate_args`` (default ``True``; ``False`` skips the per-call checks that read tensor values
    and so synchronise with the device: :class:`~shiftguard.losses.base.EmbeddingLoss`).

    The former positional form ``build_loss(name, embedding_dim, num_classes)`` still works for one
    release (read in that order) and emits a ``DeprecationWarning`` asking for the keywords.

    Raises:
        TypeError: ``name`` is not a str; more than two positional dimensions, or one given both by
            position and by keyword.
        ValueError: an unknown ``name`` (the message lists :data:`LOSS_NAMES` and suggests the
            closest); missing ``num_classes`` / ``embedding_dim`` where required; invalid
            constructor arguments (raised by the loss).
    """
    num_classes, embedding_dim = positional_dims(
        "build_loss(name, num_classes=..., embedding_dim=...)", args, num_classes, embedding_dim
    )
    return LOSS_REGISTRY.get(name)(num_classes=num_classes, embedding_dim=embedding_dim, **kw)
