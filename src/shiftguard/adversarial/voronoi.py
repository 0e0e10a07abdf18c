"""Voronoi-epsilon adversarial accuracy [Kim, Art. III]: attacks confined to ``Vor(x) ∩ B(x, eps)``.

Kim's Voronoi-epsilon adversary may move a data point ``x`` of the reference set ``X`` (the training
data) anywhere in ``R_Vor(eps; x) = Vor(x) ∩ B(x, eps)`` [Kim, Art. III, Def. 3], where the open
Voronoi cell ``Vor(x)`` holds the points nearer to ``x`` than to every other point of ``X``. No
clean point is then an adversarial example of another, so adversarial accuracy no longer trades
off against accuracy at large ``eps``. This module provides

- :func:`voronoi_project` -- the Euclidean projection onto ``Vor_m(x) ∩ B(x, eps) ∩ [lo, hi]^D``;
- :func:`voronoi_pgd` -- PGD whose projection is that one;
- :func:`voronoi_adversarial_accuracy` (VAA, [Kim, Art. III, Def. 3]),
  :func:`standard_adversarial_accuracy` (SAA, the same attack in the ball only, [Kim, Art. III,
  Def. 2]) and :func:`global_voronoi_robustness` (``eps -> inf``, [Kim, Art. III, Def. 4]);
- :func:`voronoi_inner_radius` -- half the distance from ``x`` to its nearest other reference point:
  the largest ball around ``x`` inside ``Vor(x)``, so VAA equals SAA for ``eps`` below it
  [Kim, Art. III, Observation 1 and Lemma 1].

**The cell.** With the Euclidean distance the cell is a polytope: ``z`` is nearer to ``x`` than to
``x_j`` iff ``a_j . (z - x) < ||a_j||^2 / 2`` with ``a_j = x_j - x``. The cell is open; the projection
keeps a strict interior margin ``m``: ``a_j . (z - x) <= ||a_j|| (||a_j|| / 2 - m)``, i.e. at least ``m``
from every bisector, so the points returned are in the open cell even after rounding to the
pixels' dtype. Reference points within ``1e-6 ||x||`` of ``x`` (relative, float64) are ``x`` itself; a
point ``x`` outside the reference set gets its cell in ``X ∪ {x}``.

**The projection** (exact up to a tolerance). A half-space can only bind if its bisector is within
reach of ``x``: ``||a_j|| / 2 - m`` no larger than the farthest feasible point (``eps`` in L2,
``eps sqrt(D)`` in L-inf, and the box's farthest corner from ``x``); the other reference points are
never looked at. The projection of ``y`` onto ``S = B(x, eps) ∩ [lo, hi]^D`` (exact, see
:mod:`shiftguard.adversarial.attacks`) is returned when it lies in the shrunk cell -- it is then the
projection onto the whole intersection, and exactly what standard PGD takes. Otherwise a cutting-plane
loop adds the most violated half-spaces (8 per round) to a working set and projects ``y`` onto ``S``
∩ working set by Dykstra's alternating projections (Boyle & Dykstra 1986), which converge to the
exact projection of ``y``; it stops when no half-space outside the working set is violated. Dykstra
stops when an iterate and the correction terms change by less than ``tol`` per cycle (or after
``max_iter`` cycles); the point is finally pulled toward ``x`` along the segment until it satisfies
every half-space of the cell, so it is always feasible, and optimal to about ``tol``.

**Norms.** Kim uses one distance ``d`` for both the ball and the cell. With ``norm="l2"`` this module is
exactly that. With ``norm="linf"`` the ball is L-inf and the cell stays Euclidean (an L-inf Voronoi
cell is not convex and has no exact projection): a mixed adversary region, documented as such.

**Global robustness** [Kim, Art. III, Def. 4] is the limit ``eps -> inf``. With pixel bounds it is
reached, not approximated: once the ball holds the box (``eps >= (hi - lo) sqrt(D)`` in L2,
``hi - lo`` in L-inf) the region is ``Vor(x) ∩ [lo, hi]^D`` for every larger ``eps``, so ``eps = inf`` is
run as that ``eps``. Without bounds ``eps = inf`` drops the ball and needs an explicit ``step_size``.

All accuracies here are those of a finite-step attack: an upper bound of the true (worst-case)
adversarial accuracy, tight as far as the attack is strong.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from shiftguard._validation import check_labels, check_positive
from shiftguard.adversarial.attacks import (
    Bounds,
    LossFn,
    Preprocess,
    check_batch_size,
    check_bounds,
    check_callable,
    check_norm,
    check_pixels,
    default_device,
    default_step_size,
    eval_mode,
    project_ball_box,
    run_attack,
)

__all__ = [
    "global_voronoi_robustness",
    "standard_adversarial_accuracy",
    "voronoi_adversarial_accuracy",
    "voronoi_inner_radius",
    "voronoi_pgd",
    "voronoi_project",
]

#: Default strict interior margin (pixel units): distance kept from every bisector of the cell.
DEFAULT_MARGIN = 1e-5
#: Reference points within this relative distance of ``x`` (``sqrt(1e-12)`` of the norms) are ``x``.
_SELF_RTOL = 1e-12
#: Half-spaces added to the working set per cutting-plane round, and the rounds allowed.
_ADD_PER_ROUND = 8
_MAX_ROUNDS = 64
#: Reference rows per chunk of a distance computation (memory ``O(batch * chunk)``).
_CHUNK = 8192


def _sq_distances(x: torch.Tensor, ref: torch.Tensor, ref_sq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Squared distances ``(B, M)`` between float64 rows, and the mask of reference rows that are ``x``."""
    x_sq = (x * x).sum(1, keepdim=True)
    parts, selves = [], []
    for s in range(0, ref.shape[0], _CHUNK):
        r, rs = ref[s : s + _CHUNK], ref_sq[s : s + _CHUNK].unsqueeze(0)
        sq = (x_sq + rs - 2.0 * x @ r.t()).clamp_min(0.0)
        parts.append(sq)
        selves.append(sq <= _SELF_RTOL * (x_sq + rs))
    return torch.cat(parts, 1), torch.cat(selves, 1)


