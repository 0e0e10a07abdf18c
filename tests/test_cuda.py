"""The same contracts on a CUDA device (skipped without one; ``benchmarks/device_check.sh`` runs them).

Each test compares the CUDA result with the CPU result of the same computation: QACT's eager
torch path (the GPU path) against its CPU kernels, the evaluation of a user's model on both
devices, and ``shiftguard run`` on the GPU; then the gradient attacks and the Voronoi-epsilon
adversary, the uncertainty estimators, the contrastive and hierarchy losses and the seeded
augmentations, each with the same seed and weights on both devices.

Tolerances: float32 values (losses, log-probabilities, uncertainties) agree to ``rtol=1e-4,
atol=1e-5``; gradients to ``rtol=1e-3``. Where a sign or an argmax decides (FGSM's step, accuracy)
a tiny fraction of flips is allowed: cuDNN convolutions run in TF32 by default, and a gradient
entry near zero can change its sign between devices.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from _adversarial_helpers import OneNN, band_data, trained_band_mlp
from torch import nn

import shiftguard
from shiftguard.adversarial import (
    AttackSpec,
    fgsm,
    global_voronoi_robustness,
    pgd,
    standard_adversarial_accuracy,
    voronoi_adversarial_accuracy,
    voronoi_project,
)
from shiftguard.data import Augment, two_views
from shiftguard.losses import (
    CORRLoss,
    EMAProxies,
    ESupConLoss,
    InfoNCELoss,
    MomentumMeanClassifier,
    NormFaceLoss,
    SPCELoss,
    TightnessLoss,
)
from shiftguard.models import MLP
from shiftguard.nn import QACTBlock, QuantileActivation, convert_activations
from shiftguard.uncertainty import ESTIMATOR_NAMES, build_estimator

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def test_qact_forward_on_cuda_equals_the_cpu_reference():
    torch.manual_seed(0)
    x = torch.randn(256, 64)
    cpu = QuantileActivation(num_features=64)
    gpu = QuantileActivation(num_features=64).cuda()
    y_cpu = cpu(x)
    y_gpu = gpu(x.cuda())
    # the forward is exact (quantile positions within the context): float32 rounding only
    torch.testing.assert_close(y_gpu.cpu(), y_cpu, rtol=0, atol=1e-5)


def test_qact_backward_on_cuda_is_finite_and_close_to_cpu():
    torch.manual_seed(0)
    x = torch.randn(128, 32, dtype=torch.float64)
    grads = []
    for dev in ("cpu", "cuda"):
        torch.manual_seed(1)  # the KDE draws its samples from the global RNG
        layer = QuantileActivation(num_features=32).to(dev).double()
        xi = x.detach().to(dev).requires_grad_(True)
        layer(xi).pow(2).sum().backward()
        grads.append(xi.grad.cpu())
    assert torch.isfinite(grads[1]).all()
    # both are KDE estimates of the same density from different random draws: same scale and sign
    cos = torch.nn.functional.cosine_similarity(grads[0].flatten(), grads[1].flatten(), dim=0)
    assert cos > 0.9, float(cos)


@pytest.mark.parametrize("shape", [(256, 64), (32, 16, 8, 8)])
def test_qact_triton_path_on_cuda_equals_the_eager_torch_path(shape, monkeypatch):
    # the Triton kernels (dispatched on CUDA float32 where triton is installed) against the eager
    # torch code on the same device: the same forward, quantiles, samples and running quantiles and
    # samples; the bandwidths to rounding (Silverman's sums in another order); the density (the
    # gradient over grad_output) within twice the grid bound of each other
    import shiftguard.functional.quantile as Q
    from shiftguard.functional import channel_values, kde_grid_error_bound
    from shiftguard.functional.kde import grid_layout

    pytest.importorskip("triton")
    x = torch.randn(shape, device="cuda")
    results = []
    for use in (True, False):
        monkeypatch.setattr(Q, "USE_TRITON", use)
        running = Q._Running(*(t.cuda() for t in Q.default_statistics(shape[1])), 0.1)
        fwd = Q._forward(x, None, running, 100, 100.0, 1000, torch.Generator("cuda").manual_seed(1), True)
        results.append((fwd, running))
    (tri, r1), (eag, r0) = results
    assert torch.equal(tri.output, eag.output)
    assert torch.equal(tri.stats.quantiles, eag.stats.quantiles) and torch.equal(tri.stats.samples, eag.stats.samples)
    torch.testing.assert_close(tri.stats.bandwidth, eag.stats.bandwidth, rtol=1e-5, atol=0)
    assert all(torch.equal(a, b) for a, b in zip(r1[:2], r0[:2]))
    torch.testing.assert_close(r1[2], r0[2], rtol=1e-5, atol=0)
    s, h = eag.stats.samples.double(), eag.stats.bandwidth.double()
    xmin, xmax = torch.aminmax(channel_values(x).double(), dim=1)
    _, delta, _ = grid_layout(s.min(1).values, s.max(1).values, h, xmin, xmax)
    bound = 2 * kde_grid_error_bound(h, delta)[:, None] + 1e-5 / h[:, None]
    diff = channel_values((tri.density - eag.density).double()).abs()
    assert (diff <= bound).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_qact_on_cuda_refuses_non_finite_input_by_name_before_its_running_statistics_move(bad):
    # on the Triton path the verdict comes from the output pass's flags (after the draws from the
    # module's seed), on the eager path from a pass before the forward: the same refusal either way
    torch.manual_seed(0)
    block = QACTBlock(4).cuda().train()
    x = torch.randn(8, 4, 3, 3, device="cuda")
    x[5, 2, 1, 0] = bad
    before = {k: v.clone() for k, v in block.state_dict().items()}
    with pytest.raises(ValueError, match=r"^input: contains non-finite values"):
        block(x.requires_grad_(True))
    assert all(torch.equal(before[k], v) for k, v in block.state_dict().items() if "act." in k)


def test_qact_block_compiles_on_cuda_and_trains_as_eager():
    torch.manual_seed(0)
    eager = QACTBlock(16).cuda()
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, backend="aot_eager", fullgraph=True)
    x = torch.randn(64, 16, 8, 8, device="cuda")
    outs = []
    for m in (eager, compiled):
        xi = x.clone().requires_grad_(True)
        torch.manual_seed(3)
        y = m(xi)
        y.square().sum().backward()
        outs.append((y.detach(), xi.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert all(torch.equal(a, b) for a, b in zip(eager.state_dict().values(), twin.state_dict().values()))


@pytest.mark.parametrize("momentum", [0.1, None, 1.0])
def test_qact_block_training_step_is_captured_in_a_cuda_graph_and_replays_like_eager(momentum):
    """A QACTBlock's training step (forward, backward, running updates) on the Triton path, captured in
    a CUDA graph and replayed: the forward and the running quantiles equal the eager block's after
    the same steps (they do not depend on the draws), the gradient is a KDE estimate of the same
    density; and each replay draws fresh samples (the seed is drawn on the device at replay: with
    ``momentum=1`` the running samples are the last batch's)."""
    pytest.importorskip("triton")
    torch.manual_seed(0)
    block = QACTBlock(16, momentum=momentum).cuda().train()
    eager = copy.deepcopy(block)
    x = torch.randn(64, 16, 8, 8, device="cuda", requires_grad=True)
    xe = x.detach().clone().requires_grad_(True)
    w = torch.randn(64, 16, 8, 8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture (Triton compiles its kernels here)
        for _ in range(2):
            (block(x) * w).sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(2):
        (eager(xe) * w).sum().backward()
    x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = block(x)
        (y * w).sum().backward()
    samples = []
    for _ in range(3):
        xe.grad = None
        ye = eager(xe)
        (ye * w).sum().backward()
        graph.replay()
        torch.cuda.synchronize()
        samples.append(block.act.running_samples.clone())
        assert torch.equal(y, ye)
        assert torch.equal(block.act.running_quantiles, eager.act.running_quantiles)
        assert int(block.act.num_batches_tracked) == int(eager.act.num_batches_tracked)
        assert torch.isfinite(x.grad).all()
        cos = torch.nn.functional.cosine_similarity(x.grad.flatten(), xe.grad.flatten(), dim=0)
        assert cos > 0.9, float(cos)
    if momentum == 1.0:
        assert not torch.equal(samples[0], samples[1]) and not torch.equal(samples[1], samples[2])


def test_qact_conversion_with_a_cuda_example_leaves_the_cuda_generator_as_it_was():
    # QACT draws its KDE seeds from the input device's generator: the example forward must not move it
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU()).cuda()
    before = torch.cuda.get_rng_state()
    convert_activations(model, "qact", example_input=torch.randn(8, 1, 6, 6, device="cuda"))
    assert torch.equal(torch.cuda.get_rng_state(), before)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_qact_block_trains_under_autocast(dtype):
    torch.manual_seed(0)
    block = QACTBlock(16).cuda()
    x = torch.randn(64, 16, 8, 8, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=dtype):
        y = block(x)
    y.float().pow(2).mean().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_qact_half_precision_on_cuda_is_the_float32_path_on_the_upcast_values(dtype):
    # what a QACT layer receives inside a network under autocast (a convolution's half output):
    # the Triton path computes it in float32 on the exactly upcast values and rounds the output back
    import shiftguard.functional.quantile as Q

    pytest.importorskip("triton")
    x = torch.randn(64, 16, 8, 8, device="cuda").to(dtype)
    seed = torch.tensor([5], device="cuda")
    half = Q._forward(x, None, None, 100, 100.0, 1000, seed, True)
    full = Q._forward(x.float(), None, None, 100, 100.0, 1000, seed, True)
    assert half.output.dtype == dtype and torch.equal(half.output, full.output.to(dtype))
    assert half.density.dtype == torch.float32 and torch.equal(half.density, full.density)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), QACTBlock(16)).cuda()
    with torch.autocast("cuda", dtype=dtype):
        y = net(torch.randn(32, 3, 8, 8, device="cuda"))
    y.float().square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in net.parameters())


