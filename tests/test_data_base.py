"""ImageDataset and make_loader: the container every loader returns and its deterministic DataLoader."""

from __future__ import annotations

import pytest
import torch

from shiftguard.data import ImageDataset, make_loader


def _ds(n=10, c=1, h=4, w=4, k=3):
    images = torch.arange(n * c * h * w, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(n, c, h, w)
    labels = torch.arange(n) % k
    return ImageDataset(images, labels, [f"c{i}" for i in range(k)], "toy", "train")


def test_getitem_returns_uint8_chw_image_and_int_label():
    ds = _ds()
    img, lab = ds[3]
    assert img.dtype == torch.uint8 and img.shape == (1, 4, 4)
    assert isinstance(lab, int) and lab == 0
    assert torch.equal(img, ds.images[3])
    assert len(ds) == 10


def test_transform_is_applied_per_item():
    ds = _ds().with_transform(lambda x: x.float() / 255)
    img, _ = ds[1]
    assert img.dtype == torch.float32 and float(img.max()) <= 1.0


def test_to_float_scales_to_unit_interval():
    ds = _ds()
    f = ds.to_float()
    assert f.dtype == torch.float32
    assert torch.allclose(f * 255, ds.images.float())


def test_subset_keeps_rows_classes_and_name():
    ds = _ds()
    sub = ds.subset([0, 5, 9])
    assert len(sub) == 3 and sub.classes == ds.classes and sub.name == "toy"
    assert torch.equal(sub.images[1], ds.images[5]) and sub.labels.tolist() == [0, 2, 0]
    mask = ds.labels == 1
    assert sub.__class__ is ImageDataset and len(ds.subset(mask)) == int(mask.sum())


def test_subset_rejects_out_of_range_indices():
    with pytest.raises(ValueError, match="indices"):
        _ds().subset([0, 10])


def test_class_counts():
    assert _ds(n=10, k=3).class_counts().tolist() == [4, 3, 3]


@pytest.mark.parametrize(
    "images,labels,match",
    [
        (torch.zeros(2, 1, 3, 3), torch.zeros(2, dtype=torch.int64), "images"),  # float images
        (torch.zeros(2, 3, 3, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64), "images"),  # 3-D
        (torch.zeros(2, 1, 3, 3, dtype=torch.uint8), torch.zeros(2, dtype=torch.int32), "labels"),
        (torch.zeros(2, 1, 3, 3, dtype=torch.uint8), torch.zeros(3, dtype=torch.int64), "mismatched"),
        (torch.zeros(2, 1, 3, 3, dtype=torch.uint8), torch.tensor([0, 5]), "labels"),  # out of range
    ],
)
def test_constructor_rejects_bad_tensors(images, labels, match):
    with pytest.raises(ValueError, match=match):
        ImageDataset(images, labels, ["a", "b"], "x", "train")


def _order(loader):
    return torch.cat([y for _, y in loader]).tolist(), torch.cat([x[:, 0, 0, 0] for x, _ in loader]).tolist()


def test_make_loader_shuffle_depends_only_on_seed():
    ds = _ds(n=50, k=50)
    a = make_loader(ds, batch_size=7, shuffle=True, seed=3)
    torch.manual_seed(123)  # the global RNG must not matter
    b = make_loader(ds, batch_size=7, shuffle=True, seed=3)
    torch.rand(100)
    assert _order(a) == _order(b)
    c = make_loader(ds, batch_size=7, shuffle=True, seed=4)
    assert _order(a)[0] != _order(c)[0]


def test_make_loader_epochs_differ_but_are_reproducible():
    ds = _ds(n=40, k=40)
    a = make_loader(ds, batch_size=8, shuffle=True, seed=0)
    b = make_loader(ds, batch_size=8, shuffle=True, seed=0)
    a1, a2 = _order(a)[0], _order(a)[0]
    b1, b2 = _order(b)[0], _order(b)[0]
    assert a1 != a2 and (a1, a2) == (b1, b2)
    assert sorted(a1) == list(range(40))


def test_make_loader_without_shuffle_keeps_order_and_drop_last():
    ds = _ds(n=10, k=10)
    labels, _ = _order(make_loader(ds, batch_size=3, drop_last=True))
    assert labels == list(range(9))
    x, y = next(iter(make_loader(ds, batch_size=4)))
    assert x.shape == (4, 1, 4, 4) and x.dtype == torch.uint8 and y.dtype == torch.int64


@pytest.mark.parametrize("kw", [{"batch_size": 0}, {"batch_size": 2.0}, {"batch_size": 2, "num_workers": -1}])
def test_make_loader_rejects_bad_arguments(kw):
    with pytest.raises(ValueError):
        make_loader(_ds(), **kw)


def test_empty_subset_is_allowed():
    sub = _ds().subset([])
    assert len(sub) == 0 and sub.images.shape == (0, 1, 4, 4)
