"""shiftguard.train: the [QACT, App. B] training loop, determinism, checkpoints and resume."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from torch import nn

from shiftguard.models import build_model
from shiftguard.train import (
    CheckpointError,
    Trainer,
    load_checkpoint,
    load_latest_checkpoint,
    save_checkpoint,
    to_model_input,
    train_val_split,
)
from shiftguard.train.checkpoint import list_checkpoints


def patch_images(n: int = 240, num_classes: int = 4, seed: int = 0):
    """Learnable synthetic images: class c lights up the c-th 7x7 quadrant patch, plus noise."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % num_classes
    x = torch.randint(0, 60, (n, 1, 28, 28), generator=g)
    for c in range(num_classes):
        r, col = divmod(c, 2)
        x[y == c, :, r * 14 + 3 : r * 14 + 10, col * 14 + 3 : col * 14 + 10] += 180
    return x.clamp(0, 255).to(torch.uint8), y


def small_mlp():
    return build_model("mlp", num_classes=4, hidden=(32, 16))


def make_trainer(model, tmp_path=None, **kw):
    kw.setdefault("epochs", 2)
    kw.setdefault("batch_size", 32)
    kw.setdefault("progress", False)
    kw.setdefault("seed", 3)
    if tmp_path is not None:
        kw.setdefault("checkpoint_dir", tmp_path / "ckpt")
    return Trainer(model, **kw)


def fit(trainer, data):
    x, y = data
    tr, va = train_val_split(len(y))
    return trainer.fit(x[tr], y[tr], x[va], y[va], num_classes=4)


def weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


def test_split_is_80_20_seed_42_and_disjoint():
    tr, va = train_val_split(100)
    assert len(tr) == 80 and len(va) == 20
    assert set(tr.tolist()).isdisjoint(va.tolist()) and len(set(tr.tolist()) | set(va.tolist())) == 100
    tr2, va2 = train_val_split(100, seed=42)
    assert torch.equal(va, va2) and not torch.equal(va, train_val_split(100, seed=1)[1])


def test_cross_entropy_training_learns_a_separable_task():
    data = patch_images()
    torch.manual_seed(0)
    m = small_mlp()
    out = fit(make_trainer(m, epochs=6), data)
    assert out["best_val_acc"] > 0.9
    assert out["epochs_run"] == len(out["history"]) <= 6
    assert {"train_loss", "train_acc", "val_acc", "lr"} <= set(out["history"][0])


def test_embedding_loss_uses_nearest_class_mean_validation():
    from shiftguard.losses import watershed

    data = patch_images()
    torch.manual_seed(0)
    m = small_mlp()
    tr = make_trainer(m, loss=watershed.WatershedLoss(), epochs=4)
    assert tr.loss_on == "embeddings"
    out = fit(tr, data)
    assert out["best_val_acc"] > 0.8
    assert "train_acc" not in out["history"][0]


class _OwnObjective(nn.Module):
    """A model with its own objective: cross-entropy on its logits plus a penalty the trainer cannot
    know of (so training through ``training_loss`` is observable), and a call counter."""

    def __init__(self):
        super().__init__()
        self.net = small_mlp()
        self.extra = nn.Parameter(torch.ones(1))  # only training_loss depends on it
        self.calls = 0

    def embed(self, x):
        return self.net.embed(x)

    def forward(self, x):
        return self.net(x)

    def training_loss(self, x, y):
        self.calls += 1
        return nn.functional.cross_entropy(self(x), y) + self.extra.pow(2).sum()


def test_loss_model_trains_with_the_models_own_objective():
    data = patch_images()
    torch.manual_seed(0)
    m = _OwnObjective()
    tr = make_trainer(m, loss="model", epochs=3)
    assert tr.loss_on == "model"
    out = fit(tr, data)
    assert m.calls == 3 * tr.num_batches(train_val_split(len(data[1]))[0])
    assert out["best_val_acc"] > 0.9  # validated on the argmax of model(x)
    # the penalty was optimised (Adam moves the parameter by ~lr per step); plain CE leaves it alone
    assert float(m.extra.detach()) < 1.0 - 0.01
    plain = _OwnObjective()
    fit(make_trainer(plain, epochs=3), data)
    assert float(plain.extra.detach()) == 1.0


def test_loss_model_needs_a_training_loss_method():
    with pytest.raises(TypeError, match="training_loss"):
        make_trainer(small_mlp(), loss="model")
    with pytest.raises(ValueError, match="loss_on"):
        make_trainer(_OwnObjective(), loss="model", loss_on="logits")


