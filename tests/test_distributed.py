"""Distributed training: SyncQuantileActivation, DDP multistage step, DistributedTrainer.

Multi-process checks run 2 processes with gloo on 127.0.0.1 (``tests/_ddp_worker.py``), grouped in
two spawns (layer scenarios, training) to pay the process start-up once; each test then compares
the workers' saved results with a single-process reference computed here.
"""

from __future__ import annotations

import _ddp_worker as W
import pytest
import torch

from shiftguard.functional.kde import POINTS_PER_BANDWIDTH, gaussian_kde, kde_grid_error_bound
from shiftguard.functional.quantile import channel_values, qact_statistics
from shiftguard.nn.qact import QACTBlock, QuantileActivation
from shiftguard.nn.sync_qact import SyncQuantileActivation, convert_sync_qact, sketch_context, sketch_statistics

LAYER = dict(n_tau=20, n_samples=300)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The workers use one thread each; so does the reference here (fair and far faster on a busy
    2-core machine than torch's default thread pool)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _case(shape, sizes, seed, **layer):
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(*shape, generator=g, dtype=torch.float64),
        "gout": torch.randn(*shape, generator=g, dtype=torch.float64),
        "sizes": sizes,
        "seed": seed,
        "layer": {**LAYER, **layer},
    }


def _reference(d):
    """Plain QACT on the concatenated batch, same seed: output, input gradient, layer."""
    plain = {k: v for k, v in d["layer"].items() if k not in ("sketch_size", "exact_max")}
    layer = QuantileActivation(**plain).train()
    x = d["x"].clone().requires_grad_(True)
    torch.manual_seed(d["seed"])
    out = layer(x)
    out.backward(d["gout"])
    torch.manual_seed(d["seed"])
    stats = layer.batch_statistics(d["x"])  # the statistics that forward used (same seed)
    return out.detach(), x.grad, layer, stats


@pytest.fixture(scope="module")
def layer_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_layer")
    inputs = {
        "exact_dense": _case((8, 5), [4, 4], 1),
        "exact_conv": _case((6, 3, 4, 4), [3, 3], 2),
        "exact_unequal": _case((7, 4, 3), [5, 2], 3),
        "sampled": {
            f"hw{s}": _case((8, 3, s, s), [4, 4], 4, n_tau=100, n_samples=1000, sketch_size=256, exact_max=16)
            for s in (8, 16)
        },
    }
    g = torch.Generator().manual_seed(5)
    torch.manual_seed(5)
    inputs["multistage"] = {
        "state": W.TinyEmbedder().double().state_dict(),
        "sizes": [10, 10],
        "chunk": 4,
        "x": torch.randn(20, 6, generator=g, dtype=torch.float64),
        "y": torch.randint(0, 3, (20,), generator=g),
    }
    inputs["global_loss"] = {**inputs["multistage"], "sizes": [12, 8]}
    inputs["tiny"] = {
        "x": torch.randint(0, 256, (64, 1, 4, 4), generator=g, dtype=torch.uint8),
        "y": torch.randint(0, 3, (64,), generator=g),
    }
    scenarios = [
        "exact_dense",
        "exact_conv",
        "exact_unequal",
        "sampled",
        "eval_mode_is_local",
        "multistage",
        "global_batch_loss",
        "trainer_equivalence",
        "loader_shards",
        "trainer_multistage",
    ]
    W.spawn(scenarios, out, inputs)
    results = {n: [torch.load(out / f"{n}_rank{r}.pt", weights_only=False) for r in range(2)] for n in scenarios}
    return inputs, results


