"""Fuzzing every file loader: damaged files fail clearly, pickles never run code.

Each format is built small and valid, then damaged by seeded random truncations and byte flips
(half of the flips aimed at the first 64 bytes, where headers live). Every damaged file must either

* raise ``ValueError`` whose message names the damaged file (``FileNotFoundError`` naming it is
  accepted too when a flipped byte renames a file an index lists), or
* load successfully with valid output (a flip inside pixel data is legitimately invisible): the
  shapes, dtypes and label ranges are checked.

Anything else (``EOFError``, ``zlib.error``, ``UnicodeDecodeError`` without the path, a crash, a
huge allocation) fails the test. A second group checks that loading a pickle-based file never
executes code from it: a malicious ``__reduce__`` that would create a marker file is refused and
the marker never appears.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from shiftguard.data import load
from shiftguard.data.idx import encode_idx

CASES = 60  # damaged files per format


def record(**row) -> None:
    """Append one outcome row for ``benchmarks/reliability_summary.py`` (no-op unless asked)."""
    path = os.environ.get("SHIFTGUARD_RELIABILITY_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"file": "test_fuzz_loaders.py", **row}) + "\n")


def damage(blob: bytes, rng: random.Random) -> tuple[str, bytes]:
    b = bytearray(blob)
    if rng.random() < 0.4:
        return "truncation", bytes(b[: rng.randrange(len(b))])
    head = rng.random() < 0.5
    for _ in range(rng.randint(1, 6)):
        b[rng.randrange(min(64, len(b)) if head else len(b))] = rng.randrange(256)
    return "flip", bytes(b)


def check_dataset(ds, num_classes: int, channels: int) -> None:
    assert ds.images.dtype == torch.uint8 and ds.images.dim() == 4 and ds.images.shape[1] == channels
    assert ds.labels.dtype == torch.int64 and ds.labels.shape == (ds.images.shape[0],)
    assert len(ds.classes) == num_classes
    if ds.labels.numel():
        assert 0 <= int(ds.labels.min()) and int(ds.labels.max()) < num_classes


# ------------------------------------------------------------------------------------------ builders
# Each builder writes a valid dataset under ``d`` and returns ``(files to damage, read(d), validate)``.
def build_idx(d: Path, gz: bool):
    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    blobs = {
        "t10k-images-idx3-ubyte": encode_idx(rng.integers(0, 256, (8, 28, 28), dtype=np.uint8)),
        "t10k-labels-idx1-ubyte": encode_idx(rng.integers(0, 10, 8).astype(np.uint8)),
    }
    files = []
    for stem, data in blobs.items():
        p = d / (stem + (".gz" if gz else ""))
        p.write_bytes(gzip.compress(data) if gz else data)
        files.append(p)
    return files, lambda: load("mnist", "test", root=d), lambda ds: check_dataset(ds, 10, 1)


def build_embedded(d: Path):
    """The shipped MNIST subset (a copy): damage must be caught by its sha256 manifest."""
    from shiftguard.data import embedded

    shutil.copytree(embedded.EMBEDDED_DIR, d)
    files = [d / "t10k-labels-idx1-ubyte.gz", d / "manifest.json"]
    return files, lambda: embedded.load_embedded("test", folder=d), lambda ds: check_dataset(ds, 10, 1)


def build_cifar(d: Path):
    root = d / "cifar-10-batches-py"
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    batch = {
        b"data": rng.integers(0, 256, (6, 3072), dtype=np.uint8),
        b"labels": [0, 1, 2, 3, 4, 9],
        b"batch_label": b"testing batch 1 of 1",
        b"filenames": [b"f.png"] * 6,
    }
    for name in ["test_batch"] + [f"data_batch_{i}" for i in range(1, 6)]:
        (root / name).write_bytes(pickle.dumps(batch, protocol=2))
    (root / "batches.meta").write_bytes(
        pickle.dumps({b"label_names": [f"c{i}".encode() for i in range(10)]}, protocol=2)
    )
    return (
        [root / "test_batch", root / "batches.meta"],
        lambda: load("cifar10", "test", root=d),
        lambda ds: check_dataset(ds, 10, 3),
    )


def build_cifar_c(d: Path):
    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    np.save(d / "fog.npy", rng.integers(0, 256, (10, 32, 32, 3), dtype=np.uint8))
    np.save(d / "labels.npy", rng.integers(0, 10, 10))
    return (
        [d / "fog.npy", d / "labels.npy"],
        lambda: load("cifar10-c", "test", root=d, corruption="fog", severity=2),
        lambda ds: check_dataset(ds, 10, 3),
    )


def build_mnist_c(d: Path):
    sub = d / "fog"
    sub.mkdir(parents=True)
    rng = np.random.default_rng(0)
    np.save(sub / "test_images.npy", rng.integers(0, 256, (6, 28, 28, 1), dtype=np.uint8))
    np.save(sub / "test_labels.npy", rng.integers(0, 10, 6))
    return (
        [sub / "test_images.npy", sub / "test_labels.npy"],
        lambda: load("mnist-c", "test", root=d, corruption="fog"),
        lambda ds: check_dataset(ds, 10, 1),
    )


def build_imagefolder(d: Path):
    from PIL import Image

    rng = np.random.default_rng(0)
    files = []
    for cls in ("cat", "dog"):
        (d / cls).mkdir(parents=True)
        for i, ext in enumerate((".png", ".jpg", ".bmp")):
            p = d / cls / f"img{i}{ext}"
            Image.fromarray(rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)).save(p)
            files.append(p)
    return files, lambda: load("imagefolder", "train", root=d), lambda ds: check_dataset(ds, 2, 3)


def build_tinyimagenet(d: Path):
    """Tiny-ImageNet-200 layout (text index files + JPEGs), validation split."""
    from PIL import Image

    wnids = ["n01443537", "n01629819"]
    (d / "val" / "images").mkdir(parents=True)
    (d / "wnids.txt").write_text("\n".join(wnids) + "\n")
    (d / "words.txt").write_text("n01443537\tgoldfish, Carassius auratus\nn01629819\tEuropean fire salamander\n")
    rng = np.random.default_rng(0)
    lines = []
    for i in range(4):
        Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(d / "val" / "images" / f"val_{i}.JPEG")
        lines.append(f"val_{i}.JPEG\t{wnids[i % 2]}\t0\t0\t7\t7")
    (d / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    files = [d / "wnids.txt", d / "words.txt", d / "val" / "val_annotations.txt", d / "val" / "images" / "val_1.JPEG"]
    return files, lambda: load("tinyimagenet", "test", root=d), lambda ds: check_dataset(ds, 2, 3)


VALID_TOML = """# a small but complete run configuration
name = "fuzz"
seed = 3
[data]
dataset = "mnist-default"
train_subset = 100
test_subset = 50
corruptions = ["shot_noise", "rotate"]
severities = [1, 5]
[train]
epochs = 2
batch_size = 32
lr = 0.001
[eval]
batch_size = 50
k = 5
retrieval_ks = [1, 5]
[[models]]
name = "a"
arch = "lenet"
activation = "relu"
heads = ["softmax", "knn"]
"""


def build_toml(d: Path):
    from shiftguard.commands.config import RunConfig, load_config

    d.mkdir(parents=True)
    p = d / "run.toml"
    p.write_text(VALID_TOML)

    def validate(cfg):
        assert isinstance(cfg, RunConfig) and all(m.heads for m in cfg.models)

    return [p], lambda: load_config(p), validate


def build_checkpoint(d: Path):
    """A checkpoint whose damage happened after its checksum was written (bit rot, bad copy)."""
    from shiftguard.train.checkpoint import load_checkpoint, save_checkpoint

    state = {"epoch": 3, "model": {"w": torch.arange(64.0).view(8, 8), "b": torch.zeros(8)}, "history": [{"a": 1.0}]}
    p = save_checkpoint(d, 3, state)

    def validate(got):  # the checksum makes a silently different state impossible
        assert got["epoch"] == 3 and torch.equal(got["model"]["w"], state["model"]["w"])

    return [p, p.with_name(p.name + ".sha256")], lambda: load_checkpoint(p), validate


def build_checkpoint_rechecksummed(d: Path):
    """A checkpoint damaged *before* its checksum was computed: torch.load itself must fail cleanly."""
    from shiftguard.train.checkpoint import load_checkpoint, save_checkpoint

    state = {"epoch": 1, "w": torch.linspace(0, 1, 50), "names": ["a", "b"]}
    p = save_checkpoint(d, 1, state)
    sidecar = p.with_name(p.name + ".sha256")

    def read():
        sidecar.write_text(hashlib.sha256(p.read_bytes()).hexdigest() + "\n")
        return load_checkpoint(p)

    def validate(got):
        assert isinstance(got, dict)

    return [p], read, validate


def build_results(d: Path):
    """``results.json`` of a finished run, read back by ``shiftguard report``."""
    from shiftguard.commands.report import load_run

    d.mkdir(parents=True)
    (d / "config.json").write_text('{"config": {}}\n')
    (d / "COMPLETE").write_text("x\n")
    (d / "results.json").write_text(json.dumps({"status": "complete", "name": "r", "rows": [{"accuracy": 0.5}]}))

    def validate(res):
        assert res["status"] == "complete"

    return [d / "results.json"], lambda: load_run(d), validate


def build_run_config(d: Path):
    """``config.json`` of a run directory, read back by ``shiftguard run --resume``."""
    import argparse

    from shiftguard.commands.config import quick_config
    from shiftguard.commands.run import prepare_run_dir

    cfg = quick_config()
    args = argparse.Namespace(name="r", out=str(d), resume=False)
    run_dir = prepare_run_dir(cfg, args)
    args.resume = True

    def validate(got):
        assert got == run_dir

    return [run_dir / "config.json"], lambda: prepare_run_dir(cfg, args), validate


def build_final_model(d: Path):
    """``models/<m>/model.pt`` + ``model.json`` of a run directory, reloaded by ``--resume``."""
    from shiftguard.commands.config import quick_config
    from shiftguard.commands.run import train_model
    from shiftguard.io import atomic_write, atomic_write_json
    from shiftguard.models import build_model
    from shiftguard.train.checkpoint import write_checksum

    cfg = quick_config()
    m = cfg.models[0]
    torch.manual_seed(cfg.seed)
    model = build_model(m.arch, activation=m.activation, num_classes=10, in_channels=1)
    mdir = d / "models" / m.name
    atomic_write(mdir / "model.pt", lambda fh: torch.save(model.state_dict(), fh))
    write_checksum(mdir / "model.pt")
    atomic_write_json(mdir / "model.json", {"best_val_acc": 0.5, "best_epoch": 1, "epochs_run": 1})
    data = {"num_classes": 10, "in_channels": 1, "image_size": 28}  # no images: nothing may be retrained

    def validate(got):
        loaded, summary, _ = got
        assert summary["loaded_from_run_dir"] is True
        assert loaded.state_dict().keys() == model.state_dict().keys()

    return (
        [mdir / "model.pt", mdir / "model.json"],
        lambda: train_model(cfg, m, data, d, "cpu", resume=True, progress=False),
        validate,
    )


FORMATS = {
    "idx-gz": lambda d: build_idx(d, True),
    "idx-raw": lambda d: build_idx(d, False),
    "embedded-mnist": build_embedded,
    "cifar-pickle": build_cifar,
    "cifar10-c-npy": build_cifar_c,
    "mnist-c-npy": build_mnist_c,
    "imagefolder": build_imagefolder,
    "tinyimagenet-val": build_tinyimagenet,
    "toml-config": build_toml,
    "checkpoint": build_checkpoint,
    "checkpoint-rechecksummed": build_checkpoint_rechecksummed,
    "results-json": build_results,
    "run-config-json": build_run_config,
    "run-final-model": build_final_model,
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_damaged_file_fails_naming_it_or_loads_valid_data(tmp_path, fmt):
    files, read, validate = FORMATS[fmt](tmp_path / "data")
    validate(read())  # the pristine files load
    pristine = {p: p.read_bytes() for p in files}
    rng = random.Random(f"fuzz-{fmt}")
    outcomes = {"error naming the file": 0, "loaded valid data": 0}
    kinds = {"truncation": 0, "flip": 0}
    problems = []  # every bad outcome, reported together (not just the first)
    for case in range(CASES):
        target = files[case % len(files)]
        kind, blob = damage(pristine[target], rng)
        kinds[kind] += 1
        target.write_bytes(blob)
        try:
            got = read()
        except (ValueError, FileNotFoundError) as exc:
            # The message must name the damaged file (its path, or its name when the error is a
            # cross-file inconsistency reported from the other file, e.g. "not in wnids.txt").
            if not (str(target) in str(exc) or target.name in str(exc)):
                problems.append(f"case {case} ({kind} of {target.name}): error does not name the file: {exc!r}"[:300])
            elif not (isinstance(exc, ValueError) or kind == "flip"):
                problems.append(f"case {case} ({kind} of {target.name}): {exc!r}"[:300])
            else:
                outcomes["error naming the file"] += 1
        except Exception as exc:  # any other exception type is a defect
            problems.append(f"case {case} ({kind} of {target.name}): {type(exc).__name__}: {exc}"[:300])
        else:
            try:
                validate(got)
            except AssertionError as exc:
                problems.append(f"case {case} ({kind} of {target.name}): loaded invalid data: {exc}"[:300])
            else:
                outcomes["loaded valid data"] += 1
        finally:
            target.write_bytes(pristine[target])
    record(
        group="fuzz",
        case=fmt,
        n=CASES,
        outcome=f"{outcomes['error naming the file']} clear errors, "
        f"{outcomes['loaded valid data']} valid loads, {len(problems)} defects "
        f"({kinds['truncation']} truncations, {kinds['flip']} flips)",
    )
    assert not problems, f"{len(problems)} of {CASES} damaged files mishandled:\n" + "\n".join(problems[:8])
    assert outcomes["error naming the file"] >= CASES // 4, outcomes  # the damage is real


def test_cache_file_damage_is_recomputed_never_raised(tmp_path):
    """Evaluation caches are disposable: any damaged file is recomputed, never trusted."""
    from shiftguard.evaluation.cache import OutputCache

    cache = OutputCache(tmp_path)
    good = {"embeddings": torch.randn(5, 3), "logits": torch.randn(5, 2)}
    cache.get_or_compute("k", lambda: good)
    pristine = cache.path("k").read_bytes()
    rng = random.Random("fuzz-cache")
    recomputed = 0
    for _ in range(CASES):
        cache.path("k").write_bytes(damage(pristine, rng)[1])
        calls = []
        out = cache.get_or_compute("k", lambda: calls.append(1) or good)
        recomputed += len(calls)
        assert set(out) == {"embeddings", "logits"} and out["embeddings"].shape == (5, 3)
        if not calls:
            torch.testing.assert_close(out["embeddings"].shape, good["embeddings"].shape)
    assert recomputed >= CASES // 4
    record(
        group="fuzz",
        case="embedding-cache",
        n=CASES,
        outcome=f"{recomputed} recomputed, {CASES - recomputed} read back",
    )


# ------------------------------------------------------------------------------------------ malicious pickles
class Evil:
    """Unpickling this creates ``marker`` (a stand-in for arbitrary code execution)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def test_the_evil_pickle_really_runs_code_with_plain_pickle(tmp_path):
    marker = tmp_path / "pwned"
    pickle.loads(pickle.dumps(Evil(marker)))
    assert marker.exists()  # so its absence below means the loaders refused it


