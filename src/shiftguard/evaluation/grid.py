"""The evaluation grid: every (model, context, adaptation arm, head) on every (corruption, severity) cell.

For each model:

1. compute its outputs (logits, embedding) on the clean support (training) set, the validation
   set, the clean test set (severity 0) and every corruption x severity of the test set;
2. fit every head on clean data only, one call for every head: ``fit(support, support labels,
   validation, validation labels)`` with the outputs the head reads (its ``input``), the
   validation set where it ``uses_validation``: embedding heads on the support embeddings ([QACT,
   Sec. 4, Remark]: the baselines' last layer is refitted "on the train embedding"; NED / kNN on
   the unaltered support as in [NED]), temperature scaling on the validation logits;
3. score each (head, corruption, severity) cell (:func:`.scoring.score_cell`) and the
   embedding's retrieval quality within the test set.

QACT models see the test batch as their context (``batch_size``) and, unless told otherwise, are
evaluated a second time with the context frozen to the training distribution [QACT, Sec. 3],
so the report shows what the context buys. Each test-time adaptation arm (:mod:`.adaptation`)
adapts a private copy of the model to each cell before scoring it, with the heads fitted on the
static model. Each corrupted set is generated once and passed to
every model. Outputs are cached per (model, context, cell) when a cache folder is given, so an
interrupted evaluation resumes without recomputing finished cells. Under ``torch.distributed``
(``distributed=True``) the processes share the head fits and the (cell, model, context) units
and each returns the one-process result (:func:`grid_shards`, ``docs/distributed.md``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from shiftguard._rng import seeded
from shiftguard.heads import build_head, head_class
from shiftguard.neighbors import SearchCache, resolve_backend
from shiftguard.nn import has_qact, qact_context

from .adaptation import AdaptedModel, AdaptSpec, arm_contexts, skip_reason
from .adversarial import ADVERSARIAL, AttackSuite
from .aggregate import CLEAN
from .cache import OutputCache
from .cell import Cell
from .conformal import ConformalSpec, cell_uniform, cell_weights, fit_calibrators, set_metrics
from .outputs import ModelOutputs, compute_outputs
from .scoring import calibration_view, reliability_bins, score_cell, score_retrieval

__all__ = ["Cell", "applicable_heads", "grid_jobs", "grid_shards", "model_contexts", "run_grid"]


def model_contexts(model: torch.nn.Module, contexts: Sequence[str] = ("batch", "frozen")) -> list[str]:
    """Inference contexts a model is evaluated with: ``["none"]`` without QACT, else ``contexts``."""
    return list(contexts) if has_qact(model) else ["none"]


def applicable_heads(
    outputs: ModelOutputs, heads: Sequence[str], has_support: bool, has_validation: bool
) -> tuple[list[str], list[dict]]:
    """``(heads to fit, [{"head", "reason"}] skipped)``: what each head's class declares it needs
    (``input``, ``needs_support``, ``needs_validation``) and what is there."""
    keep, skipped = [], []
    for h in heads:
        cls = head_class(h)
        reason = None
        if cls.input == "logits" and not outputs.has_logits:
            reason = "the model gives no logits (output='embedding')"
        elif cls.input == "embeddings" and not outputs.has_embeddings:
            reason = f"the model has no embedding ({outputs.embedding_source})"
        elif cls.needs_support and not has_support:
            reason = "needs support= data to be fitted on"
        elif cls.needs_validation and not has_validation:
            reason = f"needs validation= data ({cls.__name__} is fitted on held-out {cls.input})"
        if reason is None:
            keep.append(h)
        else:
            skipped.append({"head": h, "reason": reason})
    return keep, skipped


def grid_jobs(
    models: Sequence[dict], contexts: Sequence[str], adapt: Sequence[AdaptSpec], has_support: bool, has_validation: bool
) -> tuple[list[tuple], list[dict], list[dict]]:
    """``(jobs, skipped heads, skipped arms)``: the ``(model entry, context, arm, heads)`` the grid
    scores on every cell, model by model, arm by arm (in the order of ``adapt``), then context by
    context (:func:`~.adaptation.arm_contexts`). An arm a model cannot use is skipped with the
    reason (:func:`~.adaptation.skip_reason`), like a head."""
    jobs, skipped_heads, skipped_arms = [], [], []
    for m in models:
        heads, skipped = applicable_heads(m["outputs"], m["heads"], has_support, has_validation)
        skipped_heads += [{"model": m["name"], **s} for s in skipped]
        ctxs = model_contexts(m["model"], contexts)
        for spec in adapt:
            reason = skip_reason(spec, m["outputs"])
            if reason is not None:
                skipped_arms.append({"model": m["name"], "adaptation": spec.label, "reason": reason})
                continue
            jobs += [(m, ctx, spec, heads) for ctx in arm_contexts(spec, ctxs)]
    return jobs, skipped_heads, skipped_arms


def _slug(label: str) -> str:
    """An arm label as a folder name."""
    return "".join(ch if ch.isalnum() or ch in "-." else "-" for ch in label)


def run_grid(
    *,
    models: list[dict],
    test: tuple[torch.Tensor, torch.Tensor],
    cells: list[Cell],
    shifted: Callable[[str, int], torch.Tensor],
    num_classes: int,
    support: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    validation: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    cache_root: Optional[str | Path] = None,
    batch_size: int = 500,
    device: str | torch.device = "cpu",
    contexts: Sequence[str] = ("batch", "frozen"),
    k: int = 10,
    retrieval_ks: Sequence[int] = (1, 5),
    ece_bins: int = 15,
    progress: bool = False,
    distributed: bool = False,
    attacks: Optional[AttackSuite] = None,
    knn_backend: str = "auto",
    adapt: Sequence[AdaptSpec] = (AdaptSpec("none"),),
    seed: int = 0,
    conformal: Optional[ConformalSpec] = None,
    calibration: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> dict:
    """Score the grid; returns ``{"rows", "reliability", "per_image", "skipped_heads",
    "skipped_adaptations", "timings", "knn_backend"}``.

    ``models`` holds ``{"name", "model", "outputs": ModelOutputs, "heads": [names]}`` dicts.
    ``adapt``: the test-time adaptation arms (:mod:`.adaptation`), each scored on every cell in
    the contexts :func:`~.adaptation.arm_contexts` gives (rows say which in ``"adaptation"``); the
    heads of a (model, context) are fitted once, on the static model's clean outputs, and score
    every arm. Adversarial cells are scored for the ``"none"`` arm only: attacking an adapting
    model is another threat model. ``seed``: the batch order of the ``refresh`` arm's passes, and
    the draws of the conformal sets.
    ``conformal`` (:mod:`.conformal`): every head is also calibrated on ``calibration`` (clean data
    none of the heads was fitted on) and each cell's rows record the coverage and mean size of its
    prediction sets per method.
    ``shifted(corruption, severity)`` returns the corrupted test images (same order and labels as
    ``test``). Severity 0 (the clean test set) is scored once, as ``corruption="clean"``.
    Cells of group "adversarial" (``attacks.cells()``) are attacked per (model, context) by
    ``attacks`` (:mod:`.adversarial`) instead.
    ``per_image[(model, context, adaptation, head)]`` keeps each test image's correctness and confidence on
    the clean set and on the benchmark corrupted cells, for bootstrap intervals.
    ``knn_backend``: the kNN search of the NED / kNN heads (``build_head(..., backend=)``),
    ``"auto"`` resolved by :func:`shiftguard.neighbors.resolve_backend` for the support's rows and
    a cell's test rows (the result's ``"knn_backend"`` says which). The heads share one
    :class:`~shiftguard.neighbors.SearchCache`: each support is prepared for the back end once and
    searched once per cell for the heads of the same ``k``.

    ``distributed``: when a ``torch.distributed`` process group of several processes is up, every
    process must call ``run_grid`` with the same arguments (the same models and data); the work is
    then shared (:func:`grid_shards`): the heads of each (model, context) are fitted by one
    process and sent to all, each process scores its contiguous share of the (cell, model,
    context) units, and every process returns the complete grid, identical to one process's
    (rows in the same order, the same per-image arrays and reliability pools). Each cached output
    is written by the one process that computes it. ``timings`` then sums the processes'
    seconds. Without a process group (or with one process) it changes nothing.

    Raises:
        RuntimeError: under ``distributed``, on every process when another process failed (the
            failing process raises its own error).
    """
    from shiftguard._progress import progress as make_progress
    from shiftguard.train.distributed import get_rank, get_world_size, is_distributed

    test_x, test_y = test
    support_x, support_y = support if support is not None else (None, None)
    knn_backend = resolve_backend(
        knn_backend, 0 if support_y is None else int(support_y.numel()), int(test_y.numel()), argument="knn_backend"
    )
    searches = SearchCache()
    validation_x, validation_y = validation if validation is not None else (None, None)
    if conformal is not None and calibration is None:
        raise ValueError("calibration: conformal prediction sets need calibration data")
    all_cells = [Cell(CLEAN, 0, "benchmark"), *(Cell(*c) for c in cells)]
    top = max((s for _, s, _ in cells), default=0)
    rank, world = (get_rank(), get_world_size()) if distributed and is_distributed() else (0, 1)
    timings = {"embed_s": 0.0, "adapt_s": 0.0, "fit_heads_s": 0.0, "score_s": 0.0, "corrupt_s": 0.0, "attack_s": 0.0}
    if any(g == ADVERSARIAL for _, _, g in cells) and attacks is None:
        raise ValueError("cells: adversarial cells need the attacks that make their images")
    jobs, skipped_all, skipped_arms = grid_jobs(models, contexts, adapt, support is not None, validation is not None)
    # the heads of each (model, context) are fitted once and score every arm scored in that context
    fit_jobs_list: list[tuple] = []
    for m, ctx, _, heads in jobs:
        if not any(f[0] is m and f[1] == ctx for f in fit_jobs_list):
            fit_jobs_list.append((m, ctx, heads))
    _, unit_share = grid_shards(len(jobs), len(all_cells), rank, world)
    fit_share = range(rank, len(fit_jobs_list), world)
    bar = make_progress(total=2 * len(fit_share) + len(unit_share), desc="evaluate", enabled=progress, unit="set")
    adapted: dict[tuple, AdaptedModel] = {}  # (model name, arm label) -> the arm's private copy

    def outputs_of(m, ctx, spec, key, make_images):
        static = spec.name == "none"
        root = Path(cache_root) / m["name"] / ctx if cache_root is not None else Path(".")
        if not static:
            root = root / f"adapt-{_slug(spec.label)}"
        cache = OutputCache(root, enabled=cache_root is not None)
        t0 = time.perf_counter()
        if static:
            with qact_context(m["model"], "batch" if ctx == "none" else ctx):
                out = cache.get_or_compute(
                    key, lambda: compute_outputs(m["outputs"], make_images(), batch_size, device)
                )
            timings["embed_s"] += time.perf_counter() - t0
        else:

            def compute():
                arm = adapted.get((m["name"], spec.label))
                if arm is None:
                    arm = adapted[m["name"], spec.label] = AdaptedModel(spec, m["outputs"], seed=seed)
                return arm.outputs_on(make_images(), batch_size, device, ctx)

            out = cache.get_or_compute(key, compute)
            timings["adapt_s"] += time.perf_counter() - t0
        bar.update(1, info=f"{m['name']}/{ctx}/{spec.label}/{key}")
        return out

    none = AdaptSpec("none")

    # 1. fit the heads on clean data, per model and context (this process's share of the jobs)
    def fit_jobs() -> dict:
        fitted: dict[tuple, Any] = {}
        for j in fit_share:
            m, ctx, heads = fit_jobs_list[j]
            built = {h: build_head(h, num_classes, k=k, backend=knn_backend, searches=searches) for h in heads}
            # applicable_heads keeps a head that needs_support only when a support set is given. The
            # validation outputs are computed (and cached) beside the support's whenever a head learns
            # from data, whether or not it reads them, so the cache folder of a (model, context) is
            # filled alike for any such set of heads.
            learns = [hd for hd in built.values() if hd.needs_support or hd.uses_validation]
            sup = (
                outputs_of(m, ctx, none, "support", lambda: support_x)
                if support is not None and any(hd.needs_support for hd in built.values())
                else None
            )
            val = (
                outputs_of(m, ctx, none, "validation", lambda: validation_x)
                if validation is not None and learns
                else None
            )
            t0 = time.perf_counter()
            for h, head in built.items():
                train = (sup[head.input], support_y) if sup is not None else (None, None)
                held_out = (val[head.input], validation_y) if val is not None and head.uses_validation else ()
                # a fixed global RNG for each head fit / prediction (QACT heads sample from it), so a
                # resumed run, whose RNG state differs after skipped training, scores like an uninterrupted one
                with seeded(0, device):
                    head.fit(*train, *held_out)
                fitted[m["name"], ctx, h] = head
            if conformal is not None:
                assert calibration is not None
                cal = outputs_of(m, ctx, none, "calibration", lambda: calibration[0])
                fitted[m["name"], ctx, "calibration-features"] = (
                    cal["embeddings"] if cal["embeddings"] is not None else cal["logits"]
                )
                for h in heads:
                    head = fitted[m["name"], ctx, h]
                    with seeded(0, device):
                        probs = torch.as_tensor(head.predict_proba(cal[head.input]))
                    fitted[m["name"], ctx, h, "conformal"] = fit_calibrators(conformal, probs, calibration[1], seed)
            timings["fit_heads_s"] += time.perf_counter() - t0
        return fitted

    fitted = {}
    try:
        for part in _exchange(fit_jobs, world, "fitting the heads"):
            fitted.update(part)
    except BaseException:
        bar.close()
        raise

    # 2. this process's (cell, model, context) units: corrupt each cell once, run the model, score every head
    def score_units() -> dict:
        results: dict[int, dict] = {}
        images: dict = {}
        for u in unit_share:
            c, j = divmod(u, len(jobs))
            corruption, severity, group = all_cells[c]
            m, ctx, spec, heads = jobs[j]
            if group == ADVERSARIAL and spec.name != "none":
                results[u] = {"rows": [], "kept": []}
                continue

            def make_images():
                if group == ADVERSARIAL:  # white-box: every (model, context) has its own images
                    assert attacks is not None
                    t0 = time.perf_counter()
                    x = attacks(m, ctx, corruption, severity)
                    timings["attack_s"] += time.perf_counter() - t0
                    return x
                if images.get("cell") != c:  # units are cell-major: one cell's images at a time
                    t0 = time.perf_counter()
                    images["x"] = test_x if corruption == CLEAN else shifted(corruption, severity)
                    images["cell"] = c
                    timings["corrupt_s"] += time.perf_counter() - t0
                return images["x"]

            key = attacks.key(corruption, severity) if group == ADVERSARIAL and attacks else f"{corruption}-s{severity}"
            out = outputs_of(m, ctx, spec, key, make_images)
            t0 = time.perf_counter()
            sets = None
            if conformal is not None:
                weights = None
                if conformal.weighted:
                    features = out["embeddings"] if out["embeddings"] is not None else out["logits"]
                    weights = cell_weights(fitted[m["name"], ctx, "calibration-features"], features, seed)
                sets = {"spec": conformal, "uniform": cell_uniform(int(test_y.numel()), seed, c), "weights": weights}
            results[u] = _score_unit(
                out,
                fitted,
                m["name"],
                ctx,
                spec.label,
                heads,
                all_cells[c],
                test_y,
                retrieval_ks,
                ece_bins,
                keep=severity == 0 or group == "benchmark",
                conformal=sets,
            )
            timings["score_s"] += time.perf_counter() - t0
        bar.close()
        return {"units": results, "timings": timings}

    try:
        shares = _exchange(score_units, world, "scoring the grid")
    finally:
        bar.close()
    units = {u: r for s in shares for u, r in s["units"].items()}
    total = {key: sum(s["timings"][key] for s in shares) for key in timings}

    # 3. put the units together in the single-process order: cells, then models and contexts, then heads
    rows: list[dict] = []
    pooled: dict[tuple, list] = {}
    per_image: dict[tuple, dict] = {}
    for u in range(len(all_cells) * len(jobs)):
        c, j = divmod(u, len(jobs))
        _, severity, group = all_cells[c]
        m, ctx, spec, heads = jobs[j]
        for h, row, kept in zip(heads, units[u]["rows"], units[u]["kept"]):
            rows.append(row)
            if kept is None:
                continue
            correct, conf, hit = kept
            hk = (m["name"], ctx, spec.label, h)
            if severity in (0, top) and group == "benchmark":
                pooled.setdefault((*hk, severity), []).append((conf, hit))
            rec = per_image.setdefault(hk, {f"corrupted_{f}": [] for f in ("correct", "conf", "hit")})
            if severity == 0:
                rec["clean_correct"], rec["clean_conf"], rec["clean_hit"] = correct, conf, hit
            elif group == "benchmark":
                for f, v in (("correct", correct), ("conf", conf), ("hit", hit)):
                    rec[f"corrupted_{f}"].append(v)
    for rec in per_image.values():
        for f in ("corrupted_correct", "corrupted_conf", "corrupted_hit"):
            rec[f] = torch.stack(rec[f]) if rec[f] else None
    reliability = []
    for (name, ctx, arm, h, sev), parts in pooled.items():
        conf = torch.cat([p[0] for p in parts])
        correct = torch.cat([p[1] for p in parts])
        reliability.append(
            {
                "model": name,
                "context": ctx,
                "adaptation": arm,
                "head": h,
                "severity": sev,
                **reliability_bins(conf, correct, ece_bins),
            }
        )
    return {
        "rows": rows,
        "reliability": reliability,
        "per_image": per_image,
        "skipped_heads": skipped_all,
        "skipped_adaptations": skipped_arms,
        "timings": {**total, "processes": world},
        "knn_backend": knn_backend,
    }


def grid_shards(n_jobs: int, n_cells: int, rank: int = 0, world_size: int = 1) -> tuple[range, range]:
    """``(jobs, units)``: the share of the grid's work that process ``rank`` of ``world_size`` does.

    ``jobs`` indexes the (model, context) pairs whose heads it fits: every ``world_size``-th one,
    from ``rank``. ``units`` indexes the ``n_cells * n_jobs`` (cell, model, context) units in
    cell-major order (unit ``u`` is cell ``u // n_jobs`` of job ``u % n_jobs``): one contiguous
    run of them (:func:`~shiftguard.train.distributed.shard_range`), so a process corrupts each
    of its cells once and only the cells at the runs' ends are corrupted by two processes.
    Every job and unit belongs to exactly one process.
    """
    from shiftguard.train.distributed import shard_range

    return range(rank, n_jobs, world_size), shard_range(n_jobs * n_cells, rank, world_size)


def _exchange(fn: Callable[[], object], world: int, what: str) -> list:
    """``[fn()]`` in one process, else every process's ``fn()`` in rank order, on every process
    (:func:`~shiftguard.train.distributed.all_gather_results`: a failure anywhere raises everywhere)."""
    if world == 1:
        return [fn()]
    from shiftguard.train.distributed import all_gather_results

    return all_gather_results(fn, what)


def _score_unit(
    out: dict,
    fitted: dict,
    name: str,
    ctx: str,
    adaptation: str,
    heads: Sequence[str],
    cell: Cell,
    test_y: torch.Tensor,
    retrieval_ks: Sequence[int],
    ece_bins: int,
    keep: bool,
    conformal: Optional[dict] = None,
) -> dict:
    """Rows of every head of one (model, context, adaptation arm) on one cell; with ``keep``, also each head's
    per-image ``(correct, confidence, hit)``, for the intervals and reliability pools. Each head reads
    the outputs its ``input`` names (the kNN heads share their searches through their
    ``SearchCache``). ``conformal``: ``{"spec",
    "uniform", "weights"}`` of the cell; each head's calibrators are ``fitted[name, ctx, head,
    "conformal"]``."""
    corruption, severity, group = cell
    if out["embeddings"] is not None:
        retrieval, miss = score_retrieval(out["embeddings"], test_y, retrieval_ks)
    else:
        retrieval, miss = {}, None
    rows, kept = [], []
    for h in heads:
        head = fitted[name, ctx, h]
        x = out[head.input]
        ovr = None
        with seeded(0, x.device):
            probs = torch.as_tensor(head.predict_proba(x))
            if hasattr(head, "predict_one_vs_rest"):
                ovr = torch.as_tensor(head.predict_one_vs_rest(x))
        norm, calib = calibration_view(probs, ovr)
        conf, top_class = calib.max(1)
        hit = top_class == test_y  # the top-label event the ECE is about
        correct = norm.argmax(1) == test_y  # the prediction accuracy counts
        kept.append((correct, conf, hit) if keep else None)
        sets = {}
        if conformal is not None:
            sets = set_metrics(
                conformal["spec"],
                fitted[name, ctx, h, "conformal"],
                probs,
                test_y,
                conformal["uniform"],
                conformal["weights"],
            )
        rows.append(
            {
                "model": name,
                "context": ctx,
                "adaptation": adaptation,
                "head": h,
                "corruption": corruption,
                "severity": severity,
                "n": int(test_y.numel()),
                "group": group,
                **score_cell(probs, test_y, miss, n_bins=ece_bins, one_vs_rest=ovr),
                **retrieval,
                **sets,
            }
        )
    return {"rows": rows, "kept": kept}
