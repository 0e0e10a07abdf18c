"""The quantile classifier ([QACT, Sec. 3], fitted "on the train embedding") as a head.

- :func:`fit_quantile_classifier` -- trains a ``shiftguard.nn.QuantileClassifier`` on frozen
  embeddings [QACT, Sec. 4, Remark]: Adam, shuffled mini-batches, each mini-batch its own QACT context,
  then the frozen QACT statistics set from all training embeddings.
- :class:`QuantileClassifierHead` -- the head interface over it (``fit`` / ``predict_proba``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from shiftguard._validation import check_labels, check_positive, check_same_length, check_tensor
from shiftguard.heads.base import EmbeddingHead
from shiftguard.nn import QuantileClassifier

__all__ = ["QuantileClassifierHead", "fit_quantile_classifier"]


def fit_quantile_classifier(
    classifier: QuantileClassifier,
    train_embeddings,
    train_labels,
    epochs: int = 30,
    batch_size: int = 256,
    lr: float = 1e-2,
    weight_decay: float = 0.0,
    seed: int = 0,
) -> QuantileClassifier:
    """Train ``classifier`` in place on frozen training embeddings [QACT, Sec. 4, Remark] and return it.

    Adam on :meth:`QuantileClassifier.loss` [QACT, Sec. 3] over shuffled mini-batches; each mini-batch
    is its own QACT context (a trailing batch of one row is skipped: QACT needs a context). Afterwards
    the frozen QACT statistics are set from all training embeddings, so ``context="frozen"`` scores
    against the training distribution; the classifier is left in eval mode with its context mode
    unchanged.

    Args:
        classifier: the ``QuantileClassifier`` to train (its parameters' device and dtype are used).
        train_embeddings: ``(N, D)`` float tensor, finite. train_labels: ``(N,)`` labels in ``[0, K)``.
        epochs: passes over the data (>= 1). batch_size: rows per step (>= 2). lr (> 0),
            weight_decay: Adam's. seed: seed of the shuffling (a private generator; torch's global
            RNG still seeds QACT's KDE samples).

    Raises:
        TypeError / ValueError naming ``train_embeddings``, ``train_labels``, ``epochs``, ``batch_size``
        or ``lr`` for bad input.

    Examples:
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> x, y = torch.randn(64, 3), torch.arange(64) % 2
        >>> clf = fit_quantile_classifier(QuantileClassifier(3, 2, n_samples=30), x, y, epochs=1, batch_size=32)
        >>> clf.predict_proba(x).shape
        torch.Size([64, 2])
    """
    emb = check_tensor(train_embeddings, "train_embeddings", ndim=2, floating=True, finite=True, nonempty=True)
    labels = check_labels(train_labels, "train_labels", num_classes=classifier.num_classes)
    check_same_length([("train_embeddings", emb), ("train_labels", labels)])
    check_positive(epochs, "epochs", integer=True)
    check_positive(batch_size, "batch_size", integer=True)
    check_positive(lr, "lr")
    if batch_size < 2:
        raise ValueError(f"batch_size: expected >= 2 (QACT needs a context), got {batch_size}")
    weight = classifier.linear.weight
    emb, labels = emb.to(weight.device, weight.dtype), labels.to(weight.device)
    n = emb.shape[0]
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(classifier.parameters(), lr=lr, weight_decay=weight_decay)
    mode = str(classifier.qact.context)
    classifier.qact.context = "batch"
    classifier.train()
    try:
        for _ in range(epochs):
            order = torch.randperm(n, generator=gen).to(weight.device)
            for start in range(0, n, batch_size):
                idx = order[start : start + batch_size]
                if idx.numel() < 2:
                    continue
                opt.zero_grad(set_to_none=True)
                loss = classifier.loss(classifier(emb[idx]), labels[idx])
                loss.backward()
                opt.step()
    finally:
        classifier.eval()
        classifier.qact.context = mode
    with torch.no_grad():
        classifier.qact.fit_context(classifier.linear(emb))
    classifier.qact.context = mode
    return classifier


class QuantileClassifierHead(EmbeddingHead):
    """Quantile classifier [QACT, Sec. 3] on embeddings.

    Args:
        num_classes: number of classes; inferred when None.
        classifier_kwargs: keyword arguments for ``QuantileClassifier(in_features, num_classes, **kw)``.
        fit_kwargs: keyword arguments for ``fit_quantile_classifier(classifier, emb, labels, **kw)``.

    Learned state: ``classifier_`` (the fitted ``QuantileClassifier``), ``num_classes_``, ``classes_``.
    """

    _param_names = ("num_classes", "classifier_kwargs", "fit_kwargs")

    def __init__(
        self,
        num_classes: Optional[int] = None,
        classifier_kwargs: Optional[dict[str, Any]] = None,
        fit_kwargs: Optional[dict[str, Any]] = None,
    ):
        super().__init__(num_classes)
        self.classifier_kwargs = classifier_kwargs
        self.fit_kwargs = fit_kwargs

    def _validate_params(self) -> None:
        super()._validate_params()
        for name in ("classifier_kwargs", "fit_kwargs"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, dict):
                raise TypeError(f"{name}: expected a dict of keyword arguments or None, got {type(value).__name__}")

    def fit(self, train_embeddings, train_labels, val_embeddings=None, val_labels=None):
        self._validate_params()
        self._no_validation(val_embeddings, val_labels)
        emb, y, num_classes = self._check_fit_inputs(train_embeddings, train_labels)
        clf = QuantileClassifier(emb.shape[1], num_classes, **(self.classifier_kwargs or {})).to(emb.device)
        fit_quantile_classifier(clf, emb, y, **(self.fit_kwargs or {}))
        self.classifier_ = clf
        self.in_features_ = emb.shape[1]
        self._set_classes(num_classes, emb.device)
        return self

    def predict_proba(self, embeddings) -> torch.Tensor:
        """``(N, C)`` rows on the simplex: the one-vs-rest probabilities renormalised to sum 1
        (for NLL and other metrics that need a distribution; the arg-max is unchanged)."""
        self._check_is_fitted()
        emb = self._check_query(embeddings, self.in_features_)
        if emb.shape[0] == 0:  # an empty query has an empty answer (QACT needs a non-empty context)
            return torch.zeros(0, self.num_classes_, dtype=emb.dtype, device=emb.device)
        with torch.no_grad():
            probs = self.classifier_.predict_proba(emb)
        return probs

    def predict_one_vs_rest(self, embeddings) -> torch.Tensor:
        """``(N, C)`` one-vs-rest probabilities, one per class, as the quantile classifier outputs
        them ([QACT, Sec. 3]; rows need not sum to 1). These are what [QACT] calibrates and reports:
        measure them with ``metrics.ece(..., one_vs_rest=True)``."""
        self._check_is_fitted()
        emb = self._check_query(embeddings, self.in_features_)
        if emb.shape[0] == 0:
            return torch.zeros(0, self.num_classes_, dtype=emb.dtype, device=emb.device)
        with torch.no_grad():
            return self.classifier_.class_scores(emb)
