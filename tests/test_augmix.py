"""shiftguard.corruptions.augmix: AugMix (Hendrycks et al. 2020) and its Jensen-Shannon consistency term.

Each operation is compared with a slow per-image numpy reference written here from the PIL definitions
the official code calls (``ImageOps.equalize`` / ``autocontrast`` / ``posterize`` / ``solarize``,
``Image.rotate`` / ``transform(AFFINE)`` with bilinear sampling and black fill).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from shiftguard import corruptions
from shiftguard.corruptions import augmix as am
from shiftguard.corruptions.augmix import AugMix, augmix_ops, jensen_shannon_consistency


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def digits(n: int = 8, c: int = 1, size: int = 28, seed: int = 0) -> torch.Tensor:
    """uint8 images with a bright blob on a dark background plus noise: varied histograms."""
    g = gen(seed)
    x = torch.randint(0, 40, (n, c, size, size), generator=g)
    for i in range(n):
        r, col = divmod(i % 4, 2)
        x[i, :, 4 + r * 10 : 12 + r * 10, 4 + col * 10 : 14 + col * 10] += 150 + 10 * i
    return x.clamp(0, 255).to(torch.uint8)


def identity(x, level, sign):
    return x


def zeros(x, level, sign):
    return torch.zeros_like(x)


# ----------------------------------------------------------------------------------------------- contract


@pytest.mark.parametrize(
    "dtype, out",
    [
        (torch.uint8, torch.float32),
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
        (torch.float16, torch.float16),
    ],
)
@pytest.mark.parametrize("suite, c", [("mnist-c", 1), ("cifar-c", 3)])
def test_output_shape_dtype_and_range(dtype, out, suite, c):
    x = digits(6, c=c, size=28 if c == 1 else 32)
    x = x if dtype == torch.uint8 else (x.double() / 255).to(dtype)
    y = AugMix(suite)(x, gen())
    assert y.shape == x.shape and y.dtype == out
    assert float(y.min()) >= 0.0 and float(y.max()) <= 1.0 and torch.isfinite(y).all()
    assert not torch.allclose(y.double(), x.double() / (255 if dtype == torch.uint8 else 1), atol=1e-3)


def test_empty_batch_and_uint8_equals_its_float():
    a = AugMix("mnist-c")
    assert a(torch.zeros(0, 1, 28, 28, dtype=torch.uint8), gen()).shape == (0, 1, 28, 28)
    x = digits(4)
    torch.testing.assert_close(a(x, gen(5)), a(x.float() / 255, gen(5)), rtol=0, atol=1e-6)


def test_same_seed_same_output_other_seed_other_output():
    x = digits(8)
    for suite in ("mnist-c", "cifar-c"):
        a = AugMix(suite)
        assert torch.equal(a(x, gen(1)), a(x, gen(1)))
        assert not torch.equal(a(x, gen(1)), a(x, gen(2)))
    # without a generator the global one is used: reseeding it repeats the output
    torch.manual_seed(3)
    y1 = AugMix("cifar-c")(x)
    torch.manual_seed(3)
    assert torch.equal(y1, AugMix("cifar-c")(x))


def test_different_images_get_different_chains():
    x = digits(1).expand(16, 1, 28, 28).contiguous()  # one image, 16 times
    for suite in ("mnist-c", "cifar-c"):
        y = AugMix(suite)(x, gen(0)).reshape(16, -1)
        for i, j in itertools.combinations(range(16), 2):
            assert not torch.equal(y[i], y[j]), (suite, i, j)


def test_identity_operations_give_back_the_input():
    # m x + (1 - m) sum_i w_i x = x exactly when the weights are convex (sum_i w_i = 1)
    x = torch.rand(32, 3, 16, 16, generator=gen(0), dtype=torch.float64)
    for width, depth, alpha in ((3, -1, 1.0), (1, 2, 1.0), (5, 1, 0.1)):
        y = AugMix(ops=[identity], width=width, depth=depth, alpha=alpha)(x, gen(1))
        torch.testing.assert_close(y, x, rtol=0, atol=1e-12)


def test_skip_weight_is_a_beta_draw_per_image():
    # operations that blacken the image leave m x: one ratio per image, in [0, 1], Beta(alpha, alpha)
    x = torch.rand(4000, 1, 8, 8, generator=gen(0), dtype=torch.float64) * 0.9 + 0.1
    for alpha in (1.0, 0.5, 3.0):
        a = AugMix(ops=[zeros], alpha=alpha)
        y = a(x, gen(2))
        ratio = y / x
        m = ratio[:, 0, 0, 0]
        torch.testing.assert_close(ratio, m.view(-1, 1, 1, 1).expand_as(ratio), rtol=1e-12, atol=0)
        # m weights the clean image (the paper's Algorithm 1): the draw of the same generator state
        torch.testing.assert_close(m, a._draw(4000, gen(2), torch.device("cpu"))["m"], rtol=1e-12, atol=0)
        assert float(m.min()) >= 0 and float(m.max()) <= 1
        # Beta(a, a): mean 1/2, variance 1 / (4 (2a + 1)); 4000 draws: standard errors < 0.005
        assert abs(float(m.mean()) - 0.5) < 0.02
        assert abs(float(m.var()) - 1 / (4 * (2 * alpha + 1))) < 0.01


@pytest.mark.parametrize("alpha", [0.2, 1.0, 2.5])
def test_gamma_draws_have_the_gamma_moments(alpha):
    g = am._log_gamma((20000,), alpha, gen(0), "cpu").exp()
    assert torch.isfinite(g).all() and float(g.min()) >= 0
    # Gamma(alpha, 1): mean = variance = alpha
    assert abs(float(g.mean()) - alpha) < 0.05 * alpha
    assert abs(float(g.var()) - alpha) < 0.1 * alpha


def test_chain_weights_are_a_dirichlet_draw():
    a = AugMix(ops=[identity], width=3, alpha=0.5)
    w = a._draw(20000, gen(0), torch.device("cpu"))["w"]
    torch.testing.assert_close(w.sum(1), torch.ones(20000, dtype=w.dtype))
    # Dirichlet(a, a, a): mean 1/3, variance (1/3)(2/3) / (3a + 1)
    assert (w.mean(0) - 1 / 3).abs().max() < 0.01
    assert (w.var(0) - (2 / 9) / (3 * 0.5 + 1)).abs().max() < 0.01


def test_random_depth_is_one_to_three_and_a_fixed_depth_is_kept():
    p = AugMix(ops=[identity], width=4)._draw(3000, gen(0), torch.device("cpu"))
    assert p["steps"] == 3 and set(p["depth"].unique().tolist()) == {1, 2, 3}
    p = AugMix(ops=[identity], width=2, depth=2)._draw(10, gen(0), torch.device("cpu"))
    assert p["steps"] == 2 and (p["depth"] == 2).all()
    assert float(p["level"].min()) >= 0.1 and float(p["level"].max()) < 3


# ----------------------------------------------------------------------------------------------- op sets


def test_mnist_c_leaves_out_its_own_corruptions():
    assert augmix_ops("mnist-c") == ["autocontrast", "equalize", "posterize", "solarize"]
    a = AugMix("MNIST_C")
    assert a.ops == ("autocontrast", "equalize", "posterize", "solarize") and a.suite == "mnist-c"
    assert set(a.excluded) == {"rotate", "shear_x", "shear_y", "translate_x", "translate_y"}
    mnist = set(corruptions.names("mnist-c"))
    assert {"rotate", "shear", "translate"} <= mnist  # why they are left out


def test_cifar_c_uses_the_official_list():
    official = [
        "autocontrast",
        "equalize",
        "posterize",
        "rotate",
        "solarize",
        "shear_x",
        "shear_y",
        "translate_x",
        "translate_y",
    ]
    assert augmix_ops("cifar-c") == official == augmix_ops("cifar-c-extra")
    assert list(AugMix("cifar-c").ops) == official and AugMix("cifar-c").excluded == ()
    cfg = AugMix("cifar-c", severity=5, width=2, depth=1, alpha=0.5).config
    assert cfg == {
        "suite": "cifar-c",
        "severity": 5,
        "width": 2,
        "depth": 1,
        "alpha": 0.5,
        "ops": official,
        "excluded": [],
    }


def test_only_the_chosen_operations_run(monkeypatch):
    seen = set()

    def spy(name):
        def op(x, level, sign):
            seen.add(name)
            return x

        return op

    for name in am.OPS:
        monkeypatch.setitem(am.OPS, name, spy(name))
    AugMix("mnist-c")(digits(32), gen(0))
    assert seen == {"autocontrast", "equalize", "posterize", "solarize"}
    seen.clear()
    AugMix("cifar-c")(digits(64), gen(0))
    assert seen == set(am.AUGMENTATIONS)


@pytest.mark.parametrize(
    "kwargs, arg",
    [
        (dict(suite="mnist-c", severity=0), "severity"),
        (dict(suite="mnist-c", severity=11), "severity"),
        (dict(suite="mnist-c", severity=2.5), "severity"),
        (dict(suite="mnist-c", width=0), "width"),
        (dict(suite="mnist-c", depth=0), "depth"),
        (dict(suite="mnist-c", depth=-2), "depth"),
        (dict(suite="mnist-c", alpha=0.0), "alpha"),
        (dict(suite="mnist-c", alpha=math.inf), "alpha"),
        (dict(suite="imagenet-c"), "suite"),
        (dict(), "suite"),
        (dict(ops=[]), "ops"),
        (dict(ops=["blur"]), "ops"),
        (dict(ops="equalize"), "ops"),
    ],
)
def test_bad_arguments_are_named(kwargs, arg):
    with pytest.raises(ValueError, match=f"^{arg}:"):
        AugMix(**kwargs)


def test_bad_images_and_generator_are_named():
    a = AugMix("mnist-c")
    with pytest.raises(ValueError, match="^images:"):
        a(torch.full((2, 1, 28, 28), 2.0))
    with pytest.raises(ValueError, match="^images:"):
        a(torch.zeros(2, 28, 28))
    with pytest.raises(TypeError, match="^generator:"):
        a(torch.zeros(2, 1, 28, 28), generator=0)


# ----------------------------------------------------------------------------------------------- operations
# Slow references: one image, one channel at a time, numpy, from the PIL definitions.


def ref_equalize(v: np.ndarray) -> np.ndarray:
    """PIL ImageOps.equalize on one uint8 channel."""
    h = np.histogram(v, bins=256, range=(0, 256))[0]
    present = [c for c in h if c]
    if len(present) <= 1:
        return v.copy()
    step = (sum(present) - present[-1]) // 255
    if not step:
        return v.copy()
    lut, n = [], step // 2
    for i in range(256):
        lut.append(min(n // step, 255))
        n += h[i]
    return np.array(lut)[v]


def ref_autocontrast(v: np.ndarray) -> np.ndarray:
    lo, hi = v.min(), v.max()
    return v.copy() if hi <= lo else (v - lo) / (hi - lo)


def levels(n: int, c: int, seed: int) -> torch.Tensor:
    """float64 images on the 8-bit grid: random, constant, two-level and sparse channels."""
    v = digits(n, c=c, seed=seed).long()
    v[0, 0] = 77  # one level
    v[1, 0] = 0
    v[1, 0, :3] = 255  # two levels
    v[2, 0] = torch.where(v[2, 0] > 100, 200, 199)  # two adjacent levels
    return v.double() / 255


@pytest.mark.parametrize("c", [1, 3])
def test_equalize_matches_pil(c):
    x = levels(6, c, seed=c)
    y = am.equalize(x, torch.ones(6), torch.ones(6))
    v = (x * 255).round().long().numpy()
    for i in range(6):
        for ch in range(c):
            np.testing.assert_array_equal((y[i, ch] * 255).round().long().numpy(), ref_equalize(v[i, ch]))
    assert float((y - x).abs().max()) > 0.1  # it did equalise


@pytest.mark.parametrize("c", [1, 3])
def test_autocontrast_matches_a_per_channel_stretch(c):
    x = levels(6, c, seed=c) * 0.5 + 0.1
    y = am.autocontrast(x, torch.ones(6), torch.ones(6))
    for i in range(6):
        for ch in range(c):
            np.testing.assert_allclose(y[i, ch].numpy(), ref_autocontrast(x[i, ch].numpy()), rtol=0, atol=1e-12)


def test_posterize_matches_pil_bit_masks():
    x = levels(4, 3, seed=1)
    # level -> int(level * 4 / 10) -> bits 4, 3, 2, 1
    for level, bits in ((0.1, 4), (2.6, 3), (5.1, 2), (9.9, 1)):
        y = am.posterize(x, torch.full((4,), level, dtype=torch.float64), torch.ones(4))
        mask = ~(2 ** (8 - bits) - 1) & 0xFF
        ref = ((x * 255).round().long().numpy() & mask) / 255
        np.testing.assert_allclose(y.numpy(), ref, rtol=0, atol=1e-12)


def test_solarize_matches_pil_thresholds():
    x = levels(4, 1, seed=2)
    for level in (0.1, 1.0, 2.9, 9.99):
        threshold = 256 - int(level * 256 / 10)
        y = am.solarize(x, torch.full((4,), level, dtype=torch.float64), torch.ones(4))
        v = (x * 255).round().long().numpy()
        ref = np.where(v < threshold, v, 255 - v) / 255
        np.testing.assert_allclose(y.numpy(), ref, rtol=0, atol=1e-12)
        # off the 8-bit grid: a value is inverted when its nearest level reaches the threshold
        grid = torch.arange(256, dtype=torch.float64).view(1, 1, 16, 16).expand(4, 1, 16, 16) / 255  # every level
        off = (grid + torch.tensor([-0.3, 0.3, -0.4, 0.2], dtype=torch.float64).view(4, 1, 1, 1) / 255).clamp(0, 1)
        y = am.solarize(off, torch.full((4,), level, dtype=torch.float64), torch.ones(4))
        near = np.round(off.numpy() * 255)
        np.testing.assert_allclose(y.numpy(), np.where(near < threshold, off, 1 - off), rtol=0, atol=1e-12)


def ref_bilinear(img: np.ndarray, src) -> np.ndarray:
    """Output pixel (row, col) = bilinear value of ``img`` at index position ``src(col, row)``;
    neighbours outside the image count as 0 (black fill)."""
    H, W = img.shape
    out = np.zeros_like(img)
    for r in range(H):
        for c in range(W):
            sx, sy = src(c, r)
            x0, y0 = math.floor(sx), math.floor(sy)
            acc = 0.0
            for yy, wy in ((y0, 1 - (sy - y0)), (y0 + 1, sy - y0)):
                for xx, wx in ((x0, 1 - (sx - x0)), (x0 + 1, sx - x0)):
                    if 0 <= yy < H and 0 <= xx < W:
                        acc += wy * wx * img[yy, xx]
            out[r, c] = acc
    return out


def pil_affine(a, b, c, d, e, f):
    """PIL ``transform(AFFINE, (a, b, c, d, e, f))``: output centre (x + .5, y + .5) reads input
    (a X + b Y + c, d X + e Y + f) in area coordinates, i.e. index position minus 0.5."""
    return lambda x, y: (a * (x + 0.5) + b * (y + 0.5) + c - 0.5, d * (x + 0.5) + e * (y + 0.5) + f - 0.5)


def pil_rotate(degrees, W, H):
    """PIL ``Image.rotate(degrees)``: the affine matrix of its source, about (W / 2, H / 2)."""
    phi = -math.radians(degrees)
    a, b, d, e = math.cos(phi), math.sin(phi), -math.sin(phi), math.cos(phi)
    cx, cy = W / 2, H / 2
    c = a * -cx + b * -cy + cx
    f = d * -cx + e * -cy + cy
    return pil_affine(a, b, c, d, e, f)


@pytest.mark.parametrize("op", ["rotate", "shear_x", "shear_y", "translate_x", "translate_y"])
def test_geometric_operations_match_pil_geometry(op):
    x = digits(4, c=1, size=20, seed=3).double() / 255
    level = torch.tensor([0.5, 2.9, 7.3, 9.9], dtype=torch.float64)
    sign = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    y = am.OPS[op](x, level, sign)
    H, W = x.shape[-2:]
    for i in range(4):
        lv, sg = float(level[i]), float(sign[i])
        if op == "rotate":
            src = pil_rotate(int(lv * 30 / 10) * sg, W, H)
        elif op == "shear_x":
            src = pil_affine(1, lv * 0.3 / 10 * sg, 0, 0, 1, 0)
        elif op == "shear_y":
            src = pil_affine(1, 0, 0, lv * 0.3 / 10 * sg, 1, 0)
        elif op == "translate_x":
            src = pil_affine(1, 0, int(lv * (W / 3) / 10) * sg, 0, 1, 0)
        else:
            src = pil_affine(1, 0, 0, 0, 1, int(lv * (H / 3) / 10) * sg)
        np.testing.assert_allclose(
            y[i, 0].numpy(), ref_bilinear(x[i, 0].numpy(), src), rtol=0, atol=1e-9, err_msg=f"{op} image {i}"
        )


def test_translation_moves_whole_pixels_with_black_fill():
    x = digits(1, size=24).double() / 255
    y = am.translate_x(x, torch.tensor([9.0], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64))
    k = int(9.0 * 8 / 10)  # 7 pixels: output column c reads input column c + 7
    torch.testing.assert_close(y[..., : 24 - k], x[..., k:], rtol=0, atol=1e-12)
    assert (y[..., 24 - k :] == 0).all()


# ----------------------------------------------------------------------------------------------- Jensen-Shannon


def ref_js(*logits) -> float:
    """Direct formula, numpy float64: mean over rows of (1/3) sum_i sum_k p_ik log(p_ik / M_k),
    log M of M clamped to [1e-7, 1]; 0 log 0 = 0."""
    ps = [np.exp(t - t.max(1, keepdims=True)) for t in (np.asarray(t, dtype=np.float64) for t in logits)]
    ps = [p / p.sum(1, keepdims=True) for p in ps]
    log_m = np.log(np.clip(sum(ps) / 3, 1e-7, 1))
    total = 0.0
    for p in ps:
        with np.errstate(divide="ignore", invalid="ignore"):
            total += np.where(p > 0, p * (np.log(p) - log_m), 0.0).sum()
    return total / 3 / ps[0].shape[0]


def three_logits(n=5, k=7, scale=2.0, seed=0, dtype=torch.float64):
    g = gen(seed)
    return [torch.randn(n, k, generator=g, dtype=dtype) * scale for _ in range(3)]


def test_js_is_zero_for_equal_logits_and_positive_otherwise():
    a, b, c = three_logits()
    assert float(jensen_shannon_consistency(a, a, a)) == pytest.approx(0.0, abs=1e-12)
    assert float(jensen_shannon_consistency(a, a + 3.0, a - 1.0)) == pytest.approx(0.0, abs=1e-12)  # shift-invariant
    assert float(jensen_shannon_consistency(a, b, c)) > 0.01


def test_js_is_symmetric_in_its_three_arguments():
    t = three_logits(seed=1)
    ref = jensen_shannon_consistency(*t)
    for perm in itertools.permutations(range(3)):
        torch.testing.assert_close(jensen_shannon_consistency(*(t[i] for i in perm)), ref, rtol=1e-12, atol=0)


@pytest.mark.parametrize("scale", [0.5, 3.0, 40.0])  # 40: probabilities below 1e-7, the clamp at work
def test_js_matches_the_direct_formula(scale):
    t = three_logits(n=6, k=10, scale=scale, seed=2)
    assert float(jensen_shannon_consistency(*t)) == pytest.approx(ref_js(*(x.numpy() for x in t)), rel=1e-9, abs=1e-12)
    t32 = [x.float() for x in t]
    assert float(jensen_shannon_consistency(*t32)) == pytest.approx(ref_js(*(x.numpy() for x in t)), rel=1e-4, abs=1e-6)


def test_js_gradients_pass_gradcheck():
    t = [x.requires_grad_() for x in three_logits(n=4, k=5, scale=1.0, seed=3)]
    assert torch.autograd.gradcheck(jensen_shannon_consistency, t)


def test_js_bad_arguments_are_named():
    a, b, c = three_logits()
    with pytest.raises(ValueError, match="^logits_aug1:"):
        jensen_shannon_consistency(a, b[:3], c)
    with pytest.raises(ValueError, match="^logits_aug2:"):
        jensen_shannon_consistency(a, b, c[None])
    with pytest.raises(TypeError, match="^logits_clean:"):
        jensen_shannon_consistency(a.long(), b, c)


# ----------------------------------------------------------------------------------------------- device


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_images_with_a_cpu_generator_match_the_cpu_result():
    x = digits(16, c=3, size=32)
    for suite in ("mnist-c", "cifar-c"):
        cpu = AugMix(suite)(x, gen(4))
        cuda = AugMix(suite)(x.cuda(), gen(4))
        assert cuda.device.type == "cuda"
        # the same draws (taken on the generator's CPU); only float rounding of the warps differs
        torch.testing.assert_close(cuda.cpu(), cpu, rtol=0, atol=1e-4)
