"""``shiftguard transfer``: the URL transfer benchmark [Kirchhof, URL Sec. 3] in miniature, on MNIST and
Fashion-MNIST.

Protocol ([Kirchhof, URL Sec. 3.2], scaled down): every method trains a LeNet on a subset of the
UPSTREAM training images, then is evaluated zero-shot (no training, no fitting) on the test images of
DOWNSTREAM classes it never saw. Splits (:data:`SPLITS`, also the ``--preset`` names):

- ``mnist-0to4-5to9``: upstream MNIST digits 0-4, downstream digits 5-9 (new classes, same domain);
- ``mnist-to-fashion``: upstream MNIST (all digits), downstream Fashion-MNIST (new domain);
- ``fashion-5-5``: upstream Fashion-MNIST classes 0-4, downstream classes 5-9.

A class is identified by ``(dataset, label)``; the downstream classes are disjoint from the upstream
ones (checked when a split is built, :func:`check_class_split`), and every image is checked against
its side's class list after sub-sampling.

Metrics of one (method, split, seed), for every uncertainty the method defines (higher = more
uncertain):

- ``r1``: downstream Recall@1, the fraction of test images whose nearest other embedding by cosine
  similarity (the L2-normalised embeddings, as URL computes it) has the same class
  [Kirchhof, URL Sec. 3.1, Alg. 1];
- ``r_auroc``: downstream R-AUROC, the AUROC of the uncertainty for a Recall@1 miss
  [Kirchhof, URL Sec. 3.1, Alg. 1];
- ``ood_auroc``: the AUROC of the uncertainty for "the image is downstream" on a 50/50 mix of
  upstream and downstream test images [Kirchhof, URL App. C.4];
- ``mixed_r_auroc``: R-AUROC on the same 50/50 mix, the downstream labels offset so that no
  downstream class shares a label with an upstream one [Kirchhof, URL App. C.5];
- ``up_r1`` / ``up_r_auroc``: the same two on the upstream test images [Kirchhof, URL App. C.3];
- for methods with a classifier: ``top1`` / ``top5`` upstream test accuracy (``top5`` only with more
  than five upstream classes, where it is not trivially 1) and ``e_aurc``, the excess AURC of the
  upstream classification errors: AURC (Geifman & El-Yaniv 2017) minus the AURC of the oracle order
  that accepts every correct prediction first (Geifman et al. 2019), so 0 is a perfect ordering.

Methods (:data:`METHODS`, one entry each: build the model, its training objective, its uncertainties):
``ce``, ``infonce``, ``mcinfonce`` (URL's unsupervised form on two augmented views),
``mcinfonce-sup`` (class labels as positives), ``elk``, ``nivmf``, ``hib``, ``qact-watershed``,
``ensemble``, ``mcdropout``, ``sngp``, ``hetxl``, ``losspred``, ``spce``, ``tightness``, ``esupcon``
(details in :data:`METHODS`). Training: Adam, learning rate 1e-3, fixed epochs, batch 128, the same
seeded images for every method; no hyperparameter is tuned (URL tunes each method on downstream
validation data, [Kirchhof, URL Sec. 3.2]; this miniature has none).

Every random draw comes from the run's seed: the same command gives the same numbers.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union, cast

import torch
import torch.nn.functional as F
from torch import nn

from shiftguard._validation import check_labels, check_positive, check_same_length, check_tensor
from shiftguard.io import atomic_write_text
from shiftguard.metrics import auroc_error, excess_aurc, one_nn_misses
from shiftguard.models import EmbeddingClassifier, build_model
from shiftguard.uncertainty import UncertaintyEstimator, entropy_from_log_probs

from .arguments import ListAction

if TYPE_CHECKING:
    from shiftguard.losses import ESupConLoss, SPCELoss, TightnessLoss
    from shiftguard.uncertainty import SNGP

__all__ = [
    "SPLITS",
    "METHODS",
    "SplitSpec",
    "TransferData",
    "Method",
    "TransferModel",
    "check_class_split",
    "make_transfer_data",
    "load_split",
    "one_nn_misses",
    "recall_at_one",
    "excess_aurc",
    "evaluate_transfer",
    "train_model",
    "run_one",
    "run_benchmark",
    "summarize",
    "format_table",
    "across_splits",
    "add_arguments",
    "main",
]

# ----------------------------------------------------------------------------------------------- splits


@dataclass(frozen=True)
class SplitSpec:
    """One upstream -> downstream pair: dataset names (``shiftguard.data.load``) and label lists."""

    upstream: str
    upstream_labels: tuple[int, ...]
    downstream: str
    downstream_labels: tuple[int, ...]
    description: str


#: The three presets of the benchmark.
SPLITS: dict[str, SplitSpec] = {
    "mnist-0to4-5to9": SplitSpec(
        "mnist", (0, 1, 2, 3, 4), "mnist", (5, 6, 7, 8, 9), "MNIST digits 0-4 -> digits 5-9 (new classes, same domain)"
    ),
    "mnist-to-fashion": SplitSpec(
        "mnist", tuple(range(10)), "fashion-mnist", tuple(range(10)), "MNIST -> Fashion-MNIST (new domain)"
    ),
    "fashion-5-5": SplitSpec(
        "fashion-mnist", (0, 1, 2, 3, 4), "fashion-mnist", (5, 6, 7, 8, 9), "Fashion-MNIST classes 0-4 -> classes 5-9"
    ),
}


def check_class_split(
    upstream_classes: Sequence[tuple[str, int]], downstream_classes: Sequence[tuple[str, int]]
) -> None:
    """Raise ``ValueError`` naming ``downstream_classes`` if a downstream class is also upstream.

    Classes are ``(dataset, label)`` pairs: label 3 of MNIST and label 3 of Fashion-MNIST differ.
    Also raises if either side is empty or lists a class twice.
    """
    up, down = list(upstream_classes), list(downstream_classes)
    for name, side in (("upstream_classes", up), ("downstream_classes", down)):
        if not side:
            raise ValueError(f"{name}: expected at least one class")
        if len(set(side)) != len(side):
            raise ValueError(f"{name}: lists a class twice: {side}")
    leaked = sorted(set(up) & set(down))
    if leaked:
        raise ValueError(
            f"downstream_classes: {leaked} are also upstream classes; the transfer protocol "
            f"evaluates on classes never seen in training [Kirchhof, URL Sec. 3.2]"
        )


@dataclass
class TransferData:
    """The tensors of one split. Images are float ``(N, C, H, W)`` in ``[0, 1]``; labels int64 ``(N,)``,
    re-indexed ``0..K-1`` per side (``upstream_classes[k]`` / ``downstream_classes[k]`` name label
    ``k``); ``source_labels_*`` keep the datasets' own labels, for the leak checks."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    up_test_x: torch.Tensor
    up_test_y: torch.Tensor
    down_x: torch.Tensor
    down_y: torch.Tensor
    upstream_classes: tuple[tuple[str, int], ...]
    downstream_classes: tuple[tuple[str, int], ...]
    source_labels_train: torch.Tensor
    source_labels_up_test: torch.Tensor
    source_labels_down: torch.Tensor

    @property
    def num_upstream_classes(self) -> int:
        return len(self.upstream_classes)


