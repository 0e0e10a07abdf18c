"""``ModelEntry``: one model of an evaluation, as the grid, the attacks and the results read it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from torch import nn

from .outputs import ModelOutputs

__all__ = ["ModelEntry"]


@dataclass(frozen=True)
class ModelEntry:
    """One model of an evaluation: its name (a folder of the cache, a value of the rows' ``model``),
    the module, where its logits and embedding come from, the heads it is scored with and the
    inference contexts a QACT model is scored in (a model without QACT is scored in ``"none"``)."""

    name: str
    model: nn.Module
    outputs: ModelOutputs
    heads: Sequence[str]
    contexts: Sequence[str] = ("batch", "frozen")

    def __post_init__(self) -> None:
        object.__setattr__(self, "heads", tuple(self.heads))
        object.__setattr__(self, "contexts", tuple(self.contexts))
