"""Robustness summaries (mean corruption accuracy, CE / mCE / relative mCE of Hendrycks & Dietterich 2019)
and percentile bootstrap intervals over test images (Efron & Tibshirani 1993)."""

import math

import numpy as np
import pytest
import torch

from shiftguard.metrics import (
    bootstrap_ci,
    bootstrap_ece_ci,
    bootstrap_mean_ci,
    corruption_errors,
    ece,
    mean_corruption_accuracy,
)

# ---------------------------------------------------------------- mean corruption accuracy


def test_mean_corruption_accuracy_of_a_hand_example():
    # (0.9 + 0.8 + 0.7 + 0.6 + 0.5 + 0.4) / 6 = 3.9 / 6 = 0.65
    grid = [[0.9, 0.8, 0.7], [0.6, 0.5, 0.4]]
    assert mean_corruption_accuracy(grid) == pytest.approx(0.65, abs=1e-15)
    assert mean_corruption_accuracy(np.array(grid)) == pytest.approx(0.65, abs=1e-15)
    assert mean_corruption_accuracy({"fog": grid[0], "snow": grid[1]}) == pytest.approx(0.65, abs=1e-15)
    cells = {(c, s + 1): grid[i][s] for i, c in enumerate(["fog", "snow"]) for s in range(3)}
    assert mean_corruption_accuracy(cells) == pytest.approx(0.65, abs=1e-15)