def _select(images: torch.Tensor, labels: torch.Tensor, keep: Sequence[int], name: str):
    keep_t = torch.tensor(list(keep), dtype=torch.int64)
    mask = torch.isin(labels, keep_t)
    if not bool(mask.any()):
        raise ValueError(f"{name}: no image has one of the labels {list(keep)}")
    remap = torch.full((int(max(int(labels.max()), max(keep))) + 1,), -1, dtype=torch.int64)
    remap[keep_t] = torch.arange(len(keep_t))
    src = labels[mask]
    return images[mask], remap[src], src


def _as_float_images(images, name: str) -> torch.Tensor:
    t = check_tensor(images, name, ndim=4, nonempty=True)
    if t.dtype == torch.uint8:
        return t.float() / 255.0
    if not t.is_floating_point():
        raise TypeError(f"{name}: expected uint8 or float images (N, C, H, W), got {t.dtype}")
    return t.float()


def make_transfer_data(
    upstream_train,
    upstream_test,
    downstream_test,
    upstream_classes: Sequence[tuple[str, int]],
    downstream_classes: Sequence[tuple[str, int]],
    train_subset: Optional[int] = None,
    data_seed: int = 0,
) -> TransferData:
    """Build a split from ``(images, labels)`` pairs (or anything with ``.images`` / ``.labels``).

    Args:
        upstream_train, upstream_test, downstream_test: images ``(N, C, H, W)`` uint8 (divided by 255)
            or float, labels ``(N,)`` int: the datasets' own labels.
        upstream_classes, downstream_classes: ``(dataset, label)`` pairs; only images of these labels
            are kept on each side; the labels of the two sides must be disjoint classes
            (:func:`check_class_split`).
        train_subset: keep this many upstream training images (a uniformly random subset drawn with
            ``data_seed``); ``None`` keeps all.
        data_seed: seed of the subset; the same images for every method and run seed.

    Raises ``ValueError`` for a class leak, a side without images, a ``train_subset`` larger than the
    training images, or a kept image whose label is not a class of its side.
    """
    check_class_split(upstream_classes, downstream_classes)
    up_labels = [c[1] for c in upstream_classes]
    down_labels = [c[1] for c in downstream_classes]
    parts = []
    for name, pair in (
        ("upstream_train", upstream_train),
        ("upstream_test", upstream_test),
        ("downstream_test", downstream_test),
    ):
        images, labels = (pair.images, pair.labels) if hasattr(pair, "images") else pair
        x = _as_float_images(images, name)
        y = check_labels(labels, f"{name} labels")
        check_same_length([(f"{name} images", x), (f"{name} labels", y)])
        parts.append((x, y))
    tx, ty, tsrc = _select(*parts[0], up_labels, "upstream_train")
    ux, uy, usrc = _select(*parts[1], up_labels, "upstream_test")
    dx, dy, dsrc = _select(*parts[2], down_labels, "downstream_test")
    if train_subset is not None:
        check_positive(train_subset, "train_subset", integer=True)
        if train_subset > tx.shape[0]:
            raise ValueError(f"train_subset: {train_subset} exceeds the {tx.shape[0]} upstream training images")
        idx = torch.randperm(tx.shape[0], generator=torch.Generator().manual_seed(data_seed))[:train_subset]
        idx = idx.sort().values
        tx, ty, tsrc = tx[idx], ty[idx], tsrc[idx]
    data = TransferData(tx, ty, ux, uy, dx, dy, tuple(upstream_classes), tuple(downstream_classes), tsrc, usrc, dsrc)
    _check_no_leak(data)
    return data


