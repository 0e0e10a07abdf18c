"""Deep ensembles: K classifiers whose class probabilities are averaged ([Kirchhof, URL App. B.10];
Lakshminarayanan et al. 2017).

Two forms:

- shared backbone (default, [Kirchhof, URL Sec. 4.1]: "Following (Lee et al., 2015), we only train
  multiple output heads and share the backbone"; App. B.10: "10 classifier heads attached to the
  embedding space"): ``embed(x)`` is the backbone's embedding, member ``k`` is the linear head
  ``W_k e + b_k``;
- ``independent=True``: K full copies of the backbone, each freshly initialised (``copy.deepcopy``
  and ``reset_parameters()`` on every submodule that has one, under seed ``seed + k``), each with its
  own head (Lakshminarayanan et al. 2017). ``embed(x)`` is then the concatenation of the members'
  embeddings ``(N, K * D)``, so that ``classifier(embed(x))`` still gives the pooled prediction.

The prediction is ``p_bar = mean_k softmax(z_k)`` [Kirchhof, URL App. B.10] ("Their logits are
transformed into probabilities by a softmax and then averaged"); ``forward`` returns ``log p_bar``.
Uncertainties: ``"entropy"`` ``H(p_bar)`` and ``"jsd"`` the Jensen-Shannon divergence between the
members ([Kirchhof, URL Sec. 4.1], "Deep Ensembles"); default ``"entropy"``.

Objective (``objective``): ``"mean"`` (default) the CE of the averaged probabilities,
``-log p_bar_y``, as [Kirchhof, URL App. B.10] writes ("This average is trained under a CE loss");
``"members"`` the sum over members of each member's CE, as Lakshminarayanan et al. 2017 train every
member on its own loss.
"""

from __future__ import annotations

import copy
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
    seeded,
)

__all__ = ["DeepEnsemble", "EnsembleHead"]

OBJECTIVES = ("members", "mean")


def _reset_all(module: nn.Module) -> None:
    for m in module.modules():
        reset = getattr(m, "reset_parameters", None)
        if callable(reset):
            reset()


class EnsembleHead(nn.Module):
    """K linear heads pooled in probability space: embeddings ``(N, D_in)`` -> ``log p_bar (N, C)``.

    With ``chunk=None`` every head reads the whole embedding (shared backbone); with ``chunk=D`` head
    ``k`` reads columns ``[k D, (k + 1) D)`` (the concatenated embeddings of independent members).
    """

    def __init__(self, heads: list[nn.Linear], chunk: Optional[int] = None):
        super().__init__()
        self.heads = nn.ModuleList(heads)
        self.chunk = chunk

    def member_log_probs(self, emb: torch.Tensor) -> torch.Tensor:
        """``(N, K, C)`` log-softmax of each member's logits."""
        outs = []
        for k, head in enumerate(self.heads):
            e = emb if self.chunk is None else emb[:, k * self.chunk : (k + 1) * self.chunk]
            outs.append(F.log_softmax(head(e), dim=-1))
        return torch.stack(outs, dim=1)

    def member_logits(self, emb: torch.Tensor) -> torch.Tensor:
        """``(N, K, C)`` logits of each member."""
        outs = []
        for k, head in enumerate(self.heads):
            e = emb if self.chunk is None else emb[:, k * self.chunk : (k + 1) * self.chunk]
            outs.append(head(e))
        return torch.stack(outs, dim=1)

    def forward(self, emb: torch.Tensor) -> torch.Tensor:
        return _log_mean_exp(self.member_log_probs(emb), dim=1)


