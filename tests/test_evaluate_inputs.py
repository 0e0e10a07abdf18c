"""``shiftguard.evaluate`` never scores misaligned, stale or unintended inputs, and never moves or
keeps the caller's model changed: one class of silent wrong results per test group."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shiftguard
from shiftguard.evaluation.cache import FINGERPRINT_FILE

FAST = dict(suite="mnist-c", corruptions=["fog"], severities=[3], n_boot=20, batch_size=30)


def _data(n=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 1, 8, 8), dtype=torch.uint8, generator=g), torch.arange(n) % 3


def _net(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 3)).to(dtype)


# --------------------------------------------------------------------------- outputs not aligned with inputs
class _Rows(nn.Module):
    """Returns ``extra`` more rows than it was given (fewer when negative)."""

    def __init__(self, extra: int):
        super().__init__()
        self.net, self.extra = _net(), extra

    def forward(self, x):
        out = self.net(x)
        return torch.cat([out, out[: self.extra]]) if self.extra > 0 else out[: out.shape[0] + self.extra]


@pytest.mark.parametrize("extra", [1, -1])
def test_a_model_returning_another_number_of_rows_than_images_is_refused(extra):
    x, y = _data()
    with pytest.raises(ValueError, match=r"model: model\(x\) has \d+ rows for a batch of \d+ images"):
        shiftguard.evaluate(_Rows(extra), (x, y), heads=["softmax"], **FAST)


# --------------------------------------------------------------------------- probabilities scored as logits
def test_a_model_returning_probabilities_is_refused_unless_output_says_so():
    x, y = _data()
    logits_model = _net()
    prob_model = nn.Sequential(logits_model, nn.Softmax(dim=1))
    with pytest.raises(ValueError, match="output: model 'Sequential' returns probabilities"):
        shiftguard.evaluate(prob_model, (x, y), heads=["softmax"], **FAST)
    from_probs = shiftguard.evaluate(prob_model, (x, y), heads=["softmax"], output="probabilities", **FAST)
    from_logits = shiftguard.evaluate(logits_model, (x, y), heads=["softmax"], **FAST)
    for a, b in zip(from_probs.rows, from_logits.rows):
        assert a["accuracy"] == b["accuracy"]
        assert a["nll"] == pytest.approx(b["nll"], rel=1e-5)
        assert a["ece_top_label"] == pytest.approx(b["ece_top_label"], abs=1e-6)


def test_output_probabilities_refuses_a_model_that_returns_logits():
    x, y = _data()
    with pytest.raises(ValueError, match="output: 'probabilities' was given, but row"):
        shiftguard.evaluate(_net(), (x, y), heads=["softmax"], output="probabilities", **FAST)


def test_probabilities_are_attacked_through_their_logarithm():
    x, y = _data()
    prob_model = nn.Sequential(_net(), nn.Softmax(dim=1))
    res = shiftguard.evaluate(
        prob_model, (x, y), heads=["softmax"], output="probabilities", attacks=["fgsm"], attack_eps=[0.2], **FAST
    )
    logit_res = shiftguard.evaluate(_net(), (x, y), heads=["softmax"], attacks=["fgsm"], attack_eps=[0.2], **FAST)
    adv = [r["accuracy"] for r in res.rows if r["group"] == "adversarial"]
    assert adv == [r["accuracy"] for r in logit_res.rows if r["group"] == "adversarial"]


# --------------------------------------------------------------------------- dtypes
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_models_in_other_floating_dtypes_get_their_own_dtype(dtype):
    x, y = _data()
    res = shiftguard.evaluate(_net(dtype=dtype), (x, y), support=(x, y), heads=["softmax", "knn"], **FAST)
    ref = shiftguard.evaluate(_net(), (x, y), support=(x, y), heads=["softmax", "knn"], **FAST)
    assert [r["head"] for r in res.rows] == [r["head"] for r in ref.rows]
    if dtype == torch.float64:  # float64 computes the float32 model's numbers to float32 rounding
        for a, b in zip(res.rows, ref.rows):
            assert a["nll"] == pytest.approx(b["nll"], rel=1e-4)


def test_float64_pixels_attack_a_float32_model():
    x, y = _data()
    res = shiftguard.evaluate(
        _net(), (x.double() / 255, y), heads=["softmax"], attacks=["pgd"], attack_eps=[0.1], attack_steps=2, **FAST
    )
    assert any(r["group"] == "adversarial" for r in res.rows)


# --------------------------------------------------------------------------- stale cached outputs
def test_the_cache_serves_only_the_evaluation_that_wrote_it(tmp_path):
    x, y = _data()
    kw = dict(heads=["softmax"], cache_dir=tmp_path, **FAST)
    first = shiftguard.evaluate(_net(0), (x, y), **kw)
    assert (tmp_path / "Sequential" / FINGERPRINT_FILE).is_file()
    assert shiftguard.evaluate(_net(0), (x, y), **kw).rows == first.rows  # the same evaluation reuses it
    for change, call in (
        ("weights", lambda: shiftguard.evaluate(_net(1), (x, y), **kw)),
        ("test", lambda: shiftguard.evaluate(_net(0), _data(seed=5), **kw)),
        ("preprocess", lambda: shiftguard.evaluate(_net(0), (x, y), preprocess=lambda t: t * 2, **kw)),
        ("batch_size", lambda: shiftguard.evaluate(_net(0), (x, y), **{**kw, "batch_size": 20})),
    ):
        with pytest.raises(
            ValueError,
            match=rf"cache_dir: .*Sequential holds the outputs of another evaluation "
            rf"\(.*{change}.*\)",
        ):
            call()


def test_cached_outputs_without_a_fingerprint_are_refused(tmp_path):
    x, y = _data()
    (tmp_path / "Sequential" / "none").mkdir(parents=True)
    torch.save({"logits": torch.zeros(60, 3), "embeddings": None}, tmp_path / "Sequential" / "none" / "clean-s0.pt")
    with pytest.raises(ValueError, match=f"holds outputs without a {FINGERPRINT_FILE}"):
        shiftguard.evaluate(_net(), (x, y), heads=["softmax"], cache_dir=tmp_path, **FAST)


# --------------------------------------------------------------------------- the caller's model
def test_the_callers_model_is_evaluated_as_a_copy_when_it_lives_elsewhere():
    from shiftguard.evaluation.evaluate import _on_device

    net = _net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    moved = _on_device(net, torch.device("meta"), None, "net")
    assert moved is not net and next(moved.parameters()).device.type == "meta"
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())  # weights kept, on the CPU
    assert _on_device(net, torch.device("cpu"), None, "net") is net
    with pytest.raises(ValueError, match="embed: model 'net' lives on cpu"):
        _on_device(net, torch.device("meta"), lambda t: t, "net")


# --------------------------------------------------------------------------- names that reach files
@pytest.mark.parametrize("name", ["../x", "/abs", ".hidden", "=cmd()", "a/b", "-rm"])
def test_model_names_that_would_leave_cache_dir_or_run_in_a_spreadsheet_are_refused(name):
    x, y = _data()
    with pytest.raises(ValueError, match=r"model: name .* must be letters, digits and _\.\+-"):
        shiftguard.evaluate({name: _net()}, (x, y), heads=["softmax"], **FAST)


def test_csv_cells_that_a_spreadsheet_would_run_are_neutralised():
    from shiftguard.evaluation.report import csv_text

    text = csv_text(
        [
            {
                "model": "=1+2",
                "context": "@x",
                "adaptation": "-y",
                "head": "+z",
                "corruption": "fog",
                "severity": 1,
                "n": 2,
                "accuracy": -0.5,
            }
        ]
    )
    row = text.splitlines()[1].split(",")
    assert row[:4] == ["'=1+2", "'@x", "'-y", "'+z"] and row[-1] == "-0.5"


# --------------------------------------------------------------------------- half-precision inputs to the heads
@pytest.mark.parametrize("head", ["ned", "knn", "wknn", "1nn", "logistic", "temperature", "distance_ratio"])
def test_heads_given_bfloat16_inputs_compute_in_float32(head):
    from shiftguard.heads import build_head
    from shiftguard.metrics import ece

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(200, 4, generator=g).bfloat16(), torch.arange(200) % 4
    h = build_head(head, 4)
    h.fit(x, y, x, y) if head == "temperature" else h.fit(x, y)
    p = h.predict_proba(x)
    assert p.dtype == torch.float32 and (p.sum(1) - 1).abs().max() < 1e-5
    ece(p, y)  # the metrics take them


# --------------------------------------------------------------------------- gradient modes of the caller
@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_attacks_inside_the_callers_inference_mode_give_the_same_rows(mode):
    x, y = _data()
    kw = dict(heads=["softmax"], attacks=["fgsm"], attack_eps=[0.1], **FAST)
    net = _net()
    ref = shiftguard.evaluate(net, (x, y), **kw)
    with getattr(torch, mode)():
        xi, yi = x.clone(), y.clone()
        res = shiftguard.evaluate(net, (xi, yi), **kw)
        if mode == "inference_mode":  # a model built under inference mode cannot be differentiated at all
            with pytest.raises(
                ValueError, match="attacks: model 'Sequential' has parameters created under torch.inference_mode"
            ):
                shiftguard.evaluate(_net(), (xi, yi), **kw)
    assert res.rows == ref.rows


# --------------------------------------------------------------------------- validation data a head does not read
@pytest.mark.parametrize("head", ["knn", "wknn", "1nn", "logistic", "distance_ratio", "quantile"])
def test_heads_that_do_not_read_validation_data_refuse_it(head):
    from shiftguard.heads import build_head

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 4, generator=g), torch.arange(40) % 4
    h = build_head(head, 4)
    assert not h.uses_validation
    with pytest.raises(ValueError, match="val_embeddings: .* does not use validation data"):
        h.fit(x, y, x, y)


def test_heads_that_read_validation_data_say_so_and_the_grid_gives_it_to_them_only():
    from shiftguard.heads import build_head

    assert build_head("ned", 3).uses_validation and build_head("temperature", 3).uses_validation
    x, y = _data()
    res = shiftguard.evaluate(
        _net(),
        (x, y),
        support=(x, y),
        validation=(x, y),
        heads=["softmax", "temperature", "ned", "knn", "logistic"],
        **FAST,
    )
    assert {r["head"] for r in res.rows} == {"softmax", "temperature", "ned", "knn", "logistic"}
