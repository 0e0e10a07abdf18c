"""Property-based hardening of the public tensor APIs: QACT, heads, metrics, losses.

For every API, hypothesis draws

* **bad inputs** -- empty tensors, NaN / inf, integer or boolean dtypes where floats are needed,
  wrong numbers of dimensions, mismatched lengths, labels that are negative, too large, fractional
  or 2-D -- and the API must raise ``ValueError`` / ``TypeError`` whose message names one of its
  arguments where ``shiftguard._validation`` puts it (see ``named_arguments``; never a bare
  ``IndexError`` / ``RuntimeError``, never a silent result);
* **edge inputs** -- a single sample, a single class, constant values -- and the API must return
  a documented, finite result or raise such a named error;
* **valid random inputs** -- and the result must be finite and in range (probabilities on the
  simplex, metrics in their interval, losses finite with finite gradients).

Examples are kept few (``max_examples`` 10-30, ``deadline=None``) so the file runs in seconds.
"""

from __future__ import annotations

import collections
import json
import math
import os
import re

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

# Derandomized (same examples every run), no example database on disk, no shrinking (a failure
# is reported as found: shrinking re-runs the expensive calls many times).
_COMMON = dict(
    deadline=None,
    derandomize=True,
    database=None,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow],
)
FAST = settings(max_examples=25, **_COMMON)
FEW = settings(max_examples=10, **_COMMON)
MEDIUM = settings(max_examples=20, **_COMMON)

#: (api, kind) -> number of examples tried; written out by ``_summary`` at the end of the module.
TRIED: collections.Counter = collections.Counter()


