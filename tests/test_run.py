"""``shiftguard run``: a quick end-to-end run writes every artefact; user errors are one line."""

from __future__ import annotations

import csv
import json
import shutil

import pytest

from shiftguard.cli import main as cli


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One ``shiftguard run --quick`` shared by the tests of this file (~20-40 s on one core)."""
    out = tmp_path_factory.mktemp("runs")
    rc = cli(["run", "--quick", "--name", "q", "--out", str(out), "--no-progress"])
    assert rc == 0
    return out / "q"


def test_quick_run_writes_every_artefact(quick_run):
    for f in [
        "results.json",
        "results.csv",
        "report.html",
        "COMPLETE",
        "config.json",
        "plots/accuracy_vs_severity.png",
        "plots/ece_vs_severity.png",
        "plots/accuracy_drop_heatmap.png",
        "plots/reliability_diagrams.png",
        "plots/corruption_gallery.png",
        "models/lenet-relu-ce/model.pt",
        "models/lenet-relu-ce/metrics.jsonl",
    ]:
        assert (quick_run / f).is_file(), f


def test_results_json_has_every_cell_metric_and_provenance(quick_run):
    r = json.loads((quick_run / "results.json").read_text())
    assert r["status"] == "complete" and r["seed"] == 0
    assert {"torch", "numpy", "shiftguard", "python"} <= set(r["versions"])
    assert r["timings"]["total_s"] > 0 and r["config"]["models"]
    cells = {(x["model"], x["context"], x["head"], x["corruption"], x["severity"]) for x in r["rows"]}
    corr, sev = r["data"]["corruptions"], r["data"]["severities"]
    # ReLU model: every head x (clean + corruptions x severities)
    heads = r["config"]["models"][0]["heads"]
    assert len([c for c in cells if c[0] == "lenet-relu-ce"]) == len(heads) * (1 + len(corr) * len(sev))
    # QACT model: its batch context (the default run leaves the frozen one to eval.frozen_context); every
    # model static and with BatchNorm re-estimated, except the ReLU model, which has no BatchNorm
    assert {c[1] for c in cells if c[0] == "lenet-qact-watershed"} == {"batch"}
    arms = {(x["model"], x["adaptation"]) for x in r["rows"]}
    assert arms == {
        ("lenet-relu-ce", "none"),
        ("lenet-bnrelubn-ce", "none"),
        ("lenet-bnrelubn-ce", "bn"),
        ("lenet-qact-watershed", "none"),
        ("lenet-qact-watershed", "bn"),
    }
    assert [(s["model"], s["adaptation"]) for s in r["skipped_adaptations"]] == [("lenet-relu-ce", "bn")]
    assert next(a for a in r["adaptation"] if a["name"] == "bn")["images"] == r["data"]["n_test"]
    row = r["rows"][0]
    for k in ["accuracy", "ece_top_label", "ece_marginal", "nll", "r_auroc", "map_at_5", "recall_at_1"]:
        assert k in row
    assert 0.0 <= row["accuracy"] <= 1.0
    drops = [d for d in r["drops"] if d["from"] == 0 and d["to"] == max(sev)]
    assert drops and all(set(d["per_corruption"]) == set(corr) for d in drops)
    assert r["summary"] and r["reliability"]


def test_aggregates_are_means_over_corruptions(quick_run):
    r = json.loads((quick_run / "results.json").read_text())
    key = ("lenet-bnrelubn-ce", "none", "bn", "logistic")

    def of(x):
        return (x["model"], x["context"], x["adaptation"], x["head"]) == key

    a = next(x for x in r["aggregates"] if x["severity"] == 5 and of(x))
    accs = [x["accuracy"] for x in r["rows"] if x["severity"] == 5 and of(x)]
    assert len(accs) == len(r["data"]["corruptions"])
    assert a["accuracy_mean"] == pytest.approx(sum(accs) / len(accs))
    d = next(x for x in r["drops"] if of(x) and (x["from"], x["to"]) == (0, 5))
    clean = next(x["accuracy"] for x in r["rows"] if x["severity"] == 0 and of(x))
    assert d["drop_mean"] == pytest.approx(100 * (clean - a["accuracy_mean"]))


def test_csv_has_one_line_per_cell(quick_run):
    rows = list(csv.DictReader((quick_run / "results.csv").open()))
    r = json.loads((quick_run / "results.json").read_text())
    assert len(rows) == len(r["rows"]) and {"model", "head", "corruption", "severity", "accuracy"} <= set(rows[0])


def test_report_html_is_self_contained(quick_run):
    text = (quick_run / "report.html").read_text()
    assert "data:image/png;base64," in text and "<img" in text
    assert 'src="http' not in text and "lenet-qact-watershed" in text


def test_resume_of_a_finished_run_recomputes_nothing(quick_run, tmp_path, capsys):
    copy = tmp_path / "q"
    shutil.copytree(quick_run, copy)
    cache_files = {p: p.stat().st_mtime_ns for p in (copy / "cache").rglob("*.pt")}
    assert cli(["run", "--quick", "--name", "q", "--out", str(tmp_path), "--resume", "--no-progress"]) == 0
    assert all(p.stat().st_mtime_ns == t for p, t in cache_files.items())
    assert (copy / "COMPLETE").is_file()
    after = json.loads((copy / "results.json").read_text())
    assert after["status"] == "complete"


def test_existing_run_dir_without_resume_is_refused(quick_run, capsys):
    rc = cli(["run", "--quick", "--name", "q", "--out", str(quick_run.parent), "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already exists" in err[0] and "--resume" in err[0]


@pytest.mark.parametrize(
    "toml, message",
    [
        ("[train]\nepochz = 1\n", "unknown key train.'epochz'"),
        ("[[models]]\narch = 'alexnet'\n", "unknown model 'alexnet'"),
        ("[[models]]\narch = 'lenet'\nloss = 'nope'\n", "nope"),
        ("[[models]]\narch = 'lenet'\nheads = ['oracle']\n", "unknown head 'oracle'"),
        ("[data]\ndataset = 'cifar10'\nroot = '/nonexistent/x'\n[[models]]\narch = 'lenet'\n", "cifar10"),
    ],
)
def test_user_errors_end_with_one_line_and_exit_2(tmp_path, capsys, toml, message):
    p = tmp_path / "bad.toml"
    p.write_text(toml)
    rc = cli(
        ["run", "--config", str(p), "--out", str(tmp_path / "runs"), "--name", "x", "--no-progress", "--epochs", "1"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("shiftguard run: error:") and message in err[0]


def test_missing_config_file_and_bad_device(tmp_path, capsys):
    assert cli(["run", "--config", str(tmp_path / "none.toml")]) == 2
    assert "not found" in capsys.readouterr().err
    assert (
        cli(
            [
                "run",
                "--quick",
                "--device",
                "cuda:7" if not __import__("torch").cuda.is_available() else "nodevice",
                "--out",
                str(tmp_path),
            ]
        )
        == 2
    )
    assert "device" in capsys.readouterr().err


def test_resume_needs_an_existing_run(tmp_path, capsys):
    assert cli(["run", "--quick", "--resume", "--name", "nothere", "--out", str(tmp_path)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_shipped_configs_are_listed(capsys):
    assert cli(["run", "--list-configs"]) == 0
    assert "cifar10-c-resnet18" in capsys.readouterr().out


def test_score_retrieval_reads_the_recall_at_1_misses_off_its_own_search():
    import torch

    from shiftguard.evaluation.scoring import score_retrieval

    g = torch.Generator().manual_seed(3)
    y = torch.randint(0, 5, (400,), generator=g)
    emb = torch.randn(400, 8, generator=g) + torch.nn.functional.one_hot(y, 8).float()
    scores, miss = score_retrieval(emb, y, (1, 4))
    d = torch.cdist(emb.double(), emb.double())
    d.fill_diagonal_(float("inf"))
    assert torch.equal(miss, y[d.argmin(1)] != y)  # the 1-NN (itself excluded) has another class
    assert scores["recall_at_1"] == pytest.approx(1.0 - float(miss.double().mean()))
