"""Shared pieces of every ``shiftguard.losses`` module.

All losses are ``nn.Module`` s called as ``loss(embeddings, labels) -> scalar`` with
``embeddings`` a float tensor ``(N, D)`` and ``labels`` an integer tensor ``(N,)``, in the style of
pytorch-metric-learning: a user swaps a loss by changing one line.

Bad-input policy (the same for every loss, tested in ``tests/test_losses_bad_input.py``):

* NaN / inf embeddings, wrong shapes, non-integer labels, length mismatch -> ``ValueError`` /
  ``TypeError`` naming the argument (validated here, once, at the public boundary).
* A batch in which no anchor has the pairs the loss needs (a single class for pair-based losses, every
  class a singleton) is not an error: the loss returns an exact ``0`` that is still connected to the
  autograd graph (so ``backward()`` works and gives zero gradients) -- never a silent NaN.
* Anchors without a positive (a class with one sample in the batch) are skipped by pair-based losses and
  averaged over the remaining anchors.
* Zero-norm embeddings: every distance below is computed as ``sqrt(d^2 + eps)`` (the ``1e-10`` of
  [Kim, Art. II, Sec. 3.1]) and every normalisation divides by ``max(||x||, eps)``, so gradients stay
  finite; the behaviour of each loss at zero norm is stated in its docstring.

``validate_args=False`` (every loss's constructor) turns off the checks that read tensor values on
every call -- finite embeddings, labels in range, a finite loss -- each of which waits for the device
(a host synchronisation); the checks of shapes, dtypes and devices stay (they read metadata only).
Inside a few losses a value check also picks the arithmetic (DR's widening to float64 where squared
distances would overflow, the vMF split of very large rows) or guards a representable range; those
stay too. With the checks off, NaN/inf input gives a NaN/inf loss and an out-of-range label fails
wherever the indexing does.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from shiftguard._validation import check_labels, check_tensor

__all__ = [
    "EmbeddingLoss",
    "validate_batch",
    "zero_loss",
    "safe_euclidean",
    "pair_masks",
    "adam_scale_step_",
]

#: Added to squared Euclidean distances before the square root ([Kim, Art. II, Sec. 3.1]: "we add a small
#: positive value 1e-10 before taking square root").
DIST_EPS = 1e-10


def validate_batch(
    embeddings, labels, *, min_dim: int = 1, check_values: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate ``(embeddings (N, D) float finite, labels (N,) int)``; return them (labels as int64).

    ``check_values=False``: the finiteness and label-range checks (host synchronisations) are skipped."""
    emb = check_tensor(embeddings, "embeddings", ndim=2, floating=True, finite=check_values, nonempty=True)
    if emb.shape[1] < min_dim:
        raise ValueError(f"embeddings: expected at least {min_dim} feature dimensions, got shape {tuple(emb.shape)}")
    lab = check_labels(labels, "labels", n=emb.shape[0], check_values=check_values)
    if lab.device != emb.device:
        raise ValueError(f"labels: expected device {emb.device} (that of embeddings), got {lab.device}")
    return emb, lab


def zero_loss(*tensors: torch.Tensor) -> torch.Tensor:
    """An exact scalar 0 that stays attached to the graph of ``tensors`` (so ``backward`` works)."""
    out: torch.Tensor | None = None
    for t in tensors:
        if t is None:
            continue
        term = t.sum() * 0.0
        out = term if out is None else out + term
    if out is None:
        raise ValueError("tensors: zero_loss needs at least one tensor to attach the zero to")
    return out


#: Above this many ``N * M * D`` elements, :func:`safe_euclidean` switches to the Gram-matrix expansion.
EXPLICIT_DIFF_LIMIT = 1 << 22


def safe_euclidean(a: torch.Tensor, b: torch.Tensor, eps: float = DIST_EPS) -> torch.Tensor:
    """Pairwise Euclidean distances ``(N, M)`` as ``sqrt(||a_i - b_j||^2 + eps)``.

    Small problems use the explicit differences (the distance of a point to itself is exactly
    ``sqrt(eps)``, float64 gradchecks are exact); above ``EXPLICIT_DIFF_LIMIT`` elements the
    ``|a|^2 + |b|^2 - 2 a.b`` expansion (clamped at 0) keeps memory at ``O(N * M)``.
    """
    if a.shape[0] * b.shape[0] * a.shape[1] <= EXPLICIT_DIFF_LIMIT:
        diff = a.unsqueeze(1) - b.unsqueeze(0)
        return (diff.pow(2).sum(-1) + eps).sqrt()
    sq = a.pow(2).sum(1, keepdim=True) + b.pow(2).sum(1).unsqueeze(0) - 2.0 * a @ b.t()
    return (sq.clamp_min(0.0) + eps).sqrt()


def pair_masks(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean ``(N, N)`` masks of positive pairs (same label, not self) and negative pairs."""
    same = labels.unsqueeze(0) == labels.unsqueeze(1)
    eye = torch.eye(labels.shape[0], dtype=torch.bool, device=labels.device)
    return same & ~eye, ~same


class EmbeddingLoss(nn.Module):
    """Base class: validates ``(embeddings, labels)`` then calls ``compute(embeddings, labels)``.

    ``validate_args``: run the checks that read tensor values (finite embeddings, labels in range, a
    finite loss; module docstring) on every call. ``False`` skips them, e.g. in a training loop whose
    inputs are known good, where each would wait for the device; shapes and dtypes are still checked.
    """

    #: Minimal embedding dimension the loss supports.
    min_dim: int = 1
    #: Whether the value checks run (set by ``__init__``; the class default covers subclasses that do
    #: not pass it on).
    validate_args: bool = True

    def __init__(self, *, validate_args: bool = True):
        super().__init__()
        self.validate_args = bool(validate_args)

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        emb, lab = validate_batch(embeddings, labels, min_dim=self.min_dim, check_values=self.validate_args)
        if emb.dtype in (torch.float16, torch.bfloat16):
            # Losses are computed in float32 (as autocast does): DIST_EPS underflows in half precision
            # (NaN gradients at d = 0) and some CPU kernels (cdist) lack bfloat16. Gradients flow
            # back to the half-precision input through the cast.
            emb = emb.float()
        return self.compute(emb, lab)

    def compute(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError


def adam_scale_step_(loss: nn.Module, grad: float, lr: float) -> None:
    """One Adam step (beta1 0.9, beta2 0.999, eps 1e-8; Kingma & Ba 2015) of a dynamic scale on
    ``grad = d psi^2 / d s``: the float64 buffers ``scale``, ``_adam_m``, ``_adam_v``, ``_adam_t``
    of ``loss`` are updated in place with step ``lr``, ``s`` kept >= 1e-3. A
    non-finite ``grad`` leaves everything as it was."""
    if not math.isfinite(grad):
        return
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    m, v, t, scale = loss._adam_m, loss._adam_v, loss._adam_t, loss.scale
    assert isinstance(m, torch.Tensor) and isinstance(v, torch.Tensor) and isinstance(t, torch.Tensor)
    assert isinstance(scale, torch.Tensor)
    t += 1
    m.mul_(beta1).add_((1 - beta1) * grad)
    v.mul_(beta2).add_((1 - beta2) * grad * grad)
    m_hat = m / (1 - beta1**t)
    v_hat = v / (1 - beta2**t)
    scale.copy_((scale - lr * m_hat / (v_hat.sqrt() + eps)).clamp_min(1e-3))
