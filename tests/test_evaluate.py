"""``shiftguard.evaluate`` on models and data a user brings: every input form, where the
embedding comes from, which heads run, and the numbers it reports."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _evaluate_helpers import quadrant_data as _data
from torch import nn
from torch.utils.data import DataLoader, Dataset

import shiftguard
from shiftguard.evaluation import EvaluationResult

pytestmark = pytest.mark.usefixtures("torch_one_thread")

REPO = Path(__file__).resolve().parents[1]
FAST = dict(corruptions=["fog", "rotate"], severities=[2, 5], n_boot=50)


class TinyCNN(nn.Module):
    """A user's model: conv features, a hidden Linear, an output Linear; trained on normalised input."""

    def __init__(self, num_classes: int = 3):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten())
        self.hidden = nn.Linear(64, 12)
        self.out = nn.Linear(12, num_classes)

    def forward(self, x):
        return self.out(F.relu(self.hidden(self.features(x))))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = TinyCNN()
    x, y = _data(300, seed=1)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for _ in range(40):
        loss = F.cross_entropy(m(x.float() / 255), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m.eval()


def _key_rows(res: EvaluationResult) -> list[tuple]:
    return [tuple(sorted((k, v) for k, v in r.items())) for r in res.rows]


# ----------------------------------------------------------------------------------------- input forms
class _PairDataset(Dataset):
    def __init__(self, x, y, nhwc=False):
        self.x, self.y, self.nhwc = x, y, nhwc

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        img = self.x[i].permute(1, 2, 0).numpy() if self.nhwc else self.x[i]
        return img, int(self.y[i])


def test_every_input_form_gives_the_same_rows(model):
    x, y = _data()
    sup = _data(120, seed=2)
    ref = shiftguard.evaluate(model, (x, y), support=sup, heads=["softmax", "knn"], **FAST)
    forms = {
        "Dataset": (_PairDataset(x, y), _PairDataset(*sup), "nchw"),
        "DataLoader": (
            DataLoader(_PairDataset(x, y), batch_size=7),
            DataLoader(_PairDataset(*sup), batch_size=50),
            "nchw",
        ),
        "numpy NHWC": (
            (x.permute(0, 2, 3, 1).numpy(), y.numpy()),
            (sup[0].permute(0, 2, 3, 1).numpy(), sup[1].numpy()),
            "nhwc",
        ),
        "Dataset of HWC arrays": (_PairDataset(x, y, nhwc=True), _PairDataset(*sup, nhwc=True), "nhwc"),
        "float pixels in [0, 1]": ((x.double() / 255, y), (sup[0].double() / 255, sup[1]), "nchw"),
    }
    for name, (test, support, layout) in forms.items():
        res = shiftguard.evaluate(model, test, support=support, heads=["softmax", "knn"], layout=layout, **FAST)
        if name.startswith("float"):
            clean = [r for r in res.rows if r["severity"] == 0]
            assert clean == [r for r in ref.rows if r["severity"] == 0], name
        else:
            assert res.rows == ref.rows, name


def test_a_float_image_outside_0_1_is_an_error_naming_the_range(model):
    x, y = _data()
    normalised = (x.float() / 255 - 0.5) / 0.25
    with pytest.raises(ValueError, match=r"test.*-2\.0.*[0, 1]|test.*\[0, 1\]") as info:
        shiftguard.evaluate(model, (normalised, y), heads=["softmax"], **FAST)
    assert "preprocess" in str(info.value)


def test_preprocess_runs_after_the_corruption_and_before_the_model(model):
    """A model wrapping its own normalisation == the bare model with ``preprocess``: same cells."""
    x, y = _data()
    mean, std = 0.3, 0.2

    class Wrapped(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, t):
            return self.inner((t - mean) / std)

    a = shiftguard.evaluate(Wrapped(model), (x, y), heads=["softmax"], **FAST)
    b = shiftguard.evaluate(model, (x, y), heads=["softmax"], preprocess=lambda t: (t - mean) / std, **FAST)
    strip = lambda res: [{k: v for k, v in r.items() if k != "model"} for r in res.rows]
    assert strip(a) == strip(b)
    c = shiftguard.evaluate(model, (x, y), heads=["softmax"], **FAST)
    assert strip(c) != strip(b), "preprocess had no effect"


# ----------------------------------------------------------------------------------------- embedding
def test_default_embedding_is_the_input_of_the_last_linear_called(model):
    x, y = _data(30)
    outs = shiftguard.evaluation.ModelOutputs(model)
    emb, logits = outs(x)
    with torch.no_grad():
        inp = x.float() / 255
        expected = F.relu(model.hidden(model.features(inp)))
        assert torch.equal(emb, expected) and torch.equal(logits, model(inp))
    by_name, _ = shiftguard.evaluation.ModelOutputs(model, embed="features")(x)
    with torch.no_grad():
        assert torch.equal(by_name, model.features(inp))
    by_fn, _ = shiftguard.evaluation.ModelOutputs(model, embed=lambda t: model.hidden(model.features(t)))(x)
    with torch.no_grad():
        assert torch.equal(by_fn, model.hidden(model.features(inp)))


def test_unknown_embed_layer_is_an_error_naming_it(model):
    with pytest.raises(ValueError, match="embed: .*'fc9'"):
        shiftguard.evaluation.ModelOutputs(model, embed="fc9")


def test_heads_a_model_cannot_serve_are_skipped_with_the_reason(model):
    x, y = _data()
    logits_only = shiftguard.evaluate(
        model, (x, y), support=_data(60, seed=3), embed=False, heads=["softmax", "knn", "temperature"], **FAST
    )
    assert {r["head"] for r in logits_only.rows} == {"softmax"}
    reasons = {s["head"]: s["reason"] for s in logits_only.skipped_heads}
    assert "no embedding" in reasons["knn"] and "validation" in reasons["temperature"]
    assert all(r["r_auroc"] is None and "map_at_1" not in r for r in logits_only.rows)

    embedder = nn.Sequential(model.features, model.hidden)
    emb_only = shiftguard.evaluate(
        embedder, (x, y), support=_data(60, seed=3), output="embedding", heads=["softmax", "knn", "ned"], **FAST
    )
    assert {r["head"] for r in emb_only.rows} == {"knn", "ned"}
    assert "no logits" in {s["head"]: s["reason"] for s in emb_only.skipped_heads}["softmax"]

    no_support = shiftguard.evaluate(model, (x, y), heads=["softmax", "ned"], **FAST)
    assert "support" in {s["head"]: s["reason"] for s in no_support.skipped_heads}["ned"]


# ----------------------------------------------------------------------------------------- what is reported
def test_rows_hold_every_metric_and_the_grid_is_complete(model):
    x, y = _data()
    res = shiftguard.evaluate(
        model,
        (x, y),
        support=_data(120, seed=2),
        validation=_data(60, seed=4),
        heads=["softmax", "temperature", "logistic", "ned", "knn"],
        **FAST,
    )
    cells = {(r["corruption"], r["severity"]) for r in res.rows}
    assert cells == {("clean", 0), ("fog", 2), ("fog", 5), ("rotate", 2), ("rotate", 5)}
    for r in res.rows:
        for k in (
            "accuracy",
            "nll",
            "brier",
            "ece_top_label",
            "ece_marginal",
            "r_auroc",
            "auroc_error",
            "aurc",
            "map_at_1",
            "recall_at_5",
        ):
            assert k in r, k
        assert r["n"] == 90 and 0 <= r["accuracy"] <= 1
    # the clean row of the softmax head equals the model's own accuracy
    with torch.no_grad():
        acc = (model(x.float() / 255).argmax(1) == y).double().mean().item()
    clean = next(r for r in res.rows if r["head"] == "softmax" and r["severity"] == 0)
    assert clean["accuracy"] == pytest.approx(acc)
    # mean corruption accuracy = the mean of the corrupted cells' accuracies
    rob = next(r for r in res.robustness if r["head"] == "softmax")
    cells_acc = [r["accuracy"] for r in res.rows if r["head"] == "softmax" and r["severity"] > 0]
    assert rob["mca"] == pytest.approx(float(np.mean(cells_acc)))
    # intervals bracket the clean accuracy, seeded and repeatable
    ci = next(i for i in res.intervals if i["head"] == "softmax" and i["metric"] == "accuracy_clean")
    assert ci["lo"] <= ci["estimate"] <= ci["hi"] and ci["estimate"] == pytest.approx(acc)
    again = shiftguard.evaluate(
        model,
        (x, y),
        support=_data(120, seed=2),
        validation=_data(60, seed=4),
        heads=["softmax", "temperature", "logistic", "ned", "knn"],
        **FAST,
    )
    assert again.intervals == res.intervals and again.rows == res.rows


def test_mce_against_a_baseline_the_user_passes(model):
    x, y = _data()
    base = shiftguard.evaluate(model, (x, y), heads=["softmax"], name="base", **FAST)
    own = shiftguard.evaluate(model, (x, y), heads=["softmax"], baseline=base, **FAST)
    rob = own.robustness[0]
    assert rob["mce"] == pytest.approx(1.0) and set(rob["ce"]) == {"fog", "rotate"}
    assert rob["baseline"].startswith("base: TinyCNN/none/softmax")
    with pytest.raises(ValueError, match="baseline_key"):
        shiftguard.evaluate(model, (x, y), heads=["softmax"], baseline=base, baseline_key="x/none/softmax", **FAST)


def test_each_head_is_compared_with_the_same_head_of_the_baseline(model):
    x, y = _data()
    sup, val = _data(120, seed=2), _data(60, seed=4)
    base = shiftguard.evaluate(
        model, (x, y), support=sup, validation=val, heads=["softmax", "temperature"], name="base", **FAST
    )
    own = shiftguard.evaluate(
        model, (x, y), support=sup, validation=val, heads=["softmax", "temperature", "knn"], baseline=base, **FAST
    )
    by_head = {r["head"]: r for r in own.robustness}
    # The same model and data: each head the baseline scored has CE 1 against itself; a head it did
    # not score is compared with the baseline's primary head, its softmax.
    assert by_head["softmax"]["baseline"] == "base: TinyCNN/none/softmax"
    assert by_head["temperature"]["baseline"] == "base: TinyCNN/none/temperature"
    assert by_head["knn"]["baseline"] == "base: TinyCNN/none/softmax"
    assert by_head["temperature"]["mce"] == pytest.approx(1.0)


def test_baseline_key_alone_names_a_series_of_this_evaluation(model):
    x, y = _data()
    res = shiftguard.evaluate(
        {"a": model, "b": model}, (x, y), heads=["softmax"], baseline_key="a/none/softmax", **FAST
    )
    assert {r["baseline"] for r in res.robustness} == {"this evaluation: a/none/softmax"}
    assert all(r["mce"] == pytest.approx(1.0) for r in res.robustness)
    with pytest.raises(ValueError, match="baseline_key: 'c/none/softmax' names no model and head"):
        shiftguard.evaluate({"a": model}, (x, y), heads=["softmax"], baseline_key="c/none/softmax", **FAST)
    with pytest.raises(ValueError, match="baseline_key: 'a/none/bn/softmax' names an adaptation arm"):
        shiftguard.evaluate({"a": model}, (x, y), heads=["softmax"], baseline_key="a/none/bn/softmax", **FAST)


def test_compare_gives_deltas_and_names_protocol_differences(model):
    x, y = _data()
    a = shiftguard.evaluate(model, (x, y), heads=["softmax"], **FAST)
    b = shiftguard.evaluate(model, (x, y), heads=["softmax"], corruptions=["fog"], severities=[2, 5], n_boot=50)
    same = a.compare(a)
    assert same["protocol_differences"] == []
    assert all(v[2] == 0 for row in same["deltas"] for k, v in row.items() if isinstance(v, tuple) and v[2] is not None)
    diff = b.compare(a)
    assert any(d.startswith("corruptions:") for d in diff["protocol_differences"])
    acc = diff["deltas"][0]["accuracy_clean"]
    assert acc[2] == pytest.approx(acc[0] - acc[1])


def test_files_round_trip_and_report_is_written(model, tmp_path):
    x, y = _data()
    res = shiftguard.evaluate(model, (x, y), support=_data(60, seed=3), heads=["softmax", "knn"], **FAST)
    page = res.write_report(tmp_path / "rep")
    assert page.is_file() and (tmp_path / "rep" / "results.csv").is_file()
    back = EvaluationResult.load(tmp_path / "rep")
    assert back.rows == json.loads(res.to_json())["rows"]
    header = res.to_csv().splitlines()[0].split(",")
    assert header[:8] == ["model", "context", "adaptation", "head", "corruption", "severity", "n", "group"]
    assert "nll" in header
    assert "TinyCNN" in res.summary()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(heads=["softmax", "nope"]), "heads: unknown head 'nope'"),
        (dict(corruptions=["fog", "fog"]), "corruptions: listed more than once: 'fog'"),
        (dict(severities=[2, 2]), "severities: listed more than once"),
        (dict(severities=[6]), "severities: expected integers in 1..5"),
        (dict(corruptions=["fgo"]), "corruptions: unknown .*'fgo'"),
        (dict(suite="imagenet-c"), "suite: unknown suite"),
        (dict(batch_size=0), "batch_size"),
        (dict(contexts=["train"]), "contexts"),
        (dict(layout="hwc"), "layout"),
    ],
)
def test_bad_arguments_are_errors_naming_them(model, kwargs, match):
    x, y = _data(30)
    kw = {**dict(heads=["softmax"], corruptions=["fog"], severities=[1]), **kwargs}
    with pytest.raises((ValueError, TypeError), match=match):
        shiftguard.evaluate(model, (x, y), **kw)


