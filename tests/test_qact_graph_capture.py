"""What capturing QACT in a CUDA graph needs of its device path, checked without a GPU.

A CUDA graph records kernels once and replays them; while it is captured nothing may be read back to
the host (a synchronisation), copied from the host, or drawn from a generator made for the occasion.
QACT's CUDA path therefore draws its KDE samples from a seed tensor made on the device (the
module's), whose comb offsets are SplitMix64 of the seed computed there (the compiled CPU kernels'
arithmetic, so a seed gives the same samples on every path), weighs a cumulative average
(``momentum=None``) on the device, grounds the context without a host tensor, and asserts finiteness
(the output pass's flags) on the device during capture. The tests run that path on the fake accelerator of
``tests/_fake_device.py`` with stand-ins for the Triton kernels (a launch takes pointers and sizes,
so no value crosses to the host there; the kernels themselves are checked against the eager code in
Triton's interpreter, ``tests/test_qact_triton.py``) and count what crosses. Every comparison is
between two computations of this run.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from _fake_device import DEVICE, FakeDevice

import shiftguard.functional.quantile as Q
from shiftguard import _rng
from shiftguard._numba import AVAILABLE as NUMBA
from shiftguard.functional import _qact_cpu, channel_values
from shiftguard.nn import QACTBlock


def test_torch_splitmix64_equals_the_compiled_kernels():
    from shiftguard._numba import splitmix64

    keys = np.array([0, 1, 2, 2**31, 2**62 - 1, 2**63, 2**63 + 5, 2**64 - 1, 0x9E3779B97F4A7C15], dtype=np.uint64)
    keys = np.concatenate([keys, np.random.default_rng(0).integers(0, 2**63, 200, dtype=np.uint64) * 2 + 1])
    want = np.array([splitmix64(k) for k in keys], dtype=np.uint64)
    got = _rng.splitmix64(torch.from_numpy(keys.view(np.int64))).numpy().view(np.uint64)
    assert np.array_equal(got, want)
    with pytest.raises(TypeError, match="^key:"):
        _rng.splitmix64(torch.zeros(2, dtype=torch.int32))


@pytest.mark.skipif(not NUMBA, reason="needs the compiled CPU kernels")
def test_a_seed_tensor_gives_the_compiled_kernels_samples_on_the_torch_path():
    """A seed tensor's comb offsets are the compiled kernels' (``_qact_cpu`` with the same seed):
    the torch path (CUDA's, and the Triton path's draws) draws the same KDE samples."""
    g = torch.Generator().manual_seed(0)
    for shape in ((64, 5), (6, 3, 4, 4)):
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        seed = torch.tensor([0x5DEECE66D << 20])
        ctx = torch.sort(Q._grounded(channel_values(x), 100.0), dim=1).values
        n_neg = torch.searchsorted(ctx, torch.zeros(ctx.shape[0], 1, dtype=ctx.dtype))[:, 0]
        samples, bw = Q._draw_samples(ctx, n_neg, 300, seed, None)
        want, want_bw = _qact_cpu.grounded_samples(ctx.numpy(), 300, int(seed))
        assert torch.equal(samples, torch.from_numpy(want))
        torch.testing.assert_close(bw, torch.from_numpy(want_bw), rtol=1e-12, atol=0)
        # and through the two forwards: the same statistics for the same seed
        eager = Q._eager_forward(x, None, None, 20, 100.0, 300, seed)
        compiled = Q._forward(x, None, None, 20, 100.0, 300, seed, False)
        assert torch.equal(eager.output, compiled.output)
        assert torch.equal(eager.stats.samples, compiled.stats.samples)
        # another seed, other samples
        assert not torch.equal(Q._draw_samples(ctx, n_neg, 300, seed + 1, None)[0], samples)


def test_a_seed_stands_for_a_seeded_generator_on_the_cpu():
    """On the CPU a seed keeps meaning the generator seeded with it (CPU results keep their bits);
    elsewhere it is the seed itself, used on the device."""
    seed = torch.tensor([77])
    draws = Q._draws_of_seed(seed, torch.device("cpu"))
    assert isinstance(draws, torch.Generator)
    assert torch.equal(
        torch.randint(0, 9, (5,), generator=draws),
        torch.randint(0, 9, (5,), generator=torch.Generator().manual_seed(77)),
    )
    with FakeDevice() as fd:
        on_device = Q._draws_of_seed(seed.to(DEVICE), DEVICE)
        assert isinstance(on_device, torch.Tensor) and on_device.device == DEVICE
    assert fd.host_reads == [] and fd.generators == []


class _StandIns:
    """The Triton stages' signatures and output shapes (values are placeholders: what is counted
    is what crosses between host and device around them)."""

    @staticmethod
    def grounded_context(x, c):
        return x.new_zeros(x.shape[1], x.numel() // x.shape[1] + 2)

    @staticmethod
    def grounded_quantiles(ctx, n_tau, c):
        ch = ctx.shape[0]
        return ctx.new_zeros(ch, n_tau), torch.zeros(ch, dtype=torch.int64, device=ctx.device), ctx[:, 0], ctx[:, -1]

    @staticmethod
    def systematic_draws(ctx, n_neg, n_samples, seed=None, offsets=None, silverman=False):
        return ctx[:, :1].expand(-1, n_samples).contiguous(), (ctx[:, -1].clone() if silverman else None)

    @staticmethod
    def kde_grid(samples, h, xmin, xmax, per_h, truncate, max_points):
        ch = samples.shape[0]
        n = torch.zeros(ch, dtype=torch.int64, device=samples.device)
        return samples.new_zeros(ch, max_points + 2), h.clone(), h.clone(), n

    @staticmethod
    def levels_and_density(x, q, grid, lo, delta, n_nodes):
        finite = torch.isfinite(x).all().reshape(1).to(torch.int8)  # (the flags' meaning, computed by torch)
        return torch.zeros_like(x), (None if grid is None else torch.ones_like(x)), finite


@pytest.fixture
def device_path(monkeypatch):
    """QACT's CUDA path (Triton dispatch) for fake-device tensors, inside a simulated capture."""
    monkeypatch.setattr(Q, "_triton", lambda x: x.device.type == DEVICE.type)
    monkeypatch.setattr(Q._qact_triton, "kernels", lambda: SimpleNamespace(**vars(_StandIns)))
    monkeypatch.setattr(Q, "_capturing", lambda: True)


