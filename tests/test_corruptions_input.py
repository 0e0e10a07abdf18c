"""What corruptions.corrupt accepts: pixels only (never clipped on the way in), and labelled data sets."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from shiftguard import corruptions as C
from shiftguard.data import ImageDataset

# corruptions without a uint8 fast path: their uint8 result is the float pipeline's, rounded
_FLOAT_PIPELINE = [("mnist-c", "fog"), ("mnist-c", "rotate"), ("cifar-c", "motion_blur"), ("cifar-c", "frost")]


def _u8(n=3, c=3, size=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, c, size, size), generator=g, dtype=torch.uint8)


@pytest.mark.parametrize("suite,name", _FLOAT_PIPELINE)
def test_in_range_float_input_is_used_as_given(suite, name):
    """The float path sees the very values the uint8 path divides by 255: the same output, rounded."""
    assert C.get(name, suite).u8 is None
    x = _u8(c=1 if suite == "mnist-c" else 3)
    from_u8 = C.corrupt(x, name, 3, seed=4, suite=suite)
    from_float = C.corrupt(x.float() / 255, name, 3, seed=4, suite=suite)
    assert from_float.dtype == torch.float32
    assert torch.equal(from_u8, from_float.mul(255).round().to(torch.uint8))


def test_the_output_is_still_clipped_to_the_valid_range():
    x = torch.ones(2, 3, 32, 32)  # any noise pushes half the pixels above 1
    y = C.corrupt(x, "gaussian_noise", 5, seed=0)
    assert float(y.max()) == 1.0 and float(y.min()) >= 0.0 and bool((y < 1).any())


def test_normalised_float_input_is_refused_not_clipped():
    x = (_u8().float() / 255 - 0.5) / 0.25
    lo, hi = float(x.min()), float(x.max())
    with pytest.raises(ValueError) as err:
        C.corrupt(x, "fog", 3)
    msg = str(err.value)
    assert msg.startswith("images:") and f"{lo:.6g}" in msg and f"{hi:.6g}" in msg and "[0, 1]" in msg
    assert "uint8" in msg


def test_zero_to_255_float_input_is_refused():
    with pytest.raises(ValueError, match=r"images: float pixels must lie in \[0, 1\], found min 0, max 255"):
        C.corrupt(torch.full((1, 1, 28, 28), 255.0).index_fill_(3, torch.tensor([0]), 0.0), "fog", 3)


def test_a_nan_pixel_is_refused_with_the_count_at_every_severity():
    x = torch.rand(2, 1, 28, 28)
    x[1, 0, 3, 4] = float("nan")
    for severity in (0, 3):
        with pytest.raises(ValueError, match=r"images: 1 of 1568 pixel values are not finite \(1 NaN, 0 inf\)"):
            C.corrupt(x, "shot_noise", severity)


def test_image_dataset_in_image_dataset_out():
    x = _u8(n=4)
    ds = ImageDataset(x, torch.tensor([0, 1, 1, 0]), ["a", "b"], "toy", "test", meta={"root": "r"})
    out = C.corrupt(ds, "contrast", 2, seed=3)
    assert isinstance(out, ImageDataset)
    assert torch.equal(out.images, C.corrupt(x, "contrast", 2, seed=3))
    assert torch.equal(out.labels, ds.labels) and out.classes == ["a", "b"]
    assert (out.name, out.split) == ("toy", "test")
    assert out.meta == {"root": "r", "corruption": "contrast", "suite": "cifar-c", "severity": 2, "seed": 3}
    assert torch.equal(ds.images, x)  # the input is untouched


def test_dataset_loader_and_tuple_give_images_and_labels():
    x = _u8(n=5, c=1, size=28)
    y = torch.tensor([3, 1, 4, 1, 5])
    want = C.corrupt(x, "mnist-c/shear", 3, seed=1)
    for data in (TensorDataset(x, y), DataLoader(TensorDataset(x, y), batch_size=2), (x, y), (x.numpy(), y.numpy())):
        images, labels = C.corrupt(data, "mnist-c/shear", 3, seed=1)
        assert torch.equal(images, want) and torch.equal(labels, y)


def test_float_tuple_gives_float_images_and_labels():
    x = torch.rand(2, 3, 32, 32, dtype=torch.float64)
    images, labels = C.corrupt((x, torch.tensor([0, 1])), "pixelate", 2, seed=0)
    assert images.dtype == torch.float64 and torch.equal(images, C.corrupt(x, "pixelate", 2, seed=0))
    assert labels.tolist() == [0, 1]


def test_labelled_input_checks_the_arguments_and_pixels():
    x = _u8(n=2)
    with pytest.raises(ValueError, match="severity"):
        C.corrupt((x, torch.tensor([0, 1])), "fog", 7)
    with pytest.raises(ValueError, match=r"images: float pixels must lie in \[0, 1\]"):
        C.corrupt(TensorDataset(x.float(), torch.tensor([0, 1])), "fog", 2)
    with pytest.raises(TypeError, match="images: expected an ImageDataset, a torch Dataset"):
        C.corrupt([x, x, x], "fog", 2)
    with pytest.raises(TypeError, match="images: expected a torch.Tensor.*numpy"):
        C.corrupt(x.numpy(), "fog", 2)
