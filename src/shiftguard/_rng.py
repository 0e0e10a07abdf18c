"""A block of code under a fixed seed of torch's global generators, the caller's states restored after.

Why not ``torch.manual_seed`` inside ``torch.random.fork_rng``: ``torch.manual_seed`` also reseeds
every CUDA device (and queues the same call for the XPU and MTIA back ends, capturing the Python
stack each time while they are not initialised: ~1 ms a call, and the queue grows with every
call), while ``fork_rng(devices=[])`` restores the CPU generator only, so the caller's CUDA random
stream was changed behind its back. :func:`seeded` seeds and restores exactly the generators it
names: the CPU one always (QACT draws its sampling seeds from it, on every device), a CUDA
device's when ``device`` is one.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional, Union

import torch

__all__ = ["seeded"]


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