def test_malicious_cifar_batch_is_refused_without_running_it(tmp_path):
    files, read, _ = build_cifar(tmp_path / "data")
    marker = tmp_path / "pwned"
    variants = {
        "top-level object": Evil(marker),
        "nested in the dict": {b"data": Evil(marker), b"labels": [1]},
    }
    for what, payload in variants.items():
        for target in files:
            good = target.read_bytes()
            target.write_bytes(pickle.dumps(payload, protocol=2))
            with pytest.raises(ValueError, match="unsafe|refused|forbidden") as exc:
                read()
            assert str(target) in str(exc.value), what
            assert not marker.exists(), f"{what} in {target.name} executed code"
            target.write_bytes(good)
    record(
        group="malicious pickle", case="CIFAR batch / meta (__reduce__ -> exec)", n=4, outcome="refused, no code ran"
    )


def test_malicious_checkpoint_is_refused_without_running_it(tmp_path):
    from shiftguard.train.checkpoint import CheckpointError, load_checkpoint, load_latest_checkpoint

    marker = tmp_path / "pwned"
    p = tmp_path / "ckpt" / "epoch-0001.pt"
    p.parent.mkdir()
    torch.save({"epoch": 1, "model": Evil(marker)}, p)
    # A valid checksum: the attacker controls both files, so only weights_only=True protects.
    p.with_name(p.name + ".sha256").write_text(hashlib.sha256(p.read_bytes()).hexdigest() + "\n")
    with pytest.raises(CheckpointError, match="epoch-0001.pt"):
        load_checkpoint(p)
    with pytest.warns(RuntimeWarning):
        assert load_latest_checkpoint(p.parent) is None
    assert not marker.exists()
    record(group="malicious pickle", case="checkpoint with a valid checksum", n=2, outcome="refused, no code ran")


