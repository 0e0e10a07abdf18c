"""Side-by-side retrieval comparison of the shiftguard losses on Fashion-MNIST (CPU-sized).

Trains the same tiny CNN embedding with each loss (class-balanced batches of m samples per class,
[Patel, Sec. 5.3.2]) and reports Recall@1/2/4/8 (retrieval sense: a positive among the k nearest neighbours,
[Patel, Sec. 5.3.1]) and MAP@R (pytorch-metric-learning's AccuracyCalculator) on held-out test images, next to
the untrained network.  Every number in docs/losses.md's retrieval table comes from this script:

    .venv/bin/python studies/losses_retrieval.py --out studies/results/losses_retrieval.json

Scale (defaults): 6000 training images (600/class), 2000 test images, 3 epochs, batch 60 (m = 6),
32-d embeddings; seeds fixed.  Timing is wall-clock on a shared 2-core CPU: noisy.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator
from torch import nn

from shiftguard.data import load
from shiftguard.io import atomic_write_json
from shiftguard.losses import build_loss
from shiftguard.train.samplers import ClassBalancedBatchSampler

LOSSES = {
    "RS@k": ("recall_at_k", {}),
    "RS@k+SiMix": ("recall_at_k", {"simix": True}),
    "Smooth-AP": ("smooth_ap", {}),
    "triplet (semihard)": ("triplet", {}),
    "ProxyAnchor": ("proxy_anchor", {}),
    "ProxyDR": ("proxydr", {}),
    "ProxyDR (dynamic)": ("proxydr", {"dynamic": True}),
    "DR (prototypes)": ("dr", {}),
    "watershed": ("watershed", {}),
    "MCInfoNCE": ("mcinfonce", {}),
    "EL-nivMF": ("nivmf_proxy", {}),
    "HIB": ("hib", {}),
    "ELK": ("elk", {}),
}
#: sampling-based vMF losses read ||e|| as kappa; the untrained CNN has ||e|| ~ 0.3 (a near-uniform vMF), so its
#: last layer is scaled at init by --prob-init-scale ([Kirchhof, App. B.1] likewise starts kappa^ in range).
SAMPLED_VMF = {"mcinfonce", "nivmf_proxy", "hib"}


class TinyCNN(nn.Module):
    """28x28 grey -> ``dim``-d embedding (two strided convolutions and a linear layer)."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, 16, 5, stride=2, padding=2),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(32 * 7 * 7, dim),
        )

    def forward(self, x):
        return self.body(x)

    embed = forward


def subset(ds, per_class: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    idx = torch.cat(
        [
            torch.nonzero(ds.labels == c).flatten()[
                torch.randperm(int((ds.labels == c).sum()), generator=g)[:per_class]
            ]
            for c in range(10)
        ]
    )
    return ds.images[idx].float().div(255.0).sub(0.2860).div(0.3530), ds.labels[idx]


@torch.no_grad()
def embed_all(model, x, bs=1000):
    model.eval()
    out = torch.cat([model(x[i : i + bs]) for i in range(0, len(x), bs)])
    model.train()
    return out


def retrieval(emb, labels, ks=(1, 2, 4, 8)):
    """Recall@k (any positive among the k nearest, cosine) and MAP@R (AccuracyCalculator)."""
    e = F.normalize(emb, dim=1)
    sim = e @ e.t()
    sim.fill_diagonal_(-float("inf"))
    top = sim.topk(max(ks), dim=1).indices
    hit = labels[top] == labels.unsqueeze(1)
    res = {f"recall@{k}": float(hit[:, :k].any(1).float().mean()) for k in ks}
    acc = AccuracyCalculator(
        include=("precision_at_1", "mean_average_precision_at_r"), k="max_bin_count", device=torch.device("cpu")
    )
    pml = acc.get_accuracy(e, labels, e, labels, ref_includes_query=True)
    res["map@r"] = float(pml["mean_average_precision_at_r"])
    res["pml_precision@1"] = float(pml["precision_at_1"])
    return res


def train_one(loss_name, kw, xtr, ytr, args):
    torch.manual_seed(args.seed)
    model = TinyCNN(args.dim)
    if loss_name in SAMPLED_VMF:
        with torch.no_grad():
            model.body[-1].weight.mul_(args.prob_init_scale)
            model.body[-1].bias.mul_(args.prob_init_scale)
    loss_fn = build_loss(loss_name, num_classes=10, embedding_dim=args.dim, **kw)
    opt = torch.optim.Adam(
        [
            {"params": list(model.parameters())},
            {"params": list(loss_fn.parameters()), "lr": args.lr * args.loss_lr_mult},
        ],
        lr=args.lr,
    )
    sampler = ClassBalancedBatchSampler(ytr, m=args.m, batch_size=args.batch_size, seed=args.seed)
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for batch in sampler:
            idx = torch.tensor(batch)
            loss = loss_fn(model(xtr[idx]), ytr[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model, time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default_root = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "fashion-mnist"
    p.add_argument("--root", default=str(default_root))
    p.add_argument("--train-per-class", type=int, default=600)
    p.add_argument("--test-per-class", type=int, default=200)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=60)
    p.add_argument("--m", type=int, default=6)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--loss-lr-mult", type=float, default=10.0, help="learning-rate multiplier for loss parameters (proxies)"
    )
    p.add_argument("--prob-init-scale", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", nargs="*", default=None, help="subset of loss labels to run")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    xtr, ytr = subset(load("fashion-mnist", "train", root=args.root), args.train_per_class, args.seed)
    xte, yte = subset(load("fashion-mnist", "test", root=args.root), args.test_per_class, args.seed)
    torch.manual_seed(args.seed)
    rows = {"untrained": {**retrieval(embed_all(TinyCNN(args.dim), xte), yte), "train_s": 0.0}}
    print(f"{'loss':<22}{'R@1':>7}{'R@2':>7}{'R@4':>7}{'R@8':>7}{'MAP@R':>8}{'train s':>9}")

    def show(name, r):
        print(
            f"{name:<22}{r['recall@1']:7.3f}{r['recall@2']:7.3f}{r['recall@4']:7.3f}{r['recall@8']:7.3f}"
            f"{r['map@r']:8.3f}{r['train_s']:9.1f}",
            flush=True,
        )

    show("untrained", rows["untrained"])
    for label, (name, kw) in LOSSES.items():
        if args.only and label not in args.only:
            continue
        model, secs = train_one(name, kw, xtr, ytr, args)
        rows[label] = {**retrieval(embed_all(model, xte), yte), "train_s": secs}
        show(label, rows[label])
    if args.out:
        atomic_write_json(
            args.out,
            {"config": vars(args), "results": rows, "torch": torch.__version__, "python": sys.version.split()[0]},
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
