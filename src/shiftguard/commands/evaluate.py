"""``shiftguard evaluate``: the command-line face of :func:`shiftguard.evaluate`.

::

    shiftguard evaluate --model mypkg.nets:make_cnn --weights cnn.pt --dataset fashion-mnist \\
        --root ../data/fashion-mnist --normalize 0.2860 0.3530 --heads softmax temperature ned --out report/

The model comes from a factory ``module:function`` (``shiftguard.models.build_user_model``: called
with those of ``num_classes`` / ``in_channels`` it accepts; the current directory is importable);
weights are read safely: ``torch.load`` with
``weights_only=True`` (no code runs) or a ``.safetensors`` file. Nothing is downloaded. The
support (heads' training data) and the validation split come from the dataset's training split.
"""

from __future__ import annotations

import argparse
import errno
import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["add_arguments", "main", "load_weights", "command_line", "record"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from shiftguard.heads import HEAD_NAMES

    from .arguments import ListAction

    p.add_argument(
        "--model",
        required=True,
        metavar="MODULE:FACTORY",
        help="import path of a function returning the nn.Module, e.g. mypkg.nets:make_cnn "
        "(the current directory is importable)",
    )
    p.add_argument(
        "--weights",
        metavar="FILE",
        help="state dict: .pt/.pth (torch.load weights_only=True) or .safetensors (required unless --random-weights)",
    )
    p.add_argument(
        "--random-weights",
        action="store_true",
        help="evaluate the model as its factory initialises it, without --weights (a baseline of chance)",
    )
    p.add_argument(
        "--dataset",
        default="mnist-default",
        help="a shiftguard.data.load name (mnist, fashion-mnist, cifar10, ...) or mnist-default "
        "(the embedded MNIST subset; default)",
    )
    p.add_argument("--root", help="folder of the dataset files (default: the loader's default location)")
    p.add_argument("--suite", help="corruption suite: mnist-c or cifar-c (default: by channel count)")
    p.add_argument(
        "--corruptions",
        action=ListAction,
        metavar="NAME",
        help="subset of the suite's corruptions, space- or comma-separated (default: all)",
    )
    p.add_argument(
        "--severities",
        action=ListAction,
        item=int,
        default=[1, 2, 3, 4, 5],
        metavar="S",
        help="severities in 1..5, space- or comma-separated (default: 1 2 3 4 5)",
    )
    p.add_argument("--extra", action="store_true", help="also CIFAR-10-C's 4 extra corruptions (reported apart)")
    p.add_argument(
        "--heads",
        action=ListAction,
        metavar="HEAD",
        help=f"heads, space- or comma-separated (default: the library default); any of {', '.join(HEAD_NAMES)}",
    )
    p.add_argument(
        "--normalize",
        nargs=2,
        type=float,
        action="append",
        metavar=("MEAN", "STD"),
        help="mean/std normalisation after corruption, once per channel (or once for all)",
    )
    p.add_argument(
        "--embed",
        metavar="LAYER",
        help="submodule whose output is the embedding (default: the input of the last nn.Linear)",
    )
    p.add_argument("--test-subset", type=int, default=0, metavar="N", help="evaluate on N test images (0 = all)")
    p.add_argument(
        "--support-size",
        type=int,
        default=10000,
        metavar="N",
        help="training images the heads are fitted on (default 10000; 0 = all)",
    )
    p.add_argument(
        "--val-size",
        type=int,
        default=2000,
        metavar="N",
        help="training images held out for temperature / NED (default 2000; 0 = none)",
    )
    p.add_argument("--batch-size", type=int, default=500, help="evaluation batch (the QACT context)")
    p.add_argument(
        "--adapt",
        action=ListAction,
        options=True,
        default=["none"],
        metavar="ARM",
        help="test-time adaptation arms scored side by side, space- or comma-separated: none (default), "
        "bn-batch, bn, tent, refresh "
        "(options as 'bn:prior=16', 'tent:lr=0.00025,optimizer=sgd', 'refresh:passes=2'; "
        "docs/evaluate.md)",
    )
    p.add_argument(
        "--conformal",
        action=ListAction,
        default=[],
        metavar="METHOD",
        help="conformal prediction sets of every head, space- or comma-separated: some of lac, aps, raps "
        "(calibrated on half of the validation images; docs/conformal.md)",
    )
    p.add_argument(
        "--alpha", type=float, default=0.1, help="miscoverage level of the sets (default 0.1: 90%% coverage)"
    )
    p.add_argument(
        "--conformal-weighted",
        action="store_true",
        help="also the weighted split conformal of covariate shift (transductive)",
    )
    p.add_argument("--baseline", metavar="RESULTS", help="results.json (or its folder) of a baseline for CE / mCE")
    p.add_argument(
        "--baseline-key",
        metavar="MODEL/CONTEXT/HEAD",
        help="which of the baseline's series (MODEL/CONTEXT/ADAPTATION/HEAD for an adapted one); "
        "without --baseline, a series of this evaluation",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--n-boot", type=int, default=1000, help="bootstrap resamples of the 95%% intervals")
    p.add_argument("--name", default="evaluation", help="name shown in the report")
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="folder for results.json, results.csv, plots, report.html: new or empty (see --overwrite)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the report files of an earlier evaluation in --out (never a shiftguard run folder)",
    )
    p.add_argument("--no-progress", action="store_true")


def _clear_report(out: Path) -> None:
    """Remove an earlier report from ``out`` (``--overwrite``): ``results.json`` first, so that a
    failure from here on never leaves old and new files side by side looking complete."""
    for name in _REPORT_FILES:
        (out / name).unlink(missing_ok=True)
    plots = out / "plots"
    if plots.is_dir() and not plots.is_symlink():
        for f in plots.iterdir():
            if f.suffix == ".png" and (f.is_file() or f.is_symlink()):
                f.unlink()


def load_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Load a state dict safely: ``.safetensors`` via safetensors, else ``torch.load(weights_only=True)``
    (a checkpoint dict with a ``state_dict`` or ``model`` entry is accepted). Mismatched keys or
    shapes are an error naming the file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--weights: no such file: {p}")
    state: Any
    if p.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise ValueError(
                "--weights: reading .safetensors needs the 'safetensors' package "
                "(pip install 'shiftguard[safetensors]')"
            ) from None
        try:
            state = load_file(str(p))
        except Exception as exc:  # the format's own errors have several types
            raise ValueError(f"--weights: {p} is not a valid safetensors file ({exc})") from None
    else:
        try:
            state = torch.load(p, map_location="cpu", weights_only=True)
        except Exception as exc:  # damaged zip, refused pickle: many types
            raise ValueError(
                f"--weights: {p} could not be read as a weights-only torch file ({type(exc).__name__}: {exc})"
            ) from None
        if isinstance(state, dict) and not all(isinstance(v, torch.Tensor) for v in state.values()):
            for key in ("state_dict", "model"):
                if isinstance(state.get(key), dict):
                    state = state[key]
                    break
    if not isinstance(state, dict):
        raise ValueError(f"--weights: {p} holds a {type(state).__name__}, not a state dict")
    for key, t in state.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not torch.isfinite(t).all():
            raise ValueError(f"--weights: {p} holds non-finite values (NaN or inf) in {key!r}")
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise ValueError(f"--weights: {p} does not fit the model: {' '.join(str(exc).split())}") from None


def _normalizer(pairs, channels: int | None = None):
    if not pairs:
        return None
    import math

    if any(not math.isfinite(v) for pair in pairs for v in pair):
        raise ValueError(f"--normalize: expected finite numbers, got {[list(p) for p in pairs]}")
    if channels is not None and len(pairs) not in (1, channels):
        raise ValueError(
            f"--normalize: given {len(pairs)} times for images of {channels} channel(s); give it once "
            f"(every channel) or once per channel"
        )
    mean = torch.tensor([m for m, _ in pairs]).view(1, -1, 1, 1)
    std = torch.tensor([s for _, s in pairs]).view(1, -1, 1, 1)
    if (std <= 0).any():
        raise ValueError(f"--normalize: std must be positive, got {[s for _, s in pairs]}")

    def normalize(x: torch.Tensor) -> torch.Tensor:
        return (x - mean.to(x.device)) / std.to(x.device)

    normalize.__qualname__ = f"normalize(mean={[m for m, _ in pairs]}, std={[s for _, s in pairs]})"
    return normalize


def _data(args):
    from shiftguard import data as D

    if args.dataset in ("mnist-default", "default"):
        train, test = D.load_default("train"), D.load_default("test")
    else:
        try:
            train, test = D.load(args.dataset, "train", args.root), D.load(args.dataset, "test", args.root)
        except FileNotFoundError as exc:  # the loader's message spans lines and speaks Python
            from .arguments import missing_files_line

            raise FileNotFoundError(missing_files_line(str(exc), args.dataset)) from None
    g = torch.Generator().manual_seed(args.seed)
    tx, ty = test.images, test.labels
    if args.test_subset:
        idx = torch.randperm(len(ty), generator=g)[: args.test_subset].sort().values
        tx, ty = tx[idx], ty[idx]
    perm = torch.randperm(len(train.labels), generator=g)
    n_val = min(args.val_size, len(perm) // 2) if args.val_size else 0
    val_idx = perm[:n_val].sort().values
    rest = perm[n_val:]
    sup_idx = (rest[: args.support_size] if args.support_size else rest).sort().values
    val = (train.images[val_idx], train.labels[val_idx]) if n_val else None
    return (
        test.name,
        (tx, ty),
        (train.images[sup_idx], train.labels[sup_idx]),
        val,
        len(test.classes),
        int(train.images.shape[1]),
    )


def main(args) -> int:
    from shiftguard._lock import LOCK_NAME, DirectoryLock

    for flag in ("test_subset", "support_size", "val_size"):
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')}: expected >= 0, got {getattr(args, flag)}")
    if ":" not in args.model:
        raise ValueError(f"--model: expected 'module:function', got {args.model!r}")
    if not args.weights and not args.random_weights:
        raise ValueError(
            "--weights: no weights given; the model would be evaluated as initialised (chance level). "
            "Pass --weights FILE, or --random-weights to evaluate the untrained model on purpose"
        )
    if args.weights and args.random_weights:
        raise ValueError("--random-weights: given with --weights; choose one")
    if not 0 <= args.seed < 2**63:
        raise ValueError(f"--seed: expected an integer in 0..2**63-1, got {args.seed}")
    from shiftguard.evaluation.evaluate import check_device

    try:
        check_device(args.device)
    except ValueError as exc:
        raise ValueError(f"--{exc}") from None
    _normalizer(args.normalize)  # values checked before any work; the channel count once the data is read
    if 0 < args.test_subset <= 5:
        raise ValueError(
            f"--test-subset: expected more than 5 test images (MAP@5 ranks each against the others), "
            f"got {args.test_subset}"
        )
    created = not Path(args.out).exists()
    out = _output_folder(args.out, args.overwrite)
    lock = DirectoryLock(out).acquire()
    try:
        return _evaluate_into(args, out)
    except BaseException:
        if created and {p.name for p in out.iterdir()} <= {LOCK_NAME}:
            (out / LOCK_NAME).unlink(missing_ok=True)  # a folder this call made and nothing was written into
            out.rmdir()
        raise
    finally:
        lock.release()


def _evaluate_into(args, out: Path) -> int:
    from shiftguard.evaluation import evaluate
    from shiftguard.models import build_user_model

    name, test, support, val, num_classes, channels = _data(args)
    model = build_user_model(args.model, num_classes=num_classes, in_channels=channels, what="--model")
    if args.weights:
        load_weights(model, args.weights)
    provenance = record(args)  # the weights' SHA-256 taken right after they are read
    result = evaluate(
        model,
        test,
        support=support,
        validation=val,
        suite=args.suite,
        corruptions=args.corruptions,
        severities=args.severities,
        extra=args.extra,
        heads=args.heads,
        embed=args.embed,
        preprocess=_normalizer(args.normalize, channels),
        batch_size=args.batch_size,
        adapt=args.adapt,
        conformal=args.conformal,
        alpha=args.alpha,
        conformal_weighted=args.conformal_weighted,
        device=args.device,
        seed=args.seed,
        baseline=args.baseline,
        baseline_key=args.baseline_key,
        n_boot=args.n_boot,
        name=args.name,
        progress=not args.no_progress,
    )
    result.results["data"]["dataset"] = name
    result.results.update(provenance)
    # The numbers are shown before the files are written: a disk that fills up now loses no result.
    print(result.summary())
    _clear_report(out)
    for s in result.skipped_heads:
        print(f"skipped {s['model']}/{s['head']}: {s['reason']}")
    for s in result.results.get("skipped_adaptations") or []:
        print(f"skipped adaptation {s['model']}/{s['adaptation']}: {s['reason']}")
    path = result.write_report(out)
    print(f"\nwrote {out}/ (results.json, results.csv, plots/, {path.name})")
    return 0


def command_line(args) -> str:
    """The command that reproduces this evaluation: ``shiftguard evaluate`` with every option of
    ``args`` spelt out (defaults included, so a later change of a default does not change what
    the line means), quoted for a POSIX shell."""
    import shlex

    words = ["shiftguard", "evaluate"]
    for dest, value in vars(args).items():
        flag = "--" + dest.replace("_", "-")
        if value is None or value is False or (isinstance(value, (list, tuple)) and not value):
            continue
        if value is True:
            words.append(flag)
        elif dest == "normalize":  # action="append" of MEAN STD pairs: one flag per pair
            for pair in value:
                words += [flag, *map(str, pair)]
        elif isinstance(value, (list, tuple)):
            words += [flag, *map(str, value)]
        else:
            words += [flag, str(value)]
    return shlex.join(words)


def file_sha256(path: str | Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def record(args) -> dict:
    """What ``results.json`` records beside the numbers so that the evaluation can be repeated:
    ``command`` (:func:`command_line`), ``versions`` (as ``shiftguard run`` records them) and
    ``record``: the model factory, the weights file with its SHA-256 (``None`` for
    ``--random-weights``), the normalisation the flags gave, the dataset's folder and the sizes
    asked for. The images the model was trained on are not known here (``data.n_train`` is None);
    ``data.n_support`` counts the heads' support set."""
    from .run import versions

    weights = None if not args.weights else {"path": str(args.weights), "sha256": file_sha256(args.weights)}
    normalize = (
        None
        if not args.normalize
        else {"mean": [float(m) for m, _ in args.normalize], "std": [float(s) for _, s in args.normalize]}
    )
    return {
        "command": command_line(args),
        "versions": versions(),
        "record": {
            "model": args.model,
            "weights": weights,
            "normalize": normalize,
            "dataset": args.dataset,
            "root": args.root,
            "test_subset": args.test_subset,
            "support_size": args.support_size,
            "val_size": args.val_size,
        },
    }


#: What an evaluation writes into --out (``EvaluationResult.write_report``); ``results.json`` is
#: written last and removed first, so a folder holding it holds one complete report.
_REPORT_FILES = ("results.json", "report.html", "results.csv")


def _output_folder(out: str, overwrite: bool = False) -> Path:
    """``--out`` created (with its parents) before the evaluation, so that a place which cannot hold
    the results fails at once: ``ValueError`` when a file is in the way, when the folder holds
    anything but an earlier evaluation's report (which ``--overwrite`` replaces) or is a
    ``shiftguard run`` folder; the ``OSError`` of a folder that cannot be created;
    ``PermissionError`` (``EROFS``/``EACCES``) when it cannot be written into."""
    from shiftguard._lock import LOCK_NAME

    from .rundir import COMPLETE_MARKER

    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out: {path} exists and is not a folder")
    if path.is_dir():
        if (path / COMPLETE_MARKER).exists() or (path / "config.json").exists():
            raise ValueError(
                f"--out: {path} is a shiftguard run folder; its report belongs to that run. Give a new "
                "folder (shiftguard report rebuilds a run's report elsewhere)"
            )
        others = [p.name for p in path.iterdir() if p.name != LOCK_NAME]
        if others and not overwrite:
            raise ValueError(
                f"--out: {path} is not empty ({', '.join(sorted(others)[:5])}"
                f"{', ...' if len(others) > 5 else ''}); give a new folder, or --overwrite to replace an "
                "earlier evaluation's report there"
            )
        foreign = [n for n in others if n not in (*_REPORT_FILES, "plots")]
        if others and overwrite and foreign:
            raise ValueError(
                f"--overwrite: {path} holds files that are not a shiftguard report "
                f"({', '.join(sorted(foreign)[:5])}); give a new folder"
            )
    path.mkdir(parents=True, exist_ok=True)
    if not os.access(path, os.W_OK):
        raise PermissionError(errno.EACCES, "cannot write into this folder (read-only or no permission)", str(path))
    return path
