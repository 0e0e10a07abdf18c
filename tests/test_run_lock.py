"""A run directory belongs to one process at a time, and its final weights are verified.

* Two processes that create the same run at the same moment: exactly one proceeds, the other is
  refused with one line naming the directory and the holder's pid, and its configuration never
  lands (a real race between two processes, synchronised, many rounds).
* ``--resume`` of a run that is still running is refused the same way; once the holder dies
  (SIGKILL: no cleanup runs) a new run or a resume proceeds, since the kernel drops the lock.
* The lock file is not content: a directory holding only it is a fresh run directory.
* ``model.pt`` carries ``model.pt.sha256``; a flipped byte or a missing checksum is refused on
  ``--resume`` naming the file and the remedy, which rebuilds identical weights.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shiftguard._lock import DirectoryInUseError, DirectoryLock
from shiftguard.cli import main as cli
from shiftguard.commands import config as C
from shiftguard.commands.run import claim_run_dir

# A worker process: "go NAME" makes it create run NAME under OUT (with its own seed) and report
# the outcome; "release" releases the lock it holds. Results are lines starting with "RESULT ".
WORKER = r"""
import argparse, json, os, sys
from shiftguard._lock import DirectoryInUseError
from shiftguard.commands import config as C
from shiftguard.commands.run import claim_run_dir

out, seed, resume = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "resume"
cfg = C.quick_config()
cfg.seed = seed
lock = None
print("RESULT ready", flush=True)
for line in sys.stdin:
    cmd, *rest = line.split()
    if cmd == "go":
        try:
            _, lock = claim_run_dir(cfg, argparse.Namespace(name=rest[0], out=out, resume=resume))
            res = {"outcome": "ok"}
        except DirectoryInUseError as exc:
            res = {"outcome": "in use", "message": str(exc), "holder": exc.pid}
        except ValueError as exc:
            res = {"outcome": "refused", "message": str(exc)}
        print("RESULT " + json.dumps(res), flush=True)
    elif cmd == "release":
        if lock is not None:
            lock.release()
            lock = None
        print("RESULT released", flush=True)
