"""How the command line's idle OpenMP threads wait: a short spin on idle cores, sleep on busy ones.

Why (the constraint): torch's CPU operators run on an OpenMP team (GNU libgomp in the PyPI
wheels). After each parallel region the workers wait for the next one, either spinning
(``GOMP_SPINCOUNT`` pause instructions; libgomp's default is 300,000, several milliseconds) or
asleep in the kernel (``OMP_WAIT_POLICY=PASSIVE``). Both extremes lose on a machine with as many
cores as threads:

- a long spin keeps the worker on a core after the step's last operator, while the Python code,
  a SciPy optimiser or another process needs it;
- sleeping at once makes every operator wake the workers again through the kernel, which costs
  more than a small operator's work: a LeNet training step at batch 64 ran slower on two threads
  than on one.

A spin of :data:`SPIN_COUNT` iterations (under a millisecond on current x86 CPUs) covers the gaps
between the operators of one training step and ends soon after it. That is the choice when the
cores this process may run on are idle at start-up. When other processes keep them busy, every
spin takes time from them and from this process's own main thread, so the workers sleep at once
instead (``PASSIVE``). The figures: ``docs/performance.md``, "Threads".

:func:`choose_waiting` sets the variables, which libgomp reads once, when torch loads it; the
command line calls it before importing torch. The library never changes the waiting of a process
it is imported into. A user's own ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` always stands.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Mapping, MutableMapping, Optional

__all__ = ["SPIN_COUNT", "BUSY_CORES", "busy_cores", "choose_waiting"]

#: Spin iterations of an idle libgomp worker when the cores are idle (``GOMP_SPINCOUNT``).
SPIN_COUNT = 10_000
#: Other processes' load, in cores, from which the workers sleep at once.
BUSY_CORES = 0.5
#: Seconds over which the cores' load is measured at start-up.
WINDOW_S = 0.1

_USER_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def _cpu_times(path: str, cpus: set[int]) -> Optional[tuple[int, int]]:
    """(busy, total) clock ticks summed over ``cpus`` from a ``/proc/stat`` file; None if unreadable."""
    busy = total = 0
    seen = 0
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                name, _, rest = line.partition(" ")
                if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
                    continue
                # user nice system idle iowait irq softirq steal (guest time is inside user and nice)
                ticks = [int(v) for v in rest.split()[:8]]
                if len(ticks) < 5:
                    return None
                total += sum(ticks)
                busy += sum(ticks) - ticks[3] - ticks[4]
                seen += 1
    except (OSError, ValueError):
        return None
    return (busy, total) if seen == len(cpus) else None


def busy_cores(window_s: float = WINDOW_S, stat_path: str = "/proc/stat") -> Optional[float]:
    """How many cores' worth of work ran on this process's allowed CPUs during ``window_s`` seconds,
    while this process slept (so: other processes' work); None where it cannot be measured (no
    ``/proc/stat``, no CPU affinity: not Linux)."""
    try:
        cpus = set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    before = _cpu_times(stat_path, cpus)
    if before is None:
        return None
    time.sleep(window_s)
    after = _cpu_times(stat_path, cpus)
    if after is None or after[1] <= before[1]:
        return None
    return len(cpus) * (after[0] - before[0]) / (after[1] - before[1])


def choose_waiting(
    environ: Optional[MutableMapping[str, str]] = None,
    load: Optional[float] = None,
    modules: Optional[Mapping[str, object]] = None,
) -> str:
    """Set how idle OpenMP workers wait for the process about to import torch (module docstring);
    returns what was decided: ``"spin"`` (``GOMP_SPINCOUNT=SPIN_COUNT``), ``"passive"``
    (``OMP_WAIT_POLICY=PASSIVE``), ``"user"`` (the user set either variable: unchanged) or
    ``"too late"`` (torch is imported already, so its runtime has read its settings: unchanged).

    ``environ``: where the variables are read and set (default ``os.environ``); ``load``: the busy
    cores, measured by :func:`busy_cores` when not given (``None`` from it counts as busy: sleeping
    is the safe choice); ``modules``: the imported modules (default ``sys.modules``)."""
    environ = os.environ if environ is None else environ
    modules = sys.modules if modules is None else modules
    if "torch" in modules:
        return "too late"
    if any(k in environ for k in _USER_SETTINGS):
        return "user"
    load = busy_cores() if load is None else load
    if load is not None and load < BUSY_CORES:
        environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
        return "spin"
    environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return "passive"
