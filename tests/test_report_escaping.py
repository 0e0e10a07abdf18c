"""The HTML report writes every value it reads from ``results.json`` escaped: a ``<script>`` (or a
quote that would close an attribute) placed in any string field, in any number field, or in a key
the page shows, appears as text on the page and never as markup. Covers the single-run page
(``build_report`` / ``render_html``), the comparison page and ``shiftguard report``, whose input
path is shown on the page too."""

from __future__ import annotations

import copy
import html
import json
from pathlib import Path

import pytest
from test_report import make_results

from shiftguard.cli import main as cli
from shiftguard.evaluation import report as R

#: Values with a meaning to the report (which rows are clean, benchmark or extra, which context a
#: row has, which interval a cell shows): poisoned one at a time below, and kept when every other
#: string is poisoned at once, so the page still has all its tables.
KEYWORDS = {
    "clean",
    "benchmark",
    "extra",
    "none",
    "batch",
    "frozen",
    "run",
    "complete",
    "accuracy_clean",
    "ece_clean",
    "ece_corrupted",
}


def payload(tag: str) -> str:
    """Script, attribute-breaking quotes and an event handler, marked with ``tag``."""
    return f"\"'><script>alert('{tag}')</script><img src=x onerror=alert('{tag}')>"


def assert_no_markup_from_values(page: str) -> None:
    low = page.lower()
    assert "<script" not in low and "<img src=x" not in low and "\"'>" not in page


def rich_results() -> dict:
    res = make_results()
    res["versions"] = {"shiftguard": "0", "torch": "2", "python": "3"}
    res["interval_info"]["metrics"] = {"accuracy_clean": "share of correct test images"}
    res["config"]["eval"]["seed"] = 3
    return res


def _rename_strings(o, f):
    """Every string value through ``f`` (dict keys left alone), except the KEYWORDS."""
    if isinstance(o, dict):
        return {k: _rename_strings(v, f) for k, v in o.items()}
    if isinstance(o, list):
        return [_rename_strings(v, f) for v in o]
    return f(o) if isinstance(o, str) and o not in KEYWORDS else o


# Displayed numbers: (path, how the page may print the payload put there)
NUMBER_FIELDS = [
    ("seed",),
    ("data", "n_train"),
    ("data", "n_val"),
    ("data", "n_test"),
    ("config", "eval", "batch_size"),
    ("config", "eval", "ece_bins"),
    ("timings", "total_s"),
    ("timings", "evaluate_s"),
    ("timings", "train_s", "qact"),
    ("training", "qact", "parameters"),
    ("training", "qact", "epochs_run"),
    ("training", "qact", "best_epoch"),
    ("training", "qact", "best_val_acc"),
    ("interval_info", "level"),
    ("interval_info", "n_boot"),
    ("interval_info", "seed"),
]


def _set(d: dict, path: tuple, value) -> None:
    for p in path[:-1]:
        d = d[p]
    d[path[-1]] = value


def poisoned() -> tuple[dict, list[str]]:
    """A results dict with a payload in every string field (the labels renamed the same way
    everywhere, so rows, models, intervals and reliability still match), in every key the page
    shows (model names of training and timings, per-corruption CE, versions, interval metrics) and in
    every number the page shows as it is; and the payloads that must be on the page, escaped."""
    res = _rename_strings(rich_results(), lambda s: s + payload(s))
    shown = [
        payload(s)
        for s in (
            "synthetic",
            "synthetic.toml",
            "shiftguard run",
            "cpu",
            "toy",
            "toy-c",
            "engine",
            "no validation split",
            "percentile bootstrap over test images",
            "share of correct test images",
            "qact",
            "logistic",
            "noise",
            "speckle",
            "relu-baseline",
            "2025-01-01T00:00:00+00:00",
        )
    ]
    qact = "qact" + payload("qact")
    res["training"] = {qact: res["training"]["qact"]}
    res["timings"]["train_s"] = {qact: res["timings"]["train_s"]["qact"]}
    rob = res["robustness"][0]
    rob["ce"] = {k + payload("ce-key"): v for k, v in rob["ce"].items()}
    res["versions"] = {k + payload("version-key"): v for k, v in res["versions"].items()}
    res["interval_info"]["metrics"] = {k + payload("metric-key"): v for k, v in res["interval_info"]["metrics"].items()}
    shown += [payload("ce-key"), payload("version-key"), payload("metric-key")]
    for path in NUMBER_FIELDS:
        tag = "/".join(path)
        path = tuple(qact if p == "qact" and path[0] in ("training", "timings") else p for p in path)
        _set(res, path, payload(tag))
        shown.append(payload(tag))
    return res, shown