def test_training_is_deterministic_given_the_seed():
    data = patch_images()
    results = []
    for _ in range(2):
        torch.manual_seed(0)
        m = small_mlp()
        fit(make_trainer(m), data)
        results.append(weights(m))
    assert_same_weights(*results)


def test_resume_gives_the_same_weights_as_an_uninterrupted_run(tmp_path):
    data = patch_images()
    torch.manual_seed(0)
    full = small_mlp()
    fit(make_trainer(full, tmp_path / "a", epochs=3, early_stopping_patience=0), data)

    torch.manual_seed(0)
    part = small_mlp()
    fit(make_trainer(part, tmp_path / "b", epochs=1, early_stopping_patience=0), data)
    # a fresh process: different global RNG state and a fresh model before resuming
    torch.manual_seed(123)
    resumed = small_mlp()
    out = make_trainer(resumed, tmp_path / "b", epochs=3, early_stopping_patience=0)
    x, y = data
    tr, va = train_val_split(len(y))
    res = out.fit(x[tr], y[tr], x[va], y[va], num_classes=4, resume=True)
    assert [h["epoch"] for h in res["history"]] == [1, 2, 3]
    assert_same_weights(weights(full), weights(resumed))


def test_resume_with_an_embedding_loss_matches_too(tmp_path):
    from shiftguard.losses import watershed

    data = patch_images(120)
    torch.manual_seed(0)
    full = small_mlp()
    fit(make_trainer(full, tmp_path / "a", loss=watershed.WatershedLoss(), early_stopping_patience=0), data)
    torch.manual_seed(0)
    part = small_mlp()
    fit(make_trainer(part, tmp_path / "b", loss=watershed.WatershedLoss(), epochs=1, early_stopping_patience=0), data)
    torch.manual_seed(7)
    resumed = small_mlp()
    x, y = data
    tr, va = train_val_split(len(y))
    make_trainer(resumed, tmp_path / "b", loss=watershed.WatershedLoss(), early_stopping_patience=0).fit(
        x[tr], y[tr], x[va], y[va], num_classes=4, resume=True
    )
    assert_same_weights(weights(full), weights(resumed))


def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    data = patch_images(120)
    torch.manual_seed(0)
    fit(make_trainer(small_mlp(), tmp_path, epochs=2, early_stopping_patience=0), data)
    ckpts = list_checkpoints(tmp_path / "ckpt")
    assert [e for e, _ in ckpts] == [1, 2]
    last = ckpts[-1][1]
    last.write_bytes(last.read_bytes()[:100])  # truncated by a crash
    with pytest.raises(CheckpointError, match="checksum"):
        load_checkpoint(last)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        state = load_latest_checkpoint(tmp_path / "ckpt")
    assert state["epoch"] == 1
    assert any("epoch-0002" in str(x.message) for x in w)


def test_checkpoint_without_checksum_is_treated_as_incomplete(tmp_path):
    p = save_checkpoint(tmp_path, 1, {"a": torch.ones(2)})
    p.with_name(p.name + ".sha256").unlink()
    with pytest.raises(CheckpointError, match="no checksum"):
        load_checkpoint(p)
    with pytest.warns(RuntimeWarning, match="no checksum"):
        assert load_latest_checkpoint(tmp_path) is None


def test_checkpoints_keep_only_the_newest_two(tmp_path):
    for e in range(1, 5):
        save_checkpoint(tmp_path, e, {"e": e})
    assert [e for e, _ in list_checkpoints(tmp_path)] == [3, 4]
    assert load_latest_checkpoint(tmp_path)["e"] == 4


def test_early_stopping_stops_and_keeps_the_best_weights():
    x, y = patch_images(80)
    y = y[torch.randperm(len(y))]  # labels unrelated to images: validation cannot improve
    torch.manual_seed(0)
    m = small_mlp()
    tr = make_trainer(m, epochs=30, early_stopping_patience=2, lr=1e-4)
    out = fit(tr, (x, y))
    assert out["stopped_early"] and out["epochs_run"] < 30
    assert_same_weights(weights(m), tr.best_model)


def test_metrics_log_has_one_json_line_per_epoch(tmp_path):
    data = patch_images(120)
    log = tmp_path / "metrics.jsonl"
    fit(make_trainer(small_mlp(), epochs=2, early_stopping_patience=0, metrics_log=log), data)
    lines = [json.loads(s) for s in log.read_text().splitlines()]
    assert [d["epoch"] for d in lines] == [1, 2] and all("val_acc" in d for d in lines)


