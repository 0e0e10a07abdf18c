"""QACT whose context is the *global* batch of a ``torch.distributed`` job (like ``nn.SyncBatchNorm``).

Under data parallelism every process sees ``1/W`` of the batch, but QACT's context [QACT, Sec. 3
"Extending to standard layers": all values of a channel in the batch] is the whole batch.
:class:`SyncQuantileActivation` therefore gathers, in every training-mode forward in ``"batch"``
context, what the statistics need from every process, and all processes compute *identical*
statistics (:func:`shiftguard.functional.quantile.qact_statistics`, [QACT, Alg. 1-2]) which each then
applies to its own inputs (:func:`~shiftguard.functional.quantile.quantile_activation` with
``statistics=``).

Nothing is communicated in the backward: [QACT, Alg. 2] treats the quantiles and the KDE samples as
constants, so ``grad_input = grad_output * f_hat(x)`` only needs the (already identical) samples.

What is gathered, per channel, from each process of context size ``M_r = N_r * prod(spatial)``:

- **exact mode** (``max_r M_r <= exact_max``): all ``M_r`` values. The statistics are then computed
  from the concatenated values, i.e. they *equal* those of the plain layer on the concatenated
  batch given the same seed: forward outputs are identical, and so are the KDE samples and
  bandwidth, hence the backward density (up to the grid KDE's documented interpolation error, because
  :func:`~shiftguard.functional.kde.gaussian_kde_grid` lays its grid over each process's own
  inputs; bounded by :func:`~shiftguard.functional.kde.kde_grid_error_bound`).
- **sampled mode** (otherwise): a fixed-size *sketch* of ``sketch_size`` values per channel,
  independent of the image size: ``sketch_size // 2`` order statistics of the process's negative
  values at mid-ranks ``floor((j + 1/2) n_- / K)``, the same for its non-negative values, plus the
  exact counts ``n_-``, ``n_+`` (a side with ``n <= K`` values is sent exactly). Each sketch value
  stands for ``n / K`` context values, so the union of the sketches is a weighted sample of the
  global context whose grounding [QACT, eqs. (8)-(9): each side weight 1/2, shared equally] uses
  the exact global counts. The weighted quantiles (midpoint rule, as in
  :func:`~shiftguard.functional.quantile.weighted_quantiles`) then differ from the exact ones by
  at most the spacing of ``~1/K`` quantile levels within a side, far below QACT's output step
  ``1/n_tau`` for the default ``K = 1024``; the KDE samples are drawn from the sketch with those
  weights (Alg. 2) instead of from the full context.

Identical statistics on every process: the KDE sample seed is drawn from rank 0's global RNG
(the same draw the plain layer makes) and shared in the small header every forward gathers anyway,
and every process runs the same computation on the same gathered tensors.

Outside training mode, in ``"frozen"`` context, or when ``torch.distributed`` is not initialised
(or the group has one process) the layer behaves exactly like :class:`QuantileActivation`:
in particular ``model.eval()`` uses each process's *local* batch as the context, so evaluation on
rank 0 alone cannot deadlock.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from shiftguard._validation import check_positive, check_tensor
from shiftguard.functional.kde import silverman_bandwidth
from shiftguard.functional.quantile import (
    QACTStatistics,
    channel_values,
    check_bandwidth,
    qact_statistics,
    quantile_activation,
    quantile_levels,
)
from shiftguard.nn.qact import QuantileActivation

__all__ = ["SyncQuantileActivation", "convert_sync_qact", "sketch_context", "sketch_statistics"]


def _distributed_world(process_group) -> int:
    """World size of ``process_group`` when torch.distributed is up, else 1."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(process_group)


