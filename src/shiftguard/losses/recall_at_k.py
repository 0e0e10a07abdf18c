"""Recall@k surrogate (RS@k) with similarity mixup (SiMix) -- [Patel, Ch. 5, Sec. 5.2].

For a query ``q`` with positives ``P_q`` in the database ``Omega = B \\ q`` [Patel, eq. (5.1)-(5.7)]:

    rank~(q, x) = 1 + sum_{z in Omega, z != x} sigmoid((s_qz - s_qx) / tau_2)            (5.2, smoothed)
    R~^k(q)     = min(k, sum_{x in P_q} sigmoid((k - rank~(q, x)) / tau_1)) / min(k, |P_q|)  (5.5 + the
                  training modification below it: divide by min(k, |P_q|), clip the numerator at k)
    L^K(q)      = 1/|K| sum_{k in K} (1 - R~^k(q))                                          (5.6, 5.7)

averaged over all queries of the batch that have at least one positive.  ``s_qx = q^T x`` on
L2-normalised embeddings (Sec. 5.2, "Deep image embeddings").  Defaults (Sec. 5.3.2): tau_2 = 0.01,
tau_1 = 1, K = {1, 2, 4, 8, 16} without SiMix and {1, 2, 4, 8, 12, 16, 20, 24, 28, 32} with SiMix.

SiMix (eq. (5.8)-(5.10)): for every unordered pair of distinct same-class samples ``(x, z)`` of the batch a
virtual example ``v = a x + (1 - a) z`` with ``a ~ U(0, 1)`` and the class of ``x`` is added.  Mixed
embeddings are never re-normalised, so every similarity involving virtual examples is the mixture of
original similarities of eq. (5.9)/(5.10); with the mixing matrix ``A = [I; M]`` (``M[v, x] = a``,
``M[v, z] = 1 - a``) the expanded similarity matrix is exactly ``A S A^T``.  Virtual examples serve as
queries and as database items.

Cost: only (query, positive) pairs are ranked, so memory is ``O(#pos_pairs * N)`` instead of ``O(N^3)``.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

from shiftguard._validation import check_positive
from shiftguard.losses.base import EmbeddingLoss, zero_loss

__all__ = ["RecallAtKSurrogate", "simix_expand", "DEFAULT_K", "DEFAULT_K_SIMIX"]

DEFAULT_K = (1, 2, 4, 8, 16)
DEFAULT_K_SIMIX = (1, 2, 4, 8, 12, 16, 20, 24, 28, 32)


def simix_expand(sim: torch.Tensor, labels: torch.Tensor, generator: Optional[torch.Generator] = None):
    """Expand a similarity matrix ``(N, N)`` with SiMix virtual examples [Patel, eq. (5.8)-(5.10)].

    Returns ``(sim_full (T, T), labels_full (T,))`` with ``T = N + #positive pairs``.
    """
    n = labels.shape[0]
    same = labels.unsqueeze(0) == labels.unsqueeze(1)
    a_idx, b_idx = torch.nonzero(torch.triu(same, diagonal=1), as_tuple=True)
    v = a_idx.shape[0]
    if v == 0:
        return sim, labels
    alpha = torch.rand(v, generator=generator, device="cpu", dtype=torch.float64).to(device=sim.device, dtype=sim.dtype)
    mix = torch.zeros(v, n, dtype=sim.dtype, device=sim.device)
    rows = torch.arange(v, device=sim.device)
    mix[rows, a_idx] = alpha
    mix[rows, b_idx] = 1.0 - alpha
    a = torch.cat([torch.eye(n, dtype=sim.dtype, device=sim.device), mix], 0)
    return a @ sim @ a.t(), torch.cat([labels, labels[a_idx]])


def _positive_pair_ranks(sim: torch.Tensor, labels: torch.Tensor, tau: float):
    """Smoothed ranks of every (query, positive) pair ([Patel, eq. (5.2)] with sigmoids).

    Returns ``(q_idx, x_idx, sig)`` where ``sig[p, z] = sigmoid((s_qz - s_qx) / tau)`` masked to zero for
    ``z in {q, x}``; the smoothed rank of pair ``p`` is ``1 + sig[p].sum()``.
    """
    t = labels.shape[0]
    same = labels.unsqueeze(0) == labels.unsqueeze(1)
    eye = torch.eye(t, dtype=torch.bool, device=labels.device)
    q_idx, x_idx = torch.nonzero(same & ~eye, as_tuple=True)
    rows = sim[q_idx]  # (P, T)
    s_qx = sim[q_idx, x_idx].unsqueeze(1)
    sig = torch.sigmoid((rows - s_qx) / tau)
    cols = torch.arange(t, device=labels.device).unsqueeze(0)
    keep = (cols != q_idx.unsqueeze(1)) & (cols != x_idx.unsqueeze(1))
    return q_idx, x_idx, sig * keep


class RecallAtKSurrogate(EmbeddingLoss):
    """RS@k loss [Patel, Ch. 5], optionally with SiMix (``simix=True``).

    Args:
        k: the set K (default per SiMix, see module docstring).
        tau1: temperature of the sigmoid on ranks (1.0).
        tau2: temperature of the sigmoid on similarity differences (0.01).
        simix: add SiMix virtual examples.
        normalize: L2-normalise the embeddings first (the thesis' embeddings are normalised).
        generator: optional CPU ``torch.Generator`` for the SiMix mixing coefficients.

    Queries with no positive are skipped; a batch without any positive pair (all singletons) gives an exact
    0.  A single-class batch has every positive at the top: the loss is ~0 (recall 1).
    Zero-norm embeddings normalise to zero (all similarities 0): finite.
    """

    def __init__(
        self,
        k: Optional[Sequence[int]] = None,
        tau1: float = 1.0,
        tau2: float = 0.01,
        simix: bool = False,
        normalize: bool = True,
        generator: Optional[torch.Generator] = None,
        *,
        validate_args: bool = True,
    ):
        super().__init__(validate_args=validate_args)
        ks = tuple(DEFAULT_K_SIMIX if simix else DEFAULT_K) if k is None else tuple(k)
        if not ks:
            raise ValueError("k: expected a non-empty sequence of positive ints")
        for kk in ks:
            check_positive(kk, "k", integer=True)
        check_positive(tau1, "tau1")
        check_positive(tau2, "tau2")
        self.k = ks
        self.tau1 = float(tau1)
        self.tau2 = float(tau2)
        self.simix = bool(simix)
        self.normalize = bool(normalize)
        self.generator = generator

    def extra_repr(self) -> str:
        return f"k={self.k}, tau1={self.tau1}, tau2={self.tau2}, simix={self.simix}"

    def compute(self, embeddings, labels):
        x = F.normalize(embeddings, dim=1) if self.normalize else embeddings
        sim = x @ x.t()
        if self.simix:
            sim, labels = simix_expand(sim, labels, self.generator)
        q_idx, _, sig = _positive_pair_ranks(sim, labels, self.tau2)
        if q_idx.numel() == 0:
            return zero_loss(embeddings)
        t = labels.shape[0]
        rank = 1.0 + sig.sum(1)  # (P,)
        n_pos = torch.bincount(q_idx, minlength=t).to(sim.dtype)
        has_pos = n_pos > 0
        total: Union[float, torch.Tensor] = 0.0
        for k in self.k:
            hit = torch.sigmoid((k - rank) / self.tau1)
            num = torch.zeros(t, dtype=sim.dtype, device=sim.device).index_add(0, q_idx, hit)
            recall = num.clamp(max=float(k)) / n_pos.clamp(max=float(k)).clamp_min(1.0)
            total = total + (1.0 - recall[has_pos]).mean()
        return total / len(self.k)