def test_labels_beyond_the_models_classes_are_an_error(model):
    x, _ = _data(30)
    with pytest.raises(ValueError, match=r"test: labels run 0\.\.7, but the model has 3 classes \(labels 0\.\.2\)"):
        shiftguard.evaluate(model, (x, torch.arange(30) % 8), heads=["softmax"], **FAST)


def test_labels_that_never_take_the_value_0_are_an_error(model):
    x, _ = _data(30)
    shifted = torch.arange(30) % 2 + 1  # 1..2 of a 3-class model: every label one too high
    with pytest.raises(ValueError, match=r"labels: the labels of test, support run 1\.\.2 and none is 0"):
        shiftguard.evaluate(model, (x, shifted), support=(x, shifted), heads=["softmax"], **FAST)


def test_not_a_module_is_an_error_naming_model():
    x, y = _data(30)
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        shiftguard.evaluate(lambda t: t, (x, y))


# ----------------------------------------------------------------------------------------- QACT and run
def test_a_model_with_qact_is_evaluated_in_batch_and_frozen_context():
    from shiftguard.nn import convert_activations

    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="functional.relu"):  # TinyCNN calls F.relu once: left as it is
        m = convert_activations(TinyCNN(), to="qact", example_input=torch.rand(8, 1, 16, 16))
    x, y = _data(60)
    res = shiftguard.evaluate(m, (x, y), heads=["softmax"], batch_size=30, **FAST)
    assert {r["context"] for r in res.rows} == {"batch", "frozen"}
    only_batch = shiftguard.evaluate(m, (x, y), heads=["softmax"], batch_size=30, contexts=["batch"], **FAST)
    assert {r["context"] for r in only_batch.rows} == {"batch"}
    assert [r for r in res.rows if r["context"] == "batch"] == only_batch.rows