def _check_exact(inputs, results, name):
    d = inputs[name]
    ref_out, ref_grad, ref_layer, s = _reference(d)
    res = results[name]
    assert [r["mode"] for r in res] == ["exact", "exact"]
    # Forward: bit-identical to the single-process layer on the full batch.
    torch.testing.assert_close(torch.cat([r["out"] for r in res]), ref_out, rtol=0, atol=0)
    # Identical statistics (and running buffers) on every process and in the reference.
    for r in res:
        for k, v in ref_layer.state_dict().items():
            torch.testing.assert_close(r["buffers"][k], v, rtol=0, atol=0)
    # Backward: same KDE; the grid KDE lays its grid over each process's own inputs, so the two
    # may differ by twice its error bound (docs/qact.md), scaled by |grad_output|.
    bound = kde_grid_error_bound(s.bandwidth, s.bandwidth / POINTS_PER_BANDWIDTH).max()
    grad = torch.cat([r["grad"] for r in res])
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=float(2 * bound * d["gout"].abs().max()) + 1e-12)
    # ... and both follow the exact KDE of the shared samples [QACT, Alg. 2, eq. (7)].
    exact = gaussian_kde(channel_values(d["x"]), s.samples, s.bandwidth)
    exact = exact.reshape(d["x"].shape[1], d["x"].shape[0], *d["x"].shape[2:]).transpose(0, 1)
    torch.testing.assert_close(grad, d["gout"] * exact, rtol=0, atol=float(bound * d["gout"].abs().max()) + 1e-12)


def test_exact_mode_equals_single_process_on_the_full_batch_dense(layer_results):
    _check_exact(*layer_results, "exact_dense")


def test_exact_mode_equals_single_process_on_the_full_batch_conv(layer_results):
    _check_exact(*layer_results, "exact_conv")


def test_exact_mode_handles_unequal_batch_parts(layer_results):
    _check_exact(*layer_results, "exact_unequal")


def test_sampled_mode_communication_does_not_grow_with_image_size(layer_results):
    inputs, results = layer_results
    sent = {k: [r[k]["sent"] for r in results["sampled"]] for k in ("hw8", "hw16")}
    assert [r["hw8"]["mode"] for r in results["sampled"]] == ["sampled", "sampled"]
    c, k = 3, 256
    assert sent["hw8"] == sent["hw16"] == [2 + c + c * k] * 2  # header + sketch, per process


def test_sampled_mode_is_close_to_exact(layer_results):
    inputs, results = layer_results
    for key in ("hw8", "hw16"):
        d = inputs["sampled"][key]
        ref_out, ref_grad, _, _ = _reference(d)
        out = torch.cat([r[key]["out"] for r in results["sampled"]])
        diff = (out - ref_out).abs()
        # Each sketch value stands for n/128 values of its side, so quantile levels move by about
        # 1/128 of a side (1/256 overall): outputs differ by at most one QACT step (1/n_tau) and
        # rarely at all.
        assert float(diff.max()) <= 1 / 100 + 1e-9
        assert float((diff > 0).double().mean()) < 0.1
        grad = torch.cat([r[key]["grad"] for r in results["sampled"]])
        # Density from 1000 samples of a sketch vs of the full context: Monte-Carlo close.
        rel = (grad - ref_grad).norm() / ref_grad.norm()
        assert float(rel) < 0.1


def test_sync_layer_in_eval_mode_runs_no_collective(layer_results):
    _, results = layer_results
    assert [r["mode"] for r in results["eval_mode_is_local"]] == ["local", "local"]


def test_distributed_multistage_step_matches_single_process_full_batch(layer_results):
    from shiftguard.train.multistage import multistage_step

    inputs, results = layer_results
    d = inputs["multistage"]
    model = W.TinyEmbedder().double()
    model.load_state_dict(d["state"])
    ref_loss = multistage_step(model, W.pairwise_loss, d["x"], d["y"], d["chunk"])
    for r in results["multistage"]:
        torch.testing.assert_close(r["loss"], ref_loss)
        for n, p in model.named_parameters():
            if n.startswith("classifier"):  # unused by an embedding loss: no gradient, or zero under DDP
                assert r["grads"][n] is None or not r["grads"][n].any()
                continue
            torch.testing.assert_close(r["grads"][n], p.grad, rtol=1e-10, atol=1e-12)


