"""Input validation at the public boundary.

Every public function validates its tensors with these helpers so that bad input raises a
``ValueError`` / ``TypeError`` that names the offending argument and what was expected.
Inside the library, validated tensors are trusted (no re-checking on hot paths).
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch

__all__ = [
    "as_tensor",
    "check_tensor",
    "check_finite",
    "check_labels",
    "check_same_length",
    "check_positive",
    "check_probabilities",
]


def as_tensor(x, name: str, dtype: Optional[torch.dtype] = None, device=None) -> torch.Tensor:
    """Convert array-likes (numpy arrays, lists) to a tensor; raise ``TypeError`` naming ``name``."""
    if isinstance(x, torch.Tensor):
        t = x
    else:
        try:
            t = torch.as_tensor(x)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(f"{name}: expected a tensor or array-like, got {type(x).__name__}") from exc
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if device is not None:
        t = t.to(device)
    return t


def check_tensor(
    x,
    name: str,
    *,
    ndim: Optional[int | Sequence[int]] = None,
    min_ndim: Optional[int] = None,
    floating: bool = False,
    finite: bool = False,
    nonempty: bool = False,
) -> torch.Tensor:
    """Validate a tensor argument and return it (converted from array-likes if needed).

    Raises ``TypeError`` for a non-tensor or a non-floating tensor when ``floating`` is set,
    ``ValueError`` for a wrong number of dimensions, an empty tensor (``nonempty``), or
    NaN/inf values (``finite``). Messages name ``name`` and show the shape received.
    """
    t = as_tensor(x, name)
    if floating and not t.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got dtype {t.dtype}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            want = " or ".join(str(a) for a in allowed)
            raise ValueError(f"{name}: expected {want} dimensions, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(f"{name}: expected at least {min_ndim} dimensions, got shape {tuple(t.shape)}")
    if nonempty and t.numel() == 0:
        raise ValueError(f"{name}: expected a non-empty tensor, got shape {tuple(t.shape)}")
    if finite:
        check_finite(t, name)
    return t


def check_finite(t: torch.Tensor, name: str) -> torch.Tensor:
    """Raise ``ValueError`` if ``t`` holds NaN or inf (integer tensors always pass)."""
    if t.is_floating_point() or t.is_complex():
        if not bool(torch.isfinite(t).all()):
            n_nan = int(torch.isnan(t).sum())
            n_inf = int(torch.isinf(t).sum())
            raise ValueError(f"{name}: contains non-finite values ({n_nan} NaN, {n_inf} inf)")
    return t


def check_labels(
    y, name: str, num_classes: Optional[int] = None, n: Optional[int] = None, *, check_values: bool = True
) -> torch.Tensor:
    """Validate integer class labels ``(N,)`` in ``[0, num_classes)``; return them as int64.

    ``check_values=False`` skips what reads the values (the range, and whether float labels are whole
    numbers: they are truncated), so that no device-to-host synchronisation happens; the dtype and
    shape checks stay."""
    t = as_tensor(y, name)
    if t.is_floating_point() or t.dtype == torch.bool or t.is_complex():
        if t.is_floating_point() and not check_values:
            t = t.long()
        elif t.is_floating_point() and t.numel() and bool((t == t.round()).all()) and bool(torch.isfinite(t).all()):
            t = t.long()
        else:
            raise TypeError(f"{name}: expected integer class labels, got dtype {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name}: expected shape (N,), got {tuple(t.shape)}")
    if n is not None and t.shape[0] != n:
        raise ValueError(f"{name}: expected {n} labels, got {t.shape[0]}")
    t = t.long()
    if check_values and t.numel():
        lo, hi = int(t.min()), int(t.max())
        if lo < 0:
            raise ValueError(f"{name}: labels must be >= 0, got minimum {lo}")
        if num_classes is not None and hi >= num_classes:
            raise ValueError(f"{name}: labels must be < num_classes={num_classes}, got maximum {hi}")
    return t


def check_same_length(named: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Raise ``ValueError`` unless all tensors share the first dimension; return it."""
    items = list(named)
    lengths = {name: int(t.shape[0]) for name, t in items}
    if len(set(lengths.values())) > 1:
        desc = ", ".join(f"{k}={v}" for k, v in lengths.items())
        raise ValueError(f"mismatched lengths: {desc}")
    return next(iter(lengths.values())) if lengths else 0


def check_positive(value, name: str, *, strict: bool = True, integer: bool = False):
    """Raise ``ValueError`` unless ``value`` is a (strictly) positive finite number."""
    if integer:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name}: expected a finite number, got {value}")
    if (strict and value <= 0) or (not strict and value < 0):
        raise ValueError(f"{name}: expected a {'positive' if strict else 'non-negative'} value, got {value}")
    return value


def check_probabilities(
    p, name: str, *, atol: float = 1e-4, simplex: bool = True, check_values: bool = True
) -> torch.Tensor:
    """Validate an ``(N, C)`` probability matrix: finite, in [0, 1], rows summing to 1.

    ``simplex=False`` drops the row-sum check (one-vs-rest probabilities, one per class);
    ``check_values=False`` drops every check that reads the values (finiteness, range, row sums),
    keeping the dtype and shape checks.
    """
    t = check_tensor(p, name, ndim=2, floating=True, finite=check_values)
    if check_values and t.numel():
        if float(t.min()) < -atol or float(t.max()) > 1 + atol:
            raise ValueError(f"{name}: probabilities must lie in [0, 1]")
        if not simplex:
            return t
        s = t.sum(dim=1)
        if not torch.allclose(s, torch.ones_like(s), atol=max(atol, 1e-3)):
            raise ValueError(f"{name}: rows must sum to 1 (max deviation {float((s - 1).abs().max()):.3g})")
    return t