TINY_RUN = """
name = "tiny"
[data]
train_subset = 300
test_subset = 120
corruptions = ["fog", "rotate"]
severities = [3]
[train]
epochs = 1
batch_size = 64
[eval]
batch_size = 60
n_boot = 50
[[models]]
name = "relu"
arch = "lenet"
activation = "relu"
heads = ["softmax", "temperature", "logistic", "knn"]
"""


def test_run_and_evaluate_give_identical_numbers_for_the_same_trained_model(tmp_path):
    """``shiftguard run`` is train-then-evaluate: its rows equal ``evaluate()`` on its trained model."""
    from shiftguard.cli import main as cli
    from shiftguard.commands import config as C
    from shiftguard.commands.run import load_data
    from shiftguard.models import build_model
    from shiftguard.train import to_model_input

    cfg_path = tmp_path / "tiny.toml"
    cfg_path.write_text(TINY_RUN)
    assert cli(["run", "--config", str(cfg_path), "--out", str(tmp_path / "runs"), "--no-progress"]) == 0
    run = json.loads((tmp_path / "runs" / "tiny" / "results.json").read_text())
    cfg = C.load_config(cfg_path)
    data = load_data(cfg)
    model = build_model("lenet", activation="relu", num_classes=10, in_channels=1)
    model.load_state_dict(torch.load(tmp_path / "runs" / "tiny" / "models" / "relu" / "model.pt", weights_only=True))
    res = shiftguard.evaluate(
        {"relu": model},
        data["test"],
        support=data["train"],
        validation=data["val"],
        corruptions=["fog", "rotate"],
        severities=[3],
        heads=["softmax", "temperature", "logistic", "knn"],
        preprocess=to_model_input,
        batch_size=60,
        seed=cfg.data.corruption_seed,
        n_boot=50,
        baseline_key=C.baseline_key(cfg),
    )  # the run's mCE baseline: its ReLU model's softmax
    assert C.baseline_key(cfg) == "relu/none/softmax"
    assert res.rows == run["rows"]
    assert res.results["robustness"] == run["robustness"]
    assert {r["baseline"] for r in run["robustness"]} == {"this evaluation: relu/none/softmax"}


