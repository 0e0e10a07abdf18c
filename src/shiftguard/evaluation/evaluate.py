"""``shiftguard.evaluate``: any model, any data, every head and metric, one call.

The counterpart of robustbench's ``benchmark(model, dataset=..., threat_model="corruptions")``
for shift *and* calibration: the test set is corrupted by the corruption engine (15 corruptions
x 5 severities by default), the model's logits and embedding are read on every cell, the
confidence heads are fitted on clean support / validation data, and every cell is scored for
accuracy, NLL, Brier, ECE (top-label and marginal), R-AUROC, error-AUROC, AURC and retrieval
quality. ``shiftguard run`` trains models and then calls the same grid (:mod:`.grid`).
"""

from __future__ import annotations

import copy
import dataclasses
import platform
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from shiftguard import corruptions as K
from shiftguard.heads.registry import canonical_head
from shiftguard.neighbors import check_backend

from . import aggregate as A
from .adaptation import AdaptSpec, adapt_specs
from .adversarial import ADVERSARIAL, AttackSuite, attack_specs
from .aggregate import primary_head
from .cache import check_fingerprint, fingerprint, tensor_digest
from .cell import Cell
from .compare import encode_per_image
from .conformal import conformal_spec, split_validation
from .grid import model_contexts, run_grid
from .outputs import EmbedSpec, ModelOutputs, compute_outputs, looks_like_probabilities
from .plan import EvaluationPlan, GridResult, ModelEntry
from .result import EvaluationResult, describe_preprocess
from .warmup import compile_announced, evaluation_steps

__all__ = ["evaluate", "DEFAULT_HEADS", "build_cells", "build_results", "primary_head"]

#: Heads evaluated when ``heads`` is not given: the model's own softmax, temperature scaling, the
#: logistic refit of [QACT, Sec. 4], NED and the kNN vote of [NED].
DEFAULT_HEADS = ("softmax", "temperature", "logistic", "ned", "knn")


def build_cells(
    suite: str, corruptions: Optional[Sequence[str]], severities: Sequence[int], extra: bool = False
) -> list[Cell]:
    """The ``(corruption, severity, group)`` cells; group "extra" for CIFAR-10-C's 4 extra
    corruptions (reported apart from the benchmark means). Duplicates are an error: they would
    re-weight the means. Suite and corruption names are canonicalised (any case, ``-``, ``_`` or
    space), so the cells, and every row, carry the registered spelling."""
    suite = evaluable_suite(suite)
    bench = K.names(suite)
    extras = K.names("cifar-c-extra") if suite == "cifar-c" else []
    if corruptions is None:
        chosen = bench + (extras if extra else [])
    else:
        if isinstance(corruptions, str):
            raise TypeError("corruptions: expected a list of names, got a string")
        chosen, unknown = [], []
        for c in corruptions:
            name = _corruption_of(c, suite)
            chosen.append(c if name is None else name)
            if name is None:
                unknown.append(c)
        if unknown:
            raise ValueError(
                f"corruptions: unknown for suite {suite!r}: {', '.join(map(repr, unknown))}; "
                f"expected some of {', '.join(bench + extras)}"
            )
    _check_unique(chosen, "corruptions")
    sevs = list(severities)
    for s in sevs:
        if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= 5:
            raise ValueError(f"severities: expected integers in 1..5 (severity 0 is always scored), got {s!r}")
    _check_unique(sevs, "severities")
    return [Cell(c, s, "extra" if c in extras else "benchmark") for c in chosen for s in sorted(sevs)]


def evaluable_suite(suite) -> str:
    """The canonical name of a suite ``evaluate`` scores: mnist-c or cifar-c (cifar-c-extra is
    scored as cifar-c's extras); any case, ``-``, ``_`` or space."""
    valid = [s for s in K.SUITES if s != "cifar-c-extra"]
    try:
        name = K.canonical_suite(suite)
    except ValueError:
        name = None
    if name not in valid:
        raise ValueError(f"suite: unknown suite {suite!r}; expected one of {', '.join(valid)}")
    return name


def _corruption_of(name, suite: str) -> Optional[str]:
    """The canonical name of corruption ``name`` in canonical ``suite`` (cifar-c: its extras too),
    or None for an unknown one; ``TypeError`` naming ``corruptions`` for a non-str."""
    for table in (suite, "cifar-c-extra") if suite == "cifar-c" else (suite,):
        try:
            return K.canonical_name(name, table, argument="corruptions")
        except ValueError:
            continue
    return None


def _check_unique(values: list, name: str) -> None:
    seen, dup = set(), []
    for v in values:
        if v in seen and v not in dup:
            dup.append(v)
        seen.add(v)
    if dup:
        raise ValueError(
            f"{name}: listed more than once: {', '.join(map(repr, dup))} (duplicates would re-weight the means)"
        )


#: Model names: they name folders of ``cache_dir`` and cells of the CSV, so no path separators, no
#: leading dot and no leading character a spreadsheet reads as a formula.
_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")


