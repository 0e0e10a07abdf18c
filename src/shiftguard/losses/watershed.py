"""Watershed loss ([QACT, App. D, eq. (10)-(11)]; Challa et al., 2024).

Recipe of [QACT, App. D]:

1. embed the batch, ``f(x_i)``;
2. starting from randomly selected seeds, propagate labels to all samples, giving estimated labels
   ``y^_i``; for every sample and every class ``l`` find the nearest neighbour in
   ``S_l = {f(x_j) : y^_j = y_j = l}`` (the correctly labelled samples of class ``l``, eq. (10));
3. loss = ``-1/n sum_i log softmax_l(-||f(x_i) - f(x_{i,l,1nn})||)[y_i]`` (eq. (11)).

How we choose seeds and propagate (the appendix leaves this to the original paper):

* Seeds: for each class present in the batch, ``n_seeds_per_class`` (default 1) samples drawn uniformly
  at random (``torch.randperm`` with an optional ``generator``, so runs are reproducible).
* Propagation is the *seeded watershed* on the complete graph of the batch with Euclidean edge weights,
  i.e. the minimum-spanning-forest (MSF) cut rooted at the seeds (watershed cuts, Cousty et al. 2009):
  starting from the seeds, repeatedly give the unlabelled sample that is nearest to any labelled sample
  the label of that neighbour (Prim's order).  We grow exactly this forest with a compiled O(N^2)
  Prim loop on the CPU (:func:`watershed_propagate`; where numba is missing, one call of SciPy's
  minimum-spanning-tree routine on the batch graph plus a virtual root tied to the seeds gives the
  same forest wherever no two distances tie; its edge sort is the slower part).  (A vectorised
  "minimax path cost to each seed" recursion is *not* equivalent: paths to different seeds often share
  their bottleneck edge, and the tie is exactly what the MSF order resolves.)  Propagation is a
  discrete assignment, computed without gradient.
* In eq. (11) the neighbour search for sample ``i`` excludes ``i`` itself (otherwise a correctly labelled
  sample would be its own neighbour at distance 0).  Classes with an empty ``S_l`` (no correctly labelled
  member other than ``i``) drop out of the softmax of sample ``i``; samples whose own class has an empty
  set are skipped.  If no sample remains, the loss is an exact 0 attached to the graph.
* Distances are ``sqrt(d^2 + 1e-10)`` so the gradient is finite for coincident points.
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np
import torch

from shiftguard import _numba
from shiftguard._numba import njit
from shiftguard._validation import check_positive
from shiftguard.losses.base import EmbeddingLoss, safe_euclidean, zero_loss

__all__ = ["watershed_seeds", "watershed_propagate", "WatershedLoss", "warm_up"]


def watershed_seeds(labels: torch.Tensor, n_per_class: int = 1, generator: Optional[torch.Generator] = None):
    """Indices of random seeds: ``n_per_class`` samples (or all, if fewer) of every class in ``labels``."""
    perm = torch.randperm(labels.shape[0], generator=generator, device="cpu").to(labels.device)
    shuffled = labels[perm]
    # rank of each shuffled sample within its class: a stable sort by label keeps the random order.
    order = torch.argsort(shuffled, stable=True)
    sorted_lab = shuffled[order]
    first = torch.ones_like(sorted_lab, dtype=torch.bool)
    first[1:] = sorted_lab[1:] != sorted_lab[:-1]
    idx = torch.arange(sorted_lab.shape[0], device=labels.device)
    group_start = torch.cummax(torch.where(first, idx, torch.zeros_like(idx)), 0).values
    rank = idx - group_start
    return perm[order[rank < n_per_class]]


@njit(nogil=True, cache=True)
def _grow_forest(d, seeds, seed_labels, out):  # pragma: no cover - compiled
    """Prim's growth of the seeded forest on the complete graph ``d`` (n, n): ``out`` (n,) int64,
    -1 on entry, gets every sample's label. ``best[t]`` is the lightest edge from the forest to the
    unlabelled sample ``t`` and ``via[t]`` the label at its other end; each round labels the sample
    with the lightest such edge (the first in index order on ties) and relaxes its edges."""
    n = d.shape[0]
    best = np.full(n, np.inf)
    via = np.full(n, -1, dtype=np.int64)
    done = np.zeros(n, dtype=np.bool_)
    for s in range(seeds.shape[0]):
        out[seeds[s]] = seed_labels[s]
        done[seeds[s]] = True
    remaining = n
    for t in range(n):
        if done[t]:
            remaining -= 1
    for s in range(seeds.shape[0]):
        i = seeds[s]
        for t in range(n):
            if not done[t] and d[i, t] < best[t]:
                best[t] = d[i, t]
                via[t] = out[i]
    for _ in range(remaining):
        j = -1
        for t in range(n):
            if not done[t] and (j < 0 or best[t] < best[j]):
                j = t
        out[j] = via[j]
        done[j] = True
        for t in range(n):
            if not done[t] and d[j, t] < best[t]:
                best[t] = d[j, t]
                via[t] = out[j]


@torch.no_grad()
def watershed_propagate(dist: torch.Tensor, seeds: torch.Tensor, seed_labels: torch.Tensor) -> torch.Tensor:
    """Seeded watershed (minimum-spanning-forest) labels ``(N,)`` from a distance matrix ``(N, N)``.

    Grows the forest from the seeds one nearest sample at a time (Prim): the unlabelled sample with
    the lightest edge to a labelled one takes that one's label. ``tests/test_losses.py`` checks it
    against a literal loop. Without numba: a virtual root joined to every seed by an edge lighter than
    all others, the minimum spanning tree of that graph (``scipy.sparse.csgraph.minimum_spanning_tree``),
    the root removed: each remaining tree holds exactly one seed, whose label it takes (the same forest
    wherever no two edge weights tie). Every sample is labelled when ``seeds`` is not empty.

    Raises:
        ValueError: ``dist`` has a non-finite entry (a sample could not be reached).
    """
    n = dist.shape[0]
    d = dist.detach().to("cpu", torch.float64).numpy()
    if not np.isfinite(d).all():
        raise ValueError("dist: expected finite distances")
    if _numba.AVAILABLE:
        out = np.full(n, -1, dtype=np.int64)
        if seeds.numel():
            _grow_forest(
                np.ascontiguousarray(d),
                seeds.cpu().numpy().astype(np.int64),
                seed_labels.cpu().numpy().astype(np.int64),
                out,
            )
        return torch.as_tensor(out, device=seed_labels.device)
    return _scipy_forest(d, seeds, seed_labels)


def _scipy_forest(d: np.ndarray, seeds: torch.Tensor, seed_labels: torch.Tensor) -> torch.Tensor:
    """:func:`watershed_propagate` by SciPy's minimum spanning tree (the path without numba)."""
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import connected_components, minimum_spanning_tree

    n = d.shape[0]
    # csgraph treats 0 as "no edge": shift every weight by the same constant (the MST is unchanged).
    shift = 1e-9 * max(1.0, float(np.abs(d).max()))
    w = np.zeros((n + 1, n + 1))
    w[:n, :n] = d + shift
    np.fill_diagonal(w, 0.0)
    seeds_np = seeds.cpu().numpy()
    w[n, seeds_np] = shift / 2  # the virtual root, lighter than every real edge
    w[seeds_np, n] = shift / 2
    mst = minimum_spanning_tree(csr_matrix(w)).tocoo()
    keep = (mst.row < n) & (mst.col < n)
    forest = csr_matrix((np.ones(int(keep.sum())), (mst.row[keep], mst.col[keep])), shape=(n, n))
    _, comp = connected_components(forest, directed=False)
    comp_label = np.full(comp.max() + 1, -1, dtype=np.int64)
    comp_label[comp[seeds_np]] = seed_labels.cpu().numpy()
    return torch.as_tensor(comp_label[comp], device=seed_labels.device)


