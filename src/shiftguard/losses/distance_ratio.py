"""Distance-ratio (DR) softmax losses: prototypical DR loss [Kim, Art. II] and ProxyDR [Kim, Art. IV].

Formulas (Kim, "On the Significance of Distance in Machine Learning" [Kim]; "Art." = the article of the thesis):

* SD softmax [Kim, Art. II, eq. (4)]:  p(c|x) = exp(-d_c^2) / sum_y exp(-d_y^2).
* DR formulation [Kim, Art. II, eq. (5); Art. IV, eq. (8)]:  p(c|x) = d_c^{-rho} / sum_y d_y^{-rho},
  i.e. a softmax over the logits ``-rho * ln(d_c)``.  rho > 0 is learnable and parametrised as
  ``rho = exp(log_rho)`` with initial ``log_rho = 2.0`` [Kim, Art. II, Sec. 3.1].
* The loss is the mean cross-entropy of the query points [Kim, Art. II, eq. (3)].

Numerics at d = 0: the thesis defines p(c|x) = 1 when d_c = 0 and every other d > 0 [Kim, Art. II, after eq.
(5)] and implements it by adding 1e-10 before the square root of the Euclidean distance (Sec. 3.1). We do
the same (``sqrt(d^2 + 1e-10)``), so a query on its prototype gets p = 1 - O(1e-5^rho) and finite gradients.

Range: squared distances of float32 embeddings beyond ~1e17 (``distance_scale_exponent``) overflow
float32, so such batches are computed in float64 (where they square safely; the 1e-10 guard keeps
its meaning) and the loss is returned in the input dtype, gradients too. A loss whose value is not
finite in the input dtype (the ``"sd"`` formulation's ``d^2`` of such embeddings), or float64
embeddings beyond ~1e150, raise ``ValueError`` naming ``embeddings`` and their largest magnitude.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from shiftguard._validation import check_positive
from shiftguard.functional.scaling import distance_scale_exponent, normalize_rows
from shiftguard.losses.base import DIST_EPS, EmbeddingLoss, adam_scale_step_, safe_euclidean, zero_loss
from shiftguard.losses.hierarchy import ema_proxy_update_

__all__ = [
    "dr_log_probs",
    "sd_softmax_log_probs",
    "leave_one_out_prototype_distances",
    "DRLoss",
    "ProxyDRLoss",
    "proxydr_initial_scale",
]


def dr_log_probs(distances: torch.Tensor, rho) -> torch.Tensor:
    """Log of the DR probabilities [Kim, Art. II, eq. (5)] from distances ``(N, C)`` (all > 0).

    ``log p(c|x) = log_softmax_c(-rho * ln d_c)``.  Masked classes may be passed as ``+inf``
    distances (their probability is exactly 0).
    """
    return torch.log_softmax(-rho * torch.log(distances), dim=-1)


def sd_softmax_log_probs(distances: torch.Tensor) -> torch.Tensor:
    """Log of the squared-distance softmax [Kim, Art. II, eq. (4)] from distances ``(N, C)``.

    Raises ``ValueError`` naming ``distances`` when a finite distance squares beyond the dtype's range
    (the log-probabilities are then not representable in it); ``+inf`` distances mask classes.
    """
    sq = distances.pow(2)
    if bool((torch.isinf(sq) & torch.isfinite(distances)).any()):
        big = float(distances[torch.isfinite(distances)].abs().max())
        raise ValueError(
            f"distances: values reach {big:.3g}; their squares overflow {distances.dtype} "
            "in the squared-distance softmax [Kim, Art. II, eq. (4)]"
        )
    return torch.log_softmax(-sq, dim=-1)


def _widen_for_range(embeddings: torch.Tensor, *others: torch.Tensor, what: str) -> torch.Tensor:
    """``embeddings`` as given, or as float64 where their squared distances would overflow its dtype.

    Raises ``ValueError`` naming ``embeddings`` when even float64 cannot hold them (beyond ~1e150).
    """
    if not distance_scale_exponent(embeddings, *others, lower=False):
        return embeddings
    if embeddings.dtype != torch.float64:
        wide = embeddings.double()
        if not distance_scale_exponent(wide, *(o.double() for o in others), lower=False):
            return wide
    big = max(float(t.detach().abs().max()) for t in (embeddings, *others) if t.numel())
    raise ValueError(f"embeddings: values reach {big:.3g}; squared distances overflow float64 in {what}")


def _check_finite_loss(loss: torch.Tensor, embeddings: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``loss`` cast to ``dtype``; ``ValueError`` naming ``embeddings`` if it is not finite there."""
    out = loss.to(dtype)
    if not bool(torch.isfinite(out)):
        big = float(embeddings.detach().abs().max())
        raise ValueError(f"embeddings: values reach {big:.3g}; the loss ({float(loss):.3g}) is not a finite {dtype}")
    return out


