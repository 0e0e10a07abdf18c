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
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from shiftguard._rng import seeded
from shiftguard.heads import build_head, head_class
from shiftguard.neighbors import SearchCache, resolve_backend
from shiftguard.nn import has_qact, qact_context

from .adaptation import AdaptedModel, AdaptSpec, arm_contexts, skip_reason
from .adversarial import ADVERSARIAL
from .aggregate import CLEAN
from .cache import OutputCache
from .cell import Cell
from .conformal import cell_uniform, cell_weights, fit_calibrators, set_metrics
from .outputs import ModelOutputs, compute_outputs
from .plan import EvaluationPlan, GridResult, ModelEntry, Timings
from .scoring import calibration_view, reliability_bins, score_cell, score_retrieval

__all__ = ["Cell", "Job", "applicable_heads", "grid_jobs", "grid_shards", "model_contexts", "run_grid"]


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


class Job(NamedTuple):
    """One (model, context, adaptation arm) the grid scores on every cell, with its heads."""

    entry: ModelEntry
    context: str
    arm: AdaptSpec
    heads: tuple[str, ...]


def grid_jobs(
    models: Sequence[ModelEntry], adapt: Sequence[AdaptSpec], has_support: bool, has_validation: bool
) -> tuple[list[Job], list[dict], list[dict]]:
    """``(jobs, skipped heads, skipped arms)``: the jobs the grid scores on every cell, model by
    model, arm by arm (in the order of ``adapt``), then context by context
    (:func:`~.adaptation.arm_contexts` of the model's :func:`model_contexts`). An arm a model
    cannot use is skipped with the reason (:func:`~.adaptation.skip_reason`), like a head."""
    jobs, skipped_heads, skipped_arms = [], [], []
    for m in models:
        heads, skipped = applicable_heads(m.outputs, m.heads, has_support, has_validation)
        skipped_heads += [{"model": m.name, **s} for s in skipped]
        ctxs = model_contexts(m.model, m.contexts)
        for spec in adapt:
            reason = skip_reason(spec, m.outputs)
            if reason is not None:
                skipped_arms.append({"model": m.name, "adaptation": spec.label, "reason": reason})
                continue
            jobs += [Job(m, ctx, spec, tuple(heads)) for ctx in arm_contexts(spec, ctxs)]
    return jobs, skipped_heads, skipped_arms


