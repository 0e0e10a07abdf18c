"""``shiftguard run``: train, shift, evaluate, report.

Without arguments: the embedded real-MNIST subset, LeNet ReLU + cross-entropy vs LeNet QACT +
watershed [QACT, Sec. 4], all 15 MNIST-C corruptions x 5 severities, several heads; writes
``runs/<name>/`` with ``results.json``, ``results.csv``, PNG plots, a self-contained
``report.html`` and a ``COMPLETE`` marker (written last). ``--config FILE`` runs any grid
described by a TOML file (see ``commands/config.py`` and ``docs/run.md``).

Run directory layout::

    config.json                 the resolved configuration (checked again on --resume)
    models/<model>/checkpoints/ per-epoch checkpoints (train/checkpoint.py)
    models/<model>/metrics.jsonl one line per epoch
    models/<model>/model.pt     final (best-validation) weights, model.pt.sha256 (checked on --resume),
                                model.json training summary
    .lock                       held (flock) by the process running the run; never deleted
    cache/<model>/<context>/    embeddings per corruption x severity (resumable evaluation)
    results.json results.csv plots/*.png report.html COMPLETE
"""

from __future__ import annotations

import argparse
import difflib
import json
import platform
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from shiftguard._lock import LOCK_NAME, DirectoryInUseError, DirectoryLock
from shiftguard.io import atomic_write, atomic_write_json, atomic_write_text

from . import config as C
from .arguments import ListAction
from .rundir import COMPLETE_MARKER

__all__ = ["add_arguments", "main", "execute", "COMPLETE_MARKER"]

#: Official pre-corrupted set of each clean dataset (``shiftguard.data.load`` names).
CORRUPTED_SETS = {
    "cifar10": "cifar10-c",
    "cifar100": "cifar100-c",
    "tinyimagenet": "tinyimagenet-c",
    "mnist": "mnist-c",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        metavar="FILE",
        help="TOML config (default: the built-in MNIST LeNet comparison); "
        "a bare name picks a shipped config, e.g. --config cifar10-c-resnet18",
    )
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda, cuda:1 (default: cpu)")
    p.add_argument("--epochs", type=int, help="override the number of epochs of every model")
    p.add_argument("--seed", type=int, help="override the training seed")
    p.add_argument(
        "--adapt",
        action=ListAction,
        options=True,
        metavar="ARM",
        help="override eval.adapt: test-time adaptation arms scored side by side, space- or "
        "comma-separated, any of none, bn-batch, bn, tent, refresh (options as 'bn:prior=16', "
        "'refresh:passes=2'; docs/evaluate.md)",
    )
    p.add_argument(
        "--conformal",
        action=ListAction,
        metavar="METHOD",
        help="override eval.conformal: conformal prediction sets of every head, space- or "
        "comma-separated, some of lac, aps, raps (docs/conformal.md)",
    )
    p.add_argument("--name", help="run name (default: the config's name, else a timestamp)")
    p.add_argument("--out", default="runs", help="parent folder of run directories (default: runs)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted run (--name NAME): training from its last good checkpoint, "
        "evaluation from its cached embeddings",
    )
    p.add_argument(
        "--quick", action="store_true", help="tiny smoke run (subsets, 1 epoch, 3 corruptions x 2 severities)"
    )
    p.add_argument(
        "--threads", type=int, help='CPU threads for torch (default: torch\'s choice; docs/performance.md, "Threads")'
    )
    p.add_argument(
        "--jobs",
        type=int,
        metavar="N",
        help="override train.jobs: models trained at once, each in its own process with an equal share "
        "of the threads (CPU; 0 = auto: one per model up to the thread count; 1 = one at a time)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--list-configs", action="store_true", help="list the shipped configs and exit")
    p.add_argument(
        "--nproc",
        type=int,
        default=0,
        metavar="N",
        help="train with N processes (DistributedDataParallel; re-launches itself through torchrun). "
        "Not needed under torchrun (docs/distributed.md)",
    )


