"""The report of an evaluation (``shiftguard.evaluation.report``) and ``shiftguard report``: the tables
carry the right numbers in one unit, every value from results.json is escaped, the input runs are
never rewritten, comparisons show differences and protocol mismatches, older results still render."""

from __future__ import annotations

import copy
import hashlib
import json
from html.parser import HTMLParser
from pathlib import Path

import pytest

from shiftguard.cli import main as cli
from shiftguard.evaluation import plots as P
from shiftguard.evaluation import report as R

SCRIPT = "<script>alert(1)</script>"


# --------------------------------------------------------------------------- a synthetic results dict
def _row(model, ctx, head, corruption, severity, acc, group="benchmark"):
    return {
        "model": model,
        "context": ctx,
        "head": head,
        "corruption": corruption,
        "severity": severity,
        "n": 100,
        "group": group,
        "accuracy": acc,
        "ece_top_label": 0.02 + 0.01 * severity,
        "ece_marginal": 0.01,
        "nll": 0.3 + 0.1 * severity,
        "brier": 0.1 + 0.01 * severity,
        "aurc": 0.05,
        "r_auroc": 0.8,
        "auroc_error": 0.85,
        "mean_confidence": 0.9,
        "map_at_1": 0.9,
        "map_at_5": 0.8 - 0.05 * severity,
        "recall_at_1": 0.9,
        "recall_at_5": 0.95,
    }


HEADS = {("qact", "batch"): ["quantile", "knn"], ("relu", "none"): ["logistic", "softmax"]}
BASE = {"quantile": 0.90, "knn": 0.88, "logistic": 0.80, "softmax": 0.78}
# accuracy lost per (corruption, severity); speckle is an extra corruption, reported apart
LOSS = {
    ("noise", 1): 0.10,
    ("noise", 3): 0.30,
    ("blur", 1): 0.20,
    ("blur", 3): 0.40,
    ("speckle", 1): 0.05,
    ("speckle", 3): 0.15,
}


def make_results() -> dict:
    """Two models x two heads; benchmark corruptions noise, blur; extra speckle; severities 1 and 3."""
    rows, rel, ivs = [], [], []
    for (m, ctx), hs in HEADS.items():
        for h in hs:
            rows.append(_row(m, ctx, h, "clean", 0, BASE[h]))
            for (c, s), d in LOSS.items():
                rows.append(_row(m, ctx, h, c, s, round(BASE[h] - d, 6), "extra" if c == "speckle" else "benchmark"))
            for s in (0, 3):  # the first bin is empty, the second holds only errors
                rel.append(
                    {
                        "model": m,
                        "context": ctx,
                        "head": h,
                        "severity": s,
                        "edges": [0.0, 0.25, 0.5, 0.75, 1.0],
                        "confidence": [None, 0.4, 0.6, 0.9],
                        "accuracy": [None, 0.0, 0.5, 0.95],
                        "count": [0, 10, 20, 70],
                    }
                )
            ivs.append(
                {
                    "model": m,
                    "context": ctx,
                    "head": h,
                    "metric": "accuracy_clean",
                    "estimate": BASE[h],
                    "lo": BASE[h] - 0.02,
                    "hi": BASE[h] + 0.02,
                }
            )
    return {
        "kind": "run",
        "status": "complete",
        "name": "synthetic",
        "created": "2025-01-01T00:00:00+00:00",
        "config": {
            "eval": {"batch_size": 256, "ece_bins": 4},
            "models": [
                {"name": "qact", "heads": ["quantile", "knn"]},
                {"name": "relu", "heads": ["logistic", "softmax"]},
            ],
        },
        "config_source": "synthetic.toml",
        "seed": 7,
        "device": "cpu",
        "versions": {"shiftguard": "0"},
        "command": "shiftguard run",
        "data": {
            "dataset": "toy",
            "n_train": 1000,
            "n_val": 100,
            "n_test": 100,
            "num_classes": 10,
            "corruptions": ["noise", "blur"],
            "severities": [1, 3],
            "corruption_source": "engine",
            "suite": "toy-c",
            "extra_corruptions": ["speckle"],
        },
        "training": {"qact": {"parameters": 1234, "epochs_run": 2, "best_epoch": 1, "best_val_acc": 0.9}},
        "timings": {"train_s": {"qact": 1.5}, "evaluate_s": 2.0, "total_s": 4.0},
        "rows": rows,
        "aggregates": [],
        "drops": [],
        "reliability": rel,
        "models": [
            {"name": "qact", "heads": ["quantile", "knn"], "primary_head": "quantile", "contexts": ["batch"]},
            {"name": "relu", "heads": ["logistic", "softmax"], "primary_head": "logistic", "contexts": ["none"]},
        ],
        "robustness": [
            {
                "model": "qact",
                "context": "batch",
                "head": "quantile",
                "mca": 0.65,
                "mca_extra": 0.8,
                "corrupted_accuracy": 0.65,
                "corrupted_nll": 0.5,
                "corrupted_ece": 0.04,
                "mce": 0.75,
                "relative_mce": 0.5,
                "ce": {"noise": 0.7, "blur": 0.8},
                "relative_ce": {"noise": 0.4, "blur": 0.6},
                "baseline": "relu-baseline",
            }
        ],
        "intervals": ivs,
        "interval_info": {"level": 0.95, "n_boot": 1000, "seed": 0, "method": "percentile bootstrap over test images"},
        "skipped_heads": [{"model": "relu", "head": "ned", "reason": "no validation split"}],
    }