@pytest.fixture(scope="module", autouse=True)
def _summary():
    yield
    path = os.environ.get("SHIFTGUARD_RELIABILITY_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            for (api, kind), n in sorted(TRIED.items()):
                fh.write(
                    json.dumps(
                        {
                            "file": "test_api_hardening.py",
                            "group": "api",
                            "case": api,
                            "kind": kind,
                            "n": n,
                            "outcome": "documented result or named error",
                        }
                    )
                    + "\n"
                )


#: The prefix of ``_validation.check_same_length``'s message, which then lists ``name=length`` pairs.
MISMATCH = "mismatched lengths: "


def named_arguments(exc: BaseException) -> list[str]:
    """The arguments an error message names, read where ``shiftguard._validation`` puts them: the
    leading ``"<name>:"`` ("labels: expected shape (N,), got (4, 1)"), or each ``"<name>="`` after
    ``"mismatched lengths: "``. A name elsewhere in the text does not count."""
    msg = str(exc)
    if msg.startswith(MISMATCH):
        return re.findall(r"(\w+)=\d+", msg[len(MISMATCH) :])
    m = re.match(r"(\w+):", msg)
    return [m.group(1)] if m else []


def names_an_argument(exc: BaseException, names) -> bool:
    """Whether ``exc`` names arguments, all of them among ``names``, in the convention's place (so a
    one-letter name like ``k`` counts only as the exact leading ``"k:"``)."""
    found = named_arguments(exc)
    return bool(found) and all(n in names for n in found)


def test_an_argument_counts_as_named_only_where_the_validation_convention_puts_it():
    from shiftguard import heads as H
    from shiftguard import metrics as M

    with pytest.raises(ValueError) as info:
        H.NED(k=0).fit(torch.randn(4, 2), torch.arange(4) % 2)  # "k: expected a positive value, got 0"
    assert names_an_argument(info.value, ("k",)) and not names_an_argument(info.value, ("x",))
    with pytest.raises(ValueError) as info:
        M.accuracy(torch.full((3, 2), 0.5), torch.zeros(2, dtype=torch.long))  # "mismatched lengths: probs=3, ..."
    assert names_an_argument(info.value, ("probs", "labels")) and not names_an_argument(info.value, ("probs",))
    # the name only inside the sentence, or only as a substring of another word, is not naming it
    assert not names_an_argument(ValueError("expected a tensor for labels"), ("labels",))
    assert not names_an_argument(ValueError("index: expected 2 dimensions"), ("x", "in"))


def expect_named_error(fn, names, api: str):
    """``fn()`` must raise ValueError/TypeError naming one of ``names``."""
    TRIED[api, "bad"] += 1
    try:
        fn()
    except (ValueError, TypeError) as exc:
        assert names_an_argument(exc, names), f"{api}: error does not name {names}: {exc!r}"
        return
    raise AssertionError(f"{api}: bad input was accepted")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------ bad inputs
EMB_KINDS = ["empty", "nan", "inf", "int_dtype", "bool_dtype", "ndim1", "ndim3", "list_of_str"]
LABEL_KINDS = ["negative", "too_large", "fractional", "ndim2", "mismatch", "nan", "complex"]


def bad_embeddings(kind: str, n: int, d: int, g: torch.Generator):
    x = torch.randn(n, d, generator=g)
    if kind == "empty":
        return x[:0]
    if kind == "nan":
        x[n // 2, d // 2] = math.nan
        return x
    if kind == "inf":
        x[0, 0] = -math.inf
        return x
    if kind == "int_dtype":
        return (x * 10).long()
    if kind == "bool_dtype":
        return x > 0
    if kind == "ndim1":
        return x.flatten()
    if kind == "ndim3":
        return x.unsqueeze(1)
    return [["a"] * d] * n


def bad_labels(kind: str, n: int, c: int, g: torch.Generator):
    y = torch.randint(0, c, (n,), generator=g)
    if kind == "negative":
        y[-1] = -1
        return y
    if kind == "too_large":
        y[0] = c + 3
        return y
    if kind == "fractional":
        return y.double() + 0.5
    if kind == "ndim2":
        return y.view(n, 1)
    if kind == "mismatch":
        return y[:-1]
    if kind == "nan":
        return torch.full((n,), math.nan)
    return y.to(torch.complex64)


def probs_of(n: int, c: int, g: torch.Generator) -> torch.Tensor:
    return torch.softmax(torch.randn(n, c, generator=g) * 2, dim=1)


PROB_KINDS = EMB_KINDS + ["not_summing_to_one", "negative_entry", "above_one"]


def bad_probs(kind: str, n: int, c: int, g: torch.Generator):
    if kind in EMB_KINDS:
        return bad_embeddings(kind, n, c, g) if kind not in ("nan", "inf") else _poison(probs_of(n, c, g), kind)
    p = probs_of(n, c, g)
    if kind == "not_summing_to_one":
        return p * 0.5
    if kind == "negative_entry":
        p[0, 0] = -0.2
        return p
    p[0] = 0.0
    p[0, 0] = 1.5
    return p


def _poison(x, kind):
    x = x.clone()
    x[0, 0] = math.nan if kind == "nan" else math.inf
    return x


sizes = st.tuples(st.integers(3, 12), st.integers(2, 6), st.integers(2, 4), st.integers(0, 2**31 - 1))


# ------------------------------------------------------------------------------------------ metrics
def _metric_fns():
    from shiftguard import metrics as M

    return {
        "metrics.accuracy": M.accuracy,
        "metrics.nll": M.nll,
        "metrics.brier": M.brier,
        "metrics.ece(top-label)": lambda p, y: M.ece(p, y, n_bins=5),
        "metrics.ece(marginal, mass)": lambda p, y: M.ece(p, y, n_bins=5, kind="marginal", binning="mass"),
        "metrics.reliability_diagram": lambda p, y: M.reliability_diagram(p, y, n_bins=5),
    }


#: The interval each scalar probability metric lies in.
METRIC_RANGES = {
    "metrics.accuracy": (0, 1),
    "metrics.nll": (0, math.inf),
    "metrics.brier": (0, 2),
    "metrics.ece(top-label)": (0, 1),
    "metrics.ece(marginal, mass)": (0, 1),
}


@FAST
@given(sizes, st.sampled_from(PROB_KINDS + LABEL_KINDS))
def test_probability_metrics_reject_bad_input_naming_it(size, kind):
    n, _, c, seed = size
    g = gen(seed)
    for api, fn in _metric_fns().items():
        if kind in PROB_KINDS:
            p, y = bad_probs(kind, n, c, g), torch.randint(0, c, (n,), generator=g)
        else:
            p, y = probs_of(n, c, g), bad_labels(kind, n, c, g)
        expect_named_error(lambda: fn(p, y), ("probs", "labels"), api)


@FAST
@given(sizes, st.booleans(), st.booleans())
def test_probability_metrics_on_edge_and_random_input_are_finite_and_in_range(size, single_sample, single_class):
    from shiftguard.metrics import ReliabilityData

    n, _, c, seed = size
    g = gen(seed)
    n = 1 if single_sample else n
    c = 1 if single_class else c
    p, y = probs_of(n, c, g), torch.randint(0, c, (n,), generator=g)
    for api, fn in _metric_fns().items():
        TRIED[api, "edge" if (single_sample or single_class) else "valid"] += 1
        out = fn(p, y)
        if isinstance(out, ReliabilityData):
            assert torch.isfinite(out.bin_edges).all()
            continue
        lo, hi = METRIC_RANGES[api]
        assert isinstance(out, float) and math.isfinite(out) and lo - 1e-9 <= out <= hi + 1e-9, (api, out)


UNC_KINDS = ["empty", "nan", "ndim2", "mismatch", "not_binary"]


def scores_and_errors(size):
    """Valid inputs of the uncertainty metrics: random uncertainties, every other sample an error."""
    n, _, _, seed = size
    return torch.rand(n, generator=gen(seed)), torch.arange(n) % 2 == 0


@FAST
@given(sizes, st.sampled_from(UNC_KINDS))
def test_uncertainty_metrics_reject_bad_input_naming_it(size, kind):
    from shiftguard import metrics as M

    u, e = scores_and_errors(size)
    n = u.numel()
    if kind == "empty":
        u, e = u[:0], e[:0]
    elif kind == "nan":
        u[0] = math.nan
    elif kind == "ndim2":
        u = u.view(n, 1)
    elif kind == "mismatch":
        e = e[:-1]
    else:
        e = e.long() * 2
    for api, fn in {"metrics.auroc_error": M.auroc_error, "metrics.aurc": M.aurc}.items():
        expect_named_error(lambda: fn(u, e), ("uncertainty", "is_error"), api)


@FAST
@given(sizes, st.sampled_from(["all_errors", "no_errors", "single", "ties", "mixed"]))
def test_uncertainty_metrics_edge_cases_are_documented(size, case):
    from shiftguard import metrics as M

    u, e = scores_and_errors(size)
    if case == "all_errors":
        e[:] = True
    elif case == "no_errors":
        e[:] = False
    elif case == "single":
        u, e = u[:1], e[:1]
    elif case == "ties":
        u[:] = 0.5
    TRIED["metrics.auroc_error", "edge"] += 1
    TRIED["metrics.aurc", "edge"] += 1
    a = M.aurc(u, e)
    assert math.isfinite(a) and 0.0 <= a <= 1.0
    if case in ("all_errors", "no_errors", "single"):
        with pytest.raises(ValueError, match="^is_error:"):  # documented: needs both outcomes
            M.auroc_error(u, e)
    else:
        r = M.auroc_error(u, e)
        assert 0.0 <= r <= 1.0
        if case == "ties":
            assert r == 0.5


@FAST
@given(sizes, st.sampled_from(EMB_KINDS + LABEL_KINDS))
def test_retrieval_metrics_and_knn_reject_bad_input_naming_it(size, kind):
    from shiftguard import metrics as M
    from shiftguard.heads import knn_search

    n, d, c, seed = size
    g = gen(seed)
    emb = bad_embeddings(kind, n, d, g) if kind in EMB_KINDS else torch.randn(n, d, generator=g)
    y = bad_labels(kind, n, c, g) if kind in LABEL_KINDS else torch.arange(n) % c
    if kind == "too_large":  # no num_classes here: any class id is fine; not an error
        return
    expect_named_error(
        lambda: M.retrieval_metrics(emb, y, ks=(1,)), ("embeddings", "labels"), "metrics.retrieval_metrics"
    )
    u = torch.rand(n, generator=g)
    expect_named_error(lambda: M.r_auroc(emb, y, u), ("embeddings", "labels", "uncertainty"), "metrics.r_auroc")
    if kind in EMB_KINDS and kind != "empty":
        expect_named_error(lambda: knn_search(emb, torch.randn(n, d, generator=g), 1), ("query",), "heads.knn_search")
        expect_named_error(lambda: knn_search(torch.randn(n, d, generator=g), emb, 1), ("support",), "heads.knn_search")


@FAST
@given(
    sizes,
    st.sampled_from(
        ["random", "single_sample", "singleton_classes", "single_class", "duplicates", "k_too_large", "k_zero"]
    ),
)
def test_retrieval_metrics_edge_cases_are_documented(size, case):
    from shiftguard import metrics as M

    n, d, c, seed = size
    g = gen(seed)
    emb = torch.randn(n, d, generator=g)
    y = torch.arange(n) % c
    ks = (1, 2)
    if case == "single_sample":
        emb, y = emb[:1], y[:1]
    elif case == "singleton_classes":
        y = torch.arange(n)
    elif case == "single_class":
        y = torch.zeros(n, dtype=torch.long)
    elif case == "duplicates":
        emb = emb[:1].expand(n, d).contiguous()
    elif case == "k_too_large":
        ks = (n,)
    elif case == "k_zero":
        ks = (0,)
    TRIED["metrics.retrieval_metrics", "edge" if case != "random" else "valid"] += 1
    try:
        out = M.retrieval_metrics(emb, y, ks=ks)
    except ValueError as exc:
        assert case in ("single_sample", "singleton_classes", "k_too_large", "k_zero"), exc
        assert names_an_argument(exc, ("ks", "labels")), exc
        return
    for key, v in out.items():
        assert math.isfinite(v), (key, v)
        if not key.startswith("n_"):
            assert 0.0 <= v <= 1.0, (key, v)
    if case == "single_class":
        assert out["precision@1"] == 1.0 and out["map@r"] == 1.0


# ------------------------------------------------------------------------------------------ heads
#: Heads cheap enough to refit on every hypothesis example (they store the support set).
CHEAP_HEADS = ("heads.NED", "heads.OneNN", "heads.KNNVote", "heads.WeightedKNN")


def _heads():
    from shiftguard import heads as H

    return {
        "heads.NED": lambda: H.NED(k=2),
        "heads.OneNN": lambda: H.OneNN(),
        "heads.KNNVote": lambda: H.KNNVote(k=2),
        "heads.WeightedKNN": lambda: H.WeightedKNN(k=2),
        "heads.TemperatureScaling": lambda: H.TemperatureScaling(max_iter=20),
        "heads.LogisticRegressionHead": lambda: H.LogisticRegressionHead(max_iter=20),
        "heads.DistanceRatioHead": lambda: H.DistanceRatioHead(max_iter=10),
        "heads.QuantileClassifierHead": lambda: H.QuantileClassifierHead(
            classifier_kwargs={"n_samples": 50}, fit_kwargs={"epochs": 1}
        ),
    }


HEAD_ARGS = (
    "train_embeddings",
    "train_labels",
    "val_embeddings",
    "val_labels",
    "embeddings",
    "labels",
    "num_classes",
    "k",
)
C_HEAD, D_HEAD = 3, 4


def _valid_fit_data(n: int, d: int, c: int, g: torch.Generator, head: str):
    n = max(n, 2 * c)
    y = torch.arange(n) % c
    if head == "heads.TemperatureScaling":  # its inputs are logits
        d = c
    return torch.randn(n, d, generator=g) + y.view(-1, 1).float(), y


FITTED: dict = {}


def fitted_heads() -> dict:
    """Every head fitted once on a valid 3-class set (expensive heads are not refitted per example)."""
    if not FITTED:
        for api, make in _heads().items():
            x, y = _valid_fit_data(12, D_HEAD, C_HEAD, gen(0), api)
            FITTED[api] = make().fit(x, y)
    return FITTED


def check_simplex(p: torch.Tensor, n: int, c: int, what: str) -> None:
    assert p.shape == (n, c), what
    assert torch.isfinite(p).all(), f"{what}: non-finite probabilities"
    assert (p >= 0).all() and torch.allclose(p.sum(1).double(), torch.ones(n, dtype=torch.float64), atol=1e-4), what


@FEW
@given(sizes, st.sampled_from(EMB_KINDS + LABEL_KINDS))
def test_heads_fit_rejects_bad_input_naming_it(size, kind):
    n, d, c, seed = size
    for api, make in _heads().items():
        g = gen(seed)
        x, y = _valid_fit_data(n, d, c, g, api)
        head = make()
        if kind in EMB_KINDS:
            x = bad_embeddings(kind, x.shape[0], x.shape[1], g)
        else:
            y = bad_labels(kind, y.shape[0], c, g)
            head.num_classes = c  # with num_classes given, a label beyond it is out of range
        expect_named_error(lambda: head.fit(x, y), HEAD_ARGS, api)


@FAST
@given(st.integers(1, 9), st.integers(0, 2**31 - 1), st.sampled_from(EMB_KINDS + ["wrong_width"]))
def test_heads_predict_rejects_bad_queries_naming_them(n, seed, kind):
    for api, head in fitted_heads().items():
        g = gen(seed)
        width = C_HEAD if api == "heads.TemperatureScaling" else D_HEAD
        if kind == "empty":  # an empty query is valid: an empty (0, C) answer, or an error naming it
            TRIED[api, "edge"] += 1
            try:
                out = head.predict_proba(torch.randn(0, width))
            except ValueError as exc:
                assert names_an_argument(exc, ("embeddings",)), f"{api}: {exc!r}"
            else:
                assert out.shape == (0, C_HEAD), api
            continue
        q = torch.randn(n, width + 1, generator=g) if kind == "wrong_width" else bad_embeddings(kind, n, width, g)
        expect_named_error(lambda: head.predict_proba(q), ("embeddings",), api)


@FAST
@given(st.integers(1, 9), st.integers(0, 2**31 - 1), st.sampled_from(["random", "far_away", "at_support", "zeros"]))
def test_heads_give_finite_probabilities_on_the_simplex_for_any_query(n, seed, case):
    for api, head in fitted_heads().items():
        g = gen(seed)
        width = C_HEAD if api == "heads.TemperatureScaling" else D_HEAD
        q = torch.randn(n, width, generator=g)
        if case == "far_away":
            q = q * 1e4
        elif case == "at_support":
            q = _valid_fit_data(12, D_HEAD, C_HEAD, gen(0), api)[0][:n]
        elif case == "zeros":
            q = torch.zeros(n, width)
        TRIED[api, "valid" if case == "random" else "edge"] += 1
        p = head.predict_proba(q)
        check_simplex(p, q.shape[0], C_HEAD, f"{api} ({case})")
        assert torch.equal(head.predict(q), p.argmax(1))


@FAST
@given(sizes, st.sampled_from(["random", "duplicated_support", "two_per_class", "k_equals_support"]))
def test_knn_heads_refitted_on_any_support_give_probabilities_on_the_simplex(size, case):
    n, d, c, seed = size
    for api in CHEAP_HEADS:
        g = gen(seed)
        x, y = _valid_fit_data(n, d, c, g, api)
        if case == "duplicated_support":
            x = x[:1].expand_as(x).contiguous()
        elif case in ("two_per_class", "k_equals_support"):
            x, y = x[: 2 * c], y[: 2 * c]
        TRIED[api, "valid" if case == "random" else "edge"] += 1
        head = _heads()[api]()
        if case == "k_equals_support" and hasattr(head, "k") and api != "heads.OneNN":
            head.k = x.shape[0]
        try:
            head.fit(x, y)
        except ValueError as exc:  # documented: NED's leave-one-out fit needs k <= support size - 1
            assert case == "k_equals_support" and api == "heads.NED" and names_an_argument(exc, ("k",)), (api, exc)
            continue
        q = torch.randn(n, d, generator=g)
        check_simplex(head.predict_proba(q), n, c, f"{api} ({case})")


@pytest.mark.parametrize("case", ["single_class", "duplicated_support", "two_per_class"])
def test_every_head_on_degenerate_training_sets_is_certain_or_refuses_by_name(case):
    g = gen(1)
    for api, make in _heads().items():
        c = 1 if case == "single_class" else C_HEAD
        x, y = _valid_fit_data(12, D_HEAD, c, g, api)
        if case == "duplicated_support":
            x = x[:1].expand_as(x).contiguous()
        elif case == "two_per_class":
            x, y = x[: 2 * c], y[: 2 * c]
        TRIED[api, "edge"] += 1
        try:
            head = make().fit(x, y)
        except ValueError as exc:
            assert names_an_argument(exc, HEAD_ARGS), (api, exc)
            continue
        p = head.predict_proba(torch.randn(3, x.shape[1], generator=g))
        check_simplex(p, 3, c, f"{api} ({case})")
        if case == "single_class":
            assert torch.allclose(p, torch.ones_like(p)), (api, p)


def test_heads_refuse_to_predict_before_fit():
    from shiftguard.heads import NotFittedError

    for api, make in _heads().items():
        TRIED[api, "bad"] += 1
        with pytest.raises(NotFittedError, match="fit"):
            make().predict_proba(torch.randn(2, 3))


# ------------------------------------------------------------------------------------------ losses
D_LOSS, C_LOSS = 4, 3


def _losses():
    from shiftguard.losses import LOSS_NAMES, build_loss

    out = {}
    for name in LOSS_NAMES:
        torch.manual_seed(0)
        out[f"losses.{name}"] = build_loss(name, num_classes=C_LOSS, embedding_dim=D_LOSS)
    return out


LOSSES = None


def losses():
    global LOSSES
    if LOSSES is None:
        LOSSES = _losses()
    return LOSSES


def has_class_params(loss) -> bool:
    """Whether ``loss`` owns per-class ``(C, D)`` parameters (proxies, a classifier)."""
    return any(
        p.dim() == 2 and p.shape[1] == D_LOSS or p.dim() == 2 and p.shape[0] == D_LOSS for p in loss.parameters()
    )


@MEDIUM
@given(st.integers(3, 8), st.integers(0, 2**31 - 1), st.sampled_from(EMB_KINDS + LABEL_KINDS + ["wrong_width"]))
def test_losses_reject_bad_input_naming_it(n, seed, kind):
    for api, loss in losses().items():
        g = gen(seed)
        x = torch.randn(n, D_LOSS, generator=g, requires_grad=False)
        y = torch.arange(n) % C_LOSS
        if kind in EMB_KINDS:
            x = bad_embeddings(kind, n, D_LOSS, g)
        elif kind == "wrong_width":
            x = torch.randn(n, D_LOSS + 2, generator=g)
            # Only losses that own per-class parameters of width D know the width is wrong.
            if not has_class_params(loss):
                continue
        else:
            y = bad_labels(kind, n, C_LOSS, g)
            if kind == "too_large" and not has_class_params(loss):
                continue  # losses without per-class parameters accept any class id
        expect_named_error(lambda: loss(x, y), ("embeddings", "labels", "num_classes"), api)


@MEDIUM
@given(
    st.integers(1, 8),
    st.integers(0, 2**31 - 1),
    st.sampled_from(
        ["random", "single_sample", "single_class", "all_singletons", "zero_vectors", "duplicates", "large_values"]
    ),
)
def test_losses_are_finite_with_finite_gradients(n, seed, case):
    for api, loss in losses().items():
        g = gen(seed)
        x = torch.randn(n, D_LOSS, generator=g)
        y = torch.arange(n) % C_LOSS
        if case == "single_sample":
            x, y = x[:1], y[:1]
        elif case == "single_class":
            y = torch.zeros_like(y)
        elif case == "all_singletons":
            y = torch.arange(n) % C_LOSS
            x, y = x[: min(n, C_LOSS)], y[: min(n, C_LOSS)]
        elif case == "zero_vectors":
            x = torch.zeros_like(x)
        elif case == "duplicates":
            x = x[:1].expand_as(x).contiguous()
        elif case == "large_values":
            x = x * 1e3
        x = x.clone().requires_grad_(True)
        TRIED[api, "valid" if case == "random" else "edge"] += 1
        try:
            out = loss(x, y)
        except ValueError as exc:  # e.g. a documented minimum batch size
            assert names_an_argument(exc, ("embeddings", "labels")), (api, exc)
            continue
        assert out.dim() == 0 and torch.isfinite(out), f"{api}: {out} in case {case}"
        out.backward()
        assert x.grad is not None and torch.isfinite(x.grad).all(), f"{api}: non-finite gradient in case {case}"


# ------------------------------------------------------------------------------------------ QACT
QACT_KINDS = ["empty_batch", "nan", "inf", "int_dtype", "bool_dtype", "ndim1", "zero_channels"]


@FAST
@given(st.integers(2, 10), st.integers(1, 5), st.integers(0, 2**31 - 1), st.sampled_from(QACT_KINDS))
def test_qact_rejects_bad_input_naming_it(n, ch, seed, kind):
    from shiftguard.nn import QuantileActivation

    g = gen(seed)
    x = torch.randn(n, ch, generator=g)
    if kind == "empty_batch":
        x = x[:0]
    elif kind == "nan":
        x[0, 0] = math.nan
    elif kind == "inf":
        x[-1, -1] = math.inf
    elif kind == "int_dtype":
        x = (x * 5).long()
    elif kind == "bool_dtype":
        x = x > 0
    elif kind == "ndim1":
        x = x[:, 0]
    else:
        x = x[:, :0]
    act = QuantileActivation(n_samples=50)
    expect_named_error(lambda: act(x), ("input",), "nn.QuantileActivation")


@FAST
@given(
    st.integers(1, 12),
    st.integers(1, 4),
    st.integers(0, 2**31 - 1),
    st.sampled_from(["random", "single_sample", "constant", "huge", "tiny_spread", "image"]),
    st.sampled_from(["batch", "frozen"]),
    st.booleans(),
)
def test_qact_outputs_finite_quantiles_with_finite_gradients(n, ch, seed, case, context, training):
    from shiftguard.nn import QuantileActivation

    g = gen(seed)
    x = torch.randn(n, ch, generator=g)
    if case == "single_sample":
        x = x[:1]
    elif case == "constant":
        x = torch.full((n, ch), 3.0)
    elif case == "huge":
        x = x * 1e6
    elif case == "tiny_spread":
        x = 1.0 + x * 1e-7
    elif case == "image":
        x = torch.randn(n, ch, 3, 3, generator=g)
    act = QuantileActivation(n_samples=50, context=context).train(training)
    x = x.clone().requires_grad_(True)
    TRIED["nn.QuantileActivation", "valid" if case == "random" else "edge"] += 1
    out = act(x)
    assert out.shape == x.shape and torch.isfinite(out).all(), case
    assert (out >= 0).all() and (out <= 1).all(), case
    out.sum().backward()
    assert torch.isfinite(x.grad).all(), f"non-finite QACT gradient in case {case}"


@FAST
@given(
    st.sampled_from(["relu", "prelu", "selu", "qact", "QACT", "gelu", "", 3, None]),
    st.sampled_from([1, 4, 0, -2, 2.5, True]),
)
def test_make_activation_accepts_its_names_and_rejects_the_rest(name, num_features):
    from shiftguard.nn import ACTIVATION_NAMES, make_activation

    known = isinstance(name, str) and name.lower() in ACTIVATION_NAMES
    TRIED["nn.make_activation", "valid" if known else "bad"] += 1
    try:
        act = make_activation(name, num_features)
    except (ValueError, TypeError) as exc:
        assert names_an_argument(exc, ("name", "num_features")), exc
        assert not (isinstance(name, str) and name.lower() in ("relu", "selu")), exc  # these ignore num_features
        return
    assert isinstance(name, str) and name.lower() in ACTIVATION_NAMES
    assert (
        isinstance(num_features, int)
        and not isinstance(num_features, bool)
        and num_features >= 1
        or name.lower() in ("relu", "selu")
    )
    x = torch.randn(4, num_features if isinstance(num_features, int) and num_features >= 1 else 1)
    assert torch.isfinite(act(x)).all()


@MEDIUM
@given(
    st.integers(2, 10),
    st.integers(0, 2**31 - 1),
    st.sampled_from(EMB_KINDS + LABEL_KINDS + ["random", "single_class_present", "batch_size_1"]),
)
def test_quantile_classifier_fit_validates_and_predicts_on_the_simplex(n, seed, kind):
    from shiftguard.heads import fit_quantile_classifier
    from shiftguard.nn import QuantileClassifier

    g = gen(seed)
    x, y = torch.randn(n, 3, generator=g), torch.arange(n) % 2
    clf = QuantileClassifier(3, 2, n_samples=30)
    fit_kw = {"epochs": 1}
    if kind in EMB_KINDS:
        x = bad_embeddings(kind, n, 3, g)
    elif kind in LABEL_KINDS:
        y = bad_labels(kind, n, 2, g)
    elif kind == "batch_size_1":
        fit_kw["batch_size"] = 1
    if kind in EMB_KINDS + LABEL_KINDS + ["batch_size_1"]:
        expect_named_error(
            lambda: fit_quantile_classifier(clf, x, y, **fit_kw),
            ("train_embeddings", "train_labels", "batch_size"),
            "nn.QuantileClassifier",
        )
        return
    if kind == "single_class_present":
        y = torch.zeros_like(y)
    TRIED["nn.QuantileClassifier", "valid" if kind == "random" else "edge"] += 1
    fit_quantile_classifier(clf, x, y, **fit_kw)
    p = clf.predict_proba(torch.randn(5, 3, generator=g))
    check_simplex(p, 5, 2, f"QuantileClassifier ({kind})")


@FAST
@given(
    st.integers(0, 2**31 - 1),
    st.sampled_from(
        ["random", "zero", "huge", "tiny", "negative", "nan", "inf", "int_dtype", "dim1", "dim_float", "empty"]
    ),
    st.integers(2, 64),
)
def test_vmf_normalizer_and_sampler_are_finite_or_refuse_by_name(seed, case, dim):
    from shiftguard.functional.vmf import log_vmf_normalizer, sample_vmf

    g = gen(seed)
    kappa = torch.rand(3, generator=g, dtype=torch.float64) * 50
    d = dim
    if case == "zero":
        kappa = torch.zeros(3, dtype=torch.float64)
    elif case == "huge":
        kappa = kappa * 1e5 + 1e4
    elif case == "tiny":
        kappa = kappa * 1e-12
    elif case == "negative":
        kappa[1] = -0.5
    elif case == "nan":
        kappa[0] = math.nan
    elif case == "inf":
        kappa[2] = math.inf
    elif case == "int_dtype":
        kappa = kappa.long()
    elif case == "dim1":
        d = 1
    elif case == "dim_float":
        d = 3.0
    elif case == "empty":
        kappa = kappa[:0]
    if case in ("negative", "nan", "inf", "int_dtype", "dim1", "dim_float"):
        expect_named_error(lambda: log_vmf_normalizer(kappa, d), ("kappa", "dim"), "functional.log_vmf_normalizer")
        return
    TRIED["functional.log_vmf_normalizer", "valid" if case == "random" else "edge"] += 1
    k = kappa.clone().requires_grad_(True)
    out = log_vmf_normalizer(k, d)
    assert out.shape == kappa.shape and torch.isfinite(out).all(), (case, out)
    if out.numel():
        out.sum().backward()
        assert torch.isfinite(k.grad).all(), case
        TRIED["functional.sample_vmf", "valid" if case == "random" else "edge"] += 1
        mu = torch.randn(3, d, generator=g, dtype=torch.float64)
        s = sample_vmf(mu, kappa, 4, generator=g)
        assert s.shape == (4, 3, d) and torch.isfinite(s).all(), case
        torch.testing.assert_close(s.norm(dim=-1), torch.ones(4, 3, dtype=torch.float64))


#: Half-precision dtypes, which every head computes and answers in float32.
HALF = (torch.float16, torch.bfloat16)
#: The APIs whose output dtype is not their input's, and why; every other API answers in its input's dtype.
OUTPUT_DTYPE_EXCEPTIONS = {
    "heads.QuantileClassifierHead": (
        torch.float32,
        "its QuantileClassifier keeps float32 parameters and casts the query to them, so the probabilities are float32",
    ),
}


def _check_probabilities(p, n: int, c: int, dtype: torch.dtype) -> list[str]:
    """What is wrong with ``p`` as ``(n, c)`` rows on the simplex of ``dtype`` (rounding to it allowed)."""
    if not isinstance(p, torch.Tensor) or p.shape != (n, c) or p.dtype != dtype:
        return [f"expected a ({n}, {c}) {dtype} tensor, got {getattr(p, 'dtype', type(p))} {getattr(p, 'shape', '')}"]
    q = p.double()
    tol = max(4 * torch.finfo(dtype).eps, 1e-6)
    if not (torch.isfinite(q).all() and (q >= 0).all() and (q <= 1).all()):
        return ["probabilities not finite or outside [0, 1]"]
    if not torch.allclose(q.sum(1), torch.ones(n, dtype=torch.float64), atol=tol):
        return [f"rows do not sum to 1 (max deviation {float((q.sum(1) - 1).abs().max()):.3g})"]
    return []


def _check_in_range(v, lo: float, hi: float) -> list[str]:
    if not isinstance(v, float) or not math.isfinite(v) or not lo <= v <= hi:
        return [f"expected a finite float in [{lo}, {hi}], got {v!r}"]
    return []


def _check_metric(api: str, out) -> list[str]:
    from shiftguard.metrics import ReliabilityData

    if api == "metrics.reliability_diagram":
        ok = isinstance(out, ReliabilityData) and bool(torch.isfinite(out.bin_edges).all())
        return [] if ok else [f"expected ReliabilityData with finite bin edges, got {out!r}"]
    return _check_in_range(out, *METRIC_RANGES[api])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_every_api_accepts_other_float_dtypes(dtype):
    """No API refuses half, bfloat16 or double input. Heads answer ``(N, C)`` probabilities on the
    simplex in the input's dtype, half precision in float32 (except ``OUTPUT_DTYPE_EXCEPTIONS``);
    QACT keeps shape and dtype, values in [0, 1]; losses give a finite scalar of
    ``promote_types(dtype, float32)`` (their parameters are float32) and a finite gradient of the
    input's dtype and shape; metrics give finite floats in their range."""
    from shiftguard import metrics as M
    from shiftguard.nn import QuantileActivation

    g = gen(0)
    checks = {}  # api -> () -> list of problems
    for api, make in _heads().items():
        x, y = _valid_fit_data(12, D_HEAD, C_HEAD, g, api)
        # half precision is computed, and answered, in float32: rows summed to 0.994-1.006 in bfloat16
        want = OUTPUT_DTYPE_EXCEPTIONS.get(api, (torch.float32 if dtype in HALF else dtype,))[0]
        checks[api] = lambda make=make, x=x, y=y, want=want: _check_probabilities(
            make().fit(x.to(dtype), y).predict_proba(x.to(dtype)), x.shape[0], C_HEAD, want
        )
    for api, loss in losses().items():

        def run(loss=loss):
            x = torch.randn(6, D_LOSS, generator=g).to(dtype).requires_grad_(True)
            out = loss(x, torch.arange(6) % C_LOSS)
            out.backward()
            want = torch.promote_types(dtype, torch.float32)
            found = []
            if out.shape != () or out.dtype != want or not torch.isfinite(out):
                found.append(f"expected a finite {want} scalar, got {out.dtype} {tuple(out.shape)}: {out}")
            if (
                x.grad is None
                or x.grad.dtype != dtype
                or x.grad.shape != x.shape
                or not torch.isfinite(x.grad.float()).all()
            ):
                found.append(f"expected a finite {dtype} gradient of shape {tuple(x.shape)}, got {x.grad}")
            return found

        checks[api] = run
    p, y = probs_of(10, 3, g).to(dtype), torch.arange(10) % 3
    for api, fn in _metric_fns().items():
        checks[api] = lambda fn=fn, api=api: _check_metric(api, fn(p, y))
    e, ye, u = torch.randn(20, 4, generator=g).to(dtype), torch.arange(20) % 4, torch.rand(20, generator=g).to(dtype)
    checks["metrics.retrieval_metrics"] = lambda: [
        f"{k}: {msg}"
        for k, v in M.retrieval_metrics(e, ye, ks=(1,)).items()
        if not k.startswith("n_")
        for msg in _check_in_range(v, 0, 1)
    ]
    checks["metrics.r_auroc"] = lambda: _check_in_range(M.r_auroc(e, ye, u), 0, 1)
    checks["metrics.auroc_error"] = lambda: _check_in_range(M.auroc_error(u, ye % 2 == 0), 0, 1)
    checks["metrics.aurc"] = lambda: _check_in_range(M.aurc(u, ye % 2 == 0), 0, 1)

    def qact():
        x = torch.randn(8, 3, generator=g).to(dtype)
        out = QuantileActivation(n_samples=50)(x)
        if out.shape != x.shape or out.dtype != dtype or not ((out >= 0) & (out <= 1)).all():
            return [f"expected {dtype} {tuple(x.shape)} values in [0, 1], got {out.dtype} {tuple(out.shape)}"]
        return []

    checks["nn.QuantileActivation"] = qact

    problems = []
    for api, check in checks.items():
        TRIED[api, "edge"] += 1
        try:
            problems += [f"{api}: {msg}" for msg in check()]
        except Exception as exc:
            problems.append(f"{api}: refused {dtype}: {type(exc).__name__}: {exc}")
    assert not problems, "\n".join(problems)
