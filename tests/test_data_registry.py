"""load(name, ...): the name table, argument checks, and the sklearn digits set."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shiftguard.data import describe, load, names
from shiftguard.data.digits import digits_split_mask

ALL = [
    "mnist",
    "fashion-mnist",
    "mnist-embedded",
    "cifar10",
    "cifar100",
    "cifar10-c",
    "cifar100-c",
    "mnist-c",
    "tinyimagenet",
    "tinyimagenet-c",
    "imagefolder",
    "digits",
]


def test_every_documented_name_is_registered():
    assert sorted(names()) == sorted(ALL)
    assert set(describe()) == set(ALL)


def test_unknown_name_lists_the_valid_names():
    with pytest.raises(
        ValueError,
        match=r"name: unknown dataset 'svhn'; expected one of cifar10, cifar10-c, "
        r".*digits, fashion-mnist",
    ):
        load("svhn")


def test_names_ignore_case_and_underscores():
    assert load("MNIST_Embedded", "test").name == "mnist-embedded"


def test_corruption_on_a_clean_dataset_is_refused():
    with pytest.raises(ValueError, match=r"mnist-embedded is a clean dataset.*cifar10-c"):
        load("mnist-embedded", "test", corruption="fog", severity=1)


def test_unexpected_option_is_refused():
    with pytest.raises(TypeError, match=r"digits: unexpected option\(s\) \['label_mode'\]"):
        load("digits", label_mode="fine")


def test_non_string_split_is_refused():
    with pytest.raises(TypeError, match="split"):
        load("digits", 1)


def test_no_download_happens_unless_asked(tmp_path, monkeypatch):
    import shiftguard.data.download as dl

    def boom(*a, **k):
        raise AssertionError("network touched")

    monkeypatch.setattr(dl, "_open_url", boom)
    with pytest.raises(FileNotFoundError):
        load("cifar10", "test", root=tmp_path)


# -- digits ---------------------------------------------------------------------------------------


def test_digits_split_sizes_and_values():
    tr, te = load("digits", "train"), load("digits", "test")
    assert len(tr) == 1442 and len(te) == 355
    assert tr.images.shape[1:] == (1, 8, 8) and tr.images.dtype == torch.uint8
    assert int(tr.images.max()) == 255 and int(tr.images.min()) == 0
    assert (te.class_counts() > 0).all() and (tr.class_counts() > 0).all()


def test_digits_pixels_are_counts_scaled_to_255():
    from sklearn.datasets import load_digits

    b = load_digits()
    test = digits_split_mask(b.target)
    want = np.rint(b.images[test] * 255 / 16).astype(np.uint8)
    assert np.array_equal(load("digits", "test").images[:, 0].numpy(), want)


def test_digits_split_mask_takes_every_fifth_of_each_class():
    target = np.array([0, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0])
    assert np.flatnonzero(digits_split_mask(target)).tolist() == [5, 9]