def _clock(device: torch.device) -> float:
    """``time.perf_counter()`` once the device's queued work is done: on a GPU the kernels run
    asynchronously, and without the synchronisation a step's seconds would be counted in whichever
    later step reads a result back (``Timings``)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _slug(label: str) -> str:
    """An arm label as a folder name."""
    return "".join(ch if ch.isalnum() or ch in "-." else "-" for ch in label)


def run_grid(plan: EvaluationPlan) -> GridResult:
    """Score every (model, context, adaptation arm, head) of ``plan`` on the clean test set and
    every cell; see the module docstring.

    The heads of a (model, context) are fitted once, on the static model's clean outputs, and score
    every arm (:func:`~.adaptation.arm_contexts` gives an arm's contexts; rows say which arm in
    ``"adaptation"``). Adversarial cells (``plan.attacks``, :mod:`.adversarial`) are attacked per
    (model, context) and scored for the ``"none"`` arm only: attacking an adapting model is another
    threat model. ``plan.seed``: the batch order of the ``refresh`` arm's passes and the draws of
    the conformal sets. With ``plan.conformal`` every head is also calibrated on
    ``plan.calibration`` and each row records the coverage and mean size of its prediction sets.
    ``per_image[(model, context, adaptation, head)]`` keeps each test image's correctness and
    confidence on the clean set and on the benchmark cells. ``plan.knn_backend``: the NED / kNN
    heads' search, ``"auto"`` resolved by :func:`shiftguard.neighbors.resolve_backend` for the
    support's rows and the test rows; the heads share one :class:`~shiftguard.neighbors.SearchCache`.

    ``plan.distributed``: when a ``torch.distributed`` process group of several processes is up,
    every process must call ``run_grid`` with the same plan; the heads of each (model, context) are
    fitted by one process and sent to all, each process scores its contiguous share of the (cell,
    model, context) units (:func:`grid_shards`), and every process returns the complete grid,
    identical to one process's. Each cached output is written by the one process that computes it;
    ``timings`` sums the processes' seconds.

    Raises:
        RuntimeError: under ``distributed``, on every process when another process failed (the
            failing process raises its own error).
    """
    from shiftguard._progress import progress as make_progress
    from shiftguard.train.distributed import get_rank, get_world_size, is_distributed

    rank, world = (get_rank(), get_world_size()) if plan.distributed and is_distributed() else (0, 1)
    n_support = 0 if plan.support is None else int(plan.support[1].numel())
    backend = resolve_backend(plan.knn_backend, n_support, int(plan.test[1].numel()), argument="knn_backend")
    jobs, skipped_heads, skipped_arms = grid_jobs(
        plan.models, plan.adapt, plan.support is not None, plan.validation is not None
    )
    fits: dict[tuple, Job] = {}  # the heads of a (model, context) are fitted once, for every arm
    for job in jobs:
        fits.setdefault((job.entry.name, job.context), job)
    fit_share = list(fits.values())[rank::world]
    _, unit_share = grid_shards(len(jobs), len(plan.all_cells), rank, world)
    bar = make_progress(total=2 * len(fit_share) + len(unit_share), desc="evaluate", enabled=plan.progress, unit="set")
    source = _OutputSource(plan, bar)
    heads = _HeadFitter(plan, source, backend)
    try:
        fitted: dict[tuple, Any] = {}
        timings = Timings()
        for part, seconds in _exchange(lambda: heads.fit(fit_share), world, "fitting the heads", plan.device):
            fitted.update(part)
            timings += seconds
        scorer = _UnitScorer(plan, source, fitted, jobs)
        shares = _exchange(lambda: scorer.score(unit_share), world, "scoring the grid", plan.device)
    finally:
        bar.close()
    units = {u: r for part, _ in shares for u, r in part.items()}
    for _, seconds in shares:
        timings += seconds
    rows, reliability, per_image = _assemble(plan, jobs, units)
    return GridResult(rows, reliability, per_image, skipped_heads, skipped_arms, timings, world, backend)


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


def _exchange(fn: Callable[[], object], world: int, what: str, device: torch.device) -> list:
    """``[fn()]`` in one process, else every process's ``fn()`` in rank order, on every process
    (:func:`~shiftguard.train.distributed.all_gather_results`: a failure anywhere raises everywhere),
    the tensors of a peer's result (its fitted heads) moved to this process's ``device``."""
    if world == 1:
        return [fn()]
    from shiftguard.train.distributed import all_gather_results

    return all_gather_results(fn, what, map_location=device)


class _OutputSource:
    """A model's outputs on a set of images in one (context, arm): read from the output cache, else
    computed (and cached); each arm's private adapted copy of a model is made once per process."""

    def __init__(self, plan: EvaluationPlan, bar) -> None:
        self.plan, self.bar = plan, bar
        self.adapted: dict[tuple, AdaptedModel] = {}  # (model name, arm label) -> the arm's copy

    def __call__(self, job: Job, key: str, make_images: Callable[[], torch.Tensor], seconds: Timings) -> dict:
        """The outputs of ``job`` on ``make_images()`` (called only when they are not cached),
        cached under ``key``; the seconds go to ``seconds.embed_s`` (static) or ``adapt_s``."""
        plan, m, static = self.plan, job.entry, job.arm.name == "none"
        root = plan.cache_root / m.name / job.context if plan.cache_root is not None else Path(".")
        if not static:
            root = root / f"adapt-{_slug(job.arm.label)}"
        cache = OutputCache(root, enabled=plan.cache_root is not None)
        t0 = _clock(plan.device)
        if static:
            with qact_context(m.model, "batch" if job.context == "none" else job.context):
                out = cache.get_or_compute(
                    key, lambda: compute_outputs(m.outputs, make_images(), plan.batch_size, plan.device), plan.device
                )
            seconds.embed_s += _clock(plan.device) - t0
        else:

            def compute():
                arm = self.adapted.get((m.name, job.arm.label))
                if arm is None:
                    arm = self.adapted[m.name, job.arm.label] = AdaptedModel(job.arm, m.outputs, seed=plan.seed)
                return arm.outputs_on(make_images(), plan.batch_size, plan.device, job.context)

            out = cache.get_or_compute(key, compute, plan.device)
            seconds.adapt_s += _clock(plan.device) - t0
        self.bar.update(1, info=f"{m.name}/{job.context}/{job.arm.label}/{key}")
        return out


