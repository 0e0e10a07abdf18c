"""Reliability diagrams ([NED, Sec. 3.1, Fig. 1]; Guo et al. 2017 Fig. 1): per-bin accuracy against
mean confidence of the top-label prediction, with the gap to the diagonal and a count histogram.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from shiftguard.metrics.calibration import binned_statistics, calibration_error_1d
from shiftguard.metrics.classification import check_probs_labels

__all__ = ["ReliabilityData", "reliability_diagram"]


@dataclass
class ReliabilityData:
    """What a reliability diagram shows; every tensor is float64 on the CPU.

    ``bin_edges`` ``(B+1,)``; ``confidence``, ``accuracy`` ``(B,)`` (NaN in empty bins);
    ``counts`` ``(B,)``; ``ece`` the top-label ECE with the same bins.
    """

    bin_edges: torch.Tensor
    confidence: torch.Tensor
    accuracy: torch.Tensor
    counts: torch.Tensor
    ece: float

    def as_dict(self) -> dict:
        return {
            "bin_edges": self.bin_edges.tolist(),
            "confidence": self.confidence.tolist(),
            "accuracy": self.accuracy.tolist(),
            "counts": self.counts.tolist(),
            "ece": self.ece,
        }


def _draw(data: ReliabilityData, title: Optional[str]):
    # The object API with an explicit Agg canvas: headless, and pyplot's global state is untouched.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.5, 5.5))
    FigureCanvasAgg(fig)
    ax, hx = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    left = data.bin_edges[:-1].numpy()
    width = (data.bin_edges[1:] - data.bin_edges[:-1]).numpy()
    acc = torch.nan_to_num(data.accuracy).numpy()
    conf = torch.nan_to_num(data.confidence).numpy()
    filled = data.counts.numpy() > 0
    ax.bar(
        left[filled],
        acc[filled],
        width=width[filled],
        align="edge",
        color="tab:blue",
        edgecolor="black",
        label="accuracy",
    )
    gap_lo = acc.clip(max=conf)
    ax.bar(
        left[filled],
        (abs(conf - acc))[filled],
        bottom=gap_lo[filled],
        width=width[filled],
        align="edge",
        color="tab:red",
        alpha=0.35,
        edgecolor="tab:red",
        hatch="//",
        label="gap to confidence",
    )
    ax.plot([0, 1], [0, 1], "k--", lw=1, label="perfect calibration")
    ax.set_ylim(0, 1)
    ax.set_ylabel("accuracy")
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title((title + "\n" if title else "") + f"top-label ECE = {100 * data.ece:.2f}%", fontsize=10)
    hx.bar(left, data.counts.numpy(), width=width, align="edge", color="tab:gray", edgecolor="black")
    hx.set_xlim(0, 1)
    hx.set_xlabel("confidence (max probability)")
    hx.set_ylabel("count")
    fig.tight_layout()
    return fig


def reliability_diagram(
    probs, labels, n_bins: int = 15, binning: str = "width", path=None, title: Optional[str] = None
) -> ReliabilityData:
    """Bin the top-label confidence and return the diagram's data; draw it to ``path`` (PNG) if given.

    Args:
        probs: ``(N, C)`` class probabilities.
        labels: ``(N,)`` true classes.
        n_bins: number of bins (default 15).
        binning: ``"width"`` or ``"mass"`` (as in :func:`shiftguard.metrics.ece`).
        path: where to save the PNG (written atomically); nothing is drawn when None.
        title: optional figure title.
    """
    prob, y = check_probs_labels(probs, labels)
    conf, pred = prob.max(dim=1)
    hits = pred == y
    count, mean_conf, mean_acc, upper = binned_statistics(conf, hits, n_bins, binning)
    lower = torch.zeros(1, dtype=torch.float64, device=upper.device)
    edges = torch.cat([lower, upper]).cpu()
    empty = (count == 0).cpu()
    data = ReliabilityData(
        bin_edges=edges,
        confidence=mean_conf.cpu().masked_fill(empty, float("nan")),
        accuracy=mean_acc.cpu().masked_fill(empty, float("nan")),
        counts=count.cpu(),
        ece=calibration_error_1d(conf, hits, n_bins, binning),
    )
    if path is not None:
        from shiftguard.io import atomic_write_bytes

        fig = _draw(data, title)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=120)
        atomic_write_bytes(Path(path), buf.getvalue())
    return data
