"""QACT against its BatchNorm twin, eager and under ``torch.compile``, on one device.

Two measurements, each QACT beside its baseline in the same run, both sides run alike (both eager,
or both compiled with the same backend):

- BN-QACT-BN (``QACTBlock``) vs BN-ReLU-BN (``BNActBlock``) forward+backward at the four shapes of
  ``bench_qact.py`` (``--smoke``: tiny shapes), eager and compiled, and on CUDA also captured in a
  CUDA graph and replayed (mode ``cuda-graph``: no launch overhead left, the kernels' own time);
- a ResNet-18 (``shiftguard.models``) training step (forward, cross-entropy, backward, SGD step) on
  32x32 inputs at batch 128 (``--smoke``: batch 8, 16x16, base width 8), ``activation="qact"`` vs
  its twin ``"bn-relu-bn"``, eager and compiled.

Each pair's steps are timed in turn, one of each per round (:func:`timed_in_turn`): a drift of a
shared machine's speed during the run moved a ResNet-18 ratio timed one model after the other from
1.13 to 0.88 on the CPU.

And where a BN-QACT-BN training step's time goes (``kernels`` rows): a ``torch.profiler`` trace of
eager steps at each shape, the kernels launched per step and their device time by name, so that a
GPU run says which stage (the sort, a Triton kernel, the launches) to work on next (on CUDA; with
``--smoke`` on the CPU the aten operators' CPU time, only to check the script: the compiled QACT
kernels are not operators).

Targets (``docs/performance.md``): ratio QACT / twin <= 2 at every shape, eager and compiled;
ResNet-18 step <= 1.5 compiled. Prints a table and writes JSON to ``--out`` (the path is printed).

Usage: ``python benchmarks/bench_qact_compile.py --device cuda --out DIR`` (``device_check.sh``);
``--smoke`` runs a reduced version in seconds (the CPU check of the script itself).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_device import (
    report_header,
    sync,
    timed_in_turn,
)  # (the same timing and report as the other device benchmarks)

SHAPES = [(256, 64, 12, 12), (128, 64, 16, 16), (256, 512), (1024, 128)]
SMOKE_SHAPES = [(16, 4, 6, 6), (32, 16)]


def _maybe_compile(module, backend):
    return module if backend is None or backend == "cuda-graph" else torch.compile(module, backend=backend)


def _graphed_step(block, x, g):
    """The block's forward+backward captured in a CUDA graph (after a warm-up on a side stream, as
    ``torch.cuda.graph`` asks), returned as the graph's replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            block(x).backward(g)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        block(x).backward(g)
    return graph.replay


def bench_blocks(dev, shapes, backends, repeats, rows):
    from shiftguard.nn import BNActBlock, QACTBlock

    for shape in shapes:
        c = shape[1]
        for backend in backends:
            t0 = time.perf_counter()
            torch.manual_seed(0)
            qact = _maybe_compile(QACTBlock(c).to(dev).train(), backend)
            relu = _maybe_compile(BNActBlock(c, "relu").to(dev).train(), backend)
            x = torch.randn(*shape, device=dev, requires_grad=True)
            g = torch.randn(*shape, device=dev)

            def step(block):
                if backend == "cuda-graph":
                    return _graphed_step(block, x, g)
                return lambda: block(x).backward(g)

            row = {"bench": "block fwd+bwd", "case": "x".join(map(str, shape)), "mode": backend or "eager"}
            try:
                times = timed_in_turn({"relu": step(relu), "qact": step(qact)}, dev, repeats, 3)
                t_relu, t_qact = times["relu"], times["qact"]
            except Exception as exc:  # one mode failing (a capture refused) must not hide the others
                rows.append({**row, "error": f"{type(exc).__name__}: {exc}"})
                print(json.dumps(rows[-1]), flush=True)
                continue
            rows.append(
                {
                    **row,
                    "baseline": "BN-ReLU-BN",
                    "baseline_ms": 1e3 * t_relu,
                    "ms": 1e3 * t_qact,
                    "ratio": t_qact / t_relu,
                    "target": 2.0,
                    "timing": "steps in turn",
                    "wall_s": time.perf_counter() - t0,
                }
            )
            print(json.dumps(rows[-1]), flush=True)


