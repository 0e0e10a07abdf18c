"""Class hierarchies: construction and validation, the class distances of [Kim, Ch. 4.1; Art. IV],
and the shipped Fashion-MNIST, CIFAR-10 and CIFAR-100 hierarchies."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from shiftguard.data import ClassHierarchy, cifar10_hierarchy, cifar100_hierarchy, fashion_mnist_hierarchy
from shiftguard.data.hierarchy import CIFAR100_COARSE_OF_FINE, FASHION_MNIST_GROUPS, transformed_distance


def small_tree() -> ClassHierarchy:
    """root -> A -> {0, 1};  root -> B -> {2, C};  C -> {3, 4}  (leaves at depths 2 and 3)."""
    # nodes: 0..4 classes, 5 root, 6 A, 7 B, 8 C
    names = ["c0", "c1", "c2", "c3", "c4", "root", "A", "B", "C"]
    return ClassHierarchy([6, 6, 7, 8, 8, None, 5, 5, 7], 5, names=names)


def test_path_distance_counts_edges_through_the_lowest_common_ancestor():
    h = small_tree()
    assert h.path_distance(0, 1) == 2
    assert h.path_distance(0, 2) == 4
    assert h.path_distance(2, 3) == 3
    assert h.path_distance(3, 4) == 2
    assert h.path_distance(0, 3) == 5
    d = h.distance_matrix("path")
    assert d.dtype == torch.float64 and torch.equal(d, d.t()) and torch.all(d.diagonal() == 0)
    assert d[0, 3] == 5 and d[1, 2] == 4


def test_lcs_distance_uses_the_shortest_path_height_by_default_and_the_longest_on_request():
    h = small_tree()
    # shortest-path heights [Kim, Ch. 4.1]: A = 1, B = 1 (child c2 is a leaf), C = 1, root = 2
    assert [h.height(w) for w in (6, 7, 8, 5)] == [1, 1, 1, 2]
    lcs = h.distance_matrix("lcs")
    assert lcs[0, 1] == 0.5 and lcs[2, 3] == 0.5 and lcs[3, 4] == 0.5 and lcs[0, 3] == 1.0
    # longest-path heights (Barz & Denzler 2019's subtree height): B = 2, root = 3
    assert [h.height(w, "longest") for w in (6, 7, 8, 5)] == [1, 2, 1, 3]
    lcs_long = h.distance_matrix("lcs", height="longest")
    assert torch.allclose(lcs_long[[0, 2, 3], [1, 3, 4]], torch.tensor([1 / 3, 2 / 3, 1 / 3], dtype=torch.float64))
    assert torch.equal(h.distance_matrix("lca"), lcs * 2)
    assert torch.equal(h.similarity_matrix("lcs"), 1 - lcs)


def test_transformed_distance_and_similarity_follow_article_iv_eq_14():
    assert float(transformed_distance(torch.tensor(2.0))) == pytest.approx(math.sqrt(2) * 2 / 3)
    assert float(transformed_distance(torch.tensor(4.0), beta=2.0)) == pytest.approx(math.sqrt(2) * 4 / 6)
    s = fashion_mnist_hierarchy().similarity_matrix("transformed")
    assert float(s[0, 2]) == pytest.approx(5 / 9)  # siblings: d_H = 2
    assert float(s[0, 1]) == pytest.approx(9 / 25)  # different groups: d_H = 4
    with pytest.raises(ValueError, match="beta"):
        transformed_distance(torch.tensor(1.0), beta=0.0)
    with pytest.raises(ValueError, match="distances"):
        transformed_distance(torch.tensor([-1.0]))


def test_nested_mapping_builds_the_same_tree_with_the_given_class_order():
    h = ClassHierarchy.from_nested(
        {"A": ["c0", "c1"], "B": {"c2": None, "C": ["c3", "c4"]}}, classes=["c0", "c1", "c2", "c3", "c4"]
    )
    ref = small_tree()
    assert torch.equal(h.distance_matrix(), ref.distance_matrix())
    assert h.class_names == ("c0", "c1", "c2", "c3", "c4")
    reordered = ClassHierarchy.from_nested({"A": ["x", "y"], "z": None}, classes=["z", "y", "x"])
    assert reordered.path_distance(1, 2) == 2 and reordered.path_distance(0, 1) == 3


@pytest.mark.parametrize(
    "parents, n_cls, match",
    [
        ([2, 3, None, None], 2, "exactly one root"),
        ([2, 3, 3, 2, None], 2, "do not reach the root"),
        ([1, None], 2, "classes must be leaves"),
        ([2, 2, None, 2], 2, "no children"),
        ([0, None], 1, "own parent"),
        ([7, None], 1, "outside"),
    ],
)
def test_invalid_parent_lists_are_refused_naming_parents(parents, n_cls, match):
    with pytest.raises(ValueError, match="parents: .*" + match):
        ClassHierarchy(parents, n_cls)


def test_invalid_nested_trees_and_names_are_refused_naming_the_argument():
    with pytest.raises(ValueError, match="tree"):
        ClassHierarchy.from_nested({"A": ["x"], "B": ["x"]})
    with pytest.raises(ValueError, match="classes"):
        ClassHierarchy.from_nested({"A": ["x", "y"]}, classes=["x", "q"])
    with pytest.raises(ValueError, match="names"):
        ClassHierarchy([2, 2, None], 2, names=["a", "a", "r"])


def test_fashion_mnist_hierarchy_groups_garments_with_every_class_at_depth_two():
    h = fashion_mnist_hierarchy()
    assert h.num_classes == 10 and h.class_names[0] == "T-shirt/top" and h.class_names[9] == "Ankle boot"
    assert sorted(c for g in FASHION_MNIST_GROUPS.values() for c in g) == list(range(10))
    assert all(h.depth(c) == 2 for c in range(10))
    d = h.distance_matrix()
    assert d[0, 6] == 2 and d[5, 9] == 2 and d[0, 1] == 4 and d[3, 8] == 4  # shirt~T-shirt, sandal~boot


def test_cifar10_hierarchy_splits_vehicles_from_animals():
    h = cifar10_hierarchy()
    d = h.distance_matrix()
    assert d[0, 9] == 2 and d[3, 5] == 2 and d[0, 3] == 4 and d[8, 7] == 4


def test_cifar100_hierarchy_has_twenty_superclasses_of_five():
    h = cifar100_hierarchy()
    assert h.num_classes == 100 and h.num_nodes == 121
    assert sorted(len(h.leaves(w)) for w in h.children(h.root)) == [5] * 20
    assert h.names[h.parents[h.class_names.index("maple_tree")]] == "trees"
    assert h.names[h.parents[h.class_names.index("whale")]] == "aquatic_mammals"
    assert h.names[h.parents[h.class_names.index("pickup_truck")]] == "vehicles_1"


def _cifar100_dir() -> Path:
    env = os.environ.get("SHIFTGUARD_SHARED_DATA")
    base = Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data"
    for d in (base / "cifar100", base / "cifar-100-python"):
        if (d / "train").is_file() or (d / "cifar-100-python" / "train").is_file():
            return d
    pytest.skip(f"CIFAR-100 not found under {base}")


def test_cifar100_coarse_table_matches_the_dataset_coarse_labels():
    from shiftguard.data import load

    root = _cifar100_dir()
    fine = load("cifar100", "train", root=root, label_mode="fine").labels
    coarse = load("cifar100", "train", root=root, label_mode="coarse").labels
    table = torch.tensor(CIFAR100_COARSE_OF_FINE)
    assert torch.equal(table[fine], coarse)
