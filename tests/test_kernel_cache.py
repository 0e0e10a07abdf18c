"""Where the compiled (numba) kernels are cached, and that a second process loads them.

Each test copies the package into a fresh folder (so no cache exists yet) and runs two Python
processes on it: the first compiles a kernel, the second must load it from the disk cache
(numba's per-dispatcher statistics: a cache hit, no miss). A read-only package folder is made
read-only for real where the tests can run a process as an unprivileged user (root with
``setpriv``), and simulated otherwise by refusing, in the child, the test write numba makes before
it picks a folder (``tempfile.TemporaryFile(dir=...)``, ``numba.core.caching``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

import shiftguard
from shiftguard._numba import AVAILABLE

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="numba is not installed: nothing is compiled or cached")

PACKAGE = Path(shiftguard.__file__).resolve().parent

# The child: optionally refuses writes under the given folders (what a read-only file system does
# to numba's writability probe), then calls one small QACT kernel and reports numba's cache
# statistics for it and the warnings raised.
_CHILD = textwrap.dedent("""
    import json, os, sys, tempfile, warnings
    refused = [os.path.realpath(p) for p in json.loads(sys.argv[1])]
    _temporary_file = tempfile.TemporaryFile

    def guarded(*args, **kwargs):
        folder = os.path.realpath(kwargs.get("dir") or tempfile.gettempdir())
        if any(folder == r or folder.startswith(r + os.sep) for r in refused):
            raise PermissionError(13, "Permission denied (read-only for the test)", folder)
        return _temporary_file(*args, **kwargs)

    tempfile.TemporaryFile = guarded
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import numpy as np
        from shiftguard.functional._qact_cpu import sort as K
        ok = K._ends_finite(np.zeros((3, 4), np.float32))
    stats = K._ends_finite.stats
    print(json.dumps({"ok": bool(ok), "hits": sum(stats.cache_hits.values()),
                      "misses": sum(stats.cache_misses.values()), "cache_path": stats.cache_path,
                      "module": K.__file__, "warnings": [str(w.message) for w in caught]}))
""")


def _copy_package(root: Path) -> Path:
    """The package's source (no caches) under ``root/site``; returns ``root/site``."""
    site = root / "site"
    shutil.copytree(PACKAGE, site / "shiftguard", ignore=shutil.ignore_patterns("__pycache__", "*.nbi", "*.nbc"))
    return site


