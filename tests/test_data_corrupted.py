"""CIFAR-10-C / CIFAR-100-C / MNIST-C / Tiny-ImageNet-C in their published layouts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shiftguard.data import CIFAR_C_CORRUPTIONS, MNIST_C_CORRUPTIONS, corruption_names, load

N = 6  # images per severity in the fixtures (10,000 in the real sets)


def write_cifar_c(root, corruptions=("fog", "snow"), n=N, num_classes=10, labels_per_row=True, seed=0):
    """``<root>/<corruption>.npy`` (5n, 32, 32, 3) uint8 and ``labels.npy`` (5n,), as on Zenodo."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    clean_labels = rng.integers(0, num_classes, n)
    arrays = {}
    for c in corruptions:
        arr = rng.integers(0, 256, size=(5 * n, 32, 32, 3), dtype=np.uint8)
        np.save(root / f"{c}.npy", arr)
        arrays[c] = arr
    np.save(root / "labels.npy", np.tile(clean_labels, 5) if labels_per_row else clean_labels)
    return arrays, clean_labels


def test_cifar10_c_severity_selects_its_block_and_transposes_to_nchw(tmp_path):
    arrays, labels = write_cifar_c(tmp_path)
    for s in (1, 3, 5):
        ds = load("cifar10-c", "test", root=tmp_path, corruption="fog", severity=s)
        want = arrays["fog"][(s - 1) * N : s * N]  # rows [(s-1)n, sn)
        assert ds.images.shape == (N, 3, 32, 32) and ds.images.dtype == torch.uint8
        assert ds.images.is_contiguous()
        assert np.array_equal(ds.images.numpy(), want.transpose(0, 3, 1, 2))
        assert ds.labels.tolist() == labels.tolist()
        assert ds.meta["corruption"] == "fog" and ds.meta["severity"] == s


def test_cifar10_c_accepts_labels_stored_once(tmp_path):
    _, labels = write_cifar_c(tmp_path, labels_per_row=False)
    ds = load("cifar10-c", "test", root=tmp_path, corruption="snow", severity=2)
    assert ds.labels.tolist() == labels.tolist()


def test_cifar10_c_root_may_hold_the_extracted_archive_folder(tmp_path):
    write_cifar_c(tmp_path / "CIFAR-10-C")
    assert len(load("cifar10-c", "test", root=tmp_path, corruption="fog", severity=1)) == N


def test_cifar100_c_uses_the_100_fine_classes(tmp_path):
    write_cifar_c(tmp_path, num_classes=100)
    ds = load("cifar100-c", "test", root=tmp_path, corruption="fog", severity=4)
    assert len(ds.classes) == 100 and ds.classes[0] == "apple"


def test_official_corruption_lists():
    assert len(CIFAR_C_CORRUPTIONS) == 19 and len(set(CIFAR_C_CORRUPTIONS)) == 19
    assert len(MNIST_C_CORRUPTIONS) == 16 and "identity" in MNIST_C_CORRUPTIONS
    assert corruption_names("tinyimagenet-c")[:15] == CIFAR_C_CORRUPTIONS[:15]


@pytest.mark.parametrize("severity", [0, 6, -1])
def test_severity_outside_1_to_5_is_refused(tmp_path, severity):
    write_cifar_c(tmp_path)
    with pytest.raises(ValueError, match="severity: expected 1..5"):
        load("cifar10-c", "test", root=tmp_path, corruption="fog", severity=severity)


def test_missing_severity_or_corruption_is_refused(tmp_path):
    write_cifar_c(tmp_path)
    with pytest.raises(ValueError, match="severity"):
        load("cifar10-c", "test", root=tmp_path, corruption="fog")
    with pytest.raises(ValueError, match="corruption: cifar10-c needs corruption="):
        load("cifar10-c", "test", root=tmp_path, severity=1)


def test_unknown_corruption_lists_valid_names(tmp_path):
    write_cifar_c(tmp_path)
    with pytest.raises(ValueError, match=r"unknown cifar10-c corruption 'fgo'.*gaussian_noise"):
        load("cifar10-c", "test", root=tmp_path, corruption="fgo", severity=1)


