"""A model factory a test writes as a module of its own, and the ``shiftguard evaluate`` command line
that scores it in a few seconds (the command-line tests of files, environments and errors)."""

from __future__ import annotations

import sys

#: ``make_net(num_classes)``: a seeded MLP on 28x28 images.
FACTORY = """
import torch
from torch import nn

def make_net(num_classes):
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 8), nn.ReLU(), nn.Linear(8, num_classes))
"""


def evaluate_argv(
    tmp_path, monkeypatch, module: str, *extra: str, source: str = FACTORY, corruption: str = "fog"
) -> list[str]:
    """Write ``source`` as ``<tmp_path>/<module>.py`` (importable, not cached from an earlier test)
    and return ``shiftguard evaluate`` arguments scoring its ``make_net`` on 60 test images, one
    corruption at severity 5, the softmax head, then ``extra``."""
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(module, None)
    return [
        "evaluate",
        "--model",
        f"{module}:make_net",
        "--test-subset",
        "60",
        "--support-size",
        "120",
        "--val-size",
        "0",
        "--corruptions",
        corruption,
        "--severities",
        "5",
        "--n-boot",
        "10",
        "--no-progress",
        "--heads",
        "softmax",
        *extra,
    ]
