"""Evaluate any model on any data under distribution shift.

- :func:`evaluate` (also ``shiftguard.evaluate``): corrupt the test set, read the model's logits
  and embedding on every cell, fit the confidence heads on clean data, score every cell;
- :class:`EvaluationResult`: rows, aggregates, mCE, bootstrap intervals; ``summary()``,
  ``to_csv()``, ``to_json()``, ``write_report(dir)``, ``compare(other)``;
- :class:`ModelOutputs`: where a model's logits and embedding come from;
- :mod:`.grid`, :mod:`.scoring`, :mod:`.aggregate`: the grid, one cell's metrics, the means;
- :mod:`.adaptation`: the test-time adaptation arms scored side by side (``evaluate(adapt=...)``).

``shiftguard run`` (train, then :func:`evaluate`) and ``shiftguard evaluate`` (the command line)
both call :func:`evaluate`: one evaluation code path. See ``docs/evaluate.md``.
"""

from .adaptation import ARMS, AdaptSpec
from .evaluate import DEFAULT_HEADS, evaluate
from .outputs import ModelOutputs, compute_outputs
from .result import EvaluationResult

__all__ = ["evaluate", "EvaluationResult", "ModelOutputs", "compute_outputs", "DEFAULT_HEADS", "ARMS", "AdaptSpec"]