def test_global_batch_loss_gives_the_full_batch_gradient_under_ddp(layer_results):
    inputs, results = layer_results
    d = inputs["global_loss"]
    model = W.TinyEmbedder().double()
    model.load_state_dict(d["state"])
    ref_loss = W.pairwise_loss(model.embed(d["x"]), d["y"])
    ref_loss.backward()
    for r in results["global_batch_loss"]:
        torch.testing.assert_close(r["loss"], ref_loss.detach())
        for n, p in model.named_parameters():
            if p.grad is None:
                continue
            torch.testing.assert_close(r["grads"][n], p.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("loss_name", ["cross_entropy", "pairwise"])
def test_distributed_trainer_equals_single_process_training_without_batchnorm(layer_results, loss_name):
    from shiftguard.train import Trainer

    inputs, results = layer_results
    model, summary = W.fit_tiny(loss_name, inputs["tiny"], Trainer)
    for r in results["trainer_equivalence"]:
        assert r[loss_name]["val_acc"] == summary["best_val_acc"]
        for k, v in model.state_dict().items():
            # Same global batches, synchronised QACT context and full-batch loss: the same training
            # up to the grid KDE's interpolation error in the backward (see the exact-mode tests).
            torch.testing.assert_close(r[loss_name]["state"][k], v, rtol=0, atol=1e-4)


def test_distributed_loader_gives_each_process_a_disjoint_shard(layer_results):
    _, results = layer_results
    a, b = (r["items"] for r in results["loader_shards"])
    assert len(a) == len(b) == 5 and sorted(a + b) == list(range(10))


# --------------------------------------------------------------------------- single process
def test_sync_layer_without_process_group_is_the_plain_layer():
    x = torch.randn(16, 4, 3)
    torch.manual_seed(3)
    a = QuantileActivation(n_tau=10, n_samples=100)(x)
    torch.manual_seed(3)
    layer = SyncQuantileActivation(n_tau=10, n_samples=100)
    b = layer(x)
    assert torch.equal(a, b) and layer.last_mode == "local"


def test_convert_sync_qact_replaces_layers_and_keeps_state():
    block = QACTBlock(4, n_tau=10, n_samples=50)
    block(torch.randn(32, 4))  # running statistics move away from the defaults
    block.eval()
    before = block.state_dict()
    conv = convert_sync_qact(block, exact_max=64, sketch_size=32)
    assert isinstance(conv.act, SyncQuantileActivation) and conv.act.exact_max == 64 and conv.act.sketch_size == 32
    assert not conv.act.training and conv.act.n_tau == 10 and conv.act.n_samples == 50
    after = conv.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    top = convert_sync_qact(QuantileActivation(n_tau=7))
    assert isinstance(top, SyncQuantileActivation) and top.n_tau == 7


def test_sketch_statistics_with_every_value_sent_equal_exact_statistics():
    x = torch.randn(3, 50, dtype=torch.float64)
    parts = [sketch_context(v, 200) for v in (x[:, :30], x[:, 30:])]
    st = sketch_statistics(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]), n_tau=20)
    ref = qact_statistics(x, n_tau=20)
    torch.testing.assert_close(st.quantiles, ref.quantiles)


def test_a_fixed_bandwidth_survives_the_sync_conversion_and_the_sketch():
    block = QACTBlock(4, n_tau=10, n_samples=50, bandwidth=0.5)
    conv = convert_sync_qact(block)
    assert conv.act.bandwidth == 0.5 and torch.equal(conv.act.running_bandwidth, torch.full((4,), 0.5))
    x = torch.randn(3, 50, dtype=torch.float64)
    parts = [sketch_context(v, 200) for v in (x[:, :30], x[:, 30:])]
    sketches, counts = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    fixed = sketch_statistics(sketches, counts, n_tau=20, bandwidth=0.5)
    rule = sketch_statistics(sketches, counts, n_tau=20)
    assert torch.equal(fixed.bandwidth, torch.full((3,), 0.5, dtype=torch.float64))
    assert not torch.equal(rule.bandwidth, fixed.bandwidth)
    torch.testing.assert_close(fixed.quantiles, rule.quantiles)


def test_sketch_context_keeps_exact_side_counts():
    v = torch.tensor([[-3.0, -1.0, 0.0, 2.0, 5.0, -2.0]])
    sketch, counts = sketch_context(v, 4)
    assert counts.tolist() == [[3, 3]]
    assert sketch.shape == (1, 4)
    assert sketch[0, :2].tolist() == [-3.0, -1.0]  # mid-ranks floor((2j+1)*3/4) = 0, 2 of the negatives
    assert sketch[0, 2:].tolist() == [0.0, 5.0]