def _models(model) -> dict[str, nn.Module]:
    if isinstance(model, nn.Module):
        return {type(model).__name__: model}
    if isinstance(model, Mapping) and model:
        for k, v in model.items():
            if not isinstance(k, str) or not k:
                raise TypeError(f"model: names must be non-empty strings, got {k!r}")
            if not _MODEL_NAME.match(k):
                raise ValueError(
                    f"model: name {k!r} must be letters, digits and _.+- (not starting with one of "
                    "_.+-): it names a folder of cache_dir and rows of the results"
                )
            if not isinstance(v, nn.Module):
                raise TypeError(f"model[{k!r}]: expected a torch.nn.Module, got {type(v).__name__}")
        return dict(model)
    raise TypeError(
        f"model: expected a torch.nn.Module or a non-empty mapping name -> Module, got {type(model).__name__}"
    )


def _heads_for(heads, names: list[str]) -> dict[str, list[str]]:
    if heads is None:
        return {n: list(DEFAULT_HEADS) for n in names}
    per = heads if isinstance(heads, Mapping) else {n: heads for n in names}
    out = {}
    for n in names:
        hs = per.get(n)
        if hs is None:
            raise ValueError(f"heads: no heads given for model {n!r}")
        if isinstance(hs, str):
            hs = [hs]
        hs = [canonical_head(h) for h in hs]  # one spelling in the rows, and duplicates found across spellings
        _check_unique(hs, "heads")
        if not hs:
            raise ValueError("heads: expected at least one head")
        out[n] = hs
    return out


def check_device(device) -> torch.device:
    """``device`` as a ``torch.device`` this machine has; one line naming ``device`` otherwise."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: not a torch device: {device!r} (e.g. 'cpu', 'cuda', 'cuda:1')") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} needs CUDA, which this torch installation or machine does not have")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device: {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device: {device!r} needs MPS, which is not available here")
    return dev


def _labels_range(num_classes: int, labels: torch.Tensor, name: str) -> None:
    if labels.numel() and int(labels.max()) >= num_classes:
        raise ValueError(
            f"{name}: labels run {int(labels.min())}..{int(labels.max())}, but the model has "
            f"{num_classes} classes (labels 0..{num_classes - 1})"
        )


def _labels_from_zero(parts: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Classes are numbered from 0: labels that never take the value 0 in any split are shifted
    (1..C from another tool), and would be scored against the wrong class."""
    found = [y for _, y in parts if y.numel()]
    if found and min(int(y.min()) for y in found) > 0:
        lo, hi = min(int(y.min()) for y in found), max(int(y.max()) for y in found)
        names = ", ".join(n for n, _ in parts)
        raise ValueError(
            f"labels: the labels of {names} run {lo}..{hi} and none is 0; classes are numbered 0..C-1 "
            f"(subtract {lo} if they start at {lo})"
        )


def _baseline_results(baseline) -> Optional[dict]:
    if baseline is None:
        return None
    if isinstance(baseline, EvaluationResult):
        return baseline.results
    if isinstance(baseline, Mapping):
        return dict(baseline)
    if isinstance(baseline, (str, Path)):
        return EvaluationResult.load(baseline).results
    raise TypeError(
        f"baseline: expected an EvaluationResult, a results dict or a results.json path, got {type(baseline).__name__}"
    )


def baseline_chooser(res: dict, key: Optional[str], name: Optional[str] = None) -> Callable[[str], tuple]:
    """``head -> (baseline rows, "name: key")`` for :func:`.aggregate.robustness_table`.

    ``key`` ("model/context/head" of the static arm, or "model/context/adaptation/head") names one
    series of ``res`` for every head. Without it, each head is compared with the *same head* of the
    baseline's first model (its first context, static arm) when the baseline scored that head, else
    with that model's primary head (:func:`primary_head`).

    Raises:
        ValueError: a ``key`` that is malformed or not in ``res`` (the message lists what it has).
    """
    rows = res.get("rows") or []
    if not rows:
        raise ValueError("baseline: has no result rows")
    label = name or res.get("name", "baseline")
    have = list(dict.fromkeys(A.series_key(r) for r in rows))
    by_key: dict = {}
    for r in rows:
        by_key.setdefault(A.series_key(r), []).append(r)
    if key is not None:
        k = A.parse_series(key, "baseline_key")
        if k not in by_key:
            raise ValueError(
                f"baseline_key: {key!r} is not in the baseline; it has "
                f"{', '.join(sorted(A.series_text(h) for h in have))}"
            )
        return lambda head: (by_key[k], f"{label}: {A.series_text(k)}")
    models = res.get("models") or [{"name": have[0][0], "heads": [h for m, _, _, h in have if m == have[0][0]]}]
    first = models[0]["name"]
    ctx = (
        next(c for m, c, a, _ in have if m == first and a == "none")
        if any(m == first and a == "none" for m, _, a, _ in have)
        else next(c for m, c, _, _ in have if m == first)
    )
    heads = [h for m, c, a, h in have if (m, c, a) == (first, ctx, "none")]
    primary = models[0].get("primary_head") or primary_head(heads)

    def choose(head: str) -> tuple:
        k = (first, ctx, "none", head if head in heads else primary)
        return by_key[k], f"{label}: {A.series_text(k)}"

    return choose


