"""The Triton kernels of QACT (``shiftguard.functional._qact_triton``) against the eager torch code, run
in Triton's interpreter on CPU tensors (no GPU needed): quantiles and forward values bit for bit, the
KDE density and the gradient within the grid error bound (``tests/_qact_triton_checks.py``). What the
interpreter cannot show (how a GPU divides) is checked on the compiled kernels in
``tests/test_qact_triton_compile.py``.

The interpreter is chosen when triton is imported (``TRITON_INTERPRET=1``), so the checks run in a
child process of their own, whatever this process (or another test on its xdist worker) has imported.
Skipped without triton. The CUDA dispatch itself is checked on a GPU (``tests/test_cuda.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

_CHECKS = Path(__file__).with_name("_qact_triton_checks.py")


@pytest.fixture(scope="module")
def report() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1")
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, str(_CHECKS)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "check",
    [
        "check_grounded_context",
        "check_quantiles",
        "check_draws",
        "check_grid_layout",
        "check_forward",
        "check_density",
        "check_non_finite",
        "check_half_precision",
        "check_gradient_through_the_functional",
    ],
)
def test_triton_kernels_in_the_interpreter_match_the_eager_code(report, check):
    assert report[check] == "ok", report[check]


def test_import_shiftguard_does_not_import_triton():
    code = "import sys, shiftguard, shiftguard.functional, shiftguard.nn; print('triton' in sys.modules)"
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"
