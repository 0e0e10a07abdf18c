"""The evaluation protocol of ``shiftguard run`` (000, Sec. 4 and App. C; 004, Sec. 5).

For one trained model:

1. embed the clean training split (the support), the validation split, the clean test set
   (severity 0) and every corruption x severity of the test set;
2. fit every head on the clean *training* embeddings only (000, Sec. 4 Remark: "we retrain the
   last layer with logistic regression on the train embedding" for the baselines, the quantile
   classifier for QACT; NED / kNN as in 004 with the support set unaltered);
3. score each (head, corruption, severity) cell: accuracy, top-label and marginal ECE, NLL,
   R-AUROC and error-AUROC of the head's uncertainty (1 - max probability), and the
   embedding's retrieval quality within the test set (MAP@K, Recall@K);
4. aggregate: mean and std over corruptions per severity, and the accuracy drop
   ``Acc@Dist_i - Acc@Dist_j`` of 000, App. C, Tables 1-2.

QACT models see the test batch as their context (``eval.batch_size``); with
``eval.frozen_context`` they are evaluated a second time with the context frozen to the
training distribution, so the report shows what the context buys.

Embeddings are cached per (model, context, corruption, severity) under ``<run>/cache`` and
reused, so an interrupted evaluation of a large grid resumes without recomputing finished
cells.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Optional

import numpy as np
import torch
from torch import nn

from shiftguard.io import atomic_write
from shiftguard.train.trainer import to_model_input

__all__ = [
    "compute_embeddings", "EmbeddingCache", "build_head", "SoftmaxHead", "score_cell",
    "evaluate_models", "model_contexts", "aggregate", "accuracy_drops", "has_qact", "qact_context",
]

CLEAN = "clean"


# --------------------------------------------------------------------------- QACT context
def _qact_modules(model: nn.Module) -> list[nn.Module]:
    from shiftguard.nn import QuantileActivation

    return [m for m in model.modules() if isinstance(m, QuantileActivation)]


def has_qact(model: nn.Module) -> bool:
    return bool(_qact_modules(model))


@contextmanager
def qact_context(model: nn.Module, mode: str):
    """Temporarily switch every QuantileActivation's inference context (``"batch"``/``"frozen"``)."""
    mods = _qact_modules(model)
    old = [m.context for m in mods]
    try:
        for m in mods:
            m.context = mode
        yield
    finally:
        for m, c in zip(mods, old):
            m.context = c


# --------------------------------------------------------------------------- embeddings
@torch.no_grad()
def compute_embeddings(
    model: nn.Module,
    images: torch.Tensor,
    batch_size: int,
    device: str | torch.device = "cpu",
    order_seed: Optional[int] = 0,
) -> dict:
    """``{"embeddings": (N, D), "logits": (N, C)}`` (float32, CPU) of ``images`` in eval mode.

    The batches are drawn in a fixed random order (``order_seed``) and the outputs put back in
    the input order: for QACT the batch is the context, and a class-sorted test file must not
    give class-pure contexts. The last batch is merged into the previous one when it would hold
    fewer than half a batch, so every context is at least ``batch_size / 2`` images.
    """
    model.eval()
    with torch.random.fork_rng(devices=[]):
        # QACT draws its KDE samples from the global RNG: a fixed seed makes embeddings repeatable
        # without disturbing the caller's random stream.
        torch.manual_seed(0)
        return _compute_embeddings(model, images, batch_size, device, order_seed)


def _compute_embeddings(model, images, batch_size, device, order_seed) -> dict:
    n = images.shape[0]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(order_seed)) if order_seed is not None else torch.arange(n)
    bounds = list(range(0, n, batch_size)) + [n]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] < batch_size // 2:
        del bounds[-2]
    embs, logits = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        x = to_model_input(images[order[a:b]], device)
        e = model.embed(x)
        embs.append(e.float().cpu())
        logits.append(model.classifier(e).float().cpu())
    inv = torch.empty_like(order)
    inv[order] = torch.arange(n)
    return {"embeddings": torch.cat(embs)[inv], "logits": torch.cat(logits)[inv]}