def build_results(
    *,
    name: str,
    grid: GridResult,
    plan: EvaluationPlan,
    data: dict,
    n_boot: int,
    config: dict,
    level: float = 0.95,
    baseline: Optional[Callable[[str], tuple]] = None,
    kind: str = "evaluate",
) -> dict:
    """The JSON-able results dict of an evaluation (``results.json``): ``data`` (what
    :meth:`_EvaluationData.describe` gives) completed with the cells, ``config`` (the arguments
    the plan does not hold: contexts, alpha, conformal_weighted, preprocess, layout, output)
    completed with the plan's settings."""
    from shiftguard._version import __version__

    rows, cells, seed = grid.rows, plan.cells, plan.seed
    skipped = {(s["model"], s["head"]) for s in grid.skipped_heads}
    skipped_arms = {(s["model"], s["adaptation"]) for s in grid.skipped_adaptations}
    t0 = time.perf_counter()
    results: dict[str, Any] = {
        "kind": kind,
        "status": "complete",
        "name": name,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seed": seed,
        "device": str(plan.device),
        "versions": {"shiftguard": __version__, "python": platform.python_version(), "torch": torch.__version__},
        "data": {
            **data,
            "corruptions": _unique_in_order(c for c, _, g in cells if g == "benchmark"),
            "extra_corruptions": _unique_in_order(c for c, _, g in cells if g == "extra"),
            "severities": sorted({s for _, s, g in cells if g != ADVERSARIAL}),
            "attacks": plan.attacks.describe() if plan.attacks is not None else {},
        },
        "models": [
            {
                "name": m.name,
                "heads": [h for h in m.heads if (m.name, h) not in skipped],
                "primary_head": None,
                "contexts": model_contexts(m.model, m.contexts),
                "adaptations": [a.label for a in plan.adapt if (m.name, a.label) not in skipped_arms],
                "embedding": m.outputs.embedding_source,
            }
            for m in plan.models
        ],
        "adaptation": [a.describe(int(data["n_test"])) for a in plan.adapt],
        "skipped_heads": grid.skipped_heads,
        "skipped_adaptations": grid.skipped_adaptations,
        "knn_backend": grid.knn_backend,  # the search the kNN heads used ("auto" resolved)
        "rows": rows,
        "aggregates": A.aggregate(rows),
        "drops": A.accuracy_drops(rows),
        "reliability": grid.reliability,
        "robustness": A.robustness_table(rows, baseline),
        "intervals": A.intervals(grid.per_image, n_bins=plan.ece_bins, n_boot=n_boot, level=level, seed=seed),
        "interval_info": {
            "level": level,
            "n_boot": n_boot,
            "seed": seed,
            "method": "percentile bootstrap over test images",
            "metrics": A.INTERVAL_METRICS,
        },
        "timings": {"evaluate_detail": {**dataclasses.asdict(grid.timings), "processes": grid.processes}},
    }
    for m in results["models"]:
        m["primary_head"] = primary_head(m["heads"]) if m["heads"] else None
    results["timings"]["aggregate_s"] = time.perf_counter() - t0
    results["per_image_correct"] = encode_per_image(grid.per_image, cells)
    if plan.conformal is not None:
        assert plan.calibration is not None and plan.calibration_source is not None
        results["conformal"] = plan.conformal.describe(plan.calibration_source, int(plan.calibration[1].numel()))
    results["config"] = {
        "batch_size": plan.batch_size,
        "contexts": config["contexts"],
        "adapt": [a.label for a in plan.adapt],
        "conformal": list(plan.conformal.methods) if plan.conformal else [],
        "alpha": config["alpha"],
        "conformal_weighted": config["conformal_weighted"],
        "k": plan.k,
        "knn_backend": plan.knn_backend,
        "retrieval_ks": list(plan.retrieval_ks),
        "ece_bins": plan.ece_bins,
        "preprocess": config["preprocess"],
        "layout": config["layout"],
        "output": config["output"],
    }
    return results