@pytest.mark.parametrize(
    "kw, match",
    [({"sketch_size": 3}, "sketch_size"), ({"sketch_size": 0}, "sketch_size"), ({"exact_max": 0}, "exact_max")],
)
def test_sync_layer_rejects_bad_options(kw, match):
    with pytest.raises(ValueError, match=match):
        SyncQuantileActivation(**kw)


def test_free_port_and_launch_command_target_loopback():
    from shiftguard.train.distributed import launch_command

    cmd = launch_command(["run", "--quick"], 2, master_port=29999)
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--nnodes=1"]
    assert "--nproc_per_node=2" in cmd and "--master_addr=127.0.0.1" in cmd
    assert cmd[-3:] == ["shiftguard", "run", "--quick"]
    with pytest.raises(ValueError, match="nproc"):
        launch_command(["run"], 0)


def test_init_distributed_outside_torchrun_is_a_single_process(monkeypatch):
    from shiftguard.train import distributed as D

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    info = D.init_distributed("cpu")
    assert (info.rank, info.world_size, info.is_main, info.distributed, info.backend) == (0, 1, True, False, None)
    assert not D.is_distributed() and D.get_world_size() == 1 and D.is_main_process()
    assert D.broadcast_object({"a": 1}) == {"a": 1}


def test_distributed_trainer_with_one_process_is_the_plain_trainer():
    from shiftguard.train import Trainer
    from shiftguard.train.distributed import DistributedTrainer

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (64, 1, 4, 4), generator=g, dtype=torch.uint8)
    y = torch.randint(0, 3, (64,), generator=g)
    states = []
    for cls in (Trainer, DistributedTrainer):
        torch.manual_seed(0)
        from shiftguard.models import build_model

        m = build_model("mlp", activation="qact", num_classes=3, input_size=4, hidden=(8,))
        cls(m, epochs=1, batch_size=16, progress=False).fit(x, y, x[:16], y[:16], num_classes=3)
        states.append(m.state_dict())
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


# --------------------------------------------------------------------------- training
@pytest.fixture(scope="module")
def training_results(tmp_path_factory):
    from shiftguard.data import load_default
    from shiftguard.models import build_model
    from shiftguard.train import Trainer
    from shiftguard.train.trainer import to_model_input

    out = tmp_path_factory.mktemp("ddp_train")
    train, test = load_default("train"), load_default("test")
    d = {
        "x": train.images[:3000],
        "y": train.labels[:3000],
        "vx": train.images[3000:3500],
        "vy": train.labels[3000:3500],
        "tx": test.images[:1000],
        "ty": test.labels[:1000],
        "batch_size": 64,
        "activation": "qact",
    }
    W.spawn(["train_mlp"], out, {"train": d})
    results = [torch.load(out / f"train_mlp_rank{r}.pt", weights_only=False) for r in range(2)]
    torch.manual_seed(0)
    model = build_model("mlp", activation="qact", num_classes=10, hidden=(64, 32))
    single = Trainer(model, epochs=1, batch_size=64, progress=False, early_stopping_patience=0)
    single.fit(d["x"], d["y"], d["vx"], d["vy"], num_classes=10)
    model.eval()
    with torch.no_grad():
        acc = float((model(to_model_input(d["tx"])).argmax(1) == d["ty"]).float().mean())
    return out, results, acc


def test_two_process_training_matches_one_process_accuracy(training_results):
    _, results, single_acc = training_results
    assert results[0]["sync_layers"] == 2  # the trainer converted both QACT layers of the MLP
    # Both processes end with the same weights (DDP) and therefore the same test accuracy.
    for k, v in results[0]["state"].items():
        torch.testing.assert_close(results[1]["state"][k], v)
    # Same global batches and global QACT context; the only differences are per-process BatchNorm
    # statistics (SyncBatchNorm has no CPU kernel) and float summation order. One epoch on 3000
    # MNIST images reaches ~0.85-0.9; 0.03 is ~3 binomial standard errors on 1000 test images.
    assert results[0]["test_acc"] > 0.7
    assert abs(results[0]["test_acc"] - single_acc) <= 0.03