# --------------------------------------------------------------------------- config
def resolve_config(args) -> C.RunConfig:
    """The configuration ``args`` asks for: ``--config`` (a file, else a shipped name), ``--quick``,
    ``--epochs``, ``--seed``. A bare ``--config`` name that is neither a file nor a shipped config is
    a ``FileNotFoundError`` listing the shipped names (and the closest one)."""
    if args.config:
        shipped = C.shipped_configs()
        path = Path(args.config)
        if not path.exists() and args.config in shipped:
            path = shipped[args.config]
        elif not path.exists() and len(path.parts) == 1:
            close = difflib.get_close_matches(path.stem, list(shipped), n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise FileNotFoundError(
                f"--config {args.config}: not found (no such file, and no shipped config of that "
                f"name); {hint}shipped configs: {', '.join(shipped)}"
            )
        cfg = C.load_config(path)
        if args.quick:
            cfg = _shrink(cfg)
    else:
        cfg = C.quick_config() if args.quick else C.default_config()
    if args.epochs is not None:
        if args.epochs < 1:
            raise ValueError(f"--epochs: expected >= 1, got {args.epochs}")
        cfg.train.epochs = args.epochs
        for m in cfg.models:
            m.train.pop("epochs", None)
    if args.seed is not None:
        cfg.seed = args.seed
    jobs = getattr(args, "jobs", None)
    if jobs is not None:
        if jobs < 0:
            raise ValueError(f"--jobs: expected >= 0 (0 = auto), got {jobs}")
        cfg.train.jobs = jobs
    adapt = getattr(args, "adapt", None)
    if adapt is not None:
        cfg.eval.adapt = list(adapt)
    conformal = getattr(args, "conformal", None)
    if conformal is not None:
        cfg.eval.conformal = list(conformal)
    if args.quick or args.epochs is not None or args.seed is not None or adapt is not None or conformal is not None:
        # the command-line overrides pass the same checks as the file's own values
        source = cfg.source
        try:
            cfg = C.config_from_dict(cfg.to_dict(), source=source)
        except ValueError as exc:
            raise ValueError(f"{exc} (after --quick/--epochs/--seed/--adapt/--conformal)") from None
    return cfg


def _shrink(cfg: C.RunConfig) -> C.RunConfig:
    """``--quick`` on a config: same models, tiny data and grid."""
    q = C.quick_config()
    cfg.data.train_subset = min(cfg.data.train_subset or 10**9, q.data.train_subset)
    cfg.data.test_subset = min(cfg.data.test_subset or 10**9, q.data.test_subset)
    cfg.data.corruptions = cfg.data.corruptions[:2] if cfg.data.corruptions else []
    cfg.data.severities = [5]
    cfg.train.epochs, cfg.train.batch_size, cfg.train.jobs = 1, q.train.batch_size, q.train.jobs
    cfg.eval.batch_size = q.eval.batch_size
    for m in cfg.models:
        m.train = {}
    return cfg


def check_device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device: not a torch device: {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {device}: MPS is not available on this machine")
    return dev


# --------------------------------------------------------------------------- data
def _subset(ds, n: int, seed: int):
    """The first ``n`` images of a fixed random permutation (all when ``n`` is 0 or too big)."""
    if not n or n >= len(ds):
        return ds.images, ds.labels, None
    idx = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed))[:n].sort().values
    return ds.images[idx], ds.labels[idx], idx


def load_data(cfg: C.RunConfig) -> dict:
    from shiftguard import data as D

    d = cfg.data
    root = d.root or None
    if d.dataset in ("mnist-default", "default"):
        train, test = D.load_default("train"), D.load_default("test")
    else:
        try:
            train, test = D.load(d.dataset, "train", root), D.load(d.dataset, "test", root)
        except FileNotFoundError as exc:  # the loader's message spans lines and speaks Python; the CLI prints one
            from .arguments import missing_files_line

            raise FileNotFoundError(
                missing_files_line(str(exc), d.dataset, root="data.root", dataset_option="data.dataset =")
            ) from None
    if train.images.shape[1:] != test.images.shape[1:]:
        raise ValueError(f"data.dataset {d.dataset!r}: train and test images differ in shape")
    x, y, _ = _subset(train, d.train_subset, d.split_seed)
    tx, ty, test_idx = _subset(test, d.test_subset, d.split_seed + 1)
    from shiftguard.train import train_val_split

    tr, va = train_val_split(len(y), d.val_fraction, d.split_seed)
    return {
        "train": (x[tr], y[tr]),
        "val": (x[va], y[va]),
        "test": (tx, ty),
        "test_idx": test_idx,
        "num_classes": len(train.classes),
        "in_channels": int(x.shape[1]),
        "image_size": int(x.shape[-1]),
        "classes": list(train.classes),
        "name": train.name,
    }


def corruption_list(cfg: C.RunConfig) -> list[str]:
    from shiftguard import corruptions

    available = list(corruptions.names(cfg.data.suite))
    if not cfg.data.corruptions:
        return available
    for c in cfg.data.corruptions:
        if c not in available:
            raise ValueError(
                f"{cfg.source}: data.corruptions has unknown corruption {c!r} for suite "
                f"{cfg.data.suite!r}; expected one of {', '.join(available)}"
            )
    return list(cfg.data.corruptions)


def make_shift_source(
    cfg: C.RunConfig, data: dict, corruptions: list[str]
) -> tuple[Callable[[str, int], torch.Tensor], str]:
    """``(shifted(corruption, severity) -> uint8 images, source)``; source is "official" or "engine"."""
    from shiftguard import corruptions as K
    from shiftguard import data as D

    d = cfg.data
    test_x, test_y = data["test"]
    test_idx = data["test_idx"]
    official = CORRUPTED_SETS.get(data["name"]) if d.dataset not in ("mnist-default", "default") else None

    def from_official(c: str, s: int) -> torch.Tensor:
        assert official is not None  # only called when the dataset has an official corrupted set
        ds = D.load(official, "test", d.root or None, corruption=c, severity=s)
        labels = ds.labels if test_idx is None else ds.labels[test_idx]
        images = ds.images if test_idx is None else ds.images[test_idx]
        if not torch.equal(labels, test_y):
            raise ValueError(f"{official} ({c}, severity {s}): its labels do not match the clean test set's")
        return images

    def from_engine(c: str, s: int) -> torch.Tensor:
        return K.corrupt(test_x, c, s, seed=d.corruption_seed)

    if d.corrupted_source == "engine" or (official is None and d.corrupted_source == "auto"):
        return from_engine, "engine"
    if official is None:
        raise ValueError(
            f"{cfg.source}: data.corrupted_source = 'official' but {d.dataset!r} has no official corrupted set"
        )
    try:
        from_official(corruptions[0], max(d.severities))
    except FileNotFoundError:
        if d.corrupted_source == "official":
            raise
        return from_engine, "engine"
    return from_official, "official"


