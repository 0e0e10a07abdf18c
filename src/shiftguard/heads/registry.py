"""Heads by name: the names ``shiftguard run`` configs and ``shiftguard.evaluate(heads=...)`` take.

Two kinds of head: *logit heads* read the model's logits (``softmax``, ``temperature``);
*embedding heads* are fitted on support embeddings (every other name). ``build_head`` returns a
fresh, unfitted head.
"""

from __future__ import annotations

from typing import Callable

from shiftguard.heads.base import EmbeddingHead

__all__ = ["HEAD_NAMES", "LOGIT_HEADS", "EMBEDDING_HEADS", "build_head", "head_input"]

#: Heads that read logits ``(N, C)``.
LOGIT_HEADS = ("softmax", "temperature")
#: Heads fitted on embeddings ``(N, D)`` of a support (training) set.
EMBEDDING_HEADS = ("logistic", "quantile", "ned", "knn", "wknn", "1nn", "distance_ratio")
HEAD_NAMES = LOGIT_HEADS + EMBEDDING_HEADS


def head_input(name: str) -> str:
    """``"logits"`` or ``"embeddings"``: what head ``name`` is fitted and evaluated on."""
    _check_name(name)
    return "logits" if name in LOGIT_HEADS else "embeddings"


def _check_name(name) -> str:
    if name not in HEAD_NAMES:
        raise ValueError(f"heads: unknown head {name!r}; expected one of {', '.join(HEAD_NAMES)}")
    return name


def build_head(name: str, num_classes: int, k: int = 10) -> EmbeddingHead:
    """A fresh head ``name`` for ``num_classes`` classes; ``k`` neighbours for the kNN family.

    ``temperature``: T fitted on the validation logits (Guo et al. 2017). ``ned``: T fitted on the
    validation embeddings against the support when a validation set is given, on a held-out 20%
    of the support otherwise (004, Sec. 2).
    """
    from shiftguard import heads as H

    table: dict[str, Callable[[], EmbeddingHead]] = {
        "softmax": lambda: H.SoftmaxHead(num_classes=num_classes),
        "temperature": lambda: H.TemperatureScaling(num_classes=num_classes),
        "logistic": lambda: H.LogisticRegressionHead(num_classes=num_classes),
        "quantile": lambda: H.QuantileClassifierHead(num_classes=num_classes),
        "ned": lambda: H.NED(k=k, fit_mode="holdout", num_classes=num_classes),
        "knn": lambda: H.KNNVote(k=k, num_classes=num_classes),
        "wknn": lambda: H.WeightedKNN(k=k, num_classes=num_classes),
        "1nn": lambda: H.OneNN(num_classes=num_classes),
        "distance_ratio": lambda: H.DistanceRatioHead(num_classes=num_classes),
    }
    return table[_check_name(name)]()