def test_extra_corruption_found_on_disk_is_accepted(tmp_path):
    write_cifar_c(tmp_path, corruptions=("my_warp",))
    assert len(load("cifar10-c", "test", root=tmp_path, corruption="my_warp", severity=5)) == N


def test_cifar_c_has_only_a_test_split(tmp_path):
    write_cifar_c(tmp_path)
    with pytest.raises(ValueError, match=r"split: 'cifar10-c' has splits \['test'\]"):
        load("cifar10-c", "train", root=tmp_path, corruption="fog", severity=1)


def test_truncated_npy_names_the_file(tmp_path):
    write_cifar_c(tmp_path)
    p = tmp_path / "fog.npy"
    p.write_bytes(p.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"fog\.npy: truncated"):
        load("cifar10-c", "test", root=tmp_path, corruption="fog", severity=1)


def test_object_npy_is_refused_without_unpickling(tmp_path):
    write_cifar_c(tmp_path)
    np.save(tmp_path / "labels.npy", np.array([{"a": 1}] * (5 * N), dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match=r"labels\.npy: holds Python objects"):
        load("cifar10-c", "test", root=tmp_path, corruption="fog", severity=1)


def test_cifar_c_label_out_of_range_names_the_file(tmp_path):
    write_cifar_c(tmp_path)
    lab = np.load(tmp_path / "labels.npy")
    lab[N + 2] = 10
    np.save(tmp_path / "labels.npy", lab)
    with pytest.raises(ValueError, match=r"labels\.npy: label 10 at index 2 is out of range 0\.\.9"):
        load("cifar10-c", "test", root=tmp_path, corruption="fog", severity=2)


def test_cifar_c_label_count_mismatch_names_the_file(tmp_path):
    write_cifar_c(tmp_path)
    np.save(tmp_path / "labels.npy", np.zeros(7, dtype=np.int64))
    with pytest.raises(ValueError, match=r"labels\.npy: holds 7 labels, expected 6"):
        load("cifar10-c", "test", root=tmp_path, corruption="fog", severity=1)


def test_cifar_c_wrong_row_count_names_the_file(tmp_path):
    write_cifar_c(tmp_path)
    np.save(tmp_path / "fog.npy", np.zeros((7, 32, 32, 3), np.uint8))
    with pytest.raises(ValueError, match=r"fog\.npy: expected 5 severity blocks"):
        load("cifar10-c", "test", root=tmp_path, corruption="fog", severity=1)


def test_cifar_c_missing_corruption_file_is_named(tmp_path):
    write_cifar_c(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"frost\.npy"):
        load("cifar10-c", "test", root=tmp_path, corruption="frost", severity=1)


# -- MNIST-C --------------------------------------------------------------------------------------


def write_mnist_c(root, corruptions=("shear", "fog"), n_train=8, n_test=5, float_images=False):
    rng = np.random.default_rng(1)
    out = {}
    for c in corruptions:
        d = root / c
        d.mkdir(parents=True)
        for split, n in (("train", n_train), ("test", n_test)):
            img = rng.integers(0, 256, size=(n, 28, 28, 1), dtype=np.uint8)
            lab = rng.integers(0, 10, n).astype(np.uint8)
            np.save(d / f"{split}_images.npy", img.astype(np.float32) if float_images else img)
            np.save(d / f"{split}_labels.npy", lab)
            out[(c, split)] = (img, lab)
    return out


def test_mnist_c_official_layout_both_splits(tmp_path):
    data = write_mnist_c(tmp_path / "mnist_c")
    for split in ("train", "test"):
        ds = load("mnist-c", split, root=tmp_path, corruption="shear")
        img, lab = data[("shear", split)]
        assert ds.images.shape == (len(lab), 1, 28, 28) and ds.images.dtype == torch.uint8
        assert np.array_equal(ds.images[:, 0].numpy(), img[..., 0])
        assert ds.labels.tolist() == lab.tolist() and ds.labels.dtype == torch.int64


def test_mnist_c_float_images_holding_whole_pixel_values_are_accepted(tmp_path):
    data = write_mnist_c(tmp_path, float_images=True)
    ds = load("mnist-c", "test", root=tmp_path, corruption="fog")
    assert np.array_equal(ds.images[:, 0].numpy(), data[("fog", "test")][0][..., 0])


def test_mnist_c_refuses_a_severity_for_the_single_severity_official_set(tmp_path):
    write_mnist_c(tmp_path)
    with pytest.raises(ValueError, match="official MNIST-C has one severity"):
        load("mnist-c", "test", root=tmp_path, corruption="shear", severity=3)


def test_mnist_c_per_severity_subfolders(tmp_path):
    rng = np.random.default_rng(2)
    for s in (1, 2):
        d = tmp_path / "rotate" / str(s)
        d.mkdir(parents=True)
        np.save(d / "test_images.npy", np.full((3, 28, 28, 1), 10 * s, np.uint8))
        np.save(d / "test_labels.npy", rng.integers(0, 10, 3))
    ds = load("mnist-c", "test", root=tmp_path, corruption="rotate", severity=2)
    assert int(ds.images.max()) == 20 and ds.meta["severity"] == 2


def test_mnist_c_stacked_cifar_c_style_layout(tmp_path):
    rng = np.random.default_rng(3)
    arr = rng.integers(0, 256, size=(5 * 4, 28, 28, 1), dtype=np.uint8)
    np.save(tmp_path / "rotate.npy", arr)
    np.save(tmp_path / "labels.npy", np.tile(np.arange(4), 5))
    ds = load("mnist-c", "test", root=tmp_path, corruption="rotate", severity=4)
    assert np.array_equal(ds.images.numpy(), arr[12:16].transpose(0, 3, 1, 2))
    assert ds.classes == [str(i) for i in range(10)]


def test_mnist_c_unknown_corruption_lists_names(tmp_path):
    write_mnist_c(tmp_path)
    with pytest.raises(ValueError, match=r"unknown mnist-c corruption 'blur'.*zigzag"):
        load("mnist-c", "test", root=tmp_path, corruption="blur")


def test_mnist_c_rejects_non_integer_float_pixels(tmp_path):
    write_mnist_c(tmp_path)
    np.save(tmp_path / "fog" / "test_images.npy", np.full((5, 28, 28, 1), 0.5, np.float32))
    with pytest.raises(ValueError, match=r"test_images\.npy: expected uint8 pixel values"):
        load("mnist-c", "test", root=tmp_path, corruption="fog")


def test_mnist_c_count_mismatch_names_the_file(tmp_path):
    write_mnist_c(tmp_path)
    np.save(tmp_path / "fog" / "test_labels.npy", np.zeros(4, np.uint8))
    with pytest.raises(ValueError, match=r"test_labels\.npy: holds 4 labels, expected 5"):
        load("mnist-c", "test", root=tmp_path, corruption="fog")


# -- Tiny-ImageNet-C ------------------------------------------------------------------------------


def write_tiny_c(root, wnids=("n02", "n01", "n03"), per_class=2, severities=(1, 3), with_wnids_file=True):
    from PIL import Image

    colors = {}
    for s in severities:
        for k, w in enumerate(wnids):
            d = root / "Tiny-ImageNet-C" / "fog" / str(s) / w
            d.mkdir(parents=True)
            for i in range(per_class):
                color = (40 * k + 10 * s, 100 + i * 20, 200 - 30 * k)
                Image.new("RGB", (64, 64), color).save(d / f"val_{k}_{i}.JPEG", quality=95)
                colors[(s, w, i)] = color
    if with_wnids_file:
        (root / "Tiny-ImageNet-C" / "wnids.txt").write_text("\n".join(list(wnids) + ["n00"]) + "\n")
    return colors


def test_tinyimagenet_c_tree_labels_follow_sorted_wnids(tmp_path):
    colors = write_tiny_c(tmp_path)
    ds = load("tinyimagenet-c", "test", root=tmp_path, corruption="fog", severity=3)
    assert ds.images.shape == (6, 3, 64, 64) and ds.images.dtype == torch.uint8
    # wnids.txt lists n00 too: sorted index n00=0, n01=1, n02=2, n03=3
    assert ds.labels.tolist() == [1, 1, 2, 2, 3, 3] and len(ds.classes) == 4
    mean = ds.images[0].float().mean(dim=(1, 2))  # first image: n01, i=0, severity 3
    assert torch.allclose(mean, torch.tensor(colors[(3, "n01", 0)], dtype=torch.float32), atol=3)


def test_tinyimagenet_c_without_wnids_file_uses_sorted_folders(tmp_path):
    write_tiny_c(tmp_path, with_wnids_file=False)
    ds = load("tinyimagenet-c", "test", root=tmp_path, corruption="fog", severity=1)
    assert ds.classes == ["n01", "n02", "n03"] and ds.labels.tolist() == [0, 0, 1, 1, 2, 2]


def test_tinyimagenet_c_missing_severity_folder_is_named(tmp_path):
    write_tiny_c(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"fog/2/"):
        load("tinyimagenet-c", "test", root=tmp_path, corruption="fog", severity=2)


def test_tinyimagenet_c_unreadable_jpeg_names_the_file(tmp_path):
    write_tiny_c(tmp_path)
    p = tmp_path / "Tiny-ImageNet-C" / "fog" / "1" / "n02" / "val_0_1.JPEG"
    p.write_bytes(p.read_bytes()[:200])
    with pytest.raises(ValueError, match=r"val_0_1\.JPEG: unreadable image"):
        load("tinyimagenet-c", "test", root=tmp_path, corruption="fog", severity=1)


def test_mnist_c_severity_prefixed_trees_as_written_by_shiftguard_corrupt(tmp_path):
    for s in (2, 5):
        d = tmp_path / f"severity-{s}" / "fog"
        d.mkdir(parents=True)
        np.save(d / "test_images.npy", np.full((4, 28, 28, 1), s, np.uint8))
        np.save(d / "test_labels.npy", np.arange(4, dtype=np.uint8))
    ds = load("mnist-c", "test", root=tmp_path, corruption="fog", severity=5)
    assert int(ds.images.min()) == 5 and ds.labels.tolist() == [0, 1, 2, 3]
    same = load("mnist-c", "test", root=tmp_path / "severity-5", corruption="fog")
    assert torch.equal(ds.images, same.images)
    with pytest.raises(FileNotFoundError, match="severity-3/fog/test_images.npy"):
        load("mnist-c", "test", root=tmp_path, corruption="fog", severity=3)


def test_stacked_subset_of_severities_follows_the_manifest(tmp_path):
    import json

    arr = np.concatenate([np.full((N, 32, 32, 3), s, np.uint8) for s in (2, 4)])
    np.save(tmp_path / "fog.npy", arr)
    np.save(tmp_path / "labels.npy", np.zeros(2 * N, np.uint8))
    (tmp_path / "manifest.json").write_text(json.dumps({"severities": [2, 4]}))
    assert int(load("cifar10-c", "test", root=tmp_path, corruption="fog", severity=4).images.max()) == 4
    assert int(load("cifar10-c", "test", root=tmp_path, corruption="fog", severity=2).images.max()) == 2
    with pytest.raises(ValueError, match=r"holds severities \[2, 4\] only"):
        load("cifar10-c", "test", root=tmp_path, corruption="fog", severity=3)


def test_round_trip_with_the_corrupt_command_writer(tmp_path):
    from shiftguard.commands import corrupt as corrupt_cmd
    from shiftguard.data import load_default

    clean = load_default("test").subset(range(8))
    split = {"test": (clean.images, clean.labels)}
    out_m = tmp_path / "mnistc"
    corrupt_cmd.write_corrupted(split, out_m, "mnist-c", [1, 3], seed=0, corruptions=["shot_noise"], progress=False)
    ds = load("mnist-c", "test", root=out_m, corruption="shot_noise", severity=3)
    assert ds.images.shape == clean.images.shape and torch.equal(ds.labels, clean.labels)
    assert not torch.equal(ds.images, clean.images)
    out_c = tmp_path / "cifarc"
    corrupt_cmd.write_corrupted(split, out_c, "cifar-c", [2, 5], seed=0, corruptions=["contrast"], progress=False)
    s5 = load("mnist-c", "test", root=out_c, corruption="contrast", severity=5)
    s2 = load("mnist-c", "test", root=out_c, corruption="contrast", severity=2)
    assert torch.equal(s5.labels, clean.labels) and not torch.equal(s5.images, s2.images)
