"""How many kernels one training step (forward + backward) of a BN-QACT-BN block launches on QACT's CUDA
path, beside its BN-ReLU-BN twin: the count that decides the eager ratio where the GPU waits for
launches, and what a CUDA graph replays.

Runs without a GPU: the CUDA path (``quantile._triton_forward``) is taken for CPU tensors with the
Triton kernels in Triton's interpreter and the module's seed used as on CUDA; a ``TorchDispatchMode``
counts the torch operations that launch a kernel on CUDA (views, allocations and scalar reads
excluded) and a wrapper counts the Triton launches. On CPU tensors the input's NaN/inf check takes
its reading form (the device assertion of a capture has as many operations). The figures are counts
of operations, not times.

Usage: ``python benchmarks/count_qact_launches.py [--out FILE]`` (prints JSON).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # (before triton is imported)

import argparse
import collections
import json
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: Operations that launch no kernel on CUDA: views, allocations, and the copy of a read-back scalar.
NO_KERNEL = {
    "aten.alias.default",
    "aten.as_strided.default",
    "aten.detach.default",
    "aten.empty.memory_format",
    "aten.empty_like.default",
    "aten.empty_strided.default",
    "aten.expand.default",
    "aten.permute.default",
    "aten.reshape.default",
    "aten.select.int",
    "aten.slice.Tensor",
    "aten.squeeze.dim",
    "aten.t.default",
    "aten.transpose.int",
    "aten.unsqueeze.default",
    "aten.view.default",
    "aten._unsafe_view.default",
    "aten._local_scalar_dense.default",
}


class _Launches(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) not in NO_KERNEL:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _count(make) -> dict:
    import shiftguard.functional.quantile as Q

    triton_calls: collections.Counter = collections.Counter()
    kernels = Q._qact_triton.kernels()
    wrapped = {}
    for name, fn in vars(kernels).items():

        def counted(*a, _fn=fn, _name=name, **k):
            triton_calls[_name] += 1
            with torch.utils._python_dispatch._disable_current_modes():  # (the interpreter's own torch calls)
                return _fn(*a, **k)

        wrapped[name] = counted
    saved = (Q.USE_COMPILED, Q._triton, Q._qact_triton.kernels, Q._draws_of_seed)
    Q.USE_COMPILED = False  # the CPU kernels would take CPU tensors first
    Q._triton = lambda x: True
    Q._draws_of_seed = lambda seed, device: seed  # the module's seed used as on CUDA (no generator)
    Q._qact_triton.kernels = lambda: type(kernels)(**wrapped)
    try:
        torch.manual_seed(0)
        block = make().train()
        x = torch.randn(16, 8, 5, 5, requires_grad=True)
        g = torch.randn(16, 8, 5, 5)
        block(x).backward(g)  # (lazy set-up outside the count)
        triton_calls.clear()
        with _Launches() as mode:
            block(x).backward(g)
    finally:
        Q.USE_COMPILED, Q._triton, Q._qact_triton.kernels, Q._draws_of_seed = saved
    torch_ops = sum(mode.ops.values())
    return {
        "torch_ops": torch_ops,
        "triton_launches": sum(triton_calls.values()),
        "launches": torch_ops + sum(triton_calls.values()),
        "by_op": dict(mode.ops.most_common()),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write the JSON here too")
    args = p.parse_args()
    from shiftguard.nn import BNActBlock, QACTBlock

    report = {
        "shape": [16, 8, 5, 5],
        "torch": torch.__version__,
        "BN-QACT-BN": _count(lambda: QACTBlock(8)),
        "BN-ReLU-BN": _count(lambda: BNActBlock(8, "relu")),
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
