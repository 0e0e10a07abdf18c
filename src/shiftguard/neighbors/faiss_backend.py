"""The ``"faiss"`` back end: ``faiss.IndexFlatL2`` on the centred support (optional dependency
``faiss-cpu``, imported lazily), CPU only. It ranks on the same centred rows as the torch back end
(:func:`shiftguard.neighbors.exact.key_centre`) and returns the same exactly recomputed, re-sorted
distances (:func:`shiftguard.neighbors.exact.exact_sq_dist`, :func:`~shiftguard.neighbors.exact.resort`).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from shiftguard.neighbors.exact import exact_sq_dist, key_centre, resort

__all__ = ["import_faiss", "faiss_available", "faiss_index", "faiss_knn"]

#: Support rows centred and added to a faiss index at a time.
_ADD_BLOCK_ROWS = 65536


def import_faiss():
    """The ``faiss`` module; ``ImportError`` naming the extra to install when it is missing."""
    try:
        import faiss  # optional dependency, imported only when asked for
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "backend='faiss' needs the optional dependency faiss-cpu (pip install 'shiftguard[faiss]')"
        ) from exc
    return faiss


def faiss_available() -> bool:
    """Whether ``faiss`` can be imported."""
    try:
        import_faiss()
    except ImportError:
        return False
    return True


def faiss_index(support: torch.Tensor):
    """``(centre (D,), faiss.IndexFlatL2 of the centred support as float32)``: what the faiss back end
    searches; callers that search one support many times build it once."""
    faiss = import_faiss()
    centre = key_centre(support)
    index = faiss.IndexFlatL2(support.shape[1])
    # Added in blocks of rows: the index holds the one float32 copy of the support, and no centred
    # copy of the whole support exists beside it (1M x 128 float32 would be another 512 MB).
    for start in range(0, support.shape[0], _ADD_BLOCK_ROWS):
        block = support[start : start + _ADD_BLOCK_ROWS] - centre
        index.add(np.ascontiguousarray(block.detach().cpu().numpy(), dtype=np.float32))
    return centre, index


def faiss_knn(
    query: torch.Tensor, support: torch.Tensor, k: int, self_index: Optional[torch.Tensor], keys=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact kNN through faiss on trusted CPU input; ``self_index`` ``(Nq,)`` (the support row to leave
    out per query) or None; ``keys``: :func:`faiss_index` of ``support`` if the caller has it."""
    centre, index = faiss_index(support) if keys is None else keys
    q = np.ascontiguousarray((query - centre).detach().cpu().numpy(), dtype=np.float32)
    extra = 1 if self_index is not None else 0
    _, idx = index.search(q, k + extra)
    idx = torch.from_numpy(idx).to(query.device)
    if self_index is not None:
        # Drop the query's own row where faiss returned it, else the farthest of the k+1.
        is_self = idx == self_index.unsqueeze(1)
        no_self = ~is_self.any(1)
        is_self[no_self, -1] = True
        keep = torch.argsort(is_self.to(torch.int8), dim=1, stable=True)[:, :k]
        idx = idx.gather(1, keep)
    d = exact_sq_dist(query, support, idx)
    return resort(d, idx)