def bench_kernels(dev, shapes, rows, steps=5, top=8):
    """Per shape, the device time and launches of eager BN-QACT-BN training steps by kernel name (on
    the CPU: operators and their CPU time), from a ``torch.profiler`` trace of ``steps`` steps."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from shiftguard.nn import QACTBlock

    cuda = dev.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for shape in shapes:
        torch.manual_seed(0)
        block = QACTBlock(shape[1]).to(dev).train()
        x = torch.randn(*shape, device=dev, requires_grad=True)
        g = torch.randn(*shape, device=dev)
        for _ in range(3):  # (kernels compiled, allocator warm)
            block(x).backward(g)
        sync(dev)
        with profile(activities=activities) as prof:
            for _ in range(steps):
                block(x).backward(g)
            sync(dev)
        spent: dict[str, list] = {}
        for e in prof.events():
            if cuda and e.device_type == DeviceType.CUDA:
                us = e.time_range.elapsed_us()
            elif not cuda and e.name.startswith("aten::"):
                us = e.self_cpu_time_total  # (self: an operator inside another is not counted twice)
            else:
                continue
            entry = spent.setdefault(e.name[:120], [0.0, 0])
            entry[0] += us
            entry[1] += 1
        ranked = sorted(spent.items(), key=lambda kv: -kv[1][0])
        rows.append(
            {
                "bench": "block kernels",
                "case": "x".join(map(str, shape)),
                "what": "CUDA kernels" if cuda else "aten operators' CPU time, not the numba kernels (script check)",
                "ms_per_step": round(sum(v[0] for v in spent.values()) / steps / 1e3, 4),
                "launches_per_step": sum(v[1] for v in spent.values()) / steps,
                "top": [
                    {"name": name, "ms_per_step": round(v[0] / steps / 1e3, 4), "per_step": v[1] / steps}
                    for name, v in ranked[:top]
                ],
            }
        )
        print(json.dumps(rows[-1]), flush=True)


def bench_resnet(dev, smoke, backends, repeats, rows):
    from shiftguard.models import resnet18

    batch, size, width = (8, 16, 8) if smoke else (128, 32, 64)
    x = torch.randn(batch, 3, size, size, device=dev)
    y = torch.randint(0, 10, (batch,), device=dev)
    for backend in backends:
        t0 = time.perf_counter()
        steps = {}
        for act in ("bn-relu-bn", "qact"):
            torch.manual_seed(0)
            model = resnet18(activation=act, base_width=width).to(dev).train()
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            fwd = _maybe_compile(model, backend)

            def step(fwd=fwd, opt=opt):
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(fwd(x), y).backward()
                opt.step()

            steps[act] = step
        times = timed_in_turn(steps, dev, repeats, 3)  # (the warm-up compiles)
        rows.append(
            {
                "bench": "resnet18 train step",
                "case": f"batch {batch}, {size}x{size}, base width {width}",
                "mode": backend or "eager",
                "baseline": "bn-relu-bn",
                "baseline_ms": 1e3 * times["bn-relu-bn"],
                "ms": 1e3 * times["qact"],
                "ratio": times["qact"] / times["bn-relu-bn"],
                "target": 1.5,
                "timing": "steps in turn",
                "wall_s": time.perf_counter() - t0,
            }
        )
        print(json.dumps(rows[-1]), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--smoke", action="store_true", help="tiny shapes, a few repeats (checks the script)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend of the compiled runs")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--skip-resnet", action="store_true")
    args = p.parse_args()
    path, info = report_header("bench_qact_compile", args.device, args.out, args.smoke, backend=args.backend, rows=[])
    if "skipped" in info:
        return 0
    dev = torch.device(args.device)
    if dev.type == "cuda":
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = None  # QACT then runs its eager torch code on the GPU
    repeats = args.repeats or (3 if args.smoke else 10)
    rows: list[dict] = info["rows"]
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    parts = []
    if dev.type == "cuda" or args.smoke:  # (on the CPU the numba kernels are not operators: only the check)
        parts.append(("kernels", lambda: bench_kernels(dev, shapes, rows)))  # first: eager, seconds
    # the eager blocks (seconds), then the ResNet-18 step (two compiles), then the compiled blocks
    # (eight compiles), so that a time limit stopping the script loses the figures that matter least
    parts.append(("blocks eager", lambda: bench_blocks(dev, shapes, (None,), repeats, rows)))
    if not args.skip_resnet:
        parts.append(("resnet18", lambda: bench_resnet(dev, args.smoke, (None, args.backend), repeats, rows)))
    parts.append(("blocks compiled", lambda: bench_blocks(dev, shapes, (args.backend,), repeats, rows)))
    if dev.type == "cuda":  # last: a refused capture may leave the device unusable for what follows
        parts.append(("blocks cuda-graph", lambda: bench_blocks(dev, shapes, ("cuda-graph",), repeats, rows)))
    for name, part in parts:
        t0 = time.perf_counter()
        try:
            part()
        except Exception as exc:  # report and go on: one failing part must not hide the other
            rows.append({"bench": name, "error": f"{type(exc).__name__}: {exc}"})
            print(json.dumps(rows[-1]), flush=True)
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
        path.write_text(json.dumps(info, indent=1))  # what is done so far survives a timeout
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