def test_non_main_process_writes_nothing(tmp_path):
    fit(
        make_trainer(small_mlp(), tmp_path, epochs=1, metrics_log=tmp_path / "m.jsonl", is_main_process=False),
        patch_images(60),
    )
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "m.jsonl").exists()


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="loss"):
        Trainer(small_mlp(), loss="hinge")
    with pytest.raises(ValueError, match="epochs"):
        Trainer(small_mlp(), epochs=0)
    with pytest.raises(ValueError, match="resume"):
        x, y = patch_images(40)
        Trainer(small_mlp(), progress=False).fit(x, y, x, y, resume=True)
    with pytest.raises(TypeError, match="embed"):
        Trainer(nn.Linear(3, 2), loss=nn.MSELoss())


def test_without_validation_every_epoch_runs_and_the_last_weights_stay(tmp_path):
    x, y = patch_images(80)
    y = y[torch.randperm(len(y))]  # labels unrelated to images: a validated run would stop after 2 epochs
    torch.manual_seed(0)
    m = small_mlp()
    tr = make_trainer(m, tmp_path, epochs=4, early_stopping_patience=1)
    out = tr.fit(x, y, num_classes=4)
    assert out["epochs_run"] == 4 and not out["stopped_early"]
    assert out["best_epoch"] is None and out["best_val_acc"] is None
    assert all("val_acc" not in h for h in out["history"])
    assert_same_weights(weights(m), load_latest_checkpoint(tmp_path / "ckpt")["model"])  # the last epoch's
    # validation draws nothing: the first epoch trains exactly as a validated one
    torch.manual_seed(0)
    a = small_mlp()
    make_trainer(a, epochs=1).fit(x, y, num_classes=4)
    torch.manual_seed(0)
    b = small_mlp()
    make_trainer(b, epochs=1).fit(x, y, x[:20], y[:20], num_classes=4)
    assert_same_weights(weights(a), weights(b))
    with pytest.raises(ValueError, match="val_images, val_labels"):
        make_trainer(small_mlp()).fit(x, y, x[:20], num_classes=4)


def test_without_validation_a_resumed_run_ends_with_the_same_weights(tmp_path):
    x, y = patch_images(80)
    torch.manual_seed(0)
    full = small_mlp()
    make_trainer(full, tmp_path / "a", epochs=2).fit(x, y, num_classes=4)
    torch.manual_seed(0)
    make_trainer(small_mlp(), tmp_path / "b", epochs=1).fit(x, y, num_classes=4)
    resumed = small_mlp()
    make_trainer(resumed, tmp_path / "b", epochs=2).fit(x, y, num_classes=4, resume=True)
    assert_same_weights(weights(full), weights(resumed))


def test_preprocess_sees_unit_pixels_in_training_views_and_validation():
    from shiftguard.losses import InfoNCELoss

    x, y = patch_images(40)
    seen = []

    def record(pixels):  # the float [0, 1] pixels on the device, as shiftguard.evaluate's preprocess
        seen.append((pixels.shape[0], pixels.dtype, float(pixels.min()), float(pixels.max())))
        return pixels

    make_trainer(small_mlp(), epochs=1, batch_size=16, preprocess=record).fit(x, y, x[:10], y[:10])
    assert [n for n, *_ in seen] == [16, 16, 8, 10]  # three training batches, then the validation set
    assert all(dt == torch.float32 and 0.0 <= lo and hi <= 1.0 for _, dt, lo, hi in seen)
    seen.clear()
    make_trainer(small_mlp(), loss=InfoNCELoss(), two_views=True, epochs=1, batch_size=16, preprocess=record).fit(x, y)
    assert [n for n, *_ in seen] == [16, 32, 16, 32, 8, 16]  # each batch, then its two views
    # the default is to_model_input ([-1, 1]); None gives the model the [0, 1] pixels themselves
    trained = []
    for kw in ({}, {"preprocess": to_model_input}, {"preprocess": lambda p: p * 2 - 1}, {"preprocess": None}):
        torch.manual_seed(0)
        m = small_mlp()
        make_trainer(m, epochs=1, **kw).fit(x, y)
        trained.append(weights(m))
    assert_same_weights(trained[0], trained[1])
    assert_same_weights(trained[0], trained[2])
    assert not torch.equal(trained[0]["body.1.weight"], trained[3]["body.1.weight"])
    with pytest.raises(TypeError, match="preprocess"):
        make_trainer(small_mlp(), preprocess="unit")