def test_mean_corruption_accuracy_is_the_plain_mean_over_15_by_5_cells():
    acc = torch.rand(15, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    total = 0.0
    for c in range(15):
        for s in range(5):
            total += float(acc[c, s])
    assert mean_corruption_accuracy(acc) == pytest.approx(total / 75, abs=1e-14)
    assert isinstance(mean_corruption_accuracy(acc), float)


def test_mean_corruption_accuracy_names_missing_and_non_finite_cells():
    with pytest.raises(ValueError, match=r"accuracy: .*missing \('snow', 3\)"):
        mean_corruption_accuracy({("fog", 1): 0.5, ("fog", 3): 0.4, ("snow", 1): 0.3})
    with pytest.raises(ValueError, match=r"accuracy: cell \('fog', 2\) is not finite"):
        mean_corruption_accuracy({"fog": [0.5, float("nan")]})
    with pytest.raises(ValueError, match=r"accuracy: cell \(corruption 1, severity index 0\)"):
        mean_corruption_accuracy(torch.tensor([[0.5, 0.5], [float("inf"), 0.5]]))
    with pytest.raises(ValueError, match=r"accuracy: cell \('fog', 1\) = 85.0 lies outside \[0, 1\]"):
        mean_corruption_accuracy({"fog": [85.0]})
    with pytest.raises(ValueError, match="accuracy: expected shape"):
        mean_corruption_accuracy(torch.rand(5))
    with pytest.raises(ValueError, match="accuracy: expected at least one cell"):
        mean_corruption_accuracy({})
    with pytest.raises(TypeError, match="accuracy: mixes"):
        mean_corruption_accuracy({("fog", 1): 0.5, "snow": [0.5]})


# ---------------------------------------------------------------- corruption errors


def test_corruption_errors_of_a_hand_example():
    errors = {"noise": [0.2, 0.4], "blur": [0.1, 0.3]}
    base = {"noise": [0.5, 0.5], "blur": [0.2, 0.2]}
    out = corruption_errors(errors, base, clean_error=0.1, baseline_clean_error=0.1)
    # CE_noise = (0.2 + 0.4) / (0.5 + 0.5) = 0.6;  CE_blur = (0.1 + 0.3) / (0.2 + 0.2) = 1.0
    assert out["ce"] == pytest.approx({"noise": 0.6, "blur": 1.0}, abs=1e-15)
    assert out["mce"] == pytest.approx(0.8, abs=1e-15)
    # rCE_noise = (0.1 + 0.3) / (0.4 + 0.4) = 0.5;  rCE_blur = (0.0 + 0.2) / (0.1 + 0.1) = 1.0
    assert out["relative_ce"] == pytest.approx({"noise": 0.5, "blur": 1.0}, abs=1e-15)
    assert out["relative_mce"] == pytest.approx(0.75, abs=1e-15)
    assert list(out["ce"]) == ["noise", "blur"]


def test_corruption_errors_equal_a_literal_loop_over_hendrycks_formulas():
    g = torch.Generator().manual_seed(1)
    names = [f"c{i}" for i in range(15)]
    e_f = 0.2 + 0.5 * torch.rand(15, 5, generator=g, dtype=torch.float64)
    e_b = 0.3 + 0.6 * torch.rand(15, 5, generator=g, dtype=torch.float64)
    clean_f, clean_b = 0.1, 0.15
    errors = {(c, s + 1): float(e_f[i, s]) for i, c in enumerate(names) for s in range(5)}
    base = {(c, s + 1): float(e_b[i, s]) for i, c in enumerate(names) for s in range(5)}
    out = corruption_errors(errors, base, clean_error=clean_f, baseline_clean_error=clean_b)
    ce, rce = {}, {}
    for i, c in enumerate(names):
        num = den = rnum = rden = 0.0
        for s in range(5):
            num += float(e_f[i, s])
            den += float(e_b[i, s])
            rnum += float(e_f[i, s]) - clean_f
            rden += float(e_b[i, s]) - clean_b
        ce[c], rce[c] = num / den, rnum / rden
    assert out["ce"] == pytest.approx(ce, rel=1e-13)
    assert out["mce"] == pytest.approx(sum(ce.values()) / 15, rel=1e-13)
    assert out["relative_ce"] == pytest.approx(rce, rel=1e-13)
    assert out["relative_mce"] == pytest.approx(sum(rce.values()) / 15, rel=1e-13)
    # the per-corruption sequence form, numpy rows and tensors give the same numbers
    seq = corruption_errors(
        {c: e_f[i].numpy() for i, c in enumerate(names)},
        {c: list(e_b[i].tolist()) for i, c in enumerate(names)},
        clean_error=torch.tensor(clean_f, dtype=torch.float64),
        baseline_clean_error=np.float64(clean_b),
    )
    assert seq["mce"] == pytest.approx(out["mce"], rel=1e-15)
    assert seq["relative_mce"] == pytest.approx(out["relative_mce"], rel=1e-15)


def test_corruption_errors_omit_the_relative_form_without_clean_errors():
    out = corruption_errors({"fog": [0.3]}, {"fog": [0.6]})
    assert set(out) == {"ce", "mce"}
    assert out["mce"] == pytest.approx(0.5)


def test_undefined_corruption_errors_are_none_and_so_is_their_mean():
    errors = {"fog": [0.2, 0.3], "snow": [0.1, 0.1]}
    base = {"fog": [0.4, 0.6], "snow": [0.0, 0.0]}  # baseline never wrong on snow
    out = corruption_errors(errors, base, clean_error=0.05, baseline_clean_error=0.5)
    assert out["ce"]["fog"] == pytest.approx(0.5)
    assert out["ce"]["snow"] is None and out["mce"] is None
    # baseline 0.4 + 0.6 - 2 * 0.5 = 0: no worse than clean on fog; better than clean on snow
    assert out["relative_ce"] == {"fog": None, "snow": None}
    assert out["relative_mce"] is None


def test_relative_ce_is_none_when_the_baseline_improves_under_corruption_but_ce_is_defined():
    out = corruption_errors(
        {"brightness": [0.1, 0.12]}, {"brightness": [0.2, 0.21]}, clean_error=0.1, baseline_clean_error=0.22
    )
    assert out["ce"]["brightness"] == pytest.approx(0.22 / 0.41)
    assert out["relative_ce"]["brightness"] is None
    assert out["relative_mce"] is None


def test_corruption_errors_reject_different_cells_and_list_them():
    with pytest.raises(ValueError, match=r"only in errors: \('fog', 3\); only in baseline_errors: \('snow', 1\)"):
        corruption_errors({"fog": [0.1, 0.2, 0.3]}, {("fog", 1): 0.2, ("fog", 2): 0.3, ("snow", 1): 0.5})


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"errors": {"fog": [12.0]}}, r"errors: cell \('fog', 1\) = 12.0 lies outside"),
        ({"baseline_errors": {("fog", 1): float("nan")}}, r"baseline_errors: cell \('fog', 1\) is not finite"),
        ({"errors": [0.1, 0.2]}, "errors: expected a mapping"),
        ({"errors": {"fog": 0.3}}, "errors: key 'fog' of a single value"),
        ({"errors": {"fog": [[0.1, 0.2]]}}, r"errors: cell \('fog', 1\) should be one number"),
        ({"errors": {"fog": ["high"]}}, r"errors: cell \('fog', 1\) is not a number"),
        ({"clean_error": 0.1}, "baseline_clean_error: the relative CE needs both"),
        ({"baseline_clean_error": 0.1}, "clean_error: the relative CE needs both"),
        ({"clean_error": 1.5, "baseline_clean_error": 0.1}, r"clean_error = 1.5 lies outside \[0, 1\]"),
    ],
)
def test_corruption_errors_reject_bad_input_naming_the_argument(kwargs, pattern):
    args = {"errors": {"fog": [0.1]}, "baseline_errors": {"fog": [0.2]}, **kwargs}
    with pytest.raises((ValueError, TypeError), match=pattern):
        corruption_errors(args.pop("errors"), args.pop("baseline_errors"), **args)