def _crossings(fd: FakeDevice) -> list:
    return [*fd.host_reads, *fd.uploads, *(("generator", w) for w in fd.generators)]


@pytest.mark.parametrize("momentum", [0.1, None])
def test_a_qact_block_trains_and_evaluates_on_the_device_path_without_crossing(device_path, momentum):
    """Training (forward, backward, running update; the cumulative average with ``momentum=None``),
    evaluation in batch context and the frozen context forward and backward: nothing read back,
    nothing copied from the host, no generator made, once the block and the input are on the device."""
    torch.manual_seed(0)
    block = QACTBlock(4, momentum=momentum)
    x = torch.randn(6, 4, 3, 3)
    with FakeDevice() as fd:
        b = block.to(DEVICE)
        xd = x.to(DEVICE).requires_grad_(True)
        weight = torch.linspace(-1.0, 1.0, x.numel()).reshape(x.shape).to(DEVICE)
        fd.uploads.clear()
        for _ in range(2):
            (b.train()(xd) * weight).sum().backward()
        with torch.no_grad():
            b.eval()(xd)
        b.act.context = "frozen"
        (b(xd) * weight).sum().backward()
        crossings = _crossings(fd)
        counted = int(b.act.num_batches_tracked.cpu())
    assert crossings == []
    assert counted == 2


