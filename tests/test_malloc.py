"""``shiftguard._malloc.reuse_large_blocks``: large freed blocks stay mapped for reuse (glibc), the
user's own allocator settings win, and nothing happens without ``mallopt``."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from shiftguard import _malloc

_CHILD = r"""
import json, resource, sys
import numpy as np
from shiftguard._malloc import reuse_large_blocks
set_ = reuse_large_blocks() if sys.argv[1] == "tuned" else None
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [np.ones(19 * 2**20 // 8) for _ in range(2)]  # two 19 MiB blocks, written in full, then freed
    del blocks
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"set": set_, "faults": faults}))
"""


def _faults(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", _CHILD, mode], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's")
def test_a_freed_large_block_is_reused_without_faulting_its_pages_in_again():
    tuned = _faults("tuned")
    assert tuned["set"] is True
    assert all(f < 50 for f in tuned["faults"][1:]), tuned["faults"]
    # glibc's defaults give the freed blocks back (the free heap exceeds the trim threshold), so every
    # round faults its pages in again (the kernel maps several pages per fault: ~1,000 faults here)
    default = _faults("default")
    assert all(f > 500 for f in default["faults"][1:]), default["faults"]


class _FakeLibc:
    def __init__(self):
        self.calls = []

    def mallopt(self, param, value):
        self.calls.append((param.value, value.value))  # ctypes.c_int arguments
        return 1


@pytest.mark.parametrize(
    "environ",
    [
        {"MALLOC_TRIM_THRESHOLD_": "0"},
        {"MALLOC_MMAP_THRESHOLD_": "131072"},
        {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"},
    ],
)
def test_the_users_own_allocator_settings_are_left_alone(monkeypatch, environ):
    fake = _FakeLibc()
    monkeypatch.setattr(_malloc, "_libc", lambda: fake)
    assert _malloc.reuse_large_blocks(environ) is False
    assert fake.calls == []


def test_both_thresholds_are_set_through_mallopt(monkeypatch):
    fake = _FakeLibc()
    monkeypatch.setattr(_malloc, "_libc", lambda: fake)
    assert _malloc.reuse_large_blocks({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"}) is True
    assert fake.calls == [(-3, _malloc.MMAP_THRESHOLD), (-1, _malloc.TRIM_THRESHOLD)]


def test_without_mallopt_nothing_is_set(monkeypatch):
    monkeypatch.setattr(_malloc, "_libc", lambda: object())
    assert _malloc.reuse_large_blocks({}) is False
    monkeypatch.setattr(_malloc, "_libc", lambda: None)
    assert _malloc.reuse_large_blocks({}) is False


def test_the_command_line_sets_them_at_start_up(monkeypatch, capsys):
    from shiftguard import cli

    calls = []
    monkeypatch.setattr(cli, "reuse_large_blocks", lambda: calls.append(1) or True)
    assert cli.main(["--version"]) == 0
    assert calls == [1] and capsys.readouterr().out.startswith("shiftguard ")
