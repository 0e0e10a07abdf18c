"""The command line never overwrites, mixes or leaks the user's files: ``shiftguard evaluate --out``
takes a new or empty folder (``--overwrite`` replaces an earlier evaluation's report, never a run's),
locks it, removes the old report before writing the new one; ``--weights`` or ``--random-weights``
is required; reports embed only a real PNG inside their own folder."""

from __future__ import annotations

import pytest
from _cli_helpers import evaluate_argv

from shiftguard.cli import main as cli
from shiftguard.evaluation.report import MAX_GALLERY_BYTES, make_plots, safe_png


@pytest.fixture
def argv(tmp_path, monkeypatch):
    return evaluate_argv(tmp_path, monkeypatch, "filenets")


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_evaluating_without_weights_needs_an_explicit_flag(argv, tmp_path, capsys):
    assert cli([*argv, "--out", str(tmp_path / "o")]) == 2
    assert "--weights: no weights given" in _error(capsys)
    assert not (tmp_path / "o").exists()
    assert cli([*argv, "--random-weights", "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "results.json").is_file()


def test_a_non_empty_out_folder_is_refused_and_overwrite_replaces_only_a_report(argv, tmp_path, capsys):
    out = tmp_path / "o"
    assert cli([*argv, "--random-weights", "--out", str(out)]) == 0
    capsys.readouterr()
    first = (out / "results.json").read_text()
    assert cli([*argv, "--random-weights", "--seed", "1", "--out", str(out)]) == 2
    assert "is not empty" in _error(capsys) and (out / "results.json").read_text() == first
    assert cli([*argv, "--random-weights", "--seed", "1", "--overwrite", "--out", str(out)]) == 0
    assert (out / "results.json").read_text() != first
    (out / "notes.txt").write_text("mine")
    assert cli([*argv, "--random-weights", "--overwrite", "--out", str(out)]) == 2
    assert "holds files that are not a shiftguard report (notes.txt)" in _error(capsys)
    assert (out / "notes.txt").read_text() == "mine"


def test_a_run_folder_is_never_an_evaluation_output(argv, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "COMPLETE").write_text("x")
    (run / "results.json").write_text("{}")
    assert cli([*argv, "--random-weights", "--overwrite", "--out", str(run)]) == 2
    assert "is a shiftguard run folder" in _error(capsys) and (run / "results.json").read_text() == "{}"


def test_a_failure_while_writing_never_leaves_the_old_report_looking_complete(argv, tmp_path, capsys, monkeypatch):
    out = tmp_path / "o"
    assert cli([*argv, "--random-weights", "--out", str(out)]) == 0
    import shiftguard.evaluation.report as R

    def broken(*a, **k):
        raise OSError(28, "No space left on device", str(out / "report.html"))

    monkeypatch.setattr(R, "build_report", broken)
    assert cli([*argv, "--random-weights", "--seed", "1", "--overwrite", "--out", str(out)]) == 2
    assert not (out / "results.json").exists()  # no results.json: the folder does not claim a complete report


def test_a_folder_locked_by_another_evaluation_is_refused(argv, tmp_path, capsys):
    from shiftguard._lock import DirectoryLock

    out = tmp_path / "o"
    out.mkdir()
    lock = DirectoryLock(out).acquire()
    try:
        assert cli([*argv, "--random-weights", "--out", str(out)]) == 2
        assert "in use by another shiftguard process" in _error(capsys)
    finally:
        lock.release()


# --------------------------------------------------------------------------- what a report embeds
def _png(path, size=64):
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * size)
    return path


def test_only_a_regular_png_inside_the_folder_is_embedded(tmp_path):
    folder = tmp_path / "run"
    (folder / "plots").mkdir(parents=True)
    good = _png(folder / "plots" / "g.png")
    assert safe_png(good, folder) == good
    secret = tmp_path / "id_rsa"
    secret.write_text("-----BEGIN PRIVATE KEY-----")
    link = folder / "plots" / "link.png"
    link.symlink_to(secret)
    assert safe_png(link, folder) is None
    outside = _png(tmp_path / "outside.png")
    assert safe_png(outside, folder) is None
    text = folder / "plots" / "text.png"
    text.write_text("not a png")
    assert safe_png(text, folder) is None
    big = _png(folder / "plots" / "big.png", MAX_GALLERY_BYTES)
    assert safe_png(big, folder) is None


def test_a_linked_gallery_never_reaches_the_report(tmp_path, monkeypatch):
    import shiftguard.evaluation.plots as P

    for name in ("metric_vs_severity", "drop_heatmap", "reliability_diagrams"):
        monkeypatch.setattr(P, name, lambda *a, **k: None)
    secret = tmp_path / "key"
    secret.write_bytes(b"\x89PNG\r\n\x1a\n" + b"SECRET")
    out = tmp_path / "out"
    (out / "plots").mkdir(parents=True)
    (out / "plots" / "corruption_gallery.png").symlink_to(secret)
    results = {"rows": [], "data": {"severities": []}}
    assert "gallery" not in make_plots(out, results)
    run = tmp_path / "run"
    (run / "plots").mkdir(parents=True)
    (run / "plots" / "corruption_gallery.png").symlink_to(secret)
    plots = make_plots(tmp_path / "new", results, gallery=run / "plots" / "corruption_gallery.png")
    assert "gallery" not in plots
    assert not (tmp_path / "new" / "plots" / "corruption_gallery.png").exists()