def leave_one_out_prototype_distances(embeddings: torch.Tensor, labels: torch.Tensor, eps: float = DIST_EPS):
    """Distances of every sample to every in-batch class prototype [Kim, Art. II, eq. (1)-(2)].

    The batch plays the role of an episode: prototypes are the class means of the batch, except that the
    prototype of a query's *own* class is the mean of the *other* members of that class (leave-one-out),
    so a query is never part of its own support set (as in prototypical-network episodes).

    Returns ``(dist (N, C), target (N,), valid (N,))`` where ``C`` is the number of classes present, and
    ``valid`` marks queries whose own class has at least one other member. Embeddings whose squared
    distances would overflow their dtype are processed in float64 and the distances cast back;
    ``ValueError`` naming ``embeddings`` if the distances themselves overflow the dtype.
    """
    wide = _widen_for_range(embeddings, what="the prototype distances")
    if wide is not embeddings:
        dist, target, valid = _loo_prototype_distances(wide, labels, eps)
        out = dist.to(embeddings.dtype)
        if not bool(torch.isfinite(out).all()):
            raise ValueError(
                f"embeddings: values reach {float(embeddings.detach().abs().max()):.3g}; "
                f"the prototype distances overflow {embeddings.dtype}"
            )
        return out, target, valid
    return _loo_prototype_distances(embeddings, labels, eps)


def _loo_prototype_distances(embeddings: torch.Tensor, labels: torch.Tensor, eps: float):
    classes, target = torch.unique(labels, return_inverse=True)
    n_cls = classes.shape[0]
    onehot = F.one_hot(target, n_cls).to(embeddings.dtype)  # (N, C)
    counts = onehot.sum(0)  # (C,)
    sums = onehot.t() @ embeddings  # (C, D)
    means = sums / counts.unsqueeze(1)
    dist = safe_euclidean(embeddings, means, eps)  # (N, C)
    own_count = counts[target] - 1.0
    valid = own_count > 0
    loo = (sums[target] - embeddings) / own_count.clamp_min(1.0).unsqueeze(1)  # (N, D)
    own_dist = ((embeddings - loo).pow(2).sum(-1) + eps).sqrt()
    dist = torch.where(onehot.bool(), own_dist.unsqueeze(1), dist)
    return dist, target, valid


