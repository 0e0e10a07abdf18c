"""Any two evaluations compare, and an evaluation's record repeats it.

``EvaluationResult.compare`` and ``shiftguard report A B`` take ``shiftguard run`` and ``shiftguard
evaluate`` outputs in any mix; series are matched by one documented rule (full key; else the only
model of each side, a model without QACT against every context of the other; or explicit pairs);
a comparison that matches nothing is an error listing both sides; the differences carry paired
bootstrap intervals only where both sides scored the same test images. ``results.json`` of
``shiftguard evaluate`` holds the whole command, the weights' SHA-256, the preprocessing, the sizes
named for what they are and the versions ``shiftguard run`` records, and the report shows no field
that does not apply."""

from __future__ import annotations

import copy
import hashlib
import json
import shlex
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from _evaluate_helpers import quadrant_data as _data
from torch import nn

import shiftguard
from shiftguard.cli import main as cli
from shiftguard.evaluation import EvaluationResult
from shiftguard.nn import convert_activations

pytestmark = pytest.mark.usefixtures("torch_one_thread")

FAST = dict(corruptions=["fog"], severities=[2], n_boot=50, heads=["softmax", "knn"])


class TinyCNN(nn.Module):
    """A user's model whose activations are modules, so that it converts to QACT."""

    def __init__(self, num_classes: int = 3):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten())
        self.hidden = nn.Sequential(nn.Linear(64, 12), nn.ReLU())
        self.out = nn.Linear(12, num_classes)

    def forward(self, x):
        return self.out(self.hidden(self.features(x)))


