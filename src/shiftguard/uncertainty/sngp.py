"""SNGP: spectral normalisation of the hidden layers and a random-feature Gaussian-process output layer
([Kirchhof, URL App. B.8, eq. (7)]; Liu et al. 2020).

Output layer ([Kirchhof, URL App. B.8]; Liu et al. 2020, Sec. 3.1 and eqs. (7)-(9)):

- random features ``phi(h) = sqrt(2 / M) cos(W h' + b)`` with FROZEN ``W ~ N(0, 1)`` ``(M, D)`` and
  ``b ~ U(0, 2 pi)`` (an RBF-kernel approximation), ``h' = LayerNorm(h) / length_scale`` (the layer
  norm is optional, as in the URL hyperparameters);
- GP logits ``g(h) = phi(h)^T beta`` with a learnable ``beta`` ``(M, C)``, trained under CE;
- posterior: ``g(h) ~ N(phi^T beta, phi^T Sigma phi)`` with ``Sigma = (ridge I + Phi^T Phi)^{-1}``,
  where ``Phi`` holds the random features of the training set ([Kirchhof, URL App. B.8, eq. (7)]
  with ``ridge = 1`` is ``(I + Phi^T Phi)^{-1}``; ``ridge`` is the prior precision of ``beta``). The
  precision ``ridge I + Phi^T Phi`` is accumulated over ONE pass of the training data after training
  (:meth:`SNGP.fit_covariance`, or :meth:`SNGP.reset_covariance` + :meth:`SNGP.update_covariance` per
  batch), the Laplace approximation of Liu et al. 2020 in the form eq. (7) writes (the likelihood
  Hessian weights ``p (1 - p)`` are replaced by 1, as their multi-class implementation does). Before
  any pass, ``Sigma = I / ridge`` (the prior);
- mean-field class probabilities (Liu et al. 2020, eq. (12)): ``softmax(g / sqrt(1 + lambda var))``
  with ``var = phi^T Sigma phi`` and ``lambda = pi / 8`` by default.

Spectral normalisation (Liu et al. 2020, Sec. 3.2, eq. (10)): every ``nn.Linear`` / ``nn.Conv*``
weight of the backbone (except an ``EmbeddingClassifier``'s own ``classifier``, which the GP layer
replaces) is reparametrised as ``W * min(1, c / sigma(W))``, ``sigma`` the largest singular value of
the weight reshaped to ``(out, -1)`` estimated by power iteration (one step per training forward),
bound ``c = 0.95`` by default; registered with ``torch.nn.utils.parametrize``. For convolutions the
reshaped matrix is Miyato et al.'s (2018) proxy of the operator norm, not the exact norm Liu et al.
compute with transposed convolutions. The backbone is modified in place.

Uncertainty: ``"entropy"`` of the mean-field probabilities ([Kirchhof, URL Sec. 4.1], "SNGP"; the
default) and ``"variance"`` the GP predictive variance ``phi^T Sigma phi``.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from shiftguard._validation import check_positive, check_tensor
from shiftguard.uncertainty.estimator import (
    UncertaintyEstimator,
    _entropy,
    backbone_embed,
    eval_mode,
    resolve_backbone,
    seeded,
)

__all__ = ["SNGP", "RandomFeatureGP", "SpectralNormBound", "spectral_normalize"]

_SPECTRAL_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


class SpectralNormBound(nn.Module):
    """Parametrisation ``W -> W * min(1, bound / sigma(W))`` (Liu et al. 2020, eq. (10)).

    ``sigma`` is estimated by power iteration on ``W.reshape(out, -1)``: 15 steps at construction,
    ``n_power_iterations`` steps per forward in training mode (the vectors ``u``, ``v`` are buffers,
    as in ``torch.nn.utils.parametrizations.spectral_norm``); eval mode reuses them.
    """

    u: torch.Tensor
    v: torch.Tensor

    def __init__(self, weight: torch.Tensor, bound: float = 0.95, n_power_iterations: int = 1, eps: float = 1e-12):
        super().__init__()
        self.bound = bound
        self.n_power_iterations = n_power_iterations
        self.eps = eps
        mat = weight.detach().reshape(weight.shape[0], -1)
        u = F.normalize(mat.new_empty(mat.shape[0]).normal_(), dim=0, eps=eps)
        v = F.normalize(mat.new_empty(mat.shape[1]).normal_(), dim=0, eps=eps)
        self.register_buffer("u", u)
        self.register_buffer("v", v)
        self._power_iteration(mat, 15)

    def extra_repr(self) -> str:
        return f"bound={self.bound}, n_power_iterations={self.n_power_iterations}"

    @torch.no_grad()
    def _power_iteration(self, mat: torch.Tensor, steps: int) -> None:
        for _ in range(steps):
            self.v.copy_(F.normalize(mat.t() @ self.u, dim=0, eps=self.eps))
            self.u.copy_(F.normalize(mat @ self.v, dim=0, eps=self.eps))

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        mat = weight.reshape(weight.shape[0], -1)
        if self.training:
            self._power_iteration(mat.detach(), self.n_power_iterations)
        u, v = self.u.clone(), self.v.clone()
        sigma = torch.dot(u, mat @ v)
        return weight * torch.clamp(self.bound / sigma, max=1.0)


def spectral_normalize(
    module: nn.Module, bound: float = 0.95, n_power_iterations: int = 1, exclude: Iterable[nn.Module] = ()
) -> int:
    """Register :class:`SpectralNormBound` on the weight of every ``Linear`` / ``Conv1-3d`` in ``module``.

    Modules in ``exclude`` and modules already parametrised are skipped. Returns the number of
    weights normalised. Raises ``TypeError`` / ``ValueError`` naming ``module``, ``bound`` or
    ``n_power_iterations``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    check_positive(bound, "bound")
    check_positive(n_power_iterations, "n_power_iterations", integer=True)
    skip = {id(m) for m in exclude}
    count = 0
    for m in list(module.modules()):
        if isinstance(m, _SPECTRAL_TYPES) and id(m) not in skip and not parametrize.is_parametrized(m, "weight"):
            parametrize.register_parametrization(m, "weight", SpectralNormBound(m.weight, bound, n_power_iterations))
            count += 1
    return count


