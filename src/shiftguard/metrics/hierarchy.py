"""Hierarchy-informed metrics of [Kim, Art. IV, "Performance measures"] for a :class:`ClassHierarchy`.

For N samples with labels ``c_n``, class scores ``(N, C)`` (probabilities, logits or negative
distances: only their order matters) and ``top_j(n)`` the class with the j-th highest score of sample n
(ties: the lower class index first), with ``d_H`` the shortest-path class distance [Kim, Art. IV,
"Problem settings"] unless a distance matrix is given:

* **AHD@k** -- average hierarchical distance of the top-k predictions (Bertinetto et al. 2020), over
  *all* samples, correct ones included [Kim, Art. IV]:
  ``AHD@k = (1 / (N k)) sum_n sum_{j <= k} d_H(c_n, top_j(n))``. At k = 1 it is the average hierarchical
  cost of Garnot & Landrieu 2021.
* **HP@k** -- hierarchical precision at k (Frome et al. 2013): with ``N(c, eps) = {y : d_H(c, y) <= eps}``
  and ``hCorrectSet(c, k)`` the ``N(c, eps)`` of the smallest ``eps`` with at least k members,
  ``HP@k = (1 / N) sum_n |{j <= k : top_j(n) in hCorrectSet(c_n, k)}| / k``.
* **HS@k** -- hierarchical similarity at k [Kim, Art. IV, eq. (15)] (the "hierarchical precision" of
  Barz & Denzler 2019), a retrieval measure: the references ``(x_i, c_i)`` ranked by distance to the
  query in the normalised embedding space, ``HS@k = sum_{i <= k} s_H(c, c_i) / max_pi sum_{i <= k}
  s_H(c, c_pi(i))`` -- the denominator is the sum of the k largest similarities among all references --
  with ``s_H = 1 - d_T^2 / 2`` and ``d_T = sqrt(2) d_H / (beta + d_H)``, ``beta = 1`` [Kim, Art. IV,
  eq. (14)], averaged over queries.
* **AHS@K** -- average hierarchical similarity: the area under HS@k for k = 1..K [Kim, Art. IV], computed
  as Barz & Denzler 2019's code does (trapezoid rule divided by K):
  ``AHS@K = (1 / K) (sum_{k <= K} HS@k - (HS@1 + HS@K) / 2)`` per query, so a perfect ranking scores
  ``1 - 1/K``.
* **Mean correlation** [Kim, Art. IV, "Mean correlations"]: for each class (row), Spearman's rank
  correlation between the row of the learned distance matrix ``D_L`` (between class representatives,
  proxies or prototypes) and the row of ``D_H``; the rows' coefficients are averaged through the Fisher
  transformation, ``tanh(mean(arctanh(rho_c)))``. The article does not say whether a row keeps its
  diagonal zero; by default it is left out (``include_diagonal=False``), since a zero on both sides adds
  agreement that says nothing about the learned geometry. Ties get average ranks.

Scores, labels and embeddings are validated at the boundary (``ValueError`` / ``TypeError`` naming the
argument); nothing is dropped: a row whose Spearman coefficient is undefined (a constant row) raises.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from shiftguard._validation import check_labels, check_positive, check_tensor
from shiftguard.data.hierarchy import ClassHierarchy, transformed_distance

__all__ = [
    "average_hierarchical_distance",
    "hierarchical_precision_at_k",
    "hierarchical_similarity_at_k",
    "mean_rank_correlation",
    "class_prototypes",
    "representative_correlation",
    "hierarchy_metrics",
]

HierarchyLike = Union[ClassHierarchy, torch.Tensor]


def _distances(hierarchy: HierarchyLike, num_classes: Optional[int]) -> torch.Tensor:
    """The class distance matrix ``(C, C)`` float64: ``d_H`` of a hierarchy, or a given matrix."""
    if isinstance(hierarchy, ClassHierarchy):
        d = hierarchy.distance_matrix("path")
    else:
        d = check_tensor(hierarchy, "hierarchy", ndim=2, finite=True).double()
        if d.shape[0] != d.shape[1]:
            raise ValueError(f"hierarchy: a distance matrix must be square, got shape {tuple(d.shape)}")
        if d.numel() and float(d.min()) < 0:
            raise ValueError("hierarchy: distances must be non-negative")
    if num_classes is not None and d.shape[0] != num_classes:
        raise ValueError(f"hierarchy: has {d.shape[0]} classes, the scores have {num_classes}")
    return d


def _check_scores(scores, labels, k: int):
    s = check_tensor(scores, "scores", ndim=2, floating=True, finite=True, nonempty=True)
    y = check_labels(labels, "labels", num_classes=s.shape[1], n=s.shape[0])
    check_positive(k, "k", integer=True)
    if k > s.shape[1]:
        raise ValueError(f"k: must be <= the number of classes {s.shape[1]}, got {k}")
    return s, y.to(s.device)


def _top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices ``(N, k)`` of the k highest scores, ties resolved towards the lower class index."""
    return torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]