class _HeadFitter:
    """Fits the heads of (model, context) jobs on clean data, with one call per head (its ``input``,
    the support set where it ``needs_support``, the validation set where it ``uses_validation``),
    and the conformal calibrators of each head."""

    def __init__(self, plan: EvaluationPlan, source: _OutputSource, backend: str) -> None:
        self.plan, self.source, self.backend = plan, source, backend
        self.searches = SearchCache()

    def fit(self, jobs: Sequence[Job]) -> tuple[dict, Timings]:
        """``({(model, context, head): fitted head, ...}, seconds)``; conformal calibrators under
        ``(model, context, head, "conformal")``, the calibration features under
        ``(model, context, "calibration-features")``."""
        plan, seconds, fitted = self.plan, Timings(), {}
        static = AdaptSpec("none")
        for job in jobs:
            m, ctx = job.entry, job.context
            job = job._replace(arm=static)
            built = {
                h: build_head(h, plan.num_classes, k=plan.k, backend=self.backend, searches=self.searches)
                for h in job.heads
            }
            # applicable_heads keeps a head that needs_support only when a support set is given. The
            # validation outputs are computed (and cached) beside the support's whenever a head learns
            # from data, whether or not it reads them, so the cache folder of a (model, context) is
            # filled alike for any such set of heads.
            learns = any(hd.needs_support or hd.uses_validation for hd in built.values())
            (sup_x, sup_y), (val_x, val_y) = plan.support or (None, None), plan.validation or (None, None)
            sup = val = None
            if sup_x is not None and any(hd.needs_support for hd in built.values()):
                sup = self.source(job, "support", lambda: sup_x, seconds)
            if val_x is not None and learns:
                val = self.source(job, "validation", lambda: val_x, seconds)
            t0 = _clock(plan.device)
            for h, head in built.items():
                train = (sup[head.input], sup_y) if sup is not None else (None, None)
                held_out = (val[head.input], val_y) if val is not None and head.uses_validation else ()
                # a fixed global RNG for each head fit / prediction (QACT heads sample from it), so a
                # resumed run, whose RNG state differs after skipped training, scores like an uninterrupted one
                with seeded(0, plan.device):
                    head.fit(*train, *held_out)
                fitted[m.name, ctx, h] = head
            if plan.conformal is not None:
                fitted.update(self._calibrate(job, fitted, seconds))
            seconds.fit_heads_s += _clock(plan.device) - t0
        return fitted, seconds

    def _calibrate(self, job: Job, fitted: dict, seconds: Timings) -> dict:
        plan, m, ctx = self.plan, job.entry, job.context
        assert plan.calibration is not None and plan.conformal is not None
        cal_x, cal_y = plan.calibration
        cal_y = cal_y.to(plan.device)
        cal = self.source(job, "calibration", lambda: cal_x, seconds)
        out: dict[tuple, Any] = {
            (m.name, ctx, "calibration-features"): cal["embeddings"] if cal["embeddings"] is not None else cal["logits"]
        }
        for h in job.heads:
            head = fitted[m.name, ctx, h]
            with seeded(0, plan.device):
                probs = torch.as_tensor(head.predict_proba(cal[head.input]))
            out[m.name, ctx, h, "conformal"] = fit_calibrators(plan.conformal, probs, cal_y, plan.seed)
        return out


class _UnitScorer:
    """Scores (cell, job) units: corrupts (or attacks) each cell once, reads the job's outputs on
    it and scores every head (:func:`_score_unit`)."""

    def __init__(self, plan: EvaluationPlan, source: _OutputSource, fitted: dict, jobs: Sequence[Job]) -> None:
        self.plan, self.source, self.fitted, self.jobs = plan, source, fitted, jobs
        self.cells = plan.all_cells
        self.labels = plan.test[1].to(plan.device)  # the cells are scored where the outputs are

    def score(self, units: Sequence[int]) -> tuple[dict[int, dict], Timings]:
        """``({unit: {"rows", "kept"}}, seconds)`` for ``units`` (cell-major indices)."""
        plan, seconds = self.plan, Timings()
        results: dict[int, dict] = {}
        images: dict = {}  # one cell's images at a time: units are cell-major
        n_test = int(plan.test[1].numel())
        for u in units:
            c, j = divmod(u, len(self.jobs))
            cell, job = self.cells[c], self.jobs[j]
            if cell.group == ADVERSARIAL and job.arm.name != "none":
                results[u] = {"rows": [], "kept": []}
                continue

            def make_images(cell=cell, c=c, job=job) -> torch.Tensor:
                t0 = _clock(plan.device)
                if cell.group == ADVERSARIAL:  # white-box: every (model, context) has its own images
                    assert plan.attacks is not None
                    x = plan.attacks(job.entry, job.context, cell.corruption, cell.severity)
                    seconds.attack_s += _clock(plan.device) - t0
                    return x
                if images.get("cell") != c:
                    clean = cell.corruption == CLEAN
                    images["x"] = plan.test[0] if clean else plan.shifted(cell.corruption, cell.severity)
                    images["cell"] = c
                    seconds.corrupt_s += _clock(plan.device) - t0
                return images["x"]

            if cell.group == ADVERSARIAL and plan.attacks is not None:
                key = plan.attacks.key(cell.corruption, cell.severity)
            else:
                key = f"{cell.corruption}-s{cell.severity}"
            out = self.source(job, key, make_images, seconds)
            t0 = _clock(plan.device)
            sets = None
            if plan.conformal is not None:
                weights = None
                if plan.conformal.weighted:
                    features = out["embeddings"] if out["embeddings"] is not None else out["logits"]
                    cal = self.fitted[job.entry.name, job.context, "calibration-features"]
                    weights = cell_weights(cal, features, plan.seed)
                uniform = cell_uniform(n_test, plan.seed, c).to(plan.device)
                sets = {"spec": plan.conformal, "uniform": uniform, "weights": weights}
            keep = cell.severity == 0 or cell.group == "benchmark"
            results[u] = _score_unit(plan, out, self.labels, self.fitted, job, cell, keep=keep, conformal=sets)
            seconds.score_s += _clock(plan.device) - t0
        self.source.bar.close()
        return results, seconds


