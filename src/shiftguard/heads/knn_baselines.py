"""kNN confidence baselines of [NED, Sec. 2.1]: 1-NN, vote share (eq. 4), distance-weighted kNN (eq. 5).

- ``OneNN``: the label of the nearest support embedding with confidence 1 ([NED, Table 1] "1NN").
- ``KNNVote``: ``p(c|z) = (1/k) sum_{i<=k} 1[y_i = c]`` [NED, eq. (4)].
- ``WeightedKNN``: ``p(c|z) = sum_i w_i 1[y_i = c] / sum_i w_i`` [NED, eq. (5)] with the weights of
  Dudani (1976, "The distance-weighted k-nearest-neighbor rule", IEEE SMC 6(4)), ref. 9 of [NED]:
  ``w_i = (d_k - d_i) / (d_k - d_1)``, and of Gou et al. (2012, "A new distance-weighted k-nearest
  neighbor classifier", J. Inf. Comput. Sci. 9(6)), ref. 16 of [NED]:
  ``w_i = (d_k - d_i) / (d_k - d_1) * (d_k + d_1) / (d_k + d_i)``; both ``w_i = 1`` when
  ``d_k = d_1``. ``d`` is the (not squared) Euclidean distance, ``d_1 <= ... <= d_k``. With these
  weights the k-th neighbour gets weight 0 (as in both papers).
"""

from __future__ import annotations

from typing import Optional

import torch

from shiftguard._validation import check_positive
from shiftguard.heads.base import EmbeddingHead
from shiftguard.neighbors import SearchCache, check_backend, knn_search

__all__ = ["KNNHeadBase", "OneNN", "KNNVote", "WeightedKNN", "dudani_weights", "gou_weights"]


def dudani_weights(dist: torch.Tensor) -> torch.Tensor:
    """Dudani (1976) weights for sorted Euclidean distances ``(N, k)``; rows with d_k = d_1 get 1."""
    d1, dk = dist[:, :1], dist[:, -1:]
    span = dk - d1
    w = (dk - dist) / torch.where(span > 0, span, torch.ones_like(span))
    return torch.where(span > 0, w, torch.ones_like(w))


def gou_weights(dist: torch.Tensor) -> torch.Tensor:
    """Gou et al. (2012) dual weights for sorted Euclidean distances ``(N, k)``."""
    d1, dk = dist[:, :1], dist[:, -1:]
    denom = dk + dist
    ratio = (dk + d1) / torch.where(denom > 0, denom, torch.ones_like(denom))
    return dudani_weights(dist) * torch.where(dk > d1, ratio, torch.ones_like(ratio))