# ----------------------------------------------------------------------------------------- the documented example
def test_the_documented_example_runs_on_a_small_subset(fashion_mnist_dir, tmp_path):
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import evaluate_own_model as example
    finally:
        sys.path.remove(str(REPO / "examples"))
    res = example.main(
        str(fashion_mnist_dir),
        str(tmp_path / "report"),
        n_train=1500,
        n_val=300,
        n_test=200,
        epochs=1,
        corruptions=["fog", "shot_noise"],
        severities=(1, 5),
    )
    assert (tmp_path / "report" / "report.html").is_file()
    assert {r["head"] for r in res.rows} == {"softmax", "temperature", "ned"}
    clean = next(r for r in res.rows if r["head"] == "softmax" and r["severity"] == 0)
    assert clean["accuracy"] > 0.6, "one epoch on 1,500 Fashion-MNIST images should beat 60%"


# ----------------------------------------------------------------------------------------- command line
FACTORY = """
import torch
from torch import nn

def make_net(num_classes):
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 32), nn.ReLU(), nn.Linear(32, num_classes))
"""


def _cli_args(tmp_path, *extra):
    return [
        "evaluate",
        "--model",
        "usernets:make_net",
        "--test-subset",
        "100",
        "--support-size",
        "300",
        "--val-size",
        "100",
        "--corruptions",
        "fog",
        "--severities",
        "3",
        "--n-boot",
        "20",
        "--no-progress",
        "--heads",
        "softmax",
        "temperature",
        "knn",
        *extra,
    ]


