"""Exact kNN that skips whole (query block, support cluster) products by provable lower bounds.

``knn_search(..., backend="pruned")`` and ``NED(backend="pruned")`` use this module. The ranking
key (on rows centred at the support's mean ``m``, ``exact.key_centre``), its ``addmm``, the exact
recomputation and the re-sort of the k winners are those of the brute-force ``"torch"`` back end;
only products that provably cannot enter a query's top k are not computed.

Index (``PrunedKNNIndex(support)``, built once per support and reusable):

- ``o`` = mean of the support, ``P`` = the top ``proj_dim`` (16) principal directions of a
  subsample (orthonormal rows, float64), ``z = P(x - o)``, ``t = ||P_perp(x - o)||``
  ``= sqrt(||x - o||^2 - ||z||^2)``;
- k-means on ``z`` (a few Lloyd iterations on a subsample; ``clamp(round(sqrt(Ns)/12), 1, 64)`` clusters);
  the support is stored reordered by cluster, so every cluster is a contiguous block of rows
  (clusters are numbered so that near ones are adjacent, which merges blocks into longer runs);
- per cluster ``C``: centroid ``c_C`` and radius ``r_C = max ||z - c_C||`` in the projected space,
  the interval ``[t_lo, t_hi]`` of ``t``, the largest ``||x - m||`` (key row) and ``||x - o||`` (rounding slack),
  and for every other cluster ``H`` the unit direction ``w_HC = (c_H - c_C)/||c_H - c_C||`` with
  ``top_HC = max_{x in C} <w_HC, z_x>``.

Bound. ``P`` is orthonormal, so ``||q - x||^2 = ||P(q - x)||^2 + ||P_perp(q - x)||^2`` and, for a
query ``q`` whose nearest centroid ("home") is ``H`` and every ``x`` in ``C``,

    ||P(q - x)|| >= max(||z_q - c_C|| - r_C,  <w_HC, z_q> - top_HC,  0)     (ball; separating plane)
    ||P_perp(q - x)|| >= dist(t_q, [t_lo, t_hi])                             (reverse triangle ineq.)
    LB(q, C) = (first)^2 + (second)^2 <= ||q - x||^2.

The ball bound alone is weak in 16 dimensions (the radius eats most of the centre distance); the
plane bound measures the spread of ``C`` along one direction only and is what prunes on class
clusters (measured on the benchmark data with the default 20 clusters and the true k-th distances:
a query keeps 12.6% of the rows with both bounds, 38% with the ball bound alone).

Pruning rule. With the ranking key ``K(q, x) = ||x||^2 - 2 q.x = ||q - x||^2 - ||q||^2``, the rows of
``C`` are skipped for ``q`` when ``LB(q, C) - ||q||^2 - slack(q, C) > K_k(q)``, the k-th smallest key
computed so far for ``q``. Every float key is within ``e(q, x) = gamma_{D+2} (||q|| + ||x||)^2`` of
the exact one whatever the summation order of the matmul (Higham, Accuracy and Stability of
Numerical Algorithms, eq. 3.5; ``gamma_n = n u / (1 - n u)``), so with
``slack >= e(q, x in C) + 2 max_y e(q, y)`` a skipped row's brute-force key is strictly above the
brute-force keys of k computed rows: brute force would not select it either, however its own
matmul rounds. Here ``q`` and ``x`` are the key rows ``q - m``, ``x - m`` as the ``addmm`` sees them
(rounded once by the subtraction, which moves ``||q - x||^2`` by at most ``~2 u (||q|| + ||x||)^2``,
inside the factor 2 below). We use ``2 (D + 2) u [(||q|| + max_C ||x||)^2 + 2 (||q|| + max ||x||)^2]``, plus
``1e-5 (||q - o|| + max_C ||x - o||)^2`` for the float64 evaluation of ``LB`` (dominated by the
cancellation in ``t``: below ``~sqrt(D u64)`` relative in ``t``, i.e. ``~1e-6`` of that square).
``u = 2^-24`` for float32 (``2^-8`` where reduced-precision float32 matmuls may be on: TF32 on CUDA
or ``torch.set_float32_matmul_precision`` other than ``"highest"``), ``2^-53`` for float64; for
other dtypes nothing is pruned. Among the computed rows the selection is by the same key formula
and ``addmm``; the results equal the torch back end's except where two keys at the k-th place lie
within that rounding error of each other (or tie exactly), where the torch back end's own result
also depends on its chunk size.

Search, per query block (queries with the same home, at most ``block_rows``):

- phase A: clusters in increasing order of their smallest ``LB`` over the block, the nearest first
  until every query has ``k`` candidates besides its own row; then, in groups of at most
  ``group_cols`` rows (and within ``memory_budget_bytes``), the clusters that at least
  ``core_fraction`` of the block still needs under the tightened k-th keys: block x cluster
  ``addmm`` + selection of the k smallest merged into the running top k;
- phase B (all blocks done): the (query, cluster) pairs some query still needs, one ``addmm`` per
  cluster over just those queries, each re-checked against the query's current k-th key. This
  keeps a block from paying for clusters that only a few of its queries need.

Only CPU tensors are pruned; on other devices the search is the brute-force torch one.

When it helps: supports whose cluster structure a few directions reveal (class clusters of
embeddings; on 10 Gaussian classes in 128 dimensions a query needs about its own class, 12.7% of
the products). It does not help on 100 Gaussian classes in 128 dimensions: their centres span
99 directions, more than the projection keeps (nothing is pruned; the fallback below takes over). It
cannot help when no low-dimensional view separates the data (e.g. an isotropic Gaussian): every LB is
then below the k-th distance. The search watches for this: once ``fallback_min_queries`` queries are
done and more than ``fallback_fraction`` of their brute-force products were computed, the remaining
queries go to the brute-force ``"torch"`` search, so the loss is the index build plus those first
queries (measured in ``benchmarks/bench_knn.py``).

``self_index`` (leave-one-out; ``exclude`` of ``knn_search``): as in the torch back end the query's
own support row is excluded by index (its key set to +inf), so a duplicate of the query elsewhere in
the support is still found.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from shiftguard.neighbors.exact import DEFAULT_MEMORY_BUDGET_BYTES, exact_sq_dist, key_rows, resort, torch_knn
from shiftguard.neighbors.select import scan_applies, smallest_k

__all__ = ["PrunedKNNIndex"]


def _topk_smallest(key: torch.Tensor, k: int, group: int = 64):
    """``torch.topk(key, k, dim=1, largest=False)`` (unsorted) for wide rows, with fewer comparisons.

    The row's columns are cut into groups of ``group``; the k smallest entries lie in the k groups
    with the smallest minima (a group outside them has k group minima below its own minimum, i.e.
    k entries smaller than any of its entries; exact ties aside), so only those k groups (and the
    < ``group`` tail columns) go through ``topk``. Where the compiled scan applies
    (:func:`~shiftguard.neighbors.select.smallest_k`) it is used instead: one pass over the row.
    Returns ``(values, column indices)`` of the ``min(k, columns)`` smallest.
    """
    b, n = key.shape
    if n and scan_applies(key, min(k, n)):
        return smallest_k(key, min(k, n))
    n_groups = n // group
    if n_groups <= 2 * k:
        return torch.topk(key, min(k, n), dim=1, largest=False, sorted=False)
    full = n_groups * group
    mins = key[:, :full].view(b, n_groups, group).amin(2)
    _, g = torch.topk(mins, k, dim=1, largest=False, sorted=False)
    cols = (g.unsqueeze(2) * group + torch.arange(group, device=key.device)).view(b, k * group)
    if full < n:
        cols = torch.cat([cols, torch.arange(full, n, device=key.device).expand(b, n - full)], dim=1)
    val, j = torch.topk(key.gather(1, cols), k, dim=1, largest=False, sorted=False)
    return val, cols.gather(1, j)


def _unit_roundoff(dtype: torch.dtype, device: torch.device) -> Optional[float]:
    """Unit roundoff of the ``addmm`` that computes the keys; None when pruning should be off."""
    if dtype == torch.float64:
        return 2.0**-53
    if dtype == torch.float32:
        reduced = torch.get_float32_matmul_precision() != "highest"
        if device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
            reduced = True
        return 2.0**-8 if reduced else 2.0**-24
    return None


class PrunedKNNIndex:
    """Clustered, reordered copy of a support set for exact pruned kNN (see the module docstring).

    Args:
        support: ``(Ns, D)`` float tensor (float32 or float64 on CPU for pruning; other dtypes
            and devices search by brute force).
        n_clusters: number of k-means clusters; default ``clamp(round(sqrt(Ns) / 12), 1, 64)``.
        proj_dim: dimension of the projection ``P`` (default 16, at most ``D``).
        kmeans_iters: Lloyd iterations (the clustering only affects speed, never the result).
        seed: seed of the subsamples and the k-means initialisation.

    ``last_stats`` (dict, after each ``search``): ``products`` (query-row x support-row keys
    computed), ``brute_products`` (what brute force computes, ``Nq x Ns``), ``cluster_visits``
    (block x cluster products computed), ``block_cluster_pairs`` (all block x cluster pairs of the
    pruned part), ``fallback_queries`` (queries searched by brute force after the fallback rule).
    """

    def __init__(
        self,
        support: torch.Tensor,
        n_clusters: Optional[int] = None,
        proj_dim: int = 16,
        kmeans_iters: int = 8,
        seed: int = 0,
    ):
        self.support = support
        self._support_version = support._version
        n, dim = support.shape
        self.n_support, self.dim = n, dim
        # The torch back end's key rows support - centre and their ||.||^2 (computed on the original
        # order, then permuted).
        self.centre, centred, s_sq = key_rows(support)
        gen = torch.Generator().manual_seed(seed)
        self.origin = self._chunked_mean(support)  # o, float64 (D,)

        # P: top principal directions of a subsample (float64 eigh; rows orthonormal).
        sample = self._sample(n, 8192, gen)
        xs = support[sample].double().cpu() - self.origin
        m = max(1, min(proj_dim, dim))
        _, vecs = torch.linalg.eigh(xs.t() @ xs)
        self.proj = vecs[:, -m:].flip(1).t().contiguous()  # (m, D), orthonormal rows
        self.proj_dim = m

        z, t, norm_o, norm_key = self._project(support)
        if n_clusters is None:
            # ~sqrt(n)/12: clusters of 1000-3000 rows for supports of 10k-60k rows, so that each
            # (block, cluster) addmm + topk is large enough for the per-call overhead not to
            # dominate; far fewer clusters than classes merge classes and prune little
            # (benchmarks/bench_knn.py compares the choices).
            n_clusters = int(min(64, max(1, round(math.sqrt(n) / 12))))
        lab, cent = self._kmeans(z.float(), n_clusters, kmeans_iters, gen)
        # Renumber the non-empty clusters so that near clusters get near numbers (k-means of the
        # centroids into ~sqrt(C) groups): the rows a query block needs are then often one run.
        used = torch.unique(lab)
        cent = cent[used]
        group, _ = self._kmeans(cent, max(1, int(math.sqrt(used.numel()))), kmeans_iters, gen)
        new_id = torch.empty(int(used.max()) + 1, dtype=torch.long)
        new_id[used[torch.argsort(group, stable=True)]] = torch.arange(used.numel())
        lab = new_id[lab]
        n_c = used.numel()
        perm = torch.argsort(lab, stable=True)  # storage position -> original row
        counts = torch.bincount(lab, minlength=n_c)
        self.n_clusters = n_c
        self.starts = [0] + torch.cumsum(counts, 0).tolist()
        self.perm = perm.to(support.device)
        self.inv_perm = torch.empty_like(self.perm)
        self.inv_perm[self.perm] = torch.arange(n, device=support.device)
        self.x = centred[self.perm].contiguous()
        del centred
        self.x_sq = s_sq[self.perm].contiguous()

        # Per-cluster statistics in float64 from the exact rows of each cluster.
        z, t, norm_o, norm_key, a = z[perm], t[perm], norm_o[perm], norm_key[perm], lab[perm]
        self.c = torch.zeros(n_c, m, dtype=torch.float64).index_add_(0, a, z) / counts.double().unsqueeze(1)
        self.r = torch.zeros(n_c, dtype=torch.float64).scatter_reduce_(0, a, (z - self.c[a]).norm(dim=1), "amax")
        self.t_lo = torch.full((n_c,), math.inf, dtype=torch.float64).scatter_reduce_(0, a, t, "amin")
        self.t_hi = torch.zeros(n_c, dtype=torch.float64).scatter_reduce_(0, a, t, "amax")
        self.max_norm_o = torch.zeros(n_c, dtype=torch.float64).scatter_reduce_(0, a, norm_o, "amax")
        self.max_norm_key = torch.zeros(n_c, dtype=torch.float64).scatter_reduce_(0, a, norm_key, "amax")
        # Separating directions: w[H, C] = unit(c_H - c_C) (0 for H = C) and
        # top[H, C] = max over x in C of <w[H, C], z_x>, so <w[H, C], z_q> - top[H, C] bounds
        # ||P(q - x)|| from below for every x in C (any unit w; H is the query's home cluster).
        w = self.c.unsqueeze(1) - self.c.unsqueeze(0)
        nrm = w.norm(dim=2, keepdim=True)
        self.w = torch.where(nrm > 0, w / nrm.clamp(min=1e-300), torch.zeros_like(w))  # (H, C, m)
        self.top = torch.empty(n_c, n_c, dtype=torch.float64)
        for c in range(n_c):
            zc = z[self.starts[c] : self.starts[c + 1]]
            self.top[:, c] = (zc @ self.w[:, c, :].t()).amax(0)
        self.last_stats: dict = {}

    def matches(self, support: torch.Tensor) -> bool:
        """Whether this index was built on ``support`` (the same tensor, not modified in place since)."""
        return support is self.support and support._version == self._support_version

    @staticmethod
    def _kmeans(x: torch.Tensor, n_c: int, iters: int, gen: torch.Generator):
        """Lloyd's k-means (CPU) on a subsample; returns (labels of all rows, centroids)."""
        n = x.shape[0]
        n_c = max(1, min(n_c, n))
        fit = x if n <= 64 * n_c else x[torch.randperm(n, generator=gen)[: 64 * n_c]]
        cent = fit[torch.randperm(fit.shape[0], generator=gen)[:n_c]].clone()
        for _ in range(iters):
            lab = torch.cdist(fit, cent).argmin(1)
            sums = torch.zeros_like(cent).index_add_(0, lab, fit)
            cnt = torch.bincount(lab, minlength=n_c).unsqueeze(1)
            cent = torch.where(cnt > 0, sums / cnt.clamp(min=1), cent)
        lab = torch.cat([torch.cdist(x[i : i + 16384], cent).argmin(1) for i in range(0, n, 16384)])
        return lab, cent

    @staticmethod
    def _sample(n: int, size: int, gen: torch.Generator) -> torch.Tensor:
        return torch.arange(n) if n <= size else torch.randperm(n, generator=gen)[:size]

    @staticmethod
    def _chunked_mean(x: torch.Tensor) -> torch.Tensor:
        total = torch.zeros(x.shape[1], dtype=torch.float64)
        for i in range(0, x.shape[0], 16384):
            total += x[i : i + 16384].double().sum(0).cpu()
        return total / x.shape[0]

    def _project(self, x: torch.Tensor):
        """float64 (CPU) ``z = P(x - o)``, ``t = ||P_perp(x - o)||``, ``||x - o||``, ``||x - m||`` (key row)."""
        zs, ts, nos, nrs = [], [], [], []
        for i in range(0, x.shape[0], 8192):
            xc = x[i : i + 8192].cpu()
            # norm of the key row x - m, rounded in the dtype as the addmm sees it
            nrs.append(torch.linalg.vector_norm(xc - self.centre.cpu(), dim=1, dtype=torch.float64))
            xd = xc.to(torch.float64, copy=True).sub_(self.origin)  # a copy: never modify the input
            z = xd @ self.proj.t()
            no = torch.linalg.vector_norm(xd, dim=1)
            zs.append(z)
            ts.append((no.square() - z.square().sum(1)).clamp(min=0).sqrt())
            nos.append(no)
        return tuple(torch.cat(v) for v in (zs, ts, nos, nrs))

    # ------------------------------------------------------------------ search

    def search(
        self,
        query: torch.Tensor,
        k: int,
        self_index: Optional[torch.Tensor] = None,
        block_rows: int = 512,
        first_cols: int = 0,
        group_cols: int = 8192,
        memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
        fallback_min_queries: int = 256,
        fallback_fraction: float = 0.7,
        core_fraction: float = 0.5,
        query_chunk: int = 65536,
    ):
        """Exact ``(distances, indices)`` ``(Nq, k)`` like ``knn_search`` (validated input expected:
        ``query`` of the support's dtype and device, ``1 <= k <= Ns`` or ``Ns - 1`` with
        ``self_index``, the support row to leave out per query, or None).

        The keyword arguments only tune speed and memory (see the module docstring); results do not
        depend on them. Key blocks stay within ``memory_budget_bytes``; the per (query, cluster)
        tables are bounded by searching at most ``query_chunk`` queries at a time. CPU tensors are
        searched with pruning; other devices go to the brute-force torch search.
        """
        n_q, n = query.shape[0], self.n_support
        if n_q > query_chunk:
            # Bounded bookkeeping ((queries, clusters) tables): search big query sets in chunks.
            parts: list[tuple[torch.Tensor, torch.Tensor]] = []
            total: dict[str, int] = {}
            for i in range(0, n_q, query_chunk):
                parts.append(
                    self.search(
                        query[i : i + query_chunk],
                        k,
                        None if self_index is None else self_index[i : i + query_chunk],
                        block_rows,
                        first_cols,
                        group_cols,
                        memory_budget_bytes,
                        fallback_min_queries,
                        fallback_fraction,
                        core_fraction,
                        query_chunk,
                    )
                )
                total = {key: total.get(key, 0) + val for key, val in self.last_stats.items()}
            self.last_stats = total
            return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        chunk = max(1, int(memory_budget_bytes // (max(1, n) * query.element_size())))
        stats = {
            "products": 0,
            "brute_products": n_q * n,
            "cluster_visits": 0,
            "block_cluster_pairs": 0,
            "fallback_queries": 0,
        }
        self.last_stats = stats
        u = _unit_roundoff(query.dtype, query.device)
        # The bounds are evaluated on the CPU: other devices search by brute force.
        if u is None or 2 * (self.dim + 2) * u > 0.05 or n_q == 0 or query.device.type != "cpu":
            stats["fallback_queries"] = n_q
            stats["products"] = n_q * n
            return torch_knn(query, self.support, k, self_index, chunk, keys=key_rows(self.support, self.centre))
        g_key = 2.0 * (self.dim + 2) * u

        zq, tq, noq, nrq = self._project(query)
        qc = query - self.centre  # the key rows of the queries
        # Home = nearest centroid; blocks of at most block_rows queries with the same home.
        home = torch.cat([torch.cdist(zq[i : i + 8192], self.c).argmin(1) for i in range(0, n_q, 8192)])
        order = torch.argsort(home, stable=True)
        homes, per_home = torch.unique_consecutive(home[order], return_counts=True)
        blocks, lo = [], 0
        for h, cnt in zip(homes.tolist(), per_home.tolist()):
            for s in range(lo, lo + cnt, block_rows):
                blocks.append((h, order[s : min(s + block_rows, lo + cnt)]))
            lo += cnt
        # Visit blocks in a fixed pseudo-random order so the fallback rule sees a fair sample.
        visit = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(0)).tolist()

        best_key = torch.full((n_q, k), math.inf, dtype=query.dtype, device=query.device)
        best_pos = torch.full((n_q, k), -1, dtype=torch.long, device=query.device)
        thr_all = torch.empty((n_q, self.n_clusters), dtype=torch.float64)
        visited_all = torch.zeros((n_q, self.n_clusters), dtype=torch.bool)
        self_pos = None if self_index is None else self.inv_perm[self_index]
        done_q, done_products, remaining, pruned_rows = 0, 0, [], []
        # Phase A, per query block: the clusters most of the block needs, as block x cluster GEMMs.
        for j, bi in enumerate(visit):
            if done_q >= fallback_min_queries and done_products > fallback_fraction * done_q * n:
                remaining = [blocks[bb][1] for bb in visit[j:]]
                break
            h, rows = blocks[bi]
            rows_dev = rows.to(query.device)
            lb = self._lower_bounds(h, zq[rows], tq[rows])
            # Key of any row x of cluster C >= LB - ||q||^2 - slack (see the module docstring).
            nq = nrq[rows].unsqueeze(1)
            slack = g_key * ((nq + self.max_norm_key).pow(2) + 2.0 * (nq + self.max_norm_key.max()).pow(2)) + 1e-5 * (
                noq[rows].unsqueeze(1) + self.max_norm_o
            ).pow(2)
            thr = lb - nrq[rows].pow(2).unsqueeze(1) - slack
            bk, bp, visited, products = self._search_block(
                qc[rows_dev],
                k,
                None if self_pos is None else self_pos[rows_dev],
                lb,
                thr,
                first_cols,
                group_cols,
                core_fraction,
                memory_budget_bytes,
            )
            best_key[rows_dev], best_pos[rows_dev] = bk, bp
            thr_all[rows] = thr
            visited_all[rows] = torch.tensor(visited)
            pruned_rows.append(rows)
            done_q += rows.numel()
            done_products += products
            stats["cluster_visits"] += sum(visited)
            stats["block_cluster_pairs"] += self.n_clusters
        # Phase B, per cluster: the (query, cluster) pairs still needed, one GEMM per cluster
        # over the queries that need it (their k-th keys only decrease, so re-check each time).
        if pruned_rows:
            done = torch.cat(pruned_rows)
            need = torch.zeros((n_q, self.n_clusters), dtype=torch.bool)
            need[done] = (thr_all[done] <= best_key[done, -1].double().cpu().unsqueeze(1)) & ~visited_all[done]
            for c in torch.nonzero(need.any(0)).squeeze(1).tolist():
                r = torch.nonzero(need[:, c]).squeeze(1)
                r = r[thr_all[r, c] <= best_key[r, -1].double().cpu()]
                if r.numel():
                    done_products += self._merge_rows(
                        qc, r.to(query.device), c, self_pos, best_key, best_pos, memory_budget_bytes
                    )
                    stats["cluster_visits"] += 1
        stats["products"] = done_products
        out_i = self.perm[best_pos]
        if remaining:
            rest = torch.cat(remaining).to(query.device)
            _, idx = torch_knn(
                query[rest],
                self.support,
                k,
                None if self_index is None else self_index[rest],
                chunk,
                keys=key_rows(self.support, self.centre),
            )
            out_i[rest] = idx
            stats["fallback_queries"] = rest.numel()
            stats["products"] += rest.numel() * n
        # Same exact recomputation and stable re-sort as the torch back end (in 1 MiB pieces, which
        # stay in cache; the per-row arithmetic and so the values are the same).
        d = exact_sq_dist(query, self.support, out_i, memory_budget_bytes=2**20)
        return resort(d, out_i)

    def _merge_rows(self, query, rows, c, self_pos, best_key, best_pos, budget):
        """Merge the keys of ``query[rows]`` against cluster ``c`` into their top k (in place)."""
        a, e = self.starts[c], self.starts[c + 1]
        k = best_key.shape[1]
        step = max(1, int(budget // ((e - a + k) * query.element_size())))
        for i in range(0, rows.numel(), step):
            r = rows[i : i + step]
            key = torch.addmm(self.x_sq[a:e].unsqueeze(0), query[r], self.x[a:e].t(), alpha=-2.0)
            if self_pos is not None:
                sp = self_pos[r]
                hit = torch.nonzero((sp >= a) & (sp < e)).squeeze(1)
                key[hit, sp[hit] - a] = math.inf
            v, j = _topk_smallest(key, k)
            val, jj = smallest_k(torch.cat([best_key[r], v], dim=1), k)
            best_pos[r] = torch.cat([best_pos[r], j + a], dim=1).gather(1, jj)
            best_key[r] = val
        return rows.numel() * (e - a)

    def _lower_bounds(self, home: int, zq: torch.Tensor, tq: torch.Tensor) -> torch.Tensor:
        """``LB(q, C) <= ||q - x||^2`` for all x in C, float64 ``(b, C)`` (module docstring)."""
        ball = (torch.cdist(zq, self.c, compute_mode="donot_use_mm_for_euclid_dist") - self.r).clamp(min=0)
        plane = (zq @ self.w[home].t() - self.top[home]).clamp(min=0)
        gap = torch.maximum(self.t_lo - tq.unsqueeze(1), tq.unsqueeze(1) - self.t_hi).clamp(min=0)
        return torch.maximum(ball, plane).pow(2) + gap.pow(2)

    def _search_block(self, q, k, self_pos, lb, thr, first_cols, group_cols, core_fraction, budget):
        """Phase A for one query block: (top-k keys, storage positions, visited list, products)."""
        b = q.shape[0]
        order = torch.argsort(lb.min(0).values, stable=True).tolist()
        visited = [False] * self.n_clusters
        group_cols = min(group_cols, max(1, int(budget // (b * q.element_size()))))
        starts = self.starts
        best_key = torch.full((b, k), math.inf, dtype=q.dtype, device=q.device)
        best_pos = torch.full((b, k), -1, dtype=torch.long, device=q.device)
        products = 0
        # Round 1: nearest clusters until every query has k candidates besides its own row;
        # then groups of the clusters that at least core_fraction of the block still needs.
        cand, want = order, max(k + 1, first_cols)
        min_need = max(1, int(math.ceil(core_fraction * b)))
        while cand:
            take: list[int] = []
            cols = 0
            for c in cand:
                size = starts[c + 1] - starts[c]
                if take and (cols >= want or cols + size > group_cols):
                    break
                take.append(c)
                cols += size
            for c in take:
                visited[c] = True
            best_key, best_pos = self._merge(q, sorted(take), self_pos, best_key, best_pos)
            products += b * cols
            kth = best_key[:, -1].double().cpu()
            need = ((thr <= kth.unsqueeze(1)).sum(0) >= min_need).tolist()
            cand = [c for c in order if need[c] and not visited[c]]
            want = group_cols
        return best_key, best_pos, visited, products

    def _merge(self, q, clusters, self_pos, best_key, best_pos):
        """Keys of ``q`` against the rows of ``clusters`` (sorted ids), merged into the top k."""
        runs: list[list[int]] = []
        for c in clusters:  # adjacent clusters are one contiguous run of rows
            a, e = self.starts[c], self.starts[c + 1]
            if runs and runs[-1][1] == a:
                runs[-1][1] = e
            else:
                runs.append([a, e])
        k = best_key.shape[1]
        vals, poss = [best_key], [best_pos]
        for a, e in runs:
            # Top k of each run straight from the addmm output (no copy of the key block), then
            # one small top k over the (k + k per run) survivors.
            key = torch.addmm(self.x_sq[a:e].unsqueeze(0), q, self.x[a:e].t(), alpha=-2.0)
            if self_pos is not None:
                # Leave each query's own row out (by index, as the torch back end does).
                hit = torch.nonzero((self_pos >= a) & (self_pos < e)).squeeze(1)
                key[hit, self_pos[hit] - a] = math.inf
            v, j = _topk_smallest(key, k)
            vals.append(v)
            poss.append(j + a)
        val, j = smallest_k(torch.cat(vals, dim=1), k)
        return val, torch.cat(poss, dim=1).gather(1, j)