"""


class Worker:
    def __init__(self, script: Path, out: Path, seed: int, resume: bool = False):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(out), str(seed), "resume" if resume else "new"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def ready(self) -> "Worker":
        assert self.read() == "ready"
        return self

    def read(self) -> str:
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return line[len("RESULT ") :].strip()
        raise AssertionError(f"worker ended (status {self.proc.wait()})")

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


@pytest.fixture
def worker_script(tmp_path) -> Path:
    p = tmp_path / "worker.py"
    p.write_text(WORKER)
    return p


def _stored_seed(run_dir: Path) -> int:
    return json.loads((run_dir / "config.json").read_text())["config"]["seed"]


def test_two_processes_creating_the_same_run_at_once_exactly_one_proceeds(worker_script, tmp_path):
    out = tmp_path / "runs"
    workers = [Worker(worker_script, out, seed) for seed in (0, 1)]
    try:
        for w in workers:
            w.ready()
        for i in range(15):
            name = f"race-{i}"
            # Both are blocked reading their pipe: the two lines wake them within microseconds.
            for w in workers:
                w.send(f"go {name}")
            results = [json.loads(w.read()) for w in workers]
            outcomes = sorted(r["outcome"] for r in results)
            assert outcomes == ["in use", "ok"], (i, results)
            winner = next(s for s, r in enumerate(results) if r["outcome"] == "ok")
            loser = results[1 - winner]
            assert loser["message"] == (
                f"run directory {out / name} is in use by another shiftguard process (pid {workers[winner].proc.pid})"
            )
            assert _stored_seed(out / name) == winner, "the refused process's config.json landed"
            for w in workers:
                w.send("release")
            assert [w.read() for w in workers] == ["released", "released"]
    finally:
        for w in workers:
            w.close()


def test_resume_of_a_running_run_is_refused_and_proceeds_once_the_holder_is_killed(worker_script, tmp_path):
    out = tmp_path / "runs"
    holder = Worker(worker_script, out, seed=3)
    try:
        holder.ready()
        holder.send("go r")
        assert json.loads(holder.read())["outcome"] == "ok"
        cfg = C.quick_config()
        cfg.seed = 3
        for resume in (True, False):
            with pytest.raises(DirectoryInUseError, match=rf"\(pid {holder.proc.pid}\)") as info:
                claim_run_dir(cfg, argparse.Namespace(name="r", out=str(out), resume=resume))
            assert info.value.directory == out / "r"
        holder.proc.send_signal(signal.SIGKILL)
        assert holder.proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        holder.close()
    # The killed run stopped before its first checkpoint: it can be resumed, or replaced by a new run.
    run_dir, lock = claim_run_dir(cfg, argparse.Namespace(name="r", out=str(out), resume=True))
    lock.release()
    cfg.seed = 4
    run_dir, lock = claim_run_dir(cfg, argparse.Namespace(name="r", out=str(out), resume=False))
    lock.release()
    assert _stored_seed(run_dir) == 4


def test_cli_run_and_resume_of_a_run_in_use_end_with_one_line_and_leave_its_config(tmp_path, capsys):
    out = tmp_path / "runs"
    cfg = C.quick_config()
    run_dir, lock = claim_run_dir(cfg, argparse.Namespace(name="q", out=str(out), resume=False))
    before = (run_dir / "config.json").read_bytes()
    try:
        for extra in ([], ["--resume"]):
            rc = cli(["run", "--quick", "--name", "q", "--out", str(out), "--seed", "7", "--no-progress", *extra])
            err = capsys.readouterr().err.splitlines()
            assert rc == 2 and err == [
                f"shiftguard run: error: run directory {run_dir} is in use by another "
                f"shiftguard process (pid {os.getpid()})"
            ], err
            assert (run_dir / "config.json").read_bytes() == before
    finally:
        lock.release()


def test_cli_run_holds_the_lock_until_it_ends(tmp_path, monkeypatch):
    import shiftguard.commands.run as R

    seen = []

    def execute(cfg, run_dir, device, **kw):  # the whole pipeline runs while the lock is held
        with pytest.raises(DirectoryInUseError):
            DirectoryLock(run_dir).acquire()
        seen.append(run_dir)
        return {}

    monkeypatch.setattr(R, "execute", execute)
    monkeypatch.setattr(R, "compile_kernels", lambda *a, **k: 0.0)
    assert cli(["run", "--quick", "--name", "held", "--out", str(tmp_path), "--no-progress"]) == 0
    assert seen == [tmp_path / "held"]
    DirectoryLock(seen[0]).acquire().release()  # released when the run ended


def test_a_directory_holding_only_the_lock_file_is_a_fresh_run_directory(tmp_path, capsys):
    cfg = C.quick_config()
    (tmp_path / "fresh").mkdir()
    DirectoryLock(tmp_path / "fresh").acquire().release()  # what a process killed before config.json leaves
    run_dir, lock = claim_run_dir(cfg, argparse.Namespace(name="fresh", out=str(tmp_path), resume=False))
    lock.release()
    assert "reusing" not in capsys.readouterr().out
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "config.json"]


def test_a_lock_is_exclusive_within_one_process_and_free_again_after_release(tmp_path):
    first = DirectoryLock(tmp_path).acquire()
    with pytest.raises(DirectoryInUseError, match=rf"{tmp_path} is in use .*\(pid {os.getpid()}\)"):
        DirectoryLock(tmp_path).acquire()
    first.release()
    first.release()  # harmless
    with DirectoryLock(tmp_path) as again:
        assert again.held
    assert not again.held and (tmp_path / ".lock").is_file()


# ------------------------------------------------------------------------------------------ model.pt
TINY = """
name = "tiny"
[data]
train_subset = 120
test_subset = 60
corruptions = ["rotate"]
severities = [5]
[train]
epochs = 1
batch_size = 40
[eval]
batch_size = 30
k = 3
retrieval_ks = [1]
n_boot = 10
[[models]]
name = "mlp"
arch = "mlp"
activation = "relu"
heads = ["softmax"]
model_kwargs = { hidden = [16] }
"""


@pytest.fixture
def tiny_run(tmp_path):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY)
    argv = ["run", "--config", str(cfg), "--out", str(tmp_path / "runs"), "--no-progress", "--threads", "1"]
    assert cli(argv) == 0
    return argv, tmp_path / "runs" / "tiny"


def test_model_pt_with_a_flipped_byte_or_no_checksum_is_refused_on_resume(tiny_run, capsys):
    argv, run_dir = tiny_run
    final = run_dir / "models" / "mlp" / "model.pt"
    sidecar = final.with_name("model.pt.sha256")
    assert sidecar.read_text().strip() == __import__("hashlib").sha256(final.read_bytes()).hexdigest()
    good = final.read_bytes()
    weights = torch.load(final, weights_only=True)
    capsys.readouterr()

    data = bytearray(good)
    data[len(data) // 2] ^= 0x40  # one flipped bit in the middle of the tensor data
    final.write_bytes(bytes(data))
    assert cli([*argv, "--resume"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and str(final) in err[0] and "checksum mismatch" in err[0], err
    assert "delete it and --resume rebuilds it from the checkpoints" in err[0]
    assert not (run_dir / "COMPLETE").exists()

    final.write_bytes(good)
    sidecar.unlink()
    assert cli([*argv, "--resume"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and str(final) in err[0] and "no checksum file model.pt.sha256" in err[0], err

    final.unlink()  # the remedy the message names
    assert cli([*argv, "--resume"]) == 0
    rebuilt = torch.load(final, weights_only=True)
    assert rebuilt.keys() == weights.keys() and all(torch.equal(rebuilt[k], weights[k]) for k in weights)
    assert sidecar.is_file() and (run_dir / "COMPLETE").is_file()
