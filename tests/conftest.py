"""Shared test fixtures, and the conventions every test follows.

Real data lives in ``../shared/data`` beside the repository (MNIST and Fashion-MNIST in the
official IDX gzip format). ``SHIFTGUARD_SHARED_DATA`` overrides the location. Tests that need it
use the fixtures below and skip with a clear reason when it is absent.

Portability: the suite passes on any x86-64 CPU (with or without AVX-512), on any thread count
and BLAS. Float results differ in their last bits between instruction sets (torch's vectorised
kernels), BLAS builds and thread counts, so

- bit-exactness is checked only between two computations made in the same test run (two code
  paths, the same computation twice, before and after a resume);
- a value recorded in a test is either exact on every machine (integers, counts, pixel sums of
  uint8 data, digests of integer data) or compared within a tolerance that bounds the rounding
  (``tests/test_qact.py``'s record: relative 1e-5 in float32, 1e-9 in float64);
- never a digest of floating-point results.

Conventions: a documented convention (a bin edge, a registered default, a rule's threshold) is
pinned by an exact test that puts its input on the edge (``tests/test_conventions.py``), since
random inputs never reach it. A new convention comes with such a test and the one-line hand
mutation of the code that the test was checked to fail on, named in the test's docstring.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]


def shared_data_dir() -> Path:
    env = os.environ.get("SHIFTGUARD_SHARED_DATA")
    return Path(env) if env else REPO_ROOT.parent / "shared" / "data"


def _require(sub: str) -> Path:
    d = shared_data_dir() / sub
    if not (d / "t10k-images-idx3-ubyte.gz").is_file():
        pytest.skip(
            f"real {sub} data not found at {d} "
            f"(set SHIFTGUARD_SHARED_DATA to the folder holding mnist/ and fashion-mnist/)"
        )
    return d


@pytest.fixture
def mnist_dir() -> Path:
    """Folder with the official MNIST IDX gzip files; skips when absent."""
    return _require("mnist")


@pytest.fixture
def fashion_mnist_dir() -> Path:
    """Folder with the Fashion-MNIST IDX gzip files; skips when absent."""
    return _require("fashion-mnist")


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def torch_one_thread():
    """Run a module's tests with one torch thread (small-image tensor ops are fastest that way,
    above all on a shared CPU); use with ``pytestmark = pytest.mark.usefixtures("torch_one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def run_forked():
    """``run_forked(body, what)``: call ``body()`` in a forked child and return its exit code (0:
    ``body`` returned True, 1: False, 2: it raised); fails the test if the child has not finished
    within 60 s (a hang). Skips where there is no ``os.fork``."""
    if not hasattr(os, "fork"):
        pytest.skip("needs os.fork")
    import time

    def run(body, what: str) -> int:
        pid = os.fork()
        if pid == 0:
            try:
                os._exit(0 if body() else 1)
            except BaseException:
                os._exit(2)
        deadline = time.monotonic() + 60
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                pytest.fail(f"{what} hung in a forked child")
            time.sleep(0.05)

    return run
