"""The public corruption API: names, validation, dtype/shape/range, determinism, severity order,
and the geometry of the MNIST-C affine corruptions."""

from __future__ import annotations

import math

import pytest
import torch

from shiftguard import corruptions as C
from shiftguard.corruptions.figures import synthetic_scene

MNIST_C = C.names("mnist-c")
CIFAR_C = C.names("cifar-c")
CIFAR_EXTRA = C.names("cifar-c-extra")


pytestmark = pytest.mark.usefixtures("torch_one_thread")  # conftest.py


@pytest.fixture(scope="module")
def digits():
    """128 real MNIST test digits (the shared IDX files, else the embedded default subset)."""
    import os
    from pathlib import Path

    env = os.environ.get("SHIFTGUARD_SHARED_DATA")
    d = (Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data") / "mnist"
    try:
        from shiftguard.data import load, load_default

        if (d / "t10k-images-idx3-ubyte.gz").is_file():
            return load("mnist", "test", root=d).images[:128]
        return load_default("test").images[:128]
    except Exception as exc:  # pragma: no cover - depends on the data package
        pytest.skip(f"no MNIST digits available: {exc}")


@pytest.fixture(scope="module")
def scenes():
    return synthetic_scene(48, 32, seed=3)


# ----------------------------------------------------------------------------- names


def test_suites_have_the_published_corruptions():
    assert MNIST_C == [
        "shot_noise", "impulse_noise", "glass_blur", "motion_blur", "shear", "scale", "rotate",
        "brightness", "translate", "stripe", "fog", "spatter", "dotted_line", "zigzag", "canny_edges",
    ]  # fmt: skip
    assert CIFAR_C == [
        "gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur", "motion_blur",
        "zoom_blur", "snow", "frost", "fog", "brightness", "contrast", "elastic_transform", "pixelate",
        "jpeg_compression",
    ]  # fmt: skip
    assert CIFAR_EXTRA == ["speckle_noise", "gaussian_blur", "spatter", "saturate"]
    assert C.names("cifar-c", extra=True) == CIFAR_C + CIFAR_EXTRA


def test_unknown_suite_and_name_are_rejected_with_the_valid_list():
    with pytest.raises(ValueError, match="suite.*mnist-c"):
        C.names("imagenet-c")
    x = torch.zeros(2, 1, 28, 28, dtype=torch.uint8)
    with pytest.raises(ValueError, match="name.*shot_noise"):
        C.corrupt(x, "gaussian_noyse", 1)
    with pytest.raises(ValueError, match="name: unknown mnist-c corruption 'frost'; expected one of brightness"):
        C.corrupt(x, "frost", 1, suite="mnist-c")


@pytest.mark.parametrize("bad", [-1, 6, 10])
def test_severity_outside_0_to_5_is_rejected(bad):
    with pytest.raises(ValueError, match="severity"):
        C.corrupt(torch.zeros(1, 1, 28, 28), "fog", bad)


def test_severity_must_be_an_int():
    with pytest.raises(TypeError, match="severity"):
        C.corrupt(torch.zeros(1, 1, 28, 28), "fog", 2.5)


def test_wrong_ndim_dtype_and_channels_are_rejected():
    with pytest.raises(ValueError, match="images.*4 dimensions"):
        C.corrupt(torch.zeros(28, 28), "fog", 1)
    with pytest.raises(TypeError, match="images.*dtype"):
        C.corrupt(torch.zeros(1, 1, 28, 28, dtype=torch.int32), "fog", 1)
    with pytest.raises(ValueError, match="channels"):
        C.corrupt(torch.zeros(1, 4, 28, 28), "fog", 1)
    with pytest.raises(TypeError, match="images"):
        C.corrupt([[0]], "fog", 1)


def test_shared_names_resolve_by_channel_count_unless_the_suite_is_given():
    assert C.get("fog", channels=1).suite == "mnist-c"
    assert C.get("fog", channels=3).suite == "cifar-c"
    assert C.get("cifar-c/fog").suite == "cifar-c"
    assert C.get("zoom_blur").suite == "cifar-c"
    assert C.get("saturate").suite == "cifar-c-extra"


# ----------------------------------------------------------------------------- contract


ALL = (
    [("mnist-c", n) for n in MNIST_C] + [("cifar-c", n) for n in CIFAR_C] + [("cifar-c-extra", n) for n in CIFAR_EXTRA]
)


@pytest.mark.parametrize("suite,name", ALL)
def test_uint8_in_uint8_out_same_shape(suite, name):
    c = 1 if suite == "mnist-c" else 3
    size = 28 if suite == "mnist-c" else 32
    x = (torch.rand(3, c, size, size) * 255).to(torch.uint8)
    y = C.corrupt(x, name, 5, seed=1, suite=suite)
    assert y.dtype == torch.uint8 and y.shape == x.shape


@pytest.mark.parametrize("suite,name", ALL)
def test_float_in_float_out_clipped_to_unit_interval(suite, name):
    c = 1 if suite == "mnist-c" else 3
    x = torch.rand(3, c, 24, 30, dtype=torch.float64)  # a non-square, off-reference size
    y = C.corrupt(x, name, 4, seed=1, suite=suite)
    assert y.dtype == torch.float64 and y.shape == x.shape
    assert float(y.min()) >= 0.0 and float(y.max()) <= 1.0
    assert bool(torch.isfinite(y).all())


def test_half_precision_is_computed_in_float32_and_returned_as_half():
    x = torch.rand(2, 3, 32, 32).half()
    y = C.corrupt(x, "gaussian_noise", 3)
    assert y.dtype == torch.float16


@pytest.mark.parametrize("suite,name", ALL)
def test_severity_zero_is_the_identity(suite, name):
    x = (torch.rand(2, 1 if suite == "mnist-c" else 3, 28, 28) * 255).to(torch.uint8)
    y = C.corrupt(x, name, 0, suite=suite)
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("suite,name", ALL)
def test_same_seed_gives_identical_output(suite, name):
    x = synthetic_scene(3, 32, seed=0)
    if suite == "mnist-c":
        x = x[:, :1]
    a = C.corrupt(x, name, 3, seed=7, suite=suite)
    b = C.corrupt(x, name, 3, seed=7, suite=suite)
    assert torch.equal(a, b)


RANDOM = ["gaussian_noise", "shot_noise", "impulse_noise", "speckle_noise", "glass_blur", "snow", "frost", "fog",
          "spatter", "elastic_transform", "motion_blur"]  # fmt: skip


@pytest.mark.parametrize("name", RANDOM)
def test_different_seed_gives_different_noise(name):
    x = synthetic_scene(4, 32, seed=0)
    suite = "cifar-c-extra" if name in CIFAR_EXTRA else "cifar-c"
    a = C.corrupt(x, name, 3, seed=0, suite=suite)
    b = C.corrupt(x, name, 3, seed=1, suite=suite)
    assert not torch.equal(a, b)


def test_input_is_not_modified():
    x = synthetic_scene(2, 32)
    before = x.clone()
    for name in CIFAR_C:
        C.corrupt(x, name, 5)
    assert torch.equal(x, before)


def test_chunked_processing_matches_for_small_batches(monkeypatch):
    x = synthetic_scene(6, 32)
    whole = C.corrupt(x, "contrast", 3)
    from shiftguard.corruptions import engine

    monkeypatch.setattr(engine, "CHUNK", 4)  # the engine reads its own module's CHUNK
    assert torch.equal(C.corrupt(x, "contrast", 3), whole)  # deterministic op: chunking invisible


# ----------------------------------------------------------------------------- severity order


def _mean_l1(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().mean())


@pytest.mark.parametrize("name", MNIST_C)
def test_mnist_c_distance_grows_with_severity_on_real_digits(digits, name):
    d = [_mean_l1(C.corrupt(digits, name, s, seed=1, suite="mnist-c"), digits) for s in (1, 3, 5)]
    assert d[0] < d[1] < d[2], d


# Published CIFAR-10-C constants that do not grow in pixel distance (checked separately below).
NOT_MONOTONE_IN_L1 = {"frost", "elastic_transform", "spatter", "saturate"}


@pytest.mark.parametrize("name", [n for n in CIFAR_C + CIFAR_EXTRA if n not in NOT_MONOTONE_IN_L1])
def test_cifar_c_distance_grows_with_severity_on_rgb_scenes(scenes, name):
    suite = "cifar-c-extra" if name in CIFAR_EXTRA else "cifar-c"
    d = [_mean_l1(C.corrupt(scenes, name, s, seed=1, suite=suite), scenes) for s in (1, 3, 5)]
    assert d[0] < d[1] < d[2], d


def _corr_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.float().flatten(1)
    b = b.float().flatten(1)
    a = a - a.mean(1, keepdim=True)
    b = b - b.mean(1, keepdim=True)
    return float((1 - (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1) + 1e-9)).mean())