def test_cli_evaluates_a_factory_with_safely_loaded_weights(tmp_path, monkeypatch, capsys):
    from safetensors.torch import save_file

    from shiftguard.cli import main as cli

    (tmp_path / "usernets.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("usernets", None)
    import usernets

    net = usernets.make_net(10)
    with torch.no_grad():
        net[1].weight.mul_(3.0)  # weights that differ from the factory's, so loading them shows
    torch.save(net.state_dict(), tmp_path / "w.pt")
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(tmp_path / "w.safetensors"))
    assert cli(_cli_args(tmp_path, "--weights", str(tmp_path / "w.pt"), "--out", str(tmp_path / "a"))) == 0
    assert cli(_cli_args(tmp_path, "--weights", str(tmp_path / "w.safetensors"), "--out", str(tmp_path / "b"))) == 0
    assert cli(_cli_args(tmp_path, "--random-weights", "--out", str(tmp_path / "c"))) == 0
    a, b, c = (EvaluationResult.load(tmp_path / d) for d in "abc")
    assert a.rows == b.rows and a.rows != c.rows
    assert (tmp_path / "a" / "report.html").is_file()
    assert "make_net" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "spec, match",
    [
        ("usernets", "expected 'module:function'"),
        ("nosuchmodule:f", "cannot import module 'nosuchmodule'"),
        ("usernets:missing", "has no attribute 'missing'"),
    ],
)
def test_cli_bad_model_spec_is_one_line_naming_the_option(tmp_path, monkeypatch, capsys, spec, match):
    from shiftguard.cli import main as cli

    (tmp_path / "usernets.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = _cli_args(tmp_path, "--random-weights", "--out", str(tmp_path / "o"))
    args[2] = spec
    assert cli(args) == 2
    err = capsys.readouterr().err
    assert "--model" in err and re.search(match, err) and "Traceback" not in err


def test_cli_weights_that_do_not_fit_are_refused_naming_the_file(tmp_path, monkeypatch, capsys):
    from shiftguard.cli import main as cli

    (tmp_path / "usernets.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    torch.save({"0.weight": torch.zeros(2, 2)}, tmp_path / "bad.pt")
    assert cli(_cli_args(tmp_path, "--weights", str(tmp_path / "bad.pt"), "--out", str(tmp_path / "o"))) == 2
    assert "bad.pt does not fit the model" in capsys.readouterr().err


def test_loading_a_deeply_nested_results_file_is_an_error_naming_it(tmp_path):
    p = tmp_path / "results.json"
    p.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="results.json: nested too deeply"):
        EvaluationResult.load(p)


def test_cells_are_named_and_stay_the_plain_tuples_they_replace():
    from shiftguard.evaluation.cell import Cell
    from shiftguard.evaluation.evaluate import build_cells

    cells = build_cells("cifar-c", ["fog", "speckle_noise"], [1, 5])
    assert all(isinstance(c, Cell) for c in cells)
    assert [(c.corruption, c.severity, c.group) for c in cells] == [
        ("fog", 1, "benchmark"),
        ("fog", 5, "benchmark"),
        ("speckle_noise", 1, "extra"),
        ("speckle_noise", 5, "extra"),
    ]
    corruption, severity, group = cells[0]
    assert cells[0] == ("fog", 1, "benchmark") and hash(cells[0]) == hash(("fog", 1, "benchmark"))
    assert json.loads(json.dumps(cells[2])) == ["speckle_noise", 1, "extra"]