class KNNHeadBase(EmbeddingHead):
    """Stores the support set; subclasses turn ``(sq. distances, neighbour labels)`` into weights.

    ``searches``: a :class:`~shiftguard.neighbors.SearchCache` shared with other heads of the same
    support; heads with the same ``k`` and ``backend`` then run one search per query between them,
    with the same answers (the evaluation grid gives one to all its heads). None: each head
    searches on its own.
    """

    _param_names: tuple[str, ...] = ("k", "backend", "num_classes")
    _shared_params = ("searches",)

    def __init__(
        self,
        k: int = 10,
        backend: str = "torch",
        num_classes: Optional[int] = None,
        searches: Optional[SearchCache] = None,
    ):
        super().__init__(num_classes)
        self.k = k
        self.backend = backend
        self.searches = searches

    def _validate_params(self) -> None:
        super()._validate_params()
        check_positive(self.k, "k", integer=True)
        check_backend(self.backend)
        if self.searches is not None and not isinstance(self.searches, SearchCache):
            raise TypeError(
                f"searches: expected a shiftguard.neighbors.SearchCache or None, got {type(self.searches).__name__}"
            )

    def fit(self, train_embeddings, train_labels, val_embeddings=None, val_labels=None):
        """Store the support set (``val_*`` are refused: these heads have no fitted parameter)."""
        self._validate_params()
        self._no_validation(val_embeddings, val_labels)
        emb, y, num_classes = self._check_fit_inputs(train_embeddings, train_labels)
        if self.k > emb.shape[0]:
            raise ValueError(f"k: {self.k} neighbours requested but the support has {emb.shape[0]} rows")
        self.support_embeddings_ = emb
        self.support_labels_ = y
        self._set_classes(num_classes, emb.device)
        return self

    def kneighbors(self, embeddings, k: Optional[int] = None):
        """``(squared distances (N, k), support labels (N, k))`` of the nearest support rows."""
        self._check_is_fitted()
        emb = self._check_query(embeddings, self.support_embeddings_.shape[1])
        dist, idx = self._search(emb, k or self.k)
        return dist, self.support_labels_[idx]

    def _search(self, emb: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``knn_search(emb, support_embeddings_, k, backend)``, through ``searches`` when given."""
        support = self.support_embeddings_
        if support.device != emb.device:
            raise ValueError(f"embeddings: on {emb.device} but the head was fitted on {support.device}")
        if self.searches is not None:
            return self.searches.search(emb, support, k, backend=self.backend)
        return knn_search(emb, support.to(emb.dtype), k, backend=self.backend)

    def _neighbour_weights(self, sq_dist: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def predict_proba(self, embeddings) -> torch.Tensor:
        """Class probabilities ``(N, C)`` from the weighted labels of the k nearest neighbours."""
        return self._probabilities(*self.kneighbors(embeddings))

    def _probabilities(self, sq_dist: torch.Tensor, nbr_labels: torch.Tensor) -> torch.Tensor:
        w = self._neighbour_weights(sq_dist)
        w = w / w.sum(dim=1, keepdim=True)
        probs = torch.zeros(sq_dist.shape[0], self.num_classes_, dtype=w.dtype, device=w.device)
        return probs.scatter_add_(1, nbr_labels, w)


class OneNN(KNNHeadBase):
    """Nearest-neighbour label with confidence 1 ([NED, Table 1], "1NN")."""

    _param_names = ("backend", "num_classes")

    def __init__(
        self, backend: str = "torch", num_classes: Optional[int] = None, searches: Optional[SearchCache] = None
    ):
        super().__init__(k=1, backend=backend, num_classes=num_classes, searches=searches)

    def _neighbour_weights(self, sq_dist):
        return torch.ones_like(sq_dist)


class KNNVote(KNNHeadBase):
    """Vote share of the k nearest neighbours as confidence [NED, eq. (4)]."""

    def _neighbour_weights(self, sq_dist):
        return torch.ones_like(sq_dist)


class WeightedKNN(KNNHeadBase):
    """Distance-weighted kNN [NED, eq. (5)]; ``kind="dudani"`` (ref. 9 of [NED]) or ``"gou"`` (ref. 16)."""

    _param_names = ("k", "kind", "backend", "num_classes")

    def __init__(
        self,
        k: int = 10,
        kind: str = "dudani",
        backend: str = "torch",
        num_classes: Optional[int] = None,
        searches: Optional[SearchCache] = None,
    ):
        super().__init__(k=k, backend=backend, num_classes=num_classes, searches=searches)
        self.kind = kind

    def _validate_params(self) -> None:
        super()._validate_params()
        if self.kind not in ("dudani", "gou"):
            raise ValueError(f"kind: expected 'dudani' or 'gou', got {self.kind!r}")

    def _neighbour_weights(self, sq_dist):
        dist = sq_dist.clamp(min=0).sqrt()
        w = dudani_weights(dist) if self.kind == "dudani" else gou_weights(dist)
        # With k >= 2 all weights can vanish only if d_1 = ... < d_k is impossible; guard anyway.
        return torch.where(w.sum(1, keepdim=True) > 0, w, torch.ones_like(w))
