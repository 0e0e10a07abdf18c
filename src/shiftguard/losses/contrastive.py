"""Contrastive classifiers with a probabilistic interpretation [Patel, Ch. 6].

Notation of the chapter: a batch of ``M`` embeddings ``z_i`` (``M = 2N`` when every image comes with an
augmented view; views share their label), labels ``y_i in {0..K-1}``, class prototypes ``theta_k``.

* :class:`SPCELoss` -- Simplified Pairwise Cross-Entropy [Patel, Ch. 6, eq. (6.7)]:
  ``-1/M sum_i log softmax_k(1/M sum_{j: y_j = k} z_j^T z_i)[y_i]``; its posterior [Patel, Ch. 6,
  eq. (6.8)] is the same softmax with the sum over a reference (training) set, :meth:`SPCELoss.fit`.
* :class:`TightnessLoss` -- the prototype tightness loss [Patel, Ch. 6, eq. (6.9)]
  ``l_tt = -1/M sum_i z_i^T theta_{y_i}`` that trains a nearest-prototype classifier beside a
  representation loss, and :class:`MomentumMeanClassifier`, the closed form of its updates
  [Patel, Ch. 6, eq. (6.10)-(6.11)].
* :class:`ESupConLoss` -- Extended Supervised Contrastive learning [Patel, Ch. 6, eq. (6.12)-(6.15)]:
  SupCon [Patel, Ch. 6, eq. (6.5)] plus a prototype loss whose softmax runs over the prototypes *and* the
  other samples; it decomposes as ``l_pt = log(exp(l_CE) + exp(l_SupCon(z_i, theta_{y_i})) - 1)``
  [Patel, Ch. 6, eq. (6.16)-(6.17)] (tested exactly).

Every loss follows the package contract (``shiftguard.losses.base``): ``loss(embeddings, labels) -> scalar``,
input validated once, float32 computation for half-precision input, labels ``>= num_classes`` and a wrong
embedding width rejected naming the argument.  Each classifier exposes ``logits(embeddings) -> (N, K)`` and
``predict_proba(embeddings) -> (N, K)`` (the softmax of the logits, the posterior of the chapter; the verb of
the heads); ``posterior`` is its deprecated alias.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from shiftguard._deprecation import warn_deprecated
from shiftguard._validation import check_positive, check_tensor
from shiftguard.functional.scaling import normalize_rows
from shiftguard.losses.base import EmbeddingLoss, validate_batch, zero_loss

__all__ = [
    "SPCELoss",
    "TightnessLoss",
    "MomentumMeanClassifier",
    "ESupConLoss",
    "ESupConTerms",
]


def _check_dims(num_classes, embedding_dim) -> None:
    check_positive(num_classes, "num_classes", integer=True)
    check_positive(embedding_dim, "embedding_dim", integer=True)


def _check_batch_against(
    embeddings: torch.Tensor, labels: torch.Tensor, num_classes: int, dim: int, check_values: bool = True
) -> None:
    """``ValueError`` naming ``labels`` / ``embeddings`` for labels ``>= num_classes`` (read only with
    ``check_values``: a host synchronisation) or a wrong width."""
    if check_values and labels.numel() and int(labels.max()) >= num_classes:
        raise ValueError(f"labels: must be < num_classes={num_classes}, got maximum {int(labels.max())}")
    if embeddings.shape[1] != dim:
        raise ValueError(f"embeddings: expected {dim} features (embedding_dim), got shape {tuple(embeddings.shape)}")


def _check_embeddings(embeddings, dim: int) -> torch.Tensor:
    """Validate ``(N, dim)`` finite float embeddings for a classifier; half precision is widened to float32."""
    z = check_tensor(embeddings, "embeddings", ndim=2, floating=True, finite=True)
    if z.shape[1] != dim:
        raise ValueError(f"embeddings: expected {dim} features (embedding_dim), got shape {tuple(z.shape)}")
    return z.float() if z.dtype in (torch.float16, torch.bfloat16) else z


def _finite_loss(loss: torch.Tensor, embeddings: torch.Tensor, check: bool = True) -> torch.Tensor:
    """``loss`` itself; ``ValueError`` naming ``embeddings`` if it is not finite (never a silent inf/NaN),
    checked only with ``check`` (the loss's ``validate_args``)."""
    if check and not bool(torch.isfinite(loss)):
        big = float(embeddings.detach().abs().max())
        raise ValueError(f"embeddings: values reach {big:.3g}; the loss is not finite in {loss.dtype} ({float(loss)})")
    return loss


def _class_sums(z: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """``(K, D)``: row ``k`` is ``sum_{i: y_i = k} z_i`` (zero for a class without members)."""
    return z.new_zeros(num_classes, z.shape[1]).index_add(0, labels, z)


def _cosine_logits(embeddings: torch.Tensor, prototypes: torch.Tensor, temperature: float) -> torch.Tensor:
    """``(N, K)`` logits ``z^T theta_k / (||z|| ||theta_k|| tau)`` (zero rows / prototypes give 0)."""
    return normalize_rows(embeddings) @ normalize_rows(prototypes.to(embeddings.dtype)).t() / temperature


# ------------------------------------------------------------------------------------------------ SPCE


class SPCELoss(EmbeddingLoss):
    """Simplified Pairwise Cross-Entropy [Patel, Ch. 6, eq. (6.7)] and its posterior [Patel, Ch. 6, eq. (6.8)].

    For a batch of ``M`` embeddings (``M`` counts augmented views too)::

        s_ik = 1/M sum_{j: y_j = k} z_j^T z_i / tau,        l_SPCE = -1/M sum_i log softmax_k(s_ik)[y_i]

    The softmax runs over all ``K = num_classes`` classes, as in eq. (6.7): a class without a member in
    the batch has an empty sum, i.e. the logit ``0`` (its implied classifier weight is the zero vector),
    and still takes part in the normaliser. The sum over ``j`` includes ``j = i`` (the equation does not
    exclude it). The chapter writes the loss without a temperature; ``temperature = 1`` and
    ``normalize=False`` (the defaults) are exactly eq. (6.7); ``normalize=True`` L2-normalises the
    embeddings first (then the logits lie in ``[-1/tau, 1/tau]``).

    Posterior: the classifier weights are the reference-set class sums divided by the reference size,
    ``w_k = 1/M_ref sum_{j: y_j = k} z_j`` (= ``(M_k / M_ref) c_k`` with ``c_k`` the class mean), and
    ``p(k|z) = softmax_k(w_k^T z / tau)`` -- eq. (6.8) with the sum over the reference set.
    :meth:`fit` stores ``w`` from reference (training) embeddings; :meth:`logits` / :meth:`predict_proba`
    apply it. The weights depend on the class frequencies of the reference set, as the equation states.

    Args:
        num_classes: ``K``; labels must lie in ``[0, K)``.
        embedding_dim: ``D``; embeddings must be ``(N, D)``.
        temperature: ``tau > 0`` dividing every logit (not in the chapter; 1 reproduces it).
        normalize: L2-normalise embeddings (batch and reference) before the dot products.

    Degenerate input: zero embeddings give zero logits (the loss is ``log K``); the loss has no
    parameters, so a single-class batch still has a finite, non-zero value. A loss that is not finite
    in the embeddings' dtype (dot products beyond its range) raises ``ValueError`` naming ``embeddings``.

    Example:
        >>> import torch
        >>> from shiftguard.losses import SPCELoss
        >>> loss = SPCELoss(num_classes=2, embedding_dim=2)
        >>> z, y = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 0, 1])
        >>> round(float(loss(z, y)), 4)
        0.3268
        >>> loss.fit(z, y).predict_proba(torch.tensor([[1.0, 0.0]])).argmax(1).tolist()
        [0]
    """

    class_weights_: torch.Tensor
    fitted_: torch.Tensor

    def __init__(
        self,
        num_classes: int,
        embedding_dim: int,
        *,
        temperature: float = 1.0,
        normalize: bool = False,
        validate_args: bool = True,
    ):
        super().__init__(validate_args=validate_args)
        _check_dims(num_classes, embedding_dim)
        check_positive(temperature, "temperature")
        self.num_classes = int(num_classes)
        self.embedding_dim = int(embedding_dim)
        self.temperature = float(temperature)
        self.normalize = bool(normalize)
        self.register_buffer("class_weights_", torch.zeros(num_classes, embedding_dim))
        self.register_buffer("fitted_", torch.tensor(False))

    def extra_repr(self) -> str:
        return (
            f"num_classes={self.num_classes}, embedding_dim={self.embedding_dim}, "
            f"temperature={self.temperature}, normalize={self.normalize}"
        )

    def _prepare(self, z: torch.Tensor) -> torch.Tensor:
        return normalize_rows(z) if self.normalize else z

    def compute(self, embeddings, labels):
        _check_batch_against(embeddings, labels, self.num_classes, self.embedding_dim, self.validate_args)
        z = self._prepare(embeddings)
        weights = _class_sums(z, labels, self.num_classes) / z.shape[0]  # (K, D): 1/M sum_{j: y_j=k} z_j
        logits = z @ weights.t() / self.temperature
        return _finite_loss(F.cross_entropy(logits, labels), embeddings, self.validate_args)

    @torch.no_grad()
    def fit(self, reference, reference_labels) -> "SPCELoss":
        """Store the eq. (6.8) weights ``w_k = 1/M_ref sum_{j: y_j = k} z_j`` of reference embeddings.

        ``reference``: ``(M_ref, D)`` float (e.g. the training set's embeddings); ``reference_labels``:
        ``(M_ref,)`` int in ``[0, K)``. Returns ``self``. Raises ``ValueError`` / ``TypeError`` naming
        the argument (non-finite values, wrong shapes, labels ``>= num_classes``).
        """
        try:
            ref, lab = validate_batch(reference, reference_labels)
        except (TypeError, ValueError) as exc:
            msg = str(exc).replace("embeddings:", "reference:", 1).replace("labels:", "reference_labels:", 1)
            raise type(exc)(msg) from None
        if lab.numel() and int(lab.max()) >= self.num_classes:
            raise ValueError(
                f"reference_labels: must be < num_classes={self.num_classes}, got maximum {int(lab.max())}"
            )
        if ref.shape[1] != self.embedding_dim:
            raise ValueError(f"reference: expected {self.embedding_dim} features, got shape {tuple(ref.shape)}")
        z = self._prepare(ref.to(self.class_weights_.dtype))
        self.class_weights_.copy_(_class_sums(z, lab.to(z.device), self.num_classes) / z.shape[0])
        self.fitted_.fill_(True)
        return self

    def logits(self, embeddings) -> torch.Tensor:
        """``(N, K)`` logits ``w_k^T z / tau`` of eq. (6.8); ``RuntimeError`` before :meth:`fit`."""
        if not bool(self.fitted_):
            raise RuntimeError("SPCELoss: call fit(reference, reference_labels) before logits/predict_proba")
        z = self._prepare(_check_embeddings(embeddings, self.embedding_dim))
        return z @ self.class_weights_.to(z.dtype).t() / self.temperature

    def predict_proba(self, embeddings) -> torch.Tensor:
        """``(N, K)`` class probabilities ``p(k|z)`` [Patel, Ch. 6, eq. (6.8)]."""
        return torch.softmax(self.logits(embeddings), dim=1)

    def posterior(self, embeddings) -> torch.Tensor:
        """Deprecated alias of :meth:`predict_proba`."""
        warn_deprecated("SPCELoss.posterior", "SPCELoss.predict_proba")
        return self.predict_proba(embeddings)


# ------------------------------------------------------------------------------- tightness and its classifier


class TightnessLoss(EmbeddingLoss):
    """Prototype tightness loss [Patel, Ch. 6, eq. (6.9)], optionally beside a representation loss.

    ``l_tt = -1/M sum_i z^_i^T theta_{y_i}`` with ``z^`` the L2-normalised embeddings (the chapter assumes
    normalised representations) and learnable prototypes ``theta`` (``prototypes``, ``(K, D)``,
    initialised at zero). Its gradient is ``d l_tt / d theta_k = -1/M sum_{i: y_i = k} z^_i``
    [Patel, Ch. 6, eq. (6.10)], so plain SGD with learning rate ``eta`` on ``prototypes`` performs exactly
    the recursion of eq. (6.11) (:class:`MomentumMeanClassifier` computes it without autograd).
    ``l_tt`` is linear in ``theta`` and unbounded below: the prototypes grow along their class's
    cumulative mean and the value keeps decreasing, so it is not a convergence diagnostic.

    With ``stop_gradient=True`` (default, as in [Patel, Ch. 6, Sec. 6.5.2]: "the gradients of the
    tightness loss are not propagated to the rest of the network") the embeddings enter ``l_tt``
    detached; the returned scalar stays attached to them with an exact zero gradient. ``base`` is the
    representation loss trained beside it (SPCE or SupCon in the chapter's experiments); the value
    returned is ``base(embeddings, labels) + l_tt``.

    Classifier: the nearest prototype [Patel, Ch. 6, Sec. 6.3] on normalised vectors, with
    ``logits = cos(z, theta_k) / tau``; the chapter gives it no temperature (``tau = 1`` by default;
    calibrate it afterwards, e.g. with temperature scaling as [Patel, Ch. 6, Sec. 6.5] does).

    Args:
        num_classes, embedding_dim: prototype table shape ``(K, D)``.
        base: optional loss module called on the same batch (it validates its input by its own
            ``validate_args``).
        temperature: ``tau > 0`` of the classifier logits (does not enter ``l_tt``).
        stop_gradient: detach the embeddings inside ``l_tt``.
    """

    def __init__(
        self,
        num_classes: int,
        embedding_dim: int,
        *,
        base: Optional[nn.Module] = None,
        temperature: float = 1.0,
        stop_gradient: bool = True,
        validate_args: bool = True,
    ):
        super().__init__(validate_args=validate_args)
        _check_dims(num_classes, embedding_dim)
        check_positive(temperature, "temperature")
        if base is not None and not isinstance(base, nn.Module):
            raise TypeError(f"base: expected an nn.Module loss or None, got {type(base).__name__}")
        self.base = base
        self.temperature = float(temperature)
        self.stop_gradient = bool(stop_gradient)
        self.prototypes = nn.Parameter(torch.zeros(num_classes, embedding_dim))

    def extra_repr(self) -> str:
        return (
            f"num_classes={self.prototypes.shape[0]}, embedding_dim={self.prototypes.shape[1]}, "
            f"temperature={self.temperature}, stop_gradient={self.stop_gradient}"
        )

    def compute(self, embeddings, labels):
        _check_batch_against(embeddings, labels, self.prototypes.shape[0], self.prototypes.shape[1], self.validate_args)
        z = normalize_rows(embeddings.detach() if self.stop_gradient else embeddings)
        theta = self.prototypes.to(z.dtype)
        loss = -(z * theta[labels]).sum(1).mean()
        if self.stop_gradient:
            loss = loss + zero_loss(embeddings)
        if self.base is not None:
            loss = loss + self.base(embeddings, labels)
        return loss

    def logits(self, embeddings) -> torch.Tensor:
        """``(N, K)`` nearest-prototype logits ``cos(z, theta_k) / tau``."""
        z = _check_embeddings(embeddings, self.prototypes.shape[1])
        return _cosine_logits(z, self.prototypes, self.temperature)

    def predict_proba(self, embeddings) -> torch.Tensor:
        """``(N, K)`` softmax of :meth:`logits`; its argmax is the nearest (normalised) prototype."""
        return torch.softmax(self.logits(embeddings), dim=1)

    def posterior(self, embeddings) -> torch.Tensor:
        """Deprecated alias of :meth:`predict_proba`."""
        warn_deprecated("TightnessLoss.posterior", "TightnessLoss.predict_proba")
        return self.predict_proba(embeddings)


class MomentumMeanClassifier(nn.Module):
    """The prototype classifier of [Patel, Ch. 6, eq. (6.11)], updated in closed form.

    ``theta_k^0 = eta/M sum_{i: y_i = k} z^_i^0``, ``theta_k^{t+1} = theta_k^t + eta/M sum_{i: y_i = k}
    z^_i^{t+1}`` with ``M`` the batch size (augmented views included) and ``z^`` the L2-normalised
    embeddings. Starting from zero prototypes, every :meth:`update` adds ``eta/M`` times the batch's class
    sums, which is one SGD step of rate ``eta`` on ``l_tt`` [Patel, Ch. 6, eq. (6.10)]. The chapter calls
    this a class mean "with momentum updates": the recursion is a cumulative sum (no decay), so each
    prototype points along the running mean of every embedding its class has had, old and new alike; a
    class absent from a batch is left unchanged. The classifier is the nearest prototype on normalised
    vectors, ``logits = cos(z, theta_k) / tau`` (``tau`` not from the chapter; 1 by default).

    Args:
        num_classes, embedding_dim: prototype table shape ``(K, D)`` (a buffer ``prototypes``).
        eta: the step ``eta > 0`` (it scales the prototypes, not the classifier's decisions).
        temperature: ``tau > 0`` of the logits.
    """

    prototypes: torch.Tensor
    steps_: torch.Tensor

    def __init__(self, num_classes: int, embedding_dim: int, *, eta: float = 1.0, temperature: float = 1.0):
        super().__init__()
        _check_dims(num_classes, embedding_dim)
        check_positive(eta, "eta")
        check_positive(temperature, "temperature")
        self.eta = float(eta)
        self.temperature = float(temperature)
        self.register_buffer("prototypes", torch.zeros(num_classes, embedding_dim))
        self.register_buffer("steps_", torch.zeros((), dtype=torch.long))

    def extra_repr(self) -> str:
        return (
            f"num_classes={self.prototypes.shape[0]}, embedding_dim={self.prototypes.shape[1]}, "
            f"eta={self.eta}, temperature={self.temperature}"
        )

    @torch.no_grad()
    def update(self, embeddings, labels) -> "MomentumMeanClassifier":
        """One step of eq. (6.11) with a batch ``embeddings (M, D)`` float, ``labels (M,)`` int; returns self.

        Raises ``ValueError`` / ``TypeError`` naming ``embeddings`` or ``labels`` (non-finite values,
        shapes, labels ``>= num_classes``, a wrong width).
        """
        z, lab = validate_batch(embeddings, labels)
        _check_batch_against(z, lab, self.prototypes.shape[0], self.prototypes.shape[1])
        zn = normalize_rows(z.detach().to(self.prototypes.dtype))
        self.prototypes.add_(_class_sums(zn, lab.to(zn.device), self.prototypes.shape[0]), alpha=self.eta / z.shape[0])
        self.steps_ += 1
        return self

    def logits(self, embeddings) -> torch.Tensor:
        """``(N, K)`` nearest-prototype logits ``cos(z, theta_k) / tau`` (all 0 before any update)."""
        z = _check_embeddings(embeddings, self.prototypes.shape[1])
        return _cosine_logits(z, self.prototypes, self.temperature)

    def predict_proba(self, embeddings) -> torch.Tensor:
        """``(N, K)`` softmax of :meth:`logits`."""
        return torch.softmax(self.logits(embeddings), dim=1)

    def posterior(self, embeddings) -> torch.Tensor:
        """Deprecated alias of :meth:`predict_proba`."""
        warn_deprecated("MomentumMeanClassifier.posterior", "MomentumMeanClassifier.predict_proba")
        return self.predict_proba(embeddings)

    def forward(self, embeddings) -> torch.Tensor:
        return self.logits(embeddings)


# --------------------------------------------------------------------------------------------------- ESupCon


class ESupConTerms(NamedTuple):
    """Per-sample terms of ESupCon for a batch of ``M`` embeddings (all ``(M,)``)."""

    #: ``l_pt(z_i, theta_{y_i})`` [Patel, Ch. 6, eq. (6.12)].
    prototype: torch.Tensor
    #: ``l_SupCon(z_i, P_i)`` [Patel, Ch. 6, eq. (6.5)]; 0 where ``has_positive`` is False.
    supcon: torch.Tensor
    #: whether sample ``i`` has another sample of its class in the batch (``P_i`` non-empty).
    has_positive: torch.Tensor


class ESupConLoss(EmbeddingLoss):
    """Extended Supervised Contrastive loss [Patel, Ch. 6, eq. (6.12)-(6.15)] with learnable prototypes.

    With ``s(a, b) = a^T b / (||a|| ||b|| tau)`` (normalised vectors as in SupCon; the chapter drops
    ``tau`` "for clarity", here it divides every similarity)::

        l_pt(z_i, theta_{y_i}) = -s(z_i, theta_{y_i}) + log(sum_k e^{s(z_i, theta_k)} + sum_{j != i} e^{s(z_i, z_j)})
        l_pt(theta_k)          = 1/(2N_k) sum_{i: y_i = k} l_pt(z_i, theta_k)                         (6.14)
        l_SupCon(z_i, P_i)     = 1/|P_i| sum_{p in P_i} (-s(z_i, z_p) + log sum_{j != i} e^{s(z_i, z_j)})  (6.5)
        l_ESupCon              = (sum_k l_pt(theta_k) + sum_i l_SupCon(z_i, P_i)) / (2N + K)           (6.15)

    ``2N`` is the batch size (views included) and ``2N_k`` the number of class-``k`` samples in it.
    Terms that do not exist in a batch are left out of both the sum and the count: a class absent from
    the batch has no ``l_pt(theta_k)`` (eq. (6.14) is an empty mean), an anchor with no other sample of
    its class has no SupCon term. The divisor is therefore (number of anchors with a positive) + (number
    of classes present), which equals ``2N + K`` of eq. (6.15) whenever every class is present with at
    least two samples -- the text does not say how to count missing terms.

    Posterior: the explicit linear classifier the loss trains, ``p(k|z) = softmax_k(s(z, theta_k))`` --
    the cross-entropy part of ``l_pt`` [Patel, Ch. 6, eq. (6.16)] -- via :meth:`logits` /
    :meth:`predict_proba`. :meth:`terms` returns the per-sample pieces, and the identity of eq. (6.17)
    ``l_pt = log(exp(l_CE(z_i)) + exp(l_SupCon(z_i, theta_{y_i})) - 1)`` holds for them (tested).

    Args:
        num_classes, embedding_dim: prototype table shape ``(K, D)`` (parameter ``prototypes``,
            initialised ``N(0, 1/D)``).
        temperature: ``tau > 0``; 0.1 by default (the chapter defers its value to a supplement we do not
            have; 0.1 is the value of Khosla et al. 2020's SupCon experiments).

    Zero-norm embeddings normalise to zero (cosine 0 to everything): finite loss and gradients. A single
    sample or a single class still gives a finite loss (the prototype term always exists).
    """

    def __init__(self, num_classes: int, embedding_dim: int, *, temperature: float = 0.1, validate_args: bool = True):
        super().__init__(validate_args=validate_args)
        _check_dims(num_classes, embedding_dim)
        check_positive(temperature, "temperature")
        self.temperature = float(temperature)
        self.prototypes = nn.Parameter(torch.randn(num_classes, embedding_dim) / math.sqrt(embedding_dim))

    def extra_repr(self) -> str:
        return (
            f"num_classes={self.prototypes.shape[0]}, embedding_dim={self.prototypes.shape[1]}, "
            f"temperature={self.temperature}"
        )

    def _terms(self, embeddings: torch.Tensor, labels: torch.Tensor) -> ESupConTerms:
        m = embeddings.shape[0]
        z = normalize_rows(embeddings)
        s_zt = _cosine_logits(embeddings, self.prototypes, self.temperature)  # (M, K)
        tight = s_zt.gather(1, labels.unsqueeze(1)).squeeze(1)  # T of eq. (6.16)
        if m == 1:
            # No other sample: C_2 is an empty sum and there is no SupCon term.
            prototype = torch.logsumexp(s_zt, dim=1) - tight
            zeros = prototype.new_zeros(1)
            return ESupConTerms(prototype, zeros, torch.zeros(1, dtype=torch.bool, device=labels.device))
        eye = torch.eye(m, dtype=torch.bool, device=embeddings.device)
        s_zz = (z @ z.t() / self.temperature).masked_fill(eye, float("-inf"))  # self excluded (j != i)
        lse_zz = torch.logsumexp(s_zz, dim=1)  # log C_2
        prototype = torch.logaddexp(torch.logsumexp(s_zt, dim=1), lse_zz) - tight  # eq. (6.12)
        pos = (labels.unsqueeze(0) == labels.unsqueeze(1)) & ~eye
        n_pos = pos.sum(1)
        has_positive = n_pos > 0
        pos_mean = torch.where(pos, s_zz, torch.zeros_like(s_zz)).sum(1) / n_pos.clamp_min(1).to(s_zz.dtype)
        supcon = torch.where(has_positive, lse_zz - pos_mean, torch.zeros_like(lse_zz))  # eq. (6.5)
        return ESupConTerms(prototype, supcon, has_positive)

    def terms(self, embeddings, labels) -> ESupConTerms:
        """Per-sample ``l_pt(z_i, theta_{y_i})`` and ``l_SupCon(z_i, P_i)`` of a batch (validated as ``forward``)."""
        emb, lab = validate_batch(embeddings, labels, check_values=self.validate_args)
        if emb.dtype in (torch.float16, torch.bfloat16):
            emb = emb.float()
        _check_batch_against(emb, lab, self.prototypes.shape[0], self.prototypes.shape[1], self.validate_args)
        return self._terms(emb, lab)

    def compute(self, embeddings, labels):
        _check_batch_against(embeddings, labels, self.prototypes.shape[0], self.prototypes.shape[1], self.validate_args)
        t = self._terms(embeddings, labels)
        k = self.prototypes.shape[0]
        counts = torch.bincount(labels, minlength=k).to(t.prototype.dtype)  # 2N_k
        per_class = t.prototype.new_zeros(k).index_add(0, labels, t.prototype) / counts.clamp_min(1.0)  # (6.14)
        n_terms = int((counts > 0).sum()) + int(t.has_positive.sum())
        return (per_class.sum() + t.supcon.sum()) / n_terms

    def logits(self, embeddings) -> torch.Tensor:
        """``(N, K)`` logits ``s(z, theta_k)`` of the linear (cosine) classifier trained by ESupCon."""
        z = _check_embeddings(embeddings, self.prototypes.shape[1])
        return _cosine_logits(z, self.prototypes, self.temperature)

    def predict_proba(self, embeddings) -> torch.Tensor:
        """``(N, K)`` class probabilities ``softmax_k(s(z, theta_k))``."""
        return torch.softmax(self.logits(embeddings), dim=1)

    def posterior(self, embeddings) -> torch.Tensor:
        """Deprecated alias of :meth:`predict_proba`."""
        warn_deprecated("ESupConLoss.posterior", "ESupConLoss.predict_proba")
        return self.predict_proba(embeddings)
