"""Conformal prediction sets from class probabilities, with a coverage guarantee: split conformal
LAC, APS and RAPS (:mod:`.split`, optionally class-conditional), and the weighted split conformal
prediction of Tibshirani et al. (2019) for covariate shift (:mod:`.weighted`). Their metrics
(coverage, set size, size-stratified coverage, class-conditional coverage gap) live in
``shiftguard.metrics``. See ``docs/conformal.md``.
"""

from .split import LAMBDA_GRID, METHODS, TOLERANCE, SplitConformal, conformal_quantile, score_matrix
from .weighted import WeightedSplitConformal, likelihood_ratio_weights, weighted_thresholds

__all__ = [
    "METHODS",
    "LAMBDA_GRID",
    "TOLERANCE",
    "SplitConformal",
    "WeightedSplitConformal",
    "conformal_quantile",
    "likelihood_ratio_weights",
    "score_matrix",
    "weighted_thresholds",
]