def test_frost_loses_image_structure_with_severity(scenes):
    # a x + b frost: the image weight a falls and b rises, so the mean pixel distance need not
    # grow, but the correlation with the clean image falls.
    d = [_corr_distance(C.corrupt(scenes, "frost", s, seed=1), scenes) for s in (1, 3, 5)]
    assert d[0] < d[1] < d[2], d


def test_spatter_grows_within_water_and_within_mud(scenes):
    d = [_mean_l1(C.corrupt(scenes, "spatter", s, seed=1, suite="cifar-c-extra"), scenes) for s in range(1, 6)]
    assert d[0] < d[1] < d[2] and d[3] < d[4], d  # severities 1-3 are water, 4-5 mud


def test_saturate_follows_its_gain(scenes):
    # gains 0.3, 0.1 (desaturate) then 1.5, 2 (+0.1), 2.5 (+0.2): distance follows |gain - 1|
    d = [_mean_l1(C.corrupt(scenes, "saturate", s, seed=1, suite="cifar-c-extra"), scenes) for s in range(1, 6)]
    assert d[0] < d[1] and d[2] < d[3] <= d[4] + 1e-9, d


def test_elastic_published_affine_part_shrinks_while_the_warp_grows(scenes):
    # CIFAR-10-C elastic: severity 1 is a pure random affine of up to 2.56 px, severity 5 an
    # affine of 0.96 px plus a local warp; the pixel distance therefore falls (published fact).
    d = [_mean_l1(C.corrupt(scenes, "elastic_transform", s, seed=1), scenes) for s in (1, 3, 5)]
    assert d[0] > d[2] > 0


