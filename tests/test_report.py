"""``shiftguard report``: rebuilds a finished run's report, compares runs, refuses half-written ones."""

from __future__ import annotations

import json
import shutil

import pytest

from shiftguard.cli import main as cli


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    assert cli(["run", "--quick", "--name", "r", "--out", str(out), "--no-progress", "--epochs", "1"]) == 0
    return out / "r"


def test_report_rebuilds_html_and_plots(run_dir, tmp_path, capsys):
    d = tmp_path / "r"
    shutil.copytree(run_dir, d)
    (d / "report.html").unlink()
    shutil.rmtree(d / "plots" / "accuracy_vs_severity.png", ignore_errors=True)
    (d / "plots" / "accuracy_vs_severity.png").unlink(missing_ok=True)
    assert cli(["report", str(d)]) == 0
    assert (d / "report.html").is_file() and (d / "plots" / "accuracy_vs_severity.png").is_file()
    out = capsys.readouterr().out
    assert "lenet-relu-ce" in out and "drop 0→5" in out


def test_report_compares_several_runs(run_dir, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(run_dir, a)
    shutil.copytree(run_dir, b)
    res = json.loads((b / "results.json").read_text())
    res["name"] = "b"
    (b / "results.json").write_text(json.dumps(res))
    page = tmp_path / "cmp.html"
    assert cli(["report", str(a), str(b), "--out", str(page)]) == 0
    text = page.read_text()
    assert "data:image/png;base64," in text and ">b<" in text


def test_report_refuses_a_run_without_complete_marker(run_dir, tmp_path, capsys):
    d = tmp_path / "half"
    shutil.copytree(run_dir, d)
    (d / "COMPLETE").unlink()
    assert cli(["report", str(d)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "incomplete" in err[0] and "--resume" in err[0]


def test_report_refuses_a_directory_that_is_not_a_run(tmp_path, capsys):
    (tmp_path / "junk").mkdir()
    assert cli(["report", str(tmp_path / "junk")]) == 2
    assert "not a shiftguard run directory" in capsys.readouterr().err
    assert cli(["report", str(tmp_path / "missing")]) == 2
    assert "not found" in capsys.readouterr().err


def test_report_refuses_a_corrupt_results_file(run_dir, tmp_path, capsys):
    d = tmp_path / "bad"
    shutil.copytree(run_dir, d)
    (d / "results.json").write_text("{ truncated")
    assert cli(["report", str(d)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
