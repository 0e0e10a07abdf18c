"""The protocol every uncertainty estimator of the URL benchmark follows ([Kirchhof, URL Sec. 4.1,
App. B.7-B.11]), and the pooled-prediction uncertainties they share.

An estimator is an ``nn.Module`` wrapping a backbone and usable wherever a classifier is:

- ``forward(x) -> (N, C)`` LOG predictive probabilities, so ``softmax(forward(x))`` is the
  predictive distribution (``log p`` is a valid logit vector for every logit-based head);
  ``predict_proba(x) -> (N, C)`` returns that distribution, computed in eval mode without gradients
  (the verb of the heads and the contrastive classifiers);
  ``forward(x) == classifier(embed(x))``, the ``embed()`` / ``classifier`` contract of
  ``shiftguard.models`` that ``shiftguard.evaluate`` uses. In ``train()`` mode a method may return
  its training-time output (one dropout sample, the GP logits without the mean-field correction).
- ``embed(x) -> (N, D)`` the embedding the heads and retrieval metrics use.
- ``training_loss(x, y) -> ()`` the method's objective.
- ``uncertainty(x) -> {name: (N,)}`` every uncertainty the method defines, higher = more uncertain,
  computed in eval mode without gradients; ``default_uncertainty`` names the one the URL paper
  reports by default.

Pooling several predictions ``p_1..p_K`` (ensemble members, dropout samples, noise samples) into
``p_bar = mean_k p_k`` is done in log space (:func:`log_mean_exp`), so that identical predictions
pool to exactly themselves. The uncertainties of pooled predictions ([Kirchhof, URL Sec. 4.1],
"Deep Ensembles", "MCDropout"; Lakshminarayanan et al. 2017):

- entropy ``H(p_bar) = -sum_c p_bar_c log p_bar_c``;
- Jensen-Shannon divergence with uniform weights ``JSD = H(p_bar) - mean_k H(p_k)``, computed in its
  equivalent form ``mean_k KL(p_k || p_bar)`` (non-negative term by term, exactly 0 for identical
  members).
"""

from __future__ import annotations

import contextlib
from typing import ClassVar, Iterator, NamedTuple, Optional

import torch
from torch import nn

from shiftguard._deprecation import positional_dims
from shiftguard._validation import check_labels, check_positive, check_tensor
from shiftguard.models import EmbeddingClassifier

__all__ = [
    "UncertaintyEstimator",
    "Backbone",
    "resolve_backbone",
    "log_mean_exp",
    "entropy_from_log_probs",
    "jensen_shannon_divergence",
]


