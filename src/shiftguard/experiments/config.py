"""The ``shiftguard run`` configuration: a strict TOML schema.

A config file has four tables and an array of model tables::

    name = "mnist-c-lenet"          # optional run name (default: a timestamp)
    seed = 0                        # training seed (the 80:20 split uses data.split_seed)

    [data]                          # what to train on and which shifts to evaluate
    [train]                         # optimiser, schedule, early stopping (000, App. B)
    [eval]                          # heads, QACT context, metrics
    [[models]]                      # one entry per trained variant
    arch = "lenet"; activation = "qact"; loss = "watershed"; heads = ["quantile", "ned", "knn"]

Every key is declared below with its type and default; an unknown key, a wrong type or a bad
value is a ``ValueError`` that names the key and the file. ``load_config(path)`` reads a file,
``default_config()`` is what ``shiftguard run`` uses without ``--config``.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, get_args, get_origin, get_type_hints

from shiftguard.heads.registry import HEAD_NAMES  # the heads [[models]].heads may name

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = [
    "DataConfig", "TrainConfig", "EvalConfig", "ModelConfig", "RunConfig",
    "load_config", "config_from_dict", "default_config", "quick_config", "shipped_configs", "config_diff",
    "HEAD_NAMES", "LOGIT_LOSSES",
]

#: Losses computed on the logits ``model(x)``; every other loss acts on ``model.embed(x)``.
LOGIT_LOSSES = ("cross_entropy",)


@dataclass
class DataConfig:
    #: "mnist-default" = the embedded MNIST subset (offline); otherwise a ``shiftguard.data.load`` name.
    dataset: str = "mnist-default"
    #: folder of the dataset files ("" = the loader's default location).
    root: str = ""
    #: corruption suite of ``shiftguard.corruptions.names`` ("mnist-c" or "cifar-c").
    suite: str = "mnist-c"
    #: corruptions to evaluate ([] = every corruption of the suite).
    corruptions: list = field(default_factory=list)
    #: severities to evaluate besides the clean test set (severity 0).
    severities: list = field(default_factory=lambda: [1, 2, 3, 4, 5])
    #: "auto": official pre-corrupted sets when ``shiftguard.data.load(..., corruption=)`` finds
    #: them, the corruption engine otherwise; "engine" / "official" force one of the two.
    corrupted_source: str = "auto"
    #: use only N training / test images (a fixed random subset, seeded by split_seed); 0 = all.
    train_subset: int = 0
    test_subset: int = 0
    #: fraction of the training set held out for validation; 000 App. B uses 80:20 with seed 42.
    val_fraction: float = 0.2
    split_seed: int = 42
    #: seed of the corruption engine.
    corruption_seed: int = 0


@dataclass
class TrainConfig:
    epochs: int = 10
    batch_size: int = 128
    #: 000 App. B: Adam, initial learning rate 1e-3.
    lr: float = 1e-3
    weight_decay: float = 0.0
    #: 000 App. B: ReduceLROnPlateau(factor=0.1, patience=50, cooldown=10, threshold=0.01,
    #: threshold_mode="abs", min_lr=1e-6) on validation accuracy.
    lr_factor: float = 0.1
    lr_patience: int = 50
    lr_cooldown: int = 10
    lr_threshold: float = 0.01
    min_lr: float = 1e-6
    #: 000 App. B: stop when validation accuracy does not improve by 0.001 (for this many epochs).
    early_stopping_patience: int = 5
    early_stopping_min_delta: float = 0.001
    #: draw batches with an equal number of images per class (some embedding losses need it).
    class_balanced: bool = False
    #: images per class in a class-balanced batch (002, Sec. 5.3.2 uses 4).
    samples_per_class: int = 4
    #: > 0: multistage back-propagation in chunks of this size (002, Sec. 5.3.2; embedding losses).
    chunk_size: int = 0
    #: evaluate validation every epoch on at most this many images (0 = the whole split).
    max_val: int = 0


@dataclass
class EvalConfig:
    #: test batch size = the context QACT sees at inference (000, Sec. 3 "context").
    batch_size: int = 1000
    #: also evaluate QACT models with a frozen (training-set) context.
    frozen_context: bool = True
    #: neighbours used by NED / kNN heads.
    k: int = 10
    #: ks of the retrieval metrics (MAP@K, Recall@K).
    retrieval_ks: list = field(default_factory=lambda: [1, 5])
    #: bins of the expected calibration error.
    ece_bins: int = 15
    #: fit heads on at most this many training embeddings (0 = all).
    max_support: int = 0
    #: bootstrap resamples of the 95% intervals of the headline numbers (over test images).
    n_boot: int = 1000


@dataclass
class ModelConfig:
    #: identifier of the variant in results and plots (default: "<arch>-<activation>-<loss>").
    name: str = ""
    #: a ``shiftguard.models`` name, or a user factory ``"package.module:function"`` (importable from
    #: sys.path or the current directory; ``shiftguard.models.build_model``).
    arch: str = "lenet"
    #: relu | prelu | selu | qact. A user factory that takes no ``activation`` argument gets its
    #: activation modules converted (``shiftguard.nn.convert_activations``) unless this is "relu".
    activation: str = "relu"
    #: "cross_entropy" (on logits) or any ``shiftguard.losses.build_loss`` name (on embeddings).
    loss: str = "cross_entropy"
    heads: list = field(default_factory=lambda: ["logistic"])
    #: extra keywords for ``build_model`` (embedding_dim, width, growth_rate, ...).
    model_kwargs: dict = field(default_factory=dict)
    #: extra keywords for ``build_loss``.
    loss_kwargs: dict = field(default_factory=dict)
    #: per-model overrides of [train] keys (e.g. epochs, batch_size).
    train: dict = field(default_factory=dict)


@dataclass
class RunConfig:
    name: str = ""
    seed: int = 0
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    models: list = field(default_factory=list)  # list[ModelConfig]
    #: where the config came from (not a TOML key).
    source: str = field(default="<defaults>", metadata={"internal": True})

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("source")
        return d

    def model_train_config(self, m: ModelConfig) -> TrainConfig:
        """``[train]`` with the model's own overrides applied."""
        return dataclasses.replace(self.train, **m.train)