def test_two_views_train_instance_discrimination_and_resume_identically(tmp_path):
    from shiftguard.losses import InfoNCELoss

    data = patch_images()
    x, y = data
    tr, va = train_val_split(len(y))
    kw = dict(loss=InfoNCELoss(), two_views=True, early_stopping_patience=0)
    torch.manual_seed(0)
    full = small_mlp()
    out = fit(make_trainer(full, tmp_path / "a", epochs=2, **kw), data)
    assert out["best_val_acc"] > 0.5  # nearest class mean of embeddings learnt without labels
    # the views are drawn per (seed, epoch): one run equals an interrupted and resumed one
    torch.manual_seed(0)
    part = small_mlp()
    fit(make_trainer(part, tmp_path / "b", epochs=1, **kw), data)
    torch.manual_seed(123)
    resumed = small_mlp()
    make_trainer(resumed, tmp_path / "b", epochs=2, **kw).fit(x[tr], y[tr], x[va], y[va], num_classes=4, resume=True)
    assert_same_weights(weights(full), weights(resumed))


def test_two_views_need_an_embedding_loss():
    with pytest.raises(ValueError, match="two_views"):
        make_trainer(small_mlp(), two_views=True)


# ----------------------------------------------------------------------------------------------- AugMix
MNIST_AUGMIX = dict(augmix=True, augmix_suite="mnist-c")


class _Recorder(nn.Module):
    """A model that keeps every training forward's input and logits."""

    def __init__(self, net):
        super().__init__()
        self.net = net
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def embed(self, x):
        return self.net.embed(x)

    def forward(self, x):
        out = self.net(x)
        if self.training:
            self.calls.append((x.detach().clone(), out.detach().clone()))
        return out


def test_augmix_training_is_deterministic_and_changes_what_is_learnt():
    data = patch_images(160)
    runs = {}
    for key, kw in {"clean": {}, "augmix": MNIST_AUGMIX, "jsd": dict(MNIST_AUGMIX, jsd_weight=12.0)}.items():
        ws = []
        for _ in range(2):
            torch.manual_seed(0)
            m = small_mlp()
            out = fit(make_trainer(m, epochs=1), data) if not kw else fit(make_trainer(m, epochs=1, **kw), data)
            ws.append(weights(m))
        assert_same_weights(*ws)  # same seed, same weights
        assert math.isfinite(out["history"][0]["train_loss"]) and "train_acc" in out["history"][0]
        runs[key] = (ws[0], out)
    for a, b in (("clean", "augmix"), ("augmix", "jsd")):
        assert not all(torch.equal(runs[a][0][k], runs[b][0][k]) for k in runs[a][0]), (a, b)
    # the operations used are recorded in the summary
    assert "augmix" not in runs["clean"][1]
    rec = runs["jsd"][1]["augmix"]
    assert rec["ops"] == ["autocontrast", "equalize", "posterize", "solarize"] and rec["suite"] == "mnist-c"
    assert rec["jsd_weight"] == 12.0 and runs["augmix"][1]["augmix"]["jsd_weight"] == 0.0


def test_plain_augmix_replaces_each_image_by_one_view():
    x, y = patch_images(160)
    tr_idx, va = train_val_split(len(y))
    model = _Recorder(small_mlp())
    t = make_trainer(model, epochs=1, **MNIST_AUGMIX)
    t.fit(x[tr_idx], y[tr_idx], x[va], y[va], num_classes=4)
    batches = list(t.batches(y[tr_idx], 1))
    assert len(model.calls) == len(batches)
    for (inp, _), idx in zip(model.calls, batches):
        clean = to_model_input(x[tr_idx][idx])
        assert inp.shape == clean.shape and float(inp.min()) >= -1 and float(inp.max()) <= 1
        assert not torch.allclose(inp, clean, atol=1e-3)


def test_jsd_forwards_clean_and_two_views_as_one_batch_and_adds_the_js_term():
    from shiftguard.corruptions import jensen_shannon_consistency

    x, y = patch_images(160)
    tr_idx, va = train_val_split(len(y))
    model = _Recorder(small_mlp())
    t = make_trainer(model, epochs=1, jsd_weight=5.0, **MNIST_AUGMIX)
    out = t.fit(x[tr_idx], y[tr_idx], x[va], y[va], num_classes=4)
    batches = list(t.batches(y[tr_idx], 1))
    assert len(model.calls) == len(batches)  # one forward per batch
    total, seen = 0.0, 0
    for (inp, logits), idx in zip(model.calls, batches):
        n = idx.numel()
        assert inp.shape[0] == 3 * n
        torch.testing.assert_close(inp[:n], to_model_input(x[tr_idx][idx]), rtol=0, atol=0)  # clean part first
        assert not torch.allclose(inp[n : 2 * n], inp[:n], atol=1e-3)
        assert not torch.allclose(inp[n : 2 * n], inp[2 * n :], atol=1e-3)  # two different views
        clean, v1, v2 = logits.split(n)
        loss = nn.functional.cross_entropy(clean, y[tr_idx][idx]) + 5.0 * jensen_shannon_consistency(clean, v1, v2)
        total, seen = total + loss.item() * n, seen + n
    assert out["history"][0]["train_loss"] == pytest.approx(total / seen, rel=1e-5)


