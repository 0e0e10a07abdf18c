"""Embedding-change diagnostics between two checkpoints [Kim, Art. II, App. C.1-C.2].

Given the embeddings of the same points under an original and an updated embedding function,
``X_origin`` and ``X_new`` (``(N, D)``, each centred on its mean point):

* scale estimate (Procrustes, [Kim, Art. II, App. C.1, eq. (11)]):
  ``alpha* = <X_origin, X_new>_F / ||X_origin||_F^2``, the least-squares ``alpha`` in
  ``X_new ~ alpha X_origin``;
* norm ratio ``phi = ||X_new - alpha* X_origin||_F / ||X_new - X_origin||_F`` (in ``[0, 1]``: near 0 when the
  change is a rescaling, near 1 when scaling explains none of it);
* ``psi_{y,j} = d(f_new(x'_j), p_y) / d(f_origin(x'_j), p_y)`` for query j and class prototype ``p_y``
  [Kim, Art. II, App. C.2]; ``psi_con`` / ``psi_div`` are the geometric means of ``psi`` over the
  (query, prototype) pairs of the same / different classes; the **con-alpha** ratio ``psi_con / alpha*``,
  **div-alpha** ratio ``psi_div / alpha*`` and **con-div** ratio ``psi_con / psi_div``. Proper training
  gives con-alpha < 1, div-alpha > 1, con-div < 1.

Prototypes: the appendix writes ``p_y`` on both sides of ``psi``; here each checkpoint's distance uses that
checkpoint's own prototypes (the class means of its support embeddings). That is the reading under which
a pure rescaling ``X_new = a X_origin`` gives ``psi = a`` for every pair, so con-alpha = div-alpha = 1, as
the normalisation by ``alpha*`` intends. Distances are Euclidean (the prototypical network of Art. II).
"""

from __future__ import annotations

from typing import Optional

import torch

from shiftguard._validation import check_labels, check_tensor

__all__ = ["procrustes_scale", "norm_ratio", "embedding_change_ratios"]


def _pair(x_origin, x_new) -> tuple[torch.Tensor, torch.Tensor]:
    a = check_tensor(x_origin, "x_origin", ndim=2, floating=True, finite=True, nonempty=True).detach().double()
    b = check_tensor(x_new, "x_new", ndim=2, floating=True, finite=True, nonempty=True).detach().double()
    if a.shape != b.shape:
        raise ValueError(f"x_new: expected the shape of x_origin {tuple(a.shape)}, got {tuple(b.shape)}")
    return a, b.to(a.device)


def procrustes_scale(x_origin, x_new) -> float:
    """``alpha* = Tr(X_origin^T X_new) / ||X_origin||_F^2`` of the centred matrices
    [Kim, Art. II, App. C.1, eq. (11)].

    Raises ``ValueError`` naming ``x_origin`` when its centred matrix is zero (``alpha*`` undefined).
    """
    a, b = _pair(x_origin, x_new)
    return _scale(a - a.mean(0), b - b.mean(0))


def _scale(a: torch.Tensor, b: torch.Tensor) -> float:
    den = float((a * a).sum())
    if den == 0.0:
        raise ValueError("x_origin: all points coincide after centring; the scale alpha* is undefined")
    return float((a * b).sum()) / den


def norm_ratio(x_origin, x_new) -> float:
    """``phi = ||X_new - alpha* X_origin||_F / ||X_new - X_origin||_F`` [Kim, Art. II, App. C.1].

    Args: ``x_origin``, ``x_new`` -- ``(N, D)`` float embeddings of the same points (centred here).
    Raises ``ValueError`` naming ``x_new`` when the centred matrices are equal (``phi`` is 0/0).
    """
    a, b = _pair(x_origin, x_new)
    a, b = a - a.mean(0), b - b.mean(0)
    alpha = _scale(a, b)
    den = float((b - a).norm())
    if den == 0.0:
        raise ValueError("x_new: equals x_origin after centring; the norm ratio is 0/0")
    return float((b - alpha * a).norm()) / den