class EmbeddingCache:
    """Embeddings of one model on disk: ``<root>/<key>.pt``, written atomically.

    A file that cannot be read (e.g. left by a killed process on a filesystem without atomic
    rename) is recomputed.
    """

    def __init__(self, root: str | Path, enabled: bool = True):
        self.root = Path(root)
        self.enabled = enabled
        self.hits = 0
        self.misses = 0

    def path(self, key: str) -> Path:
        return self.root / f"{key}.pt"

    def get_or_compute(self, key: str, fn: Callable[[], dict]) -> dict:
        p = self.path(key)
        if self.enabled and p.is_file():
            try:
                out = torch.load(p, map_location="cpu", weights_only=True)
                self.hits += 1
                return out
            except Exception:  # damaged cache file: recompute it
                pass
        out = fn()
        self.misses += 1
        if self.enabled:
            atomic_write(p, lambda fh: torch.save(out, fh))
        return out


# --------------------------------------------------------------------------- heads
class SoftmaxHead:
    """The model's own trained classifier (softmax of ``model.classifier``), no refit."""

    def __init__(self, classifier: nn.Module):
        self.classifier = classifier

    def fit(self, train_emb, train_labels, val_emb=None, val_labels=None):
        return self

    @torch.no_grad()
    def predict_proba(self, emb: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.classifier(emb.to(next(self.classifier.parameters()).device)).float().cpu(), dim=1)


