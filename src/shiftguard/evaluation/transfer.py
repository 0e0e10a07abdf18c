"""Evaluation of the transfer benchmark [Kirchhof, URL Sec. 3]: the metrics of one trained model on
its upstream and downstream test images, and the tables over seeds and splits.

Metrics of one (method, split, seed), for every uncertainty the method defines (higher = more
uncertain):

- ``r1``: downstream Recall@1, the fraction of test images whose nearest other embedding by cosine
  similarity (the L2-normalised embeddings, as URL computes it) has the same class
  [Kirchhof, URL Sec. 3.1, Alg. 1]. The neighbours are those of
  :func:`shiftguard.metrics.retrieval_metrics` on the normalised embeddings, and ``r1`` is its
  ``recall@1`` wherever every class has a second image (a query alone in its class, which
  ``retrieval_metrics`` leaves out, counts here as a miss);
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

:func:`summarize`, :func:`across_splits` and :func:`format_table` turn the runs of
``shiftguard transfer`` into its tables.
"""

from __future__ import annotations

import statistics
from typing import Optional, Sequence

import torch

from shiftguard._validation import check_labels, check_tensor
from shiftguard.data.class_split import SPLITS
from shiftguard.functional.scaling import normalize_rows
from shiftguard.metrics import auroc_error, excess_aurc, retrieval_metrics

__all__ = [
    "COLUMNS",
    "ACROSS_KEYS",
    "recall_at_one",
    "evaluate_transfer",
    "summarize",
    "across_splits",
    "format_table",
]


def _recall_at_one_misses(embeddings, labels, metric: str = "cosine") -> torch.Tensor:
    """``(N,)`` bool: whether each sample's nearest OTHER embedding has another label (arguments and
    errors as :func:`recall_at_one`)."""
    if metric not in ("cosine", "euclidean"):
        raise ValueError(f"metric: expected 'cosine' or 'euclidean', got {metric!r}")
    emb = check_tensor(embeddings, "embeddings", ndim=2, floating=True, finite=True, nonempty=True)
    y = check_labels(labels, "labels").to(emb.device)
    if emb.shape[0] < 2:
        raise ValueError("embeddings: Recall@1 needs at least 2 samples")
    if int(torch.bincount(y).max()) < 2:  # retrieval_metrics refuses; every nearest sample is another class
        return torch.ones(y.numel(), dtype=torch.bool, device=y.device)
    if metric == "cosine":
        emb = normalize_rows(emb)
    _, nearest = retrieval_metrics(emb, y, ks=(1,), backend="torch", r_metrics=False, return_nearest=True)
    return y[nearest] != y


def recall_at_one(embeddings, labels, metric: str = "cosine") -> float:
    """Recall@1 [Kirchhof, URL Sec. 3.1]: the fraction of samples whose nearest OTHER embedding
    shares their label; a sample alone in its class counts as a miss.

    The neighbours are :func:`shiftguard.metrics.retrieval_metrics`' (exact search) of the
    L2-normalised embeddings (``metric="cosine"``: the largest cosine similarity, as URL computes its
    Recall@1; a zero row normalises to zero) or of the raw ones (``"euclidean"``), and where every
    class has two or more samples the result is its ``recall@1``. ``embeddings (N, D)`` float,
    ``N >= 2``; ``labels (N,)`` int. Raises ``ValueError`` / ``TypeError`` naming the argument.
    """
    return 1.0 - float(_recall_at_one_misses(embeddings, labels, metric).double().mean())


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
    down_miss = _recall_at_one_misses(down_emb, down_y)
    up_miss = _recall_at_one_misses(up_emb, up_y)
    n = min(up_y.numel(), down_y.numel())
    g = torch.Generator().manual_seed(mix_seed)
    iu = torch.randperm(up_y.numel(), generator=g)[:n]
    idd = torch.randperm(down_y.numel(), generator=g)[:n]
    offset = int(up_y.max()) + 1
    mix_emb = torch.cat([up_emb[iu], down_emb[idd].to(up_emb.dtype)])
    mix_y = torch.cat([up_y[iu], down_y[idd] + offset])
    mix_miss = _recall_at_one_misses(mix_emb, mix_y)
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
