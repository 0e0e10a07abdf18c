"""Heads by name: the names ``shiftguard run`` configs and ``shiftguard.evaluate(heads=...)`` take.

Each name is registered with its class, whose contract attributes say what the head reads
(``input``: ``"logits"`` or ``"embeddings"``) and which data its fit takes (``needs_support``,
``uses_validation``, ``needs_validation``; :class:`~shiftguard.heads.base.Head`). The lists of
logit and embedding heads are derived from those classes. ``build_head`` returns a fresh, unfitted
head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from shiftguard.heads.base import HEAD_INPUTS, Head
from shiftguard.heads.distance_ratio import DistanceRatioHead
from shiftguard.heads.knn_baselines import KNNHeadBase, KNNVote, OneNN, WeightedKNN
from shiftguard.heads.logistic import LogisticRegressionHead
from shiftguard.heads.ned import NED
from shiftguard.heads.quantile import QuantileClassifierHead
from shiftguard.heads.softmax import SoftmaxHead
from shiftguard.heads.temperature import TemperatureScaling
from shiftguard.neighbors import SearchCache, check_backend
from shiftguard.registry import Registry

__all__ = [
    "HEAD_NAMES",
    "LOGIT_HEADS",
    "EMBEDDING_HEADS",
    "HEAD_REGISTRY",
    "HeadEntry",
    "build_head",
    "canonical_head",
    "head_class",
    "head_input",
]


@dataclass(frozen=True)
class HeadEntry:
    """A registered head: its class (the contract: ``input``, ``needs_support``, ``uses_validation``,
    ``needs_validation``) and ``make(num_classes, k)``, which returns a fresh instance. Calling the
    entry calls ``make``."""

    cls: type[Head]
    make: Callable[[int, int], Head]

    def __call__(self, num_classes: int, k: int) -> Head:
        return self.make(num_classes, k)


#: Heads by name: ``name -> HeadEntry``; ``HEAD_REGISTRY.get(name)(num_classes, k)`` is a fresh,
#: unfitted head. Names are matched ignoring case, ``-``, ``_`` and spaces (:func:`canonical_head`).
HEAD_REGISTRY: Registry[HeadEntry] = Registry("head", argument="heads")


def _register(name: str, cls: type[Head], make: Optional[Callable[[int, int], Head]] = None) -> None:
    """Register ``cls`` as ``name``, made by ``make`` (default ``cls(num_classes=num_classes)``)."""
    if getattr(cls, "input", None) not in HEAD_INPUTS:
        raise TypeError(f"{cls.__name__}: a head class must declare input as one of {HEAD_INPUTS}")
    HEAD_REGISTRY.register(name, HeadEntry(cls, make or (lambda num_classes, k: cls(num_classes=num_classes))))


_register("softmax", SoftmaxHead)
_register("temperature", TemperatureScaling)
_register("logistic", LogisticRegressionHead)
_register("quantile", QuantileClassifierHead)
_register("ned", NED, lambda num_classes, k: NED(k=k, fit_mode="holdout", num_classes=num_classes))
_register("knn", KNNVote, lambda num_classes, k: KNNVote(k=k, num_classes=num_classes))
_register("wknn", WeightedKNN, lambda num_classes, k: WeightedKNN(k=k, num_classes=num_classes))
_register("1nn", OneNN)
_register("distance_ratio", DistanceRatioHead)

#: Heads that read logits ``(N, C)`` (their class's ``input``), in registration order.
LOGIT_HEADS = tuple(name for name in HEAD_REGISTRY if HEAD_REGISTRY.get(name).cls.input == "logits")
#: Heads fitted on embeddings ``(N, D)`` of a support (training) set, in registration order.
EMBEDDING_HEADS = tuple(name for name in HEAD_REGISTRY if HEAD_REGISTRY.get(name).cls.input == "embeddings")
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


def head_class(name: str) -> type[Head]:
    """The class of head ``name``, whose attributes are its contract (``input``, ``needs_support``,
    ``uses_validation``, ``needs_validation``), read without building the head.

    Raises ``TypeError`` (``name`` not a str) or ``ValueError`` (unknown head), naming ``heads``.
    """
    return HEAD_REGISTRY.get(canonical_head(name)).cls


def head_input(name: str) -> str:
    """``"logits"`` or ``"embeddings"``: what head ``name`` is fitted and evaluated on (its class's
    ``input``).

    Raises ``TypeError`` (``name`` not a str) or ``ValueError`` (unknown head), naming ``heads``.
    """
    return head_class(name).input


def build_head(
    name: str, num_classes: int, k: int = 10, backend: str = "torch", searches: Optional[SearchCache] = None
) -> Head:
    """A fresh head ``name`` for ``num_classes`` classes; ``k`` neighbours, the kNN search's
    ``backend`` (``shiftguard.neighbors.BACKENDS``) and a shared ``searches`` cache
    (:class:`~shiftguard.neighbors.SearchCache`) for the kNN family (ned, knn, wknn, 1nn).

    ``temperature``: T fitted on the validation logits (Guo et al. 2017). ``ned``: T fitted on the
    validation embeddings against the support when a validation set is given, on a held-out 20%
    of the support otherwise [NED, Sec. 2].

    Raises ``TypeError`` (``name`` not a str) or ``ValueError`` (unknown head: the message lists
    :data:`HEAD_NAMES` sorted and suggests the closest), naming ``heads``; ``ValueError`` naming
    ``backend`` for an unknown back end; ``TypeError`` naming ``searches`` for another object than a
    ``SearchCache``.
    """
    check_backend(backend)
    if searches is not None and not isinstance(searches, SearchCache):
        raise TypeError(f"searches: expected a shiftguard.neighbors.SearchCache or None, got {type(searches).__name__}")
    head = HEAD_REGISTRY.get(canonical_head(name))(num_classes, k)
    if isinstance(head, KNNHeadBase):
        head.backend = backend
        head.searches = searches
    return head