_SECTIONS = {"data": DataConfig, "train": TrainConfig, "eval": EvalConfig}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")


def _type_ok(value: Any, typ: Any) -> bool:
    origin = get_origin(typ)
    if origin is not None and type(None) in get_args(typ):  # Optional[X]
        return value is None or _type_ok(value, [a for a in get_args(typ) if a is not type(None)][0])
    if typ is bool:
        return isinstance(value, bool)
    if typ is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if typ is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if typ is list:
        return isinstance(value, list)
    if typ is dict:
        return isinstance(value, dict)
    return isinstance(value, typ)


def _build(cls, table: Any, where: str, src: str):
    if not isinstance(table, dict):
        raise ValueError(f"{src}: [{where}] must be a table, got {type(table).__name__}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    kwargs = {}
    for key, value in table.items():
        if key not in fields:
            raise ValueError(
                f"{src}: unknown key {where + '.' if where else ''}{key!r}; "
                f"allowed keys: {', '.join(sorted(fields))}"
            )
        typ = hints[key]
        if not _type_ok(value, typ):
            tname = getattr(typ, "__name__", str(typ))
            raise ValueError(f"{src}: key {where + '.' if where else ''}{key} must be {tname}, got {value!r}")
        kwargs[key] = float(value) if typ is float else value
    return cls(**kwargs)


def _check_values(cfg: RunConfig, src: str) -> None:
    def bad(key, msg):
        raise ValueError(f"{src}: key {key} {msg}")

    d, t, e = cfg.data, cfg.train, cfg.eval
    if not 0.0 < d.val_fraction < 1.0:
        bad("data.val_fraction", f"must be in (0, 1), got {d.val_fraction}")
    if d.corrupted_source not in ("auto", "engine", "official"):
        bad("data.corrupted_source", f"must be 'auto', 'engine' or 'official', got {d.corrupted_source!r}")
    if any((not isinstance(s, int)) or isinstance(s, bool) or not 1 <= s <= 5 for s in d.severities):
        bad("data.severities", f"must be integers in 1..5, got {d.severities}")
    if any(not isinstance(c, str) for c in d.corruptions):
        bad("data.corruptions", f"must be a list of names, got {d.corruptions}")
    for k in ("train_subset", "test_subset"):
        if getattr(d, k) < 0:
            bad(f"data.{k}", "must be >= 0")
    for k in ("epochs", "batch_size"):
        if getattr(t, k) < 1:
            bad(f"train.{k}", f"must be >= 1, got {getattr(t, k)}")
    if t.lr <= 0:
        bad("train.lr", f"must be > 0, got {t.lr}")
    if e.batch_size < 2:
        bad("eval.batch_size", f"must be >= 2 (QACT needs a context), got {e.batch_size}")
    if e.k < 1 or e.ece_bins < 1:
        bad("eval.k / eval.ece_bins", "must be >= 1")
    if e.n_boot < 10:
        bad("eval.n_boot", f"must be >= 10, got {e.n_boot}")
    for key, values in (("data.severities", d.severities), ("data.corruptions", d.corruptions)):
        dup = sorted({v for v in values if values.count(v) > 1}, key=str)
        if dup:
            bad(key, f"lists {', '.join(map(repr, dup))} more than once (duplicates would re-weight the means)")
    if not cfg.models:
        raise ValueError(f"{src}: no [[models]] given; add at least one model table")
    seen = set()
    train_keys = {f.name for f in dataclasses.fields(TrainConfig)}
    for i, m in enumerate(cfg.models):
        where = f"models[{i}]"
        if not m.name:  # a factory "pkg.mod:make" names its models "pkg.mod.make-<activation>-<loss>"
            m.name = f"{m.arch.replace(':', '.')}-{m.activation}-{m.loss.replace('_', '')}"
        if not _NAME_RE.match(m.name):
            bad(f"{where}.name", f"must be letters, digits and _.+- only, got {m.name!r}")
        if m.name in seen:
            bad(f"{where}.name", f"{m.name!r} is used twice; model names must be unique")
        seen.add(m.name)
        if not m.heads:
            bad(f"{where}.heads", "must name at least one head")
        for h in m.heads:
            if h not in HEAD_NAMES:
                bad(f"{where}.heads", f"has unknown head {h!r}; expected one of {', '.join(HEAD_NAMES)}")
        for h in ("softmax", "temperature"):
            if h in m.heads and m.loss not in LOGIT_LOSSES:
                bad(f"{where}.heads", f"{h!r} uses the model's trained classifier and needs a logit loss "
                                      f"({', '.join(LOGIT_LOSSES)}), not {m.loss!r}")
        for k, v in m.train.items():
            if k not in train_keys:
                bad(f"{where}.train.{k}", f"is unknown; allowed keys: {', '.join(sorted(train_keys))}")
            if not _type_ok(v, get_type_hints(TrainConfig)[k]):
                bad(f"{where}.train.{k}", f"has the wrong type: {v!r}")


def config_from_dict(raw: dict, source: str = "<dict>") -> RunConfig:
    """Validate a parsed TOML document and build a :class:`RunConfig` (strict: unknown keys fail)."""
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: expected a table at the top level")
    top = {f.name for f in dataclasses.fields(RunConfig) if not f.metadata.get("internal")}
    for key in raw:
        if key not in top:
            raise ValueError(f"{source}: unknown key {key!r}; allowed top-level keys: {', '.join(sorted(top))}")
    cfg = RunConfig(source=source)
    if "name" in raw:
        if not isinstance(raw["name"], str):
            raise ValueError(f"{source}: key name must be a string")
        cfg.name = raw["name"]
    if "seed" in raw:
        if not _type_ok(raw["seed"], int):
            raise ValueError(f"{source}: key seed must be an integer")
        cfg.seed = raw["seed"]
    for sec, cls in _SECTIONS.items():
        if sec in raw:
            setattr(cfg, sec, _build(cls, raw[sec], sec, source))
    models = raw.get("models", [])
    if not isinstance(models, list):
        raise ValueError(f"{source}: models must be an array of tables ([[models]])")
    cfg.models = [_build(ModelConfig, m, f"models[{i}]", source) for i, m in enumerate(models)]
    _check_values(cfg, source)
    return cfg


def load_config(path: str | os.PathLike) -> RunConfig:
    """Read and validate a TOML config; errors name the file (and the key)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file not found: {p}")
    try:
        raw = tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{p}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{p}: not valid TOML: not UTF-8 text ({exc})") from None
    return config_from_dict(raw, source=str(p))


def default_config() -> RunConfig:
    """The ``shiftguard run`` default: embedded MNIST, LeNet ReLU+CE vs LeNet QACT+watershed,
    all 15 MNIST-C corruptions x 5 severities, budgeted for < 10 min on 2 CPU cores."""
    return config_from_dict(_DEFAULT, source="<default>")


def quick_config() -> RunConfig:
    """A tiny smoke run (tests, ``--quick``): small subsets, 1 epoch, 3 corruptions x 2 severities."""
    raw = {**_DEFAULT}
    raw["data"] = {**_DEFAULT["data"], "train_subset": 500, "test_subset": 200,
                   "corruptions": ["shot_noise", "rotate", "fog"], "severities": [1, 5]}
    raw["train"] = {**_DEFAULT["train"], "epochs": 1, "batch_size": 100}
    raw["models"] = [{**m, "train": {}} for m in _DEFAULT["models"]]
    raw["eval"] = {**_DEFAULT["eval"], "batch_size": 100, "retrieval_ks": [1, 5]}
    return config_from_dict(raw, source="<quick>")


# Budget (measured, see docs/run.md): QACT costs ~4x ReLU per training batch and ~10x per
# test image in batch context (it sorts every channel's context), so the default trains on
# 3,000 of the 10,000 embedded training images and tests on 1,000 (100 per digit) images per
# corruption x severity, which keeps `shiftguard run` within minutes on 2 CPU cores.
_DEFAULT: dict = {
    "data": {"dataset": "mnist-default", "suite": "mnist-c", "severities": [1, 2, 3, 4, 5],
             "train_subset": 3000, "test_subset": 1000},
    "train": {"epochs": 8, "batch_size": 256, "early_stopping_patience": 3},
    "eval": {"batch_size": 500, "frozen_context": True, "k": 10, "retrieval_ks": [1, 5]},
    "models": [
        # ReLU steps are cheap: smaller batches and more epochs bring it to its plateau too.
        {"name": "lenet-relu-ce", "arch": "lenet", "activation": "relu", "loss": "cross_entropy",
         "heads": ["logistic", "softmax", "temperature", "ned", "knn"], "train": {"batch_size": 128, "epochs": 15}},
        {"name": "lenet-qact-watershed", "arch": "lenet", "activation": "qact", "loss": "watershed",
         "heads": ["quantile", "logistic", "ned", "knn"]},
    ],
}


def config_diff(old: Any, new: Any, path: str = "") -> list[str]:
    """Where two configuration trees (``RunConfig.to_dict()`` after a JSON round trip) differ.

    One ``"path: old -> new"`` string per differing leaf, with dotted keys and list indices
    (``"train.epochs: 8 -> 10"``, ``"models[1].heads: [\"knn\"] -> [\"ned\"]"``); a key or list
    entry present on one side only reads ``(absent)`` on the other. Lists of tables (``models``)
    are compared entry by entry, lists of values as a whole. Values are shown as JSON, cut at 60
    characters. Empty when the trees are equal."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in [*old, *(k for k in new if k not in old)]:
            sub = f"{path}.{key}" if path else str(key)
            if key not in new:
                out.append(f"{sub}: {_show(old[key])} -> (absent)")
            elif key not in old:
                out.append(f"{sub}: (absent) -> {_show(new[key])}")
            else:
                out += config_diff(old[key], new[key], sub)
        return out
    tables = isinstance(old, list) and isinstance(new, list) and any(isinstance(v, dict) for v in [*old, *new])
    if tables:
        out = []
        for i in range(max(len(old), len(new))):
            sub = f"{path}[{i}]"
            if i >= len(new):
                out.append(f"{sub}: {_show(old[i])} -> (absent)")
            elif i >= len(old):
                out.append(f"{sub}: (absent) -> {_show(new[i])}")
            else:
                out += config_diff(old[i], new[i], sub)
        return out
    return [] if old == new else [f"{path or '(top level)'}: {_show(old)} -> {_show(new)}"]


def _show(value: Any, width: int = 60) -> str:
    import json

    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= width else text[: width - 3] + "..."


def shipped_configs() -> dict[str, Path]:
    """Config files shipped in ``shiftguard/configs`` (name -> path)."""
    d = Path(__file__).resolve().parent.parent / "configs"
    return {p.stem: p for p in sorted(d.glob("*.toml"))}
