"""The evaluation's typed records: a model to score, the plan of a grid, what the grid returns.

:func:`~.evaluate.evaluate` checks its arguments and builds an :class:`EvaluationPlan`;
:func:`~.grid.run_grid` scores it and returns a :class:`GridResult`; the results dict (rows,
aggregates, intervals) is built from that at the JSON boundary. Each step of the grid returns the
seconds it measured as :class:`Timings`, summed by the grid.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from .adaptation import AdaptSpec
from .adversarial import ADVERSARIAL, AttackSuite
from .cell import Cell
from .conformal import ConformalSpec
from .entry import ModelEntry

__all__ = ["EvaluationPlan", "GridResult", "ModelEntry", "Timings"]

Pair = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class EvaluationPlan:
    """Everything :func:`~.grid.run_grid` scores: the models, the data, the cells and how.

    ``test``, ``support``, ``validation``, ``calibration``: ``(images, labels)`` on any device
    (``support`` fits the embedding heads, ``validation`` temperature scaling and NED's
    temperature, ``calibration`` the conformal sets; ``calibration_source`` says where it came
    from). ``shifted(corruption, severity)`` returns the corrupted test images in the order of
    ``test``. ``cells`` excludes the clean test set, which is always scored. The other fields are
    :func:`~.evaluate.evaluate`'s arguments of the same names (``cache_root`` its ``cache_dir``;
    ``adapt`` and ``conformal`` parsed).
    """

    models: Sequence[ModelEntry]
    test: Pair
    cells: Sequence[Cell]
    shifted: Callable[[str, int], torch.Tensor]
    num_classes: int
    support: Optional[Pair] = None
    validation: Optional[Pair] = None
    calibration: Optional[Pair] = None
    calibration_source: Optional[str] = None
    cache_root: Optional[Path] = None
    batch_size: int = 500
    device: torch.device = torch.device("cpu")
    k: int = 10
    retrieval_ks: Sequence[int] = (1, 5)
    ece_bins: int = 15
    knn_backend: str = "auto"
    adapt: Sequence[AdaptSpec] = (AdaptSpec("none"),)
    seed: int = 0
    conformal: Optional[ConformalSpec] = None
    attacks: Optional[AttackSuite] = None
    progress: bool = False
    distributed: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "cells", [Cell(*c) for c in self.cells])
        object.__setattr__(self, "device", torch.device(self.device))
        if self.cache_root is not None:
            object.__setattr__(self, "cache_root", Path(self.cache_root))
        if self.conformal is not None and self.calibration is None:
            raise ValueError("calibration: conformal prediction sets need calibration data")
        if any(c.group == ADVERSARIAL for c in self.cells) and self.attacks is None:
            raise ValueError("cells: adversarial cells need the attacks that make their images")

    @property
    def all_cells(self) -> list[Cell]:
        """The clean test set (severity 0, scored as ``corruption="clean"``), then ``cells``."""
        from .aggregate import CLEAN

        return [Cell(CLEAN, 0, "benchmark"), *self.cells]


@dataclass
class Timings:
    """Seconds spent by the grid's steps (summed over processes under torch.distributed). The
    corruption and attack seconds are part of the embedding and adaptation seconds, which include
    making the images they read. On a CUDA device each is read after the device's queued work is
    done (the grid synchronises at the steps' ends)."""

    embed_s: float = 0.0
    adapt_s: float = 0.0
    fit_heads_s: float = 0.0
    score_s: float = 0.0
    corrupt_s: float = 0.0
    attack_s: float = 0.0

    def __add__(self, other: Timings) -> Timings:
        return Timings(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)})


@dataclass
class GridResult:
    """What :func:`~.grid.run_grid` returns: the result rows (one dict per model, context,
    adaptation arm, head and cell; dicts at the JSON boundary), the pooled reliability bins, each
    series' per-image ``(correct, confidence, hit)`` for the bootstrap intervals, the heads and arms
    skipped with their reasons, the seconds of each step and the kNN back end ``"auto"`` chose."""

    rows: list[dict]
    reliability: list[dict]
    per_image: dict[tuple, dict]
    skipped_heads: list[dict]
    skipped_adaptations: list[dict]
    timings: Timings = field(default_factory=Timings)
    processes: int = 1
    knn_backend: str = "torch"
