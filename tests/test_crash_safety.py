"""Crash safety: a run killed at any moment resumes to the same result.

Faults are real ``SIGKILL`` s of real processes (no ``finally`` blocks, no atexit, no flush):

* a training process killed in the middle of an epoch, before its first checkpoint, between a
  checkpoint's temporary file and its rename, between a checkpoint and its checksum file, and at
  seeded random moments; each is resumed and must end with bit-identical weights and the same
  metric history as an uninterrupted run with the same seed;
* a checkpoint writer killed at 25 random moments: the newest checkpoint that passes its checksum
  is always loadable and always holds exactly what was saved;
* an evaluation grid that is interrupted recomputes only its missing cells;
* a half-written run directory is refused by ``shiftguard report``.

The trainer worker below runs in a subprocess (``python worker.py MODE CKPT_DIR``); fault hooks are
installed by monkey-patching inside that process only, the library itself has no test hooks.
``SHIFTGUARD_RELIABILITY_LOG`` (set by ``benchmarks/reliability_summary.py``) collects counts.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from shiftguard.train.checkpoint import (
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    load_latest_checkpoint,
    save_checkpoint,
)


def record(**row) -> None:
    """Append one outcome row for ``benchmarks/reliability_summary.py`` (no-op unless asked)."""
    path = os.environ.get("SHIFTGUARD_RELIABILITY_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"file": "test_crash_safety.py", **row}) + "\n")


# ------------------------------------------------------------------------------------------ worker
WORKER = r'''
import os, signal, sys, time
import torch
from torch import nn
from shiftguard.train import Trainer, train_val_split

EPOCHS = 4


def make_data(n=192, num_classes=4):
    """Learnable synthetic images: class c lights up its own 7x7 patch, plus noise."""
    g = torch.Generator().manual_seed(0)
    y = torch.arange(n) % num_classes
    x = torch.randint(0, 60, (n, 1, 28, 28), generator=g)
    for c in range(num_classes):
        r, col = divmod(c, 2)
        x[y == c, :, r * 14 + 3 : r * 14 + 10, col * 14 + 3 : col * 14 + 10] += 180
    return x.clamp(0, 255).to(torch.uint8), y


class DropoutMLP(nn.Module):
    """Dropout draws from torch's global RNG: resume is identical only if that RNG is restored too."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(784, 24), nn.ReLU(), nn.Dropout(0.3))
        self.classifier = nn.Linear(24, 4)

    def embed(self, x):
        return self.body(x)

    def forward(self, x):
        return self.classifier(self.embed(x))


def run(ckpt, resume):
    """Build the model (seeded) and train it; returns (model, summary)."""
    torch.set_num_threads(1)
    x, y = make_data()
    tr, va = train_val_split(len(y))
    torch.manual_seed(0)
    model = DropoutMLP()
    trainer = Trainer(model, epochs=EPOCHS, batch_size=32, progress=False, seed=3, checkpoint_dir=ckpt,
                      early_stopping_patience=0)
    summary = trainer.fit(x[tr], y[tr], x[va], y[va], num_classes=4, resume=resume)
    return model, summary


def die():
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    mode, ckpt = sys.argv[1], sys.argv[2]
    if mode.startswith("batch:"):          # die inside epoch E, before its batch B
        e, b = map(int, mode[len("batch:"):].split(","))
        orig = Trainer.batches

        def batches(self, labels, epoch):
            for i, idx in enumerate(orig(self, labels, epoch)):
                if epoch == e and i == b:
                    die()
                yield idx

        Trainer.batches = batches
    elif mode.startswith("rename:"):       # die when the complete temp file of NAME is about to be renamed
        target = mode[len("rename:"):]
        real_replace = os.replace

        def replace(src, dst):
            if os.path.basename(dst) == target:
                assert os.path.getsize(src) > 0
                die()
            return real_replace(src, dst)

        os.replace = replace               # shiftguard.io.atomic_write calls os.replace
    elif mode == "slow":                   # slow batches: the parent kills at a random moment
        orig = Trainer.batches

        def batches(self, labels, epoch):
            for idx in orig(self, labels, epoch):
                time.sleep(0.05)
                yield idx

        Trainer.batches = batches
    run(ckpt, resume=False)
    print("FINISHED", flush=True)
