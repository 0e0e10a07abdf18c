"""Worker side of tests/test_distributed.py: scenarios run in 2 spawned processes (gloo, 127.0.0.1).

Each scenario takes ``(rank, world, out_dir, inputs)`` and writes ``<name>_rank<r>.pt``; the tests
compare those files with single-process references computed in the test process.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from shiftguard.train.distributed import find_free_port


def spawn(scenarios: list[str], out_dir: Path, inputs: dict, world: int = 2) -> None:
    """Run ``scenarios`` (names of functions below) in ``world`` processes; raise if one fails."""
    port = find_free_port()
    torch.save(inputs, out_dir / "inputs.pt")
    # fork (where available) reuses the test process's imported torch: start-up drops from ~10 s
    # per process (import torch on a busy machine) to well under a second.
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(
        _entry, args=(world, port, scenarios, str(out_dir)), nprocs=world, join=True, start_method=method
    )


def _entry(rank: int, world: int, port: int, scenarios: list[str], out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        inputs = torch.load(Path(out_dir) / "inputs.pt", weights_only=False)
        for name in scenarios:
            result = globals()[name](rank, world, Path(out_dir), inputs)
            torch.save(result, Path(out_dir) / f"{name}_rank{rank}.pt")
    except Exception:  # make the child's traceback visible in the parent's error
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def _halves(x: torch.Tensor, rank: int, sizes) -> torch.Tensor:
    start = sum(sizes[:rank])
    return x[start : start + sizes[rank]]


def _sync_layer_forward_backward(rank, x, gout, sizes, seed, **layer_kw):
    from shiftguard.nn import sync_qact

    layer = sync_qact.SyncQuantileActivation(**layer_kw).train()
    xr = _halves(x, rank, sizes).clone().requires_grad_(True)
    torch.manual_seed(seed)
    out = layer(xr)
    out.backward(_halves(gout, rank, sizes))
    return {
        "out": out.detach(),
        "grad": xr.grad,
        "mode": layer.last_mode,
        "sent": layer.last_sent_numel,
        "buffers": {k: v.clone() for k, v in layer.state_dict().items()},
    }


# --------------------------------------------------------------------------- layer scenarios
def exact_dense(rank, world, out, inp):
    d = inp["exact_dense"]
    return _sync_layer_forward_backward(rank, d["x"], d["gout"], d["sizes"], d["seed"], **d["layer"])


def exact_conv(rank, world, out, inp):
    d = inp["exact_conv"]
    return _sync_layer_forward_backward(rank, d["x"], d["gout"], d["sizes"], d["seed"], **d["layer"])


def exact_unequal(rank, world, out, inp):
    d = inp["exact_unequal"]
    return _sync_layer_forward_backward(rank, d["x"], d["gout"], d["sizes"], d["seed"], **d["layer"])


def sampled(rank, world, out, inp):
    res = {}
    for key, d in inp["sampled"].items():
        res[key] = _sync_layer_forward_backward(rank, d["x"], d["gout"], d["sizes"], d["seed"], **d["layer"])
    return res


def eval_mode_is_local(rank, world, out, inp):
    """In eval mode no collective runs: only rank 0 calls the layer (would hang otherwise)."""
    from shiftguard.nn import sync_qact

    layer = sync_qact.SyncQuantileActivation(n_tau=10, n_samples=50).eval()
    if rank == 0:
        layer(torch.randn(4, 3))
    dist.barrier()
    return {"mode": layer.last_mode}


def loader_shards(rank, world, out, inp):
    from shiftguard.train.distributed import make_distributed_loader

    loader = make_distributed_loader(torch.utils.data.TensorDataset(torch.arange(10)), batch_size=3, seed=1)
    loader.sampler.set_epoch(1)
    return {"items": [int(v) for (b,) in loader for v in b]}


def pairwise_loss(emb: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A loss that couples the whole batch (every pair), so it cannot be split per process."""
    sim = emb @ emb.T
    same = (labels[:, None] == labels[None, :]).to(emb.dtype) * 2 - 1
    off = ~torch.eye(len(labels), dtype=torch.bool, device=emb.device)
    return nn.functional.softplus(-same * sim)[off].mean()