def evaluate(
    model: Union[nn.Module, Mapping[str, nn.Module]],
    test,
    *,
    support=None,
    validation=None,
    suite: Optional[str] = None,
    corruptions: Optional[Sequence[str]] = None,
    severities: Sequence[int] = (1, 2, 3, 4, 5),
    extra: bool = False,
    heads: Union[None, Sequence[str], Mapping[str, Sequence[str]]] = None,
    embed: EmbedSpec = None,
    output: str = "logits",
    preprocess: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    layout: str = "nchw",
    batch_size: int = 500,
    contexts: Sequence[str] = ("batch", "frozen"),
    adapt: Union[str, AdaptSpec, Sequence[Union[str, AdaptSpec]]] = ("none",),
    conformal: Sequence[str] = (),
    alpha: float = 0.1,
    conformal_weighted: bool = False,
    calibration=None,
    device: Union[str, torch.device] = "cpu",
    seed: int = 0,
    k: int = 10,
    knn_backend: str = "auto",
    retrieval_ks: Sequence[int] = (1, 5),
    ece_bins: int = 15,
    baseline=None,
    baseline_key: Optional[str] = None,
    n_boot: int = 1000,
    shifted: Optional[Callable[[str, int], torch.Tensor]] = None,
    attacks: Sequence[Any] = (),
    attack_eps: Sequence[float] = (1 / 255, 2 / 255, 4 / 255, 8 / 255),
    attack_steps: Optional[int] = None,
    attack_loss: Union[None, Callable, Mapping[str, Callable]] = None,
    transfer_from: Sequence[str] = (),
    name: str = "evaluation",
    cache_dir: Optional[Union[str, Path]] = None,
    progress: bool = False,
    distributed: bool = False,
) -> EvaluationResult:
    """Evaluate ``model`` on ``test`` and its corrupted copies; see ``docs/evaluate.md``.

    Args:
        model: any ``nn.Module`` mapping a batch to logits (or, with ``output="embedding"``, to
            embeddings; with ``output="probabilities"``, to class probabilities, whose logarithms
            then serve as logits), named by its class in the results, or a mapping ``{name: module}``
            evaluated on the same cells.
        test, support, validation: a torch ``Dataset`` yielding ``(image, label)``, a
            ``DataLoader``, an ``(images, labels)`` pair of tensors or numpy arrays, or a
            ``shiftguard.data`` dataset. Images are pixels: uint8, or float in [0, 1] (anything
            else is an error naming the range found); NCHW, or NHWC with ``layout="nhwc"``.
            ``support`` (clean training data) fits the embedding heads; ``validation`` fits the
            temperature of ``temperature`` (and NED's T; without it NED holds out 20% of the support).
        suite: ``"mnist-c"`` or ``"cifar-c"`` (default: mnist-c for 1-channel images, cifar-c
            otherwise); ``corruptions``: a subset of its names (default: all 15); ``extra``: add
            CIFAR-10-C's 4 extra corruptions, reported apart; ``severities``: 1..5 (severity 0,
            the clean test set, is always scored).
        heads: names from ``shiftguard.heads.HEAD_NAMES`` (default :data:`DEFAULT_HEADS`), or a
            mapping model name -> names. Heads a model cannot serve (no logits, no embedding, no
            support or validation data) are skipped and listed with the reason.
        embed: where the embedding comes from: ``None`` (the input of the last ``nn.Linear``
            called, or ``model.embed``), ``"layer.name"`` (that submodule's output), a callable
            ``embed(x)``, or ``False`` (none: logit heads only).
        preprocess: applied to the float [0, 1] pixels after corruption, before the model
            (e.g. mean/std normalisation).
        batch_size: evaluation batch = the context of QACT models [QACT, Sec. 3]; models with QACT
            are evaluated in each of ``contexts`` ("batch" and "frozen" by default).
        adapt: test-time adaptation arms, each scored on every cell beside the others
            (:mod:`.adaptation`, ``docs/evaluate.md``): ``"none"`` (the static model, the default),
            ``"bn-batch"`` (BatchNorm on test-batch statistics), ``"bn"`` (BatchNorm statistics
            re-estimated on each cell; ``"bn:prior=N"``), ``"tent"`` (TENT; ``"tent:lr=...,steps=...,
            optimizer=sgd"``), ``"refresh"`` (the QACT reference protocol; ``"refresh:passes=N"``), or
            :class:`~.adaptation.AdaptSpec` s. Rows name the arm in ``"adaptation"``; an arm a model
            cannot use is skipped and listed with the reason (``skipped_adaptations``). Every arm
            adapts a private copy of the model, reset to the trained state at every cell.
        conformal, alpha, conformal_weighted, calibration: conformal prediction sets
            (:mod:`.conformal`, ``docs/conformal.md``): methods of ``shiftguard.conformal.METHODS``
            (``"lac"``, ``"aps"``, ``"raps"``) at level ``1 - alpha``; rows gain
            ``coverage_<method>`` and ``set_size_<method>`` (and ``*_weighted`` for the weighted
            split conformal of covariate shift with ``conformal_weighted``). The sets are calibrated
            on ``calibration`` (data of the same form as ``test``), or else on half of
            ``validation`` (the other half then fits temperature scaling and NED's temperature).
        seed: seed of the corruption engine and of the bootstrap intervals.
        k: neighbours of the NED / kNN heads. knn_backend: their exact kNN search
            (``shiftguard.neighbors.BACKENDS``): ``"pruned"`` skips the support clusters a lower
            bound rules out and finds the same neighbours as ``"torch"``, which computes every
            distance, except where keys at the k-th place tie within float rounding
            (``shiftguard.neighbors.PrunedKNNIndex``); ``"auto"`` (default) takes ``"pruned"`` for
            large searches (at least 24,000 support rows and 4e7 distances per cell) and
            ``"torch"`` otherwise (:func:`shiftguard.neighbors.resolve_backend`, the one meaning
            of ``"auto"``); ``result.results["knn_backend"]``
            records the one used.
        baseline, baseline_key: the errors that normalise CE / mCE (Hendrycks & Dietterich 2019):
            ``baseline`` an ``EvaluationResult`` (or results dict / results.json path);
            ``baseline_key`` one of its series, "model/context/head" (static) or
            "model/context/adaptation/head", for every head; without a key each head is compared
            with the same head of the baseline's first model where it has one, else with that
            model's primary head (:func:`baseline_chooser`). ``baseline_key`` without ``baseline``
            names a series of this evaluation itself (e.g. the ReLU model's own softmax).
            ``robustness[i]["baseline"]`` says which series each row was compared with.
        n_boot: bootstrap resamples of the 95% intervals (over test images).
        shifted: advanced: ``shifted(corruption, severity) -> images`` instead of the engine, e.g.
            the official pre-corrupted files, in the order and with the labels of ``test``.
        attacks: adversarial shift beside the corruptions (:mod:`.adversarial`): attack names
            (``"fgsm"``, ``"bim-linf"``, ``"pgd-l2"``, ...; ``shiftguard.adversarial.AttackSpec.parse``)
            or ``AttackSpec`` s, untargeted, each scored at every budget of ``attack_eps`` (pixel
            units of [0, 1] images) as severities 1..len(attack_eps) of group "adversarial";
            every (model, context) is attacked white-box; ``attack_steps`` overrides the steps of
            named BIM / PGD attacks (default 10). ``attack_loss``: for a model whose
            output is an embedding, the loss the attack ascends, ``loss(embeddings, labels)`` (a
            callable for every model or a mapping model name -> callable); models with logits
            are attacked through cross-entropy unless a loss is given for them (it then receives
            ``model.embed(x)`` where the model has ``embed``). Adversarial cells never enter the
            corruption means. ``transfer_from``: model names whose white-box images are also scored
            on every model, as cells ``"<attack>@<model>"`` (a transfer attack, the black-box check
            of gradient masking; ``docs/adversarial.md``).
        device: where the models run (``"cpu"``, ``"cuda"``, ``"cuda:1"``; a model elsewhere is
            evaluated as a copy moved there). What a model computes stays there: its logits and
            embeddings, the heads' fits and scores, the kNN searches, the adaptation arms and the
            attacks' gradients; what comes back to the host are the results (metrics, each
            head's per-image correctness and confidence), the files of ``cache_dir``, and what
            scikit-learn or SciPy compute (the weighted sets' likelihood ratio, the L-BFGS fits
            of the logistic and temperature heads). Images stay where
            ``test`` is and reach the model a batch at a time: the corruption engine draws its
            noise on the images' device, so test images on the CPU (the default) give every
            device the same corrupted cells; move ``test`` to the GPU to corrupt (and attack)
            there.
        cache_dir: keep the model outputs of every cell there (resumable). A model's folder is
            reused only by the same evaluation: a fingerprint of its weights, the data, what
            ``preprocess`` does, the batch size, output, embedding, corruption source and seed
            (:mod:`.cache`); another is refused naming what differs.
        distributed: share the grid among the processes of an initialised ``torch.distributed``
            process group (``torchrun``): every process calls ``evaluate`` with the same
            arguments and gets the same result, identical to one process's; each computes a
            contiguous share of the (corruption, severity, model, context) cells
            (:func:`.grid.run_grid`, ``docs/distributed.md``). Without a group of several
            processes it changes nothing. The caller decides which process saves the result.

    Returns:
        An :class:`EvaluationResult`.

    Raises:
        TypeError, ValueError: a bad argument, named in the message.
        RuntimeError: with ``distributed``, on every process when another process failed.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> import shiftguard
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> net = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 16), nn.ReLU(), nn.Linear(16, 3))
        >>> x, y = torch.randint(0, 256, (60, 1, 28, 28), dtype=torch.uint8), torch.arange(60) % 3
        >>> res = shiftguard.evaluate(net, (x, y), support=(x, y), corruptions=["fog"], severities=[5],
        ...                           heads=["softmax", "knn"], n_boot=100)
        >>> sorted({r["head"] for r in res.rows})
        ['knn', 'softmax']
        >>> [s["head"] for s in res.skipped_heads]
        []
    """
    t_start = time.perf_counter()
    named = _models(model)
    head_map = _heads_for(heads, list(named))
    _check_settings(batch_size, seed, n_boot, k, knn_backend, list(retrieval_ks), ece_bins)
    arms = adapt_specs(adapt)
    sets_spec = conformal_spec(conformal, alpha, conformal_weighted)
    contexts = _check_contexts(contexts, layout, distributed)
    dev = check_device(device)
    data = _EvaluationData.read(test, support, validation, calibration, layout, list(retrieval_ks), sets_spec, seed)
    suite = ("mnist-c" if data.test[0].shape[1] == 1 else "cifar-c") if suite is None else evaluable_suite(suite)
    cells = build_cells(suite, corruptions, severities, extra)
    suite_attacks = _attack_suite(
        attacks, attack_eps, attack_steps, attack_loss, transfer_from, list(named), data.test, seed, batch_size, dev
    )
    cells += suite_attacks.cells() if suite_attacks is not None else []
    source = "engine" if shifted is None else "user"
    shifted, to_corrupt = _corruption_engine(shifted, data.test[0], cells, suite, seed)
    named = {nm: _on_device(mod, dev, embed, nm) for nm, mod in named.items()}
    with _training_flags_kept(list(named.values())):
        outputs = {nm: ModelOutputs(mod, embed, output, preprocess) for nm, mod in named.items()}
        entries = [ModelEntry(nm, mod, outputs[nm], head_map[nm], contexts) for nm, mod in named.items()]
        # The kernels compile (or load from numba's cache) before any timed phase: a step of its own.
        compile_s = compile_announced(
            evaluation_steps([e.model for e in entries], dev, list(to_corrupt.values()), data.test[0], seed),
            announce=progress,
        )
        num_classes = _num_classes(entries, data, batch_size, dev)
        choose = _baseline_series(baseline, baseline_key, head_map, arms)
        plan = EvaluationPlan(
            models=entries,
            test=data.test,
            cells=cells,
            shifted=shifted,
            num_classes=num_classes,
            support=data.support,
            validation=data.validation,
            calibration=data.calibration,
            calibration_source=data.calibration_source,
            cache_root=None if cache_dir is None else Path(cache_dir),
            batch_size=batch_size,
            device=dev,
            k=k,
            retrieval_ks=list(retrieval_ks),
            ece_bins=ece_bins,
            knn_backend=knn_backend,
            adapt=arms,
            seed=seed,
            conformal=sets_spec,
            attacks=suite_attacks,
            progress=progress,
            distributed=distributed,
        )
        if suite_attacks is not None:
            suite_attacks.check_models(entries)
        if cache_dir is not None:
            _check_cache(plan, preprocess=preprocess, output=output, embed=embed, source=source, suite=suite)
        grid = run_grid(plan)
    if choose is None and baseline_key is not None:  # a series of this evaluation
        choose = baseline_chooser({"rows": grid.rows}, baseline_key, name="this evaluation")
    config = {"contexts": contexts, "alpha": alpha, "conformal_weighted": conformal_weighted, "layout": layout}
    config.update(output=output, preprocess=describe_preprocess(preprocess))
    info = data.describe(getattr(test, "name", None) or "user data", suite, num_classes, source, seed)
    results = build_results(
        name=name, grid=grid, plan=plan, data=info, n_boot=n_boot, baseline=choose, config=config, kind="evaluate"
    )
    results["timings"]["compile_s"] = compile_s
    results["timings"]["evaluate_s"] = results["timings"]["total_s"] = time.perf_counter() - t_start
    return EvaluationResult(results)  # no "training": an evaluation trains nothing (``shiftguard run`` adds it)


