"""MC dropout: dropout kept on at inference, T sampled predictions averaged ([Kirchhof, URL App. B.11];
Gal & Ghahramani 2016).

Dropout acts on the embedding, in front of the linear classifier (the placement of timm's
``drop_rate``, "dropout probability before classifier"): training draws one mask per sample
(``torch.nn.functional.dropout``, inverted scaling ``1 / (1 - rate)``); inference draws ``num_samples``
masks ``m_t`` and pools ``p_bar = mean_t softmax(W (m_t * e) + b)`` [Kirchhof, URL App. B.11]
("keeps the dropout activated to sample 10 logits and averages them like Ensemble"). The URL
implementation also drops inside the residual blocks; here dropout layers inside the backbone are
left to the backbone and follow its train / eval mode.

Reproducible inference: every eval-mode call draws its T masks ``(T, D)`` from a generator seeded
with ``seed``, shared by all samples of the batch, so a sample's prediction depends only on the
sample and the seed (not on the batch it is in); two seeds give two different sets of masks.
Uncertainties: ``"entropy"`` ``H(p_bar)`` and ``"jsd"`` the Jensen-Shannon divergence between the
T samples ([Kirchhof, URL Sec. 4.1], "MCDropout"); default ``"entropy"``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from shiftguard._validation import check_positive
from shiftguard.uncertainty.estimator import (
    UncertaintyEstimator,
    _entropy,
    _jsd,
    _log_mean_exp,
    backbone_embed,
    resolve_backbone,
)

__all__ = ["MCDropout", "MCDropoutHead"]


def _check_rate(rate) -> float:
    if isinstance(rate, bool) or not isinstance(rate, (int, float)):
        raise TypeError(f"rate: expected a number, got {type(rate).__name__}")
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"rate: expected a dropout rate in [0, 1), got {rate}")
    return float(rate)


class MCDropoutHead(nn.Module):
    """Dropout on the embedding, then ``linear``; embeddings ``(N, D)`` -> log-probabilities ``(N, C)``.

    Train mode: one dropout sample, ``log_softmax(linear(dropout(e)))``. Eval mode: the log of the mean
    of ``num_samples`` softmax predictions under masks drawn from ``seed`` (module docstring).
    """

    def __init__(self, linear: nn.Linear, rate: float, num_samples: int, seed: int):
        super().__init__()
        self.linear = linear
        self.rate = rate
        self.num_samples = num_samples
        self.seed = seed

    def extra_repr(self) -> str:
        return f"rate={self.rate}, num_samples={self.num_samples}, seed={self.seed}"

    def masks(self, dim: int, device, dtype) -> torch.Tensor:
        """The ``(T, dim)`` inverted-dropout masks (entries 0 or ``1 / (1 - rate)``) of ``seed``."""
        gen = torch.Generator().manual_seed(self.seed)
        keep = torch.full((self.num_samples, dim), 1.0 - self.rate, dtype=torch.float64)
        m = torch.bernoulli(keep, generator=gen) / (1.0 - self.rate)
        return m.to(device=device, dtype=dtype)

    def sample_log_probs(self, emb: torch.Tensor) -> torch.Tensor:
        """``(N, T, C)`` log-probabilities under the T masks of ``seed``."""
        masks = self.masks(emb.shape[1], emb.device, emb.dtype)
        return torch.stack([F.log_softmax(self.linear(emb * m), dim=-1) for m in masks], dim=1)

    def forward(self, emb: torch.Tensor) -> torch.Tensor:
        if self.training:
            return F.log_softmax(self.linear(F.dropout(emb, self.rate, training=True)), dim=-1)
        return _log_mean_exp(self.sample_log_probs(emb), dim=1)


class MCDropout(UncertaintyEstimator):
    """Monte-Carlo dropout on a backbone's embedding (module docstring).

    Args:
        backbone: a ``shiftguard.models.EmbeddingClassifier`` (its ``classifier`` is the linear layer
            behind the dropout) or any module mapping ``x`` to ``(N, D)`` (a new ``nn.Linear`` is
            created, seeded; give ``embedding_dim`` / ``num_classes`` or set them as attributes).
        rate: dropout rate in [0, 1) (URL searches [0.05, 0.25]); 0 gives the deterministic model.
        num_samples: T >= 1 masks at inference (URL: 10).
        num_classes, embedding_dim: sizes for a plain backbone.
        seed: seed of the inference masks (and of a newly created classifier).

    ``forward(x) -> (N, C)`` log-probabilities (one dropout sample in train mode, the T-sample mean in
    eval mode); ``embed(x) -> (N, D)`` the backbone's embedding (before dropout);
    ``sample_log_probs(x) -> (N, T, C)``; ``training_loss(x, y)`` the CE with dropout on;
    ``uncertainty(x) -> {"entropy", "jsd"}``. Raises ``TypeError`` / ``ValueError`` naming the argument.
    """

    uncertainty_names = ("entropy", "jsd")
    default_uncertainty = "entropy"
    classifier: MCDropoutHead

    def __init__(
        self,
        backbone: nn.Module,
        rate: float = 0.1,
        num_samples: int = 10,
        *,
        num_classes: Optional[int] = None,
        embedding_dim: Optional[int] = None,
        seed: int = 0,
    ):
        super().__init__()
        spec = resolve_backbone(backbone, num_classes=num_classes, embedding_dim=embedding_dim)
        rate = _check_rate(rate)
        check_positive(num_samples, "num_samples", integer=True)
        linear = self._adopt_backbone(spec, seed)
        self.classifier = MCDropoutHead(linear, rate, num_samples, seed)

    @property
    def rate(self) -> float:
        return self.classifier.rate

    @property
    def num_samples(self) -> int:
        return self.classifier.num_samples

    @property
    def seed(self) -> int:
        return self.classifier.seed

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return backbone_embed(self.backbone, x)

    def sample_log_probs(self, x) -> torch.Tensor:
        """``(N, T, C)`` log-probabilities of the T inference masks (the backbone in its current mode)."""
        return self.classifier.sample_log_probs(self.embed(self._check_input(x)))

    def training_loss(self, x, y) -> torch.Tensor:
        """Batch-mean CE of one dropout sample, ``CE(W dropout(e) + b, y)``, dropout on in any mode."""
        xt, yt = self._check_batch(x, y)
        emb = F.dropout(self.embed(xt), self.rate, training=True)
        return F.cross_entropy(self.classifier.linear(emb), yt)

    def _uncertainty(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        samples = self.classifier.sample_log_probs(self.embed(x))
        return {"entropy": _entropy(_log_mean_exp(samples, dim=1)), "jsd": _jsd(samples)}
