"""Torch-only augmentations: reproducible, range-preserving, shape-preserving, exact at identity settings."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shiftguard.data import (
    Augment,
    brightness_contrast_jitter,
    random_horizontal_flip,
    random_resized_crop,
    two_views,
)


def _images(n=4, c=1, h=12, w=12, seed=0):
    return torch.rand(n, c, h, w, generator=torch.Generator().manual_seed(seed))


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def test_same_seed_gives_the_same_output_and_another_seed_another():
    x = _images()
    aug = Augment(hflip=True)
    a, b = aug(x, _gen(1)), aug(x, _gen(1))
    assert torch.equal(a, b)
    assert not torch.equal(a, aug(x, _gen(2)))


@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    st.integers(1, 5),
    st.sampled_from([1, 3]),
    st.integers(4, 16),
    st.integers(4, 16),
    st.floats(0.05, 1.0),
    st.floats(0.0, 2.0),
    st.floats(0.0, 2.0),
    st.integers(0, 2**31 - 1),
)
def test_outputs_stay_in_the_unit_interval_and_keep_the_shape(n, c, h, w, lo, brightness, contrast, seed):
    x = torch.rand(n, c, h, w, generator=_gen(seed))
    x[0, 0, 0, 0], x[-1, -1, -1, -1] = 0.0, 1.0
    out = Augment(crop_scale=(lo, 1.0), hflip=True, brightness=brightness, contrast=contrast)(x, _gen(seed + 1))
    assert out.shape == x.shape and out.dtype == x.dtype
    assert float(out.min()) >= 0.0 and float(out.max()) <= 1.0


def test_identity_settings_return_the_input_exactly():
    for shape in [(3, 1, 10, 10), (2, 3, 9, 11)]:  # 11/9 lies inside the default aspect-ratio range
        x = torch.rand(*shape, generator=_gen(3))
        assert torch.equal(Augment(crop_scale=(1.0, 1.0), brightness=0.0, contrast=0.0)(x, _gen(4)), x)
        assert torch.equal(random_resized_crop(x, scale=(1.0, 1.0), generator=_gen(5)), x)
        assert torch.equal(brightness_contrast_jitter(x, 0.0, 0.0, generator=_gen(6)), x)
        assert torch.equal(random_horizontal_flip(x, p=0.0, generator=_gen(7)), x)
    assert torch.equal(random_horizontal_flip(x, p=1.0), x.flip(-1))


def test_crop_boxes_have_the_requested_area_fraction_and_aspect_ratio():
    """On a horizontal (channel 0) and a vertical (channel 1) ramp, bilinear resizing is exact in the interior,
    so the slope of the output recovers the box size: ``w = slope * W^2``."""
    n, size = 64, 32
    ramp = (torch.arange(size, dtype=torch.float64) + 0.5) / size
    x = torch.stack([ramp.expand(size, size), ramp.unsqueeze(1).expand(size, size)]).expand(n, 2, size, size)
    out = random_resized_crop(x, scale=(0.3, 0.6), ratio=(0.5, 2.0), generator=_gen(8))
    mid = size // 2
    w = (out[:, 0, mid, mid] - out[:, 0, mid, mid - 1]) * size**2
    h = (out[:, 1, mid, mid] - out[:, 1, mid - 1, mid]) * size**2
    area = w * h / size**2
    # the ramp value at output pixel u is (x0 + (u + 1/2) w / W) / W: the box lies inside the image
    x0 = out[:, 0, mid, mid] * size - (mid + 0.5) * w / size
    y0 = out[:, 1, mid, mid] * size - (mid + 0.5) * h / size
    assert bool(((x0 > -1e-9) & (x0 + w < size + 1e-9) & (y0 > -1e-9) & (y0 + h < size + 1e-9)).all())
    assert bool(((area > 0.3 - 1e-9) & (area < 0.6 + 1e-9)).all())
    assert bool(((w / h > 0.5 - 1e-9) & (w / h < 2.0 + 1e-9)).all())
    assert float(area.std()) > 0.03  # boxes are drawn per image


def test_brightness_scales_each_image_by_one_factor_in_its_range():
    x = _images(8, 1, 6, 6, seed=9) * 0.5  # no value can reach the clamp at factors <= 1.5
    out = brightness_contrast_jitter(x, brightness=0.5, contrast=0.0, generator=_gen(10))
    ratio = out / x
    factors = ratio.flatten(1)[:, 0]
    assert torch.allclose(ratio, factors.view(-1, 1, 1, 1).expand_as(ratio), rtol=1e-5)
    assert bool(((factors >= 0.5) & (factors <= 1.5)).all()) and float(factors.std()) > 0


def test_contrast_keeps_the_mean_grey_level_of_unclamped_images():
    x = 0.25 + 0.5 * _images(8, 1, 6, 6, seed=11)  # within [0.25, 0.75]: factors <= 1.5 cannot clamp
    out = brightness_contrast_jitter(x, brightness=0.0, contrast=0.5, generator=_gen(12))
    assert torch.allclose(out.mean(dim=(1, 2, 3)), x.mean(dim=(1, 2, 3)), atol=1e-6)
    assert not torch.allclose(out, x)


def test_two_views_stacks_two_independent_draws_with_instance_ids():
    x = _images(5)
    views, ids = two_views(x, _gen(13))
    assert views.shape == (10, 1, 12, 12) and ids.tolist() == [0, 1, 2, 3, 4] * 2
    g = _gen(13)
    aug = Augment()
    assert torch.equal(views[:5], aug(x, g)) and torch.equal(views[5:], aug(x, g))
    assert not torch.equal(views[:5], views[5:])


def test_half_precision_images_keep_their_dtype():
    x = _images().half()
    assert Augment()(x, _gen(14)).dtype == torch.float16


@pytest.mark.parametrize(
    "call,arg",
    [
        (lambda: Augment()(torch.rand(2, 12, 12)), "images"),
        (lambda: Augment()(torch.rand(2, 1, 4, 4) + 1.0), "images"),
        (lambda: Augment()(torch.full((1, 1, 2, 2), float("nan"))), "images"),
        (lambda: Augment()(torch.randint(0, 255, (1, 1, 4, 4))), "images"),
        (lambda: Augment()(torch.rand(1, 1, 4, 4), generator=3), "generator"),
        (lambda: Augment(crop_scale=(0.5, 1.5)), "crop_scale"),
        (lambda: Augment(crop_scale=(0.8, 0.2)), "crop_scale"),
        (lambda: Augment(crop_ratio=(0.0, 1.0)), "crop_ratio"),
        (lambda: Augment(crop_ratio=1.0), "crop_ratio"),
        (lambda: Augment(hflip=1), "hflip"),
        (lambda: Augment(flip_p=1.5), "flip_p"),
        (lambda: Augment(brightness=-0.1), "brightness"),
        (lambda: Augment(contrast=float("inf")), "contrast"),
        (lambda: random_resized_crop(torch.rand(1, 1, 4, 4), scale=(0.0, 1.0)), "scale"),
        (lambda: random_horizontal_flip(torch.rand(1, 1, 4, 4), p=-1), "p"),
        (lambda: two_views(torch.rand(1, 1, 4, 4), augment="crop"), "augment"),
    ],
)
def test_bad_arguments_are_named(call, arg):
    with pytest.raises((TypeError, ValueError), match=arg):
        call()
