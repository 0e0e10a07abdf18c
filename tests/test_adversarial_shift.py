"""Adversarial shift as an axis of the evaluation grid: ``evaluate(..., attacks=)`` and
``[eval] attacks`` of a run config score every head under FGSM / BIM / PGD at each budget, in the
same rows, tables and report as the corruptions, and never inside the corruption means."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from _adversarial_helpers import band_data, trained_band_mlp
from torch import nn

import shiftguard
from shiftguard.adversarial import AttackSpec
from shiftguard.cli import main as cli
from shiftguard.commands import config as C


@pytest.fixture(scope="module")
def attacked():
    x, y = band_data()
    net = trained_band_mlp(x, y)
    res = shiftguard.evaluate(
        net,
        (x, y),
        support=(x, y),
        corruptions=["fog"],
        severities=[3],
        heads=["softmax", "knn"],
        k=3,
        n_boot=10,
        attacks=["fgsm", "pgd-l2"],
        attack_eps=[0.05, 0.3],
        attack_steps=5,
    )
    return net, x, y, res


def test_attack_cells_are_rows_of_their_own_group(attacked):
    _, _, _, res = attacked
    adv = [r for r in res.rows if r["group"] == "adversarial"]
    assert {(r["corruption"], r["severity"]) for r in adv} == {
        ("fgsm-linf", 1),
        ("fgsm-linf", 2),
        ("pgd-l2", 1),
        ("pgd-l2", 2),
    }
    assert {r["head"] for r in adv} == {"softmax", "knn"}
    attacks = res.results["data"]["attacks"]
    assert attacks["fgsm-linf"]["eps"] == [0.05, 0.3] and attacks["pgd-l2"]["steps"] == 5
    assert res.results["data"]["severities"] == [3]  # the budgets are not corruption severities


def test_softmax_row_is_the_accuracy_on_the_attacked_images(attacked):
    net, x, y, res = attacked
    adv_x = AttackSpec.parse("fgsm", eps=0.3).run(net, x, y, preprocess=lambda t: t, batch_size=500)
    acc = float((net(adv_x.float() / 255).argmax(1) == y).float().mean())
    row = next(r for r in res.rows if r["corruption"] == "fgsm-linf" and r["severity"] == 2 and r["head"] == "softmax")
    assert row["accuracy"] == pytest.approx(acc)
    clean = next(r for r in res.rows if r["corruption"] == "clean" and r["head"] == "softmax")
    assert row["accuracy"] < clean["accuracy"]  # the attack works on a trained net


def test_adversarial_cells_stay_out_of_the_corruption_means(attacked):
    _, _, _, res = attacked
    d = res.results
    fog = {r["head"]: r["accuracy"] for r in res.rows if r["corruption"] == "fog"}
    for rob in d["robustness"]:
        assert rob["mca"] == pytest.approx(fog[rob["head"]])
    assert {a["severity"] for a in d["aggregates"]} == {0, 3}
    assert "Adversarial shift" in _html(res) and "adversarial shift" in res.summary()


def test_transfer_cells_score_every_model_on_the_images_made_on_the_source(attacked):
    net, x, y, _ = attacked
    other = copy.deepcopy(net)
    with torch.no_grad():
        other[-1].bias.add_(torch.tensor([0.5, 0.0, -0.5]))  # another model, same architecture
    res = shiftguard.evaluate(
        {"a": net, "b": other},
        (x, y),
        corruptions=["fog"],
        severities=[3],
        heads=["softmax"],
        n_boot=10,
        attacks=["fgsm"],
        attack_eps=[0.3],
        transfer_from=["a"],
    )
    acc = {(r["model"], r["corruption"]): r["accuracy"] for r in res.rows if r["group"] == "adversarial"}
    assert set(acc) == {("a", "fgsm-linf"), ("b", "fgsm-linf"), ("a", "fgsm-linf@a"), ("b", "fgsm-linf@a")}
    # the source scored on its own transfer images is its white-box result
    assert acc["a", "fgsm-linf@a"] == acc["a", "fgsm-linf"]
    made_on_a = AttackSpec.parse("fgsm", eps=0.3).run(net, x, y, preprocess=lambda t: t, batch_size=500)
    assert acc["b", "fgsm-linf@a"] == pytest.approx(
        float((other(made_on_a.float() / 255).argmax(1) == y).float().mean())
    )
    described = res.results["data"]["attacks"]["fgsm-linf@a"]
    assert described["source"] == "a" and described["transfer"] is True
    with pytest.raises(ValueError, match="transfer_from: no model named 'c'"):
        shiftguard.evaluate(
            {"a": net},
            (x, y),
            corruptions=["fog"],
            severities=[3],
            heads=["softmax"],
            attacks=["fgsm"],
            attack_eps=[0.3],
            transfer_from=["c"],
        )
    with pytest.raises(ValueError, match="transfer_from: given without attacks"):
        shiftguard.evaluate(
            {"a": net}, (x, y), corruptions=["fog"], severities=[3], heads=["softmax"], transfer_from=["a"]
        )


def test_run_config_transfer_sources_are_models_of_the_run():
    two = [{"arch": "lenet", "name": "a"}, {"arch": "lenet", "name": "b"}]
    cfg = C.config_from_dict({"eval": {"attacks": ["pgd"], "transfer_from": ["a"]}, "models": two})
    assert cfg.eval.transfer_from == ["a"]
    with pytest.raises(ValueError, match="eval.transfer_from must name models of this run"):
        C.config_from_dict({"eval": {"attacks": ["pgd"], "transfer_from": ["z"]}, "models": two})
    with pytest.raises(ValueError, match="eval.transfer_from needs eval.attacks"):
        C.config_from_dict({"eval": {"transfer_from": ["a"]}, "models": two})


def _html(res):
    from shiftguard.evaluation.report import render_html

    return render_html(res.results, {})


def test_embedding_models_need_a_loss_to_be_attacked():
    x, y = band_data(30)
    emb = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 8))
    with pytest.raises(ValueError, match="attack_loss: model 'Sequential' returns embeddings"):
        shiftguard.evaluate(
            emb,
            (x, y),
            support=(x, y),
            output="embedding",
            heads=["knn"],
            k=3,
            corruptions=["fog"],
            severities=[1],
            n_boot=10,
            attacks=["fgsm"],
        )
    from shiftguard.losses import build_loss

    res = shiftguard.evaluate(
        emb,
        (x, y),
        support=(x, y),
        output="embedding",
        heads=["knn"],
        k=3,
        corruptions=["fog"],
        severities=[1],
        n_boot=10,
        attacks=["fgsm"],
        attack_eps=[0.1],
        attack_loss=build_loss("triplet"),
    )
    assert any(r["group"] == "adversarial" for r in res.rows)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"attacks": "fgsm"}, "attacks: expected a list"),
        ({"attacks": ["fgsm", "FGSM"]}, "fgsm-linf given twice"),
        ({"attacks": ["fgsm-targeted"]}, "targeted"),
        ({"attacks": ["cw"]}, "attacks: name: expected"),
        ({"attacks": ["fgsm"], "attack_eps": [0.0]}, "attack_eps: expected finite budgets > 0"),
        ({"attack_loss": nn.MSELoss()}, "attack_loss: given without attacks"),
    ],
)
def test_bad_attack_arguments_are_named(kw, message):
    x, y = band_data(20)
    net = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 3))
    with pytest.raises((ValueError, TypeError), match=message):
        shiftguard.evaluate(net, (x, y), heads=["softmax"], corruptions=["fog"], severities=[1], n_boot=10, **kw)


def test_run_config_attacks_every_model_including_embedding_losses(tmp_path):
    toml = """