class TinyEmbedder(nn.Module):
    """No batch-dependent layers: its gradient is a plain function of the batch."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
        self.classifier = nn.Linear(4, 3)

    def embed(self, x):
        return self.body(x)

    def forward(self, x):
        return self.classifier(self.embed(x))


def _tiny_ddp_part(d, rank):
    """The shared TinyEmbedder (float64, weights ``d["state"]``) wrapped in DDP, and this rank's
    part of the batch ``d["x"], d["y"]`` (unequal parts ``d["sizes"]``)."""
    from shiftguard.train.distributed import wrap_ddp

    model = TinyEmbedder().double()
    model.load_state_dict(d["state"])
    ddp = wrap_ddp(model, find_unused_parameters=True)
    return model, ddp, _halves(d["x"], rank, d["sizes"]), _halves(d["y"], rank, d["sizes"])


def multistage(rank, world, out, inp):
    from shiftguard.train.distributed import distributed_multistage_step

    d = inp["multistage"]
    model, ddp, x, y = _tiny_ddp_part(d, rank)
    loss = distributed_multistage_step(ddp, pairwise_loss, x, y, d["chunk"], embed=lambda t: ddp(t, method="embed"))
    return {"loss": loss, "grads": {n: p.grad for n, p in model.named_parameters()}}


class PairwiseLoss(nn.Module):
    def forward(self, emb, labels):
        return pairwise_loss(emb, labels)


def global_batch_loss(rank, world, out, inp):
    """One ordinary DDP step with the loss on the gathered global batch (unequal parts)."""
    from shiftguard.train.distributed import GlobalBatchLoss

    d = inp["global_loss"]
    model, ddp, x, y = _tiny_ddp_part(d, rank)
    loss = GlobalBatchLoss(PairwiseLoss())(ddp(x, method="embed"), y)
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad for n, p in model.named_parameters()}}


class QactEmbedder(nn.Module):
    """Linear -> QACT (or tanh) -> Linear without BatchNorm: with exact synchronisation its DDP
    training is the single-process training (BatchNorm would stay per process on CPU)."""

    def __init__(self, act: str = "qact"):
        super().__init__()
        from shiftguard.nn import QuantileActivation

        mid = QuantileActivation(n_tau=20, n_samples=200) if act == "qact" else nn.Tanh()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(16, 8), mid, nn.Linear(8, 4))
        self.classifier = nn.Linear(4, 3)

    def embed(self, x):
        return self.body(x.to(self.classifier.weight.dtype))  # the trainer feeds float32

    def forward(self, x):
        return self.classifier(self.embed(x))


def fit_tiny(loss_name: str, d: dict, trainer_cls, act: str = "qact", **kw):
    """Two epochs of ``trainer_cls`` on the tiny model (shared by the workers and the test)."""
    torch.manual_seed(0)
    model = QactEmbedder(act).double()
    loss = PairwiseLoss() if loss_name == "pairwise" else "cross_entropy"
    trainer = trainer_cls(model, loss, epochs=2, batch_size=16, progress=False, early_stopping_patience=0, **kw)
    summary = trainer.fit(d["x"], d["y"], d["x"][:32], d["y"][:32], num_classes=3)
    return model, summary


def trainer_equivalence(rank, world, out, inp):
    from shiftguard.train.distributed import DistributedTrainer

    res = {}
    for loss_name in ("cross_entropy", "pairwise"):
        model, summary = fit_tiny(loss_name, inp["tiny"], DistributedTrainer)
        res[loss_name] = {
            "state": {k: v.clone() for k, v in model.state_dict().items()},
            "val_acc": summary["best_val_acc"],
        }
    return res


# --------------------------------------------------------------------------- training scenarios
def train_mlp(rank, world, out, inp):
    """One epoch of DistributedTrainer; files go to a per-rank folder (only rank 0 may write)."""
    from shiftguard.models import build_model
    from shiftguard.train.distributed import DistributedTrainer
    from shiftguard.train.trainer import to_model_input

    d = inp["train"]
    torch.manual_seed(0)
    model = build_model("mlp", activation=d["activation"], num_classes=10, hidden=(64, 32))
    folder = out / f"files_rank{rank}"
    trainer = DistributedTrainer(
        model,
        "cross_entropy",
        epochs=1,
        batch_size=d["batch_size"],
        progress=False,
        checkpoint_dir=folder / "checkpoints",
        metrics_log=folder / "metrics.jsonl",
        early_stopping_patience=0,
    )
    summary = trainer.fit(d["x"], d["y"], d["vx"], d["vy"], num_classes=10)
    model.eval()
    with torch.no_grad():
        pred = model(to_model_input(d["tx"])).argmax(1)
    return {
        "summary": summary,
        "test_acc": float((pred == d["ty"]).float().mean()),
        "sync_layers": sum(type(m).__name__ == "SyncQuantileActivation" for m in model.modules()),
        "state": {k: v.clone() for k, v in model.state_dict().items()},
    }


def trainer_multistage(rank, world, out, inp):
    """DistributedTrainer with chunk_size: the Trainer's multistage hook over the global batch."""
    from shiftguard.train.distributed import DistributedTrainer

    model, summary = fit_tiny("pairwise", inp["tiny"], DistributedTrainer, act="tanh", chunk_size=4)
    return {"state": {k: v.clone() for k, v in model.state_dict().items()}, "val_acc": summary["best_val_acc"]}
