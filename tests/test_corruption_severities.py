"""Every corruption's five severities are five different corruptions, and no corruption accepts
non-finite pixels.

- Severities: at every image size the suites are used at (MNIST-C on 28x28 grey, CIFAR-10-C and its
  extras on 32x32 RGB, on 64x64 RGB as for Tiny-ImageNet, and on 28x28 grey), the five severities of
  one corruption give five different outputs under one seed, for uint8 and float images. The
  exceptions are those the reference algorithms make equal, each named with its reason
  (``docs/corruptions.md``, "Severities that coincide").
- The motion-blur kernel is ImageMagick's ``MotionBlurImage``: ``2 ceil(r) + 1`` taps with weights
  ``exp(-i^2 / 2 sigma^2)``, normalised (``GetOptimalKernelWidth1D`` and ``GetMotionBlurKernel`` in
  MagickCore; the call of Hendrycks & Dietterich 2019's make_cifar_c.py and of Mu & Gilmer 2019).
- Non-finite pixels: ``corrupt`` refuses NaN and inf for all 34 corruptions, saying how many.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from shiftguard import corruptions as C

SETTINGS = settings(
    max_examples=20,
    deadline=None,
    derandomize=True,
    database=None,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow],
)

#: (suite, channels, side) at which each suite is used.
SHAPES = {
    "mnist-c": [(1, 28)],
    "cifar-c": [(3, 32), (3, 64), (1, 28)],
    "cifar-c-extra": [(3, 32), (3, 64), (1, 28)],
}
CASES = [(suite, name, c, side) for suite, shapes in SHAPES.items() for c, side in shapes for name in C.names(suite)]

#: Severity pairs that the reference makes equal under one seed (docs/corruptions.md).
#: CIFAR-10-C motion_blur 3 = (radius 6, sigma 2) and 4 = (8, 2): the same sigma, and the taps that
#: the larger radius adds (i = 13..16 at 32x32) weigh below 1e-9 in ImageMagick's kernel.
SAME_IN_REFERENCE = {("cifar-c", "motion_blur"): {(3, 4)}}
#: Corruptions that the reference leaves grey images untouched by (saturation of a grey image).
IDENTITY_ON_GREY = {("cifar-c-extra", "saturate")}


def _images(c: int, side: int, float_input: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * c + side)
    x = torch.randint(0, 256, (3, c, side, side), generator=g, dtype=torch.uint8)
    return x.float() / 255 if float_input else x


# --------------------------------------------------------------------------- five severities, five outputs
@pytest.mark.parametrize("float_input", [False, True], ids=["uint8", "float32"])
@pytest.mark.parametrize("suite,name,c,side", CASES, ids=[f"{s}/{n}-{c}x{h}" for s, n, c, h in CASES])
def test_the_five_severities_give_five_different_outputs(suite, name, c, side, float_input):
    x = _images(c, side, float_input)
    outs = {s: C.corrupt(x, name, s, seed=0, suite=suite) for s in range(1, 6)}
    if c == 1 and (suite, name) in IDENTITY_ON_GREY:
        assert all(torch.equal(y, x) for y in outs.values())
        return
    same = [(a, b) for a, b in itertools.combinations(range(1, 6), 2) if torch.equal(outs[a], outs[b])]
    expected = SAME_IN_REFERENCE.get((suite, name), set())
    assert set(same) == expected, f"{suite}/{name} at {c}x{side}x{side}: equal severity pairs {same}"


def test_only_the_named_pairs_coincide_and_the_reference_says_why():
    """The documented pair of equal severities follows from the suite's constants: motion_blur 3 and
    4 share sigma, and ImageMagick's kernels for their radii differ by less than 2e-9 (L1), at every
    scale the suite is used at; every other pair of its severities differs in sigma."""
    params = C.get("motion_blur", "cifar-c").params
    for a, b in itertools.combinations(range(5), 2):
        (r_a, s_a), (r_b, s_b) = params[a], params[b]
        for scale in (28 / 32, 1.0, 2.0):
            gap = _kernel_l1(_magick_kernel(r_a * scale, s_a * scale), _magick_kernel(r_b * scale, s_b * scale))
            if (a + 1, b + 1) in SAME_IN_REFERENCE[("cifar-c", "motion_blur")]:
                assert s_a == s_b and r_a != r_b and gap < 2e-9, (a + 1, b + 1, scale, gap)
            else:
                assert gap > 1e-2, (a + 1, b + 1, scale, gap)


# --------------------------------------------------------------------------- the motion-blur kernel
def _magick_kernel(radius: float, sigma: float) -> list[float]:
    """ImageMagick MotionBlurImage's kernel: width ``GetOptimalKernelWidth1D(radius, sigma) =
    2 ceil(radius) + 1`` (radius > 0), weights ``exp(-i^2 / (2 sigma^2))`` for i = 0..width-1,
    normalised to sum 1 (the constant factor 1 / (sqrt(2 pi) sigma) cancels)."""
    width = 2 * math.ceil(radius) + 1
    k = [math.exp(-(i * i) / (2.0 * sigma * sigma)) for i in range(width)]
    z = math.fsum(k)
    return [v / z for v in k]


def _kernel_l1(a: list[float], b: list[float]) -> float:
    n = max(len(a), len(b))
    return math.fsum(abs(x - y) for x, y in zip(a + [0.0] * (n - len(a)), b + [0.0] * (n - len(b))))


@pytest.mark.parametrize("suite", ["cifar-c", "mnist-c"])
@pytest.mark.parametrize("radius", [1, 2, 2.5, 3, 4, 6])
def test_motion_blur_kernel_has_two_ceil_radius_plus_one_taps(suite, radius):
    """A point source, blurred with a flat-ish kernel (sigma 10): the source pixel keeps exactly the
    weight of tap 0 (every other tap of an angle in [-45, 45] degrees reads a pixel at least one
    column away), i.e. ``1 / sum_{i < 2 ceil(r) + 1} exp(-i^2 / 2 sigma^2)``, whatever angle is drawn:
    the kernel's width follows the radius."""
    side = 32 if suite == "cifar-c" else 28  # scale 1: the parameters are in pixels
    x = torch.zeros(4, 1, side, side, dtype=torch.float64)
    x[:, :, side // 2, side // 2] = 1.0
    for seed in (0, 1):
        y = C.corrupt(x, "motion_blur", 1, seed=seed, suite=suite, params=(radius, 10.0))
        want = _magick_kernel(radius, 10.0)[0]
        assert torch.allclose(
            y[:, 0, side // 2, side // 2], torch.full((4,), want, dtype=torch.float64), rtol=0, atol=1e-12
        )
        # and the whole kernel lands in the image: the blur keeps the point's mass
        assert torch.allclose(y.sum(dim=(1, 2, 3)), torch.ones(4, dtype=torch.float64), rtol=0, atol=1e-9)


# --------------------------------------------------------------------------- non-finite pixels
ALL_34 = [(suite, name) for suite in C.SUITES for name in C.names(suite)]


def test_there_are_34_corruptions():
    assert len(ALL_34) == 34 and len({n for _, n in ALL_34}) == 34 - 7  # 7 names in both suites


@pytest.mark.parametrize("suite,name", ALL_34, ids=[f"{s}/{n}" for s, n in ALL_34])
def test_non_finite_pixels_are_refused_with_their_count(suite, name):
    c = 1 if suite == "mnist-c" else 3
    x = torch.rand(2, c, 28, 28, generator=torch.Generator().manual_seed(0))
    x[0, 0, 1, 2] = float("nan")
    x[1, -1, 5, 5] = float("inf")
    x[1, 0, 7, 3] = float("-inf")
    before = x.clone()
    msg = rf"images: 3 of {x.numel()} pixel values are not finite \(1 NaN, 2 inf\)"
    for severity in (1, 5):
        with pytest.raises(ValueError, match=msg):
            C.corrupt(x, name, severity, seed=0, suite=suite)
    with pytest.raises(ValueError, match=msg):
        C.corrupt((x, torch.zeros(2, dtype=torch.long)), name, 3, suite=suite)  # the labelled form too
    assert torch.equal(x.isnan(), before.isnan()) and torch.equal(x.nan_to_num(), before.nan_to_num())


@SETTINGS
@given(
    case=st.sampled_from(ALL_34),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]),
    n_nan=st.integers(0, 5),
    n_inf=st.integers(0, 5),
    severity=st.integers(0, 5),
    data=st.data(),
)
def test_any_count_of_nan_and_inf_in_any_float_dtype_is_refused_and_counted(case, dtype, n_nan, n_inf, severity, data):
    suite, name = case
    c = 1 if suite == "mnist-c" else 3
    x = torch.rand(2, c, 16, 16, generator=torch.Generator().manual_seed(severity)).to(dtype)
    spots = data.draw(
        st.lists(st.integers(0, x.numel() - 1), min_size=n_nan + n_inf, max_size=n_nan + n_inf, unique=True)
    )
    flat = x.view(-1)
    for i, p in enumerate(spots):
        flat[p] = float("nan") if i < n_nan else (float("inf") if i % 2 else float("-inf"))
    if n_nan + n_inf == 0:
        assert C.corrupt(x, name, severity, seed=0, suite=suite).dtype == dtype
        return
    with pytest.raises(
        ValueError,
        match=rf"^images: {n_nan + n_inf} of {x.numel()} pixel values are not finite "
        rf"\({n_nan} NaN, {n_inf} inf\)",
    ):
        C.corrupt(x, name, severity, seed=0, suite=suite)