def test_evaluate_on_cuda_matches_cpu():
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(128, 16),
        nn.ReLU(),
        nn.Linear(16, 3),
    )
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (120, 1, 28, 28), generator=g, dtype=torch.uint8)
    y = torch.arange(120) % 3
    kw = dict(support=(x, y), corruptions=["fog", "rotate"], severities=[3], heads=["softmax", "knn"], n_boot=50)
    cpu = shiftguard.evaluate(net, (x, y), **kw)
    gpu = shiftguard.evaluate(net, (x, y), device="cuda", **kw)
    # corruption noise is drawn on the images' device (CPU here), so the cells hold the same images
    for a, b in zip(cpu.rows, gpu.rows):
        assert (a["head"], a["corruption"]) == (b["head"], b["corruption"])
        assert a["accuracy"] == pytest.approx(b["accuracy"], abs=2 / 120)
        assert a["nll"] == pytest.approx(b["nll"], rel=1e-3, abs=1e-4)


def test_run_quick_on_cuda(tmp_path):
    from shiftguard.cli import main as cli

    assert cli(["run", "--quick", "--device", "cuda", "--no-progress", "--out", str(tmp_path), "--name", "gpu"]) == 0
    assert (tmp_path / "gpu" / "COMPLETE").is_file()


#: The device under test in the tests below; the CPU computes the reference.
CUDA = "cuda"