def test_augmix_with_jsd_resumes_to_the_same_weights(tmp_path):
    data = patch_images(120)
    x, y = data
    tr, va = train_val_split(len(y))
    kw = dict(MNIST_AUGMIX, jsd_weight=12.0, early_stopping_patience=0)
    torch.manual_seed(0)
    full = small_mlp()
    fit(make_trainer(full, tmp_path / "a", epochs=2, **kw), data)
    torch.manual_seed(0)
    part = small_mlp()
    fit(make_trainer(part, tmp_path / "b", epochs=1, **kw), data)
    torch.manual_seed(123)
    resumed = small_mlp()
    make_trainer(resumed, tmp_path / "b", epochs=2, **kw).fit(x[tr], y[tr], x[va], y[va], num_classes=4, resume=True)
    assert_same_weights(weights(full), weights(resumed))


def test_augmix_with_an_embedding_loss_allows_views_and_refuses_jsd():
    from shiftguard.losses import watershed

    with pytest.raises(ValueError, match="^jsd_weight:.*logits"):
        make_trainer(small_mlp(), loss=watershed.WatershedLoss(), jsd_weight=12.0, **MNIST_AUGMIX)
    with pytest.raises(ValueError, match="^jsd_weight:"):
        make_trainer(_OwnObjective(), loss="model", jsd_weight=1.0, **MNIST_AUGMIX)
    torch.manual_seed(0)
    out = fit(make_trainer(small_mlp(), loss=watershed.WatershedLoss(), epochs=1, **MNIST_AUGMIX), patch_images(120))
    assert math.isfinite(out["history"][0]["train_loss"]) and out["augmix"]["jsd_weight"] == 0.0


def test_augmix_arguments_are_named():
    from shiftguard.corruptions import AugMix
    from shiftguard.losses import InfoNCELoss

    with pytest.raises(ValueError, match="^augmix_suite:"):
        make_trainer(small_mlp(), augmix=True)
    with pytest.raises(ValueError, match="^augmix_suite:"):
        make_trainer(small_mlp(), augmix_suite="mnist-c")
    with pytest.raises(ValueError, match="^augmix_suite:"):
        make_trainer(small_mlp(), augmix=AugMix("cifar-c"), augmix_suite="mnist-c")
    with pytest.raises(ValueError, match="^suite:"):
        make_trainer(small_mlp(), augmix=True, augmix_suite="imagenet-c")
    with pytest.raises(ValueError, match="^augmix:"):
        make_trainer(small_mlp(), augmix="yes")
    with pytest.raises(ValueError, match="^augmix:"):
        make_trainer(small_mlp(), loss=InfoNCELoss(), two_views=True, **MNIST_AUGMIX)
    with pytest.raises(ValueError, match="^jsd_weight:"):
        make_trainer(small_mlp(), jsd_weight=1.0)
    for bad in (-1.0, math.nan, math.inf, True):
        with pytest.raises(ValueError, match="^jsd_weight:"):
            make_trainer(small_mlp(), jsd_weight=bad, **MNIST_AUGMIX)
    own = AugMix("mnist-c", severity=5, width=2)
    assert make_trainer(small_mlp(), augmix=own, augmix_suite="MNIST_C").augmix is own
    with pytest.raises(ValueError, match="^images:"):
        Trainer(small_mlp(), progress=False, **MNIST_AUGMIX).fit(
            torch.rand(8, 784), torch.arange(8) % 2, torch.rand(4, 784), torch.arange(4) % 2
        )


@pytest.mark.parametrize("jsd_weight", [0.0, 1.0])
def test_augmix_views_depend_on_the_seed_and_epoch_only(jsd_weight):
    x, _ = patch_images(16)

    def views(seed, epoch, global_seed):
        torch.manual_seed(global_seed)  # the global generator plays no part
        t = make_trainer(small_mlp(), seed=seed, jsd_weight=jsd_weight, **MNIST_AUGMIX)
        return t._augmix_input(x, epoch)

    ref = views(3, 1, 0)
    assert torch.equal(ref, views(3, 1, 1))
    assert not torch.equal(ref, views(3, 2, 0)) and not torch.equal(ref, views(4, 1, 0))
