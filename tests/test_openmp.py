"""``shiftguard._openmp``: the command line's OpenMP waiting. A short spin when the allowed cores
are idle, sleeping at once when other processes keep them busy or their load cannot be read; the
user's own setting stands, and nothing changes once torch is imported."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shiftguard import _openmp

_NO_TORCH: dict = {}


def test_idle_cores_get_a_short_spin():
    env: dict = {}
    assert _openmp.choose_waiting(env, load=0.0, modules=_NO_TORCH) == "spin"
    assert env == {"GOMP_SPINCOUNT": str(_openmp.SPIN_COUNT)}


@pytest.mark.parametrize("load", [_openmp.BUSY_CORES, 1.0, 3.5])
def test_busy_cores_make_the_workers_sleep_at_once(load):
    env: dict = {}
    assert _openmp.choose_waiting(env, load=load, modules=_NO_TORCH) == "passive"
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_a_load_that_cannot_be_measured_counts_as_busy(monkeypatch):
    monkeypatch.setattr(_openmp, "busy_cores", lambda: None)
    env: dict = {}
    assert _openmp.choose_waiting(env, modules=_NO_TORCH) == "passive"
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}


@pytest.mark.parametrize(
    "user", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "0"}, {"OMP_WAIT_POLICY": "passive"}]
)
@pytest.mark.parametrize("load", [0.0, 2.0])
def test_the_users_own_setting_stands(user, load):
    env = dict(user)
    assert _openmp.choose_waiting(env, load=load, modules=_NO_TORCH) == "user"
    assert env == user


def test_nothing_changes_once_torch_is_imported():
    env: dict = {}
    assert _openmp.choose_waiting(env, load=0.0, modules={"torch": object()}) == "too late"
    assert env == {}


def _stat(cpu0, cpu1) -> str:
    # user nice system idle iowait irq softirq steal guest guest_nice
    line = "cpu{} {} 0 {} {} {} 0 0 0 0 0\n"
    total = [a + b for a, b in zip(cpu0, cpu1)]
    return (
        line.format("", *total).replace("cpu ", "cpu  ", 1)
        + line.format(0, *cpu0)
        + line.format(1, *cpu1)
        + "intr 12345 0 0\nctxt 999\n"
    )


def test_busy_cores_reads_other_processes_work_on_the_allowed_cpus(monkeypatch, tmp_path):
    # over the window cpu0 runs 10 ticks of user and system work, cpu1 is idle for 10 ticks
    # (4 of them waiting for I/O), and cpu2 (not in the affinity set) does not exist in the file
    path = tmp_path / "stat"
    path.write_text(_stat((100, 50, 1000, 5), (10, 5, 2000, 1)))

    def sleep(_seconds):
        path.write_text(_stat((107, 53, 1000, 5), (10, 5, 2006, 5)))

    monkeypatch.setattr(_openmp.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(_openmp.time, "sleep", sleep)
    assert _openmp.busy_cores(stat_path=str(path)) == pytest.approx(1.0)


def test_busy_cores_is_none_where_the_load_cannot_be_read(monkeypatch, tmp_path):
    monkeypatch.setattr(_openmp.time, "sleep", lambda s: None)
    monkeypatch.setattr(_openmp.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert _openmp.busy_cores(stat_path=str(tmp_path / "missing")) is None
    # an allowed CPU missing from the file: the sum would leave it out
    path = tmp_path / "stat"
    path.write_text("cpu  1 0 1 10 0 0 0 0 0 0\ncpu0 1 0 1 10 0 0 0 0 0 0\n")
    assert _openmp.busy_cores(stat_path=str(path)) is None
    # no time passed between the readings
    path.write_text(_stat((1, 0, 10, 0), (1, 0, 10, 0)))
    assert _openmp.busy_cores(stat_path=str(path)) is None


@pytest.mark.skipif(
    not os.path.exists("/proc/stat") or not hasattr(os, "sched_getaffinity"),
    reason="the cores' load is read from Linux's /proc/stat",
)
def test_busy_cores_measures_this_machine():
    load = _openmp.busy_cores(window_s=0.05)
    assert load is not None and 0.0 <= load <= len(os.sched_getaffinity(0))


_CHILD = r"""
import os, sys
from shiftguard.cli import main
try:
    main(["report", "--help"])
except SystemExit:
    pass
print("torch" in sys.modules, os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT"))
"""


@pytest.mark.parametrize("user", [{}, {"OMP_WAIT_POLICY": "ACTIVE"}])
def test_the_command_line_chooses_before_torch_is_imported(user):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], env={**env, **user}, capture_output=True, text=True, check=True
    )
    imported, policy, spin = out.stdout.strip().splitlines()[-1].split()
    assert imported == "True"  # the command's module imported torch after the choice
    if user:
        assert (policy, spin) == ("ACTIVE", "None")
    else:
        assert (policy, spin) in {("PASSIVE", "None"), ("None", str(_openmp.SPIN_COUNT))}