# ----------------------------------------------------------------------------- geometry


def _single_pixel(row: int, col: int, size: int = 28) -> torch.Tensor:
    """A bright spot at (row, col): a narrow Gaussian bump, so that resampling at any scale
    sees it (a lone pixel can fall between the samples of a 2x zoom-out)."""
    r = torch.arange(size, dtype=torch.float64)[:, None]
    c = torch.arange(size, dtype=torch.float64)[None, :]
    return torch.exp(-((r - row) ** 2 + (c - col) ** 2) / (2 * 1.0**2))[None, None]


def _centroid(y: torch.Tensor) -> tuple[float, float]:
    w = y[0, 0]
    rows = torch.arange(w.shape[0], dtype=w.dtype)[:, None]
    cols = torch.arange(w.shape[1], dtype=w.dtype)[None, :]
    m = w.sum()
    return float((w * cols).sum() / m), float((w * rows).sum() / m)  # (x, y)


def _lands_on_one_of(y, candidates, tol=0.3):
    cx, cy = _centroid(y)
    assert min(math.hypot(cx - px, cy - py) for px, py in candidates) < tol, ((cx, cy), candidates)


@pytest.mark.parametrize("severity", [1, 3, 5])
def test_rotate_moves_a_bright_pixel_where_the_rotation_matrix_says(severity):
    angle = C.get("mnist-c/rotate").params[severity - 1]
    x = _single_pixel(6, 20)
    y = C.corrupt(x, "rotate", severity, seed=3, suite="mnist-c")
    c = 13.5
    qx, qy = 20 - c, 6 - c
    cands = []
    for a in (angle, -angle):  # the sign is random; out(p) = in(R p), so p = R^T q
        px = math.cos(a) * qx + math.sin(a) * qy + c
        py = -math.sin(a) * qx + math.cos(a) * qy + c
        cands.append((px, py))
    _lands_on_one_of(y, cands)