# ---------------------------------------------------------------- bootstrap


def test_bootstrap_ci_is_the_percentile_interval_of_the_statistic_on_resampled_indices():
    values = torch.rand(12, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    seen, reps = [], []

    def stat(idx):
        seen.append(idx.clone())
        reps.append(float(values[idx].mean()))
        return reps[-1]

    est, lo, hi = bootstrap_ci(stat, 12, n_boot=200, level=0.8, seed=3)
    assert est == float(values.mean()) and seen[0].tolist() == list(range(12))
    assert len(seen) == 201
    assert all(
        i.dtype == torch.int64 and i.shape == (12,) and 0 <= int(i.min()) and int(i.max()) < 12 for i in seen[1:]
    )
    # percentile method, linear interpolation between order statistics (numpy's default)
    assert (lo, hi) == pytest.approx(tuple(np.percentile(reps[1:], [10, 90])), abs=1e-15)


def test_bootstrap_of_a_single_image_or_constant_scores_has_zero_width():
    # n = 1: every resample is [0], so every replicate equals the estimate
    assert bootstrap_mean_ci(torch.tensor([0.25])) == (0.25, 0.25, 0.25)
    assert bootstrap_mean_ci(torch.full((3, 50), 0.5), n_boot=20) == (0.5, 0.5, 0.5)
    assert bootstrap_ci(lambda idx: 2.0, 7, n_boot=10) == (2.0, 2.0, 2.0)


@pytest.mark.parametrize("shape, n_boot", [((40,), 300), ((3, 5000), 500)])
def test_bootstrap_mean_ci_uses_the_same_resamples_as_bootstrap_ci(shape, n_boot):
    v = torch.rand(shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64) < 0.6
    rows = v.double().reshape(-1, shape[-1])
    fast = bootstrap_mean_ci(v, n_boot=n_boot, seed=11)
    slow = bootstrap_ci(lambda idx: float(rows[:, idx].mean(1).mean()), shape[-1], n_boot=n_boot, seed=11)
    assert fast == pytest.approx(slow, abs=1e-12)
    assert bootstrap_mean_ci(v.numpy(), n_boot=n_boot, seed=11) == fast


def _top_label_pairs(m, n, seed):
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(2.0 * torch.randn(m, n, 4, generator=g, dtype=torch.float64), dim=2)
    labels = torch.randint(0, 4, (n,), generator=g)
    conf, pred = probs.max(dim=2)
    return probs, labels, conf, pred == labels


@pytest.mark.parametrize("m, n, n_bins", [(1, 300, 15), (3, 120, 10)])
def test_bootstrap_ece_ci_uses_the_same_resamples_as_bootstrap_ci_over_ece(m, n, n_bins):
    probs, labels, conf, correct = _top_label_pairs(m, n, seed=m)

    def pooled_ece(idx):
        return ece(probs[:, idx].reshape(-1, 4), labels[idx].repeat(m), n_bins=n_bins, kind="top-label")

    fast = bootstrap_ece_ci(
        conf.squeeze(0) if m == 1 else conf,
        correct.squeeze(0) if m == 1 else correct,
        n_bins=n_bins,
        n_boot=200,
        seed=5,
    )
    slow = bootstrap_ci(pooled_ece, n, n_boot=200, seed=5)
    assert fast[0] == slow[0]  # the estimate is exactly shiftguard.metrics.ece on the pooled pairs
    assert fast == pytest.approx(slow, abs=1e-12)


def test_bootstrap_ece_ci_bins_a_confidence_of_one_into_the_last_bin_like_ece():
    probs = torch.tensor([[1.0, 0.0], [0.3, 0.7], [0.5, 0.5], [0.96, 0.04]], dtype=torch.float64)
    labels = torch.tensor([0, 0, 1, 0])
    conf, pred = probs.max(1)
    est, _, _ = bootstrap_ece_ci(conf, pred == labels, n_bins=10, n_boot=10)
    # bins: {1.0, 0.96} -> |2 - 1.96|;  {0.7} -> |0 - 0.7|;  {0.5} -> |0 - 0.5| (arg-max 0 is wrong)
    assert est == pytest.approx((0.04 + 0.7 + 0.5) / 4, abs=1e-15)
    assert est == ece(probs, labels, n_bins=10)


def test_bootstrap_interval_contains_the_estimate_and_shrinks_with_n():
    g = torch.Generator().manual_seed(6)
    widths = []
    for n in (100, 10_000):
        v = (torch.rand(n, generator=g) < 0.3).double()
        est, lo, hi = bootstrap_mean_ci(v, n_boot=500)
        assert lo <= est <= hi
        widths.append(hi - lo)
        # the percentile interval of a mean is close to the normal one, 2 * 1.96 * sd / sqrt(n)
        p = float(v.mean())
        assert hi - lo == pytest.approx(2 * 1.96 * math.sqrt(p * (1 - p) / n), rel=0.15)
    assert widths[1] < widths[0] / 5


def test_bootstrap_is_seeded_and_independent_of_the_global_rng():
    v = torch.rand(2, 200, generator=torch.Generator().manual_seed(7))
    torch.manual_seed(1)
    state = torch.get_rng_state()
    a = bootstrap_mean_ci(v, seed=42)
    b = bootstrap_ece_ci(v, v > 0.5, seed=42)
    assert torch.equal(torch.get_rng_state(), state)  # the global generator is not advanced
    torch.manual_seed(2)
    assert bootstrap_mean_ci(v, seed=42) == a
    assert bootstrap_ece_ci(v, v > 0.5, seed=42) == b
    assert bootstrap_mean_ci(v, seed=43) != a


@pytest.mark.parametrize(
    "call, pattern",
    [
        (lambda: bootstrap_mean_ci(torch.rand(2, 3, 4)), "values: expected 1 or 2 dimensions"),
        (lambda: bootstrap_mean_ci(torch.tensor([0.5, float("nan")])), "values: contains non-finite"),
        (lambda: bootstrap_mean_ci(torch.zeros(0)), "values: expected a non-empty"),
        (lambda: bootstrap_mean_ci(torch.rand(5), level=1.0), "level: expected a number strictly between"),
        (lambda: bootstrap_mean_ci(torch.rand(5), n_boot=0), "n_boot: expected a positive"),
        (lambda: bootstrap_mean_ci(torch.rand(5), seed=1.5), "seed: expected an int"),
        (lambda: bootstrap_ece_ci(torch.tensor([0.5, 1.2]), torch.tensor([1, 0])), r"confidence: values must lie"),
        (lambda: bootstrap_ece_ci(torch.tensor([0.5, 0.7]), torch.tensor([1, 2])), "correct: expected booleans"),
        (lambda: bootstrap_ece_ci(torch.rand(2, 5), torch.ones(5)), "correct: expected the shape of confidence"),
        (lambda: bootstrap_ece_ci(torch.tensor([1, 0]), torch.tensor([1, 0])), "confidence: expected a floating"),
        (lambda: bootstrap_ece_ci(torch.rand(5), torch.ones(5), n_bins=0), "n_bins: expected a positive"),
        (
            lambda: bootstrap_ci(lambda idx: float("nan") if len(set(idx.tolist())) < 4 else 0.0, 4),
            r"statistic: returned nan on resample \d+",
        ),
        (lambda: bootstrap_ci(lambda idx: "x", 4), "statistic: returned str on the full sample"),
        (lambda: bootstrap_ci(1.0, 4), "statistic: expected a callable"),
        (lambda: bootstrap_ci(lambda idx: 0.0, 0), "n: expected a positive"),
    ],
)
def test_bootstrap_rejects_bad_input_naming_the_argument(call, pattern):
    with pytest.raises((ValueError, TypeError), match=pattern):
        call()