def test_only_rank_zero_writes_training_files(training_results):
    out, results, _ = training_results
    assert (out / "files_rank0" / "metrics.jsonl").is_file()
    assert any((out / "files_rank0" / "checkpoints").iterdir())
    assert not (out / "files_rank1").exists()
    assert results[0]["summary"]["best_val_acc"] == results[1]["summary"]["best_val_acc"]


def test_distributed_trainer_multistage_equals_single_process_multistage(layer_results):
    from shiftguard.train import Trainer

    inputs, results = layer_results
    model, summary = W.fit_tiny("pairwise", inputs["tiny"], Trainer, act="tanh", chunk_size=4)
    for r in results["trainer_multistage"]:
        assert r["val_acc"] == summary["best_val_acc"]
        for k, v in model.state_dict().items():
            torch.testing.assert_close(r["state"][k], v, rtol=0, atol=1e-8)


# --------------------------------------------------------------------------- command line
TINY_RUN = """
name = "ddp-tiny"
seed = 0
[data]
dataset = "mnist-default"
train_subset = 400
test_subset = 100
corruptions = ["shot_noise"]
severities = [1]
corrupted_source = "engine"
[train]
epochs = 1
batch_size = 50
[eval]
batch_size = 100
frozen_context = false
[[models]]
name = "mlp-qact-watershed"
arch = "mlp"
activation = "qact"
loss = "watershed"
heads = ["knn"]
model_kwargs = { hidden = [32, 16] }
"""


def test_cli_nproc_2_trains_and_evaluates_with_two_processes_and_rank_zero_writes(tmp_path):
    import json
    import os
    import shutil
    import subprocess
    import sys

    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY_RUN)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shiftguard",
            "run",
            "--config",
            str(cfg),
            "--nproc",
            "2",
            "--out",
            str(tmp_path / "runs"),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "ddp-tiny"
    assert (run / "COMPLETE").is_file() and (run / "results.json").is_file()
    assert (run / "models" / "mlp-qact-watershed" / "model.pt").is_file()
    # Only rank 0 logs: each line of the run's story appears once although two processes trained.
    assert proc.stdout.count("trained mlp-qact-watershed") == 1
    assert proc.stdout.count("wrote ") == 1
    assert "world_size" not in proc.stderr  # torchrun did not report a failed worker
    # Both processes evaluated their share of the grid, on the weights rank 0 wrote: one process
    # evaluating those weights from scratch (--resume loads model.pt; no cached outputs) agrees.
    sharded = json.loads((run / "results.json").read_text())
    assert sharded["timings"]["evaluate_detail"]["processes"] == 2
    shutil.rmtree(run / "cache")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shiftguard",
            "run",
            "--config",
            str(cfg),
            "--resume",
            "--out",
            str(tmp_path / "runs"),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    single = json.loads((run / "results.json").read_text())
    assert single["timings"]["evaluate_detail"]["processes"] == 1
    assert single["rows"] and single["rows"] == sharded["rows"] and single["intervals"] == sharded["intervals"]


def test_relaunch_argv_keeps_every_option_but_nproc():
    import argparse

    from shiftguard.commands import run

    parser = argparse.ArgumentParser()
    run.add_arguments(parser)
    args = parser.parse_args(["--quick", "--nproc", "2", "--name", "x", "--epochs", "3", "--out", "o"])
    argv = run.relaunch_argv(args)
    assert "--nproc" not in argv and "--quick" in argv
    assert parser.parse_args(argv) == argparse.Namespace(**{**vars(args), "nproc": 0})


# --------------------------------------------------------------------------- sharded evaluation
# Two processes share the evaluation grid (``evaluate(distributed=True)`` / ``run_grid``); what
# they return must be what one process computes, bit for bit. The workers are forked from the
# test process and defined here, so that only this section depends on them.
GRID_HEADS = ["softmax", "temperature", "logistic", "ned", "knn"]


