"""HET-XL: a heteroscedastic Gaussian in the embedding space and the Monte-Carlo expected softmax
([Kirchhof, URL App. B.7, eq. (6)]; Collier et al. 2023).

For an embedding ``e = phi(x)`` ``(D,)`` a linear layer on ``e`` outputs ``V(e)`` ``(D, R)`` and
``d(e) = softplus(.)`` ``(D,)``; the embedding noise is ``eps ~ N(0, Sigma(e))`` with
``Sigma = V V^T + diag(d)`` (low rank plus diagonal; [Kirchhof, URL App. B.7] writes ``V^T V`` with
``V`` stored ``(R, D)``; rank ``R = 1`` by default as there). Sampled as
``eps = V z + sqrt(d) * z'``, ``z ~ N(0, I_R)``, ``z' ~ N(0, I_D)``. The predictive distribution is
eq. (6):

    p_bar = E_eps[softmax_tau(W^T (e + eps))] ~= (1 / S) sum_s softmax((W e + b + W eps_s) / tau),

with a learnable temperature ``tau = softplus(t)`` (initialised at ``temperature``) and ``S``
noise samples; the loss is ``CE(p_bar, y) = -log p_bar_y``. The logits are split as
``(W e + b) + W eps_s``, so that zero covariance gives exactly the deterministic
``softmax((W e + b) / tau)``.

Noise: in train mode fresh ``torch.randn`` draws per sample and step (the global generator); in
eval mode ``S`` draws ``z (S, R)``, ``z' (S, D)`` from a generator seeded with ``seed``, shared by
the samples of the batch, so predictions are reproducible and independent of batching.

Uncertainties ([Kirchhof, URL Sec. 4.1], "HET-XL": ``det Sigma(x)`` or the class entropy):
``"log_det_cov"`` ``log det Sigma(e)`` (the log keeps it finite; computed exactly with the matrix
determinant lemma ``log det(diag(d) + V V^T) = sum log d + log det(I_R + V^T diag(1/d) V)``, where
the URL code sums the logs of the diagonal of ``Sigma`` only) -- the default -- and ``"entropy"``
``H(p_bar)``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from shiftguard._validation import check_positive
from shiftguard.uncertainty.estimator import (
    UncertaintyEstimator,
    _entropy,
    _log_mean_exp,
    backbone_embed,
    resolve_backbone,
    seeded,
)

__all__ = ["HETXL", "HETXLHead"]


class HETXLHead(nn.Module):
    """Heteroscedastic output layer: embeddings ``(N, D)`` -> MC log-probabilities ``log p_bar (N, C)``.

    Args:
        linear: the classifier ``W, b`` (``nn.Linear(D, C)``).
        rank: R, columns of ``V``. num_samples: S. temperature: initial ``tau`` (> 0).
        seed: seed of the eval-mode noise (and of the covariance layer's initialisation).

    ``covariance`` is the ``nn.Linear(D, D * R + D)`` producing ``V`` and the pre-softplus ``d``.
    """

    def __init__(
        self, linear: nn.Linear, rank: int = 1, num_samples: int = 16, temperature: float = 1.0, seed: int = 0
    ):
        super().__init__()
        d = linear.in_features
        self.linear = linear
        self.rank = rank
        self.num_samples = num_samples
        self.seed = seed
        with seeded(seed):
            self.covariance = nn.Linear(d, d * rank + d)
        # softplus^{-1}(t) = log(expm1(t)) = t + log(-expm1(-t)), the second form free of overflow
        self.raw_temperature = nn.Parameter(torch.tensor(temperature + math.log(-math.expm1(-temperature))))

    def extra_repr(self) -> str:
        return f"rank={self.rank}, num_samples={self.num_samples}, seed={self.seed}"

    @property
    def temperature(self) -> torch.Tensor:
        """``tau = softplus(raw_temperature)``."""
        return F.softplus(self.raw_temperature)

    def covariance_factors(self, emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``V (N, D, R)`` and ``d (N, D)`` with ``Sigma = V V^T + diag(d)``."""
        n, dim = emb.shape
        out = self.covariance(emb)
        v = out[:, : dim * self.rank].reshape(n, dim, self.rank)
        return v, F.softplus(out[:, dim * self.rank :])

    def noise(self, emb: torch.Tensor) -> torch.Tensor:
        """Samples ``eps (N, S, D)`` of ``N(0, Sigma(e))`` (train: fresh; eval: from ``seed``)."""
        v, d = self.covariance_factors(emb)
        n, dim = d.shape
        if self.training:
            z = torch.randn(n, self.num_samples, self.rank, dtype=emb.dtype, device=emb.device)
            z_diag = torch.randn(n, self.num_samples, dim, dtype=emb.dtype, device=emb.device)
        else:
            gen = torch.Generator().manual_seed(self.seed)
            z = torch.randn(self.num_samples, self.rank, generator=gen, dtype=torch.float64)
            z_diag = torch.randn(self.num_samples, dim, generator=gen, dtype=torch.float64)
            z = z.to(emb.device, emb.dtype).expand(n, -1, -1)
            z_diag = z_diag.to(emb.device, emb.dtype).expand(n, -1, -1)
        return torch.einsum("ndr,nsr->nsd", v, z) + d.sqrt().unsqueeze(1) * z_diag

    def sample_log_probs(self, emb: torch.Tensor) -> torch.Tensor:
        """``(N, S, C)`` ``log softmax((W e + b + W eps_s) / tau)``."""
        base = self.linear(emb)
        noisy = base.unsqueeze(1) + self.noise(emb) @ self.linear.weight.t()
        return F.log_softmax(noisy / self.temperature, dim=-1)

    def log_det_covariance(self, emb: torch.Tensor) -> torch.Tensor:
        """``log det Sigma(e)`` ``(N,)`` (matrix determinant lemma; ``-inf`` for a singular ``Sigma``)."""
        v, d = self.covariance_factors(emb)
        out = torch.empty(d.shape[0], dtype=d.dtype, device=d.device)
        pos = (d > 0).all(dim=1)
        if bool(pos.any()):
            vp, dp = v[pos], d[pos]
            inner = torch.eye(self.rank, dtype=d.dtype, device=d.device) + vp.transpose(1, 2) @ (vp / dp.unsqueeze(2))
            chol = torch.linalg.cholesky(inner)
            out[pos] = dp.log().sum(dim=1) + 2 * chol.diagonal(dim1=1, dim2=2).log().sum(dim=1)
        if not bool(pos.all()):
            # d underflowed to 0 somewhere: the lemma divides by d, so take the full D x D determinant.
            vz, dz = v[~pos], d[~pos]
            full = vz @ vz.transpose(1, 2) + torch.diag_embed(dz)
            out[~pos] = torch.linalg.slogdet(full).logabsdet
        return out

    def forward(self, emb: torch.Tensor) -> torch.Tensor:
        return _log_mean_exp(self.sample_log_probs(emb), dim=1)


class HETXL(UncertaintyEstimator):
    """Heteroscedastic classifier on a backbone's embedding (module docstring).

    Args:
        backbone: a ``shiftguard.models.EmbeddingClassifier`` (its ``classifier`` is ``W, b``) or any
            module mapping ``x`` to ``(N, D)`` (a new ``nn.Linear`` is created, seeded; give
            ``embedding_dim`` / ``num_classes`` or set them as attributes).
        rank: R >= 1 (URL: 1). num_samples: S >= 1 MC samples. temperature: initial tau > 0.
        num_classes, embedding_dim: sizes for a plain backbone. seed: eval noise and initialisation.

    ``forward(x) -> (N, C)`` ``log p_bar`` (train-mode noise in train mode); ``embed(x) -> (N, D)`` the
    mean embedding ``phi(x)``; ``training_loss(x, y)`` ``-log p_bar_y`` batch mean;
    ``uncertainty(x) -> {"log_det_cov", "entropy"}``. Raises ``TypeError`` / ``ValueError`` naming
    the argument.
    """

    uncertainty_names = ("log_det_cov", "entropy")
    default_uncertainty = "log_det_cov"
    classifier: HETXLHead

    def __init__(
        self,
        backbone: nn.Module,
        rank: int = 1,
        num_samples: int = 16,
        temperature: float = 1.0,
        *,
        num_classes: Optional[int] = None,
        embedding_dim: Optional[int] = None,
        seed: int = 0,
    ):
        super().__init__()
        spec = resolve_backbone(backbone, num_classes=num_classes, embedding_dim=embedding_dim)
        check_positive(rank, "rank", integer=True)
        check_positive(num_samples, "num_samples", integer=True)
        check_positive(temperature, "temperature")
        linear = self._adopt_backbone(spec, seed)
        self.classifier = HETXLHead(linear, rank, num_samples, float(temperature), seed)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return backbone_embed(self.backbone, x)

    def training_loss(self, x, y) -> torch.Tensor:
        """``CE(p_bar, y) = -log p_bar_y``, batch mean [Kirchhof, URL App. B.7, eq. (6)]."""
        xt, yt = self._check_batch(x, y)
        return F.nll_loss(self.classifier(self.embed(xt)), yt)

    def log_det_covariance(self, x) -> torch.Tensor:
        """``log det Sigma(phi(x))`` ``(N,)`` in the module's current mode."""
        return self.classifier.log_det_covariance(self.embed(self._check_input(x)))

    def _uncertainty(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        emb = self.embed(x)
        return {"log_det_cov": self.classifier.log_det_covariance(emb), "entropy": _entropy(self.classifier(emb))}