class _Tables(HTMLParser):
    """Every <table> of a page as a list of rows of cell texts (header row first)."""

    def __init__(self):
        super().__init__()
        self.tables, self._cell = [], None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = ""

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.tables[-1][-1].append(self._cell)
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data


def tables(page: str) -> list[list[list[str]]]:
    p = _Tables()
    p.feed(page)
    return p.tables


def table_with(page: str, header: str) -> dict[tuple, dict[str, str]]:
    """The first table whose header has ``header``: {(first three cells): {column: cell}}."""
    t = next(t for t in tables(page) if header in t[0])
    return {tuple(r[:3]): dict(zip(t[0], r)) for r in t[1:]}


def sha_tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def write_run(d: Path, results: dict) -> Path:
    """A finished run directory as ``shiftguard run`` leaves it (the parts ``shiftguard report`` reads)."""
    (d / "plots").mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"config": results["config"], "source": "synthetic.toml"}))
    (d / "results.json").write_text(json.dumps(results))
    (d / "plots" / "corruption_gallery.png").write_bytes(b"\x89PNG\r\n\x1a\n gallery")  # the PNG signature
    (d / "COMPLETE").write_text("done\n")
    return d


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("report")
    return R.build_report(out, make_results()).read_text(encoding="utf-8")


# --------------------------------------------------------------------------- the page's numbers
def test_summary_shows_intervals_means_and_drops_in_percent(page):
    t = table_with(page, "acc clean")
    q = t[("qact", "batch", "quantile")]
    assert q["acc clean"] == "90.0 [88.0, 92.0]"
    assert q["acc corrupted"] == "65.0"  # from robustness
    assert q["acc extra corruptions"] == "80.0"
    assert q["acc s3"] == "55.0 ± 5.0" and q["drop 0→3"] == "35.0 ± 5.0"
    assert q["ECE clean"] == "2.0" and q["ECE corrupted"] == "4.0" and q["NLL clean"] == "0.300"
    # without a robustness entry: the mean over the benchmark corrupted cells, the extra corruption left out
    assert t[("relu", "none", "logistic")]["acc corrupted"] == "55.0"
    u = table_with(page, "R-AUROC clean")[("relu", "none", "logistic")]
    assert u["R-AUROC clean"] == "80.0" and u["error-AUROC corrupted"] == "85.0"
    assert u["Brier clean"] == "0.1000" and u["MAP@5 corrupted"] == "70.0"


def test_page_says_what_the_interval_and_the_plus_minus_are(page):
    assert "95% confidence interval, percentile bootstrap over test images, 1000 resamples, seed 0" in page
    assert "<b>a ± b</b> is the mean and the standard deviation (ddof = 0) over the benchmark corruptions" in page
    assert "in %; NLL and Brier score are plain numbers" in page


