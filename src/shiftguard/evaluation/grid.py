"""The evaluation grid: every (model, context, head) on every (corruption, severity) cell.

For each model:

1. compute its outputs (logits, embedding) on the clean support (training) set, the validation
   set, the clean test set (severity 0) and every corruption x severity of the test set;
2. fit every head on clean data only: embedding heads on the support embeddings (000, Sec. 4
   Remark: the baselines' last layer is refitted "on the train embedding"; NED / kNN on the
   unaltered support as in 004), temperature scaling on the validation logits;
3. score each (head, corruption, severity) cell (:func:`.scoring.score_cell`) and the
   embedding's retrieval quality within the test set.

QACT models see the test batch as their context (``batch_size``) and, unless told otherwise, are
evaluated a second time with the context frozen to the training distribution (000, Sec. 3),
so the report shows what the context buys. Each corrupted set is generated once and passed to
every model. Outputs are cached per (model, context, cell) when a cache folder is given, so an
interrupted evaluation resumes without recomputing finished cells.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import torch

from shiftguard.heads import build_head, head_input
from shiftguard.nn import has_qact, qact_context

from .aggregate import CLEAN
from .cache import OutputCache
from .outputs import ModelOutputs, compute_outputs
from .scoring import calibration_view, reliability_bins, score_cell, score_retrieval

__all__ = ["Cell", "applicable_heads", "model_contexts", "run_grid"]

#: One cell of the grid: ``(corruption, severity, group)``; group is "benchmark" or "extra".
Cell = tuple[str, int, str]


def model_contexts(model: torch.nn.Module, contexts: Sequence[str] = ("batch", "frozen")) -> list[str]:
    """Inference contexts a model is evaluated with: ``["none"]`` without QACT, else ``contexts``."""
    return list(contexts) if has_qact(model) else ["none"]


def applicable_heads(outputs: ModelOutputs, heads: Sequence[str], has_support: bool,
                     has_validation: bool) -> tuple[list[str], list[dict]]:
    """``(heads to fit, [{"head", "reason"}] skipped)``: what each head needs and what is there."""
    keep, skipped = [], []
    for h in heads:
        need = head_input(h)
        reason = None
        if need == "logits" and not outputs.has_logits:
            reason = "the model gives no logits (output='embedding')"
        elif need == "embeddings" and not outputs.has_embeddings:
            reason = f"the model has no embedding ({outputs.embedding_source})"
        elif need == "embeddings" and not has_support:
            reason = "needs support= data to be fitted on"
        elif h == "temperature" and not has_validation:
            reason = "needs validation= data (T is fitted on held-out logits)"
        if reason is None:
            keep.append(h)
        else:
            skipped.append({"head": h, "reason": reason})
    return keep, skipped


@contextmanager
def _seeded(seed: int = 0):
    """A fixed global RNG for one head fit / prediction (QACT heads sample from it), so a resumed
    run, whose RNG state differs after skipped training, scores exactly like an uninterrupted one."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


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
    retrieval_ks: Iterable[int] = (1, 5),
    ece_bins: int = 15,
    progress: bool = False,
) -> dict:
    """Score the grid; returns ``{"rows", "reliability", "per_image", "skipped_heads", "timings"}``.

    ``models`` holds ``{"name", "model", "outputs": ModelOutputs, "heads": [names]}`` dicts.
    ``shifted(corruption, severity)`` returns the corrupted test images (same order and labels as
    ``test``). Severity 0 (the clean test set) is scored once, as ``corruption="clean"``.
    ``per_image[(model, context, head)]`` keeps each test image's correctness and confidence on
    the clean set and on the benchmark corrupted cells, for bootstrap intervals.
    """
    from shiftguard._progress import progress as make_progress

    test_x, test_y = test
    all_cells: list[Cell] = [(CLEAN, 0, "benchmark")] + list(cells)
    top = max((s for _, s, _ in cells), default=0)
    timings = {"embed_s": 0.0, "fit_heads_s": 0.0, "score_s": 0.0, "corrupt_s": 0.0}
    skipped_all: list[dict] = []
    jobs = []
    for m in models:
        heads, skipped = applicable_heads(m["outputs"], m["heads"], support is not None, validation is not None)
        skipped_all += [{"model": m["name"], **s} for s in skipped]
        for ctx in model_contexts(m["model"], contexts):
            jobs.append((m, ctx, heads))
    bar = make_progress(total=len(jobs) * (2 + len(all_cells)), desc="evaluate", enabled=progress, unit="set")

    def outputs_of(m, ctx, key, make_images):
        root = Path(cache_root) / m["name"] / ctx if cache_root is not None else Path(".")
        cache = OutputCache(root, enabled=cache_root is not None)
        t0 = time.perf_counter()
        with qact_context(m["model"], "batch" if ctx == "none" else ctx):
            out = cache.get_or_compute(key, lambda: compute_outputs(m["outputs"], make_images(), batch_size, device))
        timings["embed_s"] += time.perf_counter() - t0
        bar.update(1, info=f"{m['name']}/{ctx}/{key}")
        return out

    # 1. fit the heads on clean data, per model and context
    fitted = {}
    for m, ctx, heads in jobs:
        emb_heads = [h for h in heads if head_input(h) == "embeddings"]
        sup = outputs_of(m, ctx, "support", lambda: support[0]) if support is not None and emb_heads else None
        needs_val = validation is not None and (emb_heads or "temperature" in heads)
        val = outputs_of(m, ctx, "validation", lambda: validation[0]) if needs_val else None
        t0 = time.perf_counter()
        for h in heads:
            head = build_head(h, num_classes, k=k)
            field = "logits" if head_input(h) == "logits" else "embeddings"
            val_x = val[field] if val is not None else None
            val_y = validation[1] if val is not None else None
            with _seeded():
                if field == "embeddings":
                    head.fit(sup["embeddings"], support[1], val_x, val_y)
                elif h == "temperature":
                    head.fit(val_x, val_y, val_x, val_y)
                elif val_x is not None or sup is not None:  # softmax: nothing to learn but the logit width
                    head.fit(val_x if val_x is not None else sup["logits"])
            fitted[m["name"], ctx, h] = head
        timings["fit_heads_s"] += time.perf_counter() - t0

    # 2. every cell: corrupt once, run every model, score every head
    rows: list[dict] = []
    pooled: dict[tuple, list] = {}
    per_image: dict[tuple, dict] = {}
    for corruption, severity, group in all_cells:
        key = f"{corruption}-s{severity}"
        images: dict = {}

        def make_images():
            if "x" not in images:
                t0 = time.perf_counter()
                images["x"] = test_x if corruption == CLEAN else shifted(corruption, severity)
                timings["corrupt_s"] += time.perf_counter() - t0
            return images["x"]

        for m, ctx, heads in jobs:
            out = outputs_of(m, ctx, key, make_images)
            t0 = time.perf_counter()
            if out["embeddings"] is not None:
                retrieval, miss = score_retrieval(out["embeddings"], test_y, retrieval_ks)
            else:
                retrieval, miss = {}, None
            for h in heads:
                head = fitted[m["name"], ctx, h]
                x = out["logits"] if head_input(h) == "logits" else out["embeddings"]
                ovr = None
                with _seeded():
                    probs = torch.as_tensor(head.predict_proba(x))
                    if hasattr(head, "predict_one_vs_rest"):
                        ovr = torch.as_tensor(head.predict_one_vs_rest(x))
                norm, calib = calibration_view(probs, ovr)
                conf, top_class = calib.max(1)
                hit = top_class == test_y            # the top-label event the ECE is about
                correct = norm.argmax(1) == test_y   # the prediction accuracy counts
                hk = (m["name"], ctx, h)
                if severity in (0, top) and group == "benchmark":
                    pooled.setdefault((*hk, severity), []).append((conf, hit))
                rec = per_image.setdefault(hk, {f"corrupted_{f}": [] for f in ("correct", "conf", "hit")})
                if severity == 0:
                    rec["clean_correct"], rec["clean_conf"], rec["clean_hit"] = correct, conf, hit
                elif group == "benchmark":
                    for f, v in (("correct", correct), ("conf", conf), ("hit", hit)):
                        rec[f"corrupted_{f}"].append(v)
                rows.append({
                    "model": m["name"], "context": ctx, "head": h, "corruption": corruption,
                    "severity": severity, "n": int(test_y.numel()), "group": group,
                    **score_cell(probs, test_y, miss, n_bins=ece_bins, one_vs_rest=ovr), **retrieval,
                })
            timings["score_s"] += time.perf_counter() - t0
    bar.close()
    for rec in per_image.values():
        for f in ("corrupted_correct", "corrupted_conf", "corrupted_hit"):
            rec[f] = torch.stack(rec[f]) if rec[f] else None
    reliability = []
    for (name, ctx, h, sev), parts in pooled.items():
        conf = torch.cat([p[0] for p in parts])
        correct = torch.cat([p[1] for p in parts])
        reliability.append({"model": name, "context": ctx, "head": h, "severity": sev,
                            **reliability_bins(conf, correct, ece_bins)})
    return {"rows": rows, "reliability": reliability, "per_image": per_image, "skipped_heads": skipped_all,
            "timings": timings}