def average_hierarchical_distance(scores, labels, hierarchy: HierarchyLike, k: int = 1) -> float:
    """AHD@k [Kim, Art. IV, "Performance measures"]: mean ``d_H`` between the label and each of the
    top-k classes, over all samples.

    Args:
        scores: ``(N, C)`` float, higher = more likely.
        labels: ``(N,)`` int in ``[0, C)``.
        hierarchy: a :class:`ClassHierarchy` (``d_H`` = shortest-path distance) or a ``(C, C)`` distance
            matrix.
        k: number of top predictions, ``1 <= k <= C``.
    """
    s, y = _check_scores(scores, labels, k)
    d = _distances(hierarchy, s.shape[1]).to(s.device)
    top = _top_k(s, k)
    return float(d[y.unsqueeze(1), top].mean())


def hierarchical_precision_at_k(scores, labels, hierarchy: HierarchyLike, k: int = 5) -> float:
    """HP@k [Kim, Art. IV, "Performance measures"] (Frome et al. 2013): the fraction of the top-k
    classes inside ``hCorrectSet(c, k)``, the smallest ``d_H``-ball around the label with >= k classes.

    Arguments as in :func:`average_hierarchical_distance`.
    """
    s, y = _check_scores(scores, labels, k)
    d = _distances(hierarchy, s.shape[1]).to(s.device)
    # The smallest eps with |N(c, eps)| >= k is the k-th smallest distance in row c.
    eps = torch.sort(d, dim=1).values[:, k - 1]
    correct = d <= eps.unsqueeze(1)  # (C, C): hCorrectSet(c, k) as a mask per row
    top = _top_k(s, k)
    return float(correct[y.unsqueeze(1), top].double().mean())


def hierarchical_similarity_at_k(
    embeddings,
    labels,
    hierarchy: HierarchyLike,
    ks: Sequence[int] = (50, 250),
    *,
    reference=None,
    reference_labels=None,
    ahs_k: Optional[int] = 250,
    beta: float = 1.0,
    normalize: bool = True,
    chunk_size: int = 1024,
) -> dict[str, float]:
    """HS@k [Kim, Art. IV, eq. (15)] for every k in ``ks`` and AHS@K for ``K = ahs_k``.

    Args:
        embeddings: query embeddings ``(N, D)`` float.
        labels: ``(N,)`` int class labels.
        hierarchy: a :class:`ClassHierarchy` or a ``(C, C)`` class distance matrix ``d_H``; the
            similarity is ``s_H = 1 - d_T^2 / 2`` with ``d_T = sqrt(2) d_H / (beta + d_H)`` [eq. (14)].
        ks: cut-offs (the article reports 50 and 250).
        reference, reference_labels: the ranked collection ``(M, D)``, ``(M,)``; default: the queries
            themselves, each query left out of its own ranking.
        ahs_k: ``K`` of AHS@K (``None`` skips it).
        normalize: rank by Euclidean distance between L2-normalised embeddings (the article's
            "normalized embedding space"); ``False`` ranks the raw embeddings.
        chunk_size: queries per block (memory ``O(chunk_size * M)``).

    Returns ``{"hs@<k>": value, ..., "ahs@<K>": value}``; ties in distance are broken by ``torch.topk``.
    Raises ``ValueError`` naming the argument when a cut-off exceeds the number of references.
    """
    q = check_tensor(embeddings, "embeddings", ndim=2, floating=True, finite=True, nonempty=True)
    y = check_labels(labels, "labels", n=q.shape[0]).to(q.device)
    if (reference is None) != (reference_labels is None):
        raise ValueError("reference, reference_labels: give both or neither")
    self_ref = reference is None
    if self_ref:
        r, ry = q, y
    else:
        r = check_tensor(reference, "reference", ndim=2, floating=True, finite=True, nonempty=True).to(q.dtype)
        ry = check_labels(reference_labels, "reference_labels", n=r.shape[0]).to(q.device)
        if r.shape[1] != q.shape[1]:
            raise ValueError(f"reference: expected {q.shape[1]} features, got {r.shape[1]}")
    check_positive(chunk_size, "chunk_size", integer=True)
    cuts = [int(check_positive(k, "ks", integer=True)) for k in ks]
    if ahs_k is not None:
        check_positive(ahs_k, "ahs_k", integer=True)
    kmax = max(cuts + ([ahs_k] if ahs_k is not None else []))
    m = r.shape[0] - (1 if self_ref else 0)
    if kmax > m:
        raise ValueError(f"ks: cut-offs up to {kmax} need at least that many references, got {m}")
    d = _distances(hierarchy, None)
    top_label = max(int(y.max()), int(ry.max()))
    if top_label >= d.shape[0]:
        raise ValueError(f"labels: class {top_label} is outside the hierarchy's {d.shape[0]} classes")
    sim = (1.0 - transformed_distance(d, beta).pow(2) / 2.0).to(q.device)  # (C, C) float64
    if normalize:
        q = torch.nn.functional.normalize(q, dim=1)
        r = torch.nn.functional.normalize(r, dim=1)
    # Ideal cumulative similarity per query class: the kmax largest s_H over all references.
    counts = torch.bincount(ry, minlength=sim.shape[0])
    best = torch.empty(sim.shape[0], kmax, dtype=torch.float64, device=q.device)
    for c in range(sim.shape[0]):
        cnt = counts.clone()
        if self_ref:
            cnt[c] -= 1  # the query is not among its own references
        vals = torch.repeat_interleave(sim[c], cnt.clamp_min(0))  # m >= kmax values
        best[c] = torch.sort(vals, descending=True).values[:kmax].cumsum(0)
    hs_sums = {k: 0.0 for k in cuts}
    ahs_sum = 0.0
    for start in range(0, q.shape[0], chunk_size):
        qb, yb = q[start : start + chunk_size], y[start : start + chunk_size]
        dist = torch.cdist(qb.double(), r.double())
        if self_ref:
            rows = torch.arange(qb.shape[0], device=q.device)
            dist[rows, rows + start] = float("inf")
        order = torch.topk(dist, kmax, dim=1, largest=False, sorted=True).indices
        got = sim[yb.unsqueeze(1), ry[order]].cumsum(1)  # (B, kmax)
        ratio = got / best[yb]  # HS@k for k = 1..kmax, per query
        for k in cuts:
            hs_sums[k] += float(ratio[:, k - 1].sum())
        if ahs_k is not None:
            per = (ratio[:, :ahs_k].sum(1) - (ratio[:, 0] + ratio[:, ahs_k - 1]) / 2.0) / ahs_k
            ahs_sum += float(per.sum())
    n = q.shape[0]
    out = {f"hs@{k}": hs_sums[k] / n for k in cuts}
    if ahs_k is not None:
        out[f"ahs@{ahs_k}"] = ahs_sum / n
    return out


