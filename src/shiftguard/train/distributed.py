"""Data-parallel training on PyTorch's own engine (``torch.distributed`` + DistributedDataParallel).

Launch with ``torchrun --nproc_per_node=N -m shiftguard run ...`` (or ``shiftguard run --nproc N``,
which re-launches itself through :func:`launch`). Each process calls :func:`init_distributed`,
which reads the ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``MASTER_ADDR`` / ``MASTER_PORT``
variables torchrun sets and initialises the default process group: ``gloo`` for CPU, ``nccl``
for CUDA. Outside torchrun everything here degrades to a single process (world size 1).

:class:`DistributedTrainer` is :class:`~shiftguard.train.Trainer` with

- **the same global batches**: every batch the single-process trainer would draw (same seed,
  same order, class-balanced or not) is split across the ``W`` processes (``batch[rank::W]``), so
  ``batch_size`` stays the *global* batch size and QACT's context (with
  :class:`~shiftguard.nn.SyncQuantileActivation`, converted automatically) is the same set of
  images as in one process. A global batch too small to give every process 2 samples is skipped
  (BatchNorm and QACT need a context of at least 2). This is the ``DistributedSampler`` idea
  (a seeded permutation shared by all processes, each taking every ``W``-th index) applied per
  batch rather than per epoch, so that each global batch, and therefore QACT's context and a
  batch-level loss, is exactly a single-process batch; :func:`make_distributed_loader` gives the
  plain ``DistributedSampler`` for DataLoader-based loops;
- **DistributedDataParallel** gradient averaging. The model's ``forward`` / ``embed`` run through
  the DDP wrapper (:class:`MethodDispatch`), so the usual bucketed all-reduce overlaps the backward;
  embedding losses leave the classifier unused, so ``find_unused_parameters`` is on for them;
- **rank 0 writes**: checkpoints, the metrics log and progress output come from rank 0 only;
- **one validation result**: buffers (BatchNorm running statistics, which are per process on CPU
  where ``nn.SyncBatchNorm`` is unavailable) are broadcast from rank 0, rank 0 validates exactly
  as a single process would (same batches, so the same QACT evaluation contexts -- evaluation-mode
  QACT uses the local batch, :mod:`shiftguard.nn.sync_qact`) and broadcasts the accuracy, so every
  process takes the same learning-rate and early-stopping decisions;
- **global-batch embedding losses**: :class:`GlobalBatchLoss` gathers the embeddings (with
  autograd) so batch-level losses see the whole batch, as in one process.

:func:`distributed_multistage_step` is the DDP form of the multistage large-batch step ([Patel,
Sec. 5.3.2]; :func:`~shiftguard.train.multistage.multistage_step`): the embeddings of all processes
are gathered so the loss sees the whole global batch, and each process back-propagates its slice
chunk by chunk under ``no_sync()`` with one synchronising backward at the end.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import io
import math
import os
import pickle
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shiftguard._validation import check_positive, check_tensor

from .multistage import _set_rng_state, embed_chunks_without_grad
from .trainer import Trainer

__all__ = [
    "DistributedInfo",
    "DistributedTrainer",
    "GlobalBatchLoss",
    "MethodDispatch",
    "all_gather_results",
    "all_reduce_sum",
    "barrier",
    "broadcast_buffers",
    "broadcast_module",
    "broadcast_object",
    "cleanup_distributed",
    "distributed_multistage_step",
    "find_free_port",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_distributed",
    "is_main_process",
    "launch",
    "launched_by_torchrun",
    "make_distributed_loader",
    "shard_batch",
    "shard_range",
    "wrap_ddp",
]


# --------------------------------------------------------------------------- process group
@dataclass(frozen=True)
class DistributedInfo:
    """Where this process stands: ``rank`` of ``world_size``, ``local_rank`` on its node, the
    ``device`` it computes on and the ``backend`` (None when not distributed)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: Optional[str] = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def is_distributed() -> bool:
    """True when a default process group with more than one process is up."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def get_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main_process() -> bool:
    """Rank 0 (or the only process): the one that writes files."""
    return get_rank() == 0


def launched_by_torchrun() -> bool:
    """True inside a process started by ``torchrun`` / ``torch.distributed.run``."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def init_distributed(
    device: str | torch.device = "cpu", backend: Optional[str] = None, timeout_s: float = 6 * 3600
) -> DistributedInfo:
    """Initialise the default process group from torchrun's environment (no-op outside torchrun).

    Args:
        device: ``"cpu"`` or ``"cuda"`` (``cuda:i`` is replaced by ``cuda:LOCAL_RANK``: one GPU
            per process).
        backend: default ``"nccl"`` for CUDA, ``"gloo"`` otherwise.
        timeout_s: collective timeout. Generous because processes wait at a collective for the
            slowest one's share of the evaluation grid, and ranks > 0 at a barrier while rank 0
            alone aggregates and writes the report.

    Returns:
        :class:`DistributedInfo`. Calling it again when the group is already up returns the info.
    """
    dev = torch.device(device)
    if not launched_by_torchrun():
        return DistributedInfo(device=dev)
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if dev.type == "cuda":
        if torch.cuda.device_count() <= local:
            raise ValueError(
                f"device: process {local} on this node needs cuda:{local}, "
                f"but only {torch.cuda.device_count()} GPU(s) are visible"
            )
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
        )
    return DistributedInfo(rank=rank, world_size=world, local_rank=local, device=dev, backend=backend)


