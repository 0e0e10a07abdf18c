"""First-call cost of the compiled (numba) kernels: what a user meets in a fresh environment.

Each measurement is a new Python process with ``NUMBA_CACHE_DIR`` pointing at a folder of its own:
"cold" with the folder empty (every kernel is compiled), then "warm", a second process on the same
folder (the kernels are loaded from numba's disk cache). Measured in each process:

- ``qact``: the first forward+backward of BN-QACT-BN at a conv shape ``(32, 16, 12, 12)`` (batch
  context, training: what the first training step runs), then the second one;
- ``warm_up``: :func:`shiftguard.functional.warm_up` (every QACT path and variant, what
  ``shiftguard run`` compiles in its announced step);
- ``corrupt``: one pass over the 15 MNIST-C corruptions (8 images 28x28, uint8) and the 15 CIFAR-10-C
  ones (8 images 3x32x32) at severity 3, the first pass over the corruptions of an evaluation,
  and ``shiftguard.corruptions.warm_up`` timed before it in a process of its own.

Wall and CPU seconds per step, import time apart. The machine's load average is printed and recorded
(timings on a shared machine are noisy; the CPU seconds less so). ``--src`` runs another source tree
(its ``src`` folder) for a before/after comparison in the same run.
Target: the first QACT forward+backward in a fresh environment <= 5 s on 2 idle cores.

    python benchmarks/bench_coldstart.py [--src PATH ...] [--out benchmarks/results/bench_coldstart.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, sys, time
mode = sys.argv[1]
w0, c0 = time.perf_counter(), time.process_time()
import torch
torch.set_num_threads(1)
import shiftguard
from shiftguard.nn import QuantileActivation
res = {"import_s": time.perf_counter() - w0, "import_cpu_s": time.process_time() - c0, "module": shiftguard.__file__}


def timed(key, fn):
    w, c = time.perf_counter(), time.process_time()
    fn()
    res[key + "_s"], res[key + "_cpu_s"] = time.perf_counter() - w, time.process_time() - c


if mode == "qact":
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.BatchNorm2d(16), QuantileActivation(), torch.nn.BatchNorm2d(16))
    x = torch.randn(32, 16, 12, 12, requires_grad=True)
    timed("first", lambda: block(x).sum().backward())
    timed("second", lambda: block(x).sum().backward())
elif mode == "warm_up":
    from shiftguard.functional import warm_up
    timed("warm_up", warm_up)
elif mode in ("corrupt", "corrupt_warm_up"):
    from shiftguard import corruptions as SC
    gen = torch.Generator().manual_seed(0)
    grey = torch.randint(0, 256, (8, 1, 28, 28), dtype=torch.uint8, generator=gen)
    rgb = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8, generator=gen)

    def one_pass():
        for suite, images in (("mnist-c", grey), ("cifar-c", rgb)):
            for name in SC.names(suite):
                SC.corrupt(images, name, 3, suite=suite)

    if mode == "corrupt_warm_up":
        res["warm_up_missing"] = not hasattr(SC, "warm_up")  # a tree from before it existed
        timed("warm_up", getattr(SC, "warm_up", lambda: None))
    timed("first", one_pass)
    timed("second", one_pass)
print(json.dumps(res))
"""


def _run(mode: str, src: Path, cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    env.update(NUMBA_CACHE_DIR=str(cache), PYTHONPATH=str(src), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _CHILD, mode], env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} on {src} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--src",
        nargs="*",
        default=[str(ROOT / "src")],
        help="source trees (folders holding the shiftguard package) to measure, each as PATH or LABEL=PATH",
    )
    parser.add_argument("--modes", default="qact,warm_up,corrupt,corrupt_warm_up")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_coldstart.json"))
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    rows = []
    load_before = os.getloadavg()
    for entry in args.src:
        label, _, src = entry.rpartition("=")
        label = label or src
        for mode in modes:
            with tempfile.TemporaryDirectory(prefix="bench-coldstart-") as cache:
                cold = _run(mode, Path(src), Path(cache))
                warm = _run(mode, Path(src), Path(cache))
            rows.append({"src": label, "mode": mode, "cold": cold, "warm": warm, "load": os.getloadavg()[0]})
            step = "warm_up" if mode in ("warm_up", "corrupt_warm_up") else "first"
            print(
                f"{label:24s} {mode:16s} {step:8s} cold {cold[step + '_s']:6.2f} s (cpu {cold[step + '_cpu_s']:6.2f})"
                f"  warm {warm[step + '_s']:6.2f} s (cpu {warm[step + '_cpu_s']:6.2f})"
                + (f"  then first pass {cold['first_s']:.2f} s" if mode == "corrupt_warm_up" else "")
                + f"  import {cold['import_s']:.1f} s  load {rows[-1]['load']:.1f}",
                flush=True,
            )
    record = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