def _prototypes(x: torch.Tensor, y: torch.Tensor, n_cls: int) -> torch.Tensor:
    sums = torch.zeros(n_cls, x.shape[1], dtype=x.dtype, device=x.device).index_add_(0, y, x)
    return sums / torch.bincount(y, minlength=n_cls).clamp_min(1).unsqueeze(1).to(x.dtype)


def embedding_change_ratios(x_origin, x_new, labels, support: Optional[torch.Tensor] = None) -> dict[str, float]:
    """Norm ratio, alpha*, psi_con, psi_div and the con-alpha / div-alpha / con-div ratios
    [Kim, Art. II, App. C.1-C.2].

    Args:
        x_origin, x_new: ``(N, D)`` float embeddings of the same N points under the two checkpoints.
        labels: ``(N,)`` int class labels.
        support: optional ``(N,)`` bool mask of the support points (prototypes are their class means);
            the others are the queries. Default: prototypes and queries are all points. ``phi`` and
            ``alpha*`` always use all N points (the appendix's "episode points").

    Returns ``{"norm_ratio", "alpha", "psi_con", "psi_div", "con_alpha", "div_alpha", "con_div"}``.

    Raises ``ValueError`` naming ``labels`` (a query's class has no support point, or fewer than two
    classes), ``support`` (wrong shape, no query) or ``x_origin`` (a query sits on a prototype under the
    original embedding, so ``psi`` divides by zero).
    """
    a, b = _pair(x_origin, x_new)
    y = check_labels(labels, "labels", n=a.shape[0]).to(a.device)
    if support is None:
        sup = torch.ones_like(y, dtype=torch.bool)
        qry = sup
    else:
        sup = torch.as_tensor(support, device=a.device)
        if sup.dtype != torch.bool or sup.shape != y.shape:
            raise ValueError(
                f"support: expected a bool mask of shape {tuple(y.shape)}, got {sup.dtype} {tuple(sup.shape)}"
            )
        qry = ~sup
        if not bool(qry.any()):
            raise ValueError("support: every point is a support point; there is no query")
    n_cls = int(y.max()) + 1
    have = torch.bincount(y[sup], minlength=n_cls) > 0
    if int(have.sum()) < 2:
        raise ValueError("labels: the support points hold fewer than two classes; psi_div is undefined")
    missing = sorted(set(y[qry].tolist()) - set(have.nonzero().flatten().tolist()))
    if missing:
        raise ValueError(f"labels: query classes {missing[:10]} have no support point")
    ac, bc = a - a.mean(0), b - b.mean(0)
    alpha = _scale(ac, bc)
    den = float((bc - ac).norm())
    if den == 0.0:
        raise ValueError("x_new: equals x_origin after centring; the norm ratio is 0/0")
    phi = float((bc - alpha * ac).norm()) / den
    if alpha == 0.0:
        raise ValueError("x_new: orthogonal to x_origin after centring (alpha* = 0); the alpha ratios are undefined")
    cls = have.nonzero().flatten()
    d_old = torch.cdist(a[qry], _prototypes(a[sup], y[sup], n_cls)[cls])
    d_new = torch.cdist(b[qry], _prototypes(b[sup], y[sup], n_cls)[cls])
    if bool((d_old == 0).any()):
        raise ValueError("x_origin: a query coincides with a prototype; psi = d_new / d_origin divides by zero")
    log_psi = torch.log(d_new) - torch.log(d_old)  # -inf where d_new = 0: psi = 0 is a valid value
    same = y[qry].unsqueeze(1) == cls.unsqueeze(0)
    psi_con = float(torch.exp(log_psi[same].mean()))
    psi_div = float(torch.exp(log_psi[~same].mean()))
    return {
        "norm_ratio": phi,
        "alpha": alpha,
        "psi_con": psi_con,
        "psi_div": psi_div,
        "con_alpha": psi_con / alpha,
        "div_alpha": psi_div / alpha,
        "con_div": psi_con / psi_div if psi_div > 0 else float("inf"),
    }