'''


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """``(path of the worker script, its namespace)``: the same code runs here and in subprocesses."""
    path = tmp_path_factory.mktemp("worker") / "worker.py"
    path.write_text(WORKER)
    ns: dict = {"__name__": "crash_worker"}
    exec(compile(WORKER, str(path), "exec"), ns)
    return path, ns


@pytest.fixture
def one_thread():
    """The subprocess trains on one thread; so does the in-process comparison (same float order)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def reference(worker, tmp_path_factory):
    """Final weights and history of an uninterrupted run with the same seed."""
    old = torch.get_num_threads()
    ckpt = tmp_path_factory.mktemp("ref") / "ckpt"
    try:
        model, summary = worker[1]["run"](ckpt, resume=False)
    finally:
        torch.set_num_threads(old)
    # The final model is the best-validation one; the last checkpoint also holds the last epoch's
    # weights and optimiser state, which any divergence after a resume would change.
    return {k: v.clone() for k, v in model.state_dict().items()}, summary, load_latest_checkpoint(ckpt)


def launch(worker, mode: str, ckpt: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(worker[0]), mode, str(ckpt)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def run_to_death(worker, mode: str, ckpt: Path) -> None:
    proc = launch(worker, mode, ckpt)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == -signal.SIGKILL, f"worker was not killed (rc={proc.returncode}):\n{out}\n{err[-3000:]}"


def comparable(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in h.items() if k != "seconds"} for h in history]


def assert_resumes_identically(worker, reference, ckpt: Path) -> dict:
    """Resume from ``ckpt`` in this process; weights and history must equal the reference exactly."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a damaged newest checkpoint is reported, then skipped
        model, summary = worker[1]["run"](ckpt, resume=True)
    ref_weights, ref_summary, ref_last = reference
    got = model.state_dict()
    assert got.keys() == ref_weights.keys()
    for k in got:
        torch.testing.assert_close(got[k], ref_weights[k], rtol=0, atol=0, msg=k)
    last = load_latest_checkpoint(ckpt)
    assert last["epoch"] == ref_last["epoch"]
    for k, v in ref_last["model"].items():
        torch.testing.assert_close(last["model"][k], v, rtol=0, atol=0, msg=f"last-epoch {k}")
    for i, st in ref_last["optimizer"]["state"].items():
        for k, v in st.items():
            torch.testing.assert_close(last["optimizer"]["state"][i][k], v, rtol=0, atol=0, msg=f"Adam {i}.{k}")
    assert comparable(summary["history"]) == comparable(ref_summary["history"])
    assert summary["best_epoch"] == ref_summary["best_epoch"]
    assert summary["best_val_acc"] == ref_summary["best_val_acc"]
    return summary


def checkpoint_epochs(ckpt: Path) -> list[int]:
    return [e for e, _ in list_checkpoints(ckpt)]


# ------------------------------------------------------------------------------------------ trainer kills
def test_kill_in_the_middle_of_an_epoch_resumes_to_identical_weights(worker, reference, tmp_path, one_thread):
    ckpt = tmp_path / "ckpt"
    run_to_death(worker, "batch:2,3", ckpt)  # epoch 1 is checkpointed, epoch 2 is half done
    assert checkpoint_epochs(ckpt) == [1]
    assert load_latest_checkpoint(ckpt)["epoch"] == 1
    assert_resumes_identically(worker, reference, ckpt)
    record(group="training kill (SIGKILL)", case="mid-epoch 2, after checkpoint 1", n=1, outcome="resumed, identical")


def test_kill_before_the_first_checkpoint_restarts_identically(worker, reference, tmp_path, one_thread):
    ckpt = tmp_path / "ckpt"
    run_to_death(worker, "batch:1,2", ckpt)
    assert checkpoint_epochs(ckpt) == []
    assert_resumes_identically(worker, reference, ckpt)
    record(group="training kill (SIGKILL)", case="mid-epoch 1, no checkpoint yet", n=1, outcome="restarted, identical")


def test_kill_between_checkpoint_temp_file_and_rename_leaves_the_previous_one(worker, reference, tmp_path, one_thread):
    ckpt = tmp_path / "ckpt"
    run_to_death(worker, "rename:epoch-0002.pt", ckpt)
    # The complete temporary file is there, the checkpoint name is not: readers never see it.
    assert any(p.name.startswith(".epoch-0002.pt.") for p in ckpt.iterdir())
    assert checkpoint_epochs(ckpt) == [1]
    assert load_latest_checkpoint(ckpt)["epoch"] == 1
    assert_resumes_identically(worker, reference, ckpt)
    record(
        group="checkpoint-write kill (SIGKILL)",
        case="temp file written, before rename",
        n=1,
        outcome="previous checkpoint used, identical",
    )


def test_kill_between_checkpoint_and_its_checksum_skips_the_unverified_file(worker, reference, tmp_path, one_thread):
    ckpt = tmp_path / "ckpt"
    run_to_death(worker, "rename:epoch-0002.pt.sha256", ckpt)
    assert checkpoint_epochs(ckpt) == [1, 2]
    assert not (ckpt / "epoch-0002.pt.sha256").exists()
    with pytest.raises(CheckpointError, match="epoch-0002.pt"):
        load_checkpoint(ckpt / "epoch-0002.pt")
    with pytest.warns(RuntimeWarning, match="epoch-0002.pt"):
        assert load_latest_checkpoint(ckpt)["epoch"] == 1
    assert_resumes_identically(worker, reference, ckpt)
    record(
        group="checkpoint-write kill (SIGKILL)",
        case="checkpoint renamed, checksum not yet",
        n=1,
        outcome="unverified file skipped with a warning, identical",
    )


def test_kill_at_random_moments_after_the_first_checkpoint(worker, reference, tmp_path, one_thread):
    rng = random.Random(8)
    killed_after = []
    for trial in range(2):
        ckpt = tmp_path / f"ckpt{trial}"
        proc = launch(worker, "slow", ckpt)
        deadline = time.monotonic() + 240
        while not (ckpt / "epoch-0001.pt.sha256").exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "worker never wrote its first checkpoint"
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.4))
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL and "FINISHED" not in out, "the run finished before the kill"
        state = load_latest_checkpoint(ckpt)
        assert state is not None
        killed_after.append(int(state["epoch"]))
        assert_resumes_identically(worker, reference, ckpt)
    record(
        group="training kill (SIGKILL)",
        case="random moment after checkpoint 1",
        n=len(killed_after),
        outcome=f"resumed, identical (last good epochs {killed_after})",
    )


# ------------------------------------------------------------------------------------------ writer under random kills
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_newest_checkpoint_is_always_loadable_under_random_kills(tmp_path):
    """A child saves checkpoints in a loop and is SIGKILLed at 25 random moments; after each kill
    the newest checkpoint that passes its checksum loads and equals what was saved for its epoch."""
    ckpt = tmp_path / "ckpt"
    g = torch.Generator().manual_seed(0)
    payloads = [torch.randn(200_000, generator=g) for _ in range(3)]  # ~0.8 MB each: writes take time

    def state(epoch: int) -> dict:
        return {"epoch": epoch, "w": payloads[epoch % 3], "note": f"epoch {epoch}"}

    # Kill within a few save-durations, measured here, so the test means the same on a slow disk.
    t0 = time.perf_counter()
    save_checkpoint(tmp_path / "timing", 1, state(1))
    window = 4 * (time.perf_counter() - t0) + 0.01
    rng = random.Random(25)
    kills, fallbacks, last_epochs = 25, 0, []
    start = 1  # like Trainer.fit(resume=True): continue after the newest *verified* checkpoint
    for _ in range(kills):
        pid = os.fork()
        if pid == 0:  # child: write until killed
            try:
                epoch = start
                while True:
                    save_checkpoint(ckpt, epoch, state(epoch), keep=2)
                    epoch += 1
            finally:
                os._exit(1)
        time.sleep(rng.uniform(0.0, window))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = load_latest_checkpoint(ckpt)
        fallbacks += bool(caught)
        if got is None:  # killed before the very first checkpoint was complete
            assert not any((ckpt / f"epoch-{e:04d}.pt.sha256").exists() for e in checkpoint_epochs(ckpt))
            continue
        e = int(got["epoch"])
        torch.testing.assert_close(got["w"], payloads[e % 3], rtol=0, atol=0)
        assert got["note"] == f"epoch {e}"
        # at most the single newest file may be unverified (its checksum was not yet written)
        unverified = [x for x in checkpoint_epochs(ckpt) if not (ckpt / f"epoch-{x:04d}.pt.sha256").exists()]
        assert unverified in ([], [checkpoint_epochs(ckpt)[-1]])
        last_epochs.append(e)
        start = e + 1
    assert len(last_epochs) >= kills // 2, "the writer rarely got a checkpoint out: the test is not testing"
    assert last_epochs == sorted(last_epochs), "a later crash must never lose an earlier good checkpoint"
    record(
        group="checkpoint-write kill (SIGKILL)",
        case="random moments in a save loop",
        n=kills,
        outcome=f"newest verified checkpoint always loadable and exact ({fallbacks} fell back past a damaged one)",
    )


def test_disk_full_during_a_checkpoint_write_keeps_the_previous_one(tmp_path, monkeypatch):
    """ENOSPC while the checkpoint (then, separately, its checksum file) is flushed: the error
    propagates, no temporary file is left, and the previous checkpoint is still the newest one loaded."""
    import errno

    import shiftguard.io as sio
    import shiftguard.train.checkpoint as C

    ckpt = tmp_path / "ckpt"
    save_checkpoint(ckpt, 1, {"epoch": 1, "w": torch.ones(3)})
    real_fsync, real_write_text = os.fsync, C.atomic_write_text

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    def checksum_hits_full_disk(path, text):  # the data file got through; the disk fills up now
        monkeypatch.setattr(sio.os, "fsync", full_disk)
        return real_write_text(path, text)

    faults = {
        "data file": lambda: monkeypatch.setattr(sio.os, "fsync", full_disk),
        "checksum file": lambda: monkeypatch.setattr(C, "atomic_write_text", checksum_hits_full_disk),
    }
    for what, inject in faults.items():
        inject()
        with pytest.raises(OSError, match="No space left"):
            save_checkpoint(ckpt, 2, {"epoch": 2, "w": torch.zeros(3)})
        monkeypatch.setattr(sio.os, "fsync", real_fsync)
        monkeypatch.setattr(C, "atomic_write_text", real_write_text)
        assert not [p for p in ckpt.iterdir() if p.name.endswith(".tmp")], what
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the unverified epoch 2 is skipped
            state = load_latest_checkpoint(ckpt)
        assert state["epoch"] == 1 and torch.equal(state["w"], torch.ones(3)), what
    record(
        group="disk full (ENOSPC)",
        case="while flushing a checkpoint / its checksum file",
        n=len(faults),
        outcome="error raised, no temp file left, previous checkpoint still loaded",
    )


# ------------------------------------------------------------------------------------------ evaluation grid
class CountingModel(torch.nn.Module):
    """A tiny embedding model that counts how many images it embeds."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 8))
        self.classifier = torch.nn.Linear(8, 3)
        self.embedded = 0

    def embed(self, x):
        self.embedded += x.shape[0]
        return self.body(x)

    def forward(self, x):
        return self.classifier(self.embed(x))


def _grid(tmp_path):
    g = torch.Generator().manual_seed(1)
    y = torch.arange(60) % 3
    x = (torch.rand(60, 1, 8, 8, generator=g) * 80 + y.view(-1, 1, 1, 1) * 60).to(torch.uint8)
    calls: list[tuple[str, int]] = []

    def shifted(corruption: str, severity: int) -> torch.Tensor:
        calls.append((corruption, severity))
        if corruption == "flip":
            return torch.flip(x[40:], dims=[3])
        return (x[40:].int() + 20 * severity).clamp(0, 255).to(torch.uint8)

    from shiftguard.evaluation import ModelOutputs
    from shiftguard.evaluation.plan import ModelEntry

    model = CountingModel()
    kw = dict(
        models=[ModelEntry("m", model, ModelOutputs(model), ["softmax", "knn", "quantile"])],
        support=(x[:30], y[:30]),
        validation=(x[30:40], y[30:40]),
        test=(x[40:], y[40:]),
        shifted=shifted,
        cells=[(c, s, "benchmark") for c in ("flip", "bright") for s in (1, 2)],
        num_classes=3,
        cache_root=tmp_path / "cache",
        batch_size=10,
        k=3,
        retrieval_ks=(1,),
        progress=False,
    )
    return kw, calls, model


def test_finished_evaluation_cells_are_not_recomputed(tmp_path):
    from shiftguard.evaluation.grid import run_grid
    from shiftguard.evaluation.plan import EvaluationPlan

    def evaluate_models(**kw):
        out = run_grid(EvaluationPlan(**kw))
        return out.rows, out

    kw, calls, model = _grid(tmp_path)
    rows1, _ = evaluate_models(**kw)
    assert len(calls) == 4 and model.embedded == 30 + 10 + 5 * 20  # support, validation, clean + 4 cells
    cache = tmp_path / "cache" / "m" / "none"
    mtimes = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}

    calls.clear()
    model.embedded = 0
    torch.manual_seed(123)  # a resumed process starts from another global RNG state (no training ran)
    rows2, _ = evaluate_models(**kw)
    assert calls == [] and model.embedded == 0, "a finished grid was recomputed"
    assert rows2 == rows1

    # An interrupted grid: two cells never finished (their files are missing), one was left damaged.
    (cache / "bright-s2.pt").unlink()
    (cache / "flip-s1.pt").unlink()
    (cache / "clean-s0.pt").write_bytes((cache / "clean-s0.pt").read_bytes()[:100])
    calls.clear()
    model.embedded = 0
    rows3, _ = evaluate_models(**kw)
    assert sorted(calls) == [("bright", 2), ("flip", 1)]
    assert model.embedded == 3 * 20  # the two missing cells and the damaged clean cell, nothing else
    assert rows3 == rows1
    untouched = {"support.pt", "validation.pt", "flip-s2.pt", "bright-s1.pt"}
    for p in cache.iterdir():
        if p.name in untouched:
            assert p.stat().st_mtime_ns == mtimes[p.name], f"{p.name} was rewritten"
    assert not [p for p in cache.iterdir() if p.name.endswith(".tmp")]
    record(
        group="evaluation resume",
        case="grid of 2 corruptions x 2 severities + clean: 2 cells missing, 1 damaged",
        n=3,
        outcome="only the 3 affected cells recomputed; rows identical",
    )


# ------------------------------------------------------------------------------------------ run directories
def _half_written_runs(root: Path) -> dict[str, Path]:
    """Run directories as a kill at each stage of ``shiftguard run`` leaves them."""
    from shiftguard.io import atomic_write_json, atomic_write_text

    runs = {}

    def make(name: str) -> Path:
        d = root / name
        (d / "models" / "m" / "checkpoints").mkdir(parents=True)
        atomic_write_json(d / "config.json", {"config": {}, "source": "<test>"})
        runs[name] = d
        return d

    make("killed-in-training")
    d = make("killed-in-evaluation")
    (d / "cache" / "m" / "none").mkdir(parents=True)
    (d / "cache" / "m" / "none" / "clean-s0.pt").write_bytes(b"\0" * 10)
    d = make("killed-before-complete-marker")  # results.json written, COMPLETE not yet
    atomic_write_json(d / "results.json", {"status": "complete", "name": d.name})
    d = make("marker-but-no-results")
    atomic_write_text(d / "COMPLETE", "x\n")
    d = make("marker-but-truncated-results")  # only possible on a filesystem without atomic rename
    atomic_write_text(d / "COMPLETE", "x\n")
    (d / "results.json").write_text('{"status": "complete", "rows": [{"mo')
    d = make("results-not-complete")
    atomic_write_text(d / "COMPLETE", "x\n")
    atomic_write_json(d / "results.json", {"status": "running"})
    return runs


def test_report_refuses_every_half_written_run_directory(tmp_path, capsys):
    from shiftguard.cli import main as cli

    runs = _half_written_runs(tmp_path)
    for name, d in runs.items():
        before = sorted(p.relative_to(d) for p in d.rglob("*"))
        assert cli(["report", str(d)]) == 2, name
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(d) in err, (name, err)
        assert sorted(p.relative_to(d) for p in d.rglob("*")) == before, f"{name}: report wrote files"
    record(
        group="half-written run directory",
        case="kill stages of `shiftguard run` (6 states)",
        n=len(runs),
        outcome="`shiftguard report` exits 2 naming the directory, writes nothing",
    )


# ------------------------------------------------------------------------------------------ end to end
TINY_RUN = """
name = "tiny"
seed = 0
[data]
train_subset = 240
test_subset = 100
corruptions = ["shot_noise", "rotate"]
severities = [5]
[train]
epochs = 3
batch_size = 48
early_stopping_patience = 0
[eval]
batch_size = 50
k = 5
retrieval_ks = [1]
[[models]]
name = "mlp-relu"
arch = "mlp"
activation = "relu"
heads = ["softmax", "knn", "quantile"]
model_kwargs = { hidden = [32, 16] }
"""

CLI_DRIVER = r"""
import os, signal, sys
mode = sys.argv[1]
def die():
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "training":                 # die in the middle of epoch 2 of the model
    from shiftguard.train import Trainer
    orig = Trainer.batches
    def batches(self, labels, epoch):
        for i, idx in enumerate(orig(self, labels, epoch)):
            if epoch == 2 and i == 2:
                die()
            yield idx
    Trainer.batches = batches
elif mode == "model-write":            # die when the final weights' temp file is about to be renamed
    real_replace = os.replace
    def replace(src, dst):
        if os.path.basename(dst) == "model.pt":
            die()
        return real_replace(src, dst)
    os.replace = replace
elif mode == "evaluation":             # die when the first corrupted cell is about to be embedded
    from shiftguard.evaluation import cache as E
    orig_get = E.OutputCache.get_or_compute
    def get_or_compute(self, key, fn, *rest):
        if key == "rotate-s5":
            die()
        return orig_get(self, key, fn, *rest)
    E.OutputCache.get_or_compute = get_or_compute
from shiftguard.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_killed_cli_run_is_refused_by_report_and_resumes_to_identical_results(tmp_path, capsys, one_thread):
    """``shiftguard run`` SIGKILLed in training, resumed and SIGKILLed while writing the final weights,
    resumed and SIGKILLed in evaluation, resumed again: ``report`` refuses the half-written directory
    each time and the final results equal an uninterrupted run's."""
    from shiftguard.cli import main as cli

    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY_RUN)
    driver = tmp_path / "driver.py"
    driver.write_text(CLI_DRIVER)
    base = ["run", "--config", str(cfg), "--no-progress"]
    assert cli([*base, "--out", str(tmp_path / "a")]) == 0
    ref = json.loads((tmp_path / "a" / "tiny" / "results.json").read_text())

    out = tmp_path / "b"
    run_dir = out / "tiny"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for mode, extra in (("training", []), ("model-write", ["--resume"]), ("evaluation", ["--resume"])):
        proc = subprocess.run(
            [sys.executable, str(driver), mode, *base, "--out", str(out), *extra],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
        assert not (run_dir / "COMPLETE").exists()
        assert cli(["report", str(run_dir)]) == 2
        assert "incomplete" in capsys.readouterr().err
    cache = run_dir / "cache" / "mlp-relu" / "none"
    done_before = {p.name: p.stat().st_mtime_ns for p in cache.glob("*.pt")}
    assert {"support.pt", "validation.pt", "clean-s0.pt", "shot_noise-s5.pt"} <= set(done_before)

    assert cli([*base, "--out", str(out), "--resume"]) == 0
    got = json.loads((run_dir / "results.json").read_text())
    assert got["rows"] == ref["rows"]
    assert got["aggregates"] == ref["aggregates"]
    assert comparable(got["training"]["mlp-relu"]["history"]) == comparable(ref["training"]["mlp-relu"]["history"])
    for name, mtime in done_before.items():
        assert (cache / name).stat().st_mtime_ns == mtime, f"finished cell {name} was recomputed"
    assert cli(["report", str(run_dir)]) == 0
    record(
        group="`shiftguard run` kill (SIGKILL)",
        case="mid-training, then writing model.pt, then mid-evaluation",
        n=3,
        outcome="report refused each half-written state; resumed results identical; finished cells not recomputed",
    )


# ------------------------------------------------------------------------------------------ every write is atomic
def test_library_writes_files_only_through_the_atomic_writers():
    """A static audit of ``src/shiftguard``: no module opens a file for writing, calls
    ``write_text``/``write_bytes``, or hands a path to ``torch.save``/``np.save``/``savefig``/
    ``PIL.Image.save`` -- they serialise to memory and call ``shiftguard.io.atomic_write*``, whose
    temp-file + fsync + rename is what the kill tests above rely on."""
    import ast

    src = Path(__file__).resolve().parents[1] / "src" / "shiftguard"
    offenders = []
    for path in sorted(src.rglob("*.py")):
        if path.name == "io.py" and path.parent == src:
            continue  # the atomic writers themselves
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            where = f"{path.relative_to(src)}:{node.lineno}"
            if name in ("write_text", "write_bytes"):
                offenders.append(f"{where} {name}()")
            elif (
                name in ("open", "fdopen")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and any(m in str(node.args[1].value) for m in "wax+")
            ):
                offenders.append(f"{where} open(..., {node.args[1].value!r})")
            elif name in ("save", "savefig", "savez", "savez_compressed", "tofile") and node.args:
                is_torch = isinstance(f, ast.Attribute) and getattr(f.value, "id", "") == "torch"
                if is_torch and len(node.args) < 2:
                    continue
                # torch.save(obj, f); np.save(f, arr); fig.savefig(f)
                target = node.args[1] if is_torch else node.args[0]
                # Saving into an in-memory buffer or the atomic writer's file object is fine; a path is not.
                if not (isinstance(target, ast.Name) and target.id in ("buf", "fh")):
                    offenders.append(f"{where} {name}({ast.unparse(target)})")
    assert not offenders, "non-atomic writes:\n" + "\n".join(offenders)
    record(
        group="atomic writes",
        case="static audit of every module in src/shiftguard",
        n=len(list(src.rglob("*.py"))),
        outcome="every file write goes through shiftguard.io.atomic_write*",
    )
