"""``shiftguard corrupt``: write a corrupted copy of a dataset in the official on-disk layout.

Layouts (readable by :func:`shiftguard.data.load`):

- CIFAR-10-C layout (suites ``cifar-c`` / ``cifar-c-extra`` / ``cifar-c+extra``):
  ``OUT/<corruption>.npy`` = uint8 ``(S*N, H, W, C)``, the N images at the first requested
  severity, then the next, ...; ``OUT/labels.npy`` = the ``S*N`` labels (uint8). With the
  default ``--severities 1,2,3,4,5`` this is exactly the CIFAR-10-C release format:
  ``load("cifar10-c", "test", root=OUT, corruption="fog", severity=3)``.
- MNIST-C layout (suite ``mnist-c``): MNIST-C publishes one severity per corruption, so one
  official tree is written per severity:
  ``OUT/severity-<s>/<corruption>/{split}_images.npy`` (uint8 ``(N, H, W, C)``) and
  ``{split}_labels.npy`` (uint8); read with
  ``load("mnist-c", split, root=OUT/"severity-3", corruption="fog")``.

``OUT/manifest.json`` records the parameters, the per-file seeds, the shiftguard and torch
versions, and the sha256 of every file. Every file is written atomically.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import time
from pathlib import Path

import numpy as np
import torch

from shiftguard import corruptions as C
from shiftguard._progress import progress as make_progress
from shiftguard._version import __version__
from shiftguard.io import atomic_write_bytes, atomic_write_json, sha256_file

from .arguments import ListAction, load_dataset, split_list, suite_name

SUITE_CHOICES = ("mnist-c", "cifar-c", "cifar-c-extra", "cifar-c+extra")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dataset",
        default="mnist",
        help="dataset name for shiftguard.data.load, or mnist-default (the embedded MNIST subset) (default: mnist)",
    )
    parser.add_argument(
        "--suite", default="mnist-c", type=suite_name, choices=SUITE_CHOICES, help="corruption suite (default: mnist-c)"
    )
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument(
        "--root", default=None, help="dataset folder (default: $SHIFTGUARD_DATA/<dataset>, else the per-user cache)"
    )
    parser.add_argument(
        "--split",
        action=ListAction,
        default=["test"],
        metavar="SPLIT",
        help="split(s) to corrupt, space- or comma-separated (default: test)",
    )
    parser.add_argument(
        "--severities",
        action=ListAction,
        default=["1", "2", "3", "4", "5"],
        metavar="S",
        help="severities in 1..5, space- or comma-separated (default: 1 2 3 4 5)",
    )
    parser.add_argument(
        "--corruptions",
        action=ListAction,
        default=None,
        metavar="NAME",
        help="subset of the suite, space- or comma-separated (default: all)",
    )
    parser.add_argument("--seed", type=int, default=0, help="base seed (default: 0)")
    parser.add_argument("--limit", type=int, default=None, help="only the first LIMIT images of each split")
    parser.add_argument("--device", default="cpu", help="torch device for the corruption work (default: cpu)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's choice; 1 is often fastest for these small images on a busy CPU)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")


def parse_severities(values) -> list[int]:
    """``--severities`` as distinct integers in 1..5: a list of values, or one comma-separated string."""
    items = split_list([values] if isinstance(values, str) else [str(v) for v in values])
    try:
        sev = [int(s) for s in items]
    except ValueError:
        raise ValueError(f"--severities: expected integers in 1..5, got {' '.join(items)!r}") from None
    if not sev or any(not 1 <= s <= 5 for s in sev) or len(set(sev)) != len(sev):
        raise ValueError(f"--severities: expected distinct integers in 1..5, got {' '.join(items)!r}")
    return sev


def suite_names(suite: str) -> list[tuple[str, str]]:
    """``(suite, name)`` pairs of a CLI suite choice."""
    if suite == "cifar-c+extra":
        return [("cifar-c", n) for n in C.names("cifar-c")] + [("cifar-c-extra", n) for n in C.names("cifar-c-extra")]
    return [(suite, n) for n in C.names(suite)]


def _canonical_in(name, suite: str):
    """The registered name of corruption ``name`` in ``suite``, or None when that suite lacks it."""
    try:
        return C.canonical_name(name, suite, argument="--corruptions")
    except ValueError:
        return None


def sub_seed(seed: int, suite: str, name: str, severity: int) -> int:
    """Independent, reproducible seed for one (corruption, severity) file."""
    h = hashlib.sha256(f"{seed}/{suite}/{name}/{severity}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def _npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def _to_nhwc(images: torch.Tensor) -> np.ndarray:
    return images.permute(0, 2, 3, 1).contiguous().cpu().numpy()


def _labels_u8(labels: torch.Tensor) -> np.ndarray:
    lab = labels.cpu().numpy()
    return lab.astype(np.uint8) if lab.size == 0 or lab.max() < 256 else lab.astype(np.int64)


def load_split(dataset: str, split: str, root, limit):
    """``(images, labels)`` of one split, found as ``shiftguard run`` finds data (:func:`.arguments.load_dataset`)."""
    ds = load_dataset(dataset, split, root)
    images, labels = ds.images, ds.labels
    if limit is not None:
        if limit <= 0:
            raise ValueError(f"--limit: expected a positive integer, got {limit}")
        images, labels = images[:limit], labels[:limit]
    return images, labels


def write_corrupted(
    images_by_split: dict[str, tuple[torch.Tensor, torch.Tensor]],
    out: Path,
    suite: str,
    severities: list[int],
    seed: int,
    corruptions: list[str] | None = None,
    device: str = "cpu",
    progress: bool = True,
    extra_manifest: dict | None = None,
) -> dict:
    """Corrupt every split and write the layout for ``suite``; return the manifest.

    ``corruptions`` may be spelled in any case, with ``-``, ``_`` or spaces; files and manifest use
    the registered names. ``progress``: a bar on a terminal, one line per file written elsewhere.
    """
    pairs = suite_names(suite)
    if corruptions is not None:
        valid = [n for _, n in pairs]
        suites = list(dict.fromkeys(s for s, _ in pairs))  # two for cifar-c+extra
        chosen, unknown = set(), []
        for c in corruptions:
            name = next(filter(None, (_canonical_in(c, s) for s in suites)), None)
            if name is None:
                unknown.append(c)
            chosen.add(name)
        if unknown:
            raise ValueError(
                f"--corruptions: unknown for suite {suite!r}: {', '.join(map(repr, unknown))}; "
                f"valid: {', '.join(valid)}"
            )
        pairs = [(s, n) for s, n in pairs if n in chosen]
    mnist_layout = suite == "mnist-c"
    if not mnist_layout and len(images_by_split) != 1:
        raise ValueError("--split: the CIFAR-10-C layout holds one split; pass a single split")
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}
    seeds: dict[str, dict[str, int]] = {}
    total = len(pairs) * len(severities) * len(images_by_split)
    bar = make_progress(total, "corrupt", enabled=progress, unit="file", line_every=1)
    t0 = time.perf_counter()

    def put(rel: str, arr: np.ndarray) -> None:
        path = out / rel
        atomic_write_bytes(path, _npy_bytes(arr))
        files[rel] = sha256_file(path)

    if not mnist_layout:
        ((split, (images, labels)),) = images_by_split.items()
        images = images.to(device)
        put("labels.npy", np.concatenate([_labels_u8(labels)] * len(severities)))
        for s_name, name in pairs:
            blocks = []
            for sev in severities:
                sd = sub_seed(seed, s_name, name, sev)
                seeds.setdefault(name, {})[str(sev)] = sd
                blocks.append(_to_nhwc(C.corrupt(images, name, sev, seed=sd, suite=s_name)))
                bar.update(1, f"{name} s{sev}")
            put(f"{name}.npy", np.concatenate(blocks))
    else:
        for sev in severities:
            for s_name, name in pairs:
                sd = sub_seed(seed, s_name, name, sev)
                seeds.setdefault(name, {})[str(sev)] = sd
                for split, (images, labels) in images_by_split.items():
                    y = C.corrupt(images.to(device), name, sev, seed=sd, suite=s_name)
                    base = f"severity-{sev}/{name}/{split}"
                    put(f"{base}_images.npy", _to_nhwc(y))
                    put(f"{base}_labels.npy", _labels_u8(labels))
                    bar.update(1, f"{name} s{sev} {split}")
    bar.close()
    manifest = {
        "tool": "shiftguard corrupt",
        "shiftguard_version": __version__,
        "torch_version": torch.__version__,
        "suite": suite,
        "layout": (
            "mnist-c (one official tree per severity)" if mnist_layout else "cifar-10-c (severity blocks stacked)"
        ),
        "splits": {k: int(v[0].shape[0]) for k, v in images_by_split.items()},
        "image_shape": list(next(iter(images_by_split.values()))[0].shape[1:]),
        "severities": severities,
        "corruptions": [n for _, n in pairs],
        "seed": seed,
        "seeds": seeds,
        "seconds": round(time.perf_counter() - t0, 3),
        "files": files,
    }
    if extra_manifest:
        manifest.update(extra_manifest)
    atomic_write_json(out / "manifest.json", manifest)
    return manifest


def main(args: argparse.Namespace) -> int:
    severities = parse_severities(args.severities)
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads: expected a positive integer, got {args.threads}")
        torch.set_num_threads(args.threads)
    splits = list(dict.fromkeys(args.split))
    data = {sp: load_split(args.dataset, sp, args.root, args.limit) for sp in splits}
    manifest = write_corrupted(
        data,
        Path(args.out),
        args.suite,
        severities,
        args.seed,
        args.corruptions,
        device=args.device,
        progress=not args.no_progress,
        extra_manifest={"dataset": args.dataset, "root": args.root, "limit": args.limit},
    )
    n_files = len(manifest["files"])
    print(f"wrote {n_files} files + manifest.json to {args.out} in {manifest['seconds']:.1f} s")
    return 0