# --------------------------------------------------------------------------- training
def build_loss_for(m: C.ModelConfig, model, num_classes: int):
    if m.loss in C.LOGIT_LOSSES:
        if m.loss_kwargs:
            raise ValueError(f"models {m.name!r}: loss_kwargs are not used by {m.loss!r}")
        return torch.nn.CrossEntropyLoss(), "logits"
    from shiftguard.losses import build_loss

    return build_loss(m.loss, embedding_dim=model.embedding_dim, num_classes=num_classes, **m.loss_kwargs), "embeddings"


def _with_embedding_dim(model, example: torch.Tensor, m: C.ModelConfig):
    """``model``, or for an embedding loss on a model without ``embedding_dim`` (a user
    architecture) an object carrying the width of ``model.embed(example)``: what
    :func:`build_loss_for` reads. The probe runs in eval mode without gradient and restores the
    RNG and the training flag, so it changes no state the training sees."""
    if m.loss in C.LOGIT_LOSSES or hasattr(model, "embedding_dim"):
        return model
    was_training = model.training
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model.eval()
            emb = model.embed(example)
    finally:
        model.train(was_training)
    if emb.dim() != 2:
        raise ValueError(
            f"models {m.name!r}: arch {m.arch!r}: embed(x) must return (N, D) embeddings, got shape {tuple(emb.shape)}"
        )
    import types

    return types.SimpleNamespace(embedding_dim=int(emb.shape[1]))


def _load_finished(model: torch.nn.Module, loss, mdir: Path) -> dict:
    """Load a finished model's weights (and its loss module's state) from its folder; return its
    training summary. A damaged or changed file is refused with the way out."""
    from shiftguard.train.checkpoint import checksum_problem

    final, summary_path = mdir / "model.pt", mdir / "model.json"
    hint = "delete it and --resume rebuilds it from the checkpoints"
    # model.pt, then model.pt.sha256, then model.json are written in this order, so a finished
    # model always has its checksum: a missing or failing one means the weights changed.
    problem = checksum_problem(final)
    if problem is not None:
        raise ValueError(f"{final}: final weights refused, {problem}; {hint}")
    try:
        model.load_state_dict(torch.load(final, map_location="cpu", weights_only=True))
    except Exception as exc:  # damaged zip, unpickling refused, missing keys: many types
        raise ValueError(f"{final}: damaged final weights ({type(exc).__name__}); {hint}") from None
    try:
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{summary_path}: damaged training summary ({exc}); {hint}") from None
    loss_file = mdir / "loss.pt"
    if isinstance(loss, torch.nn.Module) and loss_file.is_file():
        try:
            loss.load_state_dict(torch.load(loss_file, map_location="cpu", weights_only=True))
        except Exception as exc:  # as for the weights
            raise ValueError(f"{loss_file}: damaged loss state ({type(exc).__name__}); {hint}") from None
    return summary


def train_model(
    cfg: C.RunConfig,
    m: C.ModelConfig,
    data: dict,
    run_dir: Path,
    device,
    resume: bool,
    progress: bool,
    distributed: bool = False,
):
    """Train one model (or load it when a finished run dir already has it); return ``(model, summary,
    loss)``, ``loss`` the trained loss module of an embedding loss (its learnt proxies or temperatures
    saved beside the weights as ``loss.pt``; the attacks of adversarial cells ascend it), else None.

    ``distributed``: every process of a torch.distributed job trains (DistributedTrainer); rank 0 writes."""
    from shiftguard.models import build_model
    from shiftguard.train import Trainer, to_model_input
    from shiftguard.train.checkpoint import write_checksum
    from shiftguard.train.distributed import DistributedTrainer, barrier, is_main_process

    mdir = run_dir / "models" / m.name
    torch.manual_seed(cfg.seed)
    kw = dict(m.model_kwargs)
    if m.arch == "mlp":
        kw.setdefault("input_size", data["image_size"])
    # Two images of the data's shape in the models' input range: a user model whose activations
    # are converted creates its new layers on this batch, before the trainer builds the optimizer.
    size, channels = data["image_size"], data["in_channels"]
    example = torch.rand(2, channels, size, size, generator=torch.Generator().manual_seed(0)).mul(2).sub(1)
    model = build_model(
        m.arch,
        activation=m.activation,
        num_classes=data["num_classes"],
        in_channels=data["in_channels"],
        example_input=example,
        **kw,
    )
    if m.estimator:
        from shiftguard.uncertainty import build_estimator

        model = build_estimator(m.estimator, model, num_classes=data["num_classes"], **m.estimator_kwargs)
        loss, loss_on = "model", None
    else:
        loss, loss_on = build_loss_for(m, _with_embedding_dim(model, example, m), data["num_classes"])
    if resume and _finished(run_dir, m):
        summary = _load_finished(model, loss, mdir)
        trained_loss = loss.to(device) if isinstance(loss, torch.nn.Module) and loss_on == "embeddings" else None
        return model.to(device), {**summary, "loaded_from_run_dir": True}, trained_loss
    trainer = (DistributedTrainer if distributed else Trainer)(
        model,
        loss,
        loss_on=loss_on,
        **cfg.model_train_config(m).trainer_kwargs(cfg.data.suite),
        val_batch_size=cfg.eval.batch_size,
        device=device,
        seed=cfg.seed,
        checkpoint_dir=mdir / "checkpoints",
        metrics_log=mdir / "metrics.jsonl",
        progress=progress,
        desc=m.name,
        log=True,  # one line per epoch, also with --no-progress and in a log file
    )
    summary = trainer.fit(*data["train"], *data["val"], num_classes=data["num_classes"], resume=resume)
    fit_covariance = getattr(model, "fit_covariance", None)
    if callable(fit_covariance):  # SNGP: the posterior from one pass of the training data
        train_x = data["train"][0]
        step = cfg.eval.batch_size
        fit_covariance(to_model_input(train_x[i : i + step], device) for i in range(0, len(train_x), step))
    summary.update(
        {
            "parameters": sum(p.numel() for p in model.parameters()),
            "loss_on": trainer.loss_on,
            "threads": torch.get_num_threads(),
        }
    )
    # the module the trainer optimised (moved in place by .to; a distributed wrapper holds it)
    trained_loss = loss if isinstance(loss, torch.nn.Module) and loss_on == "embeddings" else None
    if is_main_process():
        if trained_loss is not None and trained_loss.state_dict():
            atomic_write(mdir / "loss.pt", lambda fh: torch.save(trained_loss.state_dict(), fh))
        final = mdir / "model.pt"
        atomic_write(final, lambda fh: torch.save(model.state_dict(), fh))
        write_checksum(final)
        atomic_write_json(mdir / "model.json", summary)
    barrier()
    return model, summary, trained_loss


