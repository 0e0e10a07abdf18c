"""Split conformal prediction sets from class probabilities: LAC, APS and RAPS.

A method defines a non-conformity score ``S(x, c)`` for every candidate label ``c`` of an input
with class probabilities ``p``; a calibration set of ``n`` labelled inputs (never data the
probabilities were fitted on) gives the scores ``s_i = S(x_i, y_i)``, and the set of a new input
is ``{c : S(x, c) <= q}`` with ``q`` the ``ceil((n + 1)(1 - alpha))``-th smallest calibration score
(``+inf`` when that rank exceeds ``n``: every label). On exchangeable data the set holds the true
label with probability at least ``1 - alpha`` (and, with continuous scores, at most
``1 - alpha + 1 / (n + 1)``) (Vovk, Gammerman & Shafer 2005; Lei et al. 2018, Thm. 2.2).

- ``"lac"`` (Sadinle, Lei & Wasserman, JASA 2019; "THR"): ``S(x, c) = 1 - p_c``. The smallest
  average sets; they may be empty.
- ``"aps"`` (Romano, Sesia & Candes, NeurIPS 2020, Sec. 2): labels sorted by decreasing
  probability, ``S(x, c)`` = the probability mass ranked above ``c`` plus ``u * p_c``. Randomised
  (the paper's default): ``u ~ U(0, 1)``, drawn per input, the same draw for the calibration score
  and for every label of a test set (exact coverage ``1 - alpha`` in expectation; sets may be
  empty). Not randomised: calibration scores with ``u = 1`` (the mass up to and including the true
  label) and test sets with ``u = 0`` (every label whose preceding mass is at most ``q``, i.e. up to
  and including the label that crosses ``q``; never empty, conservative).
- ``"raps"`` (Angelopoulos, Bates, Malik & Jordan, ICLR 2021, Sec. 2.2): APS plus
  ``lam * max(0, rank(c) - k_reg)``, rank 1-based. Without ``k_reg`` / ``lam`` they are tuned on a
  held-out fraction ``tune_fraction`` of the calibration data, which then does not enter ``q``
  (Sec. 2.3 and App. E): ``k_reg`` the conformal ``1 - alpha`` quantile of the true labels' ranks,
  ``lam`` the value of ``{0.001, 0.01, 0.1, 0.2, 0.5}`` with the smallest mean set size.
- ``mondrian=True``: class-conditional (Mondrian) conformal prediction (Vovk et al. 2005, Ch. 4.5;
  Sadinle et al. 2019, Sec. 4.3): one threshold per class from the calibration scores of that
  class, so that every class is covered at ``1 - alpha``.

Ties: a label whose score equals ``q`` is in the set, and so is one within ``TOLERANCE`` (1e-8)
above it, as MAPIE compares, so that a score equal to ``q`` up to the rounding of a cumulative sum
is not left out. Scores, thresholds and sets are computed in float64.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from shiftguard._validation import check_labels, check_same_length, check_tensor

__all__ = ["METHODS", "LAMBDA_GRID", "TOLERANCE", "SplitConformal", "conformal_quantile", "score_matrix"]

METHODS = ("lac", "aps", "raps")
#: The candidate regularisation strengths of RAPS (Angelopoulos et al. 2021, App. E; MAPIE's grid).
LAMBDA_GRID = (0.001, 0.01, 0.1, 0.2, 0.5)
#: A label whose score exceeds the threshold by at most this much is in the set (MAPIE's EPSILON).
TOLERANCE = 1e-8


def _check_probs(probs, name: str) -> torch.Tensor:
    p = check_tensor(probs, name, ndim=2, floating=True, finite=True)
    if p.shape[1] < 2:
        raise ValueError(f"{name}: expected probabilities over at least 2 classes, got shape {tuple(p.shape)}")
    p = p.double()
    if p.numel() and (bool((p < 0).any()) or bool(((p.sum(1) - 1).abs() > 1e-3).any())):
        raise ValueError(f"{name}: expected class probabilities (non-negative rows summing to 1)")
    return p


def _check_uniform(u, n: int, name: str, device) -> Optional[torch.Tensor]:
    if u is None:
        return None
    u = check_tensor(u, name, ndim=1, floating=True, finite=True).double().to(device)
    if u.shape[0] != n or bool(((u < 0) | (u > 1)).any()):
        raise ValueError(f"{name}: expected {n} numbers in [0, 1], got shape {tuple(u.shape)}")
    return u


def score_matrix(probs: torch.Tensor, method: str, u: torch.Tensor, k_reg: int = 0, lam: float = 0.0) -> torch.Tensor:
    """``S(x, c)`` ``(N, C)`` float64 of every label of every input (module docstring); ``u`` ``(N,)``
    the uniform draw of each input (APS / RAPS)."""
    p = probs.double()
    if method == "lac":
        return 1.0 - p
    order = torch.argsort(-p, dim=1, stable=True)  # decreasing probability; ties in label order
    sorted_p = torch.gather(p, 1, order)
    scores = torch.cumsum(sorted_p, dim=1) - (1.0 - u.double()[:, None]) * sorted_p
    if method == "raps":
        rank = torch.arange(1, p.shape[1] + 1, dtype=p.dtype, device=p.device)
        scores = scores + lam * torch.clamp(rank - k_reg, min=0.0)[None, :]
    out = torch.empty_like(scores)
    out.scatter_(1, order, scores)
    return out


def conformal_quantile(scores: torch.Tensor, alpha: float) -> float:
    """The ``ceil((n + 1)(1 - alpha))``-th smallest of ``scores`` (``+inf`` when that rank exceeds
    ``n``, including ``n = 0``): the threshold of split conformal prediction."""
    n = int(scores.numel())
    k = math.ceil((n + 1) * (1.0 - alpha) - 1e-12)  # the guard keeps an exact integer from rounding up
    if k > n:
        return math.inf
    return float(torch.sort(scores.double().flatten()).values[k - 1])


class SplitConformal:
    """Split conformal prediction sets from a classifier's probabilities (scikit-learn style).

    Args:
        method: ``"lac"``, ``"aps"`` or ``"raps"`` (module docstring).
        alpha: the miscoverage level; sets hold the true label with probability >= ``1 - alpha``.
        randomized: APS / RAPS with the uniform draw of Romano et al. (default) or the
            deterministic, conservative variant.
        k_reg, lam: RAPS's regularisation; ``None`` tunes them (module docstring).
        tune_fraction: the share of the calibration data that tunes RAPS's missing ``k_reg`` / ``lam``.
        mondrian: one threshold per class (class-conditional coverage).
        seed: seed of the uniform draws and of RAPS's tuning split.

    ``fit(cal_probs, cal_labels)`` learns ``threshold_`` (a float, or ``(C,)`` per class with
    ``mondrian``), ``n_calibration_``, ``classes_``, ``scores_`` and ``kept_`` (the calibration rows
    the scores come from: all of them, except RAPS's tuning rows) and, for RAPS, ``k_reg_`` and ``lam_``;
    ``predict_sets(probs)`` returns ``(N, C)`` bool sets. ``uniform=`` in either gives the draws
    ``(N,)`` explicitly (to reproduce another implementation's); otherwise they come from a
    generator seeded with ``seed`` (calibration) and ``seed + 1`` (prediction).
    """

    def __init__(
        self,
        method: str = "lac",
        alpha: float = 0.1,
        *,
        randomized: bool = True,
        k_reg: Optional[int] = None,
        lam: Optional[float] = None,
        tune_fraction: float = 0.2,
        mondrian: bool = False,
        seed: int = 0,
    ):
        if method not in METHODS:
            raise ValueError(f"method: expected one of {', '.join(METHODS)}, got {method!r}")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 < float(alpha) < 1.0:
            raise ValueError(f"alpha: expected a miscoverage level in (0, 1), got {alpha!r}")
        if not isinstance(randomized, bool):
            raise TypeError(f"randomized: expected a bool, got {type(randomized).__name__}")
        if k_reg is not None and (isinstance(k_reg, bool) or not isinstance(k_reg, int) or k_reg < 0):
            raise ValueError(f"k_reg: expected an integer >= 0 or None, got {k_reg!r}")
        if lam is not None and (
            isinstance(lam, bool) or not isinstance(lam, (int, float)) or not (math.isfinite(lam) and lam >= 0)
        ):
            raise ValueError(f"lam: expected a finite number >= 0 or None, got {lam!r}")
        if method != "raps" and (k_reg is not None or lam is not None):
            raise ValueError(f"k_reg, lam: RAPS's regularisation, not used by method {method!r}")
        if not 0.0 < float(tune_fraction) < 1.0:
            raise ValueError(f"tune_fraction: expected a fraction in (0, 1), got {tune_fraction!r}")
        self.method = method
        self.alpha = float(alpha)
        self.randomized = randomized
        self.k_reg = k_reg
        self.lam = lam
        self.tune_fraction = float(tune_fraction)
        self.mondrian = bool(mondrian)
        self.seed = int(seed)

    def __repr__(self) -> str:
        return (
            f"SplitConformal(method={self.method!r}, alpha={self.alpha}, randomized={self.randomized}, "
            f"k_reg={self.k_reg}, lam={self.lam}, mondrian={self.mondrian})"
        )

    # -- fitting ----------------------------------------------------------------------------------
    def _draws(self, n: int, seed: int, device) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.rand(n, generator=g, dtype=torch.float64).to(device)

    def _cal_u(self, n: int, uniform, device) -> torch.Tensor:
        u = _check_uniform(uniform, n, "uniform", device)
        if u is not None:
            return u
        if self.method == "lac" or not self.randomized:
            return torch.ones(n, dtype=torch.float64, device=device)  # the mass up to and including the label
        return self._draws(n, self.seed, device)

    def _tune(self, p: torch.Tensor, y: torch.Tensor) -> tuple[int, float]:
        """RAPS's ``k_reg`` and ``lam`` from the tuning rows (module docstring)."""
        order = torch.argsort(-p, dim=1, stable=True)
        ranks = torch.argsort(order, dim=1)[torch.arange(p.shape[0], device=p.device), y]  # 0-based
        k_reg = self.k_reg
        if k_reg is None:
            q = conformal_quantile(ranks.double(), self.alpha)
            k_reg = int(p.shape[1] if math.isinf(q) else q) + 1
        if self.lam is not None:
            return k_reg, float(self.lam)
        ones = torch.ones(p.shape[0], dtype=torch.float64, device=p.device)
        best, best_size = LAMBDA_GRID[0], math.inf
        for lam in LAMBDA_GRID:  # deterministic scores: the size comparison does not depend on draws
            s = score_matrix(p, "raps", ones, k_reg, lam)[torch.arange(p.shape[0], device=p.device), y]
            q = conformal_quantile(s, self.alpha)
            size = float(
                (score_matrix(p, "raps", torch.zeros_like(ones), k_reg, lam) <= q + TOLERANCE).sum(1).double().mean()
            )
            if size < best_size - TOLERANCE:
                best, best_size = lam, size
        return k_reg, float(best)

    def fit(self, cal_probs, cal_labels, uniform=None) -> "SplitConformal":
        """Calibrate on held-out ``cal_probs`` ``(n, C)`` and ``cal_labels`` ``(n,)``."""
        p = _check_probs(cal_probs, "cal_probs")
        y = check_labels(cal_labels, "cal_labels", num_classes=p.shape[1]).to(p.device)
        check_same_length([("cal_probs", p), ("cal_labels", y)])
        if p.shape[0] == 0:
            raise ValueError("cal_probs: expected at least one calibration example")
        u = self._cal_u(p.shape[0], uniform, p.device)
        self.k_reg_, self.lam_ = 0, 0.0
        self.kept_ = torch.arange(p.shape[0])
        self.n_fit_ = int(p.shape[0])
        if self.method == "raps":
            if self.k_reg is None or self.lam is None:
                perm = torch.randperm(p.shape[0], generator=torch.Generator().manual_seed(self.seed + 2))
                n_tune = max(1, int(round(self.tune_fraction * p.shape[0])))
                if n_tune >= p.shape[0]:
                    raise ValueError(
                        f"cal_probs: {p.shape[0]} calibration examples leave none after RAPS's tuning "
                        "split; give more, or k_reg and lam"
                    )
                tune, keep = perm[:n_tune].to(p.device), perm[n_tune:].to(p.device)
                self.k_reg_, self.lam_ = self._tune(p[tune], y[tune])
                p, y, u = p[keep], y[keep], u[keep]
                self.kept_ = keep.cpu()
            else:
                self.k_reg_, self.lam_ = int(self.k_reg), float(self.lam)
        scores = score_matrix(p, self.method, u, self.k_reg_, self.lam_)[torch.arange(p.shape[0], device=p.device), y]
        self.scores_ = scores
        self.threshold_: float | torch.Tensor
        if self.mondrian:
            self.threshold_ = torch.tensor(
                [conformal_quantile(scores[y == c], self.alpha) for c in range(p.shape[1])], dtype=torch.float64
            )
        else:
            self.threshold_ = conformal_quantile(scores, self.alpha)
        self.n_calibration_ = int(p.shape[0])
        self.classes_ = torch.arange(p.shape[1])
        return self

    # -- prediction -------------------------------------------------------------------------------
    def _check_fitted(self) -> None:
        if not hasattr(self, "threshold_"):
            from shiftguard.heads import NotFittedError

            raise NotFittedError("SplitConformal is not fitted yet; call fit(cal_probs, cal_labels) first")

    def test_scores(self, probs, uniform=None, seed_offset: int = 1) -> torch.Tensor:
        """``S(x, c)`` ``(N, C)`` of every label of ``probs`` under the fitted method."""
        self._check_fitted()
        p = _check_probs(probs, "probs")
        if p.shape[1] != len(self.classes_):
            raise ValueError(f"probs: {p.shape[1]} classes, calibrated on {len(self.classes_)}")
        u = _check_uniform(uniform, p.shape[0], "uniform", p.device)
        if u is None:
            if self.method == "lac" or not self.randomized:
                u = torch.zeros(p.shape[0], dtype=torch.float64, device=p.device)
            else:
                u = self._draws(p.shape[0], self.seed + seed_offset, p.device)
        return score_matrix(p, self.method, u, self.k_reg_, self.lam_)

    def predict_sets(self, probs, uniform=None) -> torch.Tensor:
        """``(N, C)`` bool prediction sets of ``probs``: ``{c : S(x, c) <= threshold_}``."""
        s = self.test_scores(probs, uniform)
        q = self.threshold_
        q = q.to(s.device)[None, :] if isinstance(q, torch.Tensor) else torch.tensor(q, dtype=torch.float64)
        return s <= q + TOLERANCE
