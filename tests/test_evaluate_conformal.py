"""Conformal prediction sets inside ``shiftguard.evaluate``: every head calibrated on data it was not
fitted on, each cell's coverage and set size equal to the library's sets computed by hand, with the
adaptation arms, the weighted variant, the report, configs and the command line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shiftguard
from shiftguard.conformal import SplitConformal
from shiftguard.evaluation import ModelOutputs, compute_outputs
from shiftguard.evaluation.conformal import cell_uniform, split_validation
from shiftguard.heads import build_head
from shiftguard.metrics.conformal import coverage

FAST = dict(suite="mnist-c", corruptions=["fog"], severities=[3], n_boot=20, batch_size=40)


def _data(n=120, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 1, 8, 8), dtype=torch.uint8, generator=g), torch.arange(n) % 3


class _BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        return self.out(self.body(x))


def test_every_head_and_method_gets_coverage_and_set_size_in_every_row():
    x, y = _data()
    res = shiftguard.evaluate(
        _BNNet(),
        (x, y),
        support=(x, y),
        validation=(x, y),
        conformal=["lac", "aps", "raps"],
        heads=["softmax", "temperature", "knn"],
        adapt=["none", "bn"],
        **FAST,
    )
    for r in res.rows:
        for m in ("lac", "aps", "raps"):
            assert 0.0 <= r[f"coverage_{m}"] <= 1.0 and 0.0 <= r[f"set_size_{m}"] <= 3.0
    c = res.results["conformal"]
    assert c["methods"] == ["lac", "aps", "raps"] and c["target_coverage"] == pytest.approx(0.9)
    assert c["n_calibration"] == 60 and "half of validation" in c["calibration"]
    assert res.results["data"]["n_val"] == 60  # the other half fitted temperature scaling


def test_a_cells_coverage_is_the_librarys_sets_on_the_heads_probabilities():
    x, y = _data()
    cal_x, cal_y = _data(90, seed=3)
    net = _BNNet()
    res = shiftguard.evaluate(
        net, (x, y), support=(x, y), calibration=(cal_x, cal_y), conformal=["aps"], heads=["knn"], **FAST
    )
    outs = ModelOutputs(net)
    head = build_head("knn", 3).fit(compute_outputs(outs, x, 40)["embeddings"], y)
    probs_cal = head.predict_proba(compute_outputs(outs, cal_x, 40)["embeddings"])
    probs = head.predict_proba(compute_outputs(outs, x, 40)["embeddings"])  # the clean cell, index 0
    conf = SplitConformal("aps", 0.1, seed=0).fit(probs_cal, cal_y)
    sets = conf.predict_sets(probs, uniform=cell_uniform(120, 0, 0))
    clean = next(r for r in res.rows if r["severity"] == 0)
    assert clean["coverage_aps"] == coverage(sets, y)
    assert clean["set_size_aps"] == float(sets.sum(1).double().mean())


def test_the_weighted_variant_is_scored_beside_the_plain_one():
    x, y = _data()
    res = shiftguard.evaluate(
        _BNNet(), (x, y), validation=(x, y), conformal=["lac"], conformal_weighted=True, heads=["softmax"], **FAST
    )
    row = res.rows[-1]
    assert {"coverage_lac", "set_size_lac", "coverage_lac_weighted", "set_size_lac_weighted"} <= set(row)
    assert res.results["conformal"]["weighted"] is True


def test_the_validation_split_is_seeded_and_disjoint():
    x, y = _data(50)
    (a, ya), (b, yb) = split_validation((x, y), seed=4)
    assert a.shape[0] == 25 and b.shape[0] == 25
    rows = {tuple(t.flatten().tolist()) for t in a} & {tuple(t.flatten().tolist()) for t in b}
    assert not rows
    assert torch.equal(split_validation((x, y), seed=4)[0][0], a)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(conformal=["lac"]), "conformal: the prediction sets need calibration data"),
        (dict(conformal=["lac", "lac"], validation="data"), "conformal: a method is listed twice"),
        (dict(conformal=["thr"], validation="data"), "conformal: unknown method 'thr'"),
        (dict(conformal=["lac"], alpha=0.0, validation="data"), "alpha: expected a miscoverage level"),
        (dict(calibration="data"), "calibration: given without conformal methods"),
        (dict(conformal_weighted=True), "conformal_weighted: given without conformal methods"),
    ],
)
def test_bad_conformal_arguments_are_errors_naming_them(kwargs, match):
    x, y = _data()
    kwargs = {k: ((x, y) if isinstance(v, str) and v == "data" else v) for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=match):
        shiftguard.evaluate(_BNNet(), (x, y), heads=["softmax"], **kwargs, **FAST)


def test_the_report_shows_coverage_against_severity_and_a_table(tmp_path):
    x, y = _data()
    res = shiftguard.evaluate(_BNNet(), (x, y), validation=(x, y), conformal=["lac", "raps"], heads=["softmax"], **FAST)
    page = res.write_report(tmp_path).read_text(encoding="utf-8")
    assert (tmp_path / "plots" / "coverage_lac_vs_severity.png").is_file()
    assert (tmp_path / "plots" / "set_size_raps_vs_severity.png").is_file()
    assert "Conformal prediction sets" in page and "coverage s3" in page
    assert "LAC coverage (%) at severity 3, per corruption" in page and "RAPS coverage (%) at severity 3" in page


def test_run_configs_and_the_command_line_ask_for_conformal_sets():
    import argparse

    from shiftguard.commands import config as C
    from shiftguard.commands import run as R

    cfg = C.config_from_dict({"models": [{"arch": "lenet"}], "eval": {"conformal": ["aps"], "conformal_alpha": 0.05}})
    assert cfg.eval.conformal == ["aps"] and cfg.eval.conformal_alpha == 0.05
    with pytest.raises(ValueError, match="key eval.conformal: unknown method 'thr'"):
        C.config_from_dict({"models": [{"arch": "lenet"}], "eval": {"conformal": ["thr"]}})
    parser = argparse.ArgumentParser()
    R.add_arguments(parser)
    assert R.resolve_config(parser.parse_args(["--quick", "--conformal", "lac", "raps"])).eval.conformal == [
        "lac",
        "raps",
    ]
