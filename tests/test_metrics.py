"""Classification and calibration metrics against slow references and torchmetrics."""

import numpy as np
import pytest
import torch

from shiftguard.metrics import accuracy, brier, ece, nll, reliability_diagram


def random_probs(n=500, c=6, seed=0, sharp=3.0):
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(sharp * torch.randn(n, c, generator=g, dtype=torch.float64), 1)
    labels = torch.multinomial(probs**0.7 / (probs**0.7).sum(1, keepdim=True), 1, generator=g).squeeze(1)
    return probs, labels


def test_accuracy_nll_brier_match_their_definitions():
    p, y = random_probs()
    n = len(y)
    assert accuracy(p, y) == pytest.approx(sum(int(p[i].argmax() == y[i]) for i in range(n)) / n)
    assert nll(p, y) == pytest.approx(-sum(float(torch.log(p[i, y[i]])) for i in range(n)) / n)
    ref_brier = sum(float(((p[i] - torch.eye(6, dtype=p.dtype)[y[i]]) ** 2).sum()) for i in range(n)) / n
    assert brier(p, y) == pytest.approx(ref_brier)


def reference_ce_1d(scores, hits, edges_upper, p=1):
    """Loop reference: assign each score to the first upper edge it does not exceed (width bins
    use [lo, hi) intervals, so the edge test is `<` except for the last bin)."""
    scores, hits = np.asarray(scores, float), np.asarray(hits, float)
    nb = len(edges_upper)
    total = 0.0
    for b in range(nb):
        lo = 0.0 if b == 0 else edges_upper[b - 1]
        hi = edges_upper[b]
        mask = (scores >= lo) & ((scores < hi) if b < nb - 1 else (scores <= hi))
        if mask.any():
            total += mask.mean() * abs(hits[mask].mean() - scores[mask].mean()) ** p
    return total ** (1 / p)


def test_top_label_ece_matches_a_loop_reference_with_equal_width_bins():
    p, y = random_probs()
    conf, pred = p.max(1)
    ref = reference_ce_1d(conf, pred == y, np.linspace(0, 1, 16)[1:])
    assert ece(p, y, n_bins=15) == pytest.approx(ref, abs=1e-12)


@pytest.mark.parametrize("n_bins", [5, 15, 30])
def test_top_label_ece_equals_torchmetrics(n_bins):
    tm = pytest.importorskip("torchmetrics")
    p, y = random_probs(n=2000, c=10, seed=3)
    metric = tm.classification.MulticlassCalibrationError(num_classes=10, n_bins=n_bins, norm="l1")
    assert ece(p, y, n_bins=n_bins) == pytest.approx(float(metric(p, y)), abs=1e-6)


def kumar_equal_mass_bins(probs, num_bins):
    """Transcription of the definition of get_equal_bins in Kumar et al.'s calibration library."""
    sorted_probs = sorted(probs)
    num_bins = min(num_bins, len(sorted_probs))
    groups = np.array_split(np.array(sorted_probs), num_bins)
    bins = [(groups[i][-1] + groups[i + 1][0]) / 2.0 for i in range(len(groups) - 1)] + [1.0]
    return sorted(set(bins))


def kumar_ce_1d(scores, hits, bins, p=1):
    scores, hits = np.asarray(scores, float), np.asarray(hits, float)
    idx = np.searchsorted(bins, scores)
    total = 0.0
    for b in range(len(bins)):
        m = idx == b
        if m.any():
            total += m.mean() * abs(hits[m].mean() - scores[m].mean()) ** p
    return total ** (1 / p)


def test_equal_mass_binning_follows_kumar_et_al():
    p, y = random_probs(n=333)
    conf, pred = p.max(1)
    bins = kumar_equal_mass_bins(conf.tolist(), 10)
    ref = kumar_ce_1d(conf, pred == y, bins)
    assert ece(p, y, n_bins=10, binning="mass") == pytest.approx(ref, abs=1e-12)


def test_marginal_ece_is_the_mean_of_classwise_binary_errors():
    p, y = random_probs(n=400, c=4)
    per_class = [reference_ce_1d(p[:, c], y == c, np.linspace(0, 1, 16)[1:]) for c in range(4)]
    assert ece(p, y, kind="marginal") == pytest.approx(np.mean(per_class), abs=1e-12)
    per_class2 = [reference_ce_1d(p[:, c], y == c, np.linspace(0, 1, 16)[1:], p=2) ** 2 for c in range(4)]
    assert ece(p, y, kind="marginal", p=2) == pytest.approx(np.sqrt(np.mean(per_class2)), abs=1e-12)


@pytest.mark.parametrize("p_norm, debiased", [(1, False), (2, False), (2, True)])
def test_marginal_ece_of_all_classes_at_once_equals_each_class_on_its_own_also_on_bin_edges(p_norm, debiased):
    from shiftguard.metrics.calibration import calibration_error_1d

    g = torch.Generator().manual_seed(3)
    # scores on the 15 bin edges exactly (multiples of 1/15) and between them
    p = torch.randint(0, 16, (240, 5), generator=g).double() / 15
    p[120:] = torch.rand(120, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 5, (240,), generator=g)
    onehot = torch.nn.functional.one_hot(y, 5).bool()
    each = [calibration_error_1d(p[:, c], onehot[:, c], 15, "width", p_norm, debiased) ** p_norm for c in range(5)]
    assert ece(p, y, kind="marginal", one_vs_rest=True, p=p_norm, debiased=debiased) == pytest.approx(
        np.mean(each) ** (1 / p_norm), rel=1e-12, abs=1e-15
    )


