"""``shiftguard gallery``: one PNG grid of a corruption suite, rows = corruptions, columns =
severities 0 (clean) to 5, the same image in every row.

``--dataset synthetic`` uses the procedural RGB scene of
:func:`shiftguard.corruptions.figures.synthetic_scene` and ``mnist-default`` (the default) the
embedded MNIST subset: no data needed. Any other name is read as ``shiftguard run`` reads its data
(:func:`.arguments.load_dataset`: ``--root``, else ``$SHIFTGUARD_DATA/<name>``, else the per-user
cache).
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

from shiftguard.io import atomic_write_bytes

from .arguments import DEFAULT_DATASETS, load_dataset, suite_name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dataset",
        default=DEFAULT_DATASETS[0],
        help="a shiftguard.data.load name, 'synthetic', or mnist-default (the embedded MNIST subset; default)",
    )
    parser.add_argument(
        "--suite",
        default="mnist-c",
        type=suite_name,
        choices=("mnist-c", "cifar-c", "cifar-c-extra"),
        help="suite (default: mnist-c)",
    )
    parser.add_argument("--out", default=None, help="PNG file (default: gallery_<suite>.png)")
    parser.add_argument(
        "--root", default=None, help="dataset folder (default: $SHIFTGUARD_DATA/<dataset>, else the per-user cache)"
    )
    parser.add_argument("--split", default="test", help="split (default: test)")
    parser.add_argument("--index", type=int, default=0, help="which image of the split (default: 0)")
    parser.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    parser.add_argument("--dpi", type=int, default=110, help="PNG resolution (default: 110)")


def load_images(dataset: str, split: str, root, index: int):
    if dataset == "synthetic":
        from shiftguard.corruptions.figures import synthetic_scene

        return synthetic_scene(index + 1, 32, seed=0)
    return load_dataset(dataset, split, root).images


def main(args: argparse.Namespace) -> int:
    from shiftguard.corruptions import gallery

    images = load_images(args.dataset, args.split, args.root, args.index)
    fig = gallery(images, args.suite, index=args.index, seed=args.seed)
    out = Path(args.out or f"gallery_{args.suite}.png")
    if out.suffix.lower() != ".png":
        raise ValueError(f"--out: expected a .png file name, got {out}")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=args.dpi)
    import matplotlib.pyplot as plt

    plt.close(fig)
    atomic_write_bytes(out, buf.getvalue())
    print(f"wrote {out}")
    return 0