def test_per_corruption_table_has_the_mean_over_severities_and_the_highest_one(page):
    t = next(t for t in tables(page) if t[0][0] == "corruption" and "qact [batch] / quantile: s3" in t[0])
    rows = {r[0]: dict(zip(t[0], r)) for r in t[1:]}
    assert rows["noise"]["qact [batch] / quantile: mean s1–3"] == "70.0"
    assert rows["noise"]["qact [batch] / quantile: s3"] == "60.0"
    assert rows["blur"]["relu / logistic: s3"] == "40.0"
    assert rows["mean (benchmark corruptions)"]["qact [batch] / quantile: mean s1–3"] == "65.0"
    assert rows["speckle (extra)"]["qact [batch] / quantile: s3"] == "75.0"


def test_per_severity_table_has_mean_and_std_over_corruptions(page):
    t = table_with(page, "s1")
    assert t[("relu", "none", "logistic")]["clean"] == "80.0"
    assert t[("relu", "none", "logistic")]["s1"] == "65.0 ± 5.0"
    assert t[("qact", "batch", "knn")]["s3"] == "53.0 ± 5.0"


def test_mce_table_names_the_baseline_and_lists_ce_per_corruption(page):
    t = table_with(page, "relative mCE")[("qact", "batch", "quantile")]
    assert t["baseline"] == "relu-baseline" and t["mCE"] == "75.0" and t["relative mCE"] == "50.0"
    assert "relative to the baseline relu-baseline" in page
    ce = next(t for t in tables(page) if "qact [batch] / quantile: CE" in t[0])
    assert dict(zip(ce[0], ce[1])) == {
        "corruption": "noise",
        "qact [batch] / quantile: CE": "70.0",
        "qact [batch] / quantile: relative CE": "40.0",
    }


def test_skipped_heads_are_listed_with_their_reason(page):
    skipped = next(t for t in tables(page) if t[0] == ["model", "head", "reason"])
    assert ["relu", "ned", "no validation split"] in skipped


def test_every_value_from_results_json_is_escaped(tmp_path):
    res = make_results()
    res["name"] = res["seed"] = res["config_source"] = res["created"] = SCRIPT
    res["config"]["eval"]["batch_size"] = SCRIPT
    res["interval_info"]["method"] = SCRIPT
    res["skipped_heads"][0]["reason"] = SCRIPT
    evil_model, evil_corr = SCRIPT + '"', SCRIPT + "$"  # "$" would start matplotlib mathtext
    for part in (res["rows"], res["reliability"], res["intervals"], res["robustness"], res["models"]):
        for r in part:
            if r.get("model", r.get("name")) == "qact":
                r["model" if "model" in r else "name"] = evil_model
            if r.get("corruption") == "noise":
                r["corruption"] = evil_corr
    res["data"]["corruptions"][0] = evil_corr
    res["robustness"][0]["ce"] = {evil_corr: 0.7}
    res["rows"][3]["accuracy"] = SCRIPT  # a string where a number belongs
    page = R.build_report(tmp_path, res).read_text(encoding="utf-8")
    assert "<script" not in page.lower()
    assert page.count("&lt;script&gt;") >= 10
    assert "results.json has values that are not numbers" in page and "rows[3].accuracy" in page


# --------------------------------------------------------------------------- older results
def _old_results() -> dict:
    """results.json as written before kind, models, robustness, intervals and extra corruptions."""
    res = make_results()
    for k in ("kind", "models", "robustness", "intervals", "interval_info", "skipped_heads"):
        del res[k]
    del res["data"]["suite"], res["data"]["extra_corruptions"]
    res["rows"] = [r for r in res["rows"] if r["corruption"] != "speckle"]
    for r in res["rows"]:
        del r["group"], r["brier"], r["aurc"]
    return res


def test_old_results_without_the_new_keys_still_render(tmp_path):
    page = R.build_report(tmp_path, _old_results()).read_text(encoding="utf-8")
    q = table_with(page, "acc clean")[("qact", "batch", "quantile")]
    assert q["acc clean"] == "90.0" and q["acc corrupted"] == "65.0"
    assert "Robustness" not in page and "Skipped heads" not in page and "x [lo, hi]" not in page
    assert "Brier clean" not in page
    per_corr = next(t for t in tables(page) if t[0][0] == "corruption")
    assert [r[0] for r in per_corr[1:]] == ["noise", "blur", "mean (benchmark corruptions)"]


