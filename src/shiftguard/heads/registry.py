"""Heads by name: the names ``shiftguard run`` configs and ``shiftguard.evaluate(heads=...)`` take.

Two kinds of head: *logit heads* read the model's logits (``softmax``, ``temperature``);
*embedding heads* are fitted on support embeddings (every other name). ``build_head`` returns a
fresh, unfitted head.
"""

from __future__ import annotations

from typing import Callable

from shiftguard.heads.base import EmbeddingHead
from shiftguard.heads.distance_ratio import DistanceRatioHead
from shiftguard.heads.knn_baselines import KNNHeadBase, KNNVote, OneNN, WeightedKNN
from shiftguard.heads.logistic import LogisticRegressionHead
from shiftguard.heads.ned import NED
from shiftguard.heads.quantile import QuantileClassifierHead
from shiftguard.heads.softmax import SoftmaxHead
from shiftguard.heads.temperature import TemperatureScaling
from shiftguard.neighbors import check_backend
from shiftguard.registry import Registry

__all__ = ["HEAD_NAMES", "LOGIT_HEADS", "EMBEDDING_HEADS", "HEAD_REGISTRY", "build_head", "canonical_head",
           "head_input"]

#: Heads by name: ``name -> factory(num_classes, k)`` returning a fresh, unfitted head. Names are
#: matched ignoring case, ``-``, ``_`` and spaces (:func:`canonical_head`).
HEAD_REGISTRY: Registry[Callable[[int, int], EmbeddingHead]] = Registry("head", argument="heads")


HEAD_REGISTRY.register("softmax", lambda num_classes, k: SoftmaxHead(num_classes=num_classes))
HEAD_REGISTRY.register("temperature", lambda num_classes, k: TemperatureScaling(num_classes=num_classes))
HEAD_REGISTRY.register("logistic", lambda num_classes, k: LogisticRegressionHead(num_classes=num_classes))
HEAD_REGISTRY.register("quantile", lambda num_classes, k: QuantileClassifierHead(num_classes=num_classes))
HEAD_REGISTRY.register("ned", lambda num_classes, k: NED(k=k, fit_mode="holdout", num_classes=num_classes))
HEAD_REGISTRY.register("knn", lambda num_classes, k: KNNVote(k=k, num_classes=num_classes))
HEAD_REGISTRY.register("wknn", lambda num_classes, k: WeightedKNN(k=k, num_classes=num_classes))
HEAD_REGISTRY.register("1nn", lambda num_classes, k: OneNN(num_classes=num_classes))
HEAD_REGISTRY.register("distance_ratio", lambda num_classes, k: DistanceRatioHead(num_classes=num_classes))

#: Heads that read logits ``(N, C)``.
LOGIT_HEADS = ("softmax", "temperature")
#: Heads fitted on embeddings ``(N, D)`` of a support (training) set.
EMBEDDING_HEADS = tuple(name for name in HEAD_REGISTRY if name not in LOGIT_HEADS)
#: Every head name, the logit heads first, in registration order.
HEAD_NAMES = LOGIT_HEADS + EMBEDDING_HEADS


def canonical_head(name: str, *, argument: str = "heads") -> str:
    """The registered name of head ``name``: case, ``-``, ``_`` and spaces do not matter
    (``"Distance Ratio"``, ``"DISTANCE-RATIO"`` -> ``"distance_ratio"``). ``shiftguard.evaluate(heads=)``
    and the run config resolve head names here, so results carry one spelling.

    Raises ``TypeError`` (``name`` not a str) or ``ValueError`` (unknown head: one line that lists
    the heads and suggests the closest), naming ``argument``.
    """
    return HEAD_REGISTRY.canonical(name, argument=argument, words=True)


def head_input(name: str) -> str:
    """``"logits"`` or ``"embeddings"``: what head ``name`` is fitted and evaluated on.

    Raises ``TypeError`` (``name`` not a str) or ``ValueError`` (unknown head), naming ``heads``.
    """
    return "logits" if canonical_head(name) in LOGIT_HEADS else "embeddings"


def build_head(name: str, num_classes: int, k: int = 10, backend: str = "torch") -> EmbeddingHead:
    """A fresh head ``name`` for ``num_classes`` classes; ``k`` neighbours and the kNN search's
    ``backend`` (``shiftguard.neighbors.BACKENDS``) for the kNN family (ned, knn, wknn, 1nn).

    ``temperature``: T fitted on the validation logits (Guo et al. 2017). ``ned``: T fitted on the
    validation embeddings against the support when a validation set is given, on a held-out 20%
    of the support otherwise [NED, Sec. 2].

    Raises ``TypeError`` (``name`` not a str) or ``ValueError`` (unknown head: the message lists
    :data:`HEAD_NAMES` sorted and suggests the closest), naming ``heads``; ``ValueError`` naming
    ``backend`` for an unknown back end.
    """
    check_backend(backend)
    head = HEAD_REGISTRY.get(canonical_head(name))(num_classes, k)
    if isinstance(head, KNNHeadBase):
        head.backend = backend
    return head