def _on_device(t: torch.Tensor) -> bool:
    return t.device.type == torch.device(CUDA).type


# ------------------------------------------------------------------------------------ adversarial shift


def _small_cnn():
    # Strided convolutions instead of pooling: the CUDA backward of adaptive pooling accumulates with
    # atomics, which would make two identical attacks differ in the last bits.
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 7 * 7, 3),
    )


def _float_pixels(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 1, 28, 28, generator=g), torch.arange(n) % 3


def _l2_per_image(delta):
    return delta.flatten(1).norm(dim=1)


@pytest.fixture
def cudnn_deterministic():
    """cuDNN's deterministic algorithms for one test (restored after): bitwise-repeatable convolutions."""
    before = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True
    yield
    torch.backends.cudnn.deterministic = before


@pytest.mark.parametrize("norm, eps", [("linf", 8 / 255), ("l2", 0.5)])
def test_fgsm_on_cuda_takes_the_cpu_step_inside_the_budget(norm, eps):
    x, y = _float_pixels()
    net = _small_cnn()
    adv_cpu = fgsm(net, x, y, eps, norm=norm)
    adv_gpu = fgsm(copy.deepcopy(net).to(CUDA), x.to(CUDA), y.to(CUDA), eps, norm=norm)
    assert _on_device(adv_gpu) and adv_gpu.dtype == x.dtype
    adv_gpu = adv_gpu.cpu()
    for adv in (adv_cpu, adv_gpu):
        assert float(adv.min()) >= 0.0 and float(adv.max()) <= 1.0
        if norm == "linf":
            assert float((adv - x).abs().max()) <= eps + 1e-6
        else:
            assert float(_l2_per_image(adv - x).max()) <= eps * (1 + 1e-5)
    if norm == "linf":
        # every pixel moves by the sign of its gradient: the same sign on both devices, up to a few
        # entries whose gradient is near zero
        agree = (torch.sign(adv_gpu - x) == torch.sign(adv_cpu - x)).float().mean()
        assert float(agree) >= 0.99, float(agree)
        assert float((adv_cpu - x).abs().max()) > eps / 2  # the attack moved the pixels
    else:
        # the L2 step eps * g / ||g|| (then the box): the same direction and length on both devices, up
        # to the rounding of the gradient (TF32 in cuDNN's convolutions)
        d_cpu, d_gpu = (adv_cpu - x).flatten(1), (adv_gpu - x).flatten(1)
        cos = nn.functional.cosine_similarity(d_gpu, d_cpu, dim=1)
        assert float(cos.min()) >= 0.999, float(cos.min())
        torch.testing.assert_close(d_gpu.norm(dim=1), d_cpu.norm(dim=1), rtol=1e-3, atol=1e-5)
        assert float(d_cpu.norm(dim=1).min()) > eps / 2  # the attack moved the pixels