class _CellProjector:
    """Projection onto ``Vor_m(x) ∩ B(x, eps) ∩ [lo, hi]^D`` for one batch of clean points ``x``."""

    def __init__(
        self,
        x: torch.Tensor,
        ref: torch.Tensor,
        ref_sq: torch.Tensor,
        eps: float,
        norm: str,
        bounds: Optional[tuple[float, float]],
        margin: float,
        tol: float,
        max_iter: int,
    ):
        self.shape, self.dtype = x.shape, x.dtype
        self.x = x.detach()
        self.x64 = x.detach().flatten(1).double()
        self.eps, self.norm, self.bounds = eps, norm, bounds
        self.margin, self.tol, self.max_iter = margin, tol, max_iter
        dim = self.x64.shape[1]
        reach = torch.full(
            (x.shape[0],), eps * (math.sqrt(dim) if norm == "linf" else 1.0), dtype=torch.float64, device=x.device
        )
        if bounds is not None:
            corner = torch.maximum(self.x64 - bounds[0], bounds[1] - self.x64).norm(dim=1)
            reach = torch.minimum(reach, corner)
        sq, is_self = _sq_distances(self.x64, ref, ref_sq)
        dist = sq.sqrt()
        too_close = (~is_self) & (dist <= 2.0 * margin)
        if bool(too_close.any()):
            raise ValueError(
                f"margin: a reference point lies within 2 * margin = {2 * margin:.3g} of a point x "
                f"(nearest {float(dist[too_close].min()):.3g}); its cell is thinner than the "
                "margin: pass a smaller margin"
            )
        cand = (~is_self) & (dist <= 2.0 * (reach.unsqueeze(1) + margin))
        cols = cand.any(0).nonzero().flatten()
        self.ref = ref[cols]
        self.cand = cand[:, cols]
        self.na = dist[:, cols]
        c = self.na * (self.na / 2.0 - margin)
        self.c = torch.where(self.cand, c, torch.full_like(c, math.inf))

    def _excess(self, z64: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Signed distance ``(b, n)`` beyond each shrunk bisector (``> 0``: outside the shrunk cell)."""
        d = z64 - self.x64[rows]
        ad = d @ self.ref.t() - (d * self.x64[rows]).sum(1, keepdim=True)
        return (ad - self.c[rows]) / self.na[rows].clamp_min(1e-300)

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        z0 = project_ball_box(y, self.x, self.eps, self.norm, self.bounds)
        if self.ref.shape[0] == 0:
            return z0
        all_rows = torch.arange(y.shape[0], device=y.device)
        bad = (self._excess(z0.flatten(1).double(), all_rows) > 0).any(1)
        if not bool(bad.any()):
            return z0
        rows = bad.nonzero().flatten()
        z = self._project_rows(y.flatten(1).double()[rows], rows)
        out = z0.flatten(1).clone()
        out[rows] = self._feasible_in_dtype(z, rows)
        return out.view(self.shape)

    # -- the exact projection of the rows whose ball projection leaves the cell
    def _project_rows(self, y64: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        b = rows.shape[0]
        work_idx = torch.zeros(b, 0, dtype=torch.long, device=y64.device)
        work_ok = torch.zeros(b, 0, dtype=torch.bool, device=y64.device)
        x64 = self.x64[rows]
        z = project_ball_box(y64, x64, self.eps, self.norm, self.bounds)
        # Dykstra's correction terms: [ball-and-box set, half-spaces of the working set...]. Dykstra is block
        # coordinate ascent on the dual of the projection (Tibshirani 2017), so a new half-space may join
        # with a zero correction and the iteration continue from where it stood (z = y - sum of corrections).
        incr = (y64 - z).unsqueeze(0)
        for _ in range(_MAX_ROUNDS):
            s = self._excess(z, rows)
            in_work = torch.zeros_like(s, dtype=torch.bool)
            if work_idx.shape[1]:
                in_work.scatter_(1, work_idx, work_ok)
            s = s.masked_fill(in_work | ~self.cand[rows], -math.inf)
            top, idx = s.topk(min(_ADD_PER_ROUND, s.shape[1]), dim=1)
            new_ok = top > 0
            if not bool(new_ok.any()):
                break
            work_idx = torch.cat([work_idx, idx], 1)
            work_ok = torch.cat([work_ok, new_ok], 1)
            incr = torch.cat([incr, incr.new_zeros(idx.shape[1], *y64.shape)], 0)
            z = self._dykstra(z, x64, rows, work_idx, work_ok, incr)
        return self._pull_inside(z, x64, rows)

    def _dykstra(
        self,
        z: torch.Tensor,
        x64: torch.Tensor,
        rows: torch.Tensor,
        idx: torch.Tensor,
        ok: torch.Tensor,
        incr: torch.Tensor,
    ) -> torch.Tensor:
        """Dykstra's projection onto the ball-and-box set ∩ the half-spaces ``idx`` (where ``ok``), from the
        iterate ``z`` and corrections ``incr`` (``[ball-and-box, half-space 1, ...]``, updated in place)."""
        a = self.ref[idx] - x64.unsqueeze(1)  # (b, K, D): a_j = x_j - x
        aa = (a * a).sum(-1).clamp_min(1e-300)
        c = self.c[rows].gather(1, idx)
        for _ in range(self.max_iter):
            z_before, incr_before = z, incr.clone()
            for k in range(idx.shape[1]):
                u = z + incr[k + 1]
                over = ((u - x64) * a[:, k]).sum(1) - c[:, k]
                step = torch.where(ok[:, k] & (over > 0), over / aa[:, k], torch.zeros_like(over))
                z = u - step.unsqueeze(1) * a[:, k]
                incr[k + 1] = u - z
            u = z + incr[0]
            z = project_ball_box(u, x64, self.eps, self.norm, self.bounds)
            incr[0] = u - z
            if float((z - z_before).abs().max()) <= self.tol and float((incr - incr_before).abs().max()) <= self.tol:
                break
        return z

    def _pull_inside(self, z: torch.Tensor, x64: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``x + t (z - x)`` with the largest ``t <= 1`` inside every shrunk half-space (``x`` is strictly
        inside all of them and the ball-and-box set is convex and holds both ends)."""
        d = z - x64
        ad = d @ self.ref.t() - (d * x64).sum(1, keepdim=True)
        c = self.c[rows]
        ratio = torch.where(ad > c, c / ad, torch.ones_like(ad))
        t = ratio.min(1, keepdim=True).values.clamp(0.0, 1.0) if ratio.shape[1] else torch.ones_like(d[:, :1])
        return x64 + t * d

    def _feasible_in_dtype(self, z64: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``z64`` in the pixels' dtype, pulled toward ``x`` again where rounding left the shrunk cell."""
        x64 = self.x64[rows]
        z = z64.to(self.dtype)
        for _ in range(4):
            bad = (self._excess(z.double(), rows) > 0).any(1)
            if not bool(bad.any()):
                return z
            pulled = self._pull_inside(z.double(), x64, rows)
            shrink = x64 + (pulled - x64) * (1.0 - 1e-6)
            z = torch.where(bad.unsqueeze(1), shrink.to(self.dtype), z)
        bad = (self._excess(z.double(), rows) > 0).any(1)
        return torch.where(bad.unsqueeze(1), self.x.flatten(1)[rows], z)


def _reference(reference, like: torch.Tensor, bounds) -> tuple[torch.Tensor, torch.Tensor]:
    ref, _ = check_pixels(reference, "reference", bounds)
    if ref.shape[1:] != like.shape[1:]:
        raise ValueError(
            f"reference: expected points of shape {tuple(like.shape[1:])} like x, got shape {tuple(ref.shape)}"
        )
    ref64 = ref.flatten(1).double()
    return ref64, (ref64 * ref64).sum(1)


def _check_margin_tol(margin, tol, max_iter) -> tuple[float, float, int]:
    return (
        float(check_positive(margin, "margin")),
        float(check_positive(tol, "tol")),
        check_positive(max_iter, "max_iter", integer=True),
    )


def _effective_eps(eps, norm: str, bounds, dim: int) -> float:
    """``eps`` validated (``>= 0``, ``inf`` allowed); ``inf`` with bounds becomes the radius from which on
    the ball holds the whole box (module docstring)."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps != eps:
        raise TypeError(f"eps: expected a number, got {eps!r}")
    if eps < 0:
        raise ValueError(f"eps: expected a non-negative value, got {eps}")
    if math.isinf(eps) and bounds is not None:
        span = bounds[1] - bounds[0]
        return span * math.sqrt(dim) if norm == "l2" else span
    return float(eps)


def voronoi_inner_radius(x, reference) -> torch.Tensor:
    """Half the Euclidean distance from each ``x`` to its nearest other reference point ``(N,)`` float64.

    It is the radius of the largest ball around ``x`` inside ``Vor(x)``: for ``eps`` below it (in L2)
    ``R_Vor(eps; x) = B(x, eps)`` [Kim, Art. III, Lemma 1 in App. A.1]; its minimum over the data is
    ``d_min / 2`` of [Kim, Art. III, Observation 1]. ``inf`` where the reference set holds only ``x``.

    Raises:
        TypeError / ValueError: as :func:`voronoi_project` for ``x`` and ``reference``.
    """
    xs, _ = check_pixels(x, "x", None)
    ref64, ref_sq = _reference(reference, xs, None)
    sq, is_self = _sq_distances(xs.flatten(1).double(), ref64, ref_sq)
    sq = sq.masked_fill(is_self, math.inf)
    return sq.min(1).values.sqrt() / 2.0


def voronoi_project(
    x_adv,
    x,
    reference,
    eps: float,
    *,
    norm: str = "l2",
    bounds: Bounds = (0.0, 1.0),
    margin: float = DEFAULT_MARGIN,
    tol: float = 1e-9,
    max_iter: int = 500,
    batch_size: int = 128,
) -> torch.Tensor:
    """Euclidean projection of ``x_adv`` onto ``Vor_m(x) ∩ B(x, eps) ∩ [lo, hi]^D`` [Kim, Art. III, Def. 3].

    Args:
        x_adv: points to project ``(N, ...)``, same shape as ``x``.
        x: the clean points ``(N, ...)`` (pixels: ``uint8`` or float in ``bounds``).
        reference: the reference set ``X`` ``(M, ...)`` (the training data), same per-point shape; the
            cell of ``x`` is taken in ``X ∪ {x}`` (reference points equal to ``x`` are ``x``).
        eps: ball radius ``>= 0``; ``inf`` for the cell (and box) alone.
        norm: the ball's norm, ``"l2"`` (Kim's definition) or ``"linf"`` (Euclidean cell, module docstring).
        bounds: pixel range ``(lo, hi)`` or ``None``.
        margin: distance kept from every bisector (strictly inside the open cell), ``> 0``.
        tol: Dykstra's stopping tolerance per cycle; ``max_iter``: its cycle limit.
        batch_size: points per batch; memory is ``O(batch_size * M)`` float64.

    Returns:
        ``(N, ...)`` points in the cell (at least ``margin`` from every bisector), the ball and the box,
        in the dtype of ``x_adv`` (float32 for ``uint8``), on the device of ``x``.

    Raises:
        TypeError: non-tensor or non-numeric inputs.
        ValueError: mismatched shapes; pixels outside ``bounds``; ``eps < 0``; unknown ``norm``;
            ``margin``, ``tol``, ``max_iter`` or ``batch_size`` not positive; a reference point other
            than ``x`` within ``2 * margin`` of ``x``.
    """
    bnds = check_bounds(bounds)
    norm = check_norm(norm)
    xs, _ = check_pixels(x, "x", bnds)
    ya, _ = check_pixels(x_adv, "x_adv", None)
    if ya.shape != xs.shape:
        raise ValueError(f"x_adv: expected the shape of x {tuple(xs.shape)}, got {tuple(ya.shape)}")
    margin, tol, max_iter = _check_margin_tol(margin, tol, max_iter)
    batch_size = check_batch_size(batch_size)
    ref64, ref_sq = _reference(reference, xs, bnds)
    eps_eff = _effective_eps(eps, norm, bnds, xs[0].numel())
    ref64, ref_sq = ref64.to(xs.device), ref_sq.to(xs.device)
    out = torch.empty_like(ya, device=xs.device)
    for s in range(0, xs.shape[0], batch_size):
        xb = xs[s : s + batch_size].to(ya.dtype)
        proj = _CellProjector(xb, ref64, ref_sq, eps_eff, norm, bnds, margin, tol, max_iter)
        out[s : s + batch_size] = proj(ya[s : s + batch_size].to(xs.device))
    return out


def voronoi_pgd(
    model: nn.Module,
    x,
    y,
    reference,
    eps: float,
    *,
    norm: str = "l2",
    steps: int = 10,
    step_size: Optional[float] = None,
    random_start: bool = True,
    targeted: bool = False,
    loss_fn: LossFn = None,
    preprocess: Preprocess = None,
    bounds: Bounds = (0.0, 1.0),
    margin: float = DEFAULT_MARGIN,
    tol: float = 1e-9,
    max_iter: int = 500,
    batch_size: int = 128,
    generator: Optional[torch.Generator] = None,
    device=None,
) -> torch.Tensor:
    """PGD of the Voronoi-epsilon adversary [Kim, Art. III, Def. 3]: every iterate, the random start
    included, is projected onto ``Vor_m(x) ∩ B(x, eps) ∩ [lo, hi]^D`` (:func:`voronoi_project`).

    Where the cell does not bind the iterates are exactly those of :func:`~shiftguard.adversarial.pgd`
    with the same generator. ``eps = inf`` is global robustness (module docstring). The step size
    defaults to ``2.5 * eps / steps`` (of the effective ``eps``); without ``bounds`` an infinite ``eps``
    needs ``step_size`` and ``random_start=False``. Other arguments as :func:`~shiftguard.adversarial.pgd`
    and :func:`voronoi_project`.

    Returns:
        Adversarial points ``(N, ...)`` (float32 for ``uint8`` ``x``: quantising could leave the cell),
        detached, on the device of ``x``.

    Raises:
        as :func:`~shiftguard.adversarial.pgd` and :func:`voronoi_project`; ``ValueError`` for an infinite
        ``eps`` without bounds and without ``step_size`` or with ``random_start``.
    """
    if reference is None:
        raise TypeError("reference: expected the reference set (training points), got None")
    return _region_pgd(
        model,
        x,
        y,
        reference,
        eps,
        norm=norm,
        steps=steps,
        step_size=step_size,
        random_start=random_start,
        targeted=targeted,
        loss_fn=loss_fn,
        preprocess=preprocess,
        bounds=bounds,
        margin=margin,
        tol=tol,
        max_iter=max_iter,
        batch_size=batch_size,
        generator=generator,
        device=device,
    )


def _region_pgd(
    model,
    x,
    y,
    reference,
    eps,
    *,
    norm,
    steps,
    step_size,
    random_start,
    targeted,
    loss_fn,
    preprocess,
    bounds,
    margin,
    tol,
    max_iter,
    batch_size,
    generator,
    device,
) -> torch.Tensor:
    """PGD in ``Vor_m(x) ∩ B(x, eps) ∩ box``, or in ``B(x, eps) ∩ box`` when ``reference`` is None."""
    bnds = check_bounds(bounds)
    norm = check_norm(norm)
    xs, _ = check_pixels(x, "x", bnds)
    margin, tol, max_iter = _check_margin_tol(margin, tol, max_iter)
    steps = check_positive(steps, "steps", integer=True)
    if step_size is not None:
        step_size = float(check_positive(step_size, "step_size"))
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator or None, got {type(generator).__name__}")
    eps_eff = _effective_eps(eps, norm, bnds, xs[0].numel())
    if math.isinf(eps_eff):
        if reference is None:
            raise ValueError("eps: an infinite eps needs bounds for the standard adversary")
        if step_size is None:
            raise ValueError("step_size: an infinite eps without bounds needs an explicit step_size")
        if random_start:
            raise ValueError("random_start: an infinite eps without bounds has no uniform start; pass False")
    alpha = step_size if step_size is not None else default_step_size("pgd", eps_eff, steps)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    dev = torch.device(device) if device is not None else default_device(model, xs)
    make_projector = None
    if reference is not None:
        ref64, ref_sq = _reference(reference, xs, bnds)
        ref64, ref_sq = ref64.to(dev), ref_sq.to(dev)

        def make_projector(xb: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
            return _CellProjector(xb, ref64, ref_sq, eps_eff, norm, bnds, margin, tol, max_iter)

    return run_attack(
        model,
        xs,
        y,
        eps_eff,
        norm=norm,
        steps=steps,
        step_size=alpha,
        random_start=bool(random_start),
        targeted=bool(targeted),
        loss_fn=loss_fn,
        preprocess=preprocess,
        bounds=bnds,
        batch_size=check_batch_size(batch_size),
        generator=generator,
        device=dev,
        make_projector=make_projector,
        quantise=False,
    )


def _accuracy(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    preprocess: Preprocess,
    predict: Optional[Callable[[torch.Tensor], torch.Tensor]],
    batch_size: int,
    device,
) -> float:
    """Fraction of ``images`` whose prediction (``argmax`` of the logits, or ``predict(outputs)``) is the label."""
    correct = 0
    with eval_mode(model), torch.no_grad():
        for s in range(0, images.shape[0], batch_size):
            xb = images[s : s + batch_size].to(device)
            out = model(preprocess(xb) if preprocess is not None else xb)
            pred = predict(out) if predict is not None else out.argmax(1)
            correct += int((pred.to(labels.device).long() == labels[s : s + batch_size]).sum())
    return correct / images.shape[0]


def _eps_list(eps_values) -> list[float]:
    if isinstance(eps_values, (int, float)) and not isinstance(eps_values, bool):
        eps_values = [eps_values]
    try:
        values = list(eps_values)
    except TypeError as exc:
        raise TypeError(f"eps_values: expected a sequence of numbers, got {type(eps_values).__name__}") from exc
    if not values:
        raise ValueError("eps_values: expected at least one eps")
    for e in values:
        if isinstance(e, bool) or not isinstance(e, (int, float)) or e != e or e < 0:
            raise ValueError(f"eps_values: expected non-negative numbers, got {e!r}")
    return [float(e) for e in values]


def _adversarial_accuracy(
    model,
    x,
    y,
    reference,
    eps_values,
    *,
    norm,
    steps,
    step_size,
    random_start,
    loss_fn,
    preprocess,
    predict,
    bounds,
    margin,
    seed,
    batch_size,
    device,
) -> dict[float, float]:
    xs, _ = check_pixels(x, "x", check_bounds(bounds))
    labels = check_labels(y, "y", n=xs.shape[0])
    check_callable(predict, "predict")
    seed = check_positive(seed, "seed", strict=False, integer=True)
    batch_size = check_batch_size(batch_size)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    dev = torch.device(device) if device is not None else default_device(model, xs)
    result: dict[float, float] = {}
    for eps in _eps_list(eps_values):
        adv = _region_pgd(
            model,
            xs,
            labels,
            reference,
            eps,
            norm=norm,
            steps=steps,
            step_size=step_size,
            random_start=random_start,
            targeted=False,
            loss_fn=loss_fn,
            preprocess=preprocess,
            bounds=bounds,
            margin=margin,
            tol=1e-9,
            max_iter=500,
            batch_size=batch_size,
            generator=torch.Generator().manual_seed(seed),
            device=dev,
        )
        result[eps] = _accuracy(model, adv, labels, preprocess, predict, batch_size, dev)
    return result


def voronoi_adversarial_accuracy(
    model: nn.Module,
    x,
    y,
    reference,
    eps_values: Sequence[float] | float,
    *,
    norm: str = "l2",
    steps: int = 10,
    step_size: Optional[float] = None,
    random_start: bool = True,
    loss_fn: LossFn = None,
    preprocess: Preprocess = None,
    predict: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    bounds: Bounds = (0.0, 1.0),
    margin: float = DEFAULT_MARGIN,
    seed: int = 0,
    batch_size: int = 128,
    device=None,
) -> dict[float, float]:
    """Voronoi-epsilon adversarial accuracy ``a_Vor(eps)`` for each ``eps`` [Kim, Art. III, Def. 3].

    The fraction of ``(x, y)`` still classified ``y`` after :func:`voronoi_pgd` (untargeted, on
    ``loss_fn``). Kim defines it on the training data: pass the training points as both ``x`` (or a
    subset) and ``reference``. ``eps = inf`` gives global robustness (:func:`global_voronoi_robustness`).

    Args:
        predict: maps the model's outputs of a batch to predicted labels ``(B,)``; default ``argmax(1)``
            of logits (pass one for an embedding model, e.g. a fitted head).
        seed: seeds the random start; the same seed for every ``eps`` and for
            :func:`standard_adversarial_accuracy`, so both see the same attack where the cell does not bind.
        Others: as :func:`voronoi_pgd`.

    Returns:
        ``{eps: accuracy}`` in the order of ``eps_values`` (accuracy in [0, 1]).

    Raises:
        as :func:`voronoi_pgd`; ``ValueError`` for empty or negative ``eps_values`` and ``y`` not ``(N,)``.
    """
    if reference is None:
        raise TypeError("reference: expected the reference set (training points), got None")
    return _adversarial_accuracy(
        model,
        x,
        y,
        reference,
        eps_values,
        norm=norm,
        steps=steps,
        step_size=step_size,
        random_start=random_start,
        loss_fn=loss_fn,
        preprocess=preprocess,
        predict=predict,
        bounds=bounds,
        margin=margin,
        seed=seed,
        batch_size=batch_size,
        device=device,
    )


def standard_adversarial_accuracy(
    model: nn.Module,
    x,
    y,
    eps_values: Sequence[float] | float,
    *,
    norm: str = "l2",
    steps: int = 10,
    step_size: Optional[float] = None,
    random_start: bool = True,
    loss_fn: LossFn = None,
    preprocess: Preprocess = None,
    predict: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    bounds: Bounds = (0.0, 1.0),
    seed: int = 0,
    batch_size: int = 128,
    device=None,
) -> dict[float, float]:
    """Standard adversarial accuracy ``a_std(eps)`` [Kim, Art. III, Def. 2]: the attack of
    :func:`voronoi_adversarial_accuracy` in ``B(x, eps) ∩ [lo, hi]^D`` alone (PGD with the same seed,
    steps and step sizes; ``eps = inf`` with bounds is the whole box). Arguments, return value and
    errors as :func:`voronoi_adversarial_accuracy`."""
    return _adversarial_accuracy(
        model,
        x,
        y,
        None,
        eps_values,
        norm=norm,
        steps=steps,
        step_size=step_size,
        random_start=random_start,
        loss_fn=loss_fn,
        preprocess=preprocess,
        predict=predict,
        bounds=bounds,
        margin=DEFAULT_MARGIN,
        seed=seed,
        batch_size=batch_size,
        device=device,
    )


def global_voronoi_robustness(model: nn.Module, x, y, reference, **kwargs) -> float:
    """Global Voronoi-epsilon robustness ``a_global = lim_{eps -> inf} a_Vor(eps)`` [Kim, Art. III, Def. 4].

    :func:`voronoi_adversarial_accuracy` at ``eps = inf``: with pixel bounds the limit is reached at
    the radius from which the ball holds the box (module docstring). A 1-NN classifier on the
    reference set scores 1 on it [Kim, Art. III, Theorem 1]. ``kwargs`` as
    :func:`voronoi_adversarial_accuracy`.
    """
    return voronoi_adversarial_accuracy(model, x, y, reference, [math.inf], **kwargs)[math.inf]
