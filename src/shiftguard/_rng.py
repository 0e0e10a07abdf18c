"""A block of code under a fixed seed of torch's global generators, the caller's states restored after.

Why not ``torch.manual_seed`` inside ``torch.random.fork_rng``: ``torch.manual_seed`` also reseeds
every CUDA device (and queues the same call for the XPU and MTIA back ends, capturing the Python
stack each time while they are not initialised: ~1 ms a call, and the queue grows with every
call), while ``fork_rng(devices=[])`` restores the CPU generator only, so the caller's CUDA random
stream was changed behind its back. :func:`seeded` seeds and restores exactly the generators it
names: the CPU one always, a CUDA device's when ``device`` is one (QACT draws its sampling seeds
from the generator of its input's device).

:func:`splitmix64` is the counter-based generator of the compiled kernels
(:func:`shiftguard._numba.splitmix64`) in torch operations, for random bits computed on a device
from a seed tensor without a generator or a read back to the host (what CUDA-graph capture needs).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional, Union

import torch

__all__ = ["seeded", "splitmix64"]


def _signed(c: int) -> int:
    """The uint64 constant ``c`` as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


_M1, _M2, _M3 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


@contextmanager
def seeded(seed: int, device: Optional[Union[str, torch.device]] = None) -> Iterator[None]:
    """Run the block with torch's global CPU generator seeded with ``seed`` -- and, when ``device``
    is a CUDA device, that device's default generator too -- and restore their states after."""
    dev = torch.device(device) if device is not None else None
    cuda: list[int] = []
    if dev is not None and dev.type == "cuda":
        cuda = [dev.index if dev.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=cuda):
        torch.default_generator.manual_seed(seed)
        for index in cuda:
            torch.cuda.default_generators[index].manual_seed(seed)
        yield


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """The logical right shift of int64 ``z`` read as uint64 (torch's ``>>`` is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(key: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser of the int64 tensor ``key`` read as uint64, the 64 bits returned as
    int64: bit for bit :func:`shiftguard._numba.splitmix64` (the multiplications wrap modulo 2^64 in
    int64 as they do in uint64; the shifts are logical), elementwise on ``key``'s device."""
    if key.dtype != torch.int64:
        raise TypeError(f"key: expected an int64 tensor, got {key.dtype}")
    z = key * _M1
    z = (z ^ _shift_right(z, 30)) * _M2
    z = (z ^ _shift_right(z, 27)) * _M3
    return z ^ _shift_right(z, 31)
