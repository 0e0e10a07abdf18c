"""Class hierarchies: a tree over the classes of a dataset, the class distances it defines, and
shipped hierarchies for Fashion-MNIST, CIFAR-10 and CIFAR-100.

Classes are the leaves of a rooted tree [Kim, Ch. 4.1]. Two class distances come from it:

* the shortest-path distance ``d_{H;path}(a, b)`` -- the number of edges from ``a`` up to their
  lowest common ancestor (LCA) and down to ``b``; this is the ``d_H`` of [Kim, Art. IV, "Problem
  settings"] (after Garnot & Landrieu 2021) used by AHD, HP@k and the mean correlation;
* the LCS-height distance ``d_{H;LCS}(a, b) = height(lca(a, b)) / max_w height(w)`` of Barz & Denzler
  2019 and Bertinetto et al. 2020 [Kim, Ch. 4.1], with ``s_H = 1 - d_{H;LCS}`` the similarity
  Barz & Denzler embed their fixed CORR proxies with.

``height(w)`` is "the length of the shortest path from node w to a leaf" in [Kim, Ch. 4.1];
Barz & Denzler's code uses the longest path (the height of the subtree). The two agree on trees whose
leaves all lie at one depth (every shipped hierarchy); ``height="longest"`` selects Barz & Denzler's,
under which ``d_{H;LCS}`` is an ultrametric and ``s_H`` a positive semi-definite matrix on any tree.

[Kim, Art. IV, eq. (14)] also uses the transformed distance ``d_T = sqrt(2) d_H / (beta + d_H)``
(``beta = 1``), a metric bounded by ``sqrt(2)``, and the similarity ``s_H = 1 - d_T^2 / 2`` for HS@k;
see :func:`transformed_distance`.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

import torch

from shiftguard._validation import check_positive
from shiftguard.data.cifar import CIFAR100_CLASSES, CIFAR100_COARSE_CLASSES

__all__ = [
    "ClassHierarchy",
    "transformed_distance",
    "fashion_mnist_hierarchy",
    "cifar10_hierarchy",
    "cifar100_hierarchy",
    "FASHION_MNIST_GROUPS",
    "CIFAR10_GROUPS",
    "CIFAR100_COARSE_OF_FINE",
]


def transformed_distance(distances: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    """``d_T = sqrt(2) d / (beta + d)`` [Kim, Art. IV, "MDS" option], elementwise; ``d >= 0``.

    Maps ``[0, inf)`` into ``[0, sqrt(2))``, the range of chord distances between orthogonal or closer
    unit vectors; a metric stays a metric. Raises ``ValueError`` naming ``beta`` (not positive) or
    ``distances`` (negative or non-finite values).
    """
    check_positive(beta, "beta")
    d = torch.as_tensor(distances)
    if not d.is_floating_point():
        d = d.double()
    if d.numel() and (not bool(torch.isfinite(d).all()) or float(d.min()) < 0):
        raise ValueError("distances: expected finite non-negative values")
    return math.sqrt(2.0) * d / (beta + d)


class ClassHierarchy:
    """A rooted tree whose leaves are the classes ``0 .. num_classes - 1``.

    Args:
        parents: the parent of every node: ``parents[i]`` is the index of node ``i``'s parent, ``None``
            (or ``-1``) for the root. Nodes ``0 .. num_classes - 1`` are the classes, in label order;
            nodes ``num_classes ..`` are the inner nodes.
        num_classes: number of classes ``C``.
        names: optional names of all nodes (``len(parents)`` strings, unique); classes default to
            ``"0" .. "C-1"``, inner nodes to ``"node<i>"``.

    Validation (``ValueError`` naming ``parents``): exactly one root, parents in range, no cycles,
    every class a leaf and every leaf a class (an inner node without children is refused).

    Attributes:
        num_classes, num_nodes, parents (tuple), names (tuple), class_names (tuple of the first C names).
    """

    def __init__(self, parents: Sequence[Optional[int]], num_classes: int, names: Optional[Sequence[str]] = None):
        check_positive(num_classes, "num_classes", integer=True)
        plist = list(parents)
        n = len(plist)
        if n < num_classes:
            raise ValueError(f"parents: expected at least num_classes={num_classes} nodes, got {n}")
        norm: list[Optional[int]] = []
        for i, p in enumerate(plist):
            if p is None or (isinstance(p, int) and not isinstance(p, bool) and p == -1):
                norm.append(None)
                continue
            if isinstance(p, bool) or not isinstance(p, int):
                raise TypeError(f"parents: entry {i} must be an int or None, got {type(p).__name__}")
            if not 0 <= p < n:
                raise ValueError(f"parents: entry {i} points to node {p}, outside 0..{n - 1}")
            if p == i:
                raise ValueError(f"parents: node {i} is its own parent")
            norm.append(p)
        roots = [i for i, p in enumerate(norm) if p is None]
        if len(roots) != 1:
            raise ValueError(f"parents: expected exactly one root (a None entry), got {len(roots)}: {roots[:10]}")
        children: list[list[int]] = [[] for _ in range(n)]
        for i, p in enumerate(norm):
            if p is not None:
                children[p].append(i)
        # Every node must reach the root; a node on a cycle never does.
        depth = [-1] * n
        depth[roots[0]] = 0
        stack = [roots[0]]
        while stack:
            v = stack.pop()
            for c in children[v]:
                depth[c] = depth[v] + 1
                stack.append(c)
        unreached = [i for i in range(n) if depth[i] < 0]
        if unreached:
            raise ValueError(f"parents: nodes {unreached[:10]} do not reach the root (a cycle)")
        inner_classes = [i for i in range(num_classes) if children[i]]
        if inner_classes:
            raise ValueError(f"parents: classes must be leaves, but classes {inner_classes[:10]} have children")
        empty_inner = [i for i in range(num_classes, n) if not children[i]]
        if empty_inner:
            raise ValueError(f"parents: inner nodes {empty_inner[:10]} have no children (every leaf must be a class)")
        if names is None:
            names = [str(i) for i in range(num_classes)] + [f"node{i}" for i in range(num_classes, n)]
        names = [str(s) for s in names]
        if len(names) != n:
            raise ValueError(f"names: expected {n} names (one per node), got {len(names)}")
        if len(set(names)) != n:
            dup = sorted({s for s in names if names.count(s) > 1})
            raise ValueError(f"names: must be unique, repeated: {dup[:10]}")
        self.num_classes = int(num_classes)
        self.num_nodes = n
        self.parents: tuple[Optional[int], ...] = tuple(norm)
        self.names: tuple[str, ...] = tuple(names)
        self.root = roots[0]
        self._children = tuple(tuple(c) for c in children)
        self._depth = tuple(depth)
        self._ancestors = tuple(self._path_to_root(i) for i in range(n))

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_nested(
        cls, tree: Mapping[str, Any], classes: Optional[Sequence[str]] = None, root_name: str = "root"
    ) -> "ClassHierarchy":
        """Build from a nested mapping: keys are node names, values are sub-mappings (inner nodes), a
        sequence of class names (an inner node whose children are those classes) or ``None`` / an
        empty mapping (a class). The outer mapping holds the root's children.

        ``classes`` fixes the label order (``classes[k]`` is class ``k``); by default the classes are
        numbered in the depth-first order of the mapping. Raises ``ValueError`` naming ``tree`` (a
        repeated name, an empty tree) or ``classes`` (not exactly the leaves of ``tree``).
        """
        if not isinstance(tree, Mapping) or not tree:
            raise ValueError("tree: expected a non-empty mapping of node names")
        edges: list[tuple[str, str]] = []  # (child, parent)
        leaves: list[str] = []
        seen = {root_name}

        def visit(name: str, sub: Any, parent: str) -> None:
            name = str(name)
            if name in seen:
                raise ValueError(f"tree: node name {name!r} appears more than once")
            seen.add(name)
            edges.append((name, parent))
            if sub is None or (isinstance(sub, Mapping) and not sub):
                leaves.append(name)
            elif isinstance(sub, Mapping):
                for k, v in sub.items():
                    visit(k, v, name)
            elif isinstance(sub, (list, tuple)):
                if not sub:
                    raise ValueError(f"tree: node {name!r} has an empty list of children")
                for k in sub:
                    visit(k, None, name)
            else:
                raise ValueError(
                    f"tree: node {name!r} maps to a {type(sub).__name__}; expected a mapping, "
                    "a list of class names or None"
                )

        for k, v in tree.items():
            visit(k, v, root_name)
        if classes is None:
            classes = list(leaves)
        classes = [str(c) for c in classes]
        if sorted(classes) != sorted(leaves) or len(set(classes)) != len(classes):
            missing = sorted(set(leaves) - set(classes))
            extra = sorted(set(classes) - set(leaves))
            raise ValueError(
                f"classes: must list every leaf of tree exactly once; missing {missing[:10]}, not leaves {extra[:10]}"
            )
        inner = [root_name] + [c for c, _ in edges if c not in set(leaves)]
        order = classes + inner
        index = {name: i for i, name in enumerate(order)}
        parent_of = dict(edges)
        parents = [None if name == root_name else index[parent_of[name]] for name in order]
        return cls(parents, len(classes), names=order)

    # ------------------------------------------------------------------ structure
    def _path_to_root(self, node: int) -> tuple[int, ...]:
        path = [node]
        p = self.parents[node]
        while p is not None:
            path.append(p)
            p = self.parents[p]
        return tuple(path)

    @property
    def class_names(self) -> tuple[str, ...]:
        return self.names[: self.num_classes]

    def children(self, node: int) -> tuple[int, ...]:
        return self._children[self._node(node)]

    def depth(self, node: int) -> int:
        """Edges from the root to ``node``."""
        return self._depth[self._node(node)]

    def ancestors(self, node: int) -> tuple[int, ...]:
        """``node`` and its ancestors, from ``node`` up to the root."""
        return self._ancestors[self._node(node)]

    def leaves(self, node: int) -> tuple[int, ...]:
        """The classes under ``node`` (``Leaves(w)`` of [Kim, Ch. 4.2]), sorted."""
        node = self._node(node)
        return tuple(c for c in range(self.num_classes) if node in self._ancestors[c])

    def height(self, node: int, kind: str = "shortest") -> int:
        """Edges from ``node`` down to a leaf: the shortest such path [Kim, Ch. 4.1] or, with
        ``kind="longest"``, the height of the subtree under ``node`` (Barz & Denzler 2019's code)."""
        if kind not in ("shortest", "longest"):
            raise ValueError(f"kind: expected 'shortest' or 'longest', got {kind!r}")
        node = self._node(node)
        kids = self._children[node]
        if not kids:
            return 0
        pick = min if kind == "shortest" else max
        return 1 + pick(self.height(c, kind) for c in kids)

    def lca(self, a: int, b: int) -> int:
        """The lowest common ancestor (lowest common subsumer) of two nodes."""
        anc_b = set(self.ancestors(b))
        return next(w for w in self.ancestors(a) if w in anc_b)

    def lca_height(self, a: int, b: int, kind: str = "shortest") -> int:
        """``height(lca(a, b))`` (0 for ``a == b``)."""
        return self.height(self.lca(a, b), kind)

    def path_distance(self, a: int, b: int) -> int:
        """Edges on the path from ``a`` to ``b``: ``d_{H;path}`` [Kim, Ch. 4.1; Art. IV, "Problem settings"]."""
        w = self.lca(a, b)
        return self.depth(a) + self.depth(b) - 2 * self.depth(w)

    def _node(self, node: int) -> int:
        if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < self.num_nodes:
            raise ValueError(f"node: expected an int in 0..{self.num_nodes - 1}, got {node!r}")
        return node

    # ------------------------------------------------------------------ matrices
    def distance_matrix(
        self, kind: str = "path", height: str = "shortest", dtype: torch.dtype = torch.float64
    ) -> torch.Tensor:
        """Class distances ``(C, C)``, zero on the diagonal, symmetric.

        ``kind``: ``"path"`` -- ``d_{H;path}``, the ``d_H`` of [Kim, Art. IV]; ``"lca"`` -- the LCA
        height ``height(lca(a, b))``; ``"lcs"`` -- ``d_{H;LCS}``, the LCA height divided by the largest
        node height [Kim, Ch. 4.1] (Barz & Denzler 2019), in ``[0, 1]``. ``height`` as in :meth:`height`.
        """
        if kind not in ("path", "lca", "lcs"):
            raise ValueError(f"kind: expected 'path', 'lca' or 'lcs', got {kind!r}")
        c = self.num_classes
        out = torch.zeros(c, c, dtype=dtype)
        heights = [self.height(w, height) for w in range(self.num_nodes)]
        for a in range(c):
            for b in range(a + 1, c):
                if kind == "path":
                    v = float(self.path_distance(a, b))
                else:
                    v = float(heights[self.lca(a, b)])
                out[a, b] = out[b, a] = v
        if kind == "lcs":
            out = out / max(heights)
        return out

    def similarity_matrix(
        self, kind: str = "lcs", beta: float = 1.0, height: str = "shortest", dtype: torch.dtype = torch.float64
    ) -> torch.Tensor:
        """Class similarities ``(C, C)`` with ones on the diagonal.

        ``kind="lcs"``: ``s_H = 1 - d_{H;LCS}`` (Barz & Denzler 2019) [Kim, Ch. 4.2];
        ``kind="transformed"``: ``s_H = 1 - d_T^2 / 2`` with ``d_T`` the transform of the path distance
        [Kim, Art. IV, eq. (14)] -- the cosine between unit vectors at chord distance ``d_T``.
        """
        if kind == "lcs":
            return 1.0 - self.distance_matrix("lcs", height=height, dtype=dtype)
        if kind == "transformed":
            d_t = transformed_distance(self.distance_matrix("path", dtype=dtype), beta)
            return 1.0 - d_t.pow(2) / 2.0
        raise ValueError(f"kind: expected 'lcs' or 'transformed', got {kind!r}")

    def __repr__(self) -> str:
        return (
            f"ClassHierarchy(num_classes={self.num_classes}, num_nodes={self.num_nodes}, "
            f"root={self.names[self.root]!r})"
        )


# ---------------------------------------------------------------------- shipped hierarchies
#: Fashion-MNIST (Xiao et al. 2017), labels 0 T-shirt/top, 1 Trouser, 2 Pullover, 3 Dress, 4 Coat,
#: 5 Sandal, 6 Shirt, 7 Sneaker, 8 Bag, 9 Ankle boot, grouped by garment type. Every class sits at
#: depth 2, so path distances are 2 (same group) or 4 (different groups).
FASHION_MNIST_GROUPS: dict[str, tuple[int, ...]] = {
    "tops": (0, 2, 4, 6),
    "bottoms": (1,),
    "dresses": (3,),
    "footwear": (5, 7, 9),
    "bags": (8,),
}
_FASHION_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)

