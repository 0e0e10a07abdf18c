"""The QACT paper's public reference code beside shiftguard's QACT, block against block, on one device.

The peer figure of ``docs/performance.md``: forward+backward in training mode of the reference
implementation's BatchNorm-QACT-BatchNorm layer (``quantile_activation_2d`` / ``_1d`` of its
``src/quantile_activation_accum.py``, the one its ResNet uses, with its own BatchNorms in and out)
against shiftguard's ``QACTBlock`` (eager) and the BN-ReLU-BN baseline, in the same run, at the
four shapes of ``bench_qact.py`` (``--smoke``: tiny shapes).

The reference code is not part of shiftguard and is never copied into it: ``--peer DIR`` names a
checkout of https://github.com/adityac20/quantile_activation (the folder holding its ``src/``),
which this script imports at run time. ``device_check.sh`` looks for it in ``.peer/quantile_activation``
(git-ignored; put a checkout there and carry it to the device machine). Without it the report
says so and nothing is measured.

Usage: ``python benchmarks/bench_peer_qact.py --peer DIR --device cuda --out DIR``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_device import report_header, timed, write_skipped

SHAPES = [(256, 64, 12, 12), (128, 64, 16, 16), (256, 512), (1024, 128)]
SMOKE_SHAPES = [(16, 4, 6, 6), (32, 16)]
#: The reference repository's last commit when this script was written (its README names no release).
PEER_COMMIT = "7162805"


def _peer_layers(peer: Path):
    """The reference's ``(quantile_activation_1d, quantile_activation_2d)``, imported from ``peer``."""
    if not (peer / "src" / "quantile_activation_accum.py").is_file():
        raise FileNotFoundError(f"--peer: {peer} holds no src/quantile_activation_accum.py")
    sys.path.insert(0, str(peer))
    from src.quantile_activation_accum import quantile_activation_1d, quantile_activation_2d

    return quantile_activation_1d, quantile_activation_2d


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peer", type=Path, required=True, help="a checkout of adityac20/quantile_activation")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--smoke", action="store_true", help="tiny shapes, a few repeats (checks the script)")
    p.add_argument("--repeats", type=int, default=None)
    args = p.parse_args()
    path, info = report_header(
        "bench_peer_qact", args.device, args.out, args.smoke, peer=str(args.peer), peer_commit=PEER_COMMIT, rows=[]
    )
    if "skipped" in info:
        return 0
    try:
        peer_1d, peer_2d = _peer_layers(args.peer)
    except (FileNotFoundError, ImportError) as exc:
        write_skipped(path, info, f"the reference code could not be imported: {exc}")
        return 0
    from shiftguard.nn import BNActBlock, QACTBlock

    dev = torch.device(args.device)
    repeats = args.repeats or (3 if args.smoke else 10)
    for shape in SMOKE_SHAPES if args.smoke else SHAPES:
        c = shape[1]
        t0 = time.perf_counter()
        torch.manual_seed(0)
        blocks = {
            "BN-ReLU-BN": BNActBlock(c, "relu"),
            "shiftguard QACTBlock": QACTBlock(c),
            "reference": (peer_2d if len(shape) == 4 else peer_1d)(c),
        }
        x = torch.randn(*shape, device=dev, requires_grad=True)
        g = torch.randn(*shape, device=dev)
        ms = {}
        for name, block in blocks.items():
            block = block.to(dev).train()
            ms[name] = 1e3 * timed(lambda block=block: block(x).backward(g), dev, repeats, 3)
        row = {
            "bench": "block fwd+bwd, training mode",
            "case": "x".join(map(str, shape)),
            **{f"{name} ms": round(v, 4) for name, v in ms.items()},
            "reference / shiftguard": round(ms["reference"] / ms["shiftguard QACTBlock"], 3),
            "shiftguard / BN-ReLU-BN": round(ms["shiftguard QACTBlock"] / ms["BN-ReLU-BN"], 3),
            "wall_s": round(time.perf_counter() - t0, 2),
        }
        info["rows"].append(row)
        print(json.dumps(row), flush=True)
        path.write_text(json.dumps(info, indent=1))  # what is done so far survives a timeout
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