def _check_settings(
    batch_size: int, seed: int, n_boot: int, k: int, knn_backend: str, retrieval_ks: list, ece_bins: int
) -> None:
    """The scalar arguments of :func:`evaluate`; one line naming the argument otherwise."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: expected a positive integer, got {batch_size!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed: expected an int, got {type(seed).__name__}")
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed: expected an integer in 0..2**63-1 (what torch's generators take), got {seed}")
    if isinstance(n_boot, bool) or not isinstance(n_boot, int) or n_boot < 10:
        raise ValueError(f"n_boot: expected an integer >= 10, got {n_boot!r}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k: expected a positive integer, got {k!r}")
    check_backend(knn_backend, "knn_backend")
    if not retrieval_ks or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in retrieval_ks):
        raise ValueError(f"retrieval_ks: expected positive integers, got {retrieval_ks!r}")
    if isinstance(ece_bins, bool) or not isinstance(ece_bins, int) or not 1 <= ece_bins <= 10_000:
        raise ValueError(f"ece_bins: expected an integer in 1..10000, got {ece_bins!r}")


def _check_contexts(contexts: Sequence[str], layout: str, distributed: bool) -> list[str]:
    contexts = list(contexts)
    if not contexts or any(c not in ("batch", "frozen") for c in contexts):
        raise ValueError(f"contexts: expected a non-empty subset of ('batch', 'frozen'), got {contexts!r}")
    _check_unique(contexts, "contexts")
    if layout not in ("nchw", "nhwc"):
        raise ValueError(f"layout: expected 'nchw' or 'nhwc', got {layout!r}")
    if not isinstance(distributed, bool):
        raise TypeError(f"distributed: expected a bool, got {type(distributed).__name__}")
    return contexts


Pair = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class _EvaluationData:
    """The validated ``(images, labels)`` of an evaluation; ``calibration_source`` says where the
    conformal sets' calibration data came from."""

    test: Pair
    support: Optional[Pair]
    validation: Optional[Pair]
    calibration: Optional[Pair]
    calibration_source: Optional[str]

    @classmethod
    def read(
        cls, test, support, validation, calibration, layout: str, retrieval_ks: list, sets_spec, seed: int
    ) -> _EvaluationData:
        """Each split as pixel tensors (``data.as_tensors``), with the checks that span splits; with
        conformal sets and no ``calibration``, ``validation`` split in two (seeded)."""
        test_x, test_y = _tensors(test, "test", layout)
        if max(retrieval_ks) >= test_y.numel():
            raise ValueError(
                f"retrieval_ks: the largest cut-off, {max(retrieval_ks)}, needs more than {max(retrieval_ks)} test "
                f"images (each test image is ranked against the others); the test set has {test_y.numel()}"
            )
        sup = _tensors(support, "support", layout) if support is not None else None
        val = _tensors(validation, "validation", layout) if validation is not None else None
        cal = _tensors(calibration, "calibration", layout) if calibration is not None else None
        if calibration is not None and sets_spec is None:
            raise ValueError("calibration: given without conformal methods (conformal=...)")
        source = None
        if sets_spec is not None:
            if cal is not None:
                source = "calibration= data"
            elif val is not None:
                val, cal = split_validation(val, seed)
                source = (
                    "half of validation= (seeded split); the other half fits temperature scaling and NED's temperature"
                )
            else:
                raise ValueError(
                    "conformal: the prediction sets need calibration data the heads were not fitted on; "
                    "give calibration=, or validation= to split in two"
                )
        for nm, part in (("support", sup), ("validation", val), ("calibration", cal)):
            if part is not None and part[0].shape[1:] != test_x.shape[1:]:
                raise ValueError(
                    f"{nm}: images of shape {tuple(part[0].shape[1:])}, test images {tuple(test_x.shape[1:])}"
                )
        return cls((test_x, test_y), sup, val, cal, source)

    def labelled(self, with_calibration: bool = True) -> list[tuple[str, torch.Tensor]]:
        """``[(split name, labels)]`` of the splits given."""
        parts = [("test", self.test), ("support", self.support), ("validation", self.validation)]
        parts += [("calibration", self.calibration)] if with_calibration else []
        return [(nm, p[1]) for nm, p in parts if p is not None]

    def describe(self, dataset: str, suite: str, num_classes: int, source: str, seed: int) -> dict:
        """The results' ``data``. ``n_support``: the images the heads are fitted on; ``n_train``: the
        images the model was trained on, which an evaluation is not told (None, "not known";
        ``shiftguard run`` knows it)."""
        return {
            "dataset": dataset,
            "suite": suite,
            "n_support": 0 if self.support is None else int(self.support[1].numel()),
            "n_train": None,
            "n_val": 0 if self.validation is None else int(self.validation[1].numel()),
            "n_test": int(self.test[1].numel()),
            "num_classes": num_classes,
            "corruption_source": source,
            "corruption_seed": seed if source == "engine" else None,
            # the very test images and labels, in order: two results with one digest can be paired image by image
            "test_sha256": tensor_digest(*self.test),
        }