class DRLoss(EmbeddingLoss):
    """Distance-ratio softmax cross-entropy for prototypes or proxies [Kim, Art. II, eq. (3) + (5)].

    Args:
        mode: ``"prototypes"`` -- each batch is an episode, class representatives are the leave-one-out
            in-batch class means (:func:`leave_one_out_prototype_distances`); ``"proxies"`` -- one
            learnable proxy per class in the (unnormalised) Euclidean embedding space (needs
            ``num_classes`` and ``embedding_dim``).
        formulation: ``"dr"`` (eq. (5)) or ``"sd"`` (the squared-distance softmax of eq. (4), the ProtoNet_S
            baseline of [Kim, Art. II]).
        init_log_rho: initial ``ln(rho)``; 2.0 in [Kim, Art. II, Sec. 3.1].
        learn_rho: train ``log_rho`` with the network ([Kim, Art. II] does).

    Behaviour on bad batches: queries whose class has no other member in the batch are skipped (prototype
    mode); a batch with one class gives p = 1 and an exact zero loss.  Zero-norm embeddings are fine
    (distances are ``sqrt(d^2 + 1e-10)``).  Scaling every embedding by ``a > 0`` leaves the DR loss
    unchanged [Kim, Art. II, eq. (6)], up to the ``1e-10`` guard.
    """

    def __init__(
        self,
        mode: str = "prototypes",
        formulation: str = "dr",
        num_classes: Optional[int] = None,
        embedding_dim: Optional[int] = None,
        init_log_rho: float = 2.0,
        learn_rho: bool = True,
        *,
        validate_args: bool = True,
    ):
        super().__init__(validate_args=validate_args)
        if mode not in ("prototypes", "proxies"):
            raise ValueError(f"mode: expected 'prototypes' or 'proxies', got {mode!r}")
        if formulation not in ("dr", "sd"):
            raise ValueError(f"formulation: expected 'dr' or 'sd', got {formulation!r}")
        self.mode = mode
        self.formulation = formulation
        log_rho = torch.tensor(float(init_log_rho))
        if learn_rho:
            self.log_rho = nn.Parameter(log_rho)
        else:
            self.register_buffer("log_rho", log_rho)
        if mode == "proxies":
            if num_classes is None or embedding_dim is None:
                raise ValueError("num_classes and embedding_dim: both are required when mode='proxies'")
            check_positive(num_classes, "num_classes", integer=True)
            check_positive(embedding_dim, "embedding_dim", integer=True)
            self.proxies = nn.Parameter(torch.randn(num_classes, embedding_dim) / math.sqrt(embedding_dim))
        else:
            self.register_parameter("proxies", None)

    @property
    def rho(self) -> torch.Tensor:
        return self.log_rho.exp()

    def extra_repr(self) -> str:
        s = f"mode={self.mode!r}, formulation={self.formulation!r}, rho={float(self.rho):.4g}"
        if self.proxies is not None:
            s += f", num_classes={self.proxies.shape[0]}, embedding_dim={self.proxies.shape[1]}"
        return s

    def log_probs(self, distances: torch.Tensor) -> torch.Tensor:
        if self.formulation == "dr":
            return dr_log_probs(distances, self.rho.to(distances.dtype))
        return sd_softmax_log_probs(distances)

    def compute(self, embeddings, labels):
        if self.mode == "proxies":
            if self.validate_args and labels.max() >= self.proxies.shape[0]:
                raise ValueError(f"labels: must be < num_classes={self.proxies.shape[0]}, got {int(labels.max())}")
            if embeddings.shape[1] != self.proxies.shape[1]:
                raise ValueError(f"embeddings: expected {self.proxies.shape[1]} features, got {embeddings.shape[1]}")
        others = () if self.proxies is None else (self.proxies.detach().to(embeddings.dtype),)
        wide = _widen_for_range(embeddings, *others, what="the DR loss")
        loss = self._compute(wide, labels)
        return loss if wide is embeddings else _check_finite_loss(loss, embeddings, embeddings.dtype)

    def _compute(self, embeddings, labels):
        if self.mode == "prototypes":
            dist, target, valid = _loo_prototype_distances(embeddings, labels, DIST_EPS)
            if not bool(valid.any()):
                return zero_loss(embeddings, self.log_rho)
            logp = self.log_probs(dist[valid])
            return -logp.gather(1, target[valid].unsqueeze(1)).mean()
        dist = safe_euclidean(embeddings, self.proxies.to(embeddings.dtype))
        logp = self.log_probs(dist)
        return -logp.gather(1, labels.unsqueeze(1)).mean()


def _psi_proxydr(s: float, b: float, theta: float) -> float:
    """psi_ProxyDR(s, theta) = B (s + 1) theta^s - s + 1 [Kim, Art. IV, S1 App.]."""
    return b * (s + 1.0) * theta**s - s + 1.0


def proxydr_initial_scale(num_classes: int) -> float:
    """Initial dynamic scale: the root of psi_ProxyDR with B = (C-1)(pi/2)^{-s}, theta = pi/4 [Kim, Art. IV, S1].

    Solved by bisection on ``s in (1, 1000]`` (psi > 0 near s = 1 and < 0 for large s).
    """
    c = int(num_classes)

    def f(s):
        return _psi_proxydr(s, (c - 1) * (math.pi / 2) ** (-s), math.pi / 4)

    lo, hi = 1.0 + 1e-9, 1000.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if f(mid) > 0:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