def test_primary_heads_come_from_models_then_config_then_rows():
    res = make_results()
    # (model, context, adaptation, head); results without adaptation arms read as the static arm
    expected = [("qact", "batch", "none", "quantile"), ("relu", "none", "none", "logistic")]
    assert P.primary_keys(res) == expected
    res["models"][0]["primary_head"] = "knn"
    assert P.primary_keys(res)[0] == ("qact", "batch", "none", "knn")
    # results that do not record their primary heads get evaluate.primary_head's rule: the model's
    # own softmax first
    own = [("qact", "batch", "none", "quantile"), ("relu", "none", "none", "softmax")]
    old = _old_results()
    assert P.primary_keys(old) == own
    old["config"] = None  # `shiftguard evaluate` results have no config
    assert P.primary_keys(old) == own


# --------------------------------------------------------------------------- figures
class _Capture:
    """Stands in for ``save_png``: keeps the figure to be inspected."""

    def __init__(self):
        self.figs = []

    def __call__(self, fig, path):
        self.figs.append(fig)
        return path


def test_reliability_diagram_draws_no_bar_for_an_empty_bin(monkeypatch, tmp_path):
    cap = _Capture()
    monkeypatch.setattr(P, "save_png", cap)
    P.reliability_diagrams(make_results(), tmp_path / "r.png")
    fig = cap.figs[0]
    acc_ax, count_ax = fig.subfigs[0].axes
    bars = [p for p in acc_ax.patches]
    assert bars and min(b.get_x() for b in bars) >= 25.0  # bin [0, 25) is empty: nothing drawn there
    assert any(b.get_x() == 25.0 and b.get_height() == 0.0 for b in bars)  # a bin that is all errors is drawn
    assert sorted({round(b.get_height()) for b in count_ax.patches}) == [10, 20, 70]
    assert count_ax.get_yscale() == "log"
    P.pyplot().close("all")


def test_reliability_diagram_file_is_written_with_an_empty_bin(tmp_path):
    path = P.reliability_diagrams(make_results(), tmp_path / "r.png")
    assert path.read_bytes()[:4] == b"\x89PNG"


def _spread_results() -> dict:
    """One head, three corruptions at severity 1 whose accuracies / ECEs spread beyond [0, 1] +/- std."""
    rows = [{**_row("m", "none", "logistic", "clean", 0, 1.0), "ece_top_label": 0.0}]
    for c, acc, ece in (("a", 1.0, 0.0), ("b", 1.0, 0.0), ("c", 0.4, 0.6)):
        rows.append({**_row("m", "none", "logistic", c, 1, acc), "ece_top_label": ece})
    return {
        "name": "spread",
        "data": {"dataset": "toy", "corruptions": ["a", "b", "c"], "severities": [1], "corruption_source": "engine"},
        "rows": rows,
        "reliability": [],
        "config": None,
    }


@pytest.mark.parametrize("metric", ["accuracy", "ece_top_label"])
def test_std_bands_stay_inside_the_metric_range_in_percent(monkeypatch, tmp_path, metric):
    cap = _Capture()
    monkeypatch.setattr(P, "save_png", cap)
    P.metric_vs_severity(_spread_results(), metric, tmp_path / "x.png")
    ax = cap.figs[0].axes[0]
    ys = [y for coll in ax.collections for path in coll.get_paths() for _, y in path.vertices]
    line = ax.lines[0].get_ydata()
    assert max(line) <= 100 and (max(line) > 1 if metric == "accuracy" else max(line) == pytest.approx(20.0))
    assert ys and 0.0 <= min(ys) and max(ys) <= 100.0
    assert (max(ys) == pytest.approx(100.0)) if metric == "accuracy" else (min(ys) == pytest.approx(0.0))
    P.pyplot().close("all")