def _grid_inputs():
    """Tiny data and two untrained models (one with QACT, so two contexts): 3 models x contexts,
    clean + 2 corruptions x 2 severities = 5 cells, 15 units for 2 processes to split."""
    from shiftguard.models import build_model

    g = torch.Generator().manual_seed(0)
    y = torch.arange(120) % 3
    x = (torch.rand(120, 1, 12, 12, generator=g) * 200).to(torch.uint8)
    x[y == 1, :, :6] += 50
    torch.manual_seed(0)
    models = {
        "relu": build_model("mlp", activation="relu", num_classes=3, input_size=12, hidden=(16, 8)),
        "qact": build_model("mlp", activation="qact", num_classes=3, input_size=12, hidden=(16, 8)),
    }
    return models, dict(
        test=(x[:60], y[:60]),
        support=(x[60:100], y[60:100]),
        validation=(x[100:], y[100:]),
        corruptions=["fog", "shot_noise"],
        severities=[2, 5],
        heads=GRID_HEADS,
        n_boot=50,
        batch_size=20,
    )


def _comparable(results: dict) -> dict:
    """Everything a results dict reports but its time stamp and timings."""
    return {k: v for k, v in results.items() if k not in ("created", "timings")}


def _sharded_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import os
    import traceback
    from pathlib import Path

    import torch.distributed as dist

    import shiftguard
    from shiftguard.evaluation.cache import OutputCache
    from shiftguard.train.distributed import all_gather_results

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        written = []  # the cache files this process wrote (a miss is computed and written)
        compute = OutputCache.get_or_compute

        def recording(self, key, fn, *rest):
            misses = self.misses
            out = compute(self, key, fn, *rest)
            if self.misses > misses:
                written.append(str(self.path(key).relative_to(out_dir)))
            return out

        OutputCache.get_or_compute = recording  # this forked process only
        models, kw = _grid_inputs()
        res = shiftguard.evaluate(models, **kw, cache_dir=Path(out_dir) / "cache", distributed=True)
        try:  # a failure on one process is raised on every process, not left as a hang
            all_gather_results(lambda: 1 // (1 - rank), "the probe")
            failure = None
        except Exception as exc:
            failure = f"{type(exc).__name__}: {exc}"
        torch.save(
            {
                "results": _comparable(res.results),
                "processes": res.results["timings"]["evaluate_detail"]["processes"],
                "written": written,
                "failure": failure,
            },
            Path(out_dir) / f"sharded_rank{rank}.pt",
        )
    except Exception:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded_results(tmp_path_factory):
    import torch.multiprocessing as mp

    from shiftguard.train.distributed import find_free_port

    out = tmp_path_factory.mktemp("sharded_eval")
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(_sharded_worker, args=(2, find_free_port(), str(out)), nprocs=2, join=True, start_method=method)
    return out, [torch.load(out / f"sharded_rank{r}.pt", weights_only=False) for r in range(2)]


def test_sharded_evaluation_equals_one_process_on_every_process(sharded_results):
    import shiftguard

    _, results = sharded_results
    models, kw = _grid_inputs()
    single = _comparable(shiftguard.evaluate(models, **kw).results)
    assert len(single["rows"]) == 5 * 3 * len(GRID_HEADS)
    for r in results:
        assert r["processes"] == 2
        # rows (in the same order), reliability pools, bootstrap intervals, aggregates: all equal
        for key in ("rows", "reliability", "intervals", "aggregates", "drops", "models", "skipped_heads"):
            assert r["results"][key] == single[key], key
        assert r["results"] == single


def test_sharded_evaluation_writes_each_cached_output_once(sharded_results):
    out, results = sharded_results
    a, b = (set(r["written"]) for r in results)
    on_disk = {str(p.relative_to(out)) for p in (out / "cache").rglob("*.pt")}
    # support + validation + 5 cells for each of the 3 (model, context) pairs
    assert len(on_disk) == 3 * 7
    assert a and b and not a & b and a | b == on_disk
    assert sum(len(r["written"]) for r in results) == len(on_disk)  # no file written twice by one process


def test_a_failure_on_one_process_is_raised_on_every_process(sharded_results):
    _, results = sharded_results
    assert results[1]["failure"].startswith("ZeroDivisionError")
    assert results[0]["failure"] == (
        "RuntimeError: the probe: process 1 of 2 failed: ZeroDivisionError: integer division or modulo by zero"
    )


def test_grid_shards_give_every_job_and_unit_to_exactly_one_process():
    from shiftguard.evaluation.grid import grid_shards

    for n_jobs, n_cells, world in [(3, 5, 2), (1, 1, 3), (4, 76, 3), (2, 3, 1)]:
        shards = [grid_shards(n_jobs, n_cells, r, world) for r in range(world)]
        assert sorted(j for jobs, _ in shards for j in jobs) == list(range(n_jobs))
        # contiguous runs in rank order whose sizes differ by at most one
        assert [u for _, units in shards for u in units] == list(range(n_jobs * n_cells))
        sizes = [len(units) for _, units in shards]
        assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(
    "kw, match",
    [({"n": -1}, "^n:"), ({"rank": 2}, "^rank:"), ({"world_size": 0}, "^world_size:"), ({"rank": True}, "^rank:")],
)
def test_shard_range_rejects_bad_arguments_naming_them(kw, match):
    from shiftguard.train.distributed import shard_range

    with pytest.raises((ValueError, TypeError), match=match):
        shard_range(**{"n": 4, "rank": 0, "world_size": 2, **kw})


def test_gathering_outside_a_process_group_is_the_local_result():
    from shiftguard.train.distributed import all_gather_results, broadcast_module

    assert all_gather_results(lambda: {"a": 1}) == [{"a": 1}]
    lin = torch.nn.Linear(2, 2)
    before = {k: v.clone() for k, v in lin.state_dict().items()}
    broadcast_module(lin)
    assert all(torch.equal(before[k], v) for k, v in lin.state_dict().items())


def test_no_process_reaches_the_grid_before_the_cache_fingerprints_are_written(tmp_path, monkeypatch):
    """A process that wrote its first outputs while another was still checking the cache folders
    would show that one outputs without a fingerprint: the check ends in a barrier, after the
    fingerprints are written."""
    import importlib

    import shiftguard.train.distributed as D

    E = importlib.import_module("shiftguard.evaluation.evaluate")  # the module, not the function
    from shiftguard.evaluation.cache import FINGERPRINT_FILE
    from shiftguard.evaluation.outputs import ModelOutputs

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 3))
    seen = []
    monkeypatch.setattr(D, "barrier", lambda: seen.append((tmp_path / "m" / FINGERPRINT_FILE).is_file()))
    monkeypatch.setattr(D, "is_main_process", lambda: True)
    x, y = torch.rand(6, 1, 4, 4), torch.arange(6) % 3
    from shiftguard.evaluation.plan import EvaluationPlan, ModelEntry

    entry = ModelEntry("m", model, ModelOutputs(model), ["softmax"])
    plan = EvaluationPlan(
        models=[entry],
        test=(x, y),
        cells=[],
        shifted=lambda c, s: x,
        num_classes=3,
        cache_root=tmp_path,
        batch_size=4,
        distributed=True,
    )
    E._check_cache(plan, preprocess=None, output="logits", embed=None, source="engine", suite="mnist-c")
    assert seen == [True]


def test_gathered_results_are_loaded_through_the_receiving_process_map_location():
    """A peer's fitted heads travel with their tensors' devices; ``map_location`` is applied to
    every tensor inside them (the grid passes the process's own device)."""
    from shiftguard.heads import build_head
    from shiftguard.train import distributed as D

    x = torch.randn(12, 4)
    head = build_head("knn", 3, k=2).fit(x, torch.arange(12) % 3)
    seen = []

    def where(storage, location):
        seen.append(location)
        return storage

    back = D._loads(D._dumps({"head": head, "rows": [{"a": 1.0}]}), where)
    assert seen and set(seen) == {"cpu"}
    assert back["rows"] == [{"a": 1.0}]
    assert torch.equal(back["head"].predict_proba(x), head.predict_proba(x))