def _tensors(d, name: str, layout: str) -> Pair:
    from shiftguard.data import as_tensors

    # canonical NCHW strides: a channels-last view (even one that counts as contiguous, C = 1)
    # takes other convolution kernels, so other rounding than the same pixels given as NCHW
    x, y = as_tensors(d, layout=layout, name=name)
    if x.stride() != torch.empty(x.shape, device="meta").stride():
        x = x.clone(memory_format=torch.contiguous_format)
    return x, y


def _attack_suite(
    attacks, attack_eps, attack_steps, attack_loss, transfer_from, names: list[str], test: Pair, seed, batch_size, dev
) -> Optional[AttackSuite]:
    """The adversarial cells' attacks (None without ``attacks``); ``attack_loss``: one callable for
    every model or a mapping model name -> callable."""
    specs = attack_specs(attacks, attack_steps)
    if not specs:
        if attack_loss is not None:
            raise ValueError("attack_loss: given without attacks")
        if transfer_from:
            raise ValueError("transfer_from: given without attacks")
        return None
    if callable(attack_loss):
        losses = {nm: attack_loss for nm in names}
    elif isinstance(attack_loss, Mapping):
        unknown = sorted(set(attack_loss) - set(names))
        if unknown:
            raise ValueError(f"attack_loss: no model named {', '.join(map(repr, unknown))}; models: {', '.join(names)}")
        losses = dict(attack_loss)
    elif attack_loss is None:
        losses = {}
    else:
        raise TypeError(f"attack_loss: expected a callable, a mapping or None, got {type(attack_loss).__name__}")
    return AttackSuite(
        specs, attack_eps, test, losses, seed=seed, batch_size=batch_size, transfer_from=transfer_from, device=dev
    )