def _check_no_leak(data: TransferData) -> None:
    up = {c[1] for c in data.upstream_classes}
    down = {c[1] for c in data.downstream_classes}
    for name, src, allowed in (
        ("upstream_train", data.source_labels_train, up),
        ("upstream_test", data.source_labels_up_test, up),
        ("downstream_test", data.source_labels_down, down),
    ):
        bad = set(src.unique().tolist()) - allowed
        if bad:
            raise ValueError(f"{name}: holds labels {sorted(bad)} outside its classes {sorted(allowed)}")


def load_split(
    name: str, root: Optional[str] = None, train_subset: Optional[int] = 6000, data_seed: int = 0
) -> TransferData:
    """Load one of :data:`SPLITS` with ``shiftguard.data.load`` (``root`` as there; e.g. the folder that
    holds ``mnist/`` and ``fashion-mnist/``). Raises ``ValueError`` for an unknown ``name`` and the
    loader's ``FileNotFoundError`` (it names the folders searched) for missing files."""
    if name not in SPLITS:
        raise ValueError(f"name: unknown split {name!r}; expected one of {', '.join(SPLITS)}")
    from shiftguard.data import load

    spec = SPLITS[name]
    up_train = load(spec.upstream, "train", root)
    up_test = load(spec.upstream, "test", root)
    down_test = load(spec.downstream, "test", root)
    return make_transfer_data(
        up_train,
        up_test,
        down_test,
        [(spec.upstream, k) for k in spec.upstream_labels],
        [(spec.downstream, k) for k in spec.downstream_labels],
        train_subset=train_subset,
        data_seed=data_seed,
    )


# ---------------------------------------------------------------------------------------------- metrics


def recall_at_one(embeddings, labels, metric: str = "cosine") -> float:
    """Recall@1 [Kirchhof, URL Sec. 3.1]: the fraction of samples whose 1-NN (itself excluded) shares
    its label; arguments and errors as :func:`one_nn_misses`."""
    return 1.0 - float(one_nn_misses(embeddings, labels, metric).double().mean())


def _auroc_or_none(u: torch.Tensor, target: torch.Tensor) -> Optional[float]:
    # An AUROC is undefined when only one outcome occurs (e.g. a perfect Recall@1); it is reported as
    # None, never replaced by a number.
    n_pos = int(target.sum())
    if n_pos == 0 or n_pos == target.numel():
        return None
    return auroc_error(u, target)


def evaluate_transfer(
    up_emb, up_y, down_emb, down_y, up_unc: dict, down_unc: dict, up_log_probs=None, mix_seed: int = 0
) -> dict:
    """All metrics of the module docstring from precomputed outputs.

    Args:
        up_emb, down_emb: upstream / downstream test embeddings ``(N_u, D)``, ``(N_d, D)``.
        up_y, down_y: their labels (each side indexed from 0; the mix offsets the downstream ones).
        up_unc, down_unc: ``{name: (N_u,)}`` / ``{name: (N_d,)}`` uncertainties with the same names.
        up_log_probs: ``(N_u, K)`` upstream class log-probabilities, or ``None`` without a classifier.
        mix_seed: seed of the 50/50 mix (``min(N_u, N_d)`` images drawn from each side).

    Returns ``{"r1", "up_r1", "uncertainty": {name: {"r_auroc", "ood_auroc", "mixed_r_auroc",
    "up_r_auroc", "e_aurc"}}, "top1", "top5"}``; entries that are undefined are ``None``.
    """
    up_y = check_labels(up_y, "up_y")
    down_y = check_labels(down_y, "down_y")
    if set(up_unc) != set(down_unc):
        raise ValueError(f"down_unc: names {sorted(down_unc)} differ from up_unc's {sorted(up_unc)}")
    down_miss = one_nn_misses(down_emb, down_y)
    up_miss = one_nn_misses(up_emb, up_y)
    n = min(up_y.numel(), down_y.numel())
    g = torch.Generator().manual_seed(mix_seed)
    iu = torch.randperm(up_y.numel(), generator=g)[:n]
    idd = torch.randperm(down_y.numel(), generator=g)[:n]
    offset = int(up_y.max()) + 1
    mix_emb = torch.cat([up_emb[iu], down_emb[idd].to(up_emb.dtype)])
    mix_y = torch.cat([up_y[iu], down_y[idd] + offset])
    mix_miss = one_nn_misses(mix_emb, mix_y)
    is_down = torch.cat([torch.zeros(n, dtype=torch.bool), torch.ones(n, dtype=torch.bool)])
    out: dict = {
        "r1": 1.0 - float(down_miss.double().mean()),
        "up_r1": 1.0 - float(up_miss.double().mean()),
        "mixed_r1": 1.0 - float(mix_miss.double().mean()),
        "top1": None,
        "top5": None,
        "uncertainty": {},
    }
    up_err = None
    if up_log_probs is not None:
        lp = check_tensor(up_log_probs, "up_log_probs", ndim=2, floating=True)
        pred = lp.argmax(1)
        up_err = pred != up_y
        out["top1"] = 1.0 - float(up_err.double().mean())
        if lp.shape[1] > 5:
            top5 = lp.topk(5, dim=1).indices
            out["top5"] = float((top5 == up_y[:, None]).any(1).double().mean())
    for name in up_unc:
        uu = check_tensor(up_unc[name], f"up_unc[{name!r}]", ndim=1, finite=True).double()
        ud = check_tensor(down_unc[name], f"down_unc[{name!r}]", ndim=1, finite=True).double()
        mix_u = torch.cat([uu[iu], ud[idd]])
        out["uncertainty"][name] = {
            "r_auroc": _auroc_or_none(ud, down_miss),
            "ood_auroc": auroc_error(mix_u, is_down),
            "mixed_r_auroc": _auroc_or_none(mix_u, mix_miss),
            "up_r_auroc": _auroc_or_none(uu, up_miss),
            "e_aurc": None if up_err is None else excess_aurc(uu, up_err),
        }
    return out