@pytest.mark.parametrize("norm, eps", [("linf", 8 / 255), ("l2", 0.5)])
def test_pgd_on_cuda_is_reproducible_from_its_seed_and_stays_in_the_ball(norm, eps, cudnn_deterministic):
    x, y = _float_pixels()
    net = _small_cnn().to(CUDA)
    xg, yg = x.to(CUDA), y.to(CUDA)
    runs = [pgd(net, xg, yg, eps, norm=norm, steps=5, generator=torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    adv = runs[0]
    assert _on_device(adv)
    assert float(adv.min()) >= 0.0 and float(adv.max()) <= 1.0
    if norm == "linf":
        assert float((adv - xg).abs().max()) <= eps + 1e-6
    else:
        assert float(_l2_per_image(adv - xg).max()) <= eps * (1 + 1e-5)
    other = pgd(net, xg, yg, eps, norm=norm, steps=5, generator=torch.Generator().manual_seed(8))
    assert not torch.equal(adv, other)  # the seed decides the start


def test_pgd_random_start_is_the_same_on_both_devices():
    """``AttackSpec.run`` draws PGD's start from a CPU generator seeded with ``seed``: with one tiny step
    the result is that start, so it must not depend on the device."""
    x, y = _float_pixels(32)
    net = _small_cnn()
    spec = AttackSpec("pgd", eps=8 / 255, steps=1, step_size=1e-6)
    on_cpu = spec.run(net, x, y, seed=3)
    on_gpu = spec.run(copy.deepcopy(net).to(CUDA), x, y, seed=3, device=CUDA)
    assert on_gpu.device == x.device  # returned where the images are
    torch.testing.assert_close(on_gpu, on_cpu, rtol=0, atol=3e-6)
    assert float((on_cpu - x).abs().mean()) > 1e-3  # the start is random, not the clean image


def test_evaluate_with_attacks_on_cuda_matches_cpu():
    x, y = band_data(120)
    net = trained_band_mlp(x, y)
    kw = dict(
        support=(x, y),
        corruptions=["fog"],
        severities=[3],
        heads=["softmax", "knn"],
        k=3,
        n_boot=10,
        attacks=["fgsm", "pgd-l2"],
        attack_eps=[0.05, 0.3],
        attack_steps=5,
    )
    cpu = shiftguard.evaluate(net, (x, y), **kw)
    gpu = shiftguard.evaluate(copy.deepcopy(net), (x, y), device=CUDA, **kw)
    assert len(cpu.rows) == len(gpu.rows)
    adversarial = [r for r in gpu.rows if r["group"] == "adversarial"]
    assert len(adversarial) == 2 * 2 * 2  # attacks x budgets x heads
    for a, b in zip(cpu.rows, gpu.rows):
        assert (a["head"], a["corruption"], a["severity"], a["group"]) == (
            b["head"],
            b["corruption"],
            b["severity"],
            b["group"],
        )
        # each (model, head) is attacked white-box on its device: a couple of images may flip
        assert a["accuracy"] == pytest.approx(b["accuracy"], abs=3 / 120)
        if a["group"] != "adversarial":  # the same images on both devices
            assert a["nll"] == pytest.approx(b["nll"], rel=1e-3, abs=1e-4)
    clean = next(r for r in gpu.rows if r["corruption"] == "clean" and r["head"] == "softmax")
    strong = next(
        r for r in adversarial if r["corruption"] == "fgsm-linf" and r["severity"] == 2 and r["head"] == "softmax"
    )
    assert strong["accuracy"] < clean["accuracy"]  # the attack works on the device


def test_voronoi_project_on_cuda_equals_cpu_and_stays_in_the_cell():
    g = torch.Generator().manual_seed(1)
    ref = torch.rand(60, 10, generator=g)
    x = ref[:20]
    y = (x + 0.4 * torch.randn(20, 10, generator=g)).clamp(-1, 2)
    eps = 0.3
    z_cpu = voronoi_project(y, x, ref, eps)
    z_gpu = voronoi_project(y.to(CUDA), x.to(CUDA), ref.to(CUDA), eps)
    assert _on_device(z_gpu) and z_gpu.dtype == torch.float32
    z_gpu = z_gpu.cpu()
    # float64 Dykstra iterations stopped at tol=1e-9 on each device, returned in float32
    torch.testing.assert_close(z_gpu, z_cpu, rtol=0, atol=1e-5)
    d_other = torch.cdist(z_gpu.double(), ref.double(), compute_mode="donot_use_mm_for_euclid_dist")
    d_other[torch.arange(20), torch.arange(20)] = math.inf
    d_self = (z_gpu.double() - x.double()).norm(dim=1)
    assert bool((d_self < d_other.min(1).values).all())  # nearer to x than to any other reference point
    assert float(d_self.max()) <= eps * (1 + 1e-6) + 1e-7
    assert float(z_gpu.min()) >= 0.0 and float(z_gpu.max()) <= 1.0


def test_voronoi_theorem_1_holds_on_cuda():
    """[Kim, Art. III, Theorem 1] on the device: the 1-NN classifier keeps Voronoi-epsilon accuracy 1
    on its own points at every eps; the standard adversary fools it in the whole box."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(16, 3, generator=g)
    y = (x[:, 0] + 0.2 * torch.randn(16, generator=g) > 0.5).long()
    model = OneNN(x, y, 2).to(CUDA)
    vaa = voronoi_adversarial_accuracy(model, x, y, x, [0.05, 0.3, math.inf], steps=4)
    assert vaa == {0.05: 1.0, 0.3: 1.0, math.inf: 1.0}
    assert global_voronoi_robustness(model, x, y, x, steps=4) == 1.0
    assert standard_adversarial_accuracy(model, x, y, [math.inf], steps=4)[math.inf] < 1.0


# ------------------------------------------------------------------------------- uncertainty estimators

#: Small settings of every estimator of ``build_estimator`` (a new name without an entry fails below).
ESTIMATOR_KW = {
    "ensemble": dict(num_members=4),
    "hetxl": dict(num_samples=8),
    "loss_prediction": dict(hidden=(32, 32)),
    "mc_dropout": dict(rate=0.2, num_samples=5),
    "sngp": dict(num_features=64),
}


def _estimator(name, dev):
    torch.manual_seed(0)  # the same weights, random features and spectral-norm vectors on both devices
    return build_estimator(name, MLP(num_classes=3, hidden=(32, 16)), **ESTIMATOR_KW[name]).to(dev)


@pytest.mark.parametrize("name", ESTIMATOR_NAMES)
def test_estimator_on_cuda_equals_cpu(name):
    """Eval-mode log-probabilities and uncertainties, and the training objective with its gradients.

    Eval-mode noise (MC dropout's masks, HET-XL's samples) is drawn from the estimator's seed on a CPU
    generator, so it is the same on both devices; HET-XL's objective is compared in eval mode for that
    reason. MC dropout's objective always draws its mask on the device: only finite there.
    """
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(24, 1, 28, 28, generator=g), torch.arange(24) % 3
    res = {}
    for side, dev in (("cpu", "cpu"), ("gpu", CUDA)):
        est = _estimator(name, dev)
        xd, yd = x.to(dev), y.to(dev)
        if name == "sngp":
            est.fit_covariance([xd[:12], (xd[12:], yd[12:])])
        est.eval()
        with torch.no_grad():
            log_probs = est(xd)
        unc = est.uncertainty(xd)
        est.train(name != "hetxl")
        loss = est.training_loss(xd, yd)
        loss.backward()
        grads = {n: p.grad.detach().cpu() for n, p in est.named_parameters() if p.grad is not None}
        res[side] = dict(
            log_probs=log_probs.cpu(),
            unc={k: v.cpu() for k, v in unc.items()},
            loss=loss.detach().cpu(),
            grads=grads,
            sigma=est.posterior_covariance().cpu() if name == "sngp" else None,
        )
    cpu, gpu = res["cpu"], res["gpu"]
    assert gpu["log_probs"].shape == (24, 3)
    torch.testing.assert_close(gpu["log_probs"].exp().sum(1), torch.ones(24), rtol=0, atol=1e-5)
    torch.testing.assert_close(gpu["log_probs"], cpu["log_probs"], rtol=1e-4, atol=1e-5)
    assert set(gpu["unc"]) == set(est.uncertainty_names)
    for key in cpu["unc"]:
        assert gpu["unc"][key].shape == (24,) and bool(torch.isfinite(gpu["unc"][key]).all()), key
        torch.testing.assert_close(gpu["unc"][key], cpu["unc"][key], rtol=1e-4, atol=1e-5, msg=key)
    assert bool(torch.isfinite(gpu["loss"])) and gpu["grads"]
    for n, gr in gpu["grads"].items():
        assert bool(torch.isfinite(gr).all()), n
    if name == "sngp":  # fit_covariance on the device: the same posterior covariance
        torch.testing.assert_close(gpu["sigma"], cpu["sigma"], rtol=1e-4, atol=1e-5)
    if name != "mc_dropout":
        torch.testing.assert_close(gpu["loss"], cpu["loss"], rtol=1e-4, atol=1e-5)
        assert set(gpu["grads"]) == set(cpu["grads"])
        for n in cpu["grads"]:
            torch.testing.assert_close(gpu["grads"][n], cpu["grads"][n], rtol=1e-3, atol=1e-5, msg=n)


# ------------------------------------------------------------------- contrastive and hierarchy losses


def _tightness():
    loss = TightnessLoss(4, 16, base=SPCELoss(4, 16), stop_gradient=False)
    with torch.no_grad():  # non-zero prototypes, so that l_tt is not identically zero
        loss.prototypes.copy_(torch.randn(4, 16))
    return loss


#: Each loss added with the contrastive and hierarchy training, in a non-default setting where one exists.
NEW_LOSSES = {
    "spce": lambda: SPCELoss(4, 16),
    "spce-normalized": lambda: SPCELoss(4, 16, temperature=0.5, normalize=True),
    "tightness+spce": _tightness,
    "esupcon": lambda: ESupConLoss(4, 16),
    "infonce": lambda: InfoNCELoss(temperature=0.1),
    "corr": lambda: CORRLoss(num_classes=4, embedding_dim=16),
    "normface": lambda: NormFaceLoss(4, 16),
    "normface-dynamic-adam": lambda: NormFaceLoss(4, 16, dynamic=True),
    "normface-dynamic-adacos": lambda: NormFaceLoss(4, 16, dynamic=True, dynamic_rule="adacos"),
    "normface-ema": lambda: NormFaceLoss(4, 16, ema_alpha=0.1),
}


@pytest.mark.parametrize("name", sorted(NEW_LOSSES))
def test_new_losses_on_cuda_equal_cpu_with_a_finite_backward(name):
    """Value, gradients (embeddings and parameters) and the state a training-mode call updates
    (NormFace's dynamic scale and its EMA proxies) agree between the devices."""
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(32, 16, generator=g)
    # InfoNCE takes instance ids of two views; the others class labels
    labels = torch.arange(16).repeat(2) if name == "infonce" else torch.arange(32) % 4
    res = {}
    for side, dev in (("cpu", "cpu"), ("gpu", CUDA)):
        torch.manual_seed(0)  # prototypes and proxies are drawn from the global generator
        loss_fn = NEW_LOSSES[name]().to(dev).train()
        z = emb.to(dev).detach().clone().requires_grad_(True)
        value = loss_fn(z, labels.to(dev))
        value.backward()
        res[side] = dict(
            value=value.detach().cpu(),
            grad=z.grad.cpu(),
            params={n: p.grad.cpu() for n, p in loss_fn.named_parameters() if p.grad is not None},
            state={k: v.detach().cpu() for k, v in loss_fn.state_dict().items()},
        )
    cpu, gpu = res["cpu"], res["gpu"]
    assert gpu["value"].shape == () and bool(torch.isfinite(gpu["value"]))
    assert bool(torch.isfinite(gpu["grad"]).all())
    torch.testing.assert_close(gpu["value"], cpu["value"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gpu["grad"], cpu["grad"], rtol=1e-3, atol=1e-6)
    assert set(gpu["params"]) == set(cpu["params"])
    for n in cpu["params"]:
        assert bool(torch.isfinite(gpu["params"][n]).all()), n
        torch.testing.assert_close(gpu["params"][n], cpu["params"][n], rtol=1e-3, atol=1e-6, msg=n)
    assert set(gpu["state"]) == set(cpu["state"])
    for k in cpu["state"]:
        torch.testing.assert_close(gpu["state"][k], cpu["state"][k], rtol=1e-4, atol=1e-6, msg=k)


def test_prototype_classifiers_and_ema_proxies_on_cuda_equal_cpu():
    """The posteriors of SPCE (after ``fit``), tightness and ESupCon, the momentum-mean classifier after
    one update, and one EMA proxy update [Kim, Art. IV, eq. (12)]."""
    g = torch.Generator().manual_seed(0)
    ref, ref_y = torch.randn(40, 16, generator=g), torch.arange(40) % 4
    query = torch.randn(12, 16, generator=g)
    res = {}
    for side, dev in (("cpu", "cpu"), ("gpu", CUDA)):
        torch.manual_seed(0)
        out = {
            "spce": SPCELoss(4, 16).to(dev).fit(ref.to(dev), ref_y.to(dev)).predict_proba(query.to(dev)),
            "tightness": _tightness().to(dev).predict_proba(query.to(dev)),
            "esupcon": ESupConLoss(4, 16).to(dev).predict_proba(query.to(dev)),
            "momentum": MomentumMeanClassifier(4, 16)
            .to(dev)
            .update(ref.to(dev), ref_y.to(dev))
            .predict_proba(query.to(dev)),
        }
        ema = EMAProxies(4, 16, alpha=0.1).to(dev)
        ema.update(ref.to(dev), ref_y.to(dev))
        out["ema"] = ema.proxies
        res[side] = {k: v.detach().cpu() for k, v in out.items()}
    for k in res["cpu"]:
        torch.testing.assert_close(res["gpu"][k], res["cpu"][k], rtol=1e-4, atol=1e-5, msg=k)
    torch.testing.assert_close(res["gpu"]["ema"].norm(dim=1), torch.ones(4), rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------ augmentation


@pytest.mark.parametrize("hflip", [False, True], ids=["crop-jitter", "crop-flip-jitter"])
def test_augment_of_cuda_images_with_a_cpu_generator_equals_the_cpu_result(hflip):
    """Every random number comes from the generator, here on the CPU: the same crops, flips and
    factors for CUDA images. Only the bilinear sampling rounds differently: on random pixels
    (neighbours differ by up to 1) a coordinate rounded differently by a few float32 ulps moves the
    value by as much, times the jitter factors (up to 1.4 each), hence 1e-4."""
    x = torch.rand(16, 3, 20, 24, generator=torch.Generator().manual_seed(0))
    aug = Augment(hflip=hflip)
    on_cpu = aug(x, torch.Generator().manual_seed(1))
    on_gpu = aug(x.to(CUDA), torch.Generator().manual_seed(1))
    assert _on_device(on_gpu) and on_gpu.dtype == x.dtype and on_gpu.shape == x.shape
    torch.testing.assert_close(on_gpu.cpu(), on_cpu, rtol=0, atol=1e-4)
    assert not torch.equal(on_cpu, x)  # the augmentation changed the images


def test_two_views_with_a_cuda_generator_is_seeded_and_feeds_infonce():
    x = torch.rand(8, 1, 28, 28, generator=torch.Generator().manual_seed(0)).to(CUDA)
    views, ids = two_views(x, torch.Generator(device=CUDA).manual_seed(3))
    again, _ = two_views(x, torch.Generator(device=CUDA).manual_seed(3))
    assert torch.equal(views, again)
    assert views.shape == (16, 1, 28, 28) and _on_device(views) and _on_device(ids)
    assert ids.tolist() == list(range(8)) * 2
    assert float(views.min()) >= 0.0 and float(views.max()) <= 1.0
    assert not torch.equal(views[:8], views[8:])  # two independent draws
    z = views.flatten(1).clone().requires_grad_(True)
    loss = InfoNCELoss()(z, ids)
    loss.backward()
    assert bool(torch.isfinite(loss)) and bool(torch.isfinite(z.grad).all())