def _average_ranks(x: torch.Tensor) -> torch.Tensor:
    from scipy.stats import rankdata

    return torch.as_tensor(rankdata(x.detach().cpu().numpy(), axis=1), dtype=torch.float64)


def mean_rank_correlation(
    learned, reference, include_diagonal: bool = False, skip_constant_reference: bool = False
) -> float:
    """Mean correlation (MC) of two distance matrices [Kim, Art. IV, "Mean correlations"; Ch. 5.1].

    Spearman's rank correlation between the c-th rows of ``learned`` and ``reference`` (both ``(C, C)``),
    averaged through the Fisher transformation: ``tanh(mean_c(arctanh(rho_c)))``. Rows keep or lose
    their diagonal entry with ``include_diagonal``. Returns a float in ``[-1, 1]``.

    A class whose ``reference`` row is constant (off the diagonal: a class hanging alone from the root's
    child, at one distance from every other class) has no rank correlation. By default that raises;
    ``skip_constant_reference=True`` leaves such rows out of the mean (say so where the number is
    reported: the mean then covers fewer classes). A row at exactly +1 (or -1) has an infinite Fisher
    transform and sets the mean to +1 (or -1), as the definition implies.

    Raises ``ValueError`` naming ``learned`` / ``reference`` for a shape mismatch, fewer than 3 classes, or
    a row that is constant (its coefficient is undefined), and when some rows correlate at exactly +1
    and others at exactly -1 (the Fisher mean is then undefined).
    """
    a = check_tensor(learned, "learned", ndim=2, finite=True).double()
    b = check_tensor(reference, "reference", ndim=2, finite=True).double()
    if a.shape != b.shape or a.shape[0] != a.shape[1]:
        raise ValueError(
            f"learned, reference: expected two square matrices of one shape, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    c = a.shape[0]
    if c < 3:
        raise ValueError(f"learned: need at least 3 classes for a rank correlation per row, got {c}")
    if not include_diagonal:
        keep = ~torch.eye(c, dtype=torch.bool)
        a = a[keep].view(c, c - 1)
        b = b[keep].view(c, c - 1)
    ra, rb = _average_ranks(a), _average_ranks(b)
    ra = ra - ra.mean(1, keepdim=True)
    rb = rb - rb.mean(1, keepdim=True)
    na, nb = ra.norm(dim=1), rb.norm(dim=1)
    if skip_constant_reference:
        use = nb > 0
        if not bool(use.any()):
            raise ValueError("reference: every row is constant; no rank correlation is defined")
        ra, rb, na, nb = ra[use], rb[use], na[use], nb[use]
    for name, nrm in (("learned", na), ("reference", nb)):
        flat = (nrm == 0).nonzero().flatten().tolist()
        if flat:
            raise ValueError(f"{name}: rows {flat[:10]} are constant; their rank correlation is undefined")
    # rho = <u, v> for the unit centred rank vectors, written as 1 - |u - v|^2 / 2 so that equal ranks give
    # exactly 1 (and reversed ranks exactly -1): arctanh is infinite there and must not see 1 - 1e-16.
    u, v = ra / na.unsqueeze(1), rb / nb.unsqueeze(1)
    rho = torch.where(
        (u - v).abs().sum(1) <= (u + v).abs().sum(1),
        1.0 - (u - v).pow(2).sum(1) / 2.0,
        (u + v).pow(2).sum(1) / 2.0 - 1.0,
    ).clamp(-1.0, 1.0)
    z = torch.atanh(rho)
    if bool(torch.isposinf(z).any()) and bool(torch.isneginf(z).any()):
        raise ValueError("learned: some rows correlate at +1 and others at -1; the Fisher mean is undefined")
    return float(torch.tanh(z.mean()))


def class_prototypes(embeddings, labels, num_classes: int, normalize: bool = True) -> torch.Tensor:
    """Prototype representatives ``(C, D)`` [Kim, Art. IV, "Proxies and prototypes"]:
    ``mu_y = mean_{x in X_y} f~(x)`` of the normalised embeddings and ``mu~_y = mu_y / ||mu_y||``
    (``normalize=False``: plain class means). Raises ``ValueError`` naming ``labels`` if a class has no
    sample.
    """
    e = check_tensor(embeddings, "embeddings", ndim=2, floating=True, finite=True, nonempty=True)
    y = check_labels(labels, "labels", num_classes=num_classes, n=e.shape[0]).to(e.device)
    if normalize:
        e = torch.nn.functional.normalize(e, dim=1)
    counts = torch.bincount(y, minlength=num_classes)
    empty = (counts == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"labels: classes {empty[:10]} have no sample, so no prototype")
    sums = torch.zeros(num_classes, e.shape[1], dtype=e.dtype, device=e.device).index_add_(0, y, e)
    mu = sums / counts.unsqueeze(1).to(e.dtype)
    return torch.nn.functional.normalize(mu, dim=1) if normalize else mu


def representative_correlation(
    representatives,
    hierarchy: HierarchyLike,
    normalize: bool = True,
    include_diagonal: bool = False,
    skip_constant_reference: bool = False,
    decimals: Optional[int] = None,
) -> float:
    """Mean correlation between the class representatives' distances and ``d_H`` [Kim, Art. IV].

    ``representatives``: ``(C, D)`` proxies or prototypes (row c represents class c); ``D_L`` is their
    Euclidean distance matrix, after L2 normalisation with ``normalize`` (the article's hypersphere).

    ``decimals``: round ``D_L`` to this many decimals before ranking, so that distances equal up to
    floating-point rounding tie (fixed hierarchy proxies have exactly tied distances in exact arithmetic;
    without rounding, their rounding noise breaks the ties at random and lowers the coefficient).
    """
    w = check_tensor(representatives, "representatives", ndim=2, floating=True, finite=True, nonempty=True)
    w = w.detach().double()
    if normalize:
        w = torch.nn.functional.normalize(w, dim=1)
    d_h = _distances(hierarchy, w.shape[0])
    d_l = torch.cdist(w, w)
    if decimals is not None:
        d_l = torch.round(d_l, decimals=int(decimals))
    return mean_rank_correlation(
        d_l, d_h, include_diagonal=include_diagonal, skip_constant_reference=skip_constant_reference
    )


def hierarchy_metrics(
    scores, labels, hierarchy: HierarchyLike, ks: Sequence[int] = (1, 5), hp_ks: Sequence[int] = (5,)
) -> dict[str, float]:
    """Top-k accuracy and AHD@k for every k in ``ks``, and HP@k for every k in ``hp_ks``, from class
    scores ``(N, C)``.

    Returns ``{"top<k>": ..., "ahd@<k>": ..., "hp@<k>": ...}`` [Kim, Art. IV, "Performance measures"].
    """
    s, y = _check_scores(scores, labels, max(list(ks) + list(hp_ks)))
    out: dict[str, float] = {}
    for k in ks:
        top = _top_k(s, k)
        out[f"top{k}"] = float((top == y.unsqueeze(1)).any(1).double().mean())
        out[f"ahd@{k}"] = average_hierarchical_distance(s, y, hierarchy, k)
    for k in hp_ks:
        out[f"hp@{k}"] = hierarchical_precision_at_k(s, y, hierarchy, k)
    return out