# ---------------------------------------------------------------------------------------------- methods


class TransferModel(nn.Module):
    """What the benchmark needs of a method: an objective, embeddings, uncertainties, a classifier.

    Subclasses implement :meth:`training_loss`, :meth:`embed` and :meth:`outputs`; ``default_uncertainty``
    names the uncertainty the URL paper reports for the method. :meth:`after_training` runs once on the
    training images after the last step (SNGP's covariance pass, SPCE's class weights).
    """

    default_uncertainty: str = ""

    def training_loss(self, x: torch.Tensor, y: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        raise NotImplementedError

    def after_training(self, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> None:
        return None

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def outputs(self, x: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor], dict[str, torch.Tensor]]:
        """``(embeddings (N, D), log-probabilities (N, K) or None, {uncertainty name: (N,)})`` in eval mode."""
        raise NotImplementedError


class _CrossEntropy(TransferModel):
    """CE on the backbone's logits; uncertainty: the class entropy [Kirchhof, URL Sec. 4.1, "CE"]."""

    default_uncertainty = "entropy"

    def __init__(self, backbone: EmbeddingClassifier):
        super().__init__()
        self.backbone = backbone

    def training_loss(self, x, y, generator):
        return F.cross_entropy(self.backbone(x), y)

    def embed(self, x):
        return self.backbone.embed(x)

    def outputs(self, x):
        e = self.backbone.embed(x)
        lp = F.log_softmax(self.backbone.classifier(e), dim=1)
        return e, lp, {"entropy": entropy_from_log_probs(lp)}


class _EmbeddingObjective(TransferModel):
    """An embedding loss on ``embed(x)``; with ``views`` on two augmented views of each image with
    instance ids (the unsupervised setup of InfoNCE / MCInfoNCE, [Kirchhof, URL Sec. 4.1]).
    Uncertainty: ``-||e||``, the vMF concentration kappa = ||e|| inverted [Kirchhof, URL Sec. 4.1];
    for InfoNCE and watershed, which predict no kappa, the embedding-norm heuristic of the same section."""

    default_uncertainty = "embedding_norm"

    def __init__(self, backbone: EmbeddingClassifier, loss: nn.Module, views: bool = False):
        super().__init__()
        self.backbone = backbone
        self.loss = loss
        self.views = views

    def training_loss(self, x, y, generator):
        if self.views:
            from shiftguard.data.augment import two_views

            v, ids = two_views(x, generator=generator)
            return self.loss(self.backbone.embed(v), ids)
        return self.loss(self.backbone.embed(x), y)

    def embed(self, x):
        return self.backbone.embed(x)

    def outputs(self, x):
        e = self.backbone.embed(x)
        return e, None, {"embedding_norm": -e.norm(dim=1)}


class _Estimator(TransferModel):
    """An ``shiftguard.uncertainty`` estimator: its objective, its ``forward`` log-probabilities and every
    uncertainty it defines; ``default_uncertainty`` is the estimator's."""

    def __init__(self, estimator: UncertaintyEstimator, covariance_pass: bool = False):
        super().__init__()
        self.estimator = estimator
        self.default_uncertainty = str(estimator.default_uncertainty)
        self.covariance_pass = covariance_pass

    def training_loss(self, x, y, generator):
        return self.estimator.training_loss(x, y)

    def after_training(self, x, y, batch_size):
        if self.covariance_pass:  # set for SNGP only (_build_sngp)
            cast("SNGP", self.estimator).fit_covariance(x[i : i + batch_size] for i in range(0, x.shape[0], batch_size))

    def embed(self, x):
        return self.estimator.embed(x)

    def outputs(self, x):
        return self.estimator.embed(x), self.estimator(x), dict(self.estimator.uncertainty(x))


class _PrototypeClassifier(TransferModel):
    """A contrastive classifier of [Patel, Ch. 6] with a probabilistic posterior; uncertainty: the
    posterior's entropy. ``fit_reference``: the posterior's weights come from the training embeddings
    after training (SPCE, eq. (6.8))."""

    default_uncertainty = "entropy"

    def __init__(
        self,
        backbone: EmbeddingClassifier,
        loss: Union[SPCELoss, TightnessLoss, ESupConLoss],
        fit_reference: bool = False,
    ):
        super().__init__()
        self.backbone = backbone
        self.loss = loss
        self.fit_reference = fit_reference

    def training_loss(self, x, y, generator):
        return self.loss(self.backbone.embed(x), y)

    def after_training(self, x, y, batch_size):
        if self.fit_reference:
            with torch.no_grad():
                emb = torch.cat([self.backbone.embed(x[i : i + batch_size]) for i in range(0, x.shape[0], batch_size)])
            cast("SPCELoss", self.loss).fit(emb, y)  # fit_reference is set for SPCE only (_build_spce)

    def embed(self, x):
        return self.backbone.embed(x)

    def outputs(self, x):
        e = self.backbone.embed(x)
        lp = F.log_softmax(self.loss.logits(e), dim=1)
        return e, lp, {"entropy": entropy_from_log_probs(lp)}


@dataclass(frozen=True)
class Method:
    """One row of the benchmark: ``build(num_classes, in_channels, seed) -> TransferModel``."""

    name: str
    summary: str
    build: Callable[[int, int, int], TransferModel]


def _lenet(num_classes: int, in_channels: int, activation: str = "relu") -> EmbeddingClassifier:
    # the registry's "lenet" is LeNet5, an EmbeddingClassifier (build_model is typed for user factories too)
    return cast(
        EmbeddingClassifier,
        build_model("lenet", activation=activation, num_classes=num_classes, in_channels=in_channels, width=1),
    )


def _loss_generator(seed: int) -> torch.Generator:
    # The losses' own samples (vMF draws, watershed seeds) use a stream apart from initialisation.
    return torch.Generator().manual_seed(seed + 7919)


def _build_ce(k, c, seed):
    return _CrossEntropy(_lenet(k, c))


def _build_infonce(k, c, seed):
    from shiftguard.losses import InfoNCELoss

    return _EmbeddingObjective(_lenet(k, c), InfoNCELoss(), views=True)


def _build_mcinfonce(k, c, seed):
    from shiftguard.losses import MCInfoNCELoss

    return _EmbeddingObjective(_lenet(k, c), MCInfoNCELoss(generator=_loss_generator(seed)), views=True)


def _build_mcinfonce_sup(k, c, seed):
    from shiftguard.losses import MCInfoNCELoss

    return _EmbeddingObjective(_lenet(k, c), MCInfoNCELoss(generator=_loss_generator(seed)))


def _build_elk(k, c, seed):
    from shiftguard.losses import ELKLoss

    return _EmbeddingObjective(_lenet(k, c), ELKLoss())


def _build_hib(k, c, seed):
    from shiftguard.losses import HIBLoss

    return _EmbeddingObjective(_lenet(k, c), HIBLoss(generator=_loss_generator(seed)))


def _build_nivmf(k, c, seed):
    from shiftguard.losses import NivMFProxyLoss

    backbone = _lenet(k, c)
    return _EmbeddingObjective(backbone, NivMFProxyLoss(k, backbone.embedding_dim, generator=_loss_generator(seed)))


def _build_watershed(k, c, seed):
    from shiftguard.losses import WatershedLoss

    return _EmbeddingObjective(_lenet(k, c, "qact"), WatershedLoss(generator=_loss_generator(seed)))


def _build_ensemble(k, c, seed):
    from shiftguard.uncertainty import DeepEnsemble

    return _Estimator(DeepEnsemble(_lenet(k, c), num_members=10, seed=seed))


def _build_mcdropout(k, c, seed):
    from shiftguard.uncertainty import MCDropout

    return _Estimator(MCDropout(_lenet(k, c), seed=seed))


def _build_sngp(k, c, seed):
    from shiftguard.uncertainty import SNGP

    return _Estimator(SNGP(_lenet(k, c), seed=seed), covariance_pass=True)


def _build_hetxl(k, c, seed):
    from shiftguard.uncertainty import HETXL

    return _Estimator(HETXL(_lenet(k, c), seed=seed))


def _build_losspred(k, c, seed):
    from shiftguard.uncertainty import LossPredictionL2

    return _Estimator(LossPredictionL2(_lenet(k, c), seed=seed))


def _build_spce(k, c, seed):
    from shiftguard.losses import SPCELoss

    backbone = _lenet(k, c)
    return _PrototypeClassifier(backbone, SPCELoss(k, backbone.embedding_dim), fit_reference=True)


def _build_tightness(k, c, seed):
    from shiftguard.losses import SPCELoss, TightnessLoss

    backbone = _lenet(k, c)
    d = backbone.embedding_dim
    return _PrototypeClassifier(backbone, TightnessLoss(k, d, base=SPCELoss(k, d)))


def _build_esupcon(k, c, seed):
    from shiftguard.losses import ESupConLoss

    backbone = _lenet(k, c)
    return _PrototypeClassifier(backbone, ESupConLoss(k, backbone.embedding_dim))


_METHOD_LIST = [
    Method("ce", "cross-entropy; class entropy [Kirchhof, URL Sec. 4.1]", _build_ce),
    Method("infonce", "InfoNCE on two augmented views; -||e|| [Kirchhof, URL App. B.2]", _build_infonce),
    Method(
        "mcinfonce",
        "MCInfoNCE on two augmented views (unsupervised, as URL); -||e|| [Kirchhof, URL Sec. 4.1; App. B, eq. (7)]",
        _build_mcinfonce,
    ),
    Method("mcinfonce-sup", "MCInfoNCE with class labels as positives; -||e||", _build_mcinfonce_sup),
    Method("elk", "expected likelihood kernel; -||e|| [Kirchhof, App. B.5, eq. (55)]", _build_elk),
    Method("nivmf", "EL-nivMF proxies; -||e|| [Kirchhof, App. A, eq. (4)-(6)]", _build_nivmf),
    Method("hib", "hedged instance embeddings; -||e|| [Kirchhof, App. B.4, eq. (54)]", _build_hib),
    Method("qact-watershed", "QACT LeNet + watershed loss; -||e|| [QACT, App. D]", _build_watershed),
    Method("ensemble", "10 heads on a shared backbone; entropy [Kirchhof, URL App. B.10]", _build_ensemble),
    Method(
        "mcdropout", "dropout before the classifier, 10 samples; entropy [Kirchhof, URL App. B.11]", _build_mcdropout
    ),
    Method("sngp", "spectral norm + random-feature GP; entropy [Kirchhof, URL App. B.8]", _build_sngp),
    Method("hetxl", "heteroscedastic embedding noise; log det Sigma [Kirchhof, URL App. B.7]", _build_hetxl),
    Method("losspred", "CE + L2 loss prediction; predicted loss [Kirchhof, URL App. B.9, eq. (8)]", _build_losspred),
    Method("spce", "SPCE; posterior entropy [Patel, Ch. 6, eq. (6.7)-(6.8)]", _build_spce),
    Method(
        "tightness",
        "SPCE + prototype tightness; prototype posterior entropy [Patel, Ch. 6, eq. (6.9)-(6.11)]",
        _build_tightness,
    ),
    Method("esupcon", "ESupCon; prototype posterior entropy [Patel, Ch. 6, eq. (6.12)-(6.16)]", _build_esupcon),
]

#: ``name -> Method``: every row of the benchmark, in table order.
METHODS: dict[str, Method] = {m.name: m for m in _METHOD_LIST}


# --------------------------------------------------------------------------------------------- training


def train_model(
    model: TransferModel,
    x: torch.Tensor,
    y: torch.Tensor,
    epochs: int,
    batch_size: int = 128,
    lr: float = 1e-3,
    seed: int = 0,
) -> TransferModel:
    """Adam (learning rate ``lr``) on ``model.training_loss`` for ``epochs`` passes over shuffled
    mini-batches (order from ``seed``), then ``model.after_training``. A batch of one image is dropped
    from each epoch's end (pairwise objectives need two); a non-finite loss raises ``FloatingPointError``."""
    check_positive(epochs, "epochs", integer=True)
    check_positive(batch_size, "batch_size", integer=True)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    n = x.shape[0]
    for _ in range(epochs):
        order = torch.randperm(n, generator=g)
        for i in range(0, n, batch_size):
            idx = order[i : i + batch_size]
            if idx.numel() < 2:
                continue
            loss = model.training_loss(x[idx], y[idx], g)
            if not bool(torch.isfinite(loss)):
                raise FloatingPointError(f"training loss became {float(loss)} for {type(model).__name__}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    model.eval()
    model.after_training(x, y, batch_size)
    return model


def _outputs(model: TransferModel, x: torch.Tensor, chunk: int = 1000):
    embs: list[torch.Tensor] = []
    lps: list[Optional[torch.Tensor]] = []
    uncs: list[dict[str, torch.Tensor]] = []
    model.eval()
    with torch.no_grad():
        for i in range(0, x.shape[0], chunk):
            e, lp, u = model.outputs(x[i : i + chunk])
            embs.append(e.float())
            lps.append(None if lp is None else lp.float())
            uncs.append({k: v.double() for k, v in u.items()})
    present = [lp for lp in lps if lp is not None]
    lp_all = torch.cat(present) if present else None
    return torch.cat(embs), lp_all, {k: torch.cat([u[k] for u in uncs]) for k in uncs[0]}


def run_one(method: str, data: TransferData, seed: int, epochs: int = 3, batch_size: int = 128) -> dict:
    """Train ``method`` (a key of :data:`METHODS`) on ``data`` with ``seed`` and evaluate it.

    Returns ``{"method", "seed", "default_uncertainty", "train_seconds", "metrics"}`` with the metrics of
    :func:`evaluate_transfer`. Raises ``ValueError`` for an unknown ``method``. The global random state
    of the caller is restored afterwards.
    """
    if method not in METHODS:
        raise ValueError(f"method: unknown method {method!r}; expected one of {', '.join(METHODS)}")
    in_channels = int(data.train_x.shape[1])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = METHODS[method].build(data.num_upstream_classes, in_channels, seed)
        t0 = time.perf_counter()
        train_model(model, data.train_x, data.train_y, epochs, batch_size, seed=seed)
        train_seconds = time.perf_counter() - t0
        up_e, up_lp, up_u = _outputs(model, data.up_test_x)
        dn_e, _, dn_u = _outputs(model, data.down_x)
    metrics = evaluate_transfer(up_e, data.up_test_y, dn_e, data.down_y, up_u, dn_u, up_lp, mix_seed=seed)
    return {
        "method": method,
        "seed": seed,
        "default_uncertainty": model.default_uncertainty,
        "train_seconds": round(train_seconds, 3),
        "metrics": metrics,
    }


# -------------------------------------------------------------------------------------------- reporting

#: The columns of the table: (key, header); uncertainty-dependent keys use the default uncertainty.
COLUMNS = (
    ("r1", "R@1"),
    ("r_auroc", "R-AUROC"),
    ("ood_auroc", "OOD AUROC"),
    ("mixed_r_auroc", "mixed R-AUROC"),
    ("up_r_auroc", "up R-AUROC"),
    ("e_aurc", "E-AURC"),
    ("top1", "top-1"),
    ("top5", "top-5"),
)
_UNCERTAINTY_KEYS = ("r_auroc", "ood_auroc", "mixed_r_auroc", "up_r_auroc", "e_aurc")


def _value(run: dict, key: str, uncertainty: Optional[str] = None) -> Optional[float]:
    m = run["metrics"]
    if key in _UNCERTAINTY_KEYS:
        name = uncertainty or run["default_uncertainty"]
        return m["uncertainty"].get(name, {}).get(key)
    return m.get(key)


def summarize(runs: Sequence[dict]) -> dict:
    """``{split: {method: {uncertainty: {metric: {"mean", "std", "n"}}}}}`` over seeds (sample std;
    ``None`` values are left out of the mean and counted out of ``n``; ``std`` is ``None`` for n < 2)."""
    groups: dict = {}
    for r in runs:
        groups.setdefault(r["split"], {}).setdefault(r["method"], []).append(r)
    out: dict = {}
    for split, by_method in groups.items():
        for method, rs in by_method.items():
            names = list(rs[0]["metrics"]["uncertainty"])
            per_u = {}
            for name in names:
                cell = {}
                for key, _ in COLUMNS:
                    vals = [v for v in (_value(r, key, name) for r in rs) if v is not None]
                    cell[key] = {
                        "mean": statistics.fmean(vals) if vals else None,
                        "std": statistics.stdev(vals) if len(vals) > 1 else None,
                        "n": len(vals),
                    }
                per_u[name] = cell
            out.setdefault(split, {})[method] = {
                "default_uncertainty": rs[0]["default_uncertainty"],
                "seeds": [r["seed"] for r in rs],
                "uncertainty": per_u,
            }
    return out


#: The keys averaged over splits in :func:`across_splits` (URL reports means over its downstream sets).
ACROSS_KEYS = (("r1", "R@1"), ("r_auroc", "R-AUROC"), ("ood_auroc", "OOD AUROC"), ("mixed_r_auroc", "mixed R-AUROC"))


def across_splits(summary: dict) -> dict:
    """``{method: {key: mean over splits of the per-split means}}`` for :data:`ACROSS_KEYS`, with each
    method's default uncertainty -- the average over downstream sets that [Kirchhof, URL Sec. 3.2]
    reports. A method missing a value on some split gets ``None`` for that key (no partial means)."""
    methods: dict = {}
    for by_method in summary.values():
        for method, cell in by_method.items():
            methods.setdefault(method, []).append(cell["uncertainty"][cell["default_uncertainty"]])
    out = {}
    for method, cells in methods.items():
        row: dict = {"n_splits": len(cells)}
        for key, _ in ACROSS_KEYS:
            vals = [c[key]["mean"] for c in cells]
            row[key] = None if any(v is None for v in vals) else statistics.fmean(vals)
        out[method] = row
    return out


def _table_lines(name: str, note: str, header: list[str], rows: list[list[str]], markdown: bool) -> list[str]:
    """One table titled ``name`` as Markdown (``**name** (note)`` then a pipe table) or as aligned
    text (``== name`` then columns padded to their widest cell), followed by an empty line."""
    if markdown:
        return [
            f"**{name}**" + (f" ({note})" if note else "") + "\n",
            "| " + " | ".join(header) + " |",
            "|" + "|".join("---" for _ in header) + "|",
            *("| " + " | ".join(r) + " |" for r in rows),
            "",
        ]
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    return [
        f"== {name}",
        "  ".join(h.ljust(w) for h, w in zip(header, widths)),
        *("  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows),
        "",
    ]


def format_table(summary: dict, markdown: bool = False) -> str:
    """The summary as one table per split (default uncertainty of each method), ``mean +- std`` over
    seeds, and with several splits a last table of :func:`across_splits`."""
    lines = []
    for split, by_method in summary.items():
        header = ["method", "u(x)"] + [h for _, h in COLUMNS]
        rows = []
        for method, cell in by_method.items():
            name = cell["default_uncertainty"]
            vals = cell["uncertainty"][name]
            row = [method, name]
            for key, _ in COLUMNS:
                v = vals[key]
                if v["mean"] is None:
                    row.append("-")
                else:
                    row.append(f"{v['mean']:.3f} ± {v['std']:.3f}" if v["std"] is not None else f"{v['mean']:.3f}")
            rows.append(row)
        lines += _table_lines(split, SPLITS[split].description if split in SPLITS else split, header, rows, markdown)
    if len(summary) > 1:
        header = ["method"] + [h for _, h in ACROSS_KEYS]
        rows = [
            [m] + ["-" if r[k] is None else f"{r[k]:.3f}" for k, _ in ACROSS_KEYS]
            for m, r in across_splits(summary).items()
        ]
        lines += _table_lines(f"mean over the {len(summary)} splits", "of the per-split means", header, rows, markdown)
    return "\n".join(lines)


def run_benchmark(
    splits: Sequence[str],
    methods: Sequence[str],
    seeds: Sequence[int],
    root: Optional[str] = None,
    train_subset: Optional[int] = 6000,
    epochs: int = 3,
    batch_size: int = 128,
    data: Optional[dict] = None,
    log: Optional[Callable[[str], None]] = None,
) -> dict:
    """Every (split, method, seed); ``data`` maps split names to prebuilt :class:`TransferData` (else
    :func:`load_split`). Returns ``{"protocol", "runs", "summary"}`` (JSON-ready)."""
    for s in splits:
        if data is None or s not in data:
            if s not in SPLITS:
                raise ValueError(f"splits: unknown split {s!r}; expected one of {', '.join(SPLITS)}")
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"methods: unknown method {m!r}; expected one of {', '.join(METHODS)}")
    runs = []
    for s in splits:
        d = data[s] if data is not None and s in data else load_split(s, root, train_subset)
        for m in methods:
            for seed in seeds:
                t0 = time.perf_counter()
                r = run_one(m, d, seed, epochs, batch_size)
                r["split"] = s
                r["seconds"] = round(time.perf_counter() - t0, 3)
                runs.append(r)
                if log is not None:
                    u = r["default_uncertainty"]
                    mm = r["metrics"]
                    ra = mm["uncertainty"][u]["r_auroc"]
                    log(
                        f"{s} {m} seed={seed}: R@1 {mm['r1']:.3f} R-AUROC "
                        f"{'-' if ra is None else f'{ra:.3f}'} ({r['seconds']:.1f} s)"
                    )
    protocol = {
        "splits": {s: (SPLITS[s].description if s in SPLITS else s) for s in splits},
        "methods": {m: METHODS[m].summary for m in methods},
        "seeds": list(seeds),
        "train_subset": train_subset,
        "epochs": epochs,
        "batch_size": batch_size,
        "optimizer": "Adam, lr 1e-3",
        "model": "LeNet-5, width 1, embedding 84",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "python": platform.python_version(),
    }
    return {"protocol": protocol, "runs": runs, "summary": summarize(runs)}


# -------------------------------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=sorted(SPLITS), help="one split (same as --splits NAME)")
    p.add_argument(
        "--splits",
        nargs="+",
        action=ListAction,
        default=None,
        help=f"space- or comma-separated; default all: {','.join(SPLITS)}",
    )
    p.add_argument(
        "--methods",
        nargs="+",
        action=ListAction,
        default=None,
        help=f"space- or comma-separated; default all: {','.join(METHODS)}",
    )
    p.add_argument(
        "--seeds",
        nargs="+",
        action=ListAction,
        default=["0", "1", "2"],
        help="space- or comma-separated ints (default 0 1 2)",
    )
    p.add_argument("--train-subset", type=int, default=6000, help="upstream training images (default 6000; 0 = all)")
    p.add_argument("--epochs", type=int, default=3, help="training epochs (default 3)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--root", default=None, help="data folder holding mnist/ and fashion-mnist/ (docs/data.md)")
    p.add_argument("--out", default=None, help="write the runs and the summary to this JSON file")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument(
        "--report", default=None, metavar="FILE.json", help="print the tables of a saved --out file instead of running"
    )


def main(argv=None) -> int:
    """``shiftguard transfer`` (``argv`` a list of arguments or a parsed ``argparse.Namespace``)."""
    if isinstance(argv, argparse.Namespace):
        args = argv
    else:
        parser = argparse.ArgumentParser(prog="shiftguard transfer", description=__doc__.splitlines()[0])
        add_arguments(parser)
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.report:
        try:
            with open(args.report, encoding="utf-8") as f:
                saved = json.load(f)
            runs = saved["runs"]
            table = format_table(summarize(runs), markdown=args.markdown)
        except FileNotFoundError:
            raise FileNotFoundError(f"--report: no such file: {args.report}") from None
        except (ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError) as exc:
            raise ValueError(
                f"--report: {args.report} is not a shiftguard transfer results file ({type(exc).__name__}: {exc})"
            ) from None
        print(table)
        return 0
    if args.preset and args.splits:
        raise ValueError("--preset/--splits: give one of them")
    splits = [args.preset] if args.preset else (args.splits or list(SPLITS))
    methods = args.methods or list(METHODS)
    try:
        seeds = [int(s) for s in args.seeds]
    except ValueError:
        raise ValueError(f"--seeds: expected integers, got {' '.join(args.seeds)}") from None
    if not seeds:
        raise ValueError("--seeds: expected at least one seed")
    if args.threads is not None:
        check_positive(args.threads, "--threads", integer=True)
        torch.set_num_threads(args.threads)
    if args.out:  # a place that cannot hold the results fails now, not after the benchmark
        out = Path(args.out)
        if out.is_dir():
            raise ValueError(f"--out: {out} is a folder; give the path of a JSON file to write")
        if not out.parent.is_dir():
            raise ValueError(f"--out: the folder {out.parent} does not exist")
        if not os.access(out.parent, os.W_OK):
            raise PermissionError(errno.EACCES, "cannot write into this folder", str(out.parent))
    subset = None if args.train_subset == 0 else args.train_subset
    result = run_benchmark(
        splits,
        methods,
        seeds,
        root=args.root,
        train_subset=subset,
        epochs=args.epochs,
        batch_size=args.batch_size,
        log=lambda s: print(s, file=sys.stderr, flush=True),
    )
    result["protocol"]["command"] = "shiftguard transfer " + " ".join(
        [
            f"--splits {','.join(splits)}",
            f"--methods {','.join(methods)}",
            f"--seeds {','.join(map(str, seeds))}",
            f"--train-subset {args.train_subset}",
            f"--epochs {args.epochs}",
            f"--batch-size {args.batch_size}",
        ]
        + ([f"--threads {args.threads}"] if args.threads is not None else [])
    )
    print(format_table(result["summary"], markdown=args.markdown))
    if args.out:
        atomic_write_text(args.out, json.dumps(result, indent=1, allow_nan=False) + "\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