def _assemble(plan: EvaluationPlan, jobs: Sequence[Job], units: dict[int, dict]) -> tuple[list, list, dict]:
    """``(rows, reliability, per_image)`` from every unit, in the single-process order: cells, then
    jobs, then heads; the reliability bins pool the benchmark cells of the clean and top severity."""
    cells = plan.all_cells
    top = max((c.severity for c in plan.cells), default=0)
    rows: list[dict] = []
    pooled: dict[tuple, list] = {}
    per_image: dict[tuple, dict] = {}
    for u in range(len(cells) * len(jobs)):
        c, j = divmod(u, len(jobs))
        _, severity, group = cells[c]
        m, ctx, spec, heads = jobs[j]
        for h, row, kept in zip(heads, units[u]["rows"], units[u]["kept"]):
            rows.append(row)
            if kept is None:
                continue
            correct, conf, hit = kept
            hk = (m.name, ctx, spec.label, h)
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
        bins = reliability_bins(conf, correct, plan.ece_bins)
        reliability.append({"model": name, "context": ctx, "adaptation": arm, "head": h, "severity": sev, **bins})
    return rows, reliability, per_image


def _score_unit(
    plan: EvaluationPlan,
    out: dict,
    test_y: torch.Tensor,
    fitted: dict,
    job: Job,
    cell: Cell,
    keep: bool,
    conformal: Optional[dict] = None,
) -> dict:
    """Rows of every head of one job on one cell; with ``keep``, also each head's per-image
    ``(correct, confidence, hit)`` on the host, for the intervals and reliability pools (the one
    copy of a head's per-image results; everything else stays on the outputs' device, where
    ``test_y`` is). Each head reads the outputs its ``input`` names (the kNN heads share their
    searches through their ``SearchCache``). ``conformal``: ``{"spec", "uniform", "weights"}`` of the cell; each head's
    calibrators are ``fitted[name, ctx, head, "conformal"]``."""
    name, ctx = job.entry.name, job.context
    if out["embeddings"] is not None:
        retrieval, miss = score_retrieval(out["embeddings"], test_y, plan.retrieval_ks)
    else:
        retrieval, miss = {}, None
    rows, kept = [], []
    for h in job.heads:
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
        kept.append(_on_host(correct, conf, hit) if keep else None)
        sets = {}
        if conformal is not None:
            calibrators = fitted[name, ctx, h, "conformal"]
            sets = set_metrics(
                conformal["spec"], calibrators, probs, test_y, conformal["uniform"], conformal["weights"]
            )
        rows.append(
            {
                "model": name,
                "context": ctx,
                "adaptation": job.arm.label,
                "head": h,
                "corruption": cell.corruption,
                "severity": cell.severity,
                "n": int(test_y.numel()),
                "group": cell.group,
                **score_cell(probs, test_y, miss, n_bins=plan.ece_bins, one_vs_rest=ovr),
                **retrieval,
                **sets,
            }
        )
    return {"rows": rows, "kept": kept}


def _on_host(correct: torch.Tensor, conf: torch.Tensor, hit: torch.Tensor) -> tuple:
    """``(correct, conf, hit)`` copied to the host in one transfer (float32 holds the booleans
    exactly; ``conf`` is float32 already)."""
    block = torch.stack((correct.float(), conf.float(), hit.float())).cpu()
    return block[0].bool(), block[1], block[2].bool()
