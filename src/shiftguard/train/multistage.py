"""Multistage back-propagation for large batches ([Patel, Ch. 5, Sec. 5.3.2], "Large batch size";
Revaud et al., 2019).

Losses such as RS@k (:class:`shiftguard.losses.RecallAtKSurrogate`) need the whole batch at once, but the
activations of a large batch do not fit in memory.  The gradient of the loss with respect to the network
parameters factorises through the embeddings, ``dL/dtheta = sum_chunks (dL/de_chunk)^T de_chunk/dtheta``, so:

1. embed the batch chunk by chunk under ``torch.no_grad()`` (no activations kept);
2. compute the loss on the concatenated embeddings (a leaf tensor that requires grad) and back-propagate
   it to the embeddings -- and to the loss's own parameters (proxies, rho, ...), which get their full
   gradient here;
3. re-embed every chunk *with* gradients and call ``emb_chunk.backward(grad_slice)``, accumulating the
   parameter gradients chunk by chunk.

Peak memory is one chunk's activations plus ``N x D`` embeddings (plus the loss's own graph).

Caveats (documented behaviour, tested where testable):

* Randomness: the RNG state (CPU, and CUDA when the inputs live there) is recorded before each chunk in
  pass 1 and restored before the same chunk in pass 2, so dropout masks match between the passes; after the
  step the RNG continues from where pass 1 left it.  The gradient therefore equals that of an ordinary
  step that embeds the batch in the same chunks.
* Batch-dependent layers: BatchNorm (train mode) and batch-context QACT normalise with *chunk-level*
  statistics, so the result differs from a full-batch forward (it equals a forward over the same chunks).
  Running statistics / other buffers are snapshotted before pass 1 and restored after it, so they are
  updated once per step (by pass 2), not twice.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from shiftguard._validation import check_positive, check_tensor

__all__ = ["multistage_step"]


def _default_embed(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    return model.embed if hasattr(model, "embed") and callable(model.embed) else model


def _rng_state(device: torch.device):
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return cpu, cuda


def _set_rng_state(state, device: torch.device):
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def embed_chunks_without_grad(
    model: nn.Module,
    embed_fn: Callable[[torch.Tensor], torch.Tensor],
    chunks,
    device: torch.device,
    restore_buffers: bool = True,
):
    """Pass 1 of a multistage step: embed every chunk without gradients.

    Records the RNG state before each chunk (pass 2 replays it, so dropout / QACT's KDE sampling see
    the same random numbers) and, with ``restore_buffers``, undoes the pass's buffer updates
    (BatchNorm running statistics). Returns ``(embeddings, per-chunk RNG states, RNG state after)``.
    """
    saved = [b.detach().clone() for b in model.buffers()] if restore_buffers else None
    states, outs = [], []
    with torch.no_grad():
        for x in chunks:
            states.append(_rng_state(device))
            outs.append(embed_fn(x))
        after = _rng_state(device)
        if saved is not None:
            for b, v in zip(model.buffers(), saved):
                b.copy_(v)
    return torch.cat(outs, 0), states, after


def multistage_step(
    model: nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int,
    *,
    embed: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    restore_buffers: bool = True,
) -> torch.Tensor:
    """Accumulate into ``.grad`` the gradient of ``loss_fn(embed(inputs), labels)`` in chunks; return the loss.

    Args:
        model: the network; its parameters (and ``loss_fn``'s) receive gradients (accumulated, like
            ``loss.backward()``: call ``optimizer.zero_grad()`` before and ``optimizer.step()`` after).
        loss_fn: any ``(embeddings, labels) -> scalar`` loss, e.g. from :func:`shiftguard.losses.build_loss`.
        inputs: batch ``(N, ...)``; labels ``(N,)``.
        chunk_size: samples per forward chunk.
        embed: function mapping an input chunk to embeddings (default ``model.embed`` if it exists, else
            ``model``).
        restore_buffers: undo the buffer updates of the no-grad pass (BatchNorm running stats).

    Returns the detached loss value.
    """
    check_positive(chunk_size, "chunk_size", integer=True)
    inputs = check_tensor(inputs, "inputs", min_ndim=1, nonempty=True)
    if not isinstance(labels, torch.Tensor) or labels.dim() != 1 or labels.shape[0] != inputs.shape[0]:
        raise ValueError(
            f"labels: expected shape ({inputs.shape[0]},), got "
            f"{tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__}"
        )
    embed_fn = embed if embed is not None else _default_embed(model)
    chunks = inputs.split(chunk_size)
    device = inputs.device

    emb, states, after_pass1 = embed_chunks_without_grad(model, embed_fn, chunks, device, restore_buffers)
    emb = emb.requires_grad_(True)
    loss = loss_fn(emb, labels)
    if loss.dim() != 0:
        raise ValueError(f"loss_fn: expected a scalar loss, got shape {tuple(loss.shape)}")
    loss.backward()
    grad = emb.grad
    if grad is None:  # loss does not depend on the embeddings
        _set_rng_state(after_pass1, device)
        return loss.detach()

    start = 0
    for x, state in zip(chunks, states):
        _set_rng_state(state, device)
        out = embed_fn(x)
        g = grad[start : start + out.shape[0]]
        start += out.shape[0]
        if out.requires_grad:
            out.backward(g)
    _set_rng_state(after_pass1, device)
    return loss.detach()