def cleanup_distributed() -> None:
    """Destroy the default process group if this process created one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    """Wait for every process (no-op when not distributed)."""
    if is_distributed():
        dist.barrier()


def broadcast_object(obj, src: int = 0):
    """``obj`` of rank ``src`` on every process (any picklable object)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of ``t`` over processes (a new tensor; ``t`` itself when not distributed)."""
    if not is_distributed():
        return t
    out = t.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def all_gather_results(fn: Callable[[], object], what: str = "work", map_location=None) -> list:
    """Run ``fn()`` on every process; return every process's result, in rank order, on every process.

    Every process must call it (it is a collective). A failure on any process, an exception in
    ``fn`` or a result that cannot be pickled, is raised on every process: the failing one
    re-raises its own exception, the others a ``RuntimeError`` naming ``what``, the failing rank
    and its error. No process is left waiting at a later collective for a peer that died.
    Outside a process group (or with one process) it is ``[fn()]``.

    Results travel pickled (``dist.all_gather_object``): meant for rows, fitted heads and
    per-image arrays, not for bulk tensors (use ``dist.all_gather`` for those). A pickled tensor
    comes back on the device it left (``cuda:0`` of process 0 stays ``cuda:0`` in process 1);
    ``map_location`` (as ``torch.load``'s: this process's device) moves every tensor of the
    results where this process computes instead.
    """
    if not is_distributed():
        return [fn()]
    error: Optional[BaseException] = None
    try:
        message: tuple[str, object] = ("ok", _dumps(fn()))
    except Exception as exc:  # any failure of fn: every process must still reach the gather below
        error, message = exc, ("error", f"{type(exc).__name__}: {exc}")
    box: list = [None] * dist.get_world_size()
    dist.all_gather_object(box, message)
    failed = [(r, m[1]) for r, m in enumerate(box) if m[0] == "error"]
    if error is not None:
        raise error
    if failed:
        rank, msg = failed[0]
        raise RuntimeError(f"{what}: process {rank} of {len(box)} failed: {msg}")
    return [_loads(m[1], map_location) for m in box]


def _dumps(obj: object) -> bytes:
    """``obj`` serialised by ``torch.save`` (pickle, with tensors stored by device), for :func:`_loads`."""
    buf = io.BytesIO()
    torch.save(obj, buf, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    return buf.getvalue()


def _loads(data: bytes, map_location=None) -> object:
    """The object :func:`_dumps` made, its tensors moved by ``map_location``. Not ``weights_only``:
    the bytes are this program's own results (heads, rows), made by a peer process of the group."""
    return torch.load(io.BytesIO(data), map_location=map_location, weights_only=False)