@pytest.mark.parametrize("severity", [1, 3, 5])
def test_translate_shifts_by_the_published_pixels(severity):
    d = C.get("mnist-c/translate").params[severity - 1]
    y = C.corrupt(_single_pixel(14, 14), "translate", severity, seed=0, suite="mnist-c")
    _lands_on_one_of(y, [(14 - sx * d, 14 - sy * d) for sx in (-1, 1) for sy in (-1, 1)], tol=1e-6)


@pytest.mark.parametrize("severity", [1, 3, 5])
def test_scale_shrinks_towards_the_centre(severity):
    s = C.get("mnist-c/scale").params[severity - 1]
    y = C.corrupt(_single_pixel(4, 24), "scale", severity, suite="mnist-c")
    c = 13.5
    _lands_on_one_of(y, [(c + (24 - c) / s, c + (4 - c) / s)])


@pytest.mark.parametrize("severity", [1, 3, 5])
def test_shear_moves_a_pixel_along_the_sheared_axis(severity):
    a0 = C.get("mnist-c/shear").params[severity - 1]
    y = C.corrupt(_single_pixel(6, 14), "shear", severity, seed=2, suite="mnist-c")
    c = 13.5
    qx, qy = 14 - c, 6 - c
    cands = []
    for a in (a0, -a0):  # inverse map L = [[1, -sin a], [0, cos a]]; p = L^-1 q
        py = qy / math.cos(a)
        px = qx + math.sin(a) * py
        cands.append((px + c, py + c))
    _lands_on_one_of(y, cands)


def test_geometric_corruptions_keep_the_digit_mass(digits):
    x = digits[:32].double() / 255
    for name in ("rotate", "shear", "translate"):
        y = C.corrupt(x, name, 3, suite="mnist-c")
        ratio = float(y.sum() / x.sum())
        assert 0.9 < ratio < 1.1, (name, ratio)


def test_stripe_inverts_exactly_the_published_columns():
    x = torch.rand(2, 1, 28, 28)
    y = C.corrupt(x, "stripe", 3, suite="mnist-c")
    assert torch.allclose(y[..., :7], 1 - x[..., :7]) and torch.allclose(y[..., 21:], 1 - x[..., 21:])
    assert torch.equal(y[..., 7:21], x[..., 7:21])


def test_brightness_on_grey_digits_adds_the_published_constant():
    x = torch.rand(2, 1, 28, 28, dtype=torch.float64) * 0.4
    y = C.corrupt(x, "brightness", 3, suite="mnist-c")
    assert torch.allclose(y, x + 0.5)


def test_contrast_scales_around_the_channel_mean():
    x = torch.rand(2, 3, 32, 32, dtype=torch.float64) * 0.5 + 0.25
    y = C.corrupt(x, "contrast", 2)
    m = x.mean(dim=(2, 3), keepdim=True)
    assert torch.allclose(y, (x - m) * 0.5 + m)


def test_impulse_noise_replaces_the_published_fraction():
    x = torch.full((8, 3, 32, 32), 0.5)
    y = C.corrupt(x, "impulse_noise", 5, seed=0)  # amount 0.07
    changed = (y != 0.5).float().mean().item()
    assert abs(changed - 0.07) < 0.01
    assert set(torch.unique(y[y != 0.5]).tolist()) <= {0.0, 1.0}


def test_gaussian_noise_has_the_published_standard_deviation():
    x = torch.full((16, 3, 32, 32), 0.5, dtype=torch.float64)
    y = C.corrupt(x, "gaussian_noise", 3, seed=0)  # sigma 0.08, far from the clip
    assert abs(float((y - x).std()) - 0.08) < 0.003


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_runs_on_gpu_with_the_same_contract():  # pragma: no cover - needs a GPU
    x = synthetic_scene(4, 32).cuda()
    for name in C.names("cifar-c", extra=True):
        suite = "cifar-c-extra" if name in CIFAR_EXTRA else "cifar-c"
        y = C.corrupt(x, name, 3, suite=suite)
        assert y.device == x.device and y.dtype == x.dtype
        assert torch.equal(y, C.corrupt(x, name, 3, suite=suite))
    g = x[:, :1]
    for name in MNIST_C:
        assert C.corrupt(g, name, 3, suite="mnist-c").device == x.device
