"""``shiftguard toy``: the two-Gaussians failure mode of [QACT, Sec. 1, Fig. 1].

Trains the same small MLP (2 -> H -> H -> 1) twice on batches that each come from one context of
:func:`shiftguard.data.toy.two_gaussians` -- once with ReLU, once with QACT -- and reports the mean
accuracy over fresh contexts (each test batch is one context and, for QACT, its own context).
[QACT, Fig. 1b]: ReLU cannot beat a random guess; QACT infers the context.

The QACT network has no BatchNorm in front of its first QACT: per-batch centring would map
context ``theta`` onto context ``theta + 180 deg`` with the labels swapped, erasing exactly the
information the task needs. QACT's own grounding (eq. (8)-(9)) keeps the sign of the
pre-activation, i.e. where a point lies with respect to a fixed line.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from shiftguard.data.toy import two_gaussians
from shiftguard.nn import QuantileActivation

__all__ = ["build_mlp", "train_and_evaluate", "run_toy", "add_arguments", "main"]


def build_mlp(activation: str, hidden: int = 32, n_samples: int = 200) -> nn.Sequential:
    """MLP 2 -> hidden -> hidden -> 1 logit with ``relu`` or ``qact`` activations."""
    act: Callable[[], nn.Module]
    if activation == "relu":
        act = nn.ReLU
    elif activation == "qact":

        def act():
            return QuantileActivation(n_samples=n_samples)
    else:
        raise ValueError(f"activation: expected 'relu' or 'qact', got {activation!r}")
    return nn.Sequential(nn.Linear(2, hidden), act(), nn.Linear(hidden, hidden), act(), nn.Linear(hidden, 1))


def train_and_evaluate(
    activation: str,
    steps: int = 1000,
    batch_size: int = 64,
    hidden: int = 32,
    lr: float = 1e-2,
    n_test: int = 200,
    seed: int = 0,
    progress=None,
) -> dict:
    """Train on ``steps`` one-context batches, evaluate on ``n_test`` fresh contexts.

    Returns ``{"activation", "accuracy" (mean over contexts), "accuracy_std", "per_context" (list),
    "seconds"}``.
    """
    torch.manual_seed(seed)
    model = build_mlp(activation, hidden)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    train = two_gaussians(steps, batch_size, generator=torch.Generator().manual_seed(seed + 1))
    test = two_gaussians(n_test, batch_size, generator=torch.Generator().manual_seed(seed + 2))
    t0 = time.perf_counter()
    model.train()
    for step in range(steps):
        logits = model(train.x[step])[:, 0]
        loss = F.binary_cross_entropy_with_logits(logits, train.y[step].float())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if progress is not None:
            progress.update(1)
    model.eval()  # QACT stays in "batch" context: each test context is its own context
    with torch.no_grad():
        acc = torch.stack([((model(test.x[i])[:, 0] > 0).long() == test.y[i]).double().mean() for i in range(n_test)])
    return {
        "activation": activation,
        "accuracy": float(acc.mean()),
        "accuracy_std": float(acc.std()),
        "per_context": acc.tolist(),
        "seconds": time.perf_counter() - t0,
    }


def run_toy(
    steps: int = 1000, batch_size: int = 64, hidden: int = 32, n_test: int = 200, seed: int = 0, progress: bool = True
) -> dict:
    """Both activations; returns ``{"relu": result, "qact": result}``. ``progress``: a bar on a
    terminal; elsewhere (a log) whole lines, about one per tenth of the steps, never a ``'\\r'``."""
    from shiftguard._progress import progress as make_progress

    with make_progress(2 * steps, "toy (relu, qact)", enabled=progress, unit="step") as bar:
        return {
            a: train_and_evaluate(a, steps, batch_size, hidden, n_test=n_test, seed=seed, progress=bar)
            for a in ("relu", "qact")
        }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=1000, help="training batches (one context each), default 1000")
    parser.add_argument("--batch-size", type=int, default=64, help="points per context (even), default 64")
    parser.add_argument("--hidden", type=int, default=32, help="hidden width, default 32")
    parser.add_argument("--contexts", type=int, default=200, help="fresh test contexts, default 200")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    for name in ("steps", "hidden", "contexts"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name}: expected a positive integer, got {getattr(args, name)}")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads: expected a positive integer, got {args.threads}")
        torch.set_num_threads(args.threads)
    res = run_toy(args.steps, args.batch_size, args.hidden, args.contexts, args.seed, progress=not args.no_progress)
    print(f"two-Gaussians toy [QACT, Fig. 1]: {args.contexts} fresh contexts of {args.batch_size} points")
    for a in ("relu", "qact"):
        r = res[a]
        print(f"  {a:<5} accuracy {r['accuracy']:.3f} +- {r['accuracy_std']:.3f}   ({r['seconds']:.1f} s)")
    return 0