def shard_range(n: int, rank: Optional[int] = None, world_size: Optional[int] = None) -> range:
    """This process's contiguous part of ``range(n)``: ``world_size`` parts whose sizes differ by
    at most one, the larger ones first, in rank order (their concatenation is ``range(n)``)."""
    check_positive(n, "n", strict=False, integer=True)
    rank = get_rank() if rank is None else rank
    world_size = get_world_size() if world_size is None else world_size
    check_positive(world_size, "world_size", integer=True)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank: expected an integer in 0..{world_size - 1}, got {rank!r}")
    size, extra = divmod(n, world_size)
    start = rank * size + min(rank, extra)
    return range(start, start + size + (rank < extra))


@torch.no_grad()
def broadcast_module(module: nn.Module, src: int = 0) -> None:
    """Copy every parameter and buffer of ``module`` from rank ``src`` to all processes, so that
    every process holds exactly rank ``src``'s model (no-op when not distributed)."""
    if not is_distributed():
        return
    for t in [*module.parameters(), *module.buffers()]:
        if t.numel():
            dist.broadcast(t.data, src=src)


@torch.no_grad()
def broadcast_buffers(module: nn.Module, src: int = 0) -> None:
    """Copy every buffer of ``module`` from rank ``src`` to all processes (BatchNorm running stats)."""
    if not is_distributed():
        return
    for b in module.buffers():
        if b.numel():
            dist.broadcast(b, src=src)


# --------------------------------------------------------------------------- launching
def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (for ``MASTER_PORT``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def launch_command(
    argv: Sequence[str],
    nproc: int,
    *,
    module: str = "shiftguard",
    master_addr: str = "127.0.0.1",
    master_port: Optional[int] = None,
) -> list[str]:
    """The ``python -m torch.distributed.run`` command line that runs ``python -m module argv``
    in ``nproc`` processes on this machine."""
    check_positive(nproc, "nproc", integer=True)
    port = master_port or find_free_port(master_addr)
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc_per_node={nproc}",
        f"--master_addr={master_addr}",
        f"--master_port={port}",
        "-m",
        module,
        *argv,
    ]


def launch(argv: Sequence[str], nproc: int, *, module: str = "shiftguard", env: Optional[dict] = None) -> int:
    """Run ``python -m module argv`` under torchrun with ``nproc`` local processes; return its exit code.

    This is what ``shiftguard run --nproc N`` does: torchrun starts the workers, sets their
    environment (read by :func:`init_distributed`) and fails the whole job if one worker fails.
    """
    cmd = launch_command(argv, nproc, module=module)
    full_env = {**os.environ, **(env or {})}
    full_env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default too; stated so that it is not a surprise
    return subprocess.call(cmd, env=full_env)


# --------------------------------------------------------------------------- data sharding
def shard_batch(batch: torch.Tensor, rank: Optional[int] = None, world_size: Optional[int] = None) -> torch.Tensor:
    """This process's part ``batch[rank::world_size]`` of a global batch of indices."""
    rank = get_rank() if rank is None else rank
    world_size = get_world_size() if world_size is None else world_size
    return batch[rank::world_size]


def make_distributed_loader(
    dataset, batch_size: int, shuffle: bool = True, *, seed: int = 0, drop_last: bool = False, **loader_kwargs
) -> torch.utils.data.DataLoader:
    """A ``DataLoader`` over this process's ``DistributedSampler`` shard of ``dataset``.

    ``batch_size`` is per process here (PyTorch's convention for DataLoader-based loops); call
    ``loader.sampler.set_epoch(epoch)`` every epoch so the shuffles differ. Outside a process
    group it is an ordinary loader.
    """
    from torch.utils.data import DataLoader, DistributedSampler

    check_positive(batch_size, "batch_size", integer=True)
    if not is_distributed():
        return DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            generator=torch.Generator().manual_seed(seed),
            **loader_kwargs,
        )
    sampler: DistributedSampler = DistributedSampler(dataset, shuffle=shuffle, seed=seed, drop_last=drop_last)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **loader_kwargs)