#: CIFAR-10 labels 0 airplane, 1 automobile, 2 bird, 3 cat, 4 deer, 5 dog, 6 frog, 7 horse, 8 ship,
#: 9 truck, split into vehicles and animals.
CIFAR10_GROUPS: dict[str, tuple[int, ...]] = {"vehicles": (0, 1, 8, 9), "animals": (2, 3, 4, 5, 6, 7)}
_CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")

#: The coarse label (0..19) of every CIFAR-100 fine label (0..99), both in the alphabetical order of
#: the dataset's ``fine_label_names`` / ``coarse_label_names`` (Krizhevsky 2009). Fixed by the dataset:
#: each training and test image carries both labels, and every superclass holds five classes.
CIFAR100_COARSE_OF_FINE: tuple[int, ...] = (
    4,
    1,
    14,
    8,
    0,
    6,
    7,
    7,
    18,
    3,
    3,
    14,
    9,
    18,
    7,
    11,
    3,
    9,
    7,
    11,
    6,
    11,
    5,
    10,
    7,
    6,
    13,
    15,
    3,
    15,
    0,
    11,
    1,
    10,
    12,
    14,
    16,
    9,
    11,
    5,
    5,
    19,
    8,
    8,
    15,
    13,
    14,
    17,
    18,
    10,
    16,
    4,
    17,
    4,
    2,
    0,
    17,
    4,
    18,
    17,
    10,
    3,
    2,
    12,
    12,
    16,
    12,
    1,
    9,
    19,
    2,
    10,
    0,
    1,
    16,
    12,
    9,
    13,
    15,
    13,
    16,
    19,
    2,
    4,
    6,
    19,
    5,
    5,
    8,
    19,
    18,
    1,
    2,
    15,
    6,
    0,
    17,
    8,
    14,
    13,
)


