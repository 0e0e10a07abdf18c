"""NED confidence [NED, Sec. 2, eq. (3), Alg. 1]: a softmax over the negative squared
distances to the k nearest support embeddings, with one temperature fitted by NLL.

    p(c|z) = sum_{i in kNN(z), y_i = c} exp(-||z - z_i||^2 / T) / sum_{i in kNN(z)} exp(-||z - z_i||^2 / T)

([NED, eq. (3)]; the Gaussian-kernel derivation is [NED, App. A, eqs. (8)-(19)], with T = 2 alpha.)
Computed as ``softmax(-d / T)`` over the k neighbours (log-sum-exp stable) scattered into classes.

Fitting T ([NED, Sec. 2], "We optimize T with respect to the negative log likelihood on the support
set instead of optimizing on held-out validation dataset"; the abstract speaks of a held-out set):

- ``fit_mode="loo"`` (default, what [NED, Sec. 2] says): support embeddings are queries against the
  rest of the support (their own row excluded; a random subset of ``max_fit_queries`` of them,
  default 5000, for large supports), so T is fitted on exactly the neighbourhood statistics
  the test queries will see, with no data held back from the support.
- ``fit_mode="holdout"``: T is fitted on calibration queries against a support that excludes them:
  on ``val_embeddings``/``val_labels`` against the full support when given, otherwise on a random
  ``holdout_fraction`` of the support against the rest. Predictions always use the full support.

Calibration points whose k neighbours contain no example of their own class have NLL +inf for every
T (no T can help them); they are left out of the fit and counted in ``n_fit_excluded_``.
T is found by bounded Brent minimisation of the NLL over ``log T`` (``scipy.optimize``).

Scale: a common factor ``a`` on every embedding multiplies the squared distances and the fitted T by
``a^2`` and leaves the probabilities unchanged. Where squared distances would overflow the dtype (or
vanish below its normal range), the searches run on embeddings divided by a common power of two
(exact; ``distance_scale_exponent``) and ``temperature_`` is converted back to squared-distance units
of the input, so any finite input gives finite probabilities; if that ``temperature_`` itself is
not a finite float64, ``fit`` raises ``ValueError`` naming ``train_embeddings``.

k: [NED] gives no single value; its Fig. 2 shows NED's accuracy rising with k and flattening, while
kNN/WkNN degrade. We default to ``k=10``, large enough to sit on that plateau for class sizes of
the order of hundreds, and small enough for fast search; pass ``k`` to change it.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from scipy.optimize import minimize_scalar

from shiftguard._validation import check_positive
from shiftguard.functional.scaling import distance_scale_exponent, ldexp
from shiftguard.heads.knn_baselines import KNNHeadBase
from shiftguard.neighbors import PrunedKNNIndex, SearchCache, knn_search

__all__ = ["NED", "ned_probabilities", "ned_nll"]


def ned_probabilities(
    sq_dist: torch.Tensor, nbr_labels: torch.Tensor, temperature: float, num_classes: int
) -> torch.Tensor:
    """[NED, eq. (3)]: class probabilities ``(N, C)`` from sorted squared distances ``(N, k)``."""
    finfo = torch.finfo(sq_dist.dtype)
    ordinary = (
        finfo.tiny <= temperature <= finfo.max
        and bool(torch.isfinite(sq_dist).all())
        and (sq_dist.numel() == 0 or float(sq_dist.max()) / temperature < finfo.max)
    )
    if ordinary:
        w = torch.softmax(-sq_dist / temperature, dim=1)
    else:
        w = _shifted_weights(sq_dist, 0, temperature).to(sq_dist.dtype)
    probs = torch.zeros(sq_dist.shape[0], num_classes, dtype=w.dtype, device=w.device)
    return probs.scatter_add_(1, nbr_labels, w)


def _shifted_weights(sq_dist: torch.Tensor, exponent: int, temperature: float) -> torch.Tensor:
    """Eq. (3) weights in float64 for squared distances ``sq_dist * 4**exponent`` (rows sorted).

    ``softmax(-d / T)`` is computed as ``softmax(-(d - d_1) / T)``: the nearest neighbour's logit is
    exactly 0, a logit that overflows is ``-inf`` (weight 0, the limit), so no row is NaN for any
    finite distances and any ``T > 0``; ``T`` may be as small or large as a float64 allows.
    """
    gap = ldexp(sq_dist.double() - sq_dist[:, :1].double(), 2 * exponent)
    logits = torch.where(gap > 0, -gap / temperature, torch.zeros_like(gap))
    return torch.softmax(logits, dim=1)


def ned_nll(sq_dist: torch.Tensor, same_class: torch.Tensor, log_temperature: float) -> float:
    """Mean NLL of the true class under eq. (3): ``-(lse_{same}(-d/T) - lse_{all}(-d/T))``."""
    logits = -sq_dist / math.exp(log_temperature)
    log_num = torch.logsumexp(logits.masked_fill(~same_class, float("-inf")), dim=1)
    log_den = torch.logsumexp(logits, dim=1)
    return float((log_den - log_num).mean())


class NED(KNNHeadBase):
    """Normalised exponential of distances to the k nearest support embeddings [NED, Alg. 1].

    Args:
        k: neighbours per query (default 10; see the module docstring).
        fit_mode: ``"loo"`` (leave-one-out on the support, default) or ``"holdout"``.
        holdout_fraction: share of the support used as calibration queries in ``"holdout"`` mode
            when no ``val_*`` set is passed to ``fit``.
        backend: kNN back end (``"torch"``, ``"faiss"``, ``"pruned"``, ``"auto"``), see
            ``knn_search``. With ``"pruned"`` the index of the support is built once in ``fit``
            and reused by the leave-one-out fit and by every prediction (``knn_index_``).
        max_fit_queries: at most this many calibration queries (a random subset, drawn with
            ``seed``) enter the NLL; one scalar needs few, and the search cost is
            ``queries x support``. ``None`` uses all (exact leave-one-out over the whole support).
        seed: seed of the random holdout split and of the calibration subset.
        num_classes: number of classes; inferred as ``max(label) + 1`` when None.
        searches: a :class:`~shiftguard.neighbors.SearchCache` shared with the kNN heads of the
            same support: predictions then search through it (one search per query for heads of
            the same ``k`` and back end, the same answers) instead of ``knn_index_``. The fit
            searches on its own.

    Learned state: ``temperature_``, ``nll_`` (calibration NLL at ``temperature_``),
    ``n_fit_excluded_``, ``support_embeddings_``, ``support_labels_``, ``num_classes_``, ``classes_``,
    ``knn_index_`` (the ``PrunedKNNIndex`` of the support with ``backend="pruned"``, else None;
    it holds a reordered copy of the support).
    """

    _param_names = ("k", "fit_mode", "holdout_fraction", "backend", "max_fit_queries", "num_classes")
    uses_validation = True

    def __init__(
        self,
        k: int = 10,
        fit_mode: str = "loo",
        holdout_fraction: float = 0.2,
        backend: str = "torch",
        max_fit_queries: Optional[int] = 5000,
        seed: int = 0,
        num_classes: Optional[int] = None,
        searches: Optional[SearchCache] = None,
    ):
        super().__init__(k=k, backend=backend, num_classes=num_classes, searches=searches)
        self.fit_mode = fit_mode
        self.holdout_fraction = holdout_fraction
        self.max_fit_queries = max_fit_queries
        self.seed = seed

    def _validate_params(self) -> None:
        super()._validate_params()
        if self.fit_mode not in ("loo", "holdout"):
            raise ValueError(f"fit_mode: expected 'loo' or 'holdout', got {self.fit_mode!r}")
        try:
            fraction = float(self.holdout_fraction)
        except (TypeError, ValueError):
            raise TypeError(
                f"holdout_fraction: expected a number in (0, 1), got {type(self.holdout_fraction).__name__}"
            ) from None
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"holdout_fraction: expected a value in (0, 1), got {self.holdout_fraction}")
        if self.max_fit_queries is not None:
            check_positive(self.max_fit_queries, "max_fit_queries", integer=True)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed: expected an int, got {type(self.seed).__name__}")

    def fit(self, train_embeddings, train_labels, val_embeddings=None, val_labels=None):
        """Store the support set and fit the temperature by NLL (see the module docstring)."""
        super().fit(train_embeddings, train_labels)
        support, y = self.support_embeddings_, self.support_labels_
        val_emb, val_y = self._check_val_inputs(val_embeddings, val_labels, support.shape[1], self.num_classes_)
        n = support.shape[0]
        # Searches run on embeddings divided by 2**e where squared distances would leave the dtype's
        # range (module docstring); e = 0 for ordinary input, which is then searched as given.
        e = distance_scale_exponent(support, *(() if val_emb is None else (val_emb.to(support.dtype),)))
        if e:
            support = ldexp(support, -e)
            val_emb = None if val_emb is None else ldexp(val_emb.to(support.dtype), -e)
        self.knn_index_ = PrunedKNNIndex(support) if self.backend == "pruned" and not e else None
        gen = torch.Generator().manual_seed(self.seed)
        cap = self.max_fit_queries

        def subset(count: int) -> torch.Tensor:
            """Indices of at most ``cap`` of ``count`` calibration queries (all, in order, if fewer)."""
            if cap is None or count <= cap:
                return torch.arange(count, device=support.device)
            return torch.randperm(count, generator=gen)[:cap].to(support.device)

        if self.fit_mode == "loo":
            if self.k > n - 1:
                raise ValueError(f"k: leave-one-out needs k <= {n - 1} (support size - 1), got {self.k}")
            rows = subset(n)
            d, idx = knn_search(
                support[rows], support, self.k, backend=self.backend, exclude=rows, index=self.knn_index_
            )
            same = y[idx] == y[rows].unsqueeze(1)
        elif val_emb is not None:
            rows = subset(val_emb.shape[0])
            d, idx = knn_search(val_emb[rows].to(support.dtype), support, self.k, backend=self.backend)
            same = y[idx] == val_y[rows].unsqueeze(1)
        else:
            perm = torch.randperm(n, generator=gen).to(support.device)
            n_cal = max(1, int(round(float(self.holdout_fraction) * n)))
            cal, rest = perm[:n_cal], perm[n_cal:]
            if self.k > rest.numel():
                raise ValueError(f"k: the holdout split leaves {rest.numel()} support rows, fewer than k={self.k}")
            cal = cal[subset(n_cal)]
            d, idx = knn_search(support[cal], support[rest], self.k, backend=self.backend)
            same = y[rest][idx] == y[cal].unsqueeze(1)
        temperature, self.nll_, self.n_fit_excluded_ = self._fit_temperature(d, same)
        if e:
            temperature = float(ldexp(torch.tensor(temperature, dtype=torch.float64), 2 * e))
            if not 0.0 < temperature < math.inf:
                m = float(self.support_embeddings_.abs().max())
                raise ValueError(
                    f"train_embeddings: values reach {m:.3g}; the fitted temperature in squared-"
                    f"distance units ({temperature:.3g}) is not a finite positive float64"
                )
        self.temperature_ = temperature
        return self

    @staticmethod
    def _fit_temperature(sq_dist: torch.Tensor, same: torch.Tensor):
        usable = same.any(dim=1)
        n_excluded = int((~usable).sum())
        sq_dist, same = sq_dist[usable].double(), same[usable]
        positive = sq_dist[sq_dist > 0]
        scale = float(positive.median()) if positive.numel() else 1.0
        if sq_dist.shape[0] == 0 or bool(same.all()):
            # Every calibration point is surrounded by its own class only: the NLL is 0 for every T
            # and no value is preferred; keep the data scale (median squared neighbour distance).
            return scale, 0.0, n_excluded
        centre = math.log(scale)
        res = minimize_scalar(
            lambda lt: ned_nll(sq_dist, same, lt),
            bounds=(centre - 12.0, centre + 12.0),
            method="bounded",
            options={"xatol": 1e-5},
        )
        return float(math.exp(res.x)), float(res.fun), n_excluded

    def _neighbour_weights(self, sq_dist):
        return torch.softmax(-sq_dist / self.temperature_, dim=1)

    def kneighbors(self, embeddings, k: Optional[int] = None):
        """As ``KNNHeadBase.kneighbors``; with ``backend="pruned"`` and no ``searches`` it searches
        the index built in ``fit``. (An index depends on the support alone, so the index a
        ``SearchCache`` builds of the same support searches alike.)"""
        index = getattr(self, "knn_index_", None)
        if self.searches is not None or index is None or not index.matches(self.support_embeddings_):
            return super().kneighbors(embeddings, k)  # with "pruned" alone: builds an index for this call
        support = self.support_embeddings_
        emb = self._check_query(embeddings, support.shape[1])
        if emb.dtype != support.dtype:
            return super().kneighbors(embeddings, k)  # searches a converted copy of the support
        if support.device != emb.device:
            raise ValueError(f"embeddings: on {emb.device} but the head was fitted on {support.device}")
        dist, idx = knn_search(emb, support, k or self.k, backend="pruned", index=index)
        return dist, self.support_labels_[idx]

    def _probabilities(self, sq_dist: torch.Tensor, nbr_labels: torch.Tensor) -> torch.Tensor:
        return ned_probabilities(sq_dist, nbr_labels, self.temperature_, self.num_classes_)

    def predict_proba(self, embeddings) -> torch.Tensor:
        """[NED, eq. (3)] with the fitted temperature, ``(N, C)`` in the dtype of ``embeddings``.

        Finite for every finite input: where squared distances to the support would leave the
        dtype's range, the search runs on both divided by a common power of two and the weights
        are formed in float64 (module docstring).
        """
        self._check_is_fitted()
        support = self.support_embeddings_
        emb = self._check_query(embeddings, support.shape[1])
        e = distance_scale_exponent(emb, support.to(emb.dtype) if emb.dtype != support.dtype else support)
        if not e:
            return self._probabilities(*self.kneighbors(emb))
        if support.device != emb.device:
            raise ValueError(f"embeddings: on {emb.device} but the head was fitted on {support.device}")
        # The support is scaled in its own dtype before any cast, so no value overflows on the way.
        scaled_support = ldexp(support, -e).to(emb.dtype)
        sq_dist, idx = knn_search(ldexp(emb, -e), scaled_support, self.k, backend=self.backend)
        w = _shifted_weights(sq_dist, e, self.temperature_).to(emb.dtype)
        probs = torch.zeros(emb.shape[0], self.num_classes_, dtype=w.dtype, device=w.device)
        return probs.scatter_add_(1, self.support_labels_[idx], w)