def sketch_context(values: torch.Tensor, sketch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed-size per-channel sketch of a ``(C, M)`` context (sampled mode, module docstring).

    Returns ``(sketch (C, 2K), counts (C, 2))`` with ``K = sketch_size // 2``: columns ``[0, K)``
    hold order statistics of the negative values at mid-ranks ``floor((j + 1/2) n_- / K)`` (all of
    them, in order, when ``n_- <= K``), columns ``[K, 2K)`` the same for the non-negative values,
    and ``counts`` the exact ``(n_-, n_+)``. Unused slots hold ``+inf`` (weight 0 in
    :func:`sketch_statistics`).
    """
    k = sketch_size // 2
    ch, m = values.shape
    v, _ = torch.sort(values, dim=1)
    n_neg = torch.searchsorted(v, torch.zeros(ch, 1, dtype=v.dtype, device=v.device), right=False)  # (C, 1)
    n_pos = m - n_neg
    j = torch.arange(k, device=v.device)[None, :]
    parts = []
    for start, n in ((torch.zeros_like(n_neg), n_neg), (n_neg, n_pos)):
        rank = torch.where(n > k, torch.div((2 * j + 1) * n, 2 * k, rounding_mode="floor"), j)
        used = j < torch.minimum(n, torch.full_like(n, k))
        picked = torch.gather(v, 1, (start + rank).clamp_max(m - 1))
        parts.append(torch.where(used, picked, torch.full_like(picked, float("inf"))))
    return torch.cat(parts, dim=1), torch.cat([n_neg, n_pos], dim=1)


def sketch_statistics(
    sketches: torch.Tensor,
    counts: torch.Tensor,
    n_tau: int = 100,
    c: float = 100.0,
    n_samples: int = 1000,
    generator: Optional[torch.Generator] = None,
    bandwidth: Optional[float] = None,
) -> QACTStatistics:
    """QACT statistics [QACT, Alg. 1-2] from the sketches of ``W`` processes (sampled mode).

    Args:
        sketches: ``(W, C, 2K)`` from :func:`sketch_context` on each process.
        counts: ``(W, C, 2)`` the matching exact ``(n_-, n_+)``.
        n_tau, c, n_samples, generator, bandwidth: as in
            :func:`~shiftguard.functional.quantile.qact_statistics` (None: Silverman's rule on the
            samples; a float: that bandwidth for every channel).

    Every sketch value of side ``s`` of process ``r`` carries ``n_{r,s} / (number of values sent)``
    context values; ``-c`` and ``+c`` carry one each. Grounding [QACT, eqs. (8)-(9)] then gives each
    side total weight 1/2 using the exact global side counts, the quantiles use the midpoint rule of
    :func:`~shiftguard.functional.quantile.weighted_quantiles`, and the KDE samples are drawn with
    the grounded weights (Alg. 2).
    """
    w_dim, ch, k2 = sketches.shape
    k = k2 // 2
    dtype, device = sketches.dtype, sketches.device
    cnt = counts.to(dtype)  # (W, C, 2)
    sent = torch.clamp(cnt, max=float(k))
    carried = torch.where(sent > 0, cnt / sent.clamp_min(1.0), torch.zeros_like(cnt))  # values per sketch entry
    finite = torch.isfinite(sketches)
    w = torch.where(finite[..., :k], carried[..., :1], torch.zeros_like(sketches[..., :k]))
    w = torch.cat([w, torch.where(finite[..., k:], carried[..., 1:], torch.zeros_like(sketches[..., k:]))], dim=2)

    # One row per channel: every process's sketch, plus the grounding bounds -c and +c.
    vals = sketches.permute(1, 0, 2).reshape(ch, w_dim * k2)
    wts = w.permute(1, 0, 2).reshape(ch, w_dim * k2)
    bounds = torch.tensor([-c, c], dtype=dtype, device=device).expand(ch, 2)
    vals = torch.cat([vals, bounds], dim=1)
    wts = torch.cat([wts, torch.ones(ch, 2, dtype=dtype, device=device)], dim=1)
    n_neg = cnt[..., 0].sum(0) + 1.0  # exact global counts, with -c / +c
    n_pos = cnt[..., 1].sum(0) + 1.0
    neg = vals < 0
    wts = wts * torch.where(neg, 0.5 / n_neg[:, None], 0.5 / n_pos[:, None])

    v, order = torch.sort(vals, dim=1)  # +inf padding sorts last
    wt = torch.gather(wts, 1, order)
    wt = wt / wt.sum(dim=1, keepdim=True)
    last = torch.isfinite(v).sum(dim=1, keepdim=True) - 1
    # Padding (weight 0) takes the largest real value so that interpolation towards it clamps.
    v = torch.where(torch.isfinite(v), v, torch.gather(v, 1, last))
    cum = torch.cumsum(wt, dim=1)
    pos = cum - 0.5 * wt

    levels = quantile_levels(n_tau, dtype, device).expand(ch, -1).contiguous()
    i1 = torch.searchsorted(pos, levels, right=True).clamp(1, v.shape[1] - 1)  # pos[i1-1] <= tau < pos[i1]
    p0, p1 = torch.gather(pos, 1, i1 - 1), torch.gather(pos, 1, i1)
    v0, v1 = torch.gather(v, 1, i1 - 1), torch.gather(v, 1, i1)
    gap = p1 - p0
    t = torch.where(gap > 0, (levels - p0) / torch.where(gap > 0, gap, torch.ones_like(gap)), torch.zeros_like(gap))
    q = v0 + t.clamp(0.0, 1.0) * (v1 - v0)
    q = torch.where(levels < pos[:, :1], v[:, :1].expand_as(q), q)
    q = torch.cummax(q, dim=1).values

    u = torch.rand(ch, n_samples, generator=generator, device=device, dtype=torch.float64).to(dtype)
    idx = torch.searchsorted(cum.contiguous(), u * cum[:, -1:], right=True).clamp_max(v.shape[1] - 1)
    samples, _ = torch.sort(torch.gather(v, 1, idx), dim=1)
    bandwidth = check_bandwidth(bandwidth)
    bw = (
        silverman_bandwidth(samples, presorted=True)
        if bandwidth is None
        else torch.full((ch,), bandwidth, dtype=dtype, device=device)
    )
    return QACTStatistics(q, samples, bw)


class SyncQuantileActivation(QuantileActivation):
    """:class:`QuantileActivation` whose batch context spans all processes (module docstring).

    Args:
        n_tau, c, n_samples, context, momentum, num_features, bandwidth: as in :class:`QuantileActivation`.
        exact_max: largest per-process context size ``M_r`` (values per channel) for which the
            exact values are gathered; default ``sketch_size`` (exact whenever that is no more
            data than a sketch).
        sketch_size: values per channel each process sends in sampled mode (even, >= 2).
        process_group: the group to synchronise over (default: the whole world).

    Attributes:
        last_mode: ``"exact"``, ``"sampled"`` or ``"local"`` (no synchronisation) for the last forward.
        last_sent_numel: number of elements this process contributed to the last gather.

    Shape: as :class:`QuantileActivation`. Buffers and state-dict keys are the same, so checkpoints
    move freely between the two classes.
    """

    def __init__(
        self,
        n_tau: int = 100,
        c: float = 100.0,
        n_samples: int = 1000,
        context: str = "batch",
        momentum: Optional[float] = 0.1,
        num_features: Optional[int] = None,
        exact_max: Optional[int] = None,
        sketch_size: int = 2048,
        process_group=None,
        bandwidth: Optional[float] = None,
    ):
        super().__init__(
            n_tau=n_tau,
            c=c,
            n_samples=n_samples,
            context=context,
            momentum=momentum,
            num_features=num_features,
            bandwidth=bandwidth,
        )
        check_positive(sketch_size, "sketch_size", integer=True)
        if sketch_size < 2 or sketch_size % 2:
            raise ValueError(f"sketch_size: expected an even integer >= 2, got {sketch_size}")
        self.sketch_size = int(sketch_size)
        self.exact_max = int(sketch_size if exact_max is None else check_positive(exact_max, "exact_max", integer=True))
        self.process_group = process_group
        self.last_mode = "local"
        self.last_sent_numel = 0

    def _needs_sync(self) -> bool:
        return self.training and self._context == "batch" and _distributed_world(self.process_group) > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._needs_sync():
            self.last_mode, self.last_sent_numel = "local", 0
            return super().forward(x)
        x = check_tensor(x, "input", min_ndim=2, floating=True, nonempty=True, finite=True)  # before the gather:
        self._ensure_buffers(x)  # a NaN would reach every process
        stats = self.global_statistics(x)
        # the global statistics are identical on every process, and so are the buffers moved towards them
        out = quantile_activation(
            x,
            self.running_quantiles,
            self.running_samples,
            self.running_bandwidth,
            training=True,
            momentum=self._next_momentum(),
            statistics=stats,
            bandwidth=self.bandwidth,
        )
        self.num_batches_tracked.add_(1)
        return out

    @torch.no_grad()
    def global_statistics(self, x: torch.Tensor) -> QACTStatistics:
        """Statistics of the global batch context (collective: every process must call it)."""
        group = self.process_group
        world = dist.get_world_size(group)
        values = channel_values(x.detach())  # (C, M_r)
        ch, m = values.shape
        seed = int(torch.randint(0, 2**62, (1,)).item())  # the plain layer's draw from the global RNG
        # Header: context size, seed, and the exact per-channel count of negative values (sampled
        # mode needs it; C integers are negligible next to the values).
        n_neg = (values < 0).sum(dim=1)
        header = torch.cat([torch.tensor([m, seed], dtype=torch.int64, device=x.device), n_neg.to(torch.int64)])
        headers = [torch.empty_like(header) for _ in range(world)]
        dist.all_gather(headers, header, group=group)
        sizes = [int(h[0]) for h in headers]
        gen = torch.Generator(device=x.device)
        gen.manual_seed(int(headers[0][1]))  # rank 0's seed, on every process

        if max(sizes) <= self.exact_max:
            padded = values.new_zeros(ch, max(sizes))
            padded[:, :m] = values
            parts = [torch.empty_like(padded) for _ in range(world)]
            dist.all_gather(parts, padded, group=group)
            full = torch.cat([p[:, :n] for p, n in zip(parts, sizes)], dim=1)
            self.last_mode, self.last_sent_numel = "exact", header.numel() + padded.numel()
            return qact_statistics(full, self.n_tau, self.c, self.n_samples, gen, bandwidth=self.bandwidth)

        sketch, _ = sketch_context(values, self.sketch_size)
        parts = [torch.empty_like(sketch) for _ in range(world)]
        dist.all_gather(parts, sketch, group=group)
        neg = torch.stack([h[2:] for h in headers])  # (W, C)
        counts = torch.stack([neg, torch.tensor(sizes, device=neg.device)[:, None] - neg], dim=2)
        self.last_mode, self.last_sent_numel = "sampled", header.numel() + sketch.numel()
        return sketch_statistics(
            torch.stack(parts), counts, self.n_tau, self.c, self.n_samples, gen, bandwidth=self.bandwidth
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, exact_max={self.exact_max}, sketch_size={self.sketch_size}"


def convert_sync_qact(
    module: nn.Module, process_group=None, exact_max: Optional[int] = None, sketch_size: int = 2048
) -> nn.Module:
    """Replace every :class:`QuantileActivation` in ``module`` by a :class:`SyncQuantileActivation`.

    Mirrors ``nn.SyncBatchNorm.convert_sync_batchnorm``: configuration, context mode, running
    statistics (same tensors) and the training flag are carried over; returns the converted module
    (``module`` itself is converted in place unless it is a QuantileActivation). Layers that are
    already synchronised are left alone.

    Warns (``UserWarning``) when ``module`` holds no QuantileActivation at all (nothing converted): add
    QACT with :func:`shiftguard.nn.convert_activations` first, with ``example_input`` so that its blocks
    exist before this conversion (they are otherwise created at the first forward).
    """
    if not any(isinstance(m, QuantileActivation) for m in module.modules()):
        warnings.warn(
            "convert_sync_qact: module holds no QuantileActivation; nothing converted. Add QACT with "
            "shiftguard.nn.convert_activations(model, example_input=...) first (its blocks are created at "
            "the first forward, so pass example_input to create them before this conversion)",
            UserWarning,
            stacklevel=2,
        )
        return module
    return _convert_sync(module, process_group, exact_max, sketch_size)


def _convert_sync(module: nn.Module, process_group, exact_max: Optional[int], sketch_size: int) -> nn.Module:
    out = module
    if isinstance(module, QuantileActivation) and not isinstance(module, SyncQuantileActivation):
        out = SyncQuantileActivation(
            n_tau=module.n_tau,
            c=module.c,
            n_samples=module.n_samples,
            context=module._context,
            momentum=module.momentum,
            num_features=module.num_features,
            exact_max=exact_max,
            sketch_size=sketch_size,
            process_group=process_group,
            bandwidth=module.bandwidth,
        )
        out.running_quantiles = module.running_quantiles
        out.running_samples = module.running_samples
        out.running_bandwidth = module.running_bandwidth
        out.num_batches_tracked = module.num_batches_tracked
        out.train(module.training)
    for name, child in module.named_children():
        out.add_module(name, _convert_sync(child, process_group, exact_max, sketch_size))
    return out
