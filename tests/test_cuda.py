"""The same contracts on a CUDA device (skipped without one; ``benchmarks/device_check.sh`` runs them).

Each test compares the CUDA result with the CPU result of the same computation: QACT's eager
torch path (the GPU path) against its CPU kernels, the evaluation of a user's model on both
devices, and ``shiftguard run`` on the GPU.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shiftguard
from shiftguard.nn import QACTBlock, QuantileActivation

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_qact_block_trains_under_autocast(dtype):
    torch.manual_seed(0)
    block = QACTBlock(16).cuda()
    x = torch.randn(64, 16, 8, 8, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=dtype):
        y = block(x)
    y.float().pow(2).mean().backward()
    assert torch.isfinite(x.grad).all()


def test_evaluate_on_cuda_matches_cpu():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                        nn.Linear(128, 16), nn.ReLU(), nn.Linear(16, 3))
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