def _env(site: Path, home: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_") and k != "XDG_CACHE_HOME"}
    env.update(PYTHONPATH=str(site), HOME=str(home), OMP_NUM_THREADS="1", **extra)
    return env


def _run_child(env: dict, refused=(), user_cmd=()) -> dict:
    out = subprocess.run(
        [*user_cmd, sys.executable, "-c", _CHILD, json.dumps([str(p) for p in refused])],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _twice(env, refused=(), user_cmd=()):
    """Two fresh processes on the package copy named by ``env``'s ``PYTHONPATH`` (checked: not the
    checkout's package)."""
    first = _run_child(env, refused, user_cmd)
    second = _run_child(env, refused, user_cmd)
    for child in (first, second):
        assert _inside(child["module"], Path(env["PYTHONPATH"]))
    return first, second


def _inside(path: str, folder: Path) -> bool:
    return Path(path).resolve().is_relative_to(folder.resolve())


def test_writable_package_folder_caches_next_to_the_source(tmp_path):
    site = _copy_package(tmp_path)
    first, second = _twice(_env(site, tmp_path / "home"))
    assert (first["hits"], first["misses"]) == (0, 1)  # compiled
    assert (second["hits"], second["misses"]) == (1, 0)  # loaded
    assert _inside(first["cache_path"], site / "shiftguard")


def test_read_only_package_folder_falls_back_to_the_user_cache_directory(tmp_path):
    site = _copy_package(tmp_path)
    xdg = tmp_path / "xdg-cache"
    first, second = _twice(_env(site, tmp_path / "home", XDG_CACHE_HOME=str(xdg)), refused=[site])
    assert (first["hits"], first["misses"]) == (0, 1)
    assert (second["hits"], second["misses"]) == (1, 0)
    assert _inside(first["cache_path"], xdg) and not any(site.rglob("*.nbi"))
    assert first["warnings"] == [] and second["warnings"] == []


def test_users_numba_cache_dir_wins_over_every_other_location(tmp_path):
    site = _copy_package(tmp_path)
    mine = tmp_path / "mine"
    first, second = _twice(_env(site, tmp_path / "home", NUMBA_CACHE_DIR=str(mine)))
    assert _inside(first["cache_path"], mine) and (second["hits"], second["misses"]) == (1, 0)
    assert not any(site.rglob("*.nbi"))


def test_no_writable_cache_location_still_imports_and_runs_with_a_warning(tmp_path):
    site = _copy_package(tmp_path)
    home = tmp_path / "home"
    first, second = _twice(_env(site, home), refused=[site, home])
    for child in (first, second):  # each process compiles: no cache to load from or write to
        assert child["ok"] and child["cache_path"] is None
        assert (child["hits"], child["misses"]) == (0, 1)
        assert len(child["warnings"]) == 1 and "NUMBA_CACHE_DIR" in child["warnings"][0]
    assert not any(site.rglob("*.nbi")) and not any(home.rglob("*.nbi"))


def _setpriv_nobody():
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("setpriv") is None:
        return None
    cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    probe = subprocess.run([*cmd, sys.executable, "-c", "import numba, torch"], capture_output=True, timeout=120)
    return cmd if probe.returncode == 0 else None


@pytest.mark.slow
def test_really_read_only_package_folder_for_an_unprivileged_user():
    user_cmd = _setpriv_nobody()
    if user_cmd is None:
        pytest.skip("needs root, setpriv and an interpreter the user 'nobody' can run")
    # pytest's tmp_path lies in a folder only its owner may enter: a world-readable folder instead
    root = Path(tempfile.mkdtemp(prefix="shiftguard-ro-"))
    try:
        os.chmod(root, 0o755)
        site = _copy_package(root)  # owned by root: the user can read it, not write in it
        home = root / "home"
        home.mkdir()
        os.chown(home, 65534, 65534)
        first, second = _twice(_env(site, home), user_cmd=user_cmd)
        assert (first["hits"], first["misses"]) == (0, 1)
        assert (second["hits"], second["misses"]) == (1, 0)
        assert _inside(first["cache_path"], home / ".cache") and not any(site.rglob("*.nbi"))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_corruption_warm_up_compiles_what_an_evaluation_pass_then_uses():
    import torch

    from shiftguard import corruptions as SC
    from shiftguard.corruptions import _kernels

    assert SC.warm_up() >= 0.0

    def signatures():
        return {
            n: set(getattr(_kernels, n).signatures)
            for n in dir(_kernels)
            if hasattr(getattr(_kernels, n), "signatures")
        }

    before = signatures()
    assert any(before.values())
    gen = torch.Generator().manual_seed(1)
    for suite, shape in (("mnist-c", (5, 1, 28, 28)), ("cifar-c", (3, 3, 32, 32))):
        x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
        for name in SC.names(suite):
            SC.corrupt(x, name, 5, seed=3, suite=suite)
            SC.corrupt(x.float() / 255, name, 1, seed=3, suite=suite)
    assert signatures() == before  # nothing new was compiled


def test_corruption_warm_up_and_njit_name_what_they_refuse():
    import torch

    from shiftguard import corruptions
    from shiftguard._numba import njit

    with pytest.raises(ValueError, match="dtypes"):
        corruptions.warm_up(dtypes=(torch.int64,))
    with pytest.raises(TypeError, match="njit"):
        njit("float64(float64)")