class WatershedLoss(EmbeddingLoss):
    """Watershed loss of [QACT, App. D, eq. (11)] (see the module docstring for seeds and propagation).

    Args:
        n_seeds_per_class: random seeds per class and batch (the appendix: "randomly selected seeds").
        generator: optional ``torch.Generator`` (CPU) for reproducible seed draws.

    Bad batches: a single class or only singleton classes -> exact 0 (no pair to contrast).
    """

    def __init__(
        self, n_seeds_per_class: int = 1, generator: Optional[torch.Generator] = None, *, validate_args: bool = True
    ):
        super().__init__(validate_args=validate_args)
        check_positive(n_seeds_per_class, "n_seeds_per_class", integer=True)
        self.n_seeds_per_class = n_seeds_per_class
        self.generator = generator
        #: estimated labels of the last batch (for inspection / tests)
        self.last_propagated_labels_: Optional[torch.Tensor] = None

    def extra_repr(self) -> str:
        return f"n_seeds_per_class={self.n_seeds_per_class}"

    def compute(self, embeddings, labels):
        n = embeddings.shape[0]
        dist = safe_euclidean(embeddings, embeddings)  # (N, N)
        seeds = watershed_seeds(labels, self.n_seeds_per_class, self.generator)
        y_hat = watershed_propagate(dist.detach(), seeds, labels[seeds])
        self.last_propagated_labels_ = y_hat
        correct = y_hat == labels
        classes, target = torch.unique(labels, return_inverse=True)
        n_cls = classes.shape[0]
        # j in S_{y_j}, j != i
        in_set = correct.unsqueeze(0) & ~torch.eye(n, dtype=torch.bool, device=embeddings.device)
        big = torch.finfo(dist.dtype).max
        # nn_dist[i, l] = min_{j in S_l, j != i} ||f_i - f_j||: an (N, N) -> (N, C) scatter-min, never (N, N, C).
        masked = torch.where(in_set, dist, torch.full_like(dist, big))
        nn_dist = torch.full((n, n_cls), big, dtype=dist.dtype, device=dist.device).scatter_reduce(
            1, target.unsqueeze(0).expand(n, n), masked, reduce="amin", include_self=True
        )
        available = (
            torch.zeros((n, n_cls), dtype=dist.dtype, device=dist.device).scatter_reduce(
                1, target.unsqueeze(0).expand(n, n), in_set.to(dist.dtype), reduce="amax", include_self=True
            )
            > 0
        )
        valid = available.gather(1, target.unsqueeze(1)).squeeze(1)
        if not bool(valid.any()):
            return zero_loss(embeddings)
        logits = torch.where(available, -nn_dist, torch.full_like(nn_dist, float("-inf")))[valid]
        logp = torch.log_softmax(logits, dim=1)
        return -logp.gather(1, target[valid].unsqueeze(1)).mean()


def warm_up() -> float:
    """Compile (or load from numba's cache) the forest-growing kernel; return the seconds taken
    (0.0 without numba)."""
    if not _numba.AVAILABLE:
        return 0.0
    t0 = time.perf_counter()
    watershed_propagate(torch.tensor([[0.0, 1.0], [1.0, 0.0]]), torch.tensor([0]), torch.tensor([0]))
    return time.perf_counter() - t0