class DeepEnsemble(UncertaintyEstimator):
    """Deep ensemble of ``num_members`` classifiers (module docstring).

    Args:
        backbone: a ``shiftguard.models.EmbeddingClassifier`` or any module mapping ``x`` to ``(N, D)``
            (then give ``embedding_dim`` / ``num_classes`` or set them as attributes). In the shared
            form an ``EmbeddingClassifier``'s own ``classifier`` is not used (its parameters get no
            gradient); with ``independent=True`` each copy's ``classifier`` is that member's head.
        num_members: K >= 1 (URL: 10).
        independent: K full backbone copies instead of K heads on one backbone.
        objective: ``"mean"`` (CE of the averaged probabilities, URL's; default) or ``"members"``
            (sum of the members' CE).
        num_classes, embedding_dim: sizes for a plain backbone.
        seed: initialisation seed of the heads (and of the member copies).

    ``forward(x) -> (N, C)`` ``log p_bar`` (same in train and eval mode); ``embed(x) -> (N, D)``
    (shared) or ``(N, K * D)`` (independent); ``member_log_probs(x) -> (N, K, C)``;
    ``training_loss(x, y) -> ()``; ``uncertainty(x) -> {"entropy", "jsd"}`` each ``(N,)``.
    Raises ``TypeError`` / ``ValueError`` naming the argument for bad arguments.
    """

    uncertainty_names = ("entropy", "jsd")
    default_uncertainty = "entropy"
    classifier: EnsembleHead

    def __init__(
        self,
        backbone: nn.Module,
        num_members: int = 10,
        *,
        independent: bool = False,
        objective: str = "mean",
        num_classes: Optional[int] = None,
        embedding_dim: Optional[int] = None,
        seed: int = 0,
    ):
        super().__init__()
        spec = resolve_backbone(backbone, num_classes=num_classes, embedding_dim=embedding_dim)
        check_positive(num_members, "num_members", integer=True)
        if not isinstance(independent, bool):
            raise TypeError(f"independent: expected a bool, got {type(independent).__name__}")
        if objective not in OBJECTIVES:
            raise ValueError(f"objective: expected one of {', '.join(OBJECTIVES)}, got {objective!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed: expected an int, got {type(seed).__name__}")
        self.num_members = num_members
        self.independent = independent
        self.objective = objective
        self.num_classes = spec.num_classes
        self.member_embedding_dim = spec.embedding_dim
        d, c = spec.embedding_dim, spec.num_classes
        heads: list[nn.Linear] = []
        if independent:
            members = []
            for k in range(num_members):
                with seeded(seed + k):
                    member = copy.deepcopy(spec.module)
                    _reset_all(member)
                    if spec.classifier is not None:
                        head = member.classifier
                        assert isinstance(head, nn.Linear)  # resolve_backbone checked the original
                    else:
                        head = nn.Linear(d, c)
                members.append(member)
                heads.append(head)
            self.members = nn.ModuleList(members)
            self.embedding_dim = num_members * d
            self.classifier = EnsembleHead(heads, chunk=d)
        else:
            self.backbone = spec.module
            with seeded(seed):
                heads = [nn.Linear(d, c) for _ in range(num_members)]
            self.embedding_dim = d
            self.classifier = EnsembleHead(heads, chunk=None)

    def extra_repr(self) -> str:
        return f"num_members={self.num_members}, independent={self.independent}, objective={self.objective!r}"

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, D)`` shared embedding, or ``(N, K * D)`` concatenated member embeddings."""
        if self.independent:
            return torch.cat([backbone_embed(m, x) for m in self.members], dim=1)
        return backbone_embed(self.backbone, x)

    def member_log_probs(self, x) -> torch.Tensor:
        """``(N, K, C)`` log-probabilities of every member (in the module's current mode)."""
        return self.classifier.member_log_probs(self.embed(self._check_input(x)))

    def training_loss(self, x, y) -> torch.Tensor:
        """``sum_k CE(z_k, y)`` (``objective="members"``) or ``-log p_bar_y`` (``"mean"``), batch mean."""
        xt, yt = self._check_batch(x, y)
        emb = self.embed(xt)
        if self.objective == "members":
            logits = self.classifier.member_logits(emb)
            return torch.stack([F.cross_entropy(logits[:, k], yt) for k in range(self.num_members)]).sum()
        return F.nll_loss(self.classifier(emb), yt)

    def _uncertainty(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        member = self.classifier.member_log_probs(self.embed(x))
        return {"entropy": _entropy(_log_mean_exp(member, dim=1)), "jsd": _jsd(member)}
