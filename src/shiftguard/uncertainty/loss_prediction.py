"""Loss-prediction uncertainty head on cached embeddings ([Kirchhof, Ch. 5], "pretrained uncertainties";
URL benchmark App. B.9 "Losspred").

[Kirchhof, Ch. 5, Sec. 3.3]: an MLP ``u(e(x))`` on stop-gradient embeddings (1. StopGrad; 3. "cache
everything": the backbone and classifier are frozen, so only ``e(x)`` and the detached task loss
are needed) trained with the ranking objective of Yoo & Kweon (2019) (4. scale-free, eqs. (3)-(4)):
for a pair (x1, x2) the sample with the larger task loss must get an uncertainty larger by a margin
``m = 0.1``: ``L = max(0, m - s (u1 - u2))`` with ``s = +1`` if ``loss1 > loss2`` else ``-1``.
(Eq. (3) of the thesis is typeset as ``max(0, 1_L (u1 - u2 + m))``; its text and Yoo & Kweon fix the
sign used here: the higher-loss sample must be the more uncertain one.) Pairs are formed as in Yoo &
Kweon: each shuffled mini-batch is split into halves and paired element-wise. Architecture:
2 hidden layers of width 512 with ReLU ([Kirchhof, Ch. 5, App. C] "By default it has 2 hidden layers of
width 512"), AdamW (their default optimiser) with a cosine schedule.

:class:`LossPredictionL2` is the URL benchmark's joint variant [Kirchhof, URL App. B.9, eq. (8)]: a
loss predictor ``kappa(e)`` on the backbone's embedding trained together with the classifier under
``L = CE(x, y) + lambda (kappa(x) - CE_detached(x, y))^2``; the CE target of the L2 term is detached
("to prevent fitting it to kappa(x), instead of the other way around"). ``kappa`` is the URL code's
uncertainty network: 3 hidden layers of width 512 with LeakyReLU and a softplus output (a
non-negative prediction of a non-negative loss).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from shiftguard._deprecation import warn_deprecated
from shiftguard._validation import check_labels, check_positive, check_same_length, check_tensor
from shiftguard.uncertainty.estimator import UncertaintyEstimator, _entropy, backbone_embed, resolve_backbone, seeded

__all__ = ["LossPredictionHead", "loss_ranking_loss", "LossPredictionL2", "loss_prediction_l2_loss"]


def loss_ranking_loss(
    u1: torch.Tensor, u2: torch.Tensor, loss1: torch.Tensor, loss2: torch.Tensor, margin: float = 0.1
) -> torch.Tensor:
    """Mean pairwise ranking loss of [Kirchhof, Ch. 5, eqs. (3)-(4)] (Yoo & Kweon 2019), see module doc."""
    sign = torch.where(loss1 > loss2, 1.0, -1.0).to(u1.dtype)
    return torch.clamp(margin - sign * (u1 - u2), min=0).mean()


class LossPredictionHead(nn.Module):
    """MLP predicting a per-sample uncertainty that ranks like the per-sample task loss.

    Args:
        in_features: embedding size.
        hidden: hidden widths (default ``(512, 512)``).
        margin: ranking margin m (default 0.1, [Kirchhof, Ch. 5]).
        epochs, batch_size, lr, weight_decay: AdamW training on cached embeddings.
        seed: seed for initialisation and batch order.

    ``fit(embeddings, task_loss)`` trains on detached inputs; ``predict_uncertainty(embeddings)``
    returns ``(N,)`` uncertainties (higher = larger expected loss), also available as ``forward``.
    They rank like the task loss but are not in its units (the ranking objective is scale-free), so
    they are no loss estimate. ``predict`` is a deprecated alias of ``predict_uncertainty``.
    """

    def __init__(
        self,
        in_features: int,
        hidden: tuple[int, ...] = (512, 512),
        margin: float = 0.1,
        epochs: int = 20,
        batch_size: int = 256,
        lr: float = 1e-3,
        weight_decay: float = 1e-2,
        seed: int = 0,
    ):
        super().__init__()
        check_positive(in_features, "in_features", integer=True)
        check_positive(margin, "margin")
        check_positive(epochs, "epochs", integer=True)
        check_positive(batch_size, "batch_size", integer=True)
        if batch_size < 2:
            raise ValueError("batch_size: pairs need batches of at least 2 samples")
        self.in_features = in_features
        self.hidden = tuple(hidden)
        self.margin = margin
        self.epochs = epochs
        self.batch_size = batch_size
        self.lr = lr
        self.weight_decay = weight_decay
        self.seed = seed
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        width = in_features
        for h in self.hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)
        torch.random.set_rng_state(gen_state)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, hidden={self.hidden}, margin={self.margin}"

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        return self.mlp(embeddings).squeeze(-1)

    def _check(self, embeddings, name="embeddings") -> torch.Tensor:
        emb = check_tensor(embeddings, name, ndim=2, floating=True, finite=True)
        if emb.shape[1] != self.in_features:
            raise ValueError(f"{name}: expected {self.in_features} features, got {emb.shape[1]}")
        return emb

    def fit(self, embeddings, task_loss) -> "LossPredictionHead":
        """Train on cached ``embeddings (N, D)`` and detached per-sample ``task_loss (N,)``."""
        emb = self._check(embeddings).detach()
        target = check_tensor(task_loss, "task_loss", ndim=1, floating=True, finite=True).detach()
        n = check_same_length([("embeddings", emb), ("task_loss", target)])
        if n < 2:
            raise ValueError("embeddings: need at least 2 samples to form pairs")
        target = target.to(emb.device)
        self.to(emb.device, emb.dtype)
        gen = torch.Generator().manual_seed(self.seed)
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        steps_per_epoch = max(1, n // self.batch_size)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.epochs * steps_per_epoch)
        bs = min(self.batch_size, n) // 2 * 2
        self.train()
        history = []
        for _ in range(self.epochs):
            perm = torch.randperm(n, generator=gen).to(emb.device)
            total = 0.0
            for s in range(steps_per_epoch):
                idx = perm[s * bs : (s + 1) * bs]
                if idx.numel() < 2:
                    continue
                half = idx.numel() // 2
                i1, i2 = idx[:half], idx[half : 2 * half]
                u = self(emb[torch.cat([i1, i2])])
                loss = loss_ranking_loss(u[:half], u[half:], target[i1], target[i2], self.margin)
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                total += float(loss.detach())
            history.append(total / steps_per_epoch)
        self.eval()
        self.history_ = history
        return self

    @torch.no_grad()
    def predict_uncertainty(self, embeddings) -> torch.Tensor:
        """Uncertainty ``(N,)``; higher = the model expects a larger task loss (a ranking score, not
        a loss value)."""
        emb = self._check(embeddings)
        p = next(self.parameters())
        return self(emb.to(p.device, p.dtype)).to(emb.dtype)

    def predict(self, embeddings) -> torch.Tensor:
        """Deprecated alias of :meth:`predict_uncertainty`."""
        warn_deprecated("LossPredictionHead.predict", "LossPredictionHead.predict_uncertainty")
        return self.predict_uncertainty(embeddings)


def loss_prediction_l2_loss(logits, y, predicted_loss, loss_weight: float = 0.5) -> torch.Tensor:
    """Eq. (8) of [Kirchhof, URL App. B.9], batch mean: ``mean(CE) + loss_weight * mean((u - CE.detach())^2)``.

    Args:
        logits: ``(N, C)`` floating. y: ``(N,)`` integer labels in ``[0, C)``.
        predicted_loss: ``(N,)`` the loss predictor's output ``u = kappa(x)``.
        loss_weight: lambda >= 0 ([0.01, 0.99] in the URL search).

    Gradients of the L2 term reach ``predicted_loss`` only, never the CE target. Raises ``TypeError`` /
    ``ValueError`` naming the argument for wrong dtypes, shapes, lengths or labels.
    """
    z = check_tensor(logits, "logits", ndim=2, floating=True)
    u = check_tensor(predicted_loss, "predicted_loss", ndim=1, floating=True)
    yt = check_labels(y, "y", num_classes=z.shape[1])
    check_same_length([("logits", z), ("y", yt), ("predicted_loss", u)])
    check_positive(loss_weight, "loss_weight", strict=False)
    ce = F.cross_entropy(z, yt.to(z.device), reduction="none")
    return ce.mean() + loss_weight * ((u - ce.detach()) ** 2).mean()


class LossPredictionL2(UncertaintyEstimator):
    """Classifier + loss predictor trained jointly under eq. (8) [Kirchhof, URL App. B.9] (module docstring).

    Args:
        backbone: a ``shiftguard.models.EmbeddingClassifier`` (its ``classifier`` gives the logits) or any
            module mapping ``x`` to ``(N, D)`` (a new ``nn.Linear`` is created, seeded; give
            ``embedding_dim`` / ``num_classes`` or set them as attributes).
        loss_weight: lambda of eq. (8), >= 0.
        hidden: hidden widths of ``kappa`` (default ``(512, 512, 512)``).
        detach_embedding: feed ``kappa`` a stop-gradient embedding, so the L2 term trains ``kappa``
            only ([Kirchhof, Ch. 5, Sec. 3.3], "StopGrad"); default ``False`` as in eq. (8).
        num_classes, embedding_dim: sizes for a plain backbone. seed: initialisation of new layers.

    ``forward(x) -> (N, C)`` ``log_softmax`` of the logits; ``embed(x) -> (N, D)``;
    ``predicted_loss(x) -> (N,)``; ``training_loss(x, y)`` eq. (8);
    ``uncertainty(x) -> {"predicted_loss", "entropy"}`` (default ``"predicted_loss"``).
    """

    uncertainty_names = ("predicted_loss", "entropy")
    default_uncertainty = "predicted_loss"

    def __init__(
        self,
        backbone: nn.Module,
        loss_weight: float = 0.5,
        hidden: tuple[int, ...] = (512, 512, 512),
        *,
        detach_embedding: bool = False,
        num_classes: Optional[int] = None,
        embedding_dim: Optional[int] = None,
        seed: int = 0,
    ):
        super().__init__()
        spec = resolve_backbone(backbone, num_classes=num_classes, embedding_dim=embedding_dim)
        check_positive(loss_weight, "loss_weight", strict=False)
        widths = tuple(hidden)
        for h in widths:
            check_positive(h, "hidden", integer=True)
        if not isinstance(detach_embedding, bool):
            raise TypeError(f"detach_embedding: expected a bool, got {type(detach_embedding).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed: expected an int, got {type(seed).__name__}")
        self.backbone = spec.module
        self.embedding_dim = spec.embedding_dim
        self.num_classes = spec.num_classes
        self.loss_weight = float(loss_weight)
        self.detach_embedding = detach_embedding
        with seeded(seed):
            linear = spec.classifier if spec.classifier is not None else nn.Linear(spec.embedding_dim, spec.num_classes)
            layers: list[nn.Module] = []
            width = spec.embedding_dim
            for h in widths:
                layers += [nn.Linear(width, h), nn.LeakyReLU()]
                width = h
            layers += [nn.Linear(width, 1), nn.Softplus()]
            self.loss_predictor = nn.Sequential(*layers)
        self.linear = linear
        self.classifier = nn.Sequential(linear, nn.LogSoftmax(dim=1))

    def extra_repr(self) -> str:
        return f"loss_weight={self.loss_weight}, detach_embedding={self.detach_embedding}"

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return backbone_embed(self.backbone, x)

    def _kappa(self, emb: torch.Tensor) -> torch.Tensor:
        return self.loss_predictor(emb.detach() if self.detach_embedding else emb).squeeze(1)

    def predicted_loss(self, x) -> torch.Tensor:
        """``kappa(e(x))`` ``(N,)``, the predicted CE (in the module's current mode)."""
        return self._kappa(self.embed(self._check_input(x)))

    def training_loss(self, x, y) -> torch.Tensor:
        """Eq. (8): ``mean CE + loss_weight * mean((kappa - CE.detach())^2)``."""
        xt, yt = self._check_batch(x, y)
        emb = self.embed(xt)
        return loss_prediction_l2_loss(self.linear(emb), yt, self._kappa(emb), self.loss_weight)

    def _uncertainty(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        emb = self.embed(x)
        return {"predicted_loss": self._kappa(emb), "entropy": _entropy(self.classifier(emb))}