def test_malicious_embedding_cache_file_is_recomputed_without_running_it(tmp_path):
    from shiftguard.evaluation.cache import OutputCache

    marker = tmp_path / "pwned"
    cache = OutputCache(tmp_path / "cache")
    cache.path("clean-s0").parent.mkdir(parents=True)
    torch.save({"embeddings": Evil(marker)}, cache.path("clean-s0"))
    out = cache.get_or_compute("clean-s0", lambda: {"embeddings": torch.zeros(2, 2)})
    assert torch.equal(out["embeddings"], torch.zeros(2, 2)) and cache.misses == 1
    assert not marker.exists()
    record(group="malicious pickle", case="evaluation cache file", n=1, outcome="recomputed, no code ran")


def test_npy_with_pickled_objects_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "pwned"
    files, read, _ = build_cifar_c(tmp_path / "data")
    arr = np.empty(10, dtype=object)
    arr[:] = [Evil(marker)] * 10
    for target in files:
        good = target.read_bytes()
        np.save(target, arr, allow_pickle=True)
        with pytest.raises(ValueError, match="object|pickle") as exc:
            read()
        assert str(target) in str(exc.value)
        assert not marker.exists()
        target.write_bytes(good)
    record(
        group="malicious pickle",
        case=".npy object arrays (CIFAR-10-C images / labels)",
        n=2,
        outcome="refused, no code ran",
    )