name = "adv"
[data]
dataset = "mnist-default"
train_subset = 300
test_subset = 60
corruptions = ["shot_noise"]
severities = [2]
[train]
epochs = 1
batch_size = 64
[eval]
batch_size = 60
k = 5
n_boot = 10
attacks = ["fgsm", "pgd"]
attack_eps = [0.05]
attack_steps = 3
[[models]]
arch = "lenet"
model_kwargs = {width = 1}
heads = ["softmax", "ned"]
[[models]]
arch = "lenet"
activation = "qact"
loss = "proxydr"
model_kwargs = {width = 1}
heads = ["knn"]
"""
    p = tmp_path / "adv.toml"
    p.write_text(toml)
    assert cli(["run", "--config", str(p), "--out", str(tmp_path), "--no-progress"]) == 0
    res = json.loads((tmp_path / "adv" / "results.json").read_text())
    adv = {(r["model"], r["context"], r["head"], r["corruption"]) for r in res["rows"] if r["group"] == "adversarial"}
    assert ("lenet-qact-proxydr", "frozen", "knn", "pgd-linf") in adv  # attacked through its ProxyDR loss
    assert ("lenet-qact-proxydr", "batch", "knn", "fgsm-linf") in adv
    assert ("lenet-relu-crossentropy", "none", "ned", "fgsm-linf") in adv
    assert (tmp_path / "adv" / "models" / "lenet-qact-proxydr" / "loss.pt").is_file()  # the learnt proxies
    assert "Adversarial shift" in (tmp_path / "adv" / "report.html").read_text()
    for png in ("accuracy_vs_attack_eps.png", "ece_vs_attack_eps.png"):  # beside the corruption figures
        assert (tmp_path / "adv" / "plots" / png).stat().st_size > 1000


def test_run_config_names_a_bad_attack():
    with pytest.raises(ValueError, match="key eval.attacks: name: expected"):
        C.config_from_dict({"eval": {"attacks": ["deepfool"]}, "models": [{"arch": "lenet"}]})
    with pytest.raises(ValueError, match="key eval.attack_eps must be a non-empty list of finite budgets"):
        C.config_from_dict({"eval": {"attacks": ["fgsm"], "attack_eps": [-1]}, "models": [{"arch": "lenet"}]})


def test_attacking_a_qact_model_neither_reads_nor_moves_the_callers_random_stream():
    """QACT draws its sampling seeds from torch's global generator: the attack's passes run under
    the grid's fixed seed, so the adversarial cells are the same whatever the caller's stream
    was, and the stream is where the caller left it."""
    from shiftguard.models import build_model

    torch.manual_seed(0)
    net = build_model("lenet", num_classes=4, activation="qact")
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (40, 1, 28, 28), dtype=torch.uint8, generator=g)
    y = torch.arange(40) % 4
    kw = dict(corruptions=["fog"], severities=[1], heads=["softmax"], n_boot=10, batch_size=20)
    kw.update(attacks=["fgsm"], attack_eps=[2 / 255], contexts=["batch"])
    torch.manual_seed(1)
    state = torch.get_rng_state()
    first = shiftguard.evaluate(net, (x, y), **kw)
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(2)
    second = shiftguard.evaluate(net, (x, y), **kw)
    adversarial = [(a, b) for a, b in zip(first.rows, second.rows) if a["group"] == "adversarial"]
    assert adversarial and all(a == b for a, b in adversarial)
