"""The methods of the transfer benchmark (``shiftguard transfer``, [Kirchhof, URL Sec. 4.1]): each a
declarative :class:`Method` built from the loss and estimator registries and trained by
:class:`~shiftguard.train.Trainer`.

Every method is a LeNet-5 (width 1, an 84-dimensional embedding; ReLU, or QACT with
``activation="qact"``) with one ``objective``, which says how it trains and what it reports:

=================  ===============================================  ============================
objective          training step (``Trainer``)                      uncertainties (higher = more)
=================  ===============================================  ============================
``cross_entropy``  cross-entropy on the backbone's logits           ``entropy`` of the classes
``embedding``      ``loss(embed(x), y)``                            ``embedding_norm``: ``-||e||``
``two_views``      ``loss(embed(views), instance ids)``, two        ``embedding_norm``
                   augmented views of each image (InfoNCE's setup)
``estimator``      the estimator's ``training_loss(x, y)``          every one of the estimator's
``prototypes``     ``loss(embed(x), y)``; the classifier is         ``entropy`` of the posterior
                   ``loss.logits`` (SPCE, tightness, ESupCon)
=================  ===============================================  ============================

``registry_name`` and ``kwargs`` name the loss (``shiftguard.losses.build_loss``, given
``num_classes`` and ``embedding_dim``) or the estimator (``shiftguard.uncertainty.build_estimator``,
given ``seed``). ``loss_generator``: the loss draws samples (vMF draws, watershed seeds) from a
generator of its own, seeded with ``seed + 7919``, apart from initialisation. ``fit_after_training``:
one pass over the training images in eval mode after the last step -- the estimator's
``fit_covariance`` (SNGP) or the loss's ``fit`` on the training embeddings (SPCE's class weights).

The models see float pixels in [0, 1] (the images of ``shiftguard.data.class_split``), not the
[-1, 1] of :func:`~shiftguard.train.to_model_input`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union, cast

import torch
import torch.nn.functional as F
from torch import nn

from shiftguard._validation import check_positive
from shiftguard.losses import LOSS_REGISTRY, build_loss
from shiftguard.models import EmbeddingClassifier, build_model
from shiftguard.uncertainty import ESTIMATOR_REGISTRY, UncertaintyEstimator, build_estimator, entropy_from_log_probs

from .trainer import Trainer

__all__ = ["OBJECTIVES", "METHODS", "Method", "TransferModel", "build_method", "train_model"]

#: How a method trains and what it reports (module docstring).
OBJECTIVES = ("cross_entropy", "embedding", "two_views", "estimator", "prototypes")

#: Offset of a loss's own generator seed from the run seed.
_LOSS_SEED_OFFSET = 7919


def _unit_pixels(images: torch.Tensor) -> torch.Tensor:
    """The input of the benchmark's models: float pixels in [0, 1] (uint8 divided by 255)."""
    return images.float() / 255.0 if images.dtype == torch.uint8 else images.float()


class TransferModel(nn.Module):
    """A built method: the ``network`` (a LeNet ``EmbeddingClassifier``, or the uncertainty estimator
    wrapping it) and, for loss objectives, the ``loss`` module that trains it (and, for
    ``prototypes``, classifies). ``default_uncertainty`` names the uncertainty the URL paper reports
    for the method."""

    def __init__(
        self,
        network: nn.Module,
        objective: str,
        num_classes: int,
        loss: Optional[nn.Module] = None,
        fit_after_training: bool = False,
    ):
        super().__init__()
        if objective not in OBJECTIVES:
            raise ValueError(f"objective: expected one of {', '.join(OBJECTIVES)}, got {objective!r}")
        self.network = network
        self.loss = loss
        self.objective = objective
        self.num_classes = num_classes
        self.fit_after_training = bool(fit_after_training)
        if objective == "estimator":
            self.default_uncertainty = str(cast(UncertaintyEstimator, network).default_uncertainty)
        elif objective in ("embedding", "two_views"):
            self.default_uncertainty = "embedding_norm"
        else:
            self.default_uncertainty = "entropy"

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return cast(Any, self.network).embed(x)

    def outputs(self, x: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor], dict[str, torch.Tensor]]:
        """``(embeddings (N, D), log-probabilities (N, K) or None, {uncertainty name: (N,)})`` of the
        model input ``x`` in the model's current mode."""
        e = self.embed(x)
        if self.objective == "estimator":
            est = cast(UncertaintyEstimator, self.network)
            return e, est(x), dict(est.uncertainty(x))
        if self.objective in ("embedding", "two_views"):
            return e, None, {"embedding_norm": -e.norm(dim=1)}
        head = cast(Any, self.loss).logits if self.objective == "prototypes" else cast(Any, self.network).classifier
        lp = F.log_softmax(head(e), dim=1)
        return e, lp, {"entropy": entropy_from_log_probs(lp)}

    def predict(
        self, images: torch.Tensor, chunk: int = 1000
    ) -> tuple[torch.Tensor, Optional[torch.Tensor], dict[str, torch.Tensor]]:
        """:meth:`outputs` of ``images`` (pixels, float in [0, 1] or uint8) in eval mode without gradients,
        ``chunk`` images at a time: embeddings and log-probabilities float32, uncertainties float64."""
        embs: list[torch.Tensor] = []
        lps: list[torch.Tensor] = []
        uncs: list[dict[str, torch.Tensor]] = []
        self.eval()
        with torch.no_grad():
            for i in range(0, images.shape[0], chunk):
                e, lp, u = self.outputs(_unit_pixels(images[i : i + chunk]))
                embs.append(e.float())
                if lp is not None:
                    lps.append(lp.float())
                uncs.append({k: v.double() for k, v in u.items()})
        return torch.cat(embs), torch.cat(lps) if lps else None, {k: torch.cat([u[k] for u in uncs]) for k in uncs[0]}

    def finish_training(self, images: torch.Tensor, labels: torch.Tensor, batch_size: int) -> None:
        """With ``fit_after_training``, the pass after the last step in eval mode, ``batch_size``
        images at a time: the estimator's ``fit_covariance`` or the loss's ``fit(embeddings, labels)``."""
        if not self.fit_after_training:
            return
        self.eval()
        batches = (_unit_pixels(images[i : i + batch_size]) for i in range(0, images.shape[0], batch_size))
        if self.objective == "estimator":
            cast(Any, self.network).fit_covariance(batches)
            return
        with torch.no_grad():
            emb = torch.cat([self.embed(x) for x in batches])
        cast(Any, self.loss).fit(emb, labels)


