"""Small scikit-learn-like base classes shared by every confidence head.

A head is fitted on clean data and returns class probabilities for new inputs:
``fit(train_x, train_labels, val_x=None, val_labels=None) -> self``, ``predict_proba(x) -> (N, C)``,
``predict(x) -> (N,)``. scikit-learn's habits: ``__init__`` stores its arguments unchanged, under
their own names, and ``fit`` validates them (a bad value raises there, with one line naming it);
``get_params()`` / ``set_params(**params)`` read and change them, and :func:`clone` returns an
unfitted head with the same parameters. Learned state carries a trailing underscore
(``num_classes_``, ``classes_``, ``temperature_``...). Torch tensors in and out, on the device of
the input.

Each head class declares its contract as class attributes, which callers read instead of its name:
``input`` (``"logits"``: the model's logits ``(N, C)``, :class:`LogitHead`; ``"embeddings"``: an
embedding ``(N, D)``, :class:`EmbeddingHead`), ``needs_support`` (its fit reads the training
set), ``uses_validation`` (its fit reads ``val_*``; otherwise it refuses them) and
``needs_validation`` (it is fitted on held-out data only).
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, ClassVar, Optional

import torch

from shiftguard._validation import check_labels, check_positive, check_same_length, check_tensor

__all__ = ["EmbeddingHead", "Head", "LogitHead", "NotFittedError", "HEAD_INPUTS", "clone"]

#: The values of :attr:`Head.input`.
HEAD_INPUTS = ("logits", "embeddings")


def _compute_dtype(emb: torch.Tensor) -> torch.Tensor:
    """Half-precision embeddings (float16, bfloat16) as float32: a head's distances, softmax and
    normalisation in 8 bits of mantissa leave probability rows summing to 0.994-1.006, which the
    metrics rightly refuse."""
    return emb.float() if emb.dtype in (torch.float16, torch.bfloat16) else emb


class NotFittedError(RuntimeError):
    """Raised when ``predict_proba`` is called before ``fit``."""


class Head:
    """Base class of every head: the contract attributes, ``num_classes``, ``predict``,
    ``get_params`` / ``set_params``, ``repr``.

    Subclass :class:`EmbeddingHead` or :class:`LogitHead`, which set :attr:`input`.
    """

    #: what ``fit`` and ``predict_proba`` read, one of :data:`HEAD_INPUTS`
    input: ClassVar[str]
    #: whether ``fit`` needs the training (support) set; a head that does not accepts ``train_*=None``
    needs_support: ClassVar[bool] = True
    #: whether ``fit`` reads ``val_*`` (NED's and temperature scaling's temperature); a head that does
    #: not refuses them, so that held-out data given to it is never silently ignored
    uses_validation: ClassVar[bool] = False
    #: whether the head's parameters must come from held-out data: an evaluation fits it only when a
    #: validation set is given, on that set (temperature scaling: T fitted on the logits of the
    #: model's own training data calibrates nothing)
    needs_validation: ClassVar[bool] = False
    #: names of ``__init__`` parameters shown by ``repr``
    _param_names: tuple[str, ...] = ("num_classes",)
    #: ``__init__`` parameters that :func:`clone` hands on as they are instead of copying them:
    #: objects shared on purpose (a search cache, a model), not settings
    _shared_params: ClassVar[tuple[str, ...]] = ()

    def __init__(self, num_classes: Optional[int] = None):
        self.num_classes = num_classes

    # -- parameters (scikit-learn's get_params / set_params) ------------------------------------
    @classmethod
    def _get_param_names(cls) -> list[str]:
        """The parameters of ``__init__``, in its order (each stored under its own name)."""
        names = []
        for p in list(inspect.signature(cls.__init__).parameters.values())[1:]:
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise TypeError(f"{cls.__name__}: a head's __init__ names each parameter (no *args, **kwargs)")
            names.append(p.name)
        return names

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        """The ``__init__`` parameters, ``{name: value}``; ``type(head)(**head.get_params())`` is an
        unfitted head with the same parameters. ``deep`` is accepted for scikit-learn's signature
        (no head holds another estimator as a parameter, so both give the same)."""
        return {name: getattr(self, name) for name in self._get_param_names()}

    def set_params(self, **params: Any) -> "Head":
        """Set ``__init__`` parameters by name; returns ``self``. The values are checked by the next
        ``fit``; an unknown name raises ``ValueError`` naming it (and the parameters there are)."""
        valid = self._get_param_names()
        for name in params:
            if name not in valid:
                raise ValueError(f"{name}: not a parameter of {type(self).__name__} (its parameters: {valid})")
        for name, value in params.items():
            setattr(self, name, value)
        return self

    def _validate_params(self) -> None:
        """Check the parameters, raising ``TypeError`` / ``ValueError`` that name the bad one; the
        first thing ``fit`` does. Subclasses extend it (calling ``super()._validate_params()``)."""
        if self.num_classes is not None:
            check_positive(self.num_classes, "num_classes", integer=True)

    # -- public API -----------------------------------------------------------------------------
    def fit(self, train_x, train_labels, val_x=None, val_labels=None):
        """Fit on ``(train_x, train_labels)`` (and ``val_*`` where :attr:`uses_validation`); returns ``self``."""
        raise NotImplementedError

    def predict_proba(self, x) -> torch.Tensor:
        """Class probabilities ``(N, C)``, rows on the simplex; ``NotFittedError`` before ``fit``."""
        raise NotImplementedError

    def predict(self, x) -> torch.Tensor:
        """Most probable class per row, ``int64 (N,)``."""
        return self.predict_proba(x).argmax(dim=1)

    # -- helpers for subclasses -----------------------------------------------------------------
    def _no_validation(self, val_x, val_labels, what: Optional[str] = None) -> None:
        """Refuse ``val_*`` given to a head whose fit does not read them."""
        if val_x is not None or val_labels is not None:
            raise ValueError(
                f"{what or 'val_' + self.input}: {type(self).__name__} does not use validation "
                "data (its fit reads the training data only); leave val_* unset"
            )

    def _set_classes(self, num_classes: int, device=None) -> None:
        """Record the fitted classes: ``num_classes_`` and ``classes_ = arange(num_classes_)`` (the
        labels, on ``device``; column ``j`` of ``predict_proba`` is class ``classes_[j]``)."""
        self.num_classes_ = num_classes
        self.classes_ = torch.arange(num_classes, device=device)

    def _check_is_fitted(self) -> None:
        if not hasattr(self, "num_classes_"):
            raise NotFittedError(f"{type(self).__name__} is not fitted yet; call fit(...) first")

    def __repr__(self) -> str:
        args = ", ".join(f"{n}={getattr(self, n)!r}" for n in self._param_names)
        return f"{type(self).__name__}({args})"


class LogitHead(Head):
    """Base class of heads on a model's logits ``(N, C)`` (``softmax``, ``temperature``): nothing is
    learned from the training set, so ``fit`` takes ``train_logits=None``."""

    input = "logits"
    needs_support = False


class EmbeddingHead(Head):
    """Base class of heads fitted on support embeddings ``(N, D)``: input validation,
    ``num_classes`` inference."""

    input = "embeddings"

    # -- helpers for subclasses -----------------------------------------------------------------
    def _check_fit_inputs(
        self, embeddings, labels, name="train_embeddings", label_name="train_labels", require_all_classes: bool = True
    ):
        emb = _compute_dtype(check_tensor(embeddings, name, ndim=2, floating=True, finite=True, nonempty=True))
        y = check_labels(labels, label_name, num_classes=self.num_classes)
        check_same_length([(name, emb), (label_name, y)])
        y = y.to(emb.device)
        num_classes = self.num_classes if self.num_classes is not None else int(y.max()) + 1
        if require_all_classes:
            counts = torch.bincount(y, minlength=num_classes)
            missing = torch.nonzero(counts == 0).flatten().tolist()
            if missing:
                how = "given" if self.num_classes is not None else "inferred as max(label) + 1"
                raise ValueError(
                    f"{label_name}: class(es) {missing[:10]}{'...' if len(missing) > 10 else ''} of "
                    f"num_classes={num_classes} ({how}) have no examples; a head cannot assign them "
                    "a probability (relabel the classes to 0..C-1 or pass the matching num_classes)"
                )
        return emb, y, num_classes

    def _check_val_inputs(self, val_embeddings, val_labels, dim: int, num_classes: int):
        if (val_embeddings is None) != (val_labels is None):
            raise ValueError("val_embeddings and val_labels: give both or neither")
        if val_embeddings is None:
            return None, None
        emb = _compute_dtype(
            check_tensor(val_embeddings, "val_embeddings", ndim=2, floating=True, finite=True, nonempty=True)
        )
        y = check_labels(val_labels, "val_labels", num_classes=num_classes)
        check_same_length([("val_embeddings", emb), ("val_labels", y)])
        if emb.shape[1] != dim:
            raise ValueError(f"val_embeddings: expected {dim} features, got {emb.shape[1]}")
        return emb, y.to(emb.device)

    def _check_query(self, embeddings, dim: int, name: str = "embeddings") -> torch.Tensor:
        self._check_is_fitted()
        emb = _compute_dtype(check_tensor(embeddings, name, ndim=2, floating=True, finite=True))
        if emb.shape[1] != dim:
            raise ValueError(f"{name}: expected {dim} features (as in fit), got {emb.shape[1]}")
        return emb


def clone(head: Head) -> Head:
    """A new, unfitted head of the same class with the same parameters (``sklearn.base.clone``):
    ``type(head)(**params)`` with each parameter deep-copied, except the objects a head shares on
    purpose (its class's ``_shared_params``: the kNN heads' ``searches`` cache, temperature
    scaling's ``logit_fn``), which the clone shares too. Nothing learned by ``fit`` is carried over.

    Raises ``TypeError`` naming ``head`` for anything but a :class:`Head`.
    """
    if not isinstance(head, Head):
        raise TypeError(f"head: expected a shiftguard.heads.Head, got {type(head).__name__}")

    def copied(name: str, value: Any) -> Any:
        if name in head._shared_params:
            return value
        if isinstance(value, torch.Tensor):  # deepcopy refuses tensors computed with autograd
            return value.detach().clone().requires_grad_(value.requires_grad)
        return copy.deepcopy(value)

    return type(head)(**{name: copied(name, value) for name, value in head.get_params(deep=False).items()})