class ProxyDRLoss(EmbeddingLoss):
    """ProxyDR [Kim, Art. IV, "Methods" + eq. (8)]: DR softmax on the unit hypersphere with learnable proxies.

    ``f~ = f / ||f||``, ``W~_y = W_y / ||W_y||``, ``d_{x,y} = ||f~(x) - W~_y||`` and
    ``p(c|x) = d_c^{-s} / sum_y d_y^{-s}``, trained with cross-entropy [Kim, Art. IV, eq. (3)].

    Args:
        num_classes, embedding_dim: proxy table shape.
        scale: the fixed scale factor ``s``; 10.0 in [Kim, Art. IV, "Training settings"].
        dynamic: use the dynamic scale of [Kim, Art. IV, S1 App.]: ``s`` is initialised at the root of
            ``psi_ProxyDR`` with ``B = (C-1)(pi/2)^{-s}`` and ``theta = pi/4``, and during training (module in
            ``train()`` mode) each forward pass takes one Adam step on ``psi_ProxyDR(s, theta_med)^2`` with
            ``B = B_avg`` (batch mean of ``B_x = sum_{y != c} d_{x,y}^{-s}``, treated as a constant for the
            step, as AdaCos does) and ``theta_med`` the batch median angle to the true proxy, clipped to
            ``[0, pi/4]`` (AdaCos).  ``s`` is never trained by the main loss gradient.
        dynamic_lr: Adam step size for ``s`` (not given in the thesis; 0.01 here).
        ema_alpha: if given, the proxies are a buffer updated after every training batch by the
            normalised EMA of [Kim, Art. IV, eq. (12)] (``ema_proxy_update_``), not by gradients; the
            article uses 0.001. ``None`` (default): proxies are learned by the loss gradient.

    Zero-norm embeddings normalise to the zero vector (``F.normalize``), which is at distance 1 from
    every proxy: uniform probabilities, finite gradients.
    """

    scale: torch.Tensor

    def __init__(
        self,
        num_classes: int,
        embedding_dim: int,
        scale: float = 10.0,
        dynamic: bool = False,
        dynamic_lr: float = 0.01,
        ema_alpha: Optional[float] = None,
        *,
        validate_args: bool = True,
    ):
        super().__init__(validate_args=validate_args)
        check_positive(num_classes, "num_classes", integer=True)
        check_positive(embedding_dim, "embedding_dim", integer=True)
        check_positive(scale, "scale")
        check_positive(dynamic_lr, "dynamic_lr")
        if ema_alpha is not None and not (check_positive(ema_alpha, "ema_alpha") < 1):
            raise ValueError(f"ema_alpha: expected 0 < ema_alpha < 1, got {ema_alpha}")
        self.ema_alpha = None if ema_alpha is None else float(ema_alpha)
        if dynamic and num_classes < 2:
            raise ValueError(f"num_classes: the dynamic scale needs at least 2 classes, got {num_classes}")
        self.dynamic = bool(dynamic)
        self.dynamic_lr = float(dynamic_lr)
        if self.ema_alpha is None:
            self.proxies = nn.Parameter(torch.randn(num_classes, embedding_dim))
        else:
            self.register_buffer("proxies", F.normalize(torch.randn(num_classes, embedding_dim), dim=1))
        s0 = proxydr_initial_scale(num_classes) if dynamic else float(scale)
        self.register_buffer("scale", torch.tensor(s0, dtype=torch.float64))
        # Adam state for the dynamic scale (first/second moments, step count).
        self.register_buffer("_adam_m", torch.zeros((), dtype=torch.float64))
        self.register_buffer("_adam_v", torch.zeros((), dtype=torch.float64))
        self.register_buffer("_adam_t", torch.zeros((), dtype=torch.float64))

    def extra_repr(self) -> str:
        return (
            f"num_classes={self.proxies.shape[0]}, embedding_dim={self.proxies.shape[1]}, "
            f"scale={float(self.scale):.4g}, dynamic={self.dynamic}"
        )

    def distances(self, embeddings: torch.Tensor) -> torch.Tensor:
        """Chord distances ``(N, C)`` between normalised embeddings and normalised proxies."""
        f = normalize_rows(embeddings)
        w = normalize_rows(self.proxies.to(embeddings.dtype))
        return safe_euclidean(f, w)

    def compute(self, embeddings, labels):
        if self.validate_args and labels.max() >= self.proxies.shape[0]:
            raise ValueError(f"labels: must be < num_classes={self.proxies.shape[0]}, got {int(labels.max())}")
        if embeddings.shape[1] != self.proxies.shape[1]:
            raise ValueError(f"embeddings: expected {self.proxies.shape[1]} features, got {embeddings.shape[1]}")
        dist = self.distances(embeddings)
        s = self.scale.to(embeddings.dtype)
        logp = dr_log_probs(dist, s)
        loss = -logp.gather(1, labels.unsqueeze(1)).mean()
        if self.dynamic and self.training:
            self._update_scale(dist.detach(), embeddings.detach(), labels)
        if self.ema_alpha is not None and self.training:
            ema_proxy_update_(self.proxies, embeddings.detach(), labels, self.ema_alpha)
        return loss

    @torch.no_grad()
    def _update_scale(self, dist, embeddings, labels):
        s = float(self.scale)
        d = dist.double()
        neg = torch.ones_like(d, dtype=torch.bool)
        neg[torch.arange(d.shape[0], device=d.device), labels] = False
        b_avg = float((d.pow(-s) * neg).sum(1).mean())
        cos = (F.normalize(embeddings.double(), dim=1) * F.normalize(self.proxies.double(), dim=1)[labels]).sum(1)
        theta = float(torch.arccos(cos.clamp(-1.0, 1.0)).median().clamp(1e-6, math.pi / 4))
        psi = _psi_proxydr(s, b_avg, theta)
        # d psi / d s with B held fixed
        dpsi = b_avg * theta**s * (1.0 + (s + 1.0) * math.log(theta)) - 1.0
        adam_scale_step_(self, 2.0 * psi * dpsi, self.dynamic_lr)