def _logit_fn(classifier: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """Embeddings (CPU) -> the model's logits (CPU, float32, no graph)."""
    dev = next(classifier.parameters()).device

    @torch.no_grad()
    def fn(emb: torch.Tensor) -> torch.Tensor:
        return classifier(emb.to(dev)).float().cpu()

    return fn


def build_head(name: str, model: nn.Module, num_classes: int, k: int = 10, seed: int = 0):
    """A fresh head by config name (see ``config.HEAD_NAMES``)."""
    from shiftguard import heads as H

    if name == "softmax":
        return SoftmaxHead(model.classifier)
    if name == "temperature":
        # Temperature scaling of the model's own logits, T fitted on the validation split.
        return H.TemperatureScaling(logit_fn=_logit_fn(model.classifier), num_classes=num_classes)
    table = {
        "logistic": lambda: H.LogisticRegressionHead(num_classes=num_classes),
        "quantile": lambda: H.QuantileClassifierHead(num_classes=num_classes),
        # 004 Sec. 2: T is fitted on the held-out validation split, the support is the train split.
        "ned": lambda: H.NED(k=k, fit_mode="holdout", num_classes=num_classes),
        "knn": lambda: H.KNNVote(k=k, num_classes=num_classes),
        "wknn": lambda: H.WeightedKNN(k=k, num_classes=num_classes),
        "1nn": lambda: H.OneNN(num_classes=num_classes),
        "distance_ratio": lambda: H.DistanceRatioHead(num_classes=num_classes),
    }
    if name not in table:
        raise ValueError(f"head: unknown name {name!r}; expected one of softmax, temperature, {', '.join(table)}")
    return table[name]()


# --------------------------------------------------------------------------- metrics of one cell
def score_cell(probs: torch.Tensor, labels: torch.Tensor, miss: torch.Tensor, n_bins: int = 15,
               one_vs_rest: Optional[torch.Tensor] = None) -> dict:
    """Classification, calibration and uncertainty metrics of one head on one test set.

    The head's uncertainty is ``1 - max probability``. ``r_auroc`` (003, URL benchmark, Alg. 1) is
    its AUROC for predicting a Recall@1 miss of the embedding (``miss`` from
    :func:`score_retrieval`, computed once per cell: it is ``metrics.r_auroc`` without repeating the
    kNN search per head);
    ``auroc_error`` its AUROC for predicting the head's own errors.

    ``one_vs_rest``: the head's one-vs-rest probabilities (quantile classifier). When given, the
    ECEs and the confidence are computed on them, as 000 Sec. 4 reports the quantile classifier
    (``metrics.ece(one_vs_rest=True)``); accuracy and NLL use the normalised ``probs``.
    """
    from shiftguard import metrics as M

    probs = probs.float().clamp_min(0)
    probs = probs / probs.sum(1, keepdim=True).clamp_min(1e-12)
    calib = probs if one_vs_rest is None else one_vs_rest.float().clamp(0, 1)
    ovr = one_vs_rest is not None
    conf, pred = calib.max(1)
    uncertainty = 1.0 - conf
    return {
        "accuracy": float(M.accuracy(probs, labels)),
        "ece_top_label": float(M.ece(calib, labels, n_bins=n_bins, kind="top-label", one_vs_rest=ovr)),
        "ece_marginal": float(M.ece(calib, labels, n_bins=n_bins, kind="marginal", one_vs_rest=ovr)),
        "nll": float(M.nll(probs, labels)),
        "r_auroc": _or_none(lambda: M.auroc_error(uncertainty, miss)),
        "auroc_error": _or_none(lambda: M.auroc_error(uncertainty, pred != labels)),
        "mean_confidence": float(conf.mean()),
    }


def score_retrieval(emb: torch.Tensor, labels: torch.Tensor, ks) -> tuple[dict, torch.Tensor]:
    """MAP@K and Recall@K of the test embeddings, each querying all the others (000, Sec. 4 MAP@K),
    and the Recall@1 misses -- the nearest other embedding has another class (003, R-AUROC's
    target) -- read off the same neighbour lists (one search)."""
    from shiftguard import metrics as M

    # MAP@R is not reported here
    r, nearest = M.retrieval_metrics(emb, labels, ks=tuple(ks), r_metrics=False, return_nearest=True)
    out = {}
    for k in ks:
        out[f"map_at_{k}"] = _finite(r[f"map@{k}"])
        out[f"recall_at_{k}"] = _finite(r[f"recall@{k}"])
    return out, labels[nearest] != labels


def _or_none(fn) -> Optional[float]:
    """A metric that is undefined for this cell (e.g. AUROC with no errors at all) is ``None``."""
    try:
        return _finite(fn())
    except ValueError:
        return None


def _finite(v) -> Optional[float]:
    v = float(v)
    return v if math.isfinite(v) else None


# --------------------------------------------------------------------------- the grid
@contextmanager
def _seeded(seed: int = 0):
    """A fixed global RNG for one head fit / prediction (QACT heads sample from it), so a resumed
    run, whose RNG state differs after skipped training, scores exactly like an uninterrupted one."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def model_contexts(model: nn.Module, frozen_context: bool) -> list[str]:
    """Inference contexts a model is evaluated with: "none" (no QACT), "batch" (+ "frozen")."""
    if not has_qact(model):
        return ["none"]
    return ["batch", "frozen"] if frozen_context else ["batch"]


def evaluate_models(
    *,
    models: list[dict],
    support: tuple[torch.Tensor, torch.Tensor],
    validation: tuple[torch.Tensor, torch.Tensor],
    test: tuple[torch.Tensor, torch.Tensor],
    shifted: Callable[[str, int], torch.Tensor],
    corruptions: list[str],
    severities: list[int],
    num_classes: int,
    cache_root: str | Path,
    batch_size: int = 1000,
    device: str | torch.device = "cpu",
    frozen_context: bool = True,
    k: int = 10,
    retrieval_ks: Iterable[int] = (1, 5),
    ece_bins: int = 15,
    max_support: int = 0,
    progress: bool = True,
) -> tuple[list[dict], dict]:
    """Result rows (one per model x context x head x corruption x severity) and timings.

    ``models`` holds ``{"name", "model", "heads"}`` dicts. ``shifted(corruption, severity)``
    returns the corrupted test images (uint8, same order and labels as ``test``); each corrupted
    set is generated once and embedded by every model. Severity 0 (the clean test set) is scored
    once, as ``corruption="clean"``.
    """
    sup_x, sup_y = support
    if max_support and sup_y.numel() > max_support:
        sup_x, sup_y = sup_x[:max_support], sup_y[:max_support]
    val_x, val_y = validation
    test_x, test_y = test
    cells = [(CLEAN, 0)] + [(c, s) for c in corruptions for s in severities]
    jobs = [(m, ctx) for m in models for ctx in model_contexts(m["model"], frozen_context)]
    timings = {"embed_s": 0.0, "fit_heads_s": 0.0, "score_s": 0.0, "corrupt_s": 0.0}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(jobs) * (2 + len(cells)), desc="evaluate", dynamic_ncols=True)

    def embed(m, ctx, key, make_images):
        cache = EmbeddingCache(Path(cache_root) / m["name"] / ctx)
        t0 = time.perf_counter()
        with qact_context(m["model"], "batch" if ctx == "none" else ctx):
            out = cache.get_or_compute(key, lambda: compute_embeddings(m["model"], make_images(), batch_size, device))
        timings["embed_s"] += time.perf_counter() - t0
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(f"{m['name']}/{ctx}/{key}")
        return out

    # 1. fit the heads on clean training embeddings, per model and context
    fitted = {}
    for m, ctx in jobs:
        tr = embed(m, ctx, "support", lambda: sup_x)
        va = embed(m, ctx, "validation", lambda: val_x)
        t0 = time.perf_counter()
        for h in m["heads"]:
            head = build_head(h, m["model"], num_classes, k=k)
            with _seeded():
                head.fit(tr["embeddings"], sup_y, va["embeddings"], val_y)
            fitted[m["name"], ctx, h] = head
        timings["fit_heads_s"] += time.perf_counter() - t0

    # 2. every (corruption, severity) cell: corrupt once, embed by every model, score every head
    rows: list[dict] = []
    top = max(severities) if severities else 0
    pooled: dict[tuple, list] = {}  # (model, ctx, head, severity) -> [(confidence, correct)]
    for corruption, severity in cells:
        key = f"{corruption}-s{severity}"
        images: dict = {}

        def make_images():
            if "x" not in images:
                t0 = time.perf_counter()
                images["x"] = test_x if corruption == CLEAN else shifted(corruption, severity)
                timings["corrupt_s"] += time.perf_counter() - t0
            return images["x"]

        for m, ctx in jobs:
            out = embed(m, ctx, key, make_images)
            t0 = time.perf_counter()
            retrieval, miss = score_retrieval(out["embeddings"], test_y, retrieval_ks)
            for h in m["heads"]:
                head = fitted[m["name"], ctx, h]
                ovr = None
                with _seeded():
                    probs = torch.as_tensor(head.predict_proba(out["embeddings"]))
                    if hasattr(head, "predict_one_vs_rest"):
                        ovr = torch.as_tensor(head.predict_one_vs_rest(out["embeddings"]))
                if severity in (0, top):
                    conf, pred = (probs if ovr is None else ovr).float().max(1)
                    pooled.setdefault((m["name"], ctx, h, severity), []).append((conf, pred == test_y))
                rows.append({
                    "model": m["name"], "context": ctx, "head": h, "corruption": corruption,
                    "severity": severity, "n": int(test_y.numel()),
                    **score_cell(probs, test_y, miss, n_bins=ece_bins, one_vs_rest=ovr), **retrieval,
                })
            timings["score_s"] += time.perf_counter() - t0
    if bar is not None:
        bar.close()
    reliability = []
    for (name, ctx, h, sev), parts in pooled.items():
        conf = torch.cat([p[0] for p in parts])
        correct = torch.cat([p[1] for p in parts])
        reliability.append({"model": name, "context": ctx, "head": h, "severity": sev,
                            **reliability_bins(conf, correct, ece_bins)})
    return rows, {"timings": timings, "reliability": reliability}


def reliability_bins(confidence: torch.Tensor, correct: torch.Tensor, n_bins: int = 15) -> dict:
    """Equal-width confidence bins (the reliability diagram of 004, Sec. 3 / Fig. 1):
    per bin the mean confidence, the accuracy and the count; empty bins hold ``None``."""
    conf = confidence.double().clamp(0, 1)
    idx = torch.clamp((conf * n_bins).long(), max=n_bins - 1)
    count = torch.bincount(idx, minlength=n_bins)
    s_conf = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, idx, conf)
    s_acc = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, idx, correct.double())
    nz = count > 0
    return {
        "edges": torch.linspace(0, 1, n_bins + 1).tolist(),
        "confidence": [float(s_conf[i] / count[i]) if nz[i] else None for i in range(n_bins)],
        "accuracy": [float(s_acc[i] / count[i]) if nz[i] else None for i in range(n_bins)],
        "count": count.tolist(),
    }


# --------------------------------------------------------------------------- aggregation
METRICS = ("accuracy", "ece_top_label", "ece_marginal", "nll", "r_auroc", "auroc_error")


def _group(rows: list[dict]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["context"], r["head"]), []).append(r)
    return groups


def _stats(values: list) -> tuple[Optional[float], Optional[float]]:
    v = np.array([x for x in values if x is not None], dtype=float)
    if v.size == 0:
        return None, None
    return float(v.mean()), float(v.std(ddof=0))


def aggregate(rows: list[dict]) -> list[dict]:
    """Mean and std over corruptions per (model, context, head, severity); severity 0 is clean."""
    out = []
    for (model, ctx, head), rs in _group(rows).items():
        metric_keys = [k for k in rs[0] if k not in ("model", "context", "head", "corruption", "severity", "n")]
        for sev in sorted({r["severity"] for r in rs}):
            sel = [r for r in rs if r["severity"] == sev]
            row = {"model": model, "context": ctx, "head": head, "severity": sev, "n_corruptions": len(sel) if sev else 0}
            for m in metric_keys:
                row[f"{m}_mean"], row[f"{m}_std"] = _stats([r[m] for r in sel])
            out.append(row)
    return out


def accuracy_drops(rows: list[dict], pairs: Optional[list[tuple[int, int]]] = None) -> list[dict]:
    """``Acc@Dist_i - Acc@Dist_j`` (000, App. C, Tables 1-2), in accuracy points (x100).

    ``drop_mean`` uses the mean accuracy over corruptions at each severity (the tables' measure);
    ``drop_std`` is the std across corruptions of the per-corruption drop, ``per_corruption``
    lists them. Severity 0 is the clean test set, shared by every corruption.
    """
    out = []
    for (model, ctx, head), rs in _group(rows).items():
        acc = {}
        for r in rs:
            acc.setdefault(r["severity"], {})[r["corruption"]] = r["accuracy"]
        sevs = sorted(acc)
        todo = pairs or [(i, j) for i in sevs for j in sevs if i < j]
        for i, j in todo:
            if i not in acc or j not in acc:
                continue
            per = {}
            for c in acc[j]:
                a_i = acc[i][CLEAN] if i == 0 else acc[i].get(c)
                if a_i is not None:
                    per[c] = 100.0 * (a_i - acc[j][c])
            mean_i = float(np.mean(list(acc[i].values())))
            mean_j = float(np.mean(list(acc[j].values())))
            out.append({
                "model": model, "context": ctx, "head": head, "from": i, "to": j,
                "drop_mean": 100.0 * (mean_i - mean_j),
                "drop_std": float(np.std(list(per.values()))) if per else None,
                "per_corruption": per,
            })
    return out