def test_one_vs_rest_ece_uses_per_class_probabilities_without_renormalising():
    """[QACT, Sec. 3-4]: the quantile classifier's one-vs-rest probabilities are calibrated as they are."""
    g = torch.Generator().manual_seed(7)
    p = torch.rand(300, 5, generator=g, dtype=torch.float64)  # rows do not sum to 1
    y = torch.randint(0, 5, (300,), generator=g)
    edges = np.linspace(0, 1, 16)[1:]
    conf, pred = p.max(1)
    assert ece(p, y, one_vs_rest=True) == pytest.approx(reference_ce_1d(conf, pred == y, edges), abs=1e-12)
    per_class = [reference_ce_1d(p[:, c], y == c, edges) for c in range(5)]
    assert ece(p, y, kind="marginal", one_vs_rest=True) == pytest.approx(np.mean(per_class), abs=1e-12)
    with pytest.raises(ValueError, match="rows must sum to 1"):
        ece(p, y)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        ece(p + 1.0, y, one_vs_rest=True)


def test_debiased_l2_error_subtracts_the_binomial_variance():
    p, y = random_probs(n=300)
    conf, pred = p.max(1)
    hits = (pred == y).double().numpy()
    c = conf.numpy()
    idx = np.clip(np.searchsorted(np.linspace(0, 1, 16), c, side="right") - 1, 0, 14)
    total = 0.0
    for b in range(15):
        m = idx == b
        if m.sum() >= 2:
            a = hits[m].mean()
            total += m.mean() * ((a - c[m].mean()) ** 2 - a * (1 - a) / (m.sum() - 1))
    assert ece(p, y, p=2, debiased=True) == pytest.approx(np.sqrt(max(total, 0.0)), abs=1e-12)


def test_perfectly_calibrated_synthetic_predictions_have_small_ece():
    g = torch.Generator().manual_seed(0)
    conf = 0.5 + 0.5 * torch.rand(200000, generator=g, dtype=torch.float64)
    correct = torch.rand(200000, generator=g, dtype=torch.float64) < conf
    probs = torch.stack([conf, 1 - conf], 1)
    labels = torch.where(correct, 0, 1)
    assert ece(probs, labels) < 0.005
    assert ece(probs, labels, binning="mass") < 0.005


def test_ece_is_the_error_rate_for_always_confident_predictions():
    y = torch.tensor([0, 1, 1, 0, 2])
    probs = torch.nn.functional.one_hot(torch.tensor([0, 1, 0, 0, 1]), 3).double()
    assert ece(probs, y) == pytest.approx(0.4)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(probs=torch.rand(4, 3), labels=torch.zeros(4, dtype=torch.long)), "rows must sum"),
        (dict(probs=torch.full((4, 2), 0.5), labels=torch.tensor([0, 1, 2, 0])), "labels"),
        (dict(probs=torch.full((4, 2), 0.5), labels=torch.tensor([0, 1, 0])), "mismatched"),
        (dict(probs=torch.full((4, 2), 0.5), labels=torch.zeros(4, dtype=torch.long), kind="classwise"), "kind"),
        (dict(probs=torch.full((4, 2), 0.5), labels=torch.zeros(4, dtype=torch.long), binning="log"), "binning"),
        (dict(probs=torch.full((4, 2), 0.5), labels=torch.zeros(4, dtype=torch.long), debiased=True), "debiased"),
        (dict(probs=torch.full((0, 2), 0.5), labels=torch.zeros(0, dtype=torch.long)), "probs"),
    ],
)
def test_ece_bad_input_raises_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ece(**kwargs)


def test_reliability_diagram_returns_bin_data_and_writes_a_png(tmp_path):
    p, y = random_probs(n=1000)
    out = tmp_path / "rel.png"
    data = reliability_diagram(p, y, n_bins=10, path=out, title="test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert data.bin_edges.shape == (11,) and data.counts.sum() == 1000
    filled = data.counts > 0
    conf, pred = p.max(1)
    b = 7
    m = (conf >= 0.7) & (conf < 0.8)
    assert data.counts[b] == m.sum()
    assert data.accuracy[b] == pytest.approx(float((pred[m] == y[m]).double().mean()))
    assert torch.isnan(data.accuracy[~filled]).all()
    assert data.ece == pytest.approx(ece(p, y, n_bins=10))
    assert set(data.as_dict()) == {"bin_edges", "confidence", "accuracy", "counts", "ece"}


def test_reliability_diagram_without_path_draws_nothing(tmp_path):
    p, y = random_probs(n=50)
    reliability_diagram(p, y)
    assert list(tmp_path.iterdir()) == []
