"""shiftguard.data.as_tensors: every form users keep labelled images in becomes checked pixel tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from shiftguard.data import ImageDataset, as_tensors


def _u8(n=5, c=3, h=8, w=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, c, h, w), generator=g, dtype=torch.uint8)


class _Items(Dataset):
    """A map-style Dataset over a list of (image, label) items, counting the reads."""

    def __init__(self, items):
        self.items = items
        self.reads = 0

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        self.reads += 1
        return self.items[i]


class _Stream(IterableDataset):
    def __init__(self, items):
        self.items = items

    def __iter__(self):
        return iter(self.items)


# ----------------------------------------------------------------------------- accepted forms


def test_image_dataset_gives_its_own_tensors_without_a_copy():
    x = _u8()
    ds = ImageDataset(x, torch.arange(5) % 2, ["a", "b"], "toy", "test")
    images, labels = as_tensors(ds)
    assert images is ds.images and labels is ds.labels
    images, labels = as_tensors(ds, max_items=3)
    assert torch.equal(images, x[:3]) and labels.tolist() == [0, 1, 0]


def test_dataset_of_chw_tensors_and_int_labels_is_stacked_in_order():
    x = _u8()
    images, labels = as_tensors(_Items([(x[i], i % 3) for i in range(5)]))
    assert images.dtype == torch.uint8 and torch.equal(images, x)
    assert labels.dtype == torch.int64 and labels.tolist() == [0, 1, 2, 0, 1]


def test_dataset_of_numpy_hwc_arrays_with_layout_nhwc():
    x = _u8()
    items = [(x[i].permute(1, 2, 0).numpy(), np.int64(i)) for i in range(5)]
    images, labels = as_tensors(_Items(items), layout="nhwc")
    assert images.shape == (5, 3, 8, 6) and torch.equal(images, x)
    assert labels.tolist() == [0, 1, 2, 3, 4]


def test_dataset_with_zero_dim_tensor_labels_and_float_images_keeps_the_floats():
    x = torch.rand(4, 1, 8, 8, dtype=torch.float64)
    images, labels = as_tensors(_Items([(x[i], torch.tensor(i)) for i in range(4)]))
    assert images.dtype == torch.float64 and torch.equal(images, x)  # not quantised
    assert labels.tolist() == [0, 1, 2, 3]


def test_dataset_of_two_dim_images_gets_one_channel():
    x = _u8(c=1)
    images, _ = as_tensors(_Items([(x[i, 0].numpy(), 0) for i in range(5)]))
    assert images.shape == (5, 1, 8, 6) and torch.equal(images, x)


def test_dataset_of_pil_images_is_read_channels_last_whatever_the_layout():
    x = _u8()
    rgb = [(Image.fromarray(x[i].permute(1, 2, 0).numpy(), "RGB"), i) for i in range(5)]
    grey = [(Image.fromarray(x[i, 0].numpy(), "L"), i) for i in range(5)]
    assert torch.equal(as_tensors(_Items(rgb))[0], x)
    assert torch.equal(as_tensors(_Items(grey))[0], x[:, :1])


def test_iterable_dataset_without_length_is_read_to_its_end():
    x = _u8()
    images, labels = as_tensors(_Stream([(x[i], i) for i in range(5)]))
    assert torch.equal(images, x) and labels.tolist() == [0, 1, 2, 3, 4]


def test_max_items_reads_no_further_than_needed():
    x = _u8()
    ds = _Items([(x[i], i) for i in range(5)])
    images, labels = as_tensors(ds, max_items=2)
    assert torch.equal(images, x[:2]) and labels.tolist() == [0, 1]
    assert ds.reads == 2


def test_dataloader_batches_are_concatenated_in_loader_order():
    x = _u8(n=7)
    y = torch.arange(7)
    images, labels = as_tensors(DataLoader(TensorDataset(x, y), batch_size=3))
    assert torch.equal(images, x) and torch.equal(labels, y)
    images, labels = as_tensors(DataLoader(TensorDataset(x, y), batch_size=3), max_items=4)
    assert torch.equal(images, x[:4]) and labels.tolist() == [0, 1, 2, 3]


def test_tuple_of_numpy_nhwc_arrays_with_layout():
    x = _u8()
    arr = x.permute(0, 2, 3, 1).numpy()
    images, labels = as_tensors((arr, np.arange(5, dtype=np.int32)), layout="nhwc")
    assert images.shape == (5, 3, 8, 6) and torch.equal(images, x) and labels.dtype == torch.int64


def test_tuple_of_tensors_is_returned_as_is_and_three_dim_input_gets_one_channel():
    x = _u8()
    y = torch.arange(5)
    images, labels = as_tensors((x, y))
    assert images is x and torch.equal(labels, y)
    images, _ = as_tensors((x[:, 0], [0, 1, 2, 3, 4]))
    assert images.shape == (5, 1, 8, 6)


def test_other_integer_dtypes_within_0_255_become_uint8():
    x = _u8()
    images, _ = as_tensors((x.to(torch.int64), torch.zeros(5, dtype=torch.long)))
    assert images.dtype == torch.uint8 and torch.equal(images, x)
    images, _ = as_tensors((x.numpy().astype(np.uint16), np.zeros(5, dtype=np.int64)))
    assert images.dtype == torch.uint8 and torch.equal(images, x)


def test_float_arrays_keep_their_precision_and_half_is_widened_exactly():
    a = np.random.default_rng(0).random((2, 3, 8, 8))
    images, _ = as_tensors((a, np.zeros(2, dtype=np.int64)))
    assert images.dtype == torch.float64 and np.array_equal(images.numpy(), a)
    x = torch.rand(2, 3, 8, 8).half()
    images, _ = as_tensors((x, torch.zeros(2, dtype=torch.long)))
    assert images.dtype == torch.float32 and torch.equal(images, x.float())
    images, _ = as_tensors((x.numpy(), np.zeros(2, dtype=np.int64)))
    assert images.dtype == torch.float32 and torch.equal(images, x.float())


# ----------------------------------------------------------------------------- errors


def _pair(images, n=None):
    return images, torch.zeros(images.shape[0] if n is None else n, dtype=torch.long)


def test_normalised_floats_are_refused_with_the_range_found_and_the_contract():
    x = (torch.rand(4, 3, 8, 8) - 0.5) / 0.25  # mean/std normalised
    lo, hi = float(x.min()), float(x.max())
    with pytest.raises(ValueError) as err:
        as_tensors(_pair(x), name="test")
    msg = str(err.value)
    assert msg.startswith("test:") and f"{lo:.6g}" in msg and f"{hi:.6g}" in msg
    assert "[0, 1]" in msg and "uint8" in msg and "preprocess" in msg and "normalis" in msg


def test_zero_to_255_floats_are_refused_with_a_hint_at_the_scale():
    x = _u8().float()
    with pytest.raises(ValueError, match=r"test: float pixels must lie in \[0, 1\].*max 2\d\d.*0\.\.255"):
        as_tensors(_pair(x), name="test")


def test_non_finite_pixels_are_refused_with_their_count():
    x = torch.rand(3, 1, 8, 8)
    x[0, 0, 0, :2] = float("nan")
    x[2, 0, 5, 5] = float("inf")
    with pytest.raises(ValueError, match=r"test: 3 of 192 pixel values are not finite \(2 NaN, 1 inf\)"):
        as_tensors(_pair(x), name="test")


def test_integers_outside_0_255_are_refused_with_the_range():
    x = _u8().to(torch.int32)
    x[0, 0, 0, 0] = 300
    with pytest.raises(ValueError, match="data: integer pixels must lie in 0..255, found min 0, max 300"):
        as_tensors(_pair(x))
    with pytest.raises(ValueError, match="found min -1"):
        as_tensors(_pair(np.full((2, 1, 8, 8), -1, dtype=np.int16)))


@pytest.mark.parametrize("dtype", [torch.bool, torch.complex64])
def test_bool_and_complex_images_are_refused(dtype):
    with pytest.raises(TypeError, match=f"test: .*dtype {dtype}"):
        as_tensors(_pair(torch.zeros(2, 1, 8, 8, dtype=dtype)), name="test")


def test_labels_must_be_non_negative_integers():
    x = _u8()
    with pytest.raises(TypeError, match="test: labels must be integers, got dtype torch.float32"):
        as_tensors((x, torch.zeros(5)), name="test")
    with pytest.raises(ValueError, match="test: labels must be >= 0, found minimum -2"):
        as_tensors((x, torch.tensor([0, 1, -2, 0, 0])), name="test")
    with pytest.raises(TypeError, match="test: item 1: the label must be an int"):
        as_tensors(_Items([(x[0], 0), (x[1], 1.0)]), name="test")
    with pytest.raises(ValueError, match="test: labels must be >= 0, item 1 has label -1"):
        as_tensors(_Items([(x[0], 0), (x[1], -1)]), name="test")


def test_length_mismatch_is_refused():
    with pytest.raises(ValueError, match="test: mismatched lengths: 5 images, 4 labels"):
        as_tensors(_pair(_u8(), n=4), name="test")


def test_labels_are_required():
    with pytest.raises(TypeError, match="test: labels are required"):
        as_tensors(_u8(), name="test")
    with pytest.raises(TypeError, match="item 0: expected an \\(image, label\\) pair"):
        as_tensors(_Items([_u8()[0]]))


def test_inconsistent_item_shapes_name_the_item():
    x = _u8()
    items = [(x[0], 0), (x[1], 0), (x[2, :, :4], 0)]
    with pytest.raises(ValueError, match=r"test: item 2: image of shape \(3, 4, 6\).*item 0 \(shape \(3, 8, 6\)"):
        as_tensors(_Items(items), name="test")


def test_empty_inputs_are_refused():
    with pytest.raises(ValueError, match="test: no images"):
        as_tensors(_Items([]), name="test")
    with pytest.raises(ValueError, match="test: no images"):
        as_tensors(_pair(torch.zeros(0, 3, 8, 8, dtype=torch.uint8)), name="test")
    with pytest.raises(ValueError, match="test: no images"):
        as_tensors(DataLoader(TensorDataset(torch.zeros(0, 1, 8, 8), torch.zeros(0)), batch_size=2), name="test")


def test_channels_last_array_under_the_default_layout_suggests_nhwc():
    arr = _u8().permute(0, 2, 3, 1).numpy()  # (5, 8, 6, 3)
    with pytest.raises(ValueError, match='test: .*\\(5, 8, 6, 3\\) look channels-last.*layout="nhwc"'):
        as_tensors((arr, np.zeros(5, dtype=np.int64)), name="test")


def test_float_pixels_outside_the_range_in_a_dataset_are_refused():
    x = torch.rand(3, 1, 8, 8) * 2
    with pytest.raises(ValueError, match=r"test: float pixels must lie in \[0, 1\]"):
        as_tensors(_Items([(x[i], 0) for i in range(3)]), name="test")


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="layout"):
        as_tensors(_pair(_u8()), layout="chw")
    with pytest.raises(ValueError, match="max_items"):
        as_tensors(_pair(_u8()), max_items=0)
    with pytest.raises(TypeError, match="data: expected an ImageDataset"):
        as_tensors({"images": _u8()})
