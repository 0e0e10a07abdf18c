"""InfoNCE, the instance-discrimination baseline of the URL benchmark [Kirchhof, URL App. B.2].

:class:`InfoNCELoss` is NT-Xent (Chen et al. 2020, SimCLR; [Patel, Ch. 6, eq. (6.1)-(6.3)]) called as
``loss(embeddings, labels)``: ``embeddings`` ``(2N, D)`` hold two augmented views of ``N`` images and
``labels`` are instance ids, the two views of one image sharing an id (``shiftguard.data.augment.two_views``
returns exactly this). Its uncertainty in the benchmark is the embedding norm,
``shiftguard.uncertainty.embedding_norm_uncertainty``.
"""

from __future__ import annotations

import torch

from shiftguard._validation import check_positive
from shiftguard.functional.scaling import normalize_rows
from shiftguard.losses.base import EmbeddingLoss, zero_loss

__all__ = ["InfoNCELoss"]


class InfoNCELoss(EmbeddingLoss):
    """NT-Xent / InfoNCE with temperature on instance ids [Kirchhof, URL App. B.2, eq. (1)].

    With ``s_ij = z^_i^T z^_j / tau`` (L2-normalised embeddings, cosine similarity) and ``P_i`` the other
    samples sharing the id of ``i``::

        l_i = 1/|P_i| sum_{p in P_i} (-s_ip + log sum_{k != i} exp(s_ik)),        loss = mean_{i: P_i != {}} l_i

    With exactly two views per id this is NT-Xent: ``l_i = l_SimCLR(z_i, z_j)`` of [Patel, Ch. 6,
    eq. (6.2)-(6.3)] (the positive in the denominator, the anchor itself not) and the mean over the
    ``2N`` anchors is [Patel, Ch. 6, eq. (6.1)]. [Kirchhof, URL App. B.2, eq. (1)] writes the same loss
    for one pair with the inverse temperature ``t = 1/tau`` tuned in ``[8, 64]``; its eq. (1) shows the
    positive term ``-t e1^T e2`` once beside both directions' log-sum-exp terms, where the symmetric NT-Xent
    it names has it once per direction -- we follow NT-Xent, and leave "Batch" (the negatives' set)
    read as all samples but the anchor. More than two samples per id (or class labels instead of ids)
    give the multi-positive form above, i.e. SupCon (Khosla et al. 2020) on those labels.

    Args:
        temperature: ``tau > 0``; 0.1 by default (``t = 10``, inside the range [Kirchhof, URL App. B.2]
            tuned).

    Anchors whose id has no other sample are skipped (they still serve as negatives); a batch without
    any pair returns an exact ``0`` attached to the graph. Zero-norm embeddings have cosine 0 to
    everything (finite loss and gradients).

    Example:
        >>> import torch
        >>> from shiftguard.losses import InfoNCELoss
        >>> views = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.1], [0.1, 1.0]])  # (2N, D), N = 2
        >>> ids = torch.tensor([0, 1, 0, 1])
        >>> float(InfoNCELoss()(views, ids)) < float(InfoNCELoss()(views, torch.tensor([0, 1, 1, 0])))
        True
    """

    def __init__(self, temperature: float = 0.1, *, validate_args: bool = True):
        super().__init__(validate_args=validate_args)
        check_positive(temperature, "temperature")
        self.temperature = float(temperature)

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}"

    def compute(self, embeddings, labels):
        m = embeddings.shape[0]
        eye = torch.eye(m, dtype=torch.bool, device=embeddings.device)
        pos = (labels.unsqueeze(0) == labels.unsqueeze(1)) & ~eye
        n_pos = pos.sum(1)
        anchors = n_pos > 0
        if not bool(anchors.any()):
            return zero_loss(embeddings)
        z = normalize_rows(embeddings)
        # m >= 2 here, so every row keeps at least one finite entry after masking the diagonal.
        s = (z @ z.t() / self.temperature).masked_fill(eye, float("-inf"))
        lse = torch.logsumexp(s, dim=1)
        pos_mean = torch.where(pos, s, torch.zeros_like(s)).sum(1) / n_pos.clamp_min(1).to(s.dtype)
        return (lse - pos_mean)[anchors].mean()
