"""Smooth-AP (Brown et al., ECCV 2020), the baseline of [Patel, Ch. 5].

For a query ``q`` with positives ``P`` and database ``Omega = B \\ q`` (Brown et al., eq. (12) with the
sigmoid ``G(.; tau)`` of eq. (11)):

    AP~(q) = 1/|P| sum_{i in P} (1 + sum_{j in P, j != i} G(s_qj - s_qi)) /
                                  (1 + sum_{j in Omega, j != i} G(s_qj - s_qi))

and the loss is ``1 - mean_q AP~(q)`` over queries with at least one positive; cosine similarities,
``tau = 0.01``.

Why not wrap ``pytorch_metric_learning.losses.SmoothAPLoss`` (v2.9)?  Reading its source: (1) it reshapes
the batch as ``(num_classes, m, D)``, i.e. it assumes the samples of each class are *contiguous*, but it only
checks that class counts are equal -- a shuffled batch ``[A, B, A, B]`` passes the check and is silently
grouped wrongly; (2) it keeps the query inside its own database and positive set (as the original
repository does), which adds a constant ``rank 1`` positive to every AP, so its value is not the AP of the
paper's definition; (3) it needs equal class counts and loops in Python over samples.  The test
``test_pml_smoothap_depends_on_batch_order`` demonstrates (1); ours is permutation-invariant, works with
any class counts, and is vectorised over (query, positive) pairs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shiftguard._validation import check_positive
from shiftguard.losses.base import EmbeddingLoss, zero_loss
from shiftguard.losses.recall_at_k import _positive_pair_ranks

__all__ = ["SmoothAPLoss"]


class SmoothAPLoss(EmbeddingLoss):
    """Smooth-AP loss (Brown et al., 2020, eq. (12)); ``temperature`` = 0.01 as in the paper and [Patel].

    Queries without a positive are skipped; no positive pair at all -> exact 0.
    """

    def __init__(self, temperature: float = 0.01, *, validate_args: bool = True):
        super().__init__(validate_args=validate_args)
        check_positive(temperature, "temperature")
        self.temperature = float(temperature)

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}"

    def compute(self, embeddings, labels):
        x = F.normalize(embeddings, dim=1)
        sim = x @ x.t()
        q_idx, _, sig = _positive_pair_ranks(sim, labels, self.temperature)
        if q_idx.numel() == 0:
            return zero_loss(embeddings)
        same = labels[q_idx].unsqueeze(1) == labels.unsqueeze(0)  # (P, N): j is a positive of q
        rank_all = 1.0 + sig.sum(1)
        rank_pos = 1.0 + (sig * same).sum(1)
        n = labels.shape[0]
        ratio_sum = torch.zeros(n, dtype=sim.dtype, device=sim.device).index_add(0, q_idx, rank_pos / rank_all)
        n_pos = torch.bincount(q_idx, minlength=n).to(sim.dtype)
        has = n_pos > 0
        ap = ratio_sum[has] / n_pos[has]
        return 1.0 - ap.mean()