class RandomFeatureGP(nn.Module):
    """Random-feature GP output layer: embeddings ``(N, D)`` -> log-probabilities ``(N, C)``.

    Train mode returns ``log_softmax(g)`` of the GP logits; eval mode the mean-field
    ``log_softmax(g / sqrt(1 + mean_field_factor * var))`` (module docstring). The frozen random
    projection (``rf_weight``, ``rf_bias``), the data precision ``Phi^T Phi`` (``precision``) and the
    number of samples accumulated in it (``num_covariance_samples``) are buffers.
    """

    rf_weight: torch.Tensor
    rf_bias: torch.Tensor
    precision: torch.Tensor
    num_covariance_samples: torch.Tensor

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        num_features: int = 1024,
        *,
        ridge: float = 1.0,
        mean_field_factor: float = math.pi / 8,
        normalize_input: bool = True,
        length_scale: float = 1.0,
        seed: int = 0,
    ):
        super().__init__()
        check_positive(in_features, "in_features", integer=True)
        check_positive(num_classes, "num_classes", integer=True)
        check_positive(num_features, "num_features", integer=True)
        check_positive(ridge, "ridge")
        check_positive(mean_field_factor, "mean_field_factor", strict=False)
        check_positive(length_scale, "length_scale")
        if not isinstance(normalize_input, bool):
            raise TypeError(f"normalize_input: expected a bool, got {type(normalize_input).__name__}")
        self.in_features = in_features
        self.num_classes = num_classes
        self.num_features = num_features
        self.ridge = float(ridge)
        self.mean_field_factor = float(mean_field_factor)
        self.length_scale = float(length_scale)
        self.input_norm: nn.Module = nn.LayerNorm(in_features) if normalize_input else nn.Identity()
        with seeded(seed):
            self.register_buffer("rf_weight", torch.randn(num_features, in_features))
            self.register_buffer("rf_bias", torch.rand(num_features) * (2 * math.pi))
            self.beta = nn.Linear(num_features, num_classes, bias=False)
        self.register_buffer("precision", torch.zeros(num_features, num_features))
        self.register_buffer("num_covariance_samples", torch.zeros((), dtype=torch.long))
        self._cache_key: Optional[tuple] = None
        self._cache: Optional[torch.Tensor] = None

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, num_classes={self.num_classes}, "
            f"num_features={self.num_features}, ridge={self.ridge}, "
            f"mean_field_factor={self.mean_field_factor:.6g}, length_scale={self.length_scale}"
        )

    def random_features(self, h: torch.Tensor) -> torch.Tensor:
        """``phi(h) = sqrt(2 / M) cos(W h' + b)``, ``(N, M)``."""
        z = self.input_norm(h) / self.length_scale
        return math.sqrt(2.0 / self.num_features) * torch.cos(F.linear(z, self.rf_weight, self.rf_bias))

    def reset_covariance(self) -> None:
        """Forget the accumulated ``Phi^T Phi`` (back to the prior ``Sigma = I / ridge``)."""
        self.precision.zero_()
        self.num_covariance_samples.zero_()

    @torch.no_grad()
    def update_covariance(self, h: torch.Tensor) -> None:
        """Add ``phi(h)^T phi(h)`` of a batch of training embeddings ``h (N, D)`` to the precision."""
        phi = self.random_features(h).to(self.precision.dtype)
        self.precision.add_(phi.t() @ phi)
        self.num_covariance_samples.add_(phi.shape[0])

    def posterior_covariance(self) -> torch.Tensor:
        """``Sigma = (ridge I + Phi^T Phi)^{-1}`` ``(M, M)`` (cached until the precision changes)."""
        p = self.precision
        key = (p._version, p.data_ptr(), p.dtype, p.device, self.ridge)
        if self._cache is None or self._cache_key != key:
            a = p + self.ridge * torch.eye(self.num_features, dtype=p.dtype, device=p.device)
            self._cache = torch.cholesky_inverse(torch.linalg.cholesky(a))
            self._cache_key = key
        return self._cache

    def predictive_variance(self, h: torch.Tensor) -> torch.Tensor:
        """``var(h) = phi(h)^T Sigma phi(h)`` ``(N,)`` (no gradient flows into ``Sigma``)."""
        phi = self.random_features(h)
        sigma = self.posterior_covariance().detach().to(phi.dtype)
        return ((phi @ sigma) * phi).sum(dim=1)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """GP posterior-mean logits ``g = phi(h)^T beta`` ``(N, C)``."""
        return self.beta(self.random_features(h))

    def mean_field_logits(self, h: torch.Tensor) -> torch.Tensor:
        """``g / sqrt(1 + mean_field_factor * var)`` (Liu et al. 2020, eq. (12))."""
        phi = self.random_features(h)
        sigma = self.posterior_covariance().detach().to(phi.dtype)
        var = ((phi @ sigma) * phi).sum(dim=1)
        return self.beta(phi) / torch.sqrt(1.0 + self.mean_field_factor * var).unsqueeze(1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.training:
            return F.log_softmax(self.logits(h), dim=-1)
        return F.log_softmax(self.mean_field_logits(h), dim=-1)


class SNGP(UncertaintyEstimator):
    """Spectral-normalised backbone + random-feature GP output layer (module docstring).

    Args:
        backbone: a ``shiftguard.models.EmbeddingClassifier`` (its ``classifier`` is replaced by the GP
            layer and gets no gradient) or any module mapping ``x`` to ``(N, D)`` (give
            ``embedding_dim`` / ``num_classes`` or set them as attributes). Modified in place when
            ``spectral_norm`` is set.
        num_features: M random features (Liu et al. 2020: 1024).
        spectral_norm: normalise the backbone's Linear / Conv weights (URL treats it as a hyperparameter).
        spectral_bound: the bound c (Liu et al. 2020: 0.95). power_iterations: per training forward.
        ridge: prior precision of beta (eq. (7): 1). mean_field_factor: lambda (pi / 8).
        normalize_input: LayerNorm before the random features. length_scale: RBF length scale.
        num_classes, embedding_dim: sizes for a plain backbone. seed: the random features and beta.

    ``forward(x) -> (N, C)`` log-probabilities (``log_softmax`` of the GP logits in train mode, of the
    mean-field logits in eval mode); ``embed(x) -> (N, D)`` the backbone's embedding (GP input);
    ``training_loss(x, y)`` CE on the GP logits; ``uncertainty(x) -> {"entropy", "variance"}``.
    After training call :meth:`fit_covariance`. Raises ``TypeError`` / ``ValueError`` naming the argument.
    """

    uncertainty_names = ("entropy", "variance")
    default_uncertainty = "entropy"
    classifier: RandomFeatureGP

    def __init__(
        self,
        backbone: nn.Module,
        num_features: int = 1024,
        *,
        spectral_norm: bool = True,
        spectral_bound: float = 0.95,
        power_iterations: int = 1,
        ridge: float = 1.0,
        mean_field_factor: float = math.pi / 8,
        normalize_input: bool = True,
        length_scale: float = 1.0,
        num_classes: Optional[int] = None,
        embedding_dim: Optional[int] = None,
        seed: int = 0,
    ):
        super().__init__()
        spec = resolve_backbone(backbone, num_classes=num_classes, embedding_dim=embedding_dim)
        if not isinstance(spectral_norm, bool):
            raise TypeError(f"spectral_norm: expected a bool, got {type(spectral_norm).__name__}")
        check_positive(spectral_bound, "spectral_bound")
        check_positive(power_iterations, "power_iterations", integer=True)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed: expected an int, got {type(seed).__name__}")
        self.backbone = spec.module
        self.embedding_dim = spec.embedding_dim
        self.num_classes = spec.num_classes
        self.spectral_norm = spectral_norm
        self.spectral_bound = spectral_bound
        if spectral_norm:
            exclude = [spec.classifier] if spec.classifier is not None else []
            with seeded(seed):
                spectral_normalize(spec.module, spectral_bound, power_iterations, exclude=exclude)
        self.classifier = RandomFeatureGP(
            spec.embedding_dim,
            spec.num_classes,
            num_features,
            ridge=ridge,
            mean_field_factor=mean_field_factor,
            normalize_input=normalize_input,
            length_scale=length_scale,
            seed=seed,
        )

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return backbone_embed(self.backbone, x)

    def training_loss(self, x, y) -> torch.Tensor:
        """Batch-mean CE of the GP logits ``phi(h)^T beta`` [Kirchhof, URL App. B.8]."""
        xt, yt = self._check_batch(x, y)
        return F.cross_entropy(self.classifier.logits(self.embed(xt)), yt)

    def reset_covariance(self) -> None:
        """Forget the accumulated training features (``Sigma`` back to ``I / ridge``)."""
        self.classifier.reset_covariance()

    def update_covariance(self, embeddings) -> None:
        """Add a batch of training embeddings ``(N, D)`` (``embed(x)``) to ``Phi^T Phi``.

        Raises ``TypeError`` / ``ValueError`` naming ``embeddings`` for a non-floating, non-finite or
        wrongly shaped tensor.
        """
        h = check_tensor(embeddings, "embeddings", ndim=2, floating=True, finite=True)
        if h.shape[1] != self.embedding_dim:
            raise ValueError(f"embeddings: expected {self.embedding_dim} features, got {h.shape[1]}")
        with torch.no_grad(), eval_mode(self):
            self.classifier.update_covariance(h)

    def fit_covariance(self, x_batches) -> "SNGP":
        """One pass over the training inputs: reset, then add every batch's ``Phi^T Phi``.

        ``x_batches``: an iterable of input tensors or of ``(x, y, ...)`` tuples (a ``DataLoader``);
        the backbone runs in eval mode without gradients. Raises ``ValueError`` naming ``x_batches``
        when it yields nothing.
        """
        self.reset_covariance()
        with torch.no_grad(), eval_mode(self):
            for batch in x_batches:
                x = batch[0] if isinstance(batch, (tuple, list)) else batch
                xt = self._check_input(x)
                self.classifier.update_covariance(self.embed(xt))
        if int(self.classifier.num_covariance_samples) == 0:
            raise ValueError("x_batches: yielded no samples")
        return self

    def posterior_covariance(self) -> torch.Tensor:
        """``Sigma = (ridge I + Phi^T Phi)^{-1}`` ``(M, M)``."""
        return self.classifier.posterior_covariance()

    def predictive_variance(self, x) -> torch.Tensor:
        """GP predictive variance ``phi(h(x))^T Sigma phi(h(x))`` ``(N,)``, in eval mode, no gradient."""
        xt = self._check_input(x)
        with torch.no_grad(), eval_mode(self):
            return self.classifier.predictive_variance(self.embed(xt))

    def _uncertainty(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(x)
        return {"entropy": _entropy(self.classifier(h)), "variance": self.classifier.predictive_variance(h)}