def _corruption_engine(shifted, test_x: torch.Tensor, cells: list[Cell], suite: str, seed: int):
    """``(shifted, {corruption: one of its cells})``: the user's ``shifted`` (and nothing for the
    compile step), else the corruption engine on ``test_x`` and one cell of each corruption."""
    if shifted is not None:
        return shifted, {}
    extras = K.names("cifar-c-extra") if suite == "cifar-c" else []

    def engine(c: str, s: int) -> torch.Tensor:
        return K.corrupt(test_x, c, s, seed=seed, suite="cifar-c-extra" if c in extras else suite)

    to_corrupt: dict[str, tuple[str, int, str]] = {}
    for c, s, group in cells:
        if group != ADVERSARIAL and c not in to_corrupt:
            to_corrupt[c] = (c, s, "cifar-c-extra" if c in extras else suite)
    return engine, to_corrupt


def _num_classes(entries: Sequence[ModelEntry], data: _EvaluationData, batch_size: int, device) -> int:
    """The number of classes: the logit width when there are logits, else the labels seen; every
    split's labels in range and numbered from 0. A model ending in a softmax would be scored as if
    its probabilities were logits: an error."""
    probe_x = data.test[0][:16]
    for e in entries:
        if e.outputs.output == "logits":
            probe = compute_outputs(e.outputs, probe_x, batch_size, device)["logits"]
            if looks_like_probabilities(probe):
                raise ValueError(
                    f"output: model {e.name!r} returns probabilities (non-negative rows summing "
                    "to 1), not logits; pass output='probabilities' (or return logits)"
                )
    if entries[0].outputs.has_logits:
        num_classes = int(compute_outputs(entries[0].outputs, probe_x, batch_size, device)["logits"].shape[1])
    else:
        num_classes = int(max(int(y.max()) for nm, y in data.labelled(False) if nm != "calibration") + 1)
    for nm, y in data.labelled():
        _labels_range(num_classes, y, nm)
    _labels_from_zero(data.labelled(with_calibration=False))
    return num_classes