def test_every_string_number_and_key_from_results_json_is_escaped_on_the_page(tmp_path):
    res, shown = poisoned()
    page = R.build_report(tmp_path, res).read_text(encoding="utf-8")
    assert_no_markup_from_values(page)
    missing = [p for p in shown if html.escape(p, quote=True) not in page]
    assert not missing, missing  # each reached the page, as text
    # the tables still render with the poisoned labels
    assert "Robustness" in page and "Confidence intervals" in page and "Skipped heads" in page


def _leaves(o, path=()):
    if isinstance(o, dict):
        for k, v in o.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(o, list):
        for i, v in enumerate(o):
            yield from _leaves(v, path + (i,))
    else:
        yield path, o


def _dicts(o, path=()):
    if isinstance(o, dict):
        yield path, o
        for k, v in o.items():
            yield from _dicts(v, path + (k,))
    elif isinstance(o, list):
        for i, v in enumerate(o):
            yield from _dicts(v, path + (i,))


def _sampled(path: tuple) -> bool:
    """Within each list of results (rows, reliability, intervals), the first head's entries (its clean,
    benchmark and extra rows) stand for the other heads', which have the same fields."""
    return not (len(path) > 1 and isinstance(path[1], int) and path[1] >= 7)


def test_a_payload_in_any_single_value_or_key_is_escaped():
    """Each leaf of the results dict in turn (strings, numbers, null, booleans, keywords included) and
    each key in turn holds a payload; the page is built and has no markup from it. A value the report
    cannot order (a string among the severities) or a key it needs (``rows[i].model``) is refused
    with an exception instead, and no page is made."""
    base = rich_results()
    refused = []
    for path, value in _leaves(base):
        if not _sampled(path):
            continue
        res = copy.deepcopy(base)
        _set(res, path, payload(repr(value)))
        try:
            page = R.render_html(res, {})
        except (TypeError, KeyError):
            refused.append(path)
            continue
        assert_no_markup_from_values(page)
    assert all(p[:2] == ("data", "severities") for p in refused), refused
    for path, d in _dicts(base):
        if not _sampled(path):
            continue
        for key in list(d):
            res = copy.deepcopy(base)
            target = res
            for p in path:
                target = target[p]
            target[key + payload(key)] = target.pop(key)
            try:
                page = R.render_html(res, {})
            except KeyError:
                continue  # a key the report needs: refused by name
            assert_no_markup_from_values(page)


def test_the_comparison_page_escapes_every_value(tmp_path):
    a, shown = poisoned()
    b = copy.deepcopy(a)
    b["name"] = "other" + payload("other")
    b["seed"] = payload("seed of b")  # a protocol difference: listed in the warning
    page = R.build_comparison(tmp_path, [a, b], sources=["x" + payload("src-a"), "y" + payload("src-b")])
    page = page.read_text(encoding="utf-8")
    assert_no_markup_from_values(page)
    for p in (payload("seed of b"), payload("src-a"), payload("synthetic"), payload("toy")):
        assert html.escape(p, quote=True) in page


def test_shiftguard_report_escapes_the_results_and_the_run_path(tmp_path, capsys):
    run = tmp_path / "run<script>alert(1)</script>"
    (run / "plots").mkdir(parents=True)
    res, shown = poisoned()
    (run / "config.json").write_text(json.dumps({"config": {}, "source": "synthetic.toml"}))
    (run / "results.json").write_text(json.dumps(res))
    (run / "COMPLETE").write_text("done\n")
    out = tmp_path / "out"
    assert cli(["report", str(run), "--out", str(out)]) == 0
    page = (out / "report.html").read_text(encoding="utf-8")
    assert_no_markup_from_values(page)
    assert html.escape(str(Path(run) / "results.json"), quote=True) in page
    assert html.escape(payload("seed"), quote=True) in page
    capsys.readouterr()


@pytest.mark.parametrize("where", ["name", "model"])
def test_an_html_comment_or_style_breakout_is_escaped_too(where):
    res = make_results()
    evil = "--><style>*{display:none}</style><!--"
    if where == "name":
        res["name"] = evil
    else:
        for part in (res["rows"], res["reliability"], res["intervals"], res["robustness"]):
            for r in part:
                if r.get("model") == "relu":
                    r["model"] = evil
    page = R.render_html(res, {})
    assert "<style>*" not in page and "<!--" not in page and html.escape(evil, quote=True) in page