# --------------------------------------------------------------------------- DDP wrapping
class MethodDispatch(nn.Module):
    """Routes ``forward(x, *rest, method=...)`` to ``model.forward`` or another method such as
    ``embed`` or ``training_loss``.

    DDP only synchronises what runs through its own ``forward``; wrapping this module lets
    ``model(x)``, ``model.embed(x)`` and ``model.training_loss(x, y)`` do so: ``ddp(x)``,
    ``ddp(x, method="embed")`` and ``ddp(x, y, method="training_loss")``.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, *rest: torch.Tensor, method: str = "forward") -> torch.Tensor:
        return self.model(x, *rest) if method == "forward" else getattr(self.model, method)(x, *rest)


def wrap_ddp(
    model: nn.Module, device: torch.device | str = "cpu", *, find_unused_parameters: bool = False, process_group=None
) -> DistributedDataParallel:
    """``DistributedDataParallel(MethodDispatch(model))`` on ``device`` (params broadcast from rank 0).

    Buffers are not re-broadcast before each forward (``broadcast_buffers=False``): QACT buffers
    are identical everywhere already, and BatchNorm running statistics are broadcast explicitly
    before validation (:func:`broadcast_buffers`) so that collectives only happen where all
    processes take part.
    """
    dev = torch.device(device)
    # Newer PyTorch renames broadcast_buffers=False to forward_sync_buffers=False (both keep the
    # initial broadcast from rank 0 of parameters; buffers too with the new name, which is fine).
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    no_fwd_sync: dict[str, Any] = (
        {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}
    )
    return DistributedDataParallel(
        MethodDispatch(model),
        device_ids=[dev.index] if dev.type == "cuda" else None,
        find_unused_parameters=find_unused_parameters,
        process_group=process_group,
        **no_fwd_sync,
    )


class _TrainingView:
    """What :class:`~shiftguard.train.Trainer` calls during a training epoch, routed through DDP.

    For logit losses the view has no ``embed`` attribute, so the trainer calls ``view(x)`` (one DDP
    forward through ``classifier(embed(x))``); for embedding losses ``view.embed(x)`` is
    ``ddp(x, method="embed")``; for a model's own objective ``view.training_loss(x, y)`` is
    ``ddp(x, y, method="training_loss")``.
    """

    def __init__(
        self, ddp: DistributedDataParallel, model: nn.Module, with_embed: bool, with_training_loss: bool = False
    ):
        self._ddp, self._model = ddp, model
        if with_embed:
            self.embed = lambda x: ddp(x, method="embed")
        if with_training_loss:
            self.training_loss = lambda x, y: ddp(x, y, method="training_loss")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._ddp(x)

    def train(self, mode: bool = True):
        self._model.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def __getattr__(self, name):  # parameters(), buffers(), ... of the real model
        if name == "embed":  # logit losses: hide embed so the trainer makes one full DDP forward
            raise AttributeError(name)
        return getattr(self._model, name)


# --------------------------------------------------------------------------- multistage under DDP
def _gather_rows(t: torch.Tensor, sizes: list[int], group=None) -> torch.Tensor:
    """Concatenate in rank order the ``(n_r, ...)`` tensors of all processes (no autograd)."""
    pad = t.new_zeros((max(sizes), *t.shape[1:]))
    pad[: t.shape[0]] = t
    parts = [torch.empty_like(pad) for _ in sizes]
    dist.all_gather(parts, pad.contiguous(), group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)])


class _GatherRows(torch.autograd.Function):
    """All-gather rows with autograd: the backward sums every process's gradient for this
    process's rows (an all-reduce then a slice; gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, sizes: tuple, group) -> torch.Tensor:
        ctx.sizes, ctx.group, ctx.rank = sizes, group, dist.get_rank(group)
        return _gather_rows(t, list(sizes), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        start = sum(ctx.sizes[: ctx.rank])
        return grad[start : start + ctx.sizes[ctx.rank]], None, None


def _all_sizes(n: int, device, group=None) -> list[int]:
    size = torch.tensor([n], dtype=torch.int64, device=device)
    out = [torch.empty_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, size, group=group)
    return [int(s) for s in out]


class GlobalBatchLoss(nn.Module):
    """An embedding loss evaluated on the *global* batch of a DDP job.

    Batch-level losses (watershed, recall@k surrogates, ...) couple all samples of a batch, so the
    loss of each process's part is not the loss of the batch. This wrapper all-gathers the
    embeddings (with autograd, :class:`_GatherRows`) and labels, and evaluates ``loss`` on the
    whole batch -- the same value on every process. In the backward each process receives the sum
    over the ``W`` identical losses of the gradient for its rows, ``W x dL/de``, which DDP's
    averaging over ``W`` turns into exactly the full-batch gradient. The loss's own parameters
    (proxies, ...) get the full-batch gradient on every process directly.

    Outside a process group it is ``loss`` itself. ``state_dict`` / ``load_state_dict`` are the
    wrapped loss's, so checkpoints do not depend on the number of processes.
    """

    def __init__(self, loss: nn.Module, process_group=None):
        super().__init__()
        self.loss = loss
        self.process_group = process_group

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(self.process_group) == 1:
            return self.loss(embeddings, labels)
        sizes = _all_sizes(embeddings.shape[0], embeddings.device, self.process_group)
        emb = _GatherRows.apply(embeddings, tuple(sizes), self.process_group)
        return self.loss(emb, _gather_rows(labels, sizes, self.process_group))

    def state_dict(self, *args, **kwargs):
        return self.loss.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.loss.load_state_dict(state_dict, strict=strict, assign=assign)


def distributed_multistage_step(
    ddp_model: DistributedDataParallel,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int,
    *,
    embed: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    process_group=None,
) -> torch.Tensor:
    """Multistage step [Patel, Sec. 5.3.2] over the *global* batch of a DDP job; returns the loss.

    Each process holds its part ``inputs`` ``(n_r, ...)`` of the global batch. Steps:

    1. embed the local chunks without gradients (RNG state recorded per chunk);
    2. all-gather the embeddings and labels (rank order), compute ``loss_fn`` on the global batch
       -- identical on every process -- and back-propagate it to the gathered embeddings (the
       loss's own parameters get their full gradient on every process);
    3. re-embed each local chunk with gradients and back-propagate ``W x`` its slice of the
       embedding gradient, under ``ddp_model.no_sync()`` for all but the last chunk; the last
       backward triggers DDP's all-reduce, whose averaging over ``W`` processes the factor ``W``
       cancels, so every process ends with the gradient of the full-batch loss.

    For models without batch-dependent layers this equals the single-process
    :func:`~shiftguard.train.multistage.multistage_step` on the concatenated batch (tested). Every
    process must use the same number of chunks: ``ceil(max_r n_r / chunk_size)`` (each process
    splits its part into that many near-equal chunks). Buffers touched by pass 1 are restored.

    Args:
        ddp_model: the DDP-wrapped network (gradients accumulate into its parameters' ``.grad``).
        loss_fn: ``(embeddings, labels) -> scalar`` on the global batch.
        inputs, labels: this process's part; chunk_size: samples per forward chunk.
        embed: input chunk -> embeddings through ``ddp_model`` (default ``ddp_model(x)``; with
            :func:`wrap_ddp` use ``lambda x: ddp_model(x, method="embed")``).
        process_group: group of the gathers (default: the world).
    """
    check_positive(chunk_size, "chunk_size", integer=True)
    inputs = check_tensor(inputs, "inputs", min_ndim=1, nonempty=True)
    if not isinstance(labels, torch.Tensor) or labels.dim() != 1 or labels.shape[0] != inputs.shape[0]:
        raise ValueError(f"labels: expected shape ({inputs.shape[0]},)")
    embed_fn = embed if embed is not None else ddp_model
    device = inputs.device
    world = dist.get_world_size(process_group) if dist.is_initialized() else 1
    rank = dist.get_rank(process_group) if dist.is_initialized() else 0
    if world > 1:
        sizes = _all_sizes(inputs.shape[0], device, process_group)
    else:
        sizes = [inputs.shape[0]]
    n_chunks = math.ceil(max(sizes) / chunk_size)
    if min(sizes) < n_chunks:
        raise ValueError(
            f"inputs: every process needs at least {n_chunks} samples for {n_chunks} chunks, "
            f"got per-process sizes {sizes}"
        )
    chunks = torch.tensor_split(inputs, n_chunks)

    module = ddp_model.module if isinstance(ddp_model, DistributedDataParallel) else ddp_model
    local, states, after_pass1 = embed_chunks_without_grad(module, embed_fn, chunks, device)
    if world > 1:
        emb_all = _gather_rows(local, sizes, process_group)
        labels_all = _gather_rows(labels, sizes, process_group)
    else:
        emb_all, labels_all = local, labels
    emb_all = emb_all.detach().requires_grad_(True)
    loss = loss_fn(emb_all, labels_all)
    if loss.dim() != 0:
        raise ValueError(f"loss_fn: expected a scalar loss, got shape {tuple(loss.shape)}")
    loss.backward()
    grad = emb_all.grad
    if grad is None:
        raise ValueError("loss_fn: the loss does not depend on the embeddings; nothing to back-propagate")
    start = sum(sizes[:rank])
    grad = grad[start : start + inputs.shape[0]] * world

    offset = 0
    sync_ctx = ddp_model.no_sync if isinstance(ddp_model, DistributedDataParallel) else contextlib.nullcontext
    for i, (x, state) in enumerate(zip(chunks, states)):
        _set_rng_state(state, device)
        g = grad[offset : offset + x.shape[0]]
        offset += x.shape[0]
        with sync_ctx() if i < len(chunks) - 1 else contextlib.nullcontext():
            embed_fn(x).backward(g)
    _set_rng_state(after_pass1, device)
    return loss.detach()


# --------------------------------------------------------------------------- trainer
class DistributedTrainer(Trainer):
    """:class:`~shiftguard.train.Trainer` over all processes of a ``torch.distributed`` job.

    See the module docstring for what is synchronised. Call :func:`init_distributed` first (a
    world of one process is allowed and gives exactly the plain trainer).

    Args:
        model, loss, **trainer_kwargs: as for :class:`~shiftguard.train.Trainer` (``batch_size``
            is the global batch size; ``is_main_process`` defaults to ``rank == 0``).
        sync_qact: convert QACT layers to :class:`~shiftguard.nn.SyncQuantileActivation` (global
            batch context). qact_exact_max, qact_sketch_size: its options.
        sync_batchnorm: convert BatchNorm to ``nn.SyncBatchNorm``; ``None`` = only on CUDA
            (PyTorch's SyncBatchNorm does not run on CPU).
        global_loss: evaluate embedding losses on the global batch (:class:`GlobalBatchLoss`);
            when False each process's loss sees only its part (plain DDP averaging).
        process_group: the group to train over (default: the world).
    """

    def __init__(
        self,
        model: nn.Module,
        loss: nn.Module | str = "cross_entropy",
        *,
        sync_qact: bool = True,
        qact_exact_max: Optional[int] = None,
        qact_sketch_size: int = 2048,
        sync_batchnorm: Optional[bool] = None,
        global_loss: bool = True,
        process_group=None,
        **trainer_kwargs,
    ):
        self.rank = dist.get_rank(process_group) if dist.is_initialized() else 0
        self.world_size = dist.get_world_size(process_group) if dist.is_initialized() else 1
        self.process_group = process_group
        device = torch.device(trainer_kwargs.get("device", "cpu"))
        if self.world_size > 1:
            from shiftguard.nn import convert_sync_qact, has_qact

            if sync_qact and has_qact(model):  # a model without QACT has no context to synchronise
                model = convert_sync_qact(model, process_group, qact_exact_max, qact_sketch_size)
            if sync_batchnorm if sync_batchnorm is not None else device.type == "cuda":
                model = nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group)
        trainer_kwargs.setdefault("is_main_process", self.rank == 0)
        super().__init__(model, loss, **trainer_kwargs)
        self.ddp = None
        if self.world_size > 1:
            self.ddp = wrap_ddp(
                self.model, self.device, find_unused_parameters=self.loss_on != "logits", process_group=process_group
            )
            if global_loss and self.loss_on == "embeddings":
                self.loss_fn = GlobalBatchLoss(self.loss_fn, process_group)

    def _multistage_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The trainer's multistage step, over the global batch (:func:`distributed_multistage_step`)."""
        ddp = self.ddp
        if ddp is None:
            return super()._multistage_step(x, y)
        loss = self.loss_fn.loss if isinstance(self.loss_fn, GlobalBatchLoss) else self.loss_fn
        return distributed_multistage_step(
            ddp, loss, x, y, self.chunk_size, embed=lambda t: ddp(t, method="embed"), process_group=self.process_group
        )

    # Each global batch of the single-process trainer, split across processes.
    def batches(self, labels: torch.Tensor, epoch: int) -> Iterator[torch.Tensor]:
        for idx in super().batches(labels, epoch):
            if self.world_size == 1:
                yield idx
            elif idx.numel() // self.world_size >= 2:
                yield shard_batch(idx, self.rank, self.world_size)

    def _train_epoch(self, images, labels, epoch: int, num_classes: int) -> dict:
        if self.ddp is None:
            return super()._train_epoch(images, labels, epoch, num_classes)
        model = self.model
        self.model = _TrainingView(
            self.ddp, model, with_embed=self.loss_on == "embeddings", with_training_loss=self.loss_on == "model"
        )
        try:
            out = super()._train_epoch(images, labels, epoch, num_classes)
        finally:
            self.model = model
        # Epoch statistics of the whole job: mean over processes of the per-process means.
        keys = sorted(out)
        vals = all_reduce_sum(torch.tensor([out[k] for k in keys], dtype=torch.float64, device=self.device))
        out = {k: float(v) / self.world_size for k, v in zip(keys, vals)}
        # Class means from every process's embeddings (the epoch above has set the sums).
        if self.loss_on == "embeddings" and self._emb_sum is not None:
            self._emb_sum = all_reduce_sum(self._emb_sum)
            self._emb_cnt = all_reduce_sum(self._emb_cnt)
            self._class_means = self._emb_sum / self._emb_cnt.clamp_min(1).unsqueeze(1)
            self._class_present = self._emb_cnt > 0
        return out

    @torch.no_grad()
    def validate(self, images: torch.Tensor, labels: torch.Tensor) -> float:
        """Rank 0 validates exactly as one process would (same batches, hence the same QACT
        contexts) and broadcasts the accuracy, so every process takes the same learning-rate and
        early-stopping decisions. Buffers are first broadcast from rank 0 so that all processes
        hold the model that was validated."""
        if self.world_size == 1:
            return super().validate(images, labels)
        broadcast_buffers(self.model)
        self.model.eval()  # on every process, as one process would leave it
        acc = torch.zeros(1, dtype=torch.float64, device=self.device)
        if self.rank == 0:
            acc += super().validate(images, labels)
        dist.broadcast(acc, src=0, group=self.process_group)
        return float(acc)