def _baseline_series(baseline, baseline_key, head_map: dict, arms: Sequence[AdaptSpec]):
    """The baseline chooser of a given ``baseline``; None for none, or for a ``baseline_key`` naming
    a series of this evaluation, checked here against its models, heads and arms."""
    base_results = _baseline_results(baseline)
    if base_results is not None:
        return baseline_chooser(base_results, baseline_key)
    if baseline_key is not None:
        own = A.parse_series(baseline_key, "baseline_key")
        if own[0] not in head_map or own[3] not in head_map[own[0]]:
            listed = "; ".join(f"{m}: {', '.join(h)}" for m, h in head_map.items())
            raise ValueError(
                f"baseline_key: {baseline_key!r} names no model and head of this evaluation "
                f"(models and heads: {listed})"
            )
        if own[2] not in {a.label for a in arms}:
            raise ValueError(
                f"baseline_key: {baseline_key!r} names an adaptation arm this evaluation does "
                f"not score ({', '.join(a.label for a in arms)})"
            )
    return None


def _check_cache(plan: EvaluationPlan, *, preprocess, output: str, embed, source: str, suite: str) -> None:
    """Each model's cache folder belongs to this evaluation (``cache.check_fingerprint``); the
    fingerprint of a new folder is written by one process.

    Under torch.distributed every process checks the same folders before any writes an output (so
    all raise or none does), and none goes on to the grid until the fingerprints are written: a
    process that wrote its first outputs while another was still checking would show that one a
    folder of outputs without a fingerprint."""
    from shiftguard.train.distributed import barrier, is_main_process

    assert plan.cache_root is not None
    probe = torch.rand((2, *plan.test[0].shape[1:]), generator=torch.Generator().manual_seed(0))
    write = not plan.distributed or is_main_process()
    for e in plan.models:
        fp = fingerprint(
            e.model,
            test=plan.test,
            support=plan.support,
            validation=plan.validation,
            calibration=plan.calibration,
            preprocess=preprocess,
            probe=probe.to(device=plan.device, dtype=e.outputs.dtype),
            batch_size=plan.batch_size,
            output=output,
            embed=embed,
            corruption_source=f"engine:{suite}" if source == "engine" else source,
            seed=plan.seed,
        )
        check_fingerprint(plan.cache_root / e.name, fp, write=write)
    if plan.distributed:
        barrier()


def _on_device(model: nn.Module, device: torch.device, embed, name: str) -> nn.Module:
    """``model`` itself when its parameters and buffers are on ``device``, else a copy moved there:
    the caller's module is never moved (a move to ``"meta"`` would drop its weights)."""
    devices = {t.device for t in (*model.parameters(), *model.buffers())}
    if all(d.type == device.type and (device.index is None or d.index == device.index) for d in devices):
        return model
    if callable(embed) and not isinstance(embed, bool):
        raise ValueError(
            f"embed: model {name!r} lives on {', '.join(sorted(map(str, devices)))} and is evaluated on "
            f"{device} as a copy, which a callable embed= bound to the original cannot read; move the "
            "model to device yourself, or give embed= as a submodule name"
        )
    return copy.deepcopy(model).to(device)


@contextmanager
def _training_flags_kept(models: Sequence[nn.Module]) -> Iterator[None]:
    """Every module's training flag as it was before the evaluation (which runs in eval mode)."""
    flags = [{m: m.training for m in mod.modules()} for mod in models]
    try:
        yield
    finally:
        for f in flags:
            for m, training in f.items():
                m.training = training


def _unique_in_order(values) -> list:
    return list(dict.fromkeys(values))
