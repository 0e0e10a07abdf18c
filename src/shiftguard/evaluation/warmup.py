"""Compile the CPU kernels an evaluation will call, as a step of its own.

The compiled (numba) kernels compile on their first call per argument types and are cached on
disk (:mod:`shiftguard._numba`): seconds on a machine whose cache is empty, a fraction of a second
after. Without a step of their own, that time lands in whatever calls them first (the first
corruption of the grid, the first kNN search, the first QACT forward pass) and is recorded as that
phase's time. :func:`evaluation_steps` lists what an evaluation will call; :func:`compile_announced`
runs such steps, prints ``compiling kernels (first use) ...`` once they have taken a second, and
returns their seconds (``shiftguard.evaluate`` records them as ``timings["compile_s"]``; ``shiftguard
run`` does the same for its training and evaluation).
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Callable, Optional, Sequence

import torch

__all__ = ["compile_announced", "evaluation_steps"]

Step = Callable[[], float]


def compile_announced(steps: Sequence[Step], announce: bool = True) -> float:
    """Run ``steps`` (each returns the seconds it took); return their sum.

    With ``announce``, a step list that lasts over a second prints ``compiling kernels (first
    use) ...`` when that second has passed and its duration when done, on one line of stdout."""

    def run_all() -> float:
        return sum(step() for step in steps)

    # state["open"]: the announcement line was started and awaits its duration; state["done"]: the
    # steps ended, so a timer firing late must not start the line.
    lock, state = threading.Lock(), {"open": False, "done": False}

    def begin():
        with lock:
            if not state["done"]:
                print("compiling kernels (first use) ...", end="", flush=True)
                state["open"] = True

    timer = threading.Timer(1.0, begin) if announce else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    seconds, failed = 0.0, True
    try:
        seconds = run_all()
        failed = False
    finally:
        if timer is not None:
            timer.cancel()
            with lock:
                state["done"] = True
            if state["open"]:
                print(" failed" if failed else f" {seconds:.1f} s", flush=True)
    return seconds


def _float_dtype(model: torch.nn.Module) -> torch.dtype:
    # the dtype QACT will run in: the model's first floating parameter's (float32 without one)
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def evaluation_steps(
    models: Sequence[torch.nn.Module],
    device: torch.device,
    corruptions: Sequence[tuple[str, int, str]] = (),
    pixels: Optional[torch.Tensor] = None,
    seed: int = 0,
) -> list[Step]:
    """The compile steps of an evaluation of ``models`` on ``device``:

    - QACT's evaluation paths (:func:`shiftguard.functional.warm_up` with ``evaluation_only``) in
      the models' dtype, when a model holds QACT and ``device`` is the CPU;
    - each ``(corruption, severity, suite)`` of ``corruptions`` (one entry per corruption is
      enough), on the first two images of ``pixels`` (the test images: their size, channels and
      dtype select the compiled variants);
    - the kNN search's selection (:func:`shiftguard.neighbors.warm_up`) for float32 embeddings.
    """
    from shiftguard import corruptions as K
    from shiftguard import neighbors as NB
    from shiftguard.functional import warm_up as qact_warm_up
    from shiftguard.nn import has_qact

    steps: list[Step] = []
    if device.type == "cpu":
        dtypes = sorted({_float_dtype(m) for m in models if has_qact(m)}, key=str)
        for dtype in dtypes:
            if dtype in (torch.float32, torch.float64):
                steps.append(functools.partial(qact_warm_up, dtype, evaluation_only=True))
    if corruptions and pixels is not None:
        images = pixels[:2]

        def corrupt_each() -> float:
            t0 = time.perf_counter()
            for name, severity, suite in corruptions:
                K.corrupt(images, name, severity, seed=seed, suite=suite)
            return time.perf_counter() - t0

        steps.append(corrupt_each)
    steps.append(NB.warm_up)
    return steps