def training_jobs(cfg: C.RunConfig, device, distributed: bool, n_models: int, threads: int) -> int:
    """How many models train at once: ``train.jobs``, or for 0 (auto) one per model up to torch's
    thread count on the CPU, and 1 on other devices or under torch.distributed (where every
    process trains each model). Never more than ``n_models``.

    Raises ``ValueError`` for ``jobs > 1`` on a non-CPU device or under torch.distributed."""
    jobs = cfg.train.jobs
    one_at_a_time = distributed or torch.device(device).type != "cpu"
    if jobs > 1 and one_at_a_time:
        where = "under torch.distributed" if distributed else f"on device {device}"
        raise ValueError(
            f"{cfg.source}: train.jobs = {jobs}: models train in parallel processes on the CPU "
            f"only; {where} set jobs = 1 (or 0, auto)"
        )
    if jobs == 0:
        jobs = 1 if one_at_a_time else threads
    return max(1, min(jobs, n_models))


def _finished(run_dir: Path, m: C.ModelConfig) -> bool:
    """Whether ``run_dir`` holds the final weights and summary of ``m`` (what --resume loads)."""
    mdir = run_dir / "models" / m.name
    return (mdir / "model.pt").is_file() and (mdir / "model.json").is_file()


def _train_worker(
    cfg: C.RunConfig, index: int, data: dict, run_dir: Path, resume: bool, threads: int
) -> tuple[dict, float]:
    """One model trained with ``threads`` torch threads (in a worker process, or in the parent); returns
    its summary and seconds. Its weights reach the parent through the run directory (as a finished
    model of --resume)."""
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    _, summary, _ = train_model(cfg, cfg.models[index], data, run_dir, torch.device("cpu"), resume, progress=False)
    return summary, time.perf_counter() - t0


