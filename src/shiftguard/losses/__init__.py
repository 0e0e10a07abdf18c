"""Training objectives for embedding models, all called as ``loss(embeddings, labels) -> scalar``.

==================  ==========================================================  =========================
name (build_loss)   class                                                       source
==================  ==========================================================  =========================
watershed           :class:`WatershedLoss`                                      000, appendix D, eq. (11)
dr                  :class:`DRLoss` (prototypes; ``mode="proxies"`` too)        001, Paper II, eq. (5)
proxydr             :class:`ProxyDRLoss` (``dynamic=True`` for adaptive scale)   001, Paper III, eq. (8)
recall_at_k         :class:`RecallAtKSurrogate` (``simix=True`` for SiMix)      002, ch. 5, eq. (5.5)-(5.10)
smooth_ap           :class:`SmoothAPLoss`                                       Brown et al. 2020 (002 baseline)
mcinfonce           :class:`MCInfoNCELoss`                                      003, appendix B, eq. (7)
nivmf_proxy         :class:`NivMFProxyLoss` (EL-nivMF)                          003, appendix A, eq. (4)-(6)
hib / elk           :class:`HIBLoss` / :class:`ELKLoss`                         003, appendix B, eq. (54)/(55)
cross_entropy, triplet, proxy_nca, proxy_nca_pp, proxy_anchor, normface, supcon   pytorch-metric-learning wrappers
==================  ==========================================================  =========================

Losses with learnable parameters (proxies, rho, temperatures, a classifier) own them: pass
``loss.parameters()`` to the optimiser alongside the model's.  See ``docs/losses.md``.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from shiftguard.losses.base import EmbeddingLoss
from shiftguard.losses.distance_ratio import DRLoss, ProxyDRLoss, dr_log_probs, sd_softmax_log_probs
from shiftguard.losses.pml import PML_LOSSES, CrossEntropyLoss, PMLLoss, make_pml_loss
from shiftguard.losses.probabilistic import ELKLoss, HIBLoss, MCInfoNCELoss, NivMFProxyLoss
from shiftguard.losses.recall_at_k import RecallAtKSurrogate
from shiftguard.losses.smooth_ap import SmoothAPLoss
from shiftguard.losses.watershed import WatershedLoss

__all__ = [
    "EmbeddingLoss", "WatershedLoss", "DRLoss", "ProxyDRLoss", "RecallAtKSurrogate", "SmoothAPLoss",
    "MCInfoNCELoss", "HIBLoss", "ELKLoss", "NivMFProxyLoss", "PMLLoss", "CrossEntropyLoss", "dr_log_probs", "sd_softmax_log_probs", "build_loss", "LOSS_NAMES",
]

_CUSTOM = ("watershed", "dr", "proxydr", "recall_at_k", "smooth_ap")


def _build_custom(name, embedding_dim, num_classes, kw):
    if name == "watershed":
        return WatershedLoss(**kw)
    if name == "dr":
        if kw.get("mode") == "proxies":
            return DRLoss(num_classes=num_classes, embedding_dim=embedding_dim, **kw)
        return DRLoss(**kw)
    if name == "proxydr":
        if embedding_dim is None or num_classes is None:
            raise ValueError("embedding_dim and num_classes: both are required for loss 'proxydr'")
        return ProxyDRLoss(num_classes, embedding_dim, **kw)
    if name == "recall_at_k":
        return RecallAtKSurrogate(**kw)
    if name == "smooth_ap":
        return SmoothAPLoss(**kw)
    raise AssertionError(name)


def build_loss(name: str, embedding_dim: Optional[int] = None, num_classes: Optional[int] = None, **kw) -> nn.Module:
    """Build a loss by name (see :data:`LOSS_NAMES`); extra keywords go to its constructor.

    ``embedding_dim`` and ``num_classes`` are required by losses that own per-class parameters
    (proxies or a classifier): ``proxydr``, ``nivmf_proxy``, ``cross_entropy``, ``proxy_nca``,
    ``proxy_anchor``, ``normface`` and ``dr`` with ``mode="proxies"``; other losses ignore them.
    """
    if not isinstance(name, str):
        raise TypeError(f"name: expected a str, got {type(name).__name__}")
    key = name.lower().replace("-", "_").replace("@", "_at_")
    if key in _CUSTOM:
        return _build_custom(key, embedding_dim, num_classes, kw)
    if key in _PROBABILISTIC:
        return _build_probabilistic(key, embedding_dim, num_classes, kw)
    if key in PML_LOSSES:
        return make_pml_loss(key, embedding_dim, num_classes, **kw)
    raise ValueError(f"name: unknown loss {name!r}; valid names: {', '.join(LOSS_NAMES)}")


_PROBABILISTIC = ("mcinfonce", "hib", "elk", "nivmf_proxy")


def _build_probabilistic(name, embedding_dim, num_classes, kw):
    if name == "mcinfonce":
        return MCInfoNCELoss(**kw)
    if name == "hib":
        return HIBLoss(**kw)
    if name == "elk":
        return ELKLoss(**kw)
    if embedding_dim is None or num_classes is None:
        raise ValueError("embedding_dim and num_classes: both are required for loss 'nivmf_proxy'")
    return NivMFProxyLoss(num_classes, embedding_dim, **kw)


LOSS_NAMES = tuple(sorted(_CUSTOM + _PROBABILISTIC + PML_LOSSES))
