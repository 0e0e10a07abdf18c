"""Hierarchy-informed and proxy-based training of [Kim, Art. IV]: fixed hierarchy proxies, the CORR
loss, EMA proxy updates and NormFace with a fixed, dynamic (AdaCos) or EMA-updated proxy set.

* **Fixed proxies from a hierarchy.** ``method="similarity"`` (Barz & Denzler 2019, [Kim, Ch. 4.2]):
  unit proxies whose inner products equal ``s_H = 1 - d_{H;LCS}``, i.e. a factor ``W`` with
  ``W W^T = S``. Barz & Denzler build the Cholesky factor class by class; any factor gives the same
  inner products, and we take the eigen-factor ``V sqrt(Lambda)`` (it also covers singular ``S``),
  which needs ``embedding_dim >= rank(S)``. ``method="mds"`` ([Kim, Art. IV], "MDS" option): unit
  proxies minimising the normalised stress ``||D_W - D_T||_F / ||D_T||_F`` (eq. (13)) between their
  chord distances and ``d_T = sqrt(2) d_H / (beta + d_H)`` of the path distance, ``beta = 1``, by Adam
  with learning rate 1e-3 for 1000 iterations (the article's settings), from a seeded start.
* **CORR loss** [Kim, Art. IV, eq. (11)]: ``L = (1/|B|) sum_i (1 - W~_{c_i}^T f~(x_i))`` with fixed proxies.
* **EMA proxies** [Kim, Art. IV, eq. (9), (12)] (Zhe et al. 2019): after each training batch, for every
  class c present, ``mu~_{B;c}`` = normalised sum of its normalised embeddings and
  ``W~_c := normalise(alpha mu~_{B;c} + (1 - alpha) W~_c)``, ``alpha = 0.001`` in the article. With one
  sample of c in the batch this is eq. (9).
* **NormFace** [Kim, Art. IV, eq. (5)] (Wang et al. 2017): ``p(c|x) = softmax_c(s cos theta_c)`` with
  ``s = 10`` in the article's standard option; ``dynamic=True`` adapts ``s`` (AdaCos, Zhang et al. 2019,
  [Kim, Art. IV, eq. (10), S1 App.]).

Dynamic scale rules for NormFace (both use ``B_avg``, the batch mean of
``B_x = sum_{y != c} exp(s cos theta_y)`` at the current ``s``, and ``theta_med``, the batch median of the
angle to the true proxy clipped to ``[0, pi/4]``):

* ``dynamic_rule="adam"`` [Kim, Art. IV, S1 App.]: one Adam step per training batch on
  ``psi_NormFace(s, theta)^2`` with ``psi = cos theta (e^{s cos theta} + B) + s sin^2 theta (e^{s cos theta} - B)``
  (``B`` held fixed for the step). ``s`` starts at the minimiser of ``psi^2`` for ``B = C - 1``,
  ``theta = pi/4`` -- the largest root when ``psi`` has one. For few classes (C = 10) ``psi`` has no root
  at ``theta = pi/4`` and the rule settles at the minimiser of ``psi^2`` (s ~ 1.5): a small scale.
* ``dynamic_rule="adacos"`` (Zhang et al. 2019, their dynamic AdaCos): ``s_0 = sqrt(2) ln(C - 1)`` and
  ``s := ln(B_avg) / cos(theta_med)`` after every training batch (kept unchanged while ``B_avg <= 1``,
  where ``ln(B_avg)`` gives no positive scale).

Zero-norm embeddings normalise to the zero vector (cosine 0 with every proxy), with finite gradients.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from shiftguard._validation import check_labels, check_positive, check_tensor
from shiftguard.data.hierarchy import ClassHierarchy, transformed_distance
from shiftguard.functional.scaling import normalize_rows
from shiftguard.losses.base import EmbeddingLoss, adam_scale_step_

__all__ = [
    "hierarchy_proxies",
    "ema_proxy_update_",
    "EMAProxies",
    "CORRLoss",
    "NormFaceLoss",
    "normface_psi",
    "normface_initial_scale",
]


def hierarchy_proxies(
    hierarchy: ClassHierarchy,
    embedding_dim: int,
    method: str = "similarity",
    *,
    beta: float = 1.0,
    height: str = "shortest",
    iterations: int = 1000,
    lr: float = 1e-3,
    seed: int = 0,
) -> torch.Tensor:
    """Unit proxies ``(C, embedding_dim)`` float64 placed by the hierarchy (see the module docstring).

    ``method="similarity"``: ``W W^T = 1 - d_{H;LCS}`` exactly (``height`` picks the node height of
    :meth:`ClassHierarchy.height`); raises ``ValueError`` naming ``hierarchy`` when that matrix is not
    positive semi-definite (possible with ``height="shortest"`` on trees whose leaves lie at different
    depths) or ``embedding_dim`` when it is below the matrix's rank.
    ``method="mds"``: the stress minimiser of [Kim, Art. IV, eq. (13)] (``beta``, ``iterations``, ``lr``,
    ``seed``); any ``embedding_dim >= 1``.
    """
    if not isinstance(hierarchy, ClassHierarchy):
        raise TypeError(f"hierarchy: expected a ClassHierarchy, got {type(hierarchy).__name__}")
    check_positive(embedding_dim, "embedding_dim", integer=True)
    if method == "similarity":
        sim = hierarchy.similarity_matrix("lcs", height=height)
        evals, evecs = torch.linalg.eigh(sim)
        tol = 1e-9 * max(1.0, float(evals.abs().max()))
        if float(evals.min()) < -tol:
            raise ValueError(
                f"hierarchy: its similarity 1 - d_LCS is not positive semi-definite (eigenvalue "
                f"{float(evals.min()):.3g}); use height='longest' or method='mds'"
            )
        keep = evals > tol
        rank = int(keep.sum())
        if rank > embedding_dim:
            raise ValueError(
                f"embedding_dim: the hierarchy's similarity has rank {rank}; exact proxies need "
                f"embedding_dim >= {rank}, got {embedding_dim} (method='mds' fits any dimension)"
            )
        factor = evecs[:, keep] * evals[keep].sqrt()
        out = torch.zeros(hierarchy.num_classes, embedding_dim, dtype=torch.float64)
        out[:, :rank] = factor
        return F.normalize(out, dim=1)  # rows already have unit norm (diagonal of S is 1) up to rounding
    if method == "mds":
        check_positive(iterations, "iterations", integer=True)
        check_positive(lr, "lr")
        target = transformed_distance(hierarchy.distance_matrix("path"), beta)
        gen = torch.Generator().manual_seed(int(seed))
        w = torch.randn(hierarchy.num_classes, embedding_dim, dtype=torch.float64, generator=gen)
        w.requires_grad_(True)
        opt = torch.optim.Adam([w], lr=lr)
        norm_t = target.norm()
        for _ in range(iterations):
            opt.zero_grad()
            u = F.normalize(w, dim=1)
            # Chord distances from the Gram matrix; the 1e-12 keeps the sqrt differentiable at 0.
            d = (2.0 - 2.0 * (u @ u.t())).clamp_min(0.0).add(1e-12).sqrt()
            d = d - torch.diag(torch.diagonal(d))
            stress = (d - target).norm() / norm_t
            stress.backward()
            opt.step()
        return F.normalize(w.detach(), dim=1)
    raise ValueError(f"method: expected 'similarity' or 'mds', got {method!r}")


@torch.no_grad()
def ema_proxy_update_(proxies: torch.Tensor, embeddings: torch.Tensor, labels: torch.Tensor, alpha: float) -> None:
    """In place: ``W~_c := normalise(alpha mu~_{B;c} + (1 - alpha) W~_c)`` for every class c in ``labels``
    [Kim, Art. IV, eq. (12)], ``mu~_{B;c}`` the normalised sum of the class's normalised embeddings.

    ``proxies`` ``(C, D)`` (rows are normalised first), ``embeddings`` ``(N, D)``, ``labels`` ``(N,)``
    int64 in ``[0, C)`` -- trusted (callers validate). A class whose batch embeddings sum to zero has no
    direction and leaves its proxy unchanged; so does an update whose weighted sum is zero.
    """
    emb = normalize_rows(embeddings.detach().to(proxies.dtype))
    sums = torch.zeros_like(proxies).index_add_(0, labels, emb)
    present = torch.bincount(labels, minlength=proxies.shape[0]) > 0
    mu = F.normalize(sums, dim=1)
    has_dir = present & (sums.norm(dim=1) > 0)
    w = F.normalize(proxies, dim=1)
    new = alpha * mu + (1.0 - alpha) * w
    ok = has_dir & (new.norm(dim=1) > 0)
    proxies.copy_(torch.where(ok.unsqueeze(1), F.normalize(new, dim=1), w))


class EMAProxies(nn.Module):
    """A proxy table updated by the normalised exponential moving average [Kim, Art. IV, eq. (9), (12)].

    Args:
        num_classes, embedding_dim: table shape.
        alpha: update rate, ``0 < alpha < 1`` (0.001 in [Kim, Art. IV]).
        init: optional initial proxies ``(C, D)`` (normalised here); default: normalised standard
            normal draws from the global RNG.

    ``proxies`` is a buffer (never a gradient target). ``update(embeddings, labels)`` applies eq. (12)
    for one batch (validated: ``(N, D)`` finite float, labels in ``[0, C)``).
    """

    proxies: torch.Tensor

    def __init__(self, num_classes: int, embedding_dim: int, alpha: float = 0.001, init: Optional[torch.Tensor] = None):
        super().__init__()
        check_positive(num_classes, "num_classes", integer=True)
        check_positive(embedding_dim, "embedding_dim", integer=True)
        check_positive(alpha, "alpha")
        if alpha >= 1:
            raise ValueError(f"alpha: expected 0 < alpha < 1, got {alpha}")
        self.alpha = float(alpha)
        if init is None:
            w = torch.randn(num_classes, embedding_dim)
        else:
            w = check_tensor(init, "init", ndim=2, floating=True, finite=True).detach().clone()
            if tuple(w.shape) != (num_classes, embedding_dim):
                raise ValueError(f"init: expected shape ({num_classes}, {embedding_dim}), got {tuple(w.shape)}")
        self.register_buffer("proxies", F.normalize(w, dim=1))

    def extra_repr(self) -> str:
        return f"num_classes={self.proxies.shape[0]}, embedding_dim={self.proxies.shape[1]}, alpha={self.alpha}"

    def update(self, embeddings: torch.Tensor, labels: torch.Tensor) -> None:
        emb = check_tensor(embeddings, "embeddings", ndim=2, floating=True, finite=True, nonempty=True)
        if emb.shape[1] != self.proxies.shape[1]:
            raise ValueError(f"embeddings: expected {self.proxies.shape[1]} features, got {emb.shape[1]}")
        lab = check_labels(labels, "labels", num_classes=self.proxies.shape[0], n=emb.shape[0]).to(emb.device)
        ema_proxy_update_(self.proxies, emb, lab, self.alpha)


def _check_against_proxies(
    embeddings: torch.Tensor, labels: torch.Tensor, proxies: torch.Tensor, check_values: bool = True
) -> None:
    # the label bound reads a value (a host synchronisation): only with check_values (validate_args)
    if check_values and int(labels.max()) >= proxies.shape[0]:
        raise ValueError(f"labels: must be < num_classes={proxies.shape[0]}, got {int(labels.max())}")
    if embeddings.shape[1] != proxies.shape[1]:
        raise ValueError(f"embeddings: expected {proxies.shape[1]} features, got {embeddings.shape[1]}")


class CORRLoss(EmbeddingLoss):
    """CORR loss with fixed proxies [Kim, Art. IV, eq. (11)] (Barz & Denzler 2019).

    Args:
        hierarchy: the class hierarchy placing the proxies; default: a flat one (every class a child of
            the root), whose similarity proxies are orthonormal.
        num_classes: needed without ``hierarchy`` (else must match it).
        embedding_dim: embedding size.
        proxies: ``"similarity"`` / ``"mds"`` (see :func:`hierarchy_proxies`) or a ``(C, D)`` tensor of
            fixed proxies (normalised here).
        **proxy_kw: passed to :func:`hierarchy_proxies` (``beta``, ``height``, ``iterations``, ``seed``).

    ``loss.proxies`` is a buffer, so the proxies stay fixed under any optimiser.
    """

    proxies: torch.Tensor

    def __init__(
        self,
        hierarchy: Optional[ClassHierarchy] = None,
        num_classes: Optional[int] = None,
        embedding_dim: Optional[int] = None,
        proxies: Union[str, torch.Tensor] = "similarity",
        *,
        validate_args: bool = True,
        **proxy_kw,
    ):
        super().__init__(validate_args=validate_args)
        if hierarchy is None:
            if num_classes is None:
                raise ValueError("num_classes: required when no hierarchy is given")
            check_positive(num_classes, "num_classes", integer=True)
            hierarchy = ClassHierarchy([num_classes] * num_classes + [None], num_classes)
        elif num_classes is not None and num_classes != hierarchy.num_classes:
            raise ValueError(f"num_classes: {num_classes} differs from the hierarchy's {hierarchy.num_classes}")
        if isinstance(proxies, str):
            if embedding_dim is None:
                raise ValueError("embedding_dim: required to place the proxies")
            w = hierarchy_proxies(hierarchy, embedding_dim, proxies, **proxy_kw)
        else:
            w = check_tensor(proxies, "proxies", ndim=2, floating=True, finite=True).detach().double()
            if w.shape[0] != hierarchy.num_classes or (embedding_dim is not None and w.shape[1] != embedding_dim):
                raise ValueError(
                    f"proxies: expected shape ({hierarchy.num_classes}, {embedding_dim or 'D'}), got {tuple(w.shape)}"
                )
            if bool((w.norm(dim=1) == 0).any()):
                raise ValueError("proxies: a zero row has no direction")
            w = F.normalize(w, dim=1)
        self.hierarchy = hierarchy
        self.register_buffer("proxies", w.float())

    def extra_repr(self) -> str:
        return f"num_classes={self.proxies.shape[0]}, embedding_dim={self.proxies.shape[1]}"

    def cosines(self, embeddings: torch.Tensor) -> torch.Tensor:
        """``cos theta_y`` ``(N, C)`` between normalised embeddings and the proxies."""
        return normalize_rows(embeddings) @ self.proxies.to(embeddings.dtype).t()

    def compute(self, embeddings, labels):
        _check_against_proxies(embeddings, labels, self.proxies, self.validate_args)
        cos_c = (normalize_rows(embeddings) * self.proxies.to(embeddings.dtype)[labels]).sum(1)
        return (1.0 - cos_c).mean()


def normface_psi(s: float, b: float, theta: float) -> float:
    """``psi_NormFace(s, theta) = cos theta (e^{s cos theta} + B) + s sin^2 theta (e^{s cos theta} - B)``
    [Kim, Art. IV, S1 App.]: ``d^2 p / d theta^2 = 0`` iff ``psi = 0``."""
    e = math.exp(s * math.cos(theta))
    return math.cos(theta) * (e + b) + s * math.sin(theta) ** 2 * (e - b)


def _dpsi_ds(s: float, b: float, theta: float) -> float:
    c, s2 = math.cos(theta), math.sin(theta) ** 2
    e = math.exp(s * c)
    return c * c * e + s2 * (e - b) + s * s2 * c * e


def normface_initial_scale(num_classes: int) -> float:
    """The minimiser of ``psi_NormFace(s, pi/4)^2`` with ``B = C - 1`` over ``s in (0, 100]``: its
    largest root when one exists [Kim, Art. IV, S1 App.]."""
    b, theta = float(num_classes - 1), math.pi / 4
    grid = [0.01 * i for i in range(1, 10001)]
    vals = [normface_psi(s, b, theta) for s in grid]
    roots = [i for i in range(len(grid) - 1) if vals[i] <= 0 < vals[i + 1]]
    if roots:
        lo, hi = grid[roots[-1]], grid[roots[-1] + 1]
        for _ in range(100):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if normface_psi(mid, b, theta) <= 0 else (lo, mid)
        return 0.5 * (lo + hi)
    best = min(range(len(grid)), key=lambda i: abs(vals[i]))
    lo, hi = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
    for _ in range(100):  # golden-section search for the minimum of psi^2 around the grid point
        m1, m2 = lo + (hi - lo) / 3, hi - (hi - lo) / 3
        if normface_psi(m1, b, theta) ** 2 <= normface_psi(m2, b, theta) ** 2:
            hi = m2
        else:
            lo = m1
    return 0.5 * (lo + hi)


class NormFaceLoss(EmbeddingLoss):
    """NormFace cross-entropy [Kim, Art. IV, eq. (3), (5)] with fixed, dynamic or EMA options.

    Args:
        num_classes, embedding_dim: proxy table shape.
        scale: the fixed ``s`` (10.0 in [Kim, Art. IV, "Training settings"]).
        dynamic: adapt ``s`` during training (module in ``train()`` mode), by ``dynamic_rule``
            (``"adam"``: [Kim, Art. IV, S1 App.]; ``"adacos"``: Zhang et al. 2019); ``s`` is a buffer,
            never moved by the loss gradient.
        dynamic_lr: Adam step size of the ``"adam"`` rule (the thesis gives none; 0.01 here).
        ema_alpha: if given, the proxies are EMA proxies (:class:`EMAProxies`, eq. (12)) updated after
            every training batch, not by gradients.
        proxies: optional fixed proxies ``(C, D)`` (e.g. :func:`hierarchy_proxies`, the article's "MDS"
            option); they are then a buffer and ``ema_alpha`` must be ``None``.
    """

    weight: torch.Tensor
    scale: torch.Tensor
    _adam_m: torch.Tensor
    _adam_v: torch.Tensor
    _adam_t: torch.Tensor

    def __init__(
        self,
        num_classes: int,
        embedding_dim: int,
        scale: float = 10.0,
        dynamic: bool = False,
        dynamic_rule: str = "adam",
        dynamic_lr: float = 0.01,
        ema_alpha: Optional[float] = None,
        proxies: Optional[torch.Tensor] = None,
        *,
        validate_args: bool = True,
    ):
        super().__init__(validate_args=validate_args)
        check_positive(num_classes, "num_classes", integer=True)
        check_positive(embedding_dim, "embedding_dim", integer=True)
        check_positive(scale, "scale")
        check_positive(dynamic_lr, "dynamic_lr")
        if dynamic_rule not in ("adam", "adacos"):
            raise ValueError(f"dynamic_rule: expected 'adam' or 'adacos', got {dynamic_rule!r}")
        if dynamic and num_classes < 3 and dynamic_rule == "adacos":
            raise ValueError(
                f"num_classes: the AdaCos scale needs at least 3 classes (ln(C - 1) > 0), got {num_classes}"
            )
        if dynamic and num_classes < 2:
            raise ValueError(f"num_classes: the dynamic scale needs at least 2 classes, got {num_classes}")
        if proxies is not None and ema_alpha is not None:
            raise ValueError("ema_alpha: fixed proxies cannot be EMA-updated; give one of proxies, ema_alpha")
        self.dynamic = bool(dynamic)
        self.dynamic_rule = dynamic_rule
        self.dynamic_lr = float(dynamic_lr)
        self.ema: Optional[EMAProxies] = None
        if ema_alpha is not None:
            self.ema = EMAProxies(num_classes, embedding_dim, ema_alpha)
        elif proxies is not None:
            w = check_tensor(proxies, "proxies", ndim=2, floating=True, finite=True).detach()
            if tuple(w.shape) != (num_classes, embedding_dim):
                raise ValueError(f"proxies: expected shape ({num_classes}, {embedding_dim}), got {tuple(w.shape)}")
            self.register_buffer("weight", F.normalize(w.float(), dim=1))
        else:
            self.weight = nn.Parameter(torch.randn(num_classes, embedding_dim))
        if dynamic:
            s0 = (
                math.sqrt(2.0) * math.log(num_classes - 1)
                if dynamic_rule == "adacos"
                else normface_initial_scale(num_classes)
            )
        else:
            s0 = float(scale)
        self.register_buffer("scale", torch.tensor(s0, dtype=torch.float64))
        self.register_buffer("_adam_m", torch.zeros((), dtype=torch.float64))
        self.register_buffer("_adam_v", torch.zeros((), dtype=torch.float64))
        self.register_buffer("_adam_t", torch.zeros((), dtype=torch.float64))

    @property
    def proxies(self) -> torch.Tensor:
        """The current proxies ``(C, D)`` (unnormalised when learned by gradient)."""
        return self.ema.proxies if self.ema is not None else self.weight

    def extra_repr(self) -> str:
        w = self.proxies
        return (
            f"num_classes={w.shape[0]}, embedding_dim={w.shape[1]}, scale={float(self.scale):.4g}, "
            f"dynamic={self.dynamic}, ema={self.ema is not None}"
        )

    def cosines(self, embeddings: torch.Tensor) -> torch.Tensor:
        """``cos theta_y`` ``(N, C)`` between normalised embeddings and normalised proxies."""
        return normalize_rows(embeddings) @ normalize_rows(self.proxies.to(embeddings.dtype)).t()

    def compute(self, embeddings, labels):
        _check_against_proxies(embeddings, labels, self.proxies, self.validate_args)
        cos = self.cosines(embeddings)
        loss = F.cross_entropy(self.scale.to(embeddings.dtype) * cos, labels)
        if self.training:
            if self.dynamic:
                self._update_scale(cos.detach().double(), labels)
            if self.ema is not None:
                ema_proxy_update_(self.ema.proxies, embeddings.detach(), labels, self.ema.alpha)
        return loss

    @torch.no_grad()
    def _update_scale(self, cos: torch.Tensor, labels: torch.Tensor) -> None:
        s = float(self.scale)
        rows = torch.arange(cos.shape[0], device=cos.device)
        neg = torch.ones_like(cos, dtype=torch.bool)
        neg[rows, labels] = False
        b_avg = float((torch.exp(s * cos) * neg).sum(1).mean())
        theta = float(torch.arccos(cos[rows, labels].clamp(-1.0, 1.0)).median().clamp(0.0, math.pi / 4))
        if self.dynamic_rule == "adacos":
            if b_avg > 1.0:  # ln(B_avg) > 0: a positive scale exists
                self.scale.fill_(math.log(b_avg) / math.cos(theta))
            return
        adam_scale_step_(self, 2.0 * normface_psi(s, b_avg, theta) * _dpsi_ds(s, b_avg, theta), self.dynamic_lr)
