"""The uint8 fast paths and batched kernels of ``shiftguard.corruptions`` against slow references.

- ``_levels``: the exact per-level laws of the pixel-wise noises against scipy's distributions,
  the alias tables against those laws, and the sampler against the laws (chi-square), end to end
  through ``corrupt`` for uint8 images and against the float pipeline those laws describe.
- The uint8 paths of the deterministic corruptions against the float pipeline (defocus, JPEG,
  spatter) or against PIL itself (pixelate, bit-exact).
- The cache-sized blocks (motion blur, spatter, JPEG, the level sampler): results do not depend
  on the block size.
- The compiled CPU kernels (numba, ``_kernels``) against the torch code they replace: bitwise
  equal for motion blur, Canny and the edge distance; the same law for the level sampler.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import scipy.ndimage as ndi
import torch
from PIL import Image
from scipy import stats

from shiftguard import corruptions as C
from shiftguard.corruptions import _jpeg, _kernels, _levels, _ops, cifar_c
from shiftguard.corruptions.cifar_c import IMAGECORRUPTIONS_PARAMS
from shiftguard.corruptions.figures import synthetic_scene

pytestmark = pytest.mark.usefixtures("torch_one_thread")  # conftest.py

V = np.arange(256, dtype=np.float64)[:, None]
K = np.arange(256, dtype=np.float64)[None, :]


def _bins_ref(lo_y: np.ndarray, hi_y: np.ndarray, cdf) -> np.ndarray:
    """Mass of each output level k = round(255 y): y in [(k - 0.5) / 255, (k + 0.5) / 255),
    level 0 taking everything below and level 255 everything above (the clip)."""
    lo = np.where(K == 0, -np.inf, lo_y)
    hi = np.where(K == 255, np.inf, hi_y)
    return cdf(hi) - cdf(lo)


def _gaussian_ref(c: float) -> np.ndarray:
    return _bins_ref((K - 0.5) / 255, (K + 0.5) / 255, lambda y: stats.norm.cdf(y, loc=V / 255, scale=c))


def _speckle_ref(c: float) -> np.ndarray:
    x = np.maximum(V, 1) / 255  # y = x (1 + c Z) ~ N(x, (c x)^2) for x > 0
    p = _bins_ref((K - 0.5) / 255, (K + 0.5) / 255, lambda y: stats.norm.cdf(y, loc=x, scale=c * x))
    p[0] = np.eye(256)[0]  # black stays black
    return p


def _shot_ref(c: float) -> np.ndarray:
    """scipy's Poisson pmf of the counts, each count sent to round(255 clip(j / c, 0, 1)) in the
    float32 arithmetic of the float pipeline."""
    rate = (np.float32(1) * V.astype(np.float32) / np.float32(255) * np.float32(c)).astype(np.float64)  # (256, 1)
    j = np.arange(int(np.ceil(c)) + 400)
    level = np.round(np.clip(j.astype(np.float32) / np.float32(c), 0, 1) * np.float32(255)).astype(int)
    pj = stats.poisson.pmf(j[None, :], rate)
    p = np.zeros((256, 256))
    for k in range(256):
        p[:, k] = pj[:, level == k].sum(1)
    p[:, 255] += stats.poisson.sf(j[-1], rate[:, 0])
    return p


def _impulse_ref(c: float) -> np.ndarray:
    p = np.zeros((256, 256))
    for v in range(256):
        p[v, v] += 1 - c
        p[v, 0] += c / 2
        p[v, 255] += c / 2
    return p


LAWS = [
    (_levels.gaussian_noise_pmf, _gaussian_ref, [0.04, 0.1, 0.18, 0.38]),
    (_levels.speckle_noise_pmf, _speckle_ref, [0.06, 0.2, 0.35, 0.6]),
    (_levels.shot_noise_pmf, _shot_ref, [500, 100, 60, 12, 3]),
    (_levels.impulse_noise_pmf, _impulse_ref, [0.01, 0.09, 0.27]),
]


@pytest.mark.parametrize("law,ref,consts", LAWS, ids=lambda v: getattr(v, "__name__", ""))
def test_level_laws_match_scipy_distributions(law, ref, consts):
    for c in consts:
        p = law(c)
        assert p.shape == (256, 256) and (p >= 0).all()
        assert np.allclose(p.sum(1), 1.0, atol=1e-12)
        assert np.abs(p - ref(c)).max() < 1e-10, c


@pytest.mark.parametrize("law,c", [(_levels.gaussian_noise_pmf, 0.18), (_levels.shot_noise_pmf, 12),
                                   (_levels.speckle_noise_pmf, 0.35), (_levels.impulse_noise_pmf, 0.09)])  # fmt: skip
def test_alias_tables_sample_the_law_to_32_bits(law, c):
    p = law(c)
    implied = _levels.alias_tables(p).pmf()
    assert np.abs(implied - p).max() < 2.0**-30  # threshold quantisation: < 2^-32 per column


def test_alias_tables_reject_bad_input():
    with pytest.raises(ValueError):
        _levels.alias_tables(np.ones((3, 3)))
    with pytest.raises(ValueError):
        _levels.alias_tables(-np.ones((256, 256)))


def _chi2_pvalue(counts: np.ndarray, p: np.ndarray) -> float:
    """Chi-square goodness of fit, bins with an expectation below 5 pooled into one."""
    n = counts.sum()
    exp = n * p
    small = exp < 5
    obs = np.append(counts[~small], counts[small].sum())
    e = np.append(exp[~small], exp[small].sum())
    keep = e > 0
    assert obs[~keep].sum() == 0, "a level of probability 0 was drawn"
    if keep.sum() == 1:  # a point mass: every draw on it (checked above) is the whole test
        return 1.0
    return float(stats.chisquare(obs[keep], e[keep] * obs[keep].sum() / e[keep].sum()).pvalue)


# Fixed seeds: under the exact law the p-value is uniform, so each check has a 1/1000 chance of
# a false alarm, fixed once by the seed; a sampler off by one column, with swapped outcomes or
# with a threshold error of even 1e-3 drives p to ~0 at these sample sizes.
@pytest.fixture(params=["compiled", "torch"])
def kernels(request, monkeypatch):
    """Run a test with the numba kernels (where importable) and with the torch code."""
    if request.param == "compiled" and not _kernels.AVAILABLE:
        pytest.skip("numba not importable")
    if request.param == "torch":
        monkeypatch.setattr(_kernels, "AVAILABLE", False)
    return request.param


@pytest.mark.parametrize("law,c", [(_levels.gaussian_noise_pmf, 0.18), (_levels.shot_noise_pmf, 12),
                                   (_levels.speckle_noise_pmf, 0.35), (_levels.impulse_noise_pmf, 0.09)])  # fmt: skip
def test_sampler_draws_follow_the_law(law, c, kernels):
    p = law(c)
    tables = _levels.alias_tables(p)
    for level in (0, 1, 37, 128, 254, 255):
        x = torch.full((200_000,), level, dtype=torch.uint8)
        y = _levels.sample_levels(x, tables, torch.Generator().manual_seed(level))
        counts = np.bincount(y.numpy(), minlength=256)
        assert _chi2_pvalue(counts, p[level]) > 1e-3, level


def test_sampler_is_seeded_and_blocks_do_not_matter(monkeypatch, kernels):
    x = synthetic_scene(8, 32, seed=1)
    tables = _levels.cached_tables(_levels.gaussian_noise_pmf, 0.1)
    a = _levels.sample_levels(x, tables, torch.Generator().manual_seed(3))
    assert torch.equal(a, _levels.sample_levels(x, tables, torch.Generator().manual_seed(3)))
    assert not torch.equal(a, _levels.sample_levels(x, tables, torch.Generator().manual_seed(4)))
    assert a.shape == x.shape and a.dtype == torch.uint8
    # STEP changes how the stream is cut: same law, different draws; check the law not equality
    monkeypatch.setattr(_levels, "STEP", 1000)
    b = _levels.sample_levels(x, tables, torch.Generator().manual_seed(3))
    assert b.shape == x.shape and abs(float(b.float().mean() - a.float().mean())) < 1.0


NOISES = ["gaussian_noise", "shot_noise", "impulse_noise", "speckle_noise"]
LAW_OF = {
    "gaussian_noise": _levels.gaussian_noise_pmf,
    "shot_noise": _levels.shot_noise_pmf,
    "impulse_noise": _levels.impulse_noise_pmf,
    "speckle_noise": _levels.speckle_noise_pmf,
}


@pytest.mark.parametrize("name", NOISES)
def test_uint8_noise_follows_the_law_of_the_float_pipeline(name, kernels):
    """Both ``corrupt`` on uint8 (the alias sampler) and ``corrupt`` on float32 followed by the
    8-bit rounding (torch's float noise) fit the same per-level law."""
    suite = "cifar-c-extra" if name in C.names("cifar-c-extra") else "cifar-c"
    c = IMAGECORRUPTIONS_PARAMS[name][2]
    p = LAW_OF[name](c)
    for level in (3, 100, 240):
        x8 = torch.full((50, 3, 32, 32), level, dtype=torch.uint8)  # 153,600 values
        u8 = C.corrupt(x8, name, 3, seed=level, suite=suite, params=c)
        fl = C.corrupt(x8.float() / 255, name, 3, seed=level, suite=suite, params=c)
        fl8 = (fl * 255).round().to(torch.uint8)
        for y in (u8, fl8):
            counts = np.bincount(y.flatten().numpy(), minlength=256)
            assert _chi2_pvalue(counts, p[level]) > 1e-3, (name, level, y.dtype)


@pytest.mark.parametrize("name", NOISES)
def test_uint8_noise_uses_the_constants_of_each_severity(name):
    """The per-severity constants reach the sampler: the mean absolute change of a mid-grey
    image equals the one of the law of that severity's constant."""
    suite = "cifar-c-extra" if name in C.names("cifar-c-extra") else "cifar-c"
    x8 = torch.full((20, 3, 32, 32), 90, dtype=torch.uint8)
    for sev in range(1, 6):
        y = C.corrupt(x8, name, sev, seed=sev, suite=suite)
        p = LAW_OF[name](C.get(name, suite).params[sev - 1])[90]
        expected = float((np.abs(np.arange(256) - 90) * p).sum())
        sd = float(np.sqrt(((np.abs(np.arange(256) - 90) - expected) ** 2 * p).sum() / y.numel()))
        got = float((y.float() - 90).abs().mean())
        assert abs(got - expected) < 5 * sd + 1e-9, (sev, got, expected)


# ----------------------------------------------------------------------------- deterministic paths


def test_defocus_eigenbasis_filter_matches_scipy_on_odd_shapes():
    x = torch.rand(2, 3, 27, 32, dtype=torch.float64)
    for radius, alias in ((6, 0.5), (10, 0.5), (2, 0.3)):
        k = cifar_c._disk(float(radius), float(alias))
        ours = _ops.filter2d(x, k, "mirror")
        ref = np.stack([[ndi.correlate(x[n, c].numpy(), k.numpy(), mode="mirror") for c in range(3)] for n in range(2)])
        assert np.allclose(ours.numpy(), ref, atol=1e-12)
    one_row = torch.rand(2, 1, 1, 16, dtype=torch.float64)
    k = cifar_c._disk(3.0, 0.5)
    ref = np.stack([ndi.correlate(one_row[n, 0].numpy(), k.numpy(), mode="mirror") for n in range(2)])[:, None]
    assert np.allclose(_ops.filter2d(one_row, k, "mirror").numpy(), ref, atol=1e-12)


def test_non_symmetric_kernels_still_take_the_direct_correlation():
    x = torch.rand(2, 1, 12, 14, dtype=torch.float64)
    k = torch.rand(5, 5, dtype=torch.float64)
    ref = np.stack([ndi.correlate(x[n, 0].numpy(), k.numpy(), mode="mirror") for n in range(2)])[:, None]
    assert np.allclose(_ops.filter2d(x, k, "mirror").numpy(), ref, atol=1e-12)


def _u8_of_float_path(x8, name, severity, params=None):
    suite = "cifar-c-extra" if name in C.names("cifar-c-extra") else "cifar-c"
    y = C.corrupt(x8.float() / 255, name, severity, seed=2, suite=suite, params=params)
    return (y * 255).round().to(torch.uint8)


@pytest.mark.parametrize("name", ["defocus_blur", "jpeg_compression", "spatter", "contrast"])
@pytest.mark.parametrize("severity", [1, 3, 5])
def test_uint8_paths_equal_the_float_pipeline(name, severity, kernels):
    x8 = synthetic_scene(40, 32, seed=6)
    suite = "cifar-c-extra" if name in C.names("cifar-c-extra") else "cifar-c"
    for params in (None, IMAGECORRUPTIONS_PARAMS[name][severity - 1]):
        ours = C.corrupt(x8, name, severity, seed=2, suite=suite, params=params)
        ref = _u8_of_float_path(x8, name, severity, params)
        diff = (ours.int() - ref.int()).abs()
        if name == "spatter":  # same draws, same block computation: identical
            assert torch.equal(ours, ref)
        else:  # the 0..255 scale instead of 0..1: only rounding ties can move, by one level
            assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.002, (
                params,
                float((diff > 0).float().mean()),
            )


def _pil_pixelate(x8: torch.Tensor, ratio: float) -> torch.Tensor:
    out = []
    for n in range(x8.shape[0]):
        im = Image.fromarray(x8[n].permute(1, 2, 0).numpy())
        h, w = x8.shape[-2:]
        small = im.resize((int(w * ratio), int(h * ratio)), Image.BOX)
        out.append(np.asarray(small.resize((w, h), Image.BOX)))
    return torch.from_numpy(np.stack(out)).permute(0, 3, 1, 2)


@pytest.mark.parametrize("ratio", [0.95, 0.9, 0.85, 0.75, 0.65, 0.6, 0.5, 0.4, 0.3, 0.25])
def test_uint8_pixelate_is_bit_exact_with_pil(ratio, kernels):
    x8 = synthetic_scene(10, 32, seed=7)
    assert torch.equal(cifar_c.pixelate_u8(x8, ratio, None, 1.0), _pil_pixelate(x8, ratio))
    rect = torch.randint(0, 256, (3, 3, 24, 37), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(cifar_c.pixelate_u8(rect, ratio, None, 1.0), _pil_pixelate(rect, ratio))


def _pil_jpeg(x8: torch.Tensor, q: int) -> torch.Tensor:
    out = []
    for n in range(x8.shape[0]):
        arr = x8[n].permute(1, 2, 0).numpy() if x8.shape[1] == 3 else x8[n, 0].numpy()
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, "JPEG", quality=q)
        out.append(np.asarray(Image.open(buf)))
    y = torch.from_numpy(np.stack(out))
    return y.permute(0, 3, 1, 2) if x8.shape[1] == 3 else y[:, None]


@pytest.mark.parametrize("quality", [80, 40, 15, 7])
def test_uint8_jpeg_is_close_to_pil(quality, kernels):
    x8 = synthetic_scene(12, 32, seed=9)
    ours = _jpeg.jpeg_roundtrip(x8, quality)
    assert ours.dtype == torch.uint8
    err = (ours.float() - _pil_jpeg(x8, quality).float()).abs()
    assert float(err.mean()) < 1.5, float(err.mean())
    grey = x8[:, :1, :29, :21].contiguous()
    err = (_jpeg.jpeg_roundtrip(grey, quality).float() - _pil_jpeg(grey, quality).float()).abs()
    assert float(err.mean()) < 1.5, float(err.mean())


# ----------------------------------------------------------------------------- blocks


def test_motion_blur_blocks_do_not_change_the_result(monkeypatch):
    x = torch.rand(7, 3, 20, 24)
    angles = torch.tensor([-44.0, 10.0, 131.0, 0.0, 45.0, -170.0, 90.0])
    whole = _ops.motion_blur(x, 6, 2.0, angles)
    monkeypatch.setattr(_ops, "_MOTION_BLOCK", 2 * 3 * 20 * 24)  # two images per block
    assert torch.equal(_ops.motion_blur(x, 6, 2.0, angles), whole)


def test_spatter_and_jpeg_blocks_do_not_change_the_result(monkeypatch):
    x8 = synthetic_scene(9, 32, seed=10)
    sp = [C.corrupt(x8, "spatter", s, seed=1, suite="cifar-c-extra") for s in (2, 5)]
    jp = C.corrupt(x8, "jpeg_compression", 4, seed=1)
    monkeypatch.setattr(cifar_c, "_SPATTER_BLOCK", 2)
    monkeypatch.setattr(_jpeg, "BLOCK", 2)
    assert all(torch.equal(C.corrupt(x8, "spatter", s, seed=1, suite="cifar-c-extra"), y) for s, y in zip((2, 5), sp))
    assert torch.equal(C.corrupt(x8, "jpeg_compression", 4, seed=1), jp)


def test_equalize_hist_leaves_a_flat_image_unchanged():
    x = torch.full((2, 1, 8, 8), 37.0)
    x[1, 0, 0, 0] = 12.0
    y = _ops.equalize_hist_u8(x)
    assert torch.equal(y[0], x[0])
    assert set(torch.unique(y[1]).tolist()) == {0.0, 255.0}


# ----------------------------------------------------------------------------- compiled kernels


def _both(fn, monkeypatch):
    """``fn()`` with the numba kernels, then with the torch code."""
    if not _kernels.AVAILABLE:
        pytest.skip("numba not importable")
    a = fn()
    monkeypatch.setattr(_kernels, "AVAILABLE", False)
    return a, fn()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_motion_blur_is_bitwise_the_torch_loop(dtype, monkeypatch):
    g = torch.Generator().manual_seed(0)
    x = torch.rand(40, 3, 21, 26, generator=g, dtype=dtype)
    angles = torch.rand(40, generator=g, dtype=torch.float64) * 360 - 180
    for radius, sigma in ((6, 2.0), (15, 8.0), (30, 40.0)):  # the last: taps leaving the image
        a, b = _both(lambda: _ops.motion_blur(x, radius, sigma, angles), monkeypatch)
        monkeypatch.setattr(_kernels, "AVAILABLE", True)
        assert a.dtype == dtype and torch.equal(a, b), (radius, float((a - b).abs().max()))


def test_compiled_canny_is_bitwise_the_torch_code(monkeypatch):
    g = torch.Generator().manual_seed(1)
    scenes = synthetic_scene(30, 32, seed=3)[:, :1].float()
    noise = torch.rand(30, 1, 28, 23, generator=g)
    blocky = torch.zeros(4, 1, 20, 24)
    blocky[:, :, 5:15, 8:12] = 1.0
    cases = [(scenes, dict(sigma=0.0, low=50.0, high=150.0, l1=True)), (scenes / 255, dict(sigma=1.0)),
             (scenes.double() / 255, dict(sigma=1.5)), (noise, dict(sigma=1.0)), (blocky, dict(sigma=0.0)),
             (torch.floor(noise * 255), dict(sigma=0.0, low=50.0, high=150.0, l1=True))]  # fmt: skip
    for x, kw in cases:
        a, b = _both(lambda: _ops.canny(x, **kw), monkeypatch)
        monkeypatch.setattr(_kernels, "AVAILABLE", True)
        assert a.dtype == torch.bool and torch.equal(a, b), kw


def test_compiled_edge_distance_is_bitwise_the_torch_code(monkeypatch):
    g = torch.Generator().manual_seed(2)
    for p in (0.0, 0.002, 0.05, 0.4):
        e = torch.rand(60, 1, 33, 27, generator=g) < p
        e[:2] = False  # images without edges: the cap everywhere
        e[2, 0, 16, 13] = True  # a single edge pixel
        for cap in (20.0, 3.0, 50.0):
            a, b = _both(lambda: _ops.distance_to_edges(e, cap), monkeypatch)
            monkeypatch.setattr(_kernels, "AVAILABLE", True)
            assert torch.equal(a, b), (p, cap)
    ref = np.minimum(ndi.distance_transform_edt(~e[5, 0].numpy()), 20.0)
    assert np.allclose(_ops.distance_to_edges(e, 20.0)[5, 0].numpy(), ref, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_spatter_water_is_bitwise_the_torch_code(dtype, monkeypatch):
    x = synthetic_scene(24, 32, seed=12).to(dtype) / 255
    grey = x[:, :1].contiguous()
    for sev in (1, 2, 3):  # the water severities (mode 0); 4-5 are mud
        for imgs in (x, grey):
            a, b = _both(lambda: C.corrupt(imgs, "spatter", sev, seed=sev, suite="cifar-c-extra"), monkeypatch)
            monkeypatch.setattr(_kernels, "AVAILABLE", True)
            assert torch.equal(a, b), (sev, imgs.shape[1], float((a - b).abs().max()))


def test_compiled_uniform_has_torch_rands_law():
    """``cifar_c._fast_uniform`` (SplitMix64 bits on CPU with numba): values on torch.rand's grid
    (24 bits in float32), inside [low, high), uniform (chi-square on 64 bins, fixed seed: see
    the note above the sampler test), seeded."""
    if not _kernels.AVAILABLE:
        pytest.skip("numba not importable")
    like = torch.empty(0)
    u = cifar_c._fast_uniform((400, 1000), -1.0, 1.0, torch.Generator().manual_seed(0), like)
    assert u.dtype == torch.float32 and u.shape == (400, 1000)
    assert float(u.min()) >= -1.0 and float(u.max()) < 1.0
    grid = (u.double() + 1) / 2 * 2**24
    assert torch.equal(grid, grid.round())
    counts = np.histogram(u.numpy(), bins=64, range=(-1, 1))[0]
    assert _chi2_pvalue(counts, np.full(64, 1 / 64)) > 1e-3
    v = cifar_c._fast_uniform((1000,), 0.0, 1.0, torch.Generator().manual_seed(0), torch.empty(0, dtype=torch.float64))
    assert v.dtype == torch.float64 and abs(float(v.mean()) - 0.5) < 0.05 and len(torch.unique(v)) == 1000
    g1, g2 = (torch.Generator().manual_seed(5) for _ in range(2))
    assert torch.equal(cifar_c._fast_uniform((50,), 0, 1, g1, like), cifar_c._fast_uniform((50,), 0, 1, g2, like))


@pytest.mark.skipif(not _kernels.AVAILABLE, reason="numba is not installed: only the torch path exists")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("padding", ["zeros", "border", "mirror", "reflect"])
def test_compiled_sampling_grid_equals_the_torch_coordinates(padding, dtype, monkeypatch):
    g = torch.Generator().manual_seed(0)
    x = torch.rand(6, 3, 17, 23, generator=g, dtype=dtype)
    m = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], dtype=dtype) + 0.2 * torch.randn(
        6, 2, 3, generator=g, dtype=dtype
    )
    m[:, :, 2] = 6 * torch.randn(6, 2, generator=g, dtype=dtype)  # shifts past the border
    dx = 3 * torch.randn(6, 17, 23, generator=g, dtype=dtype)
    dy = 3 * torch.randn(6, 17, 23, generator=g, dtype=dtype)
    fast_affine = _ops.affine_warp(x, m, padding)
    fast_disp = _ops.displaced_sample(x, dx, dy, padding)
    monkeypatch.setattr(_kernels, "AVAILABLE", False)  # the torch coordinates
    ref_affine = _ops.affine_warp(x, m, padding)
    ref_disp = _ops.displaced_sample(x, dx, dy, padding)
    tol = 1e-5 if dtype == torch.float32 else 1e-12  # the grid is the same up to rounding
    torch.testing.assert_close(fast_affine, ref_affine, rtol=0, atol=tol)
    torch.testing.assert_close(fast_disp, ref_disp, rtol=0, atol=tol)
