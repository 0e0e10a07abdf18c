"""Failures of the environment end in one line, exit status 2, and lose nothing.

A full disk (ENOSPC, simulated: the file system's ``write`` fails after some bytes, as a full one
does), a read-only folder (EROFS, simulated: running as root, ``chmod`` does not stop a write), a
file where a folder should be, and a malformed or deeply nested ``results.json``: every command
says ``shiftguard <command>: error: <file>: <cause>`` on one line and exits 2. What was written
before the failure stays valid: a ``shiftguard run`` stopped by a full disk resumes with
``--resume`` to the results of an uninterrupted run, recomputing no finished step. Errors that are
not the environment's (an ``OSError`` such as EBADF points at a bug) keep their traceback.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from shiftguard.cli import main as cli
from shiftguard.io import atomic_write, atomic_write_json
from shiftguard.train.checkpoint import checksum_problem

FEW = settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    database=None,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
ENOSPC_TEXT = os.strerror(errno.ENOSPC)


class _FullFile:
    """A file on a full disk: the first ``room`` bytes are written, then ``write`` raises ENOSPC."""

    def __init__(self, fh, room: int):
        self._fh, self._room = fh, room

    def write(self, data) -> int:
        if len(data) > self._room:
            raise OSError(errno.ENOSPC, ENOSPC_TEXT)
        self._room -= len(data)
        return self._fh.write(data)

    def __getattr__(self, name):
        return getattr(self._fh, name)


def fill_disk(monkeypatch, hits, room: int = 0) -> list[Path]:
    """From now on, an atomic write to a target ``t`` with ``hits(t)`` meets a full disk after
    ``room`` bytes. Returns the list of targets that failed (filled in as they do)."""
    real_mkstemp, real_fdopen = tempfile.mkstemp, os.fdopen
    temps: dict[int, Path] = {}
    failed: list[Path] = []

    def mkstemp(*args, **kwargs):
        fd, tmp = real_mkstemp(*args, **kwargs)
        temps[fd] = Path(tmp)
        return fd, tmp

    def fdopen(fd, *args, **kwargs):
        fh = real_fdopen(fd, *args, **kwargs)
        tmp = temps.pop(fd, None)
        if tmp is None:
            return fh
        target = tmp.parent / tmp.name[1 : -len(".tmp")].rsplit(".", 1)[0]  # ".<name>.<random>.tmp"
        if not hits(target):
            return fh
        failed.append(target)
        return _FullFile(fh, room)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    monkeypatch.setattr(os, "fdopen", fdopen)
    return failed


def one_error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"shiftguard {command}: error: "), err
    return err[0]


# ------------------------------------------------------------------------------------------ atomic writer
@FEW
@given(room=st.integers(0, 3000), kind=st.sampled_from(["torch", "json"]))
def test_a_full_disk_during_any_write_raises_enospc_naming_the_target_and_keeps_the_old_file(room, kind):
    with tempfile.TemporaryDirectory() as d, pytest.MonkeyPatch.context() as mp:
        target = Path(d) / ("x.pt" if kind == "torch" else "x.json")
        atomic_write_json(target, {"old": True})
        failed = fill_disk(mp, lambda t: t == target, room)
        payload = {"w": torch.arange(500.0)}
        write = (
            (lambda: atomic_write(target, lambda fh: torch.save(payload, fh)))
            if kind == "torch"
            else (lambda: atomic_write_json(target, {"w": payload["w"].tolist()}))
        )
        try:
            write()
        except OSError as exc:  # torch.save's own "unexpected pos" RuntimeError must not be what surfaces
            assert exc.errno == errno.ENOSPC and exc.filename == str(target), exc
            assert json.loads(target.read_text()) == {"old": True}
        else:  # the write fit in the room left
            assert failed and target.stat().st_size <= room
        assert sorted(p.name for p in Path(d).iterdir()) == [target.name], "a temporary file was left"


def test_a_read_only_folder_names_the_target_not_the_temporary_file(tmp_path, monkeypatch):
    def read_only(*args, dir=None, prefix="", suffix="", **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.path.join(dir, f"{prefix}abc{suffix}"))

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    with pytest.raises(OSError, match="Read-only file system") as info:
        atomic_write_json(tmp_path / "r.json", {})
    assert info.value.errno == errno.EROFS and info.value.filename == str(tmp_path / "r.json")


def test_an_oserror_of_the_writer_itself_is_not_renamed(tmp_path):
    def writer(fh):  # e.g. reading the source of a download fails
        raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")

    with pytest.raises(ConnectionResetError) as info:
        atomic_write(tmp_path / "d.bin", writer)
    assert info.value.filename is None and not list(tmp_path.iterdir())


# ------------------------------------------------------------------------------------------ the command line
@pytest.fixture
def failing_command(monkeypatch):
    """``shiftguard gallery`` made to raise a given exception."""
    import shiftguard.commands.gallery as G

    def use(exc):
        def main(args):
            raise exc

        monkeypatch.setattr(G, "main", main)
        return ["gallery", "--out", "x.png"]

    return use


@pytest.mark.parametrize(
    "code, cause",
    [
        (errno.ENOSPC, "disk full"),
        (errno.EDQUOT, "quota"),
        (errno.EROFS, "read-only"),
        (errno.EACCES, "permission"),
        (errno.ENOTDIR, "file in the way"),
        (errno.EISDIR, "folder in the way"),
    ],
)
def test_environment_oserrors_are_one_line_naming_file_and_cause(failing_command, capsys, code, cause):
    argv = failing_command(OSError(code, os.strerror(code), "/data/out/results.json"))
    assert cli(argv) == 2, cause
    line = one_error_line(capsys, "gallery")
    assert f"/data/out/results.json: {os.strerror(code)} (errno {errno.errorcode[code]})" in line
    assert ("free space" in line) == (code in (errno.ENOSPC, errno.EDQUOT))


@pytest.mark.parametrize(
    "exc",
    [
        OSError(errno.EBADF, "Bad file descriptor"),
        RuntimeError("a bug"),
        RecursionError("maximum recursion depth exceeded"),
    ],
)
def test_errors_that_point_at_a_bug_keep_their_traceback(failing_command, exc):
    with pytest.raises(type(exc)):
        cli(failing_command(exc))


def test_debug_shows_the_traceback_of_an_environment_error(failing_command):
    with pytest.raises(OSError, match="No space left"):
        cli([*failing_command(OSError(errno.ENOSPC, ENOSPC_TEXT, "f")), "--debug"])


# ------------------------------------------------------------------------------------------ shiftguard run
TINY = """
name = "tiny"
[data]
train_subset = 120
test_subset = 60
corruptions = ["shot_noise", "rotate"]
severities = [5]
[train]
epochs = 2
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


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted tiny run: ``(argv without --out, its run directory)``."""
    root = tmp_path_factory.mktemp("reference")
    (root / "tiny.toml").write_text(TINY)
    argv = ["run", "--config", str(root / "tiny.toml"), "--no-progress", "--threads", "1"]
    assert cli([*argv, "--out", str(root / "runs")]) == 0
    return argv, root / "runs" / "tiny"


def test_run_stopped_by_a_full_disk_at_each_stage_resumes_to_the_uninterrupted_results(
    reference, tmp_path, monkeypatch, capsys
):
    """The disk fills up while writing the final weights (torch.save streaming), then a cached
    evaluation cell, then results.json; each time one line names the file, and the run resumes."""
    argv, ref_dir = reference
    out = tmp_path / "runs"
    run_dir = out / "tiny"
    stages = [("model.pt", []), ("rotate-s5.pt", ["--resume"]), ("results.json", ["--resume"])]
    kept: dict[Path, int] = {}
    for name, extra in stages:
        with pytest.MonkeyPatch.context() as mp:
            failed = fill_disk(mp, lambda t, name=name: t.name == name, room=100)
            assert cli([*argv, "--out", str(out), *extra]) == 2, name
        line = one_error_line(capsys, "run")
        assert failed and f"{failed[0]}: {ENOSPC_TEXT} (errno ENOSPC)" in line and "--resume" in line, line
        assert not (run_dir / "COMPLETE").exists()
        assert not [p for p in run_dir.rglob("*.tmp")], "a temporary file was left"
        for p, mtime in kept.items():  # nothing finished before is rewritten
            assert p.stat().st_mtime_ns == mtime, f"{p} was rewritten"
        kept.update(
            {p: p.stat().st_mtime_ns for p in run_dir.rglob("*.pt") if "checkpoints" not in p.parts and p.name != name}
        )
    assert checksum_problem(run_dir / "models" / "mlp" / "model.pt") is None
    assert cli([*argv, "--out", str(out), "--resume"]) == 0
    got, ref = (json.loads((d / "results.json").read_text()) for d in (run_dir, ref_dir))
    assert got["rows"] == ref["rows"] and got["aggregates"] == ref["aggregates"]
    for p, mtime in kept.items():
        assert p.stat().st_mtime_ns == mtime, f"{p} was rewritten"


def test_run_into_a_read_only_folder_is_one_line_and_writes_no_config(reference, tmp_path, monkeypatch, capsys):
    argv, _ = reference
    real_mkstemp = tempfile.mkstemp

    def read_only(*args, dir=None, prefix="", suffix="", **kwargs):
        if str(dir).startswith(str(tmp_path)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.path.join(dir, f"{prefix}abc{suffix}"))
        return real_mkstemp(*args, dir=dir, prefix=prefix, suffix=suffix, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    assert cli([*argv, "--out", str(tmp_path / "runs")]) == 2
    line = one_error_line(capsys, "run")
    assert f"{tmp_path / 'runs' / 'tiny' / 'config.json'}: Read-only file system (errno EROFS)" in line
    assert not (tmp_path / "runs" / "tiny" / "config.json").exists()


def test_run_with_a_file_as_out_folder_is_one_line(reference, tmp_path, capsys):
    argv, _ = reference
    (tmp_path / "afile").write_text("not a folder")
    assert cli([*argv, "--out", str(tmp_path / "afile")]) == 2
    line = one_error_line(capsys, "run")
    assert f"{tmp_path / 'afile' / 'tiny'}: {os.strerror(errno.ENOTDIR)}" in line
    assert (tmp_path / "afile").read_text() == "not a folder"


# ------------------------------------------------------------------------------------------ shiftguard evaluate
@pytest.fixture
def evaluate_argv(tmp_path, monkeypatch):
    from _cli_helpers import evaluate_argv as argv

    return argv(tmp_path, monkeypatch, "envnets", "--random-weights", corruption="rotate")


def test_evaluate_with_a_file_as_out_is_refused_before_evaluating(evaluate_argv, tmp_path, monkeypatch, capsys):
    import shiftguard.evaluation as E

    monkeypatch.setattr(E, "evaluate", lambda *a, **k: pytest.fail("evaluated although --out cannot be written"))
    (tmp_path / "afile").write_text("x")
    assert cli([*evaluate_argv, "--out", str(tmp_path / "afile")]) == 2
    assert f"--out: {tmp_path / 'afile'} exists and is not a folder" in one_error_line(capsys, "evaluate")
    assert cli([*evaluate_argv, "--out", str(tmp_path / "afile" / "sub")]) == 2
    assert f"{tmp_path / 'afile' / 'sub'}: {os.strerror(errno.ENOTDIR)}" in one_error_line(capsys, "evaluate")


def test_evaluate_on_a_full_disk_shows_its_results_and_names_the_file(evaluate_argv, tmp_path, monkeypatch, capsys):
    failed = fill_disk(monkeypatch, lambda t: t.name == "results.json")
    assert cli([*evaluate_argv, "--out", str(tmp_path / "o")]) == 2
    captured = capsys.readouterr()
    err = captured.err.splitlines()
    assert len(err) == 1 and f"{failed[0]}: {ENOSPC_TEXT}" in err[0], err
    assert "softmax" in captured.out, "the results were not shown before the write"
    assert not (tmp_path / "o" / "results.json").exists()


# ------------------------------------------------------------------------------------------ shiftguard report
def _finished_run(root: Path, results_text: str | bytes) -> Path:
    d = root / "run"
    d.mkdir()
    atomic_write_json(d / "config.json", {"config": {}, "source": "<test>"})
    atomic_write(
        d / "results.json",
        lambda fh: fh.write(results_text if isinstance(results_text, bytes) else results_text.encode()),
    )
    atomic_write(d / "COMPLETE", lambda fh: fh.write(b"x\n"))
    return d


def _report_fails_with_one_line(root: Path, capsys, results_text) -> str:
    d = _finished_run(root, results_text)
    before = {p: p.read_bytes() for p in d.iterdir()}
    assert cli(["report", str(d), "--out", str(root / "rep")]) == 2
    line = one_error_line(capsys, "report")
    assert str(d / "results.json") in line, line
    assert {p: p.read_bytes() for p in d.iterdir()} == before
    return line


@pytest.mark.parametrize(
    "text, cause",
    [
        ('{"status": "complete", "rows": ' + "[" * 100_000 + "]" * 100_000 + ', "data": {}}', "nested too deeply"),
        (
            '{"status": "complete", "data": {}, "rows": [' + '{"a": ' * 5000 + "1" + "}" * 5000 + "]}",
            "nested too deeply",
        ),
        ("[1, 2]", "a JSON list, expected an object"),
        ('{"status": "complete", "rows": "abc", "data": {}}', "'rows' must be a list of objects"),
        ('{"status": "complete", "rows": [], "data": 3}', "'data' must be an object"),
        ('{"status": "complete", "rows": [{}], "data": {}}', "malformed results file"),
        ('{"status": "complete", "rows": [{"mo', "not valid JSON"),
        (b"\xff\xfe{}", "not valid JSON"),
    ],
)
def test_report_of_a_malformed_results_file_is_one_line_naming_it(tmp_path, capsys, text, cause):
    assert cause in _report_fails_with_one_line(tmp_path, capsys, text)


def test_report_of_a_results_file_with_wrong_values_is_one_line(reference, tmp_path, capsys):
    results = json.loads((reference[1] / "results.json").read_text())
    results["rows"][0]["accuracy"] = "high"
    assert "malformed results file" in _report_fails_with_one_line(tmp_path, capsys, json.dumps(results))


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=12,
)
ROW = st.dictionaries(
    st.sampled_from(["model", "context", "head", "corruption", "severity", "accuracy", "ece"]), JSON, max_size=7
)


@FEW
@given(
    doc=st.one_of(
        JSON,
        st.fixed_dictionaries(
            {
                "status": st.just("complete"),
                "rows": st.lists(ROW, max_size=2),
                "data": st.dictionaries(st.text(max_size=5), JSON, max_size=3),
            }
        ),
    )
)
def test_report_of_any_json_document_ends_in_a_report_or_one_line(tmp_path_factory, doc):
    root = tmp_path_factory.mktemp("doc")
    d = _finished_run(root, json.dumps(doc))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = cli(["report", str(d), "--out", str(root / "rep")])
    lines = err.getvalue().splitlines()
    assert rc == 0 or (
        rc == 2
        and len(lines) == 1
        and lines[0].startswith("shiftguard report: error: ")
        and str(d / "results.json") in lines[0]
    ), (rc, lines)
