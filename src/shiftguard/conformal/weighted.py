"""Weighted split conformal prediction under covariate shift (Tibshirani, Barber, Candes & Ramdas,
"Conformal Prediction Under Covariate Shift", NeurIPS 2019).

When the test inputs come from another distribution than the calibration inputs but the labels'
conditional law is the same, the calibration scores are reweighted by the likelihood ratio
``w(x) = dP_test(x) / dP_cal(x)``. For a test input ``x`` the threshold is the ``1 - alpha``
quantile of the weighted distribution that puts mass ``w(x_i) / (sum_j w(x_j) + w(x))`` on each
calibration score ``s_i`` and the remaining mass ``w(x) / (sum_j w(x_j) + w(x))`` -- the test
point's own weight -- on ``+inf`` (their Sec. 2, Cor. 1): every test input has its own threshold,
and one whose weight dominates gets the full label set.

The likelihood ratio is estimated with a probabilistic classifier that tells calibration inputs
(label 0) from the test inputs (label 1) (their Sec. 2.3): ``w(x) = P(1 | x) / P(0 | x) * n_cal /
n_test``, here a logistic regression (scikit-learn, L2 penalty ``C = 1``) on standardised features
-- in shiftguard the embeddings (or logits) of the clean calibration set and of the evaluated cell.
Estimating it from the unlabelled test cell makes the method **transductive**: each cell's sets
depend on the other inputs of that cell. The estimated ratio is used as it is, never clipped; under
a strong shift most test inputs get the full set, which is what the guarantee then asks for.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from shiftguard._validation import check_tensor

from .split import TOLERANCE, SplitConformal

__all__ = ["WeightedSplitConformal", "likelihood_ratio_weights", "weighted_thresholds"]


def likelihood_ratio_weights(cal_features, test_features, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w_cal (n,), w_test (m,))``: the estimated ``dP_test / dP_cal`` at every calibration and
    test input, from a logistic regression telling the two sets apart (module docstring).

    The regression is scikit-learn's, on the host: the features are copied there and the weights
    returned on ``cal_features``' device."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    a = check_tensor(cal_features, "cal_features", ndim=2, floating=True, finite=True, nonempty=True)
    b = check_tensor(test_features, "test_features", ndim=2, floating=True, finite=True, nonempty=True)
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"test_features: {b.shape[1]} features, cal_features {a.shape[1]}")
    x = np.concatenate([a.detach().double().cpu().numpy(), b.detach().double().cpu().numpy()])
    d = np.concatenate([np.zeros(a.shape[0]), np.ones(b.shape[0])])
    x = StandardScaler().fit_transform(x)
    clf = LogisticRegression(C=1.0, max_iter=1000, random_state=seed).fit(x, d)
    logit = clf.decision_function(x)  # log P(1 | x) / P(0 | x)
    w = np.exp(logit + math.log(a.shape[0] / b.shape[0]))
    w_cal = torch.as_tensor(w[: a.shape[0]], dtype=torch.float64).to(a.device)
    w_test = torch.as_tensor(w[a.shape[0] :], dtype=torch.float64).to(a.device)
    return w_cal, w_test


def weighted_thresholds(
    cal_scores: torch.Tensor, cal_weights: torch.Tensor, test_weights: torch.Tensor, alpha: float
) -> torch.Tensor:
    """``(m,)`` thresholds: for each test weight ``w``, the smallest calibration score at which the
    normalised cumulative weight (with ``w`` on ``+inf``) reaches ``1 - alpha``; ``+inf`` when the
    calibration scores never reach it."""
    order = torch.argsort(cal_scores.double())
    s = cal_scores.double()[order]
    cum = torch.cumsum(cal_weights.double()[order], 0)
    total = cum[-1] + test_weights.double()
    target = (1.0 - alpha) * total
    idx = torch.searchsorted(cum, target * (1 - 1e-12))  # first k with cum[k] >= target (rounding kept in)
    out = torch.full(test_weights.shape, math.inf, dtype=torch.float64, device=test_weights.device)
    ok = idx < s.numel()
    out[ok] = s[idx[ok]]
    return out


class WeightedSplitConformal(SplitConformal):
    """:class:`SplitConformal` whose threshold is reweighted for covariate shift per test input
    (module docstring). Arguments as :class:`SplitConformal` (``mondrian`` not supported).

    ``fit(cal_probs, cal_labels)`` computes the calibration scores; ``predict_sets(probs,
    cal_weights=, test_weights=)`` takes the likelihood ratios of the calibration and test inputs
    (e.g. from :func:`likelihood_ratio_weights`), or ``cal_features=`` and ``test_features=`` to
    estimate them. ``last_thresholds_`` holds the thresholds of the last call.
    """

    def __init__(self, method: str = "lac", alpha: float = 0.1, **kwargs):
        if kwargs.get("mondrian"):
            raise ValueError("mondrian: the weighted variant has one threshold per test input, not per class")
        super().__init__(method, alpha, **kwargs)

    def predict_sets(
        self, probs, uniform=None, *, cal_weights=None, test_weights=None, cal_features=None, test_features=None
    ) -> torch.Tensor:
        s = self.test_scores(probs, uniform)
        if (cal_weights is None) != (test_weights is None):
            raise ValueError("cal_weights, test_weights: give both or neither")
        if cal_weights is None:
            if cal_features is None or test_features is None:
                raise ValueError(
                    "cal_features, test_features: needed to estimate the likelihood ratio when no weights are given"
                )
            cal = check_tensor(cal_features, "cal_features", ndim=2)
            if cal.shape[0] != self.n_fit_:
                raise ValueError(
                    f"cal_features: {cal.shape[0]} rows; expected the features of the {self.n_fit_} "
                    "calibration examples given to fit"
                )
            cal_weights, test_weights = likelihood_ratio_weights(
                cal[self.kept_.to(cal.device)], test_features, seed=self.seed
            )
        cw = check_tensor(cal_weights, "cal_weights", ndim=1, finite=True).double()
        tw = check_tensor(test_weights, "test_weights", ndim=1, finite=True).double()
        if cw.shape[0] != self.n_calibration_:
            raise ValueError(
                f"cal_weights: {cw.shape[0]} weights for {self.n_calibration_} calibration examples "
                "(RAPS's tuning rows are not calibration examples)"
            )
        if tw.shape[0] != s.shape[0]:
            raise ValueError(f"test_weights: {tw.shape[0]} weights for {s.shape[0]} test inputs")
        if bool((cw < 0).any()) or bool((tw < 0).any()):
            raise ValueError("cal_weights, test_weights: likelihood ratios must be >= 0")
        q = weighted_thresholds(self.scores_, cw, tw, self.alpha)
        self.last_thresholds_ = q
        return s <= q.to(s.device)[:, None] + TOLERANCE