def _log_mean_exp(a: torch.Tensor, dim: int) -> torch.Tensor:
    # m + log(mean(exp(a - m))): for identical entries exp(0) = 1, the mean is exactly 1 and the
    # result is exactly m; torch.logsumexp(a) - log(K) would round twice.
    m = a.detach().amax(dim=dim, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return (m + torch.log(torch.exp(a - m).mean(dim=dim, keepdim=True))).squeeze(dim)


def _entropy(log_probs: torch.Tensor) -> torch.Tensor:
    p = log_probs.exp()
    return -torch.where(p > 0, p * log_probs, torch.zeros_like(p)).sum(dim=-1)


def _jsd(member_log_probs: torch.Tensor) -> torch.Tensor:
    # member_log_probs (N, K, C); mean over k of KL(p_k || p_bar).
    log_bar = _log_mean_exp(member_log_probs, dim=1).unsqueeze(1)
    p = member_log_probs.exp()
    kl = torch.where(p > 0, p * (member_log_probs - log_bar), torch.zeros_like(p)).sum(dim=-1)
    return kl.mean(dim=1)


def log_mean_exp(a, dim: int = 1) -> torch.Tensor:
    """``log(mean_k exp(a_k))`` along ``dim``: the log of the mean of probabilities given as logs.

    Args:
        a: floating tensor, e.g. member log-probabilities ``(N, K, C)``.
        dim: the dimension averaged over (removed from the result).

    Raises ``TypeError`` for a non-floating ``a``, ``ValueError`` for an empty ``a`` or a ``dim``
    out of range.
    """
    t = check_tensor(a, "a", floating=True, nonempty=True)
    if not isinstance(dim, int) or not -t.dim() <= dim < t.dim():
        raise ValueError(f"dim: expected an int in [{-t.dim()}, {t.dim()}), got {dim!r}")
    return _log_mean_exp(t, dim)


def entropy_from_log_probs(log_probs) -> torch.Tensor:
    """Shannon entropy (nats) ``-sum_c p_c log p_c`` of ``log_probs (..., C)``; ``0 log 0 = 0``.

    Raises ``TypeError`` for non-floating input, ``ValueError`` for NaN or ``+inf`` entries
    (``-inf`` is a zero probability and allowed).
    """
    t = check_tensor(log_probs, "log_probs", floating=True, min_ndim=1)
    if bool(torch.isnan(t).any()) or bool((t == float("inf")).any()):
        raise ValueError("log_probs: contains NaN or +inf")
    return _entropy(t)


def jensen_shannon_divergence(member_log_probs) -> torch.Tensor:
    """Uniform-weight Jensen-Shannon divergence between K predictions, ``(N,)`` in nats.

    ``JSD = H(mean_k p_k) - mean_k H(p_k) = mean_k KL(p_k || mean_j p_j)`` ([Kirchhof, URL Sec. 4.1],
    "Deep Ensembles"). Args: ``member_log_probs (N, K, C)`` log-probabilities of each member.
    Raises ``TypeError`` / ``ValueError`` naming ``member_log_probs`` for a non-floating tensor, a
    wrong number of dimensions, or NaN / ``+inf`` entries.
    """
    t = check_tensor(member_log_probs, "member_log_probs", floating=True, ndim=3)
    if bool(torch.isnan(t).any()) or bool((t == float("inf")).any()):
        raise ValueError("member_log_probs: contains NaN or +inf")
    return _jsd(t)


class Backbone(NamedTuple):
    """What an estimator needs of its backbone (see :func:`resolve_backbone`)."""

    module: nn.Module
    embedding_dim: int
    num_classes: int
    classifier: Optional[nn.Linear]


def resolve_backbone(
    backbone, *args: Optional[int], num_classes: Optional[int] = None, embedding_dim: Optional[int] = None
) -> Backbone:
    """Read embedding size, class count and (if any) linear classifier off ``backbone``.

    ``resolve_backbone(backbone, *, num_classes=None, embedding_dim=None)``: the sizes are
    keyword-only, as in the estimators; the former positional ``(embedding_dim, num_classes)`` still
    works for one release, with a ``DeprecationWarning``.

    ``backbone`` is either a ``shiftguard.models.EmbeddingClassifier`` (``embed()``,
    ``embedding_dim``, ``classifier``; the class count is ``classifier.out_features``) or any
    ``nn.Module`` mapping ``x`` to an embedding ``(N, D)``; then ``embedding_dim`` and ``num_classes``
    come from the arguments or, where those are ``None``, from attributes of the same name.

    Raises ``TypeError`` (``backbone`` not a module, non-int sizes) or ``ValueError`` (missing or
    inconsistent sizes), naming the argument.
    """
    num_classes, embedding_dim = positional_dims(
        "resolve_backbone(backbone, num_classes=..., embedding_dim=...)", args, num_classes, embedding_dim
    )
    if not isinstance(backbone, nn.Module):
        raise TypeError(f"backbone: expected a torch.nn.Module, got {type(backbone).__name__}")
    classifier: Optional[nn.Linear] = None
    if isinstance(backbone, EmbeddingClassifier):
        classifier = backbone.classifier
        if not isinstance(classifier, nn.Linear):
            raise TypeError(
                f"backbone: expected backbone.classifier to be an nn.Linear, got {type(classifier).__name__}"
            )
        if embedding_dim is not None and embedding_dim != classifier.in_features:
            raise ValueError(
                f"embedding_dim: the backbone's embeddings have {classifier.in_features} "
                f"features, got embedding_dim={embedding_dim}"
            )
        if num_classes is not None and num_classes != classifier.out_features:
            raise ValueError(
                f"num_classes: the backbone's classifier has {classifier.out_features} "
                f"classes, got num_classes={num_classes}"
            )
        embedding_dim, num_classes = classifier.in_features, classifier.out_features
    else:
        if embedding_dim is None:
            embedding_dim = getattr(backbone, "embedding_dim", None)
        if num_classes is None:
            num_classes = getattr(backbone, "num_classes", None)
        if embedding_dim is None:
            raise ValueError("embedding_dim: the backbone has no embedding_dim attribute; pass embedding_dim")
        if num_classes is None:
            raise ValueError("num_classes: the backbone has no num_classes attribute; pass num_classes")
    check_positive(embedding_dim, "embedding_dim", integer=True)
    check_positive(num_classes, "num_classes", integer=True)
    if num_classes < 2:
        raise ValueError(f"num_classes: expected at least 2 classes, got {num_classes}")
    return Backbone(backbone, int(embedding_dim), int(num_classes), classifier)


def backbone_embed(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module.embed(x)`` for an ``EmbeddingClassifier``, ``module(x)`` otherwise."""
    if isinstance(module, EmbeddingClassifier):
        return module.embed(x)
    return module(x)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run a block under ``torch.manual_seed(seed)`` and restore the caller's CPU random state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[None]:
    """Put ``module`` (and its children) in eval mode for a block; restore every submodule's mode."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


class UncertaintyEstimator(nn.Module):
    """Base class of the estimators (module docstring for the protocol).

    Subclasses set ``embedding_dim``, ``num_classes``, ``classifier`` (a module mapping
    ``embed(x)`` to log-probabilities) and the class attributes ``uncertainty_names`` /
    ``default_uncertainty``, and implement :meth:`embed`, :meth:`training_loss` and
    :meth:`_uncertainty`.
    """

    #: the keys :meth:`uncertainty` returns.
    uncertainty_names: ClassVar[tuple[str, ...]] = ()
    #: the key the URL benchmark reports for this method by default.
    default_uncertainty: ClassVar[str] = ""

    embedding_dim: int
    num_classes: int
    classifier: nn.Module

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Log predictive probabilities ``(N, C)`` (the training-time output in train mode)."""
        return self.classifier(self.embed(x))

    def training_loss(self, x, y) -> torch.Tensor:
        raise NotImplementedError

    def _uncertainty(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _adopt_backbone(self, spec: Backbone, seed) -> nn.Linear:
        """Keep ``spec``'s backbone and sizes; return its linear classifier, or a new one initialised
        under ``seed`` for a backbone without one. Raises ``TypeError`` naming ``seed`` for a non-int."""
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed: expected an int, got {type(seed).__name__}")
        self.backbone = spec.module
        self.embedding_dim = spec.embedding_dim
        self.num_classes = spec.num_classes
        if spec.classifier is not None:
            return spec.classifier
        with seeded(seed):
            return nn.Linear(spec.embedding_dim, spec.num_classes)

    def _check_input(self, x) -> torch.Tensor:
        return check_tensor(x, "x", floating=True, min_ndim=2, nonempty=True)

    def _check_batch(self, x, y) -> tuple[torch.Tensor, torch.Tensor]:
        xt = self._check_input(x)
        yt = check_labels(y, "y", num_classes=self.num_classes, n=xt.shape[0])
        return xt, yt.to(xt.device)

    def predict_proba(self, x) -> torch.Tensor:
        """The predictive distribution ``softmax(forward(x))``, ``(N, C)`` rows on the simplex.

        Computed in eval mode (every submodule's mode is restored afterwards) without gradients, as
        :meth:`uncertainty`. Raises ``TypeError`` / ``ValueError`` naming ``x`` for a non-floating,
        empty or 1-d input.
        """
        xt = self._check_input(x)
        with torch.no_grad(), eval_mode(self):
            return torch.softmax(self(xt), dim=1)

    def uncertainty(self, x) -> dict[str, torch.Tensor]:
        """Every uncertainty of the method for ``x``: ``{name: (N,)}``, higher = more uncertain.

        Computed in eval mode (every submodule's mode is restored afterwards) without gradients.
        Raises ``TypeError`` / ``ValueError`` naming ``x`` for a non-floating, empty or 1-d input.
        """
        xt = self._check_input(x)
        with torch.no_grad(), eval_mode(self):
            return self._uncertainty(xt)