@dataclass(frozen=True)
class Method:
    """One row of the benchmark (module docstring): ``registry_name`` and ``kwargs`` name the loss or
    the estimator; ``cross_entropy`` needs neither. :meth:`build` makes the model."""

    name: str
    summary: str
    objective: str
    registry_name: Optional[str] = None
    kwargs: Mapping[str, Any] = field(default_factory=dict, hash=False)
    activation: str = "relu"
    loss_generator: bool = False
    fit_after_training: bool = False

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective: expected one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if self.objective == "cross_entropy":
            if self.registry_name is not None or self.kwargs or self.loss_generator or self.fit_after_training:
                raise ValueError(
                    f"{self.name}: the cross_entropy objective takes no registry_name, kwargs, loss_generator "
                    "or fit_after_training"
                )
            return
        if self.registry_name is None:
            raise ValueError(f"registry_name: the {self.objective} objective needs a loss or estimator name")
        if self.objective == "estimator":
            ESTIMATOR_REGISTRY.get(self.registry_name)  # an unknown name raises, naming the close ones
            if self.loss_generator:
                raise ValueError(f"{self.name}: loss_generator is for losses; estimators are given seed")
        else:
            LOSS_REGISTRY.get(self.registry_name)

    def build(self, num_classes: int, in_channels: int, seed: int) -> TransferModel:
        """The untrained model: LeNet-5 for ``num_classes`` classes on ``in_channels``-channel images,
        initialised from the global random state, and its loss or estimator (``seed`` as in the module
        docstring)."""
        check_positive(num_classes, "num_classes", integer=True)
        check_positive(in_channels, "in_channels", integer=True)
        # the registry's "lenet" is LeNet5, an EmbeddingClassifier (build_model is typed for user factories too)
        backbone = cast(
            EmbeddingClassifier,
            build_model("lenet", activation=self.activation, num_classes=num_classes, in_channels=in_channels, width=1),
        )
        if self.objective == "cross_entropy":
            return TransferModel(backbone, self.objective, num_classes)
        assert self.registry_name is not None  # __post_init__
        kwargs = dict(self.kwargs)
        if self.objective == "estimator":
            estimator = build_estimator(self.registry_name, backbone, seed=seed, **kwargs)
            return TransferModel(estimator, self.objective, num_classes, fit_after_training=self.fit_after_training)
        if self.loss_generator:
            kwargs["generator"] = torch.Generator().manual_seed(seed + _LOSS_SEED_OFFSET)
        loss = build_loss(self.registry_name, num_classes=num_classes, embedding_dim=backbone.embedding_dim, **kwargs)
        return TransferModel(
            backbone, self.objective, num_classes, loss=loss, fit_after_training=self.fit_after_training
        )


def build_method(name: Union[str, Method], num_classes: int, in_channels: int, seed: int) -> TransferModel:
    """:meth:`Method.build` of ``name`` (a key of :data:`METHODS` or a :class:`Method`); raises
    ``ValueError`` for an unknown name."""
    if isinstance(name, Method):
        return name.build(num_classes, in_channels, seed)
    if name not in METHODS:
        raise ValueError(f"method: unknown method {name!r}; expected one of {', '.join(METHODS)}")
    return METHODS[name].build(num_classes, in_channels, seed)


