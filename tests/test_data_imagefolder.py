"""Class-per-folder image trees and Tiny-ImageNet-200 decoded with Pillow."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from shiftguard.data import load


def _png(path, arr):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path)


def write_tree(root, mode="RGB", size=(5, 7)):
    """Classes 'cat' and 'ant' (sorted: ant=0, cat=1), lossless PNGs with known pixels."""
    rng = np.random.default_rng(0)
    shape = (size[0], size[1], 3) if mode == "RGB" else size
    pixels = {}
    for cls, n in (("cat", 2), ("ant", 3)):
        for i in range(n):
            arr = rng.integers(0, 256, size=shape, dtype=np.uint8)
            _png(root / cls / f"{i:02d}.png", arr)
            pixels[(cls, i)] = arr
    return pixels


def test_classes_are_sorted_folders_and_pixels_exact(tmp_path):
    pix = write_tree(tmp_path)
    ds = load("imagefolder", root=tmp_path)
    assert ds.classes == ["ant", "cat"] and ds.labels.tolist() == [0, 0, 0, 1, 1]
    assert ds.images.shape == (5, 3, 5, 7) and ds.images.dtype == torch.uint8
    assert np.array_equal(ds.images[3].numpy(), pix[("cat", 0)].transpose(2, 0, 1))


def test_grayscale_tree_gives_one_channel(tmp_path):
    pix = write_tree(tmp_path, mode="L")
    ds = load("imagefolder", root=tmp_path)
    assert ds.images.shape == (5, 1, 5, 7)
    assert np.array_equal(ds.images[0, 0].numpy(), pix[("ant", 0)])


def test_mode_and_image_size_options(tmp_path):
    write_tree(tmp_path)
    ds = load("imagefolder", root=tmp_path, mode="L", image_size=(8, 4))
    assert ds.images.shape == (5, 1, 8, 4)
    assert load("imagefolder", root=tmp_path, image_size=3).images.shape == (5, 3, 3, 3)


def test_split_subfolders_are_used(tmp_path):
    write_tree(tmp_path / "train")
    write_tree(tmp_path / "test")
    (tmp_path / "test" / "ant" / "00.png").unlink()
    assert len(load("imagefolder", "train", root=tmp_path)) == 5
    assert len(load("imagefolder", "test", root=tmp_path)) == 4
    with pytest.raises(ValueError, match=r"split: .* has split folders \['train', 'test'\], no 'val'"):
        load("imagefolder", "val", root=tmp_path)


def test_mixed_sizes_without_resize_name_the_file(tmp_path):
    write_tree(tmp_path)
    _png(tmp_path / "cat" / "99.png", np.zeros((6, 6, 3), np.uint8))
    with pytest.raises(ValueError, match=r"99\.png: image size 6x6 differs"):
        load("imagefolder", root=tmp_path)


def test_truncated_image_names_the_file(tmp_path):
    write_tree(tmp_path, size=(40, 40))
    p = tmp_path / "ant" / "01.png"
    p.write_bytes(p.read_bytes()[:80])
    with pytest.raises(ValueError, match=r"01\.png: unreadable image"):
        load("imagefolder", root=tmp_path)


def test_non_image_file_is_an_error_and_hidden_files_are_ignored(tmp_path):
    write_tree(tmp_path)
    (tmp_path / "ant" / ".DS_Store").write_bytes(b"x")
    assert len(load("imagefolder", root=tmp_path)) == 5
    (tmp_path / "ant" / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match=r"notes\.txt: not an image file"):
        load("imagefolder", root=tmp_path)


def test_empty_class_folder_is_an_error(tmp_path):
    write_tree(tmp_path)
    (tmp_path / "zebra").mkdir()
    with pytest.raises(FileNotFoundError, match="zebra: class folder holds no images"):
        load("imagefolder", root=tmp_path)


def test_imagefolder_needs_a_root():
    with pytest.raises(ValueError, match="root"):
        load("imagefolder")


# -- Tiny-ImageNet-200 ----------------------------------------------------------------------------


WNIDS = ["n09", "n01", "n05"]  # wnids.txt order is not sorted, as in the official file


def write_tiny(root, per_class=2):
    base = root / "tiny-imagenet-200"
    base.mkdir(parents=True)
    (base / "wnids.txt").write_text("\n".join(WNIDS) + "\n")
    (base / "words.txt").write_text("n01\tgoldfish, Carassius auratus\nn05\tbullfrog\nn09\tteapot\nn77\tunused\n")
    for k, w in enumerate(WNIDS):
        d = base / "train" / w / "images"
        d.mkdir(parents=True)
        (base / "train" / w / f"{w}_boxes.txt").write_text("")  # official beside images/
        for i in range(per_class):
            Image.new("RGB", (64, 64), (30 * k, 60, 90)).save(d / f"{w}_{i}.JPEG")
    (base / "val" / "images").mkdir(parents=True)
    ann = []
    for i, w in enumerate(["n05", "n09", "n01", "n05"]):
        Image.new("L", (64, 64), 10 * i).save(base / "val" / "images" / f"val_{i}.JPEG")  # grayscale, as some are
        ann.append(f"val_{i}.JPEG\t{w}\t0\t0\t63\t63")
    (base / "val" / "val_annotations.txt").write_text("\n".join(ann) + "\n")
    return base


def test_tinyimagenet_train_labels_index_sorted_wnids_and_words_names(tmp_path):
    write_tiny(tmp_path)
    ds = load("tinyimagenet", "train", root=tmp_path)
    assert ds.images.shape == (6, 3, 64, 64)
    assert ds.meta["wnids"] == ["n01", "n05", "n09"]
    assert ds.classes == ["goldfish", "bullfrog", "teapot"]
    assert ds.labels.tolist() == [0, 0, 1, 1, 2, 2]


def test_tinyimagenet_test_split_is_the_labelled_val_set(tmp_path):
    write_tiny(tmp_path)
    ds = load("tinyimagenet", "test", root=tmp_path)
    assert ds.labels.tolist() == [1, 2, 0, 1]
    assert ds.images.shape == (4, 3, 64, 64)  # grayscale JPEGs converted to RGB
    assert torch.equal(ds.images, load("tinyimagenet", "val", root=tmp_path).images)


def test_tinyimagenet_unknown_wnid_in_annotations_names_the_file(tmp_path):
    base = write_tiny(tmp_path)
    ann = base / "val" / "val_annotations.txt"
    ann.write_text(ann.read_text().replace("n09", "n99"))
    with pytest.raises(ValueError, match=r"val_annotations\.txt: line 2: wnid 'n99' is not in wnids\.txt"):
        load("tinyimagenet", "test", root=tmp_path)


def test_tinyimagenet_missing_class_folder_is_named(tmp_path):
    base = write_tiny(tmp_path)
    import shutil

    shutil.rmtree(base / "train" / "n05")
    with pytest.raises(FileNotFoundError, match=r"n05/images: missing training images of class n05"):
        load("tinyimagenet", "train", root=tmp_path)


def test_sixteen_bit_grayscale_is_scaled_not_clipped(tmp_path):
    arr = np.array([[0, 32768], [65535, 257]], dtype=np.uint16)
    for cls in ("a", "b"):
        (tmp_path / cls).mkdir()
        Image.fromarray(arr).save(tmp_path / cls / "x.png")
    ds = load("imagefolder", root=tmp_path)
    assert ds.images.shape == (2, 1, 2, 2)
    assert ds.images[0, 0].tolist() == [[0, 128], [255, 1]]


def test_large_trees_decode_in_parallel_in_file_order(tmp_path):
    from shiftguard.data.imagefolder import decode_images

    rng = np.random.default_rng(1)
    files = []
    for i in range(700):  # above the threshold for threaded decoding
        p = tmp_path / f"{i:04d}.png"
        Image.fromarray(rng.integers(0, 256, (4, 4), dtype=np.uint8)).save(p)
        files.append(p)
    out = decode_images(files, "L")
    for i in (0, 1, 350, 699):
        with Image.open(files[i]) as im:
            assert np.array_equal(out[i, 0].numpy(), np.asarray(im))
    files[400].write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"0400\.png: unreadable image"):
        decode_images(files, "L")