def test_the_operators_run_on_the_device_path_without_crossing(device_path):
    """The body of ``qact_forward`` (what a CUDA graph records when the compiled module is captured),
    with the seed and the update count on the device, moving the running statistics or not."""
    x = torch.randn(8, 3, 2, 2)
    with FakeDevice() as fd:
        xd = x.to(DEVICE)
        seed = torch.randint(0, 2**62, (1,), device=DEVICE)
        count = torch.tensor(3, device=DEVICE)
        running = [t.to(DEVICE) for t in Q.default_statistics(3, 10, 20)]
        fd.uploads.clear()
        out, dens = Q._qact_forward_op._init_fn(
            xd, None, None, None, seed, *running, 0.1, count, 10, 100.0, 20, None, True
        )
        Q._backward(torch.ones_like(out), dens)
        Q._qact_forward_op._init_fn(xd, None, None, None, seed, None, None, None, 0.0, None, 10, 100.0, 20, None, False)
        Q._qact_forward_op._init_fn(xd, *running, None, None, None, None, 0.0, None, 10, 0.0, 0, 0.5, True)
        crossings = _crossings(fd)
    assert crossings == []


def test_a_cumulative_update_on_the_device_equals_the_cpu_update():
    """``momentum=None``: the weight ``1 / (n + 1)`` computed on the device moves the buffers as the
    CPU's float weight does, without reading the count back; and the operator, given statistics and
    the count, moves the buffers towards them alike on both."""
    stats = Q.default_statistics(3, 10, 20, dtype=torch.float64)
    new = Q.QACTStatistics(*(t + 1.0 for t in stats))
    x = torch.randn(8, 3, dtype=torch.float64)
    cpu, by_op = [t.clone() for t in stats], [t.clone() for t in stats]
    Q._move_running(Q._Running(*cpu, Q._cumulative(torch.tensor(4))), new)
    rest = (10, 0.0, 0, None, False)
    Q._qact_forward_op._init_fn(x, *new, None, *by_op, 0.1, torch.tensor(4), *rest)
    with FakeDevice() as fd:
        dev, dev_op = [t.to(DEVICE) for t in stats], [t.to(DEVICE) for t in stats]
        given = Q.QACTStatistics(*(t.to(DEVICE) for t in new))
        count = torch.tensor(4, device=DEVICE)
        fd.host_reads.clear()
        Q._move_running(Q._Running(*dev, Q._cumulative(count)), given)
        reads = list(fd.host_reads)
        Q._qact_forward_op._init_fn(x.to(DEVICE), *given, None, *dev_op, 0.1, count, *rest)
        dev, dev_op = [t.cpu() for t in dev], [t.cpu() for t in dev_op]
    assert reads == []
    for a, b, c, d in zip(cpu, dev, by_op, dev_op):
        for got in (b, c, d):
            torch.testing.assert_close(got, a, rtol=1e-15, atol=0)
    torch.testing.assert_close(cpu[0], stats.quantiles + 0.2, rtol=1e-15, atol=0)


def test_non_finite_input_is_refused_with_its_name_or_asserted_on_the_device_during_capture(monkeypatch):
    x = torch.randn(8, 3)
    x[2, 1] = float("nan")
    with pytest.raises(ValueError, match="^input:"):
        Q.quantile_activation(x)
    monkeypatch.setattr(Q, "_triton", lambda t: t.device.type == DEVICE.type)
    monkeypatch.setattr(Q._qact_triton, "kernels", lambda: SimpleNamespace(**vars(_StandIns)))
    with FakeDevice() as fd:
        xd = x.to(DEVICE)
        fd.uploads.clear()
        with pytest.raises(ValueError, match="^input:"):  # outside capture: the check reads its verdict
            Q.quantile_activation(xd, n_samples=0)
        assert fd.host_reads and {h.kind for h in fd.host_reads} == {"scalar"}
        monkeypatch.setattr(Q, "_capturing", lambda: True)
        fd.host_reads.clear()
        # during capture: a device-side assertion (the fake device runs it at once, a GPU at replay)
        with pytest.raises(RuntimeError):
            Q.quantile_activation(xd, n_samples=0)
        assert fd.host_reads == []
        Q.quantile_activation(torch.nan_to_num(xd), n_samples=0)  # finite: passes