# --------------------------------------------------------------------------- comparison
def _shifted(res: dict, by: float) -> dict:
    """A copy whose quantile head is ``by`` more accurate in every cell (and in its robustness entry)."""
    out = copy.deepcopy(res)
    out["name"] = "better"
    for r in out["rows"]:
        if r["head"] == "quantile":
            r["accuracy"] = round(r["accuracy"] + by, 6)
    rob = out["robustness"][0]
    rob["mca"] = rob["corrupted_accuracy"] = rob["mca"] + by
    rob["mce"] = 0.70
    return out


def test_delta_rows_subtract_the_first_runs_headline_numbers():
    a = make_results()
    deltas = {(r["model"], r["head"]): r for r in R.delta_rows([a, _shifted(a, 0.05)])}
    q = deltas[("qact", "quantile")]
    assert q["reference"] == "qact [batch] / quantile"
    assert q["d_acc_clean"] == pytest.approx(5.0) and q["d_mca"] == pytest.approx(5.0)
    assert q["d_drop"] == pytest.approx(0.0) and q["d_mce"] == pytest.approx(-5.0)
    assert deltas[("relu", "logistic")]["d_acc_clean"] == pytest.approx(0.0)


def test_protocol_warning_appears_only_when_protocols_differ():
    a = make_results()
    same = R.render_comparison([a, _shifted(a, 0.05)], {})
    assert "do not share one protocol" not in same and "Every run has the same protocol" in same
    other = copy.deepcopy(a)
    other["data"]["n_test"], other["seed"] = 50, 8
    assert [d[0] for d in R.protocol_differences([a, other])] == ["n_test", "seed"]
    page = R.render_comparison([a, other], {})
    assert "do not share one protocol" in page and "<b>n_test</b>" in page and "<b>seed</b>" in page
    assert "<b>severities</b>" not in page


# --------------------------------------------------------------------------- the command
def test_report_of_one_run_goes_to_a_new_folder_and_leaves_the_run_untouched(tmp_path, capsys):
    run = write_run(tmp_path / "r", make_results())
    before = sha_tree(run)
    assert cli(["report", str(run)]) == 0
    assert sha_tree(run) == before
    (out,) = [p for p in tmp_path.iterdir() if p.name.startswith("r-report-")]
    page = (out / "report.html").read_text(encoding="utf-8")
    assert "90.0 [88.0, 92.0]" in page and str(run / "results.json") in page
    assert (out / "results.csv").is_file() and (out / "plots" / "corruption_gallery.png").is_file()
    assert "drop 0→3" in capsys.readouterr().out


def test_report_refuses_to_write_into_an_input_run_or_a_used_folder(tmp_path, capsys):
    run = write_run(tmp_path / "r", make_results())
    assert cli(["report", str(run), "--out", str(run / "plots")]) == 2
    assert "inside the input run" in capsys.readouterr().err
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("x")
    assert cli(["report", str(run), "--out", str(tmp_path / "used")]) == 2
    assert "not an empty folder" in capsys.readouterr().err


def test_report_compares_several_runs_on_the_same_axes(tmp_path):
    a = write_run(tmp_path / "a", make_results())
    other = _shifted(make_results(), 0.05)
    other["data"]["n_test"] = 50
    b = write_run(tmp_path / "b", other)
    before = sha_tree(tmp_path)
    assert cli(["report", str(a), str(b), "--out", str(tmp_path / "cmp")]) == 0
    assert {k: v for k, v in sha_tree(tmp_path).items() if not k.startswith("cmp")} == before
    page = (tmp_path / "cmp" / "report.html").read_text(encoding="utf-8")
    assert page.count("data:image/png;base64,") == 2 and "do not share one protocol" in page
    d = table_with(page, "Δ acc clean (points)")[("better", "qact", "batch")]
    assert d["Δ acc clean (points)"] == "+5.0" and d["Δ mCE (points)"] == "-5.0"
    assert (tmp_path / "cmp" / "comparison.csv").read_text().count("\n") == 3


# --------------------------------------------------------------------------- refused inputs
def test_report_refuses_a_run_without_complete_marker(tmp_path, capsys):
    d = write_run(tmp_path / "half", make_results())
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


def test_report_refuses_a_corrupt_results_file(tmp_path, capsys):
    d = write_run(tmp_path / "bad", make_results())
    (d / "results.json").write_text("{ truncated")
    assert cli(["report", str(d)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
