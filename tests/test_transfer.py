"""The transfer benchmark (URL protocol in miniature): class splits, metrics, and a smoke run."""

import json
import math

import pytest
import torch

from shiftguard.commands import transfer as T
from shiftguard.metrics import r_auroc

# ------------------------------------------------------------------------------------------- class split


def _synthetic(n_per_class=12, classes=10, size=16, seed=0):
    """``(images uint8 (N, 1, size, size), labels)``: a bright square whose place encodes the class."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(classes).repeat_interleave(n_per_class)
    x = (torch.rand(y.numel(), 1, size, size, generator=g) * 60).to(torch.uint8)
    for i, c in enumerate(y.tolist()):
        r, col = divmod(c, 4)
        x[i, 0, 4 * r : 4 * r + 4, 4 * col : 4 * col + 4] = 255
    return x, y


def _pair_data(train_subset=None, up=range(5), down=range(5, 10), down_name="synthetic"):
    train, test = _synthetic(seed=0), _synthetic(seed=1)
    return T.make_transfer_data(
        train, test, test, [("synthetic", k) for k in up], [(down_name, k) for k in down], train_subset=train_subset
    )


def test_synthetic_split_keeps_every_downstream_class_out_of_upstream():
    d = _pair_data()
    up, down = set(d.source_labels_train.tolist()), set(d.source_labels_down.tolist())
    assert up == {0, 1, 2, 3, 4} and set(d.source_labels_up_test.tolist()) == up
    assert down == {5, 6, 7, 8, 9}
    assert not up & down
    # Labels are re-indexed per side, each side from 0.
    assert set(d.train_y.tolist()) == set(d.down_y.tolist()) == set(range(5))


def test_a_class_listed_on_both_sides_is_refused():
    with pytest.raises(ValueError, match="downstream_classes"):
        _pair_data(up=range(6), down=range(5, 10))
    with pytest.raises(ValueError, match="downstream_classes"):
        T.check_class_split([("mnist", 3)], [("mnist", 3)])
    # The same label of another dataset is another class.
    T.check_class_split([("mnist", 3)], [("fashion-mnist", 3)])


def test_train_subset_is_seeded_and_bounded():
    a, b = _pair_data(train_subset=20), _pair_data(train_subset=20)
    assert a.train_x.shape[0] == 20 and torch.equal(a.train_x, b.train_x)
    with pytest.raises(ValueError, match="train_subset"):
        _pair_data(train_subset=61)


@pytest.mark.parametrize("split", sorted(T.SPLITS))
def test_real_splits_never_leak_a_downstream_class(split, mnist_dir, fashion_mnist_dir):
    spec = T.SPLITS[split]
    d = T.load_split(split, root=str(mnist_dir.parent), train_subset=500)
    up_src = set(d.source_labels_train.tolist()) | set(d.source_labels_up_test.tolist())
    assert up_src <= set(spec.upstream_labels)
    assert set(d.source_labels_down.tolist()) == set(spec.downstream_labels)
    if spec.upstream == spec.downstream:
        assert not up_src & set(d.source_labels_down.tolist())
    assert not set(d.upstream_classes) & set(d.downstream_classes)
    assert d.train_x.shape[0] == 500 and d.train_x.dtype == torch.float32
    assert 0.0 <= float(d.down_x.min()) and float(d.down_x.max()) <= 1.0


def test_missing_data_names_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        T.load_split("mnist-0to4-5to9", root=str(tmp_path))


# ---------------------------------------------------------------------------------------------- metrics


def test_recall_at_one_is_cosine_nearest_neighbour_agreement():
    # Cosine neighbours: 0 <-> 1 (same direction, different length), 2 <-> 3. Euclidean would pair the
    # short vectors 0 and 2 instead.
    x = torch.tensor([[1.0, 0.0], [10.0, 0.5], [0.0, 1.0], [0.5, 10.0]])
    y = torch.tensor([0, 0, 1, 1])
    assert T.one_nn_misses(x, y).tolist() == [False, False, False, False]
    assert T.recall_at_one(x, y) == 1.0
    assert T.one_nn_misses(x, y, metric="euclidean").tolist() == [True, False, True, False]
    assert T.recall_at_one(x, torch.tensor([0, 1, 0, 1])) == 0.0


def _brute_force_recall_at_one(x, y, metric):
    """Recall@1 by a double loop over the pairs: the nearest other sample by cosine or Euclidean distance."""
    n, hits = len(y), 0
    for i in range(n):
        best, best_j = None, None
        for j in range(n):
            if j == i:
                continue
            if metric == "cosine":
                d = -float(torch.dot(x[i], x[j]) / (x[i].norm() * x[j].norm()))
            else:
                d = float((x[i] - x[j]).norm())
            if best is None or d < best:
                best, best_j = d, j
        hits += int(y[best_j] == y[i])
    return hits / n


@pytest.mark.parametrize("metric", ["cosine", "euclidean"])
def test_recall_at_one_agrees_with_brute_force_and_the_retrieval_metrics(metric):
    from shiftguard.functional.scaling import normalize_rows
    from shiftguard.metrics import retrieval_metrics

    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 3, generator=g, dtype=torch.float64) * torch.rand(40, 1, generator=g, dtype=torch.float64)
    y = torch.arange(40) % 4
    r1 = T.recall_at_one(x, y, metric=metric)
    assert 0.0 < r1 < 1.0
    assert r1 == pytest.approx(_brute_force_recall_at_one(x, y, metric), abs=1e-15)
    searched = normalize_rows(x) if metric == "cosine" else x
    assert r1 == pytest.approx(retrieval_metrics(searched, y, ks=(1,), backend="torch")["recall@1"], abs=1e-15)
    # a sample alone in its class counts as a miss (retrieval_metrics leaves it out of its average)
    lone = torch.cat([y[:-1], torch.tensor([9])])
    assert T.recall_at_one(x, lone, metric=metric) == pytest.approx(
        _brute_force_recall_at_one(x, lone, metric), abs=1e-15
    )
    assert T.recall_at_one(x[:3], torch.tensor([0, 1, 2])) == 0.0  # every class alone: no hit


def test_excess_aurc_is_zero_for_a_perfect_ordering_and_hand_computed_otherwise():
    err = torch.tensor([False, True, False, True])
    assert T.excess_aurc(torch.tensor([0.1, 0.9, 0.2, 0.8]), err) == pytest.approx(0.0, abs=1e-15)
    # Two samples, the error accepted first: risks 1, 1/2 -> AURC 3/4; oracle 0, 1/2 -> 1/4.
    assert T.excess_aurc(torch.tensor([0.0, 1.0]), torch.tensor([1, 0])) == pytest.approx(0.5)


def test_evaluate_transfer_hand_computed_problem():
    up_emb = torch.tensor([[1.0, 0.0], [2.0, 0.1], [0.0, 1.0], [0.1, 2.0]])
    up_y = torch.tensor([0, 0, 1, 1])
    down_emb = torch.tensor([[1.0, 1.0], [2.0, 2.1], [-1.0, 1.0], [-2.0, 2.1]])
    down_y = torch.tensor([0, 0, 1, 0])  # cosine pairs 0<->1 (both hit) and 2<->3 (both miss)
    u_up = {"u": torch.tensor([0.1, 0.2, 0.3, 0.4])}
    u_down = {"u": torch.tensor([0.5, 0.6, 0.9, 0.8])}
    lp = torch.log(torch.tensor([[0.9, 0.1], [0.4, 0.6], [0.2, 0.8], [0.3, 0.7]]))
    out = T.evaluate_transfer(up_emb, up_y, down_emb, down_y, u_up, u_down, lp, mix_seed=0)
    assert out["r1"] == pytest.approx(0.5)
    assert out["up_r1"] == 1.0
    assert out["top1"] == pytest.approx(0.75) and out["top5"] is None  # two classes: top-5 is trivial
    m = out["uncertainty"]["u"]
    assert m["r_auroc"] == 1.0  # both misses (0.9, 0.8) above both hits (0.5, 0.6)
    assert m["ood_auroc"] == 1.0  # every downstream uncertainty above every upstream one
    assert m["up_r_auroc"] is None  # no upstream miss: undefined, not invented
    # Upstream error: only sample 1 (predicts class 1); u ranks it 2nd of 4 -> risks 0, 1/2, 1/3, 1/4.
    oracle = (0 + 0 + 0 + 1 / 4) / 4
    assert m["e_aurc"] == pytest.approx((0 + 1 / 2 + 1 / 3 + 1 / 4) / 4 - oracle)


def test_evaluate_transfer_r_auroc_agrees_with_the_library_metric():
    g = torch.Generator().manual_seed(3)
    up_emb, down_emb = torch.randn(60, 5, generator=g), torch.randn(50, 5, generator=g) * 3
    up_y, down_y = torch.arange(60) % 3, torch.arange(50) % 4
    u_up, u_down = {"u": torch.rand(60, generator=g)}, {"u": torch.rand(50, generator=g)}
    out = T.evaluate_transfer(up_emb, up_y, down_emb, down_y, u_up, u_down)
    assert out["uncertainty"]["u"]["r_auroc"] == pytest.approx(r_auroc(down_emb, down_y, u_down["u"].double()))
    assert out["top1"] is None and out["uncertainty"]["u"]["e_aurc"] is None


def test_mixed_set_never_matches_an_upstream_class_to_a_downstream_one():
    # Each downstream embedding is a copy of an upstream one with the same label index; in the 50/50 mix
    # every 1-NN is that twin from the other side, which is another class: all misses.
    emb = torch.tensor([[1.0, 0.0], [0.9, 0.5], [0.0, 1.0], [-0.5, 0.9]])
    y = torch.tensor([0, 0, 1, 1])
    u = {"u": torch.tensor([0.1, 0.2, 0.3, 0.4])}
    out = T.evaluate_transfer(emb, y, emb.clone(), y.clone(), u, u)
    assert out["r1"] == 1.0 and out["mixed_r1"] == 0.0
    assert out["uncertainty"]["u"]["mixed_r_auroc"] is None


# ------------------------------------------------------------------------------------------------ smoke


def test_every_listed_method_has_a_builder():
    assert list(T.METHODS)[:1] == ["ce"]
    assert {"ce", "mcinfonce", "elk", "nivmf", "hib", "qact-watershed"} <= set(T.METHODS)


def test_methods_are_declarative_records_over_the_registries():
    from shiftguard.losses import LOSS_REGISTRY
    from shiftguard.train.methods import OBJECTIVES, Method
    from shiftguard.uncertainty import ESTIMATOR_REGISTRY

    for m in T.METHODS.values():
        assert m.objective in OBJECTIVES
        if m.objective == "estimator":
            ESTIMATOR_REGISTRY.get(m.registry_name)
        elif m.objective != "cross_entropy":
            LOSS_REGISTRY.get(m.registry_name)
    with pytest.raises(ValueError, match="nope"):
        Method("x", "", "embedding", "nope")
    with pytest.raises(ValueError, match="objective"):
        Method("x", "", "hinge", "elk")
    with pytest.raises(ValueError, match="registry_name"):
        Method("x", "", "estimator")
    with pytest.raises(ValueError, match="method"):
        T.build_method("nope", 5, 1, 0)
    # a method of the user's own runs through the same build, training and read-out
    mine = Method("elk-qact", "ELK on a QACT LeNet", "embedding", "elk", activation="qact")
    model = T.build_method(mine, num_classes=5, in_channels=1, seed=0)
    assert model.default_uncertainty == "embedding_norm" and model.loss is not None


@pytest.mark.parametrize("name", sorted(T.METHODS))
def test_every_method_builds_trains_and_reports_its_uncertainties(name):
    d = _pair_data()
    torch.manual_seed(0)
    model = T.build_method(name, d.num_upstream_classes, int(d.train_x.shape[1]), seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    T.train_model(model, d.train_x, d.train_y, epochs=1, batch_size=20, seed=0)
    assert not model.training
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items() if k in before)
    emb, log_probs, unc = model.predict(d.down_x)
    assert emb.shape[0] == d.down_x.shape[0] and bool(torch.isfinite(emb).all())
    assert model.default_uncertainty in unc
    assert all(u.shape == (d.down_x.shape[0],) and bool(torch.isfinite(u).all()) for u in unc.values())
    has_classifier = T.METHODS[name].objective in ("cross_entropy", "estimator", "prototypes")
    assert (log_probs is not None) == has_classifier
    if log_probs is not None:
        assert log_probs.shape == (d.down_x.shape[0], d.num_upstream_classes)


def test_training_draws_its_batches_from_the_trainer():
    """train_model is Trainer.fit without validation on [0, 1] pixels (``preprocess=None``): the same
    weights as a Trainer set up by hand (its batch order, views and global seed come from ``seed`` and
    the epoch)."""
    from shiftguard.train import Trainer

    d = _pair_data()
    for name, loss, kw in (("ce", "cross_entropy", {}), ("infonce", None, {"two_views": True})):
        torch.manual_seed(0)
        a = T.build_method(name, 5, 1, seed=3)
        T.train_model(a, d.train_x, d.train_y, epochs=2, batch_size=16, seed=3)
        torch.manual_seed(0)
        b = T.build_method(name, 5, 1, seed=3)
        trainer = Trainer(
            b.network,
            b.loss if loss is None else loss,
            epochs=2,
            batch_size=16,
            seed=3,
            progress=False,
            preprocess=None,
            **kw,
        )
        trainer.fit(d.train_x, d.train_y, num_classes=5)
        for k, v in a.state_dict().items():
            assert torch.equal(v, b.state_dict()[k]), (name, k)


def test_two_methods_one_split_smoke_run_is_deterministic(tmp_path, capsys):
    d = _pair_data()
    res = T.run_benchmark(["synthetic"], ["ce", "elk"], [0], epochs=1, batch_size=16, data={"synthetic": d})
    assert [(r["method"], r["split"]) for r in res["runs"]] == [("ce", "synthetic"), ("elk", "synthetic")]
    ce = res["runs"][0]["metrics"]
    assert 0.0 <= ce["r1"] <= 1.0 and ce["top1"] is not None
    assert res["runs"][1]["metrics"]["top1"] is None  # ELK has no classifier
    u = ce["uncertainty"]["entropy"]
    assert 0.0 <= u["ood_auroc"] <= 1.0 and u["e_aurc"] >= -1e-12
    cell = res["summary"]["synthetic"]["ce"]["uncertainty"]["entropy"]["r1"]
    assert cell["n"] == 1 and cell["std"] is None and cell["mean"] == ce["r1"]
    again = T.run_one("ce", d, 0, epochs=1, batch_size=16)
    assert again["metrics"] == ce
    assert "R@1" in T.format_table(res["summary"]) and "| ce |" in T.format_table(res["summary"], markdown=True)
    saved = tmp_path / "transfer.json"
    saved.write_text(json.dumps(res))
    assert T.main(["--report", str(saved)]) == 0
    assert "elk" in capsys.readouterr().out


def test_summary_reports_mean_and_sample_std_over_seeds():
    runs = [
        {
            "split": "s",
            "method": "m",
            "seed": i,
            "default_uncertainty": "u",
            "metrics": {"r1": v, "top1": None, "uncertainty": {"u": {"r_auroc": v, "ood_auroc": None}}},
        }
        for i, v in enumerate([0.5, 0.7, 0.9])
    ]
    cell = T.summarize(runs)["s"]["m"]["uncertainty"]["u"]
    assert cell["r1"]["mean"] == pytest.approx(0.7)
    assert cell["r1"]["std"] == pytest.approx(math.sqrt(((0.2) ** 2 * 2) / 2))
    assert cell["top1"] == {"mean": None, "std": None, "n": 0}
    # Over splits: the mean of the per-split means; a value missing on one split gives no partial mean.
    other = [dict(r, split="t", metrics=dict(r["metrics"], r1=0.1)) for r in runs]
    across = T.across_splits(T.summarize(runs + other))["m"]
    assert across["n_splits"] == 2 and across["r1"] == pytest.approx((0.7 + 0.1) / 2)
    assert across["r_auroc"] == pytest.approx(0.7) and across["ood_auroc"] is None


def test_unknown_names_are_refused_before_any_training():
    with pytest.raises(ValueError, match="methods"):
        T.main(["--methods", "ce,nope", "--seeds", "0"])
    with pytest.raises(ValueError, match="splits"):
        T.main(["--splits", "cifar", "--seeds", "0"])