def train_model(
    model: TransferModel,
    x: torch.Tensor,
    y: torch.Tensor,
    epochs: int,
    batch_size: int = 128,
    lr: float = 1e-3,
    seed: int = 0,
) -> TransferModel:
    """Train ``model`` on images ``x`` (pixels, float in [0, 1] or uint8) and labels ``y`` with
    :class:`~shiftguard.train.Trainer`: Adam (learning rate ``lr``) for exactly ``epochs`` epochs of
    shuffled mini-batches (no validation, ``preprocess=None``; the random streams of ``seed`` as
    there), then
    :meth:`TransferModel.finish_training`. The model is left in eval mode. A batch of one image is
    dropped from each epoch's end (pairwise objectives need two); a non-finite loss raises
    ``FloatingPointError``."""
    check_positive(epochs, "epochs", integer=True)
    check_positive(batch_size, "batch_size", integer=True)
    loss: Union[nn.Module, str]
    if model.objective == "cross_entropy":
        loss = "cross_entropy"
    elif model.objective == "estimator":
        loss = "model"
    else:
        assert model.loss is not None  # built with one (Method.build)
        loss = model.loss
    trainer = Trainer(
        model.network,
        loss,
        loss_on="embeddings" if isinstance(loss, nn.Module) else None,
        two_views=model.objective == "two_views",
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        seed=seed,
        progress=False,
        log=False,
        preprocess=None,
    )
    model.train()
    trainer.fit(x, y, num_classes=model.num_classes)
    model.eval()
    model.finish_training(x, y, batch_size)
    return model


#: Every row of the benchmark, in table order.
_METHOD_LIST = (
    Method("ce", "cross-entropy; class entropy [Kirchhof, URL Sec. 4.1]", "cross_entropy"),
    Method("infonce", "InfoNCE on two augmented views; -||e|| [Kirchhof, URL App. B.2]", "two_views", "infonce"),
    Method(
        "mcinfonce",
        "MCInfoNCE on two augmented views (unsupervised, as URL); -||e|| [Kirchhof, URL Sec. 4.1; App. B, eq. (7)]",
        "two_views",
        "mcinfonce",
        loss_generator=True,
    ),
    Method(
        "mcinfonce-sup",
        "MCInfoNCE with class labels as positives; -||e||",
        "embedding",
        "mcinfonce",
        loss_generator=True,
    ),
    Method("elk", "expected likelihood kernel; -||e|| [Kirchhof, App. B.5, eq. (55)]", "embedding", "elk"),
    Method(
        "nivmf",
        "EL-nivMF proxies; -||e|| [Kirchhof, App. A, eq. (4)-(6)]",
        "embedding",
        "nivmf_proxy",
        loss_generator=True,
    ),
    Method(
        "hib",
        "hedged instance embeddings; -||e|| [Kirchhof, App. B.4, eq. (54)]",
        "embedding",
        "hib",
        loss_generator=True,
    ),
    Method(
        "qact-watershed",
        "QACT LeNet + watershed loss; -||e|| [QACT, App. D]",
        "embedding",
        "watershed",
        activation="qact",
        loss_generator=True,
    ),
    Method(
        "ensemble",
        "10 heads on a shared backbone; entropy [Kirchhof, URL App. B.10]",
        "estimator",
        "ensemble",
        {"num_members": 10},
    ),
    Method(
        "mcdropout",
        "dropout before the classifier, 10 samples; entropy [Kirchhof, URL App. B.11]",
        "estimator",
        "mc_dropout",
    ),
    Method(
        "sngp",
        "spectral norm + random-feature GP; entropy [Kirchhof, URL App. B.8]",
        "estimator",
        "sngp",
        fit_after_training=True,
    ),
    Method("hetxl", "heteroscedastic embedding noise; log det Sigma [Kirchhof, URL App. B.7]", "estimator", "hetxl"),
    Method(
        "losspred",
        "CE + L2 loss prediction; predicted loss [Kirchhof, URL App. B.9, eq. (8)]",
        "estimator",
        "loss_prediction",
    ),
    Method(
        "spce",
        "SPCE; posterior entropy [Patel, Ch. 6, eq. (6.7)-(6.8)]",
        "prototypes",
        "spce",
        fit_after_training=True,
    ),
    Method(
        "tightness",
        "SPCE + prototype tightness; prototype posterior entropy [Patel, Ch. 6, eq. (6.9)-(6.11)]",
        "prototypes",
        "tightness",
        {"base": "spce"},
    ),
    Method(
        "esupcon", "ESupCon; prototype posterior entropy [Patel, Ch. 6, eq. (6.12)-(6.16)]", "prototypes", "esupcon"
    ),
)

#: ``name -> Method``: every row of the benchmark, in table order.
METHODS: dict[str, Method] = {m.name: m for m in _METHOD_LIST}