def _trained(steps: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    m = TinyCNN()
    x, y = _data(300, seed=1)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = F.cross_entropy(m(x.float() / 255), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m.eval()


@pytest.fixture(scope="module")
def nets():
    relu = _trained(40)
    qact = convert_activations(copy.deepcopy(relu), "qact", example_input=torch.rand(4, 1, 16, 16)).eval()
    return {"relu": relu, "qact": qact, "weak": _trained(3, seed=1)}


@pytest.fixture(scope="module")
def evaluated(nets):
    """The same test and support images scored for a ReLU model, its QACT conversion and a weaker model."""
    test, support = _data(), _data(60, seed=3)
    return {name: shiftguard.evaluate({name: nets[name]}, test, support=support, **FAST) for name in nets}


# --------------------------------------------------------------------------- matching
def test_a_relu_model_and_its_qact_conversion_are_matched_and_the_rule_is_named(evaluated):
    out = evaluated["relu"].compare(evaluated["qact"])
    pairs = {(d["head"], d["other"]["model"], d["other"]["context"]) for d in out["deltas"]}
    # the ReLU model's single context "none" stands against both QACT contexts, head by head
    assert pairs == {(h, "qact", c) for h in ("softmax", "knn") for c in ("batch", "frozen")}
    assert all(d["model"] == "relu" and d["context"] == "none" for d in out["deltas"])
    assert "only model of each side" in out["match"]
    assert evaluated["relu"].compare(evaluated["relu"])["match"].startswith("the full series key")


def test_explicit_pairs_map_this_sides_model_names_to_the_others(evaluated, nets):
    both = shiftguard.evaluate({"a": nets["weak"], "b": nets["relu"]}, _data(), support=_data(60, seed=3), **FAST)
    out = evaluated["relu"].compare(both, pairs={"relu": "b"})
    assert {d["other"]["model"] for d in out["deltas"]} == {"b"}
    acc = next(d for d in out["deltas"] if d["head"] == "softmax")["accuracy_clean"]
    assert acc[2] == pytest.approx(0.0)  # the same network under another name
    assert out["match"] == "models paired as given (relu -> b)"
    with pytest.raises(ValueError, match=r"^pairs: 'c' is not a model of the other"):
        evaluated["relu"].compare(both, pairs={"relu": "c"})


def test_a_comparison_that_matches_nothing_lists_the_series_of_each_side(evaluated, nets):
    two = shiftguard.evaluate({"x": nets["weak"], "y": nets["relu"]}, _data(), support=_data(60, seed=3), **FAST)
    with pytest.raises(ValueError) as info:
        evaluated["relu"].compare(two)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("pairs: no series")
    assert "relu/none/softmax" in msg and "x/none/knn" in msg and "y/none/softmax" in msg


# --------------------------------------------------------------------------- intervals
def test_paired_intervals_are_given_on_the_same_test_images(evaluated):
    out = evaluated["relu"].compare(evaluated["weak"])
    assert out["intervals"]["clean"] is None and out["intervals"]["corrupted"] is None
    soft = next(d for d in out["deltas"] if d["head"] == "softmax")
    for metric in ("accuracy_clean", "mca"):
        lo, hi = soft["intervals"][metric]
        assert lo <= soft[metric][2] <= hi and lo < soft[metric][2] < hi
    # paired: a model against itself differs on no image, so the interval has no width
    same = evaluated["relu"].compare(evaluated["relu"])
    assert all(d["intervals"] == {"accuracy_clean": (0.0, 0.0), "mca": (0.0, 0.0)} for d in same["deltas"])


def test_no_interval_is_invented_when_the_images_differ(evaluated, nets):
    other_images = shiftguard.evaluate({"relu": nets["weak"]}, _data(seed=5), support=_data(60, seed=3), **FAST)
    out = evaluated["relu"].compare(other_images)
    assert all(d["intervals"] == {} for d in out["deltas"])
    assert "test images differ" in out["intervals"]["clean"]
    other_cells = shiftguard.evaluate(
        {"relu": nets["weak"]}, _data(), support=_data(60, seed=3), **{**FAST, "severities": [3]}
    )
    out = evaluated["relu"].compare(other_cells)
    assert out["intervals"]["clean"] is None and "different corruption" in out["intervals"]["corrupted"]
    assert all(set(d["intervals"]) == {"accuracy_clean"} for d in out["deltas"])


# --------------------------------------------------------------------------- the record of the Python API
def test_the_api_records_sizes_for_what_they_are_and_the_preprocessing(nets):
    def scale(x):
        return x * 2.0 - 1.0

    res = shiftguard.evaluate({"relu": nets["relu"]}, _data(), support=_data(60, seed=3), preprocess=scale, **FAST)
    d = res.results["data"]
    assert d["n_support"] == 60 and d["n_train"] is None and d["n_test"] == 90
    assert res.results["config"]["preprocess"].endswith(
        "test_the_api_records_sizes_for_what_they_are_and_the_preprocessing.<locals>.scale"
    )
    assert "training" not in res.results and "train_s" not in res.results["timings"]


# --------------------------------------------------------------------------- the command line
FACTORY = """
import torch
from torch import nn


def make_net(num_classes):
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 8), nn.ReLU(), nn.Linear(8, num_classes))


def make_qact(num_classes):
    from shiftguard.nn import convert_activations

    return convert_activations(make_net(num_classes), "qact", example_input=torch.rand(2, 1, 28, 28))
"""


@pytest.fixture
def cli_env(tmp_path, monkeypatch):
    (tmp_path / "cmpnets.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("cmpnets", None)
    weights = tmp_path / "net.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(1)
        net = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 8), nn.ReLU(), nn.Linear(8, 10))
    torch.save(net.state_dict(), weights)
    common = [
        "--test-subset",
        "60",
        "--support-size",
        "120",
        "--val-size",
        "0",
        "--corruptions",
        "fog",
        "--severities",
        "2",
        "--n-boot",
        "20",
        "--no-progress",
        "--heads",
        "softmax",
    ]
    return tmp_path, weights, common


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_the_evaluate_record_repeats_the_command(cli_env):
    tmp_path, weights, common = cli_env
    out = tmp_path / "ev"
    assert (
        cli(
            [
                "evaluate",
                "--model",
                "cmpnets:make_net",
                "--weights",
                str(weights),
                "--dataset",
                "mnist-default",
                "--normalize",
                "0.1307",
                "0.3081",
                *common,
                "--out",
                str(out),
            ]
        )
        == 0
    )
    res = json.loads((out / "results.json").read_text())
    words = shlex.split(res["command"])
    for flag, value in (
        ("--weights", str(weights)),
        ("--dataset", "mnist-default"),
        ("--test-subset", "60"),
        ("--support-size", "120"),
        ("--heads", "softmax"),
        ("--corruptions", "fog"),
        ("--batch-size", "500"),
        ("--seed", "0"),
    ):
        assert words[words.index(flag) + 1] == value, flag
    assert words[words.index("--normalize") + 1 : words.index("--normalize") + 3] == ["0.1307", "0.3081"]
    rec = res["record"]
    assert rec["weights"]["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert rec["normalize"] == {"mean": [0.1307], "std": [0.3081]}
    assert "normalize(mean=[0.1307], std=[0.3081])" in res["config"]["preprocess"]
    assert res["data"]["n_support"] == 120 and res["data"]["n_train"] is None and res["data"]["n_test"] == 60
    assert {"numpy", "scikit-learn", "platform"} <= set(res["versions"])
    page = (out / "report.html").read_text(encoding="utf-8")
    assert "config None" not in page and "training 0 s" not in page and "train_s" not in page
    assert "not known" in page and rec["weights"]["sha256"] in page and "120 support" in page


def test_report_compares_two_evaluate_outputs_and_a_run(cli_env, nets, capsys):
    tmp_path, _, common = cli_env
    a, b = tmp_path / "relu", tmp_path / "qact"
    for folder, factory in ((a, "make_net"), (b, "make_qact")):
        assert (
            cli(["evaluate", "--model", f"cmpnets:{factory}", "--random-weights", *common, "--out", str(folder)]) == 0
        )
    assert cli(["report", str(a), str(b), "--out", str(tmp_path / "cmp")]) == 0
    csv_lines = (tmp_path / "cmp" / "comparison.csv").read_text().splitlines()
    assert len(csv_lines) == 3  # Sequential [none] against Sequential [batch] and [frozen]
    page = (tmp_path / "cmp" / "report.html").read_text(encoding="utf-8")
    assert "only model of each side" in page and "paired 95% percentile bootstrap" in page
    # a run folder of two models beside an evaluation: which of them is compared is said by name
    run = tmp_path / "run"
    shiftguard.evaluate(
        {"relu": nets["relu"], "weak": nets["weak"]}, _data(), support=_data(60, seed=3), **FAST
    ).write_report(run)
    res = json.loads((run / "results.json").read_text())
    res["kind"] = "run"
    (run / "results.json").write_text(json.dumps(res))
    (run / "config.json").write_text("{}")
    (run / "COMPLETE").write_text("done\n")
    capsys.readouterr()
    assert cli(["report", str(run), str(a), "--out", str(tmp_path / "mixed")]) == 2
    err = _error(capsys)
    assert err.startswith("shiftguard report: error: --match: no series") and "relu/none/softmax" in err
    assert not (tmp_path / "mixed").exists()
    assert cli(["report", str(run), str(a), "--match", "relu=Sequential", "--out", str(tmp_path / "mixed")]) == 0
    page = (tmp_path / "mixed" / "report.html").read_text(encoding="utf-8")
    # different test images: the page says why there is no interval instead of giving one
    assert "models paired as given (relu -&gt; Sequential)" in page and "No interval for the differences" in page


def test_an_incomplete_evaluate_output_is_refused_without_pointing_at_run_resume(cli_env, capsys):
    tmp_path, _, common = cli_env
    out = tmp_path / "ev"
    assert cli(["evaluate", "--model", "cmpnets:make_net", "--random-weights", *common, "--out", str(out)]) == 0
    assert cli(["report", str(out), "--out", str(tmp_path / "again")]) == 0
    (out / "results.json").unlink()
    capsys.readouterr()
    assert cli(["report", str(out)]) == 2
    err = _error(capsys)
    assert "evaluation output is incomplete" in err and "--resume" not in err and "--overwrite" in err


@pytest.mark.parametrize(
    "match, expected",
    [(["relu"], "--match: expected FIRST=OTHER"), (["a=b", "a=c"], "--match: model 'a' is paired twice")],
)
def test_a_malformed_match_is_one_line_naming_it(cli_env, capsys, match, expected):
    tmp_path, _, common = cli_env
    out = tmp_path / "ev"
    assert cli(["evaluate", "--model", "cmpnets:make_net", "--random-weights", *common, "--out", str(out)]) == 0
    capsys.readouterr()
    assert cli(["report", str(out), str(out), "--match", *match]) == 2
    assert expected in _error(capsys)


def test_results_files_without_per_image_data_compare_without_intervals(evaluated):
    old = copy.deepcopy(evaluated["weak"].results)
    del old["per_image_correct"]
    out = evaluated["relu"].compare(EvaluationResult(old))
    assert all(d["intervals"] == {} for d in out["deltas"])
    assert "holds no per-image correctness" in out["intervals"]["clean"]