def _two_level(groups: Mapping[str, Sequence[int]], class_names: Sequence[str]) -> ClassHierarchy:
    c = len(class_names)
    group_names = list(groups)
    parents: list[Optional[int]] = [None] * (c + 1 + len(group_names))
    for g, name in enumerate(group_names):
        node = c + 1 + g
        parents[node] = c
        for k in groups[name]:
            parents[k] = node
    names = list(class_names) + ["root"] + group_names
    return ClassHierarchy(parents, c, names=names)


def fashion_mnist_hierarchy() -> ClassHierarchy:
    """Fashion-MNIST: root -> {tops, bottoms, dresses, footwear, bags} -> the 10 classes
    (:data:`FASHION_MNIST_GROUPS`)."""
    return _two_level(FASHION_MNIST_GROUPS, _FASHION_CLASSES)


def cifar10_hierarchy() -> ClassHierarchy:
    """CIFAR-10: root -> {vehicles, animals} -> the 10 classes (:data:`CIFAR10_GROUPS`)."""
    return _two_level(CIFAR10_GROUPS, _CIFAR10_CLASSES)


def cifar100_hierarchy() -> ClassHierarchy:
    """CIFAR-100: root -> the 20 official superclasses -> the 100 classes (:data:`CIFAR100_COARSE_OF_FINE`).

    Node names are the dataset's ``fine_label_names`` then ``"root"`` then its ``coarse_label_names``.
    """
    groups = {
        name: tuple(f for f, g in enumerate(CIFAR100_COARSE_OF_FINE) if g == k)
        for k, name in enumerate(CIFAR100_COARSE_CLASSES)
    }
    return _two_level(groups, CIFAR100_CLASSES)
