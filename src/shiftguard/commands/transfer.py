"""``shiftguard transfer``: the URL transfer benchmark [Kirchhof, URL Sec. 3] in miniature, on MNIST and
Fashion-MNIST.

Protocol ([Kirchhof, URL Sec. 3.2], scaled down): every method trains a LeNet on a subset of the
UPSTREAM training images, then is evaluated zero-shot (no training, no fitting) on the test images of
DOWNSTREAM classes it never saw. This module is the command; the library parts are

- ``shiftguard.data.class_split``: the splits (:data:`SPLITS`, also the ``--preset`` names), their
  leak checks and loading;
- ``shiftguard.train.methods``: the methods (:data:`METHODS`), each a declarative record over the loss
  and estimator registries, trained by ``shiftguard.train.Trainer`` (Adam, learning rate 1e-3, fixed
  epochs, batch 128, the same seeded images for every method; nothing is tuned);
- ``shiftguard.evaluation.transfer``: the metrics (``r1``, ``r_auroc``, ``ood_auroc``,
  ``mixed_r_auroc``, ``up_r1``, ``up_r_auroc``, ``top1``, ``top5``, ``e_aurc``) and the tables.

Their public names are importable from here too. Every random draw comes from the run's seed: the
same command gives the same numbers. See ``docs/uncertainty.md`` ("The transfer benchmark").
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from shiftguard._validation import check_positive
from shiftguard.data.class_split import (
    SPLITS,
    SplitSpec,
    TransferData,
    check_class_split,
    load_split,
    make_transfer_data,
)
from shiftguard.evaluation.transfer import (
    ACROSS_KEYS,
    COLUMNS,
    across_splits,
    evaluate_transfer,
    format_table,
    recall_at_one,
    summarize,
)
from shiftguard.io import atomic_write_text
from shiftguard.metrics import excess_aurc, one_nn_misses
from shiftguard.train.methods import METHODS, Method, TransferModel, build_method, train_model

from .arguments import ListAction

__all__ = [
    "SPLITS",
    "METHODS",
    "COLUMNS",
    "ACROSS_KEYS",
    "SplitSpec",
    "TransferData",
    "Method",
    "TransferModel",
    "check_class_split",
    "make_transfer_data",
    "load_split",
    "one_nn_misses",
    "recall_at_one",
    "excess_aurc",
    "evaluate_transfer",
    "build_method",
    "train_model",
    "run_one",
    "run_benchmark",
    "summarize",
    "format_table",
    "across_splits",
    "add_arguments",
    "main",
]


def run_one(method: str, data: TransferData, seed: int, epochs: int = 3, batch_size: int = 128) -> dict:
    """Train ``method`` (a key of :data:`METHODS`) on ``data`` with ``seed`` and evaluate it.

    Returns ``{"method", "seed", "default_uncertainty", "train_seconds", "metrics"}`` with the metrics of
    :func:`evaluate_transfer`. Raises ``ValueError`` for an unknown ``method``. The global random state
    of the caller is restored afterwards.
    """
    in_channels = int(data.train_x.shape[1])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # the initialisation
        model = build_method(method, data.num_upstream_classes, in_channels, seed)
        t0 = time.perf_counter()
        train_model(model, data.train_x, data.train_y, epochs, batch_size, seed=seed)
        train_seconds = time.perf_counter() - t0
        up_e, up_lp, up_u = model.predict(data.up_test_x)
        dn_e, _, dn_u = model.predict(data.down_x)
    metrics = evaluate_transfer(up_e, data.up_test_y, dn_e, data.down_y, up_u, dn_u, up_lp, mix_seed=seed)
    return {
        "method": method,
        "seed": seed,
        "default_uncertainty": model.default_uncertainty,
        "train_seconds": round(train_seconds, 3),
        "metrics": metrics,
    }


def run_benchmark(
    splits: Sequence[str],
    methods: Sequence[str],
    seeds: Sequence[int],
    root: Optional[str] = None,
    train_subset: Optional[int] = 6000,
    epochs: int = 3,
    batch_size: int = 128,
    data: Optional[dict] = None,
    log: Optional[Callable[[str], None]] = None,
) -> dict:
    """Every (split, method, seed); ``data`` maps split names to prebuilt :class:`TransferData` (else
    :func:`load_split`). Returns ``{"protocol", "runs", "summary"}`` (JSON-ready)."""
    for s in splits:
        if data is None or s not in data:
            if s not in SPLITS:
                raise ValueError(f"splits: unknown split {s!r}; expected one of {', '.join(SPLITS)}")
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"methods: unknown method {m!r}; expected one of {', '.join(METHODS)}")
    runs = []
    for s in splits:
        d = data[s] if data is not None and s in data else load_split(s, root, train_subset)
        for m in methods:
            for seed in seeds:
                t0 = time.perf_counter()
                r = run_one(m, d, seed, epochs, batch_size)
                r["split"] = s
                r["seconds"] = round(time.perf_counter() - t0, 3)
                runs.append(r)
                if log is not None:
                    u = r["default_uncertainty"]
                    mm = r["metrics"]
                    ra = mm["uncertainty"][u]["r_auroc"]
                    log(
                        f"{s} {m} seed={seed}: R@1 {mm['r1']:.3f} R-AUROC "
                        f"{'-' if ra is None else f'{ra:.3f}'} ({r['seconds']:.1f} s)"
                    )
    protocol = {
        "splits": {s: (SPLITS[s].description if s in SPLITS else s) for s in splits},
        "methods": {m: METHODS[m].summary for m in methods},
        "seeds": list(seeds),
        "train_subset": train_subset,
        "epochs": epochs,
        "batch_size": batch_size,
        "optimizer": "Adam, lr 1e-3",
        "model": "LeNet-5, width 1, embedding 84",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "python": platform.python_version(),
    }
    return {"protocol": protocol, "runs": runs, "summary": summarize(runs)}


# -------------------------------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=sorted(SPLITS), help="one split (same as --splits NAME)")
    p.add_argument(
        "--splits",
        nargs="+",
        action=ListAction,
        default=None,
        help=f"space- or comma-separated; default all: {','.join(SPLITS)}",
    )
    p.add_argument(
        "--methods",
        nargs="+",
        action=ListAction,
        default=None,
        help=f"space- or comma-separated; default all: {','.join(METHODS)}",
    )
    p.add_argument(
        "--seeds",
        nargs="+",
        action=ListAction,
        default=["0", "1", "2"],
        help="space- or comma-separated ints (default 0 1 2)",
    )
    p.add_argument("--train-subset", type=int, default=6000, help="upstream training images (default 6000; 0 = all)")
    p.add_argument("--epochs", type=int, default=3, help="training epochs (default 3)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--root", default=None, help="data folder holding mnist/ and fashion-mnist/ (docs/data.md)")
    p.add_argument("--out", default=None, help="write the runs and the summary to this JSON file")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument(
        "--report", default=None, metavar="FILE.json", help="print the tables of a saved --out file instead of running"
    )


def main(argv=None) -> int:
    """``shiftguard transfer`` (``argv`` a list of arguments or a parsed ``argparse.Namespace``)."""
    if isinstance(argv, argparse.Namespace):
        args = argv
    else:
        parser = argparse.ArgumentParser(prog="shiftguard transfer", description=__doc__.splitlines()[0])
        add_arguments(parser)
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.report:
        try:
            with open(args.report, encoding="utf-8") as f:
                saved = json.load(f)
            runs = saved["runs"]
            table = format_table(summarize(runs), markdown=args.markdown)
        except FileNotFoundError:
            raise FileNotFoundError(f"--report: no such file: {args.report}") from None
        except (ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError) as exc:
            raise ValueError(
                f"--report: {args.report} is not a shiftguard transfer results file ({type(exc).__name__}: {exc})"
            ) from None
        print(table)
        return 0
    if args.preset and args.splits:
        raise ValueError("--preset/--splits: give one of them")
    splits = [args.preset] if args.preset else (args.splits or list(SPLITS))
    methods = args.methods or list(METHODS)
    try:
        seeds = [int(s) for s in args.seeds]
    except ValueError:
        raise ValueError(f"--seeds: expected integers, got {' '.join(args.seeds)}") from None
    if not seeds:
        raise ValueError("--seeds: expected at least one seed")
    if args.threads is not None:
        check_positive(args.threads, "--threads", integer=True)
        torch.set_num_threads(args.threads)
    if args.out:  # a place that cannot hold the results fails now, not after the benchmark
        out = Path(args.out)
        if out.is_dir():
            raise ValueError(f"--out: {out} is a folder; give the path of a JSON file to write")
        if not out.parent.is_dir():
            raise ValueError(f"--out: the folder {out.parent} does not exist")
        if not os.access(out.parent, os.W_OK):
            raise PermissionError(errno.EACCES, "cannot write into this folder", str(out.parent))
    subset = None if args.train_subset == 0 else args.train_subset
    result = run_benchmark(
        splits,
        methods,
        seeds,
        root=args.root,
        train_subset=subset,
        epochs=args.epochs,
        batch_size=args.batch_size,
        log=lambda s: print(s, file=sys.stderr, flush=True),
    )
    result["protocol"]["command"] = "shiftguard transfer " + " ".join(
        [
            f"--splits {','.join(splits)}",
            f"--methods {','.join(methods)}",
            f"--seeds {','.join(map(str, seeds))}",
            f"--train-subset {args.train_subset}",
            f"--epochs {args.epochs}",
            f"--batch-size {args.batch_size}",
        ]
        + ([f"--threads {args.threads}"] if args.threads is not None else [])
    )
    print(format_table(result["summary"], markdown=args.markdown))
    if args.out:
        atomic_write_text(args.out, json.dumps(result, indent=1, allow_nan=False) + "\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
