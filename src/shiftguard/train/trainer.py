"""A plain PyTorch training loop following [QACT, App. B].

- Adam with initial learning rate 1e-3;
- ReduceLROnPlateau(factor=0.1, patience=50, cooldown=10, threshold=0.01, threshold_mode="abs",
  min_lr=1e-6) on the validation accuracy;
- early stopping when the validation accuracy does not improve by 0.001 (for
  ``early_stopping_patience`` epochs), keeping the best weights;
- an 80:20 train/validation split with seed 42 (:func:`train_val_split`).

Any loss works: ``loss_on="logits"`` (cross-entropy on ``model(x)``), ``loss_on="embeddings"``
(watershed and other embedding losses on ``model.embed(x)``; with ``two_views=True`` on two
augmented views of each image, labelled by instance, as InfoNCE trains) or ``loss="model"`` (the model's own
objective ``model.training_loss(x, y)``, as the uncertainty estimators of
``shiftguard.uncertainty`` define it; validated on the argmax of ``model(x)``). For embedding
losses the validation metric is the accuracy of a nearest-class-mean head whose means are
accumulated from the epoch's training embeddings (no extra pass).

AugMix (Hendrycks et al. 2020; ``shiftguard.corruptions.augmix``): ``augmix=True`` (with
``augmix_suite``, the corruption suite the model will be tested on, which chooses the operations)
or an ``AugMix`` object augments the [0, 1] pixels of every training batch before
:func:`to_model_input`. With ``jsd_weight == 0`` each image is replaced by one AugMix view; with
``jsd_weight > 0`` (logit losses only) the clean batch and two AugMix views are forwarded as one
batch of 3N (BatchNorm and QACT see all three as their context, as the official code's single
forward does) and the loss is ``loss(clean logits, y) + jsd_weight * JS(clean, view 1, view 2)``;
the training accuracy is counted on the clean part. Validation stays clean.

Input: the model sees ``preprocess(x)`` of the float pixels ``x`` in [0, 1] (uint8 divided by 255)
on the device, as ``shiftguard.evaluate`` does; the default ``preprocess`` is :func:`to_model_input`
([-1, 1]), and ``preprocess=None`` gives the model the [0, 1] pixels themselves. The same holds for
training batches, the two views, AugMix views and validation.

Without validation data (``fit(images, labels)``), every one of ``epochs`` epochs runs: there is no
early stopping and no learning-rate schedule (both follow the validation accuracy), and the model
keeps the weights of its last step.

Resumability: a checkpoint is written after every epoch (``train/checkpoint.py``) holding the
model, optimiser, scheduler, early-stopping state, metric history and the global RNG states.
The batch order of epoch ``e`` (and its two views or AugMix views) is drawn from a generator
seeded with ``(seed, e)``, so
``fit(epochs=2)`` and ``fit(epochs=1)`` + ``fit(epochs=2, resume=True)`` end with identical
weights.

Distributed training (later): only the process with ``is_main_process=True`` writes files or
shows progress, and :meth:`Trainer.batches` is the single place that decides which indices a
process sees (override it to shard, e.g. with a ``DistributedSampler``).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
from torch import nn

from shiftguard._progress import progress, write
from shiftguard._validation import check_labels, check_tensor
from shiftguard.io import atomic_write_text

from .checkpoint import load_latest_checkpoint, save_checkpoint

if TYPE_CHECKING:
    from shiftguard.corruptions.augmix import AugMix

__all__ = ["Trainer", "train_val_split", "to_model_input"]


def to_model_input(images: torch.Tensor, device=None) -> torch.Tensor:
    """Images as the models see them: float in [-1, 1].

    ``uint8`` images ``(N, C, H, W)`` are scaled by 1/255; floating images are taken to be in
    [0, 1] already (as the corruption engine returns them for float input).
    """
    x = images.to(device) if device is not None else images
    x = x.float() / 255.0 if x.dtype == torch.uint8 else x.float()
    return x.mul(2.0).sub_(1.0)


def train_val_split(n: int, val_fraction: float = 0.2, seed: int = 42) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``(train_idx, val_idx)`` split of ``range(n)``; [QACT, App. B] uses 80:20, seed 42."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction: expected a value in (0, 1), got {val_fraction}")
    if n < 2:
        raise ValueError(f"n: need at least 2 samples to split, got {n}")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_val = min(n - 1, max(1, int(round(n * val_fraction))))
    return perm[n_val:].sort().values, perm[:n_val].sort().values


class Trainer:
    """Train ``model`` with ``loss``; see the module docstring for the protocol.

    Parameters mirror ``commands.config.TrainConfig``. ``checkpoint_dir`` enables per-epoch
    checkpoints and ``resume``; ``metrics_log`` is a JSONL file with one line per epoch.

    Output (main process only): ``progress`` draws a per-epoch batch bar on a terminal (nothing
    in a log, where a redrawn bar would be noise); ``log`` prints one line per epoch (epoch,
    loss, accuracies, learning rate, seconds): ``True`` to stdout, a callable receives the line,
    ``False`` prints none, ``None`` (default) follows ``progress``. ``log`` not None, a bool or a
    callable is a ``ValueError``. ``preprocess``: see the module docstring ("Input"); a value that
    is neither callable nor ``None`` is a ``TypeError``.
    """

    #: Nearest-class-mean validation head of embedding losses: class means (C, D) of the last
    #: epoch's training embeddings and which classes had any.
    _class_means: torch.Tensor
    _class_present: torch.Tensor

    def __init__(
        self,
        model: nn.Module,
        loss: nn.Module | str = "cross_entropy",
        *,
        loss_on: Optional[str] = None,
        epochs: int = 10,
        batch_size: int = 128,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        lr_factor: float = 0.1,
        lr_patience: int = 50,
        lr_cooldown: int = 10,
        lr_threshold: float = 0.01,
        min_lr: float = 1e-6,
        early_stopping_patience: int = 5,
        early_stopping_min_delta: float = 0.001,
        class_balanced: bool = False,
        samples_per_class: int = 4,
        chunk_size: int = 0,
        two_views: bool = False,
        augmix: "bool | AugMix" = False,
        augmix_suite: Optional[str] = None,
        jsd_weight: float = 0.0,
        max_val: int = 0,
        val_batch_size: int = 1000,
        device: str | torch.device = "cpu",
        seed: int = 0,
        checkpoint_dir: Optional[str | Path] = None,
        metrics_log: Optional[str | Path] = None,
        progress: bool = True,
        desc: str = "train",
        is_main_process: bool = True,
        log=None,
        preprocess: Optional[Callable[[torch.Tensor], torch.Tensor]] = to_model_input,
    ):
        loss_fn: Optional[nn.Module | Callable] = None
        if isinstance(loss, str):
            if loss == "model":
                if not callable(getattr(model, "training_loss", None)):
                    raise TypeError(
                        "model: loss='model' trains with model.training_loss(x, y), which this "
                        f"{type(model).__name__} does not have"
                    )
                if loss_on not in (None, "model"):
                    raise ValueError(
                        f"loss_on: loss='model' computes its own loss; leave loss_on unset, got {loss_on!r}"
                    )
                loss_on = "model"
            elif loss == "cross_entropy":
                loss_fn = nn.CrossEntropyLoss()
            else:
                raise ValueError(
                    "loss: a string loss must be 'cross_entropy' or 'model'; build others with "
                    f"shiftguard.losses.build_loss, got {loss!r}"
                )
        else:
            loss_fn = loss
        if loss_on is None:
            loss_on = "logits" if isinstance(loss_fn, nn.CrossEntropyLoss) else "embeddings"
        if loss_on not in ("logits", "embeddings", "model"):
            raise ValueError(f"loss_on: expected 'logits', 'embeddings' or 'model', got {loss_on!r}")
        if not hasattr(model, "embed") and loss_on == "embeddings":
            raise TypeError("model: an embedding loss needs a model with an embed() method")
        for name, v in (("epochs", epochs), ("batch_size", batch_size), ("val_batch_size", val_batch_size)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected a positive integer, got {v!r}")
        if preprocess is not None and not callable(preprocess):
            raise TypeError(f"preprocess: expected a callable or None, got {type(preprocess).__name__}")
        self.preprocess = preprocess
        self.device = torch.device(device)
        # Any: the model's embed() (and a DDP view's) is checked above, not by the nn.Module type.
        self.model: Any = model.to(self.device)
        # None exactly when loss_on == "model" (the model computes its own loss).
        self.loss_fn: Any = loss_fn.to(self.device) if isinstance(loss_fn, nn.Module) else loss_fn
        self.loss_on = loss_on
        self.epochs, self.batch_size, self.val_batch_size = epochs, batch_size, val_batch_size
        self.early_stopping_patience = early_stopping_patience
        self.early_stopping_min_delta = early_stopping_min_delta
        self.class_balanced, self.samples_per_class, self.max_val = class_balanced, samples_per_class, max_val
        if chunk_size and loss_on != "embeddings":
            raise ValueError("chunk_size: multistage steps [Patel, Sec. 5.3.2] need an embedding loss")
        self.chunk_size = int(chunk_size)
        if two_views and (loss_on != "embeddings" or chunk_size):
            raise ValueError(
                "two_views: two augmented views with instance ids need an embedding loss and no chunk_size"
            )
        self.two_views = bool(two_views)
        self._views_gen: Optional[torch.Generator] = None
        self._views_epoch = -1
        self.augmix = _build_augmix(augmix, augmix_suite)
        if self.augmix is not None and two_views:
            raise ValueError("augmix: two_views draws its own augmented views; use one of augmix and two_views")
        if isinstance(jsd_weight, bool) or not isinstance(jsd_weight, (int, float)) or not 0.0 <= jsd_weight < math.inf:
            raise ValueError(f"jsd_weight: expected a finite number >= 0, got {jsd_weight!r}")
        if jsd_weight > 0 and self.augmix is None:
            raise ValueError("jsd_weight: the Jensen-Shannon consistency term compares AugMix views; enable augmix")
        if jsd_weight > 0 and (loss_on != "logits" or chunk_size):
            raise ValueError(
                f"jsd_weight: the Jensen-Shannon consistency term needs class logits (a logit loss "
                f"such as cross-entropy, no chunk_size), got loss_on={loss_on!r}; use jsd_weight=0 "
                "for plain AugMix views"
            )
        self.jsd_weight = float(jsd_weight)
        self._augmix_gen: Optional[torch.Generator] = None
        self._augmix_epoch = -1
        self.seed = int(seed)
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.metrics_log = Path(metrics_log) if metrics_log is not None else None
        self.progress, self.desc, self.is_main_process = progress, desc, is_main_process
        if not (log is None or isinstance(log, bool) or callable(log)):
            raise ValueError(f"log: expected None, a bool or a callable taking one line, got {log!r}")
        self.log = progress if log is None else log
        params = list(self.model.parameters()) + [p for p in getattr(self.loss_fn, "parameters", lambda: [])()]
        self.optimizer = torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
        self.scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
            self.optimizer,
            mode="max",
            factor=lr_factor,
            patience=lr_patience,
            cooldown=lr_cooldown,
            threshold=lr_threshold,
            threshold_mode="abs",
            min_lr=min_lr,
        )
        self.history: list[dict] = []

    # ----------------------------------------------------------------- batching (sampler hook)
    def batches(self, labels: torch.Tensor, epoch: int) -> Iterator[torch.Tensor]:
        """Index tensors of the training batches of ``epoch`` (deterministic in ``seed``, ``epoch``).

        The single hook a distributed trainer overrides to shard the data across processes.
        """
        gen = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        n = labels.numel()
        if self.class_balanced:
            from .samplers import ClassBalancedBatchSampler

            sampler = ClassBalancedBatchSampler(
                labels, m=self.samples_per_class, batch_size=self.batch_size, seed=self.seed * 100_003
            )
            sampler.set_epoch(epoch)
            for batch in sampler:
                yield torch.as_tensor(batch, dtype=torch.long)
            return
        perm = torch.randperm(n, generator=gen)
        # Drop a last batch smaller than 2: BatchNorm and QACT need a context of at least 2.
        for i in range(0, n, self.batch_size):
            idx = perm[i : i + self.batch_size]
            if idx.numel() >= 2:
                yield idx

    def num_batches(self, labels: torch.Tensor) -> int:
        if self.class_balanced:
            return max(1, labels.numel() // self.batch_size)
        n = labels.numel()
        return n // self.batch_size + (1 if n % self.batch_size >= 2 else 0)

    def model_input(self, pixels: torch.Tensor) -> torch.Tensor:
        """What the model sees of a batch of pixels: float in [0, 1] on the device (uint8 divided by
        255), then ``preprocess`` (module docstring, "Input")."""
        x = pixels.to(self.device)
        x = x.float() / 255.0 if x.dtype == torch.uint8 else x.float()
        return x if self.preprocess is None else self.preprocess(x)

    # ----------------------------------------------------------------- one epoch
    def _train_epoch(self, images, labels, epoch: int, num_classes: int) -> dict:
        self.model.train()
        self._emb_sum: Optional[torch.Tensor] = None
        self._emb_cnt = torch.zeros(num_classes, device=self.device)
        # A bar on a terminal only: in a log the epoch line (fit) is the progress record.
        with progress(
            self.num_batches(labels),
            f"{self.desc} epoch {epoch}/{self.epochs}",
            unit="batch",
            enabled=self.progress and self.is_main_process,
            lines=False,
        ) as bar:
            total_loss, n_seen, n_correct = self._train_batches(bar, images, labels, epoch, num_classes)
        out = {"train_loss": total_loss / max(n_seen, 1)}
        if self.loss_on == "logits":
            out["train_acc"] = n_correct / max(n_seen, 1)
        elif self.loss_on == "embeddings":
            if self._emb_sum is None:
                raise RuntimeError(f"{self.desc}: epoch {epoch} ran no training batch, so there are no class means")
            self._class_means = self._emb_sum / self._emb_cnt.clamp_min(1).unsqueeze(1)
            self._class_present = self._emb_cnt > 0
        return out

    def _train_batches(self, bar, images, labels, epoch: int, num_classes: int) -> tuple[float, int, int]:
        """The optimisation steps of one epoch; returns (summed loss, images seen, correct predictions)."""
        total_loss, n_seen, n_correct = 0.0, 0, 0
        for idx in self.batches(labels, epoch):
            pixels = images[idx]
            x = self.model_input(pixels) if self.augmix is None else self._augmix_input(pixels, epoch)
            y = labels[idx].to(self.device)
            if self.chunk_size and y.numel() > self.chunk_size:
                # Large batch: multistage back-propagation [Patel, Sec. 5.3.2] accumulates .grad itself.
                self.optimizer.zero_grad(set_to_none=True)
                loss = self._multistage_step(x, y)
                self.optimizer.step()
                total_loss += loss.item() * y.numel()
                n_seen += y.numel()
                with torch.no_grad():  # class means for the validation head
                    self._accumulate_means(self.model.embed(x).float(), y, num_classes)
                bar.update(1, {"loss": f"{total_loss / n_seen:.4f}"})
                continue
            if self.two_views:
                emb, ids = self._two_view_embeddings(images[idx], epoch)
                loss = self.loss_fn(emb, ids)
                self._accumulate_means(emb[: y.numel()].detach().float(), y, num_classes)
            elif self.loss_on == "logits" and self.jsd_weight > 0:
                from shiftguard.corruptions.augmix import jensen_shannon_consistency

                # x holds [clean; view 1; view 2]: one forward, one context for BatchNorm and QACT
                out, out1, out2 = self.model(x).split(y.numel())
                loss = self.loss_fn(out, y) + self.jsd_weight * jensen_shannon_consistency(out, out1, out2)
                n_correct += int((out.argmax(1) == y).sum())
            elif self.loss_on == "logits":
                out = self.model(x)  # shiftguard's models: forward = classifier(embed(x))
                loss = self.loss_fn(out, y)
                n_correct += int((out.argmax(1) == y).sum())
            elif self.loss_on == "model":
                loss = self.model.training_loss(x, y)
            else:
                emb = self.model.embed(x)
                loss = self.loss_fn(emb, y)
                self._accumulate_means(emb.detach().float(), y, num_classes)
            if not torch.isfinite(loss):
                lr = self.optimizer.param_groups[0]["lr"]
                raise FloatingPointError(
                    f"{self.desc}: the training diverged (loss {loss.item()} at epoch {epoch}, "
                    f"learning rate {lr:g}); lower the learning rate"
                )
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            total_loss += loss.item() * y.numel()
            n_seen += y.numel()
            post = {"loss": f"{total_loss / n_seen:.4f}"}
            if self.loss_on == "logits":
                post["acc"] = f"{n_correct / n_seen:.3f}"
            bar.update(1, post)
        return total_loss, n_seen, n_correct

    def _two_view_embeddings(self, pixels: torch.Tensor, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings ``(2N, D)`` of two augmented views of ``pixels`` and their instance ids
        (rows ``i`` and ``N + i`` are views of image ``i``; ``shiftguard.data.two_views``), drawn
        from one generator per epoch, seeded with ``(seed, epoch)``, so that a resumed run (which
        restarts at an epoch boundary) draws the same views."""
        from shiftguard.data import two_views

        if self._views_gen is None or self._views_epoch != epoch:
            self._views_gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._views_epoch = epoch
        x = pixels.float() / 255.0 if pixels.dtype == torch.uint8 else pixels.float()
        views, ids = two_views(x, self._views_gen)
        return self.model.embed(self.model_input(views)), ids.to(self.device)

    def _augmix_input(self, pixels: torch.Tensor, epoch: int) -> torch.Tensor:
        """Model input of a batch under AugMix: one view per image, or (``jsd_weight > 0``) the
        clean batch followed by two views, ``(3N, ...)``. The views are drawn from one CPU generator
        per epoch seeded with ``(seed, epoch)`` (AugMix draws on the generator's device, so the
        draws do not depend on ``device``) and a resumed run, which restarts at an epoch boundary,
        draws the same views."""
        assert self.augmix is not None
        if self._augmix_gen is None or self._augmix_epoch != epoch:
            self._augmix_gen = torch.Generator().manual_seed(self.seed * 10_000_019 + epoch)
            self._augmix_epoch = epoch
        x = pixels.to(self.device)
        x = x.float() / 255.0 if x.dtype == torch.uint8 else x.float()
        if self.jsd_weight > 0:
            x = torch.cat([x, self.augmix(x, self._augmix_gen), self.augmix(x, self._augmix_gen)])
        else:
            x = self.augmix(x, self._augmix_gen)
        return self.model_input(x)

    def _multistage_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One multistage step on batch ``(x, y)``; the DDP trainer overrides it (train/distributed.py)."""
        from .multistage import multistage_step

        return multistage_step(self.model, self.loss_fn, x, y, self.chunk_size)

    def _accumulate_means(self, e: torch.Tensor, y: torch.Tensor, num_classes: int) -> None:
        """Running per-class sums of training embeddings (the nearest-class-mean validation head)."""
        if self._emb_sum is None:
            self._emb_sum = torch.zeros(num_classes, e.shape[1], device=e.device)
        self._emb_sum.index_add_(0, y, e)
        self._emb_cnt += torch.bincount(y, minlength=num_classes).float()

    @torch.no_grad()
    def validate(self, images: torch.Tensor, labels: torch.Tensor) -> float:
        """Validation accuracy: the model's classifier (logit losses) or nearest class mean."""
        self.model.eval()
        if self.max_val and labels.numel() > self.max_val:
            images, labels = images[: self.max_val], labels[: self.max_val]
        correct = 0
        for i in range(0, labels.numel(), self.val_batch_size):
            x = self.model_input(images[i : i + self.val_batch_size])
            y = labels[i : i + self.val_batch_size].to(self.device)
            if self.loss_on in ("logits", "model"):
                pred = self.model(x).argmax(1)
            else:
                d = torch.cdist(self.model.embed(x).float(), self._class_means)
                d[:, ~self._class_present] = math.inf
                pred = d.argmin(1)
            correct += int((pred == y).sum())
        return correct / max(labels.numel(), 1)

    # ----------------------------------------------------------------- state
    def state_dict(self, epoch: int) -> dict:
        s = {
            "epoch": epoch,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "best_metric": self.best_metric,
            "best_epoch": self.best_epoch,
            "best_model": self.best_model,
            "bad_epochs": self.bad_epochs,
            "stopped": self.stopped,
            "history": self.history,
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        }
        if isinstance(self.loss_fn, nn.Module):
            s["loss"] = self.loss_fn.state_dict()
        if self.loss_on == "embeddings":
            s["class_means"], s["class_present"] = self._class_means, self._class_present
        return s

    def load_state_dict(self, s: dict) -> int:
        self.model.load_state_dict(s["model"])
        self.optimizer.load_state_dict(s["optimizer"])
        self.scheduler.load_state_dict(s["scheduler"])
        if "loss" in s and isinstance(self.loss_fn, nn.Module):
            self.loss_fn.load_state_dict(s["loss"])
        self.best_metric, self.best_epoch = s["best_metric"], s["best_epoch"]
        self.best_model, self.bad_epochs, self.stopped = s["best_model"], s["bad_epochs"], s["stopped"]
        self.history = list(s["history"])
        if "class_means" in s:
            self._class_means = s["class_means"].to(self.device)
            self._class_present = s["class_present"].to(self.device)
        torch.set_rng_state(s["torch_rng"])
        if s["cuda_rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(s["cuda_rng"])
        return int(s["epoch"])

    def _log_epoch(self, h: dict) -> None:
        """One line per epoch: epoch, loss, train/val accuracy, learning rate, seconds."""
        acc = f" train_acc={h['train_acc']:.4f}" if "train_acc" in h else ""
        val = f" val_acc={h['val_acc']:.4f}" if "val_acc" in h else ""
        line = (
            f"{self.desc} epoch {h['epoch']}/{self.epochs}: loss={h['train_loss']:.4f}{acc}"
            f"{val} lr={h['lr']:.2g} {h['seconds']:.1f} s"
            f"{' (early stop)' if self.stopped else ''}"
        )
        if callable(self.log):
            self.log(line)
        else:
            write(line)

    def _write_log(self) -> None:
        if self.metrics_log is not None and self.is_main_process:
            atomic_write_text(self.metrics_log, "".join(json.dumps(h) + "\n" for h in self.history))

    # ----------------------------------------------------------------- fit
    def _after_validation(self, val_acc: float, epoch: int) -> None:
        """The learning-rate schedule, the best weights and early stopping after one validation."""
        self.scheduler.step(val_acc)
        improved = val_acc > self.best_metric + self.early_stopping_min_delta
        if improved or self.best_model is None:
            self.best_metric, self.best_epoch = val_acc, epoch
            self.best_model = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            self.bad_epochs = 0
        else:
            self.bad_epochs += 1
            if self.early_stopping_patience > 0 and self.bad_epochs >= self.early_stopping_patience:
                self.stopped = True

    def fit(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        val_images: Optional[torch.Tensor] = None,
        val_labels: Optional[torch.Tensor] = None,
        *,
        num_classes: Optional[int] = None,
        resume: bool = False,
    ) -> dict:
        """Train on ``(images, labels)``, validate on ``(val_images, val_labels)`` each epoch.

        Images are ``(N, C, H, W)`` uint8 (or float in [0, 1]); labels int64 ``(N,)``. Returns a
        summary dict (history, best epoch and validation accuracy, epochs run, early stop flag,
        seconds); the model ends with its best validation weights. Without ``val_images`` and
        ``val_labels`` (give both or neither) every epoch runs and the model keeps its last weights;
        the history then has no ``val_acc`` and the summary's ``best_epoch`` / ``best_val_acc`` are
        ``None``.
        """
        images = check_tensor(images, "images", ndim=(2, 4), nonempty=True)
        validated = val_images is not None
        if validated != (val_labels is not None):
            raise ValueError("val_images, val_labels: give both (validation each epoch) or neither")
        num_classes = int(num_classes or int(labels.max()) + 1)
        labels = check_labels(labels, "labels", num_classes=num_classes, n=images.shape[0])
        if val_images is not None:
            val_images = check_tensor(val_images, "val_images", ndim=images.dim(), nonempty=True)
            val_labels = check_labels(val_labels, "val_labels", num_classes=num_classes, n=val_images.shape[0])
        if self.augmix is not None and images.dim() != 4:
            raise ValueError(f"images: augmix needs images (N, C, H, W), got shape {tuple(images.shape)}")
        t0 = time.perf_counter()
        start = 0
        self.best_metric, self.best_epoch, self.best_model = -math.inf, 0, None
        self.bad_epochs, self.stopped, self.history = 0, False, []
        if resume:
            if self.checkpoint_dir is None:
                raise ValueError("resume: needs a checkpoint_dir")
            state = load_latest_checkpoint(self.checkpoint_dir, map_location=self.device)
            if state is not None:
                start = self.load_state_dict(state)
            else:  # killed before the first checkpoint: start exactly as a fresh run would
                torch.manual_seed(self.seed)
        else:
            torch.manual_seed(self.seed)
        for epoch in range(start + 1, self.epochs + 1):
            if self.stopped:
                break
            te = time.perf_counter()
            stats = self._train_epoch(images, labels, epoch, num_classes)
            if val_images is not None and val_labels is not None:
                stats["val_acc"] = val_acc = self.validate(val_images, val_labels)
                self._after_validation(val_acc, epoch)
            self.history.append(
                {
                    "epoch": epoch,
                    **stats,
                    "lr": self.optimizer.param_groups[0]["lr"],
                    "seconds": time.perf_counter() - te,
                }
            )
            if self.log and self.is_main_process:
                self._log_epoch(self.history[-1])
            if self.checkpoint_dir is not None and self.is_main_process:
                save_checkpoint(self.checkpoint_dir, epoch, self.state_dict(epoch))
            self._write_log()
        if self.best_model is not None:
            self.model.load_state_dict(self.best_model)
        return {
            "history": self.history,
            "best_epoch": self.best_epoch if validated else None,
            "best_val_acc": self.best_metric if validated else None,
            "epochs_run": len(self.history),
            "stopped_early": self.stopped,
            "seconds": time.perf_counter() - t0,
            **({"augmix": {**self.augmix.config, "jsd_weight": self.jsd_weight}} if self.augmix is not None else {}),
        }


def _build_augmix(augmix, augmix_suite: Optional[str]) -> "Optional[AugMix]":
    """The trainer's AugMix: None (off), built from ``augmix_suite`` (``augmix=True``) or the given
    object (then ``augmix_suite``, if given, must name its suite)."""
    from shiftguard.corruptions.augmix import AugMix

    if augmix is False or augmix is None:
        if augmix_suite is not None:
            raise ValueError(f"augmix_suite: only used with augmix=True, got augmix_suite={augmix_suite!r}")
        return None
    if augmix is True:
        if augmix_suite is None:
            raise ValueError(
                "augmix_suite: AugMix's operations depend on the corruption suite the model is tested "
                "on; pass augmix_suite ('mnist-c', 'cifar-c', ...)"
            )
        return AugMix(augmix_suite)
    if isinstance(augmix, AugMix):
        if augmix_suite is not None and AugMix(augmix_suite).suite != augmix.suite:
            raise ValueError(f"augmix_suite: {augmix_suite!r} differs from the AugMix object's suite {augmix.suite!r}")
        return augmix
    raise ValueError(f"augmix: expected a bool or a shiftguard.corruptions.AugMix, got {augmix!r}")
