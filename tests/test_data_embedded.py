"""The embedded default: real, class-balanced MNIST shipped in the package, checked by sha256."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from shiftguard.data import load, load_default
from shiftguard.data.embedded import EMBEDDED_DIR, load_embedded, select_balanced
from shiftguard.data.idx import load_idx_pair

REPO = Path(__file__).resolve().parents[1]
# sha256 of the source files, from shared/data/README.md
README_SHA256 = {
    "train-images-idx3-ubyte.gz": "71524e2cd1ad2968737f7f2f2ff69cbfc32df8ccddff51593f7cb2d4e0eb5b64",
    "train-labels-idx1-ubyte.gz": "fe03b8bd7915f70bf5aa08be480aa413fbd85afcaa58b35d230d335f284fd88e",
    "t10k-images-idx3-ubyte.gz": "5634745efa576a17e7d4cf5cd9d09123c75e6538e5114267c2d156edaf519341",
    "t10k-labels-idx1-ubyte.gz": "ae18e77e031ccde52407f794d123116439864147d33ac992975f85dd4dc42af6",
}


def test_default_is_balanced_real_mnist_of_the_documented_size():
    tr, te = load_default("train"), load_default("test")
    assert tr.images.shape == (10000, 1, 28, 28) and te.images.shape == (2000, 1, 28, 28)
    assert tr.images.dtype == torch.uint8 and tr.labels.dtype == torch.int64
    assert tr.class_counts().tolist() == [1000] * 10 and te.class_counts().tolist() == [200] * 10
    assert tr.name == "mnist-embedded" and tr.classes == [str(i) for i in range(10)]
    assert int(tr.images.max()) == 255 and int(tr.images.min()) == 0


def test_load_by_name_equals_load_default():
    a, b = load("mnist-embedded", "test"), load_default("test")
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)


def test_shipped_files_are_small():
    total = sum(p.stat().st_size for p in EMBEDDED_DIR.iterdir())
    assert total < 3_000_000


def test_manifest_records_provenance():
    m = json.loads((EMBEDDED_DIR / "manifest.json").read_text())
    for name, sha in README_SHA256.items():
        assert m["source"][name]["sha256"] == sha
    assert m["splits"]["train"]["class_counts"] == [1000] * 10
    assert "first N images of that digit" in m["selection_rule"]


def test_damaged_file_is_detected_by_sha256(tmp_path):
    copy = tmp_path / "embedded"
    shutil.copytree(EMBEDDED_DIR, copy)
    p = copy / "t10k-images-idx3-ubyte.gz"
    b = bytearray(p.read_bytes())
    b[-20] ^= 1
    p.write_bytes(bytes(b))
    with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte\.gz: sha256 .* does not match the manifest"):
        load_embedded("test", folder=copy)
    assert len(load_embedded("train", folder=copy)) == 10000  # the other split is intact


def test_missing_manifest_says_how_to_regenerate(tmp_path):
    with pytest.raises(FileNotFoundError, match="make_embedded_mnist.py"):
        load_embedded("test", folder=tmp_path)


def test_select_balanced_takes_the_first_per_class_in_file_order():
    labels = np.array([2, 0, 1, 0, 2, 1, 0, 1, 2, 2])
    idx = select_balanced(labels, 2, num_classes=3)
    assert idx.tolist() == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="class 0 has 3 samples"):
        select_balanced(labels, 4, num_classes=3)


def test_embedded_rows_are_exactly_the_selected_official_rows(mnist_dir):
    m = json.loads((EMBEDDED_DIR / "manifest.json").read_text())
    for split, prefix in (("train", "train"), ("test", "t10k")):
        images, labels = load_idx_pair(
            mnist_dir / f"{prefix}-images-idx3-ubyte.gz", mnist_dir / f"{prefix}-labels-idx1-ubyte.gz", 10
        )
        idx = select_balanced(labels, 1000 if split == "train" else 200)
        assert hashlib.sha256(idx.astype("<i8").tobytes()).hexdigest() == m["splits"][split]["indices_sha256"]
        ds = load_default(split)
        assert np.array_equal(ds.images[:, 0].numpy(), images[idx])
        assert np.array_equal(ds.labels.numpy(), labels[idx])


@pytest.mark.slow  # ~8 s: recompresses 10k images at gzip level 9
def test_generator_script_reproduces_the_shipped_files(mnist_dir):
    spec = importlib.util.spec_from_file_location("make_embedded_mnist", REPO / "scripts" / "make_embedded_mnist.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--source", str(mnist_dir), "--out", str(EMBEDDED_DIR), "--check"]) == 0
