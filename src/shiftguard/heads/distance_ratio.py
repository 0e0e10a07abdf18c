"""Distance-ratio (DR) head [Kim, Art. II, eq. (5)]: ``p(c|x) = d_c^-rho / sum_y d_y^-rho`` over
class representatives, with a learnable ``rho > 0``.

- Representatives: class means of the support embeddings (prototypes, as in the prototypical
  networks of [Kim, Art. II, Sec. 3]) or user-given proxies ``(C, D)``.
- Computed as ``log_softmax(-rho * log d)`` ([Kim, Art. II, Sec. 3]: "replacing ... -d^2 by -rho ln d"),
  with ``log d = 0.5 * log(max(d^2, eps))``; eps is tiny so the limit of [Kim, Art. II, eq. (5)] holds:
  a query at distance 0 of exactly one representative gets probability 1 for that class (up to
  floating point), 0 for the others.
- ``rho = exp(log_rho)`` with ``log_rho`` initialised at 2.0 ([Kim, Art. II, Sec. 3]: "We set the initial
  parameter for ln(rho) as 2.0") and fitted by NLL with L-BFGS (SciPy, autograd gradient; the NLL is convex in
  rho) on ``val_*`` when given, else on
  the support itself (a single scalar, so in-sample fitting is benign).
- Scale: the DR probabilities do not change when every embedding and representative is multiplied
  by the same ``a > 0`` [Kim, Art. II, eq. (6)]. Where squared distances would overflow the dtype (or
  vanish below its normal range), embeddings and representatives are divided by a common power of
  two first (exact; ``distance_scale_exponent``), so any finite input gives finite probabilities;
  the floor then applies to the rescaled squared distances. Class means are formed the same way.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from shiftguard._validation import check_positive, check_tensor
from shiftguard.functional.scaling import distance_scale_exponent, ldexp
from shiftguard.heads._optim import minimize_lbfgs
from shiftguard.heads.base import EmbeddingHead

__all__ = ["DistanceRatioHead", "distance_ratio_log_probs"]

#: floor on the squared distance inside the log: exp(-690) ~ 1e-300 (float64) / clamps to 0 in fp32
_SQ_DIST_FLOOR = {torch.float64: 1e-300, torch.float32: 1e-37, torch.float16: 1e-7, torch.bfloat16: 1e-37}


def _exact_sq_dists(x: torch.Tensor, reps: torch.Tensor, max_elems: int = 4_000_000) -> torch.Tensor:
    """``||x_i - r_c||^2`` by direct differences (exact 0 at a representative), chunked over rows."""
    rows = max(1, max_elems // max(1, reps.shape[0] * reps.shape[1]))
    return (
        torch.cat(
            [(x[s : s + rows].unsqueeze(1) - reps.unsqueeze(0)).pow(2).sum(-1) for s in range(0, x.shape[0], rows)]
        )
        if x.shape[0]
        else x.new_zeros(0, reps.shape[0])
    )


def distance_ratio_log_probs(
    embeddings: torch.Tensor, representatives: torch.Tensor, rho: torch.Tensor | float
) -> torch.Tensor:
    """[Kim, Art. II, eq. (5)] in log space: ``log p (N, C)`` for embeddings ``(N, D)``, reps ``(C, D)``.

    Finite for every finite input: out-of-range magnitudes are rescaled by a common power of two
    first (module docstring; eq. (6) makes the result independent of that scale).
    """
    e = distance_scale_exponent(embeddings, representatives)
    if e:
        embeddings, representatives = ldexp(embeddings, -e), ldexp(representatives, -e)
    sq = _exact_sq_dists(embeddings, representatives)
    floor = _SQ_DIST_FLOOR.get(sq.dtype, 1e-37)
    log_d = 0.5 * torch.log(sq.clamp(min=floor))
    return F.log_softmax(-rho * log_d, dim=1)


class DistanceRatioHead(EmbeddingHead):
    """DR probabilities over class prototypes or given proxies [Kim, Art. II].

    Args:
        proxies: optional ``(C, D)`` class representatives; default: class means of the support.
        init_log_rho: initial ``ln rho`` (default 2.0, [Kim, Art. II, Sec. 3]).
        max_iter: L-BFGS iterations for ``log_rho``.
        num_classes: number of classes; inferred when None.

    Learned state: ``representatives_ (C, D)``, ``rho_``, ``num_classes_``, ``classes_``.
    """

    _param_names = ("init_log_rho", "num_classes")

    def __init__(
        self,
        proxies: Optional[torch.Tensor] = None,
        init_log_rho: float = 2.0,
        max_iter: int = 100,
        num_classes: Optional[int] = None,
    ):
        super().__init__(num_classes)
        self.proxies = proxies
        self.init_log_rho = init_log_rho
        self.max_iter = max_iter

    def _validate_params(self) -> None:
        super()._validate_params()
        try:
            init_log_rho = float(self.init_log_rho)
        except (TypeError, ValueError):
            raise TypeError(f"init_log_rho: expected a number, got {type(self.init_log_rho).__name__}") from None
        if not math.isfinite(init_log_rho):
            raise ValueError(f"init_log_rho: expected a finite number, got {self.init_log_rho}")
        check_positive(self.max_iter, "max_iter", integer=True)

    def fit(self, train_embeddings, train_labels, val_embeddings=None, val_labels=None):
        self._validate_params()
        self._no_validation(val_embeddings, val_labels)
        emb, y, num_classes = self._check_fit_inputs(
            train_embeddings, train_labels, require_all_classes=self.proxies is None
        )
        if self.proxies is not None:
            reps = check_tensor(self.proxies, "proxies", ndim=2, floating=True, finite=True, nonempty=True)
            if reps.shape[1] != emb.shape[1]:
                raise ValueError(f"proxies: expected {emb.shape[1]} features, got {reps.shape[1]}")
            if reps.shape[0] < num_classes:
                raise ValueError(f"proxies: {reps.shape[0]} rows but labels need {num_classes} classes")
            num_classes = reps.shape[0]
            reps = reps.to(emb.device, emb.dtype)
        else:
            # A class mean lies within the range of its members, but the sums need not: they are
            # formed on embeddings divided by a power of two where they could overflow (exact).
            e = distance_scale_exponent(emb, dim=1, lower=False)
            sums = torch.zeros(num_classes, emb.shape[1], dtype=emb.dtype, device=emb.device)
            sums.index_add_(0, y, ldexp(emb, -e) if e else emb)
            reps = sums / torch.bincount(y, minlength=num_classes).unsqueeze(1).to(emb.dtype)
            if e:
                reps = ldexp(reps, e)
        val_emb, val_y = self._check_val_inputs(val_embeddings, val_labels, emb.shape[1], num_classes)
        x, t = (val_emb, val_y) if val_emb is not None else (emb, y)
        x, reps64 = x.double(), reps.double()
        e = distance_scale_exponent(x, reps64)
        if e:  # only float64 input can leave the range: float32 magnitudes square safely in float64
            x, reps64 = ldexp(x, -e), ldexp(reps64, -e)
        # log d does not depend on rho: compute it once.
        sq = _exact_sq_dists(x, reps64)
        log_d = 0.5 * torch.log(sq.clamp(min=_SQ_DIST_FLOOR[torch.float64]))
        theta, _, _ = minimize_lbfgs(
            lambda p: F.nll_loss(F.log_softmax(-torch.exp(p[0]) * log_d, dim=1), t),
            torch.tensor([float(self.init_log_rho)], dtype=torch.float64, device=x.device),
            max_iter=self.max_iter,
        )
        self.rho_ = float(torch.exp(theta[0]))
        if not 0.0 < self.rho_ < math.inf:
            name = "val_embeddings" if val_emb is not None else "train_embeddings"
            raise ValueError(
                f"{name}: the NLL of rho has no finite minimiser here (L-BFGS reached "
                f"ln rho = {float(theta[0]):.4g}); every point is much nearer its own class "
                "representative than the others, so the DR head cannot fit rho"
            )
        self.representatives_ = reps
        self._set_classes(num_classes, emb.device)
        return self

    def predict_log_proba(self, embeddings) -> torch.Tensor:
        self._check_is_fitted()
        emb = self._check_query(embeddings, self.representatives_.shape[1])
        return distance_ratio_log_probs(emb, self.representatives_.to(emb.dtype), self.rho_)

    def predict_proba(self, embeddings) -> torch.Tensor:
        return self.predict_log_proba(embeddings).exp()