def train_models(
    cfg: C.RunConfig,
    data: dict,
    run_dir: Path,
    device,
    resume: bool,
    progress: bool,
    distributed: bool,
    log: Callable[[str], None],
) -> tuple[dict, dict, dict, dict]:
    """Train every model of ``cfg`` (or load the finished ones on ``resume``); return ``(models,
    training summaries, trained losses, timings)`` keyed by model name, ``timings`` with
    ``train_s`` (seconds per model), ``train_wall_s`` and ``train_jobs``.

    With ``jobs`` > 1 (:func:`training_jobs`) the models still to train are trained that many at
    a time, each with ``threads // jobs`` torch threads: the first in this process, the others in
    ``jobs - 1`` spawned ones (small models use two threads far less than twice as well as one:
    docs/performance.md, "The default run"); models with QACT come first, their epochs cost about
    twice a ReLU model's. Each model is trained by the same code, from the same seed, as in one
    process with that thread count, and its weights come back through the run directory. Its
    epoch lines are printed as they come, without progress bars."""
    t_start = time.perf_counter()
    threads = torch.get_num_threads()
    pending = [i for i, m in enumerate(cfg.models) if not (resume and _finished(run_dir, m))]
    jobs = training_jobs(cfg, device, distributed, len(pending), threads)
    train_s: dict[str, float] = {}
    summaries: dict[str, dict] = {}

    def report(m: C.ModelConfig, summary: dict) -> None:
        log(
            f"  trained {m.name}: best val acc {summary['best_val_acc']:.4f} at epoch {summary['best_epoch']} "
            f"({summary['epochs_run']} epochs, {train_s[m.name]:.1f} s)"
        )

    if jobs > 1:
        import concurrent.futures as cf

        import torch.multiprocessing as tmp

        from shiftguard.nn.qact import ACTIVATION_REGISTRY

        def qact_first(i: int) -> int:
            act = cfg.models[i].activation
            return 0 if act in ACTIVATION_REGISTRY and ACTIVATION_REGISTRY.canonical(act) == "qact" else 1

        per_job = max(1, threads // jobs)
        first, *rest = sorted(pending, key=qact_first)
        with cf.ProcessPoolExecutor(max_workers=jobs - 1, mp_context=tmp.get_context("spawn")) as pool:
            futures = {pool.submit(_train_worker, cfg, i, data, run_dir, resume, per_job): i for i in rest}
            try:
                # this process trains the first model meanwhile, with the same share of the threads
                # (the workers spend their first seconds importing)
                m = cfg.models[first]
                summaries[m.name], train_s[m.name] = _train_worker(cfg, first, data, run_dir, resume, per_job)
                report(m, summaries[m.name])
                for fut in cf.as_completed(futures):
                    m = cfg.models[futures[fut]]
                    try:
                        summaries[m.name], train_s[m.name] = fut.result()
                    except cf.process.BrokenProcessPool:
                        raise RuntimeError(
                            f"training {m.name}: a training process ended abnormally (killed, or out "
                            "of memory); --resume continues from the last checkpoints"
                        ) from None
                    report(m, summaries[m.name])
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
            finally:
                torch.set_num_threads(threads)
    trained: dict[str, torch.nn.Module] = {}
    training: dict[str, dict] = {}
    attack_losses: dict[str, Any] = {}
    for m in cfg.models:
        t0 = time.perf_counter()
        # trained by a worker: its final weights are loaded like a finished model of --resume
        loads = resume or m.name in summaries
        model, summary, attack_losses[m.name] = train_model(cfg, m, data, run_dir, device, loads, progress, distributed)
        if m.name in summaries:
            summary = summaries[m.name]
        else:
            train_s[m.name] = time.perf_counter() - t0
            report(m, summary)
        trained[m.name], training[m.name] = model, summary
    timings = {
        "train_s": {m.name: train_s[m.name] for m in cfg.models},
        "train_jobs": jobs,
        "train_wall_s": time.perf_counter() - t_start,
    }
    return trained, training, attack_losses, timings


def preflight(cfg: C.RunConfig) -> None:
    """Check every name in the config (dataset, corruptions, models, losses) before anything is
    written or trained, so a typo costs one clear line, not a half-made run directory."""
    from shiftguard import data as D
    from shiftguard.losses import LOSS_NAMES
    from shiftguard.models import build_model

    src = cfg.source
    if cfg.data.dataset not in ("mnist-default", "default"):
        canon = lambda n: n.lower().replace("_", "-")
        if canon(cfg.data.dataset) not in {canon(n) for n in D.names()}:
            raise ValueError(
                f"{src}: data.dataset: unknown dataset {cfg.data.dataset!r}; "
                "expected mnist-default or one of "
                f"{', '.join(D.names())}"
            )
    corruption_list(cfg)
    for m in cfg.models:
        try:  # a 2-class dummy build checks the arch, activation and model_kwargs at no cost
            model = build_model(m.arch, activation=m.activation, num_classes=2, in_channels=1, **m.model_kwargs)
            if m.estimator:
                from shiftguard.uncertainty import build_estimator

                build_estimator(m.estimator, model, num_classes=2, **m.estimator_kwargs)
        except ValueError as exc:
            raise ValueError(f"{src}: models {m.name!r}: {exc}") from None
        if m.loss not in C.LOGIT_LOSSES and not callable(getattr(model, "embed", None)):
            raise ValueError(
                f"{src}: models {m.name!r}: loss {m.loss!r} acts on embeddings, but arch {m.arch!r} "
                "has no embed(x) method; give the model one (images -> (N, D) embeddings) or use "
                f"loss = {C.LOGIT_LOSSES[0]!r}"
            )
        if m.loss not in C.LOGIT_LOSSES and m.loss not in LOSS_NAMES:
            raise ValueError(
                f"{src}: models {m.name!r}: unknown loss {m.loss!r}; expected one of "
                f"{', '.join(sorted({*C.LOGIT_LOSSES, *LOSS_NAMES}))}"
            )
        if m.loss not in C.LOGIT_LOSSES:  # a dummy build checks loss_kwargs before anything is written
            from shiftguard.losses import build_loss

            try:
                build_loss(m.loss, embedding_dim=16, num_classes=10, **m.loss_kwargs)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{src}: models {m.name!r}: loss {m.loss!r}: {exc}") from None


# --------------------------------------------------------------------------- run dir
def prepare_run_dir(cfg: C.RunConfig, args) -> Path:
    """:func:`claim_run_dir` with the lock released on return: the run directory created (or
    checked for ``--resume``) as one step, for a tool that does not then run the job in it. A
    process that runs the job uses :func:`claim_run_dir` and holds the lock until it ends."""
    run_dir, lock = claim_run_dir(cfg, args)
    lock.release()
    return run_dir


def claim_run_dir(cfg: C.RunConfig, args) -> tuple[Path, DirectoryLock]:
    """Create the run directory ``args.out / name`` (or, with ``args.resume``, check it against
    ``cfg``) and return it with its exclusive lock (``<run>/.lock``) held.

    The caller keeps the lock for the run's whole lifetime and then calls ``lock.release()``; a
    process that dies releases it too. The lock is taken before the directory's content is looked
    at, so the check for an earlier run and the ``config.json`` write are one step: of several
    processes started with the same name exactly one proceeds. Raises
    :class:`~shiftguard._lock.DirectoryInUseError` while another process holds the lock (also for
    ``--resume`` of a run still running), ``ValueError`` for a bad name, an existing run without
    ``--resume`` or a different configuration, ``FileNotFoundError`` for ``--resume`` of nothing,
    and the ``OSError`` of a directory that cannot be created."""
    name = args.name or cfg.name or datetime.now().strftime("%Y%m%d-%H%M%S")
    if not C._NAME_RE.match(name):
        raise ValueError(f"--name: use letters, digits and _.+- only, got {name!r}")
    if args.resume and not (args.name or cfg.name):
        raise ValueError("--resume: give the run's --name")
    run_dir = Path(args.out) / name
    if args.resume:
        if not run_dir.is_dir():
            raise FileNotFoundError(f"--resume: run directory {run_dir} does not exist")
    else:
        if run_dir.exists() and not run_dir.is_dir():
            raise ValueError(f"--name: {run_dir} exists and is not a directory")
        run_dir.mkdir(parents=True, exist_ok=True)
    lock = DirectoryLock(run_dir).acquire()
    try:
        _check_run_dir(cfg, run_dir, args.resume)
    except BaseException:
        lock.release()
        raise
    return run_dir, lock


def _check_run_dir(cfg: C.RunConfig, run_dir: Path, resume: bool) -> None:
    """Under the run directory's lock: check ``run_dir`` for ``--resume`` (same configuration; the
    ``COMPLETE`` marker removed), else check that it holds no earlier run and write ``config.json``."""
    stored = run_dir / "config.json"
    if resume:
        if not stored.is_file():
            raise ValueError(f"--resume: {run_dir} is not a shiftguard run directory (no config.json)")
        try:
            old = json.loads(stored.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise ValueError(f"--resume: {stored} is damaged ({type(exc).__name__}: {exc})") from None
        if not isinstance(old, dict) or not isinstance(old.get("config"), dict):
            raise ValueError(f"--resume: {stored} is damaged (no configuration table)")
        new = _jsonable(cfg.to_dict())
        # how many models train at once is how the run is computed, like --threads, not what it computes
        for tree in (old["config"], new):
            if isinstance(tree.get("train"), dict):
                tree["train"].pop("jobs", None)
        if old["config"] != new:
            diff = C.config_diff(old["config"], new)
            shown = "; ".join(diff[:8]) + (f"; and {len(diff) - 8} more" if len(diff) > 8 else "")
            raise ValueError(
                f"--resume: {run_dir} was started with a different configuration: {shown} "
                f"(stored -> now; see {stored}: the same --config/--quick/--epochs/--seed are needed "
                "to resume)"
            )
        try:
            (run_dir / COMPLETE_MARKER).unlink()
        except FileNotFoundError:
            pass
        return
    if any(p.name != LOCK_NAME for p in run_dir.iterdir()):
        if _run_outputs(run_dir):
            raise ValueError(f"run directory {run_dir} already exists; use --resume to continue it or another --name")
        # Nothing a run produces is there (no checkpoint, weights, cache or results): a run that
        # stopped before its first checkpoint. Its config.json is replaced by this run's.
        print(
            f"reusing run directory {run_dir}: it holds only the config.json of a run that stopped before its "
            "first checkpoint",
            flush=True,
        )
    atomic_write_json(stored, {"config": _jsonable(cfg.to_dict()), "source": cfg.source})


def _run_outputs(run_dir: Path) -> list[Path]:
    """Files under ``run_dir`` that a run produced beyond its ``config.json`` (and that file's
    atomic-write temporaries) and its lock file: any checkpoint, metrics log, weights, cached
    embedding or result."""
    own = lambda p: (
        p.parent == run_dir
        and (p.name in ("config.json", LOCK_NAME) or (p.name.startswith(".config.json.") and p.name.endswith(".tmp")))
    )
    return [p for p in run_dir.rglob("*") if not p.is_dir() and not own(p)]


def _jsonable(obj):
    return json.loads(json.dumps(obj))


def versions() -> dict:
    import numpy
    import sklearn

    from shiftguard._version import __version__

    return {
        "shiftguard": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "scikit-learn": sklearn.__version__,
        "platform": platform.platform(),
    }


# --------------------------------------------------------------------------- main
def write_gallery(
    path: Path, test_images: torch.Tensor, corruptions: list[str], cfg: C.RunConfig, source: str, shifted
) -> Path:
    """The corruption gallery: one test image under every corruption x severity."""
    from shiftguard.evaluation import plots as P

    sevs = sorted(cfg.data.severities)
    if source == "engine":
        return P.corruption_gallery(test_images[:1], corruptions, sevs, path, seed=cfg.data.corruption_seed)
    # official sets: show their images (first test image), not the engine's

    plt = P.pyplot()
    fig, axes = plt.subplots(
        len(corruptions), len(sevs) + 1, figsize=(1.1 * (len(sevs) + 1), 1.1 * len(corruptions)), squeeze=False
    )
    for i, c in enumerate(corruptions):
        for j, s in enumerate([0, *sevs]):
            img = (test_images if s == 0 else shifted(c, s))[0].permute(1, 2, 0).numpy()
            axes[i, j].imshow(img[..., 0] if img.shape[-1] == 1 else img, cmap="gray" if img.shape[-1] == 1 else None)
            axes[i, j].set_xticks([])
            axes[i, j].set_yticks([])
            if j == 0:
                axes[i, j].set_ylabel(c, fontsize=6, rotation=0, ha="right")
    return P.save_png(fig, path)


def _run_results(results: dict, cfg: C.RunConfig, data: dict, source: str, training: dict, timings: dict) -> dict:
    """An evaluation's results as a run's: the training provenance, the run's data, config,
    versions and command, its timings (the evaluation's own kept as ``evaluate_detail`` and
    ``evaluate_compile_s``) and the summary rows."""
    from shiftguard.evaluation.report import summary_rows

    results["kind"] = "run"
    # the models' training images (the heads' support may be a capped subset of them: n_support)
    results["data"].update(
        {"dataset": data["name"], "corruption_source": source, "n_train": int(data["train"][1].numel())}
    )
    timings["evaluate_detail"] = results["timings"]["evaluate_detail"]
    timings["evaluate_compile_s"] = results["timings"].get("compile_s", 0.0)
    results.update(
        {
            "config": _jsonable(cfg.to_dict()),
            "config_source": cfg.source,
            "versions": versions(),
            "command": " ".join(["shiftguard", *sys.argv[1:]]) if sys.argv and "shiftguard" in sys.argv[0] else None,
            "training": training,
            "timings": timings,  # total_s is set by the caller once the report is written
        }
    )
    results["summary"] = summary_rows(results)
    return results


def execute(
    cfg: C.RunConfig,
    run_dir: Path,
    device: torch.device,
    resume: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = print,
    compile_s: float = 0.0,
    data: Optional[dict] = None,
) -> dict:
    """Run the whole pipeline into ``run_dir`` and return the results dict.

    Training is this module's; the evaluation is :func:`shiftguard.evaluate`, called with the
    trained models, the models' own input scaling (pixels to [-1, 1]) as ``preprocess``, the
    run's corrupted test sets (engine or official files) as ``shifted`` and ``run_dir/cache`` as
    its output cache. ``compile_s``: seconds spent compiling kernels before (recorded apart from
    the training time). Under torch.distributed every process trains, then every process
    evaluates its share of the grid (``evaluate(distributed=True)``: the same results as one
    process) on rank 0's weights; rank 0 alone writes the results and the report, the others
    return ``{}`` after waiting for it at a barrier (docs/distributed.md)."""
    from shiftguard.evaluation import evaluate
    from shiftguard.evaluation.report import build_report, format_summary
    from shiftguard.train import to_model_input
    from shiftguard.train.distributed import barrier, broadcast_module, is_distributed, is_main_process

    distributed = is_distributed()
    if not is_main_process():
        log = lambda s: None

    t_start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    corruptions = corruption_list(cfg)
    data = load_data(cfg) if data is None else data
    shifted, source = make_shift_source(cfg, data, corruptions)
    log(
        f"shiftguard run: {run_dir}  (data {cfg.data.dataset}: {len(data['train'][1])} train / "
        f"{len(data['val'][1])} val / {len(data['test'][1])} test; {len(corruptions)} corruptions x severities "
        f"{cfg.data.severities}, {source}; device {device})"
    )

    e = cfg.eval
    timings: dict[str, Any] = {"compile_s": compile_s, "evaluate_s": 0.0}
    trained, training, attack_losses, train_timings = train_models(
        cfg, data, run_dir, device, resume, progress, distributed, log
    )
    timings.update(train_timings)

    t0 = time.perf_counter()
    if distributed:
        # Every process evaluates exactly the weights rank 0 wrote (per-process BatchNorm
        # statistics on CPU would otherwise make the shares of the grid come from different models).
        for model in trained.values():
            broadcast_module(model)
    support = data["train"]
    if e.max_support and support[1].numel() > e.max_support:
        support = (support[0][: e.max_support], support[1][: e.max_support])
    evaluated = evaluate(
        trained,
        data["test"],
        support=support,
        validation=data["val"],
        suite=cfg.data.suite,
        corruptions=corruptions,
        severities=cfg.data.severities,
        heads={m.name: list(m.heads) for m in cfg.models},
        preprocess=to_model_input,
        baseline_key=C.baseline_key(cfg),
        device=device,
        seed=cfg.seed,
        shifted=shifted,
        attack_loss=attack_losses if e.attacks else None,
        name=run_dir.name,
        cache_dir=run_dir / "cache",
        progress=progress,
        distributed=distributed,
        **e.evaluate_kwargs(),
    )
    if not is_main_process():
        barrier()  # rank 0 writes the report
        return {}
    timings["evaluate_s"] = time.perf_counter() - t0
    results = _run_results(evaluated.results, cfg, data, source, training, timings)
    timings["total_s"] = time.perf_counter() - t_start
    write_gallery(run_dir / "plots" / "corruption_gallery.png", data["test"][0], corruptions, cfg, source, shifted)
    build_report(run_dir, results, progress=progress)
    # results.json says "complete" only once every artefact exists; COMPLETE is the very last write.
    atomic_write_json(run_dir / "results.json", results)
    atomic_write_text(run_dir / COMPLETE_MARKER, results["created"] + "\n")
    log("")
    log(format_summary(results))
    log(f"\nwrote {run_dir}/ (results.json, results.csv, plots/, report.html) in {timings['total_s']:.0f} s")
    if distributed:
        barrier()
    return results


def main(args) -> int:
    if getattr(args, "list_configs", False):
        for name, path in C.shipped_configs().items():
            print(f"{name:<28} {path}")
        return 0
    cfg = resolve_config(args)
    device = check_device(args.device)
    preflight(cfg)
    # missing or damaged dataset files (and official corrupted sets asked for but absent) end the run
    # before its directory exists
    data = load_data(cfg)
    make_shift_source(cfg, data, corruption_list(cfg))
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads: expected >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    from shiftguard.train import distributed as D

    nproc = getattr(args, "nproc", 0) or 0
    if nproc < 0:
        raise ValueError(f"--nproc: expected a positive number of processes, got {nproc}")
    if nproc > 1 and not D.launched_by_torchrun():
        # Re-launch through torchrun; every worker gets the same run name.
        args.name = args.name or cfg.name or datetime.now().strftime("%Y%m%d-%H%M%S")
        return D.launch(["run", *relaunch_argv(args)], nproc)
    info = D.init_distributed(device)
    lock = None
    try:
        # Rank 0 creates (or checks) the run directory and alone holds its lock until the run ends;
        # the others take its path or its error.
        outcome, error = None, None
        if info.is_main:
            try:
                run_dir, lock = claim_run_dir(cfg, args)
                outcome = ("ok", str(run_dir))
            except (ValueError, DirectoryInUseError, OSError) as exc:
                outcome, error = ("error", str(exc)), exc
        status, value = D.broadcast_object(outcome)
        if status == "error":
            if error is not None:
                raise error
            raise ValueError(value)
        progress = not args.no_progress and info.is_main
        log = lambda s: print(s, flush=True)
        # Before execute: the compile time is its own step, outside every training time.
        compile_s = compile_kernels(cfg, info.device, announce=info.is_main)
        execute(
            cfg,
            Path(value),
            info.device,
            resume=args.resume,
            progress=progress,
            log=log,
            compile_s=compile_s,
            data=data,
        )
    finally:
        if lock is not None:
            lock.release()
        if info.distributed:
            D.cleanup_distributed()
    return 0


def compile_kernels(cfg: C.RunConfig, device, announce: bool = True) -> float:
    """Compile the CPU kernels the run will call before any training; return the seconds it took
    (a fraction of a second once numba's on-disk cache holds them):

    - QACT's (:func:`shiftguard.functional.warm_up`) when a model of ``cfg`` has
      ``activation = "qact"`` and ``device`` is the CPU;
    - the corruption engine's for ``cfg.data.suite`` on uint8 images
      (:func:`shiftguard.corruptions.warm_up`), unless ``data.corrupted_source = "official"`` (the
      corrupted test sets are then read from disk, not generated);
    - the kNN search's selection step (:func:`shiftguard.neighbors.warm_up`): every evaluation
      searches the float32 embeddings on the CPU (kNN heads, retrieval scores);
    - the watershed loss's forest growing (:func:`shiftguard.losses.watershed.warm_up`) when a model
      trains with ``loss = "watershed"``;
    - the 2 x 2 max pooling's pass for training (:func:`shiftguard.functional.pool.warm_up`) on the
      CPU: the shipped LeNet and VGG pool with it.

    With ``announce``, a step that lasts over a second prints ``compiling kernels (first use) ...``
    when that second has passed and its duration when done, on one line of stdout."""
    steps: list[Callable[[], float]] = []
    from shiftguard.nn.qact import ACTIVATION_REGISTRY

    def canonical(name: str) -> str:
        return ACTIVATION_REGISTRY.canonical(name) if name in ACTIVATION_REGISTRY else name

    if torch.device(device).type == "cpu" and any(canonical(m.activation) == "qact" for m in cfg.models):
        from shiftguard.functional import warm_up as qact_warm_up

        steps.append(qact_warm_up)
    if cfg.data.corrupted_source != "official":
        from shiftguard import corruptions as K

        steps.append(lambda: K.warm_up(dtypes=(torch.uint8,), suites=(cfg.data.suite,)))
    from shiftguard import neighbors as NB

    steps.append(NB.warm_up)
    if torch.device(device).type == "cpu":
        from shiftguard.functional import pool

        steps.append(pool.warm_up)
    if any(m.loss.lower() == "watershed" for m in cfg.models):
        from shiftguard.losses import watershed

        steps.append(watershed.warm_up)

    from shiftguard.evaluation.warmup import compile_announced

    return compile_announced(steps, announce)


def relaunch_argv(args) -> list[str]:
    """The options in ``args`` that differ from their defaults, as ``shiftguard run`` arguments
    (without ``--nproc``): what each torchrun worker is started with."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = []
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "nproc"):
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default or value is None:
            continue
        flag = action.option_strings[-1] if action.option_strings[-1].startswith("--") else action.option_strings[0]
        if action.nargs == 0:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv
