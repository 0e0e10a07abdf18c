"""The report's views of a model: a fixed colour per head, reliability diagrams of every head, the
adversarial pivot and its gradient-masking caveat."""

from __future__ import annotations

import pytest

from shiftguard.evaluation import plots as P
from shiftguard.evaluation.report import make_plots, masking_signs, render_html


def _row(model, head, corruption, severity, acc, group="benchmark"):
    return {
        "model": model,
        "context": "none",
        "adaptation": "none",
        "head": head,
        "corruption": corruption,
        "severity": severity,
        "group": group,
        "accuracy": acc,
        "ece_top_label": 0.1,
        "nll": 1.0,
        "r_auroc": 0.5,
    }


def _attacked(pgd: dict, fgsm: dict) -> dict:
    """Two heads of one model under FGSM and PGD (L-inf) at eps 0.05 and 0.3: ``pgd`` / ``fgsm`` map
    eps to the accuracy of head ``softmax`` (head ``knn`` is 1 point lower everywhere)."""
    eps = [0.05, 0.3]
    rows = []
    for head, shift in (("softmax", 0.0), ("knn", 0.01)):
        rows.append(_row("m", head, "clean", 0, 0.99 - shift))
        for name, acc in (("pgd", pgd), ("fgsm", fgsm)):
            rows += [_row("m", head, name, i + 1, acc[e] - shift, "adversarial") for i, e in enumerate(eps)]
    attacks = {
        "pgd": {"attack": "pgd", "norm": "linf", "eps": eps, "steps": 10},
        "fgsm": {"attack": "fgsm", "norm": "linf", "eps": eps, "steps": 1},
    }
    return {
        "name": "t",
        "kind": "evaluate",
        "rows": rows,
        "data": {"dataset": "d", "attacks": attacks, "num_classes": 10, "severities": [], "corruptions": []},
    }


def test_an_attack_that_removes_all_accuracy_shows_no_masking_sign():
    res = _attacked(pgd={0.05: 0.40, 0.3: 0.01}, fgsm={0.05: 0.55, 0.3: 0.05})
    assert masking_signs(res) == []
    assert "Possible gradient masking" not in render_html(res, {})


@pytest.mark.parametrize(
    "pgd, fgsm, sign",
    [
        ({0.05: 0.40, 0.3: 0.30}, {0.05: 0.55, 0.3: 0.35}, "keeps 30.0% under pgd at eps 0.3 (chance 10.0%)"),
        (
            {0.05: 0.40, 0.3: 0.02},
            {0.05: 0.30, 0.3: 0.05},
            "one-step fgsm (30.0%) beats iterative pgd (40.0%) at eps 0.05",
        ),
        ({0.05: 0.40, 0.3: 0.02}, {0.05: 0.30, 0.3: 0.45}, "accuracy under fgsm rises with the budget"),
    ],
)
def test_each_sign_of_gradient_masking_is_named_on_the_page(pgd, fgsm, sign):
    res = _attacked(pgd, fgsm)
    signs = masking_signs(res)
    assert any(sign in s for s in signs), signs
    page = render_html(res, {})
    assert "Possible gradient masking" in page and sign.split(" (")[0] in page


def test_the_adversarial_pivot_has_one_row_per_head_and_one_column_per_attack_and_budget():
    page = render_html(_attacked(pgd={0.05: 0.40, 0.3: 0.01}, fgsm={0.05: 0.55, 0.3: 0.05}), {})
    pivot = page.split("Accuracy (%) per attack and budget")[1].split("</table>")[0]
    assert all(f"<th>{c}</th>" in pivot for c in ("clean", "pgd 0.05", "pgd 0.3", "fgsm 0.05", "fgsm 0.3"))
    assert pivot.count("<tr>") == 3  # the header and the two heads
    assert ">40.0<" in pivot and ">39.0<" in pivot


def test_a_head_has_one_colour_whatever_the_other_heads():
    assert P.head_color("knn", ["knn"]) == P.head_color("knn", ["softmax", "knn", "quantile"])
    listed = [P.head_color(h) for h in P.HEAD_COLORS]
    assert len(set(listed)) == len(listed)
    spare = [P.head_color(h, ["zeta", "alpha"]) for h in ("alpha", "zeta")]
    assert len(set(spare)) == 2 and not set(spare) & set(listed)
    assert P.head_color("alpha", ["zeta", "alpha"]) == P.head_color("alpha", ["alpha", "zeta"])


def test_every_scored_head_has_a_reliability_diagram(tmp_path):
    res = _attacked(pgd={0.05: 0.40, 0.3: 0.01}, fgsm={0.05: 0.55, 0.3: 0.05})
    res["data"]["severities"] = []
    res["reliability"] = [
        {
            "model": "m",
            "context": "none",
            "adaptation": "none",
            "head": h,
            "severity": 0,
            "edges": [0.0, 0.5, 1.0],
            "accuracy": [None, 0.9],
            "count": [0, 3],
        }
        for h in ("softmax", "knn")
    ]
    plots = make_plots(tmp_path, res)
    assert plots["reliability_every_head"].stat().st_size > 0
    assert plots["adversarial_accuracy"].stat().st_size > 0
    assert "Reliability diagrams of every head" in render_html(res, plots)


def test_images_made_on_another_model_that_beat_the_white_box_attack_are_a_masking_sign():
    res = _attacked(pgd={0.05: 0.40, 0.3: 0.01}, fgsm={0.05: 0.55, 0.3: 0.05})
    res["data"]["attacks"]["pgd@other"] = {**res["data"]["attacks"]["pgd"], "source": "other", "transfer": True}
    res["rows"] += [_row("m", "softmax", "pgd@other", i + 1, acc, "adversarial") for i, acc in enumerate((0.2, 0.01))]
    signs = masking_signs(res)
    assert signs == [
        "m / softmax: images made on other (pgd@other, 20.0%) remove more accuracy than its own "
        "white-box pgd (40.0%) at eps 0.05"
    ]
    page = render_html(res, {})
    assert "pgd@other 0.05" in page and "columns <code>attack@model</code>" in page
    # the source's own transfer cell is its white-box attack again: never a sign
    res["data"]["attacks"]["pgd@other"]["source"] = "m"
    assert masking_signs(res) == []
