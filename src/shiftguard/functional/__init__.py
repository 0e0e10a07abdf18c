"""Pure tensor functions (no state, no data, no training).

- :mod:`shiftguard.functional.quantile` -- quantile activation QACT [QACT, Alg. 1-2]
- :mod:`shiftguard.functional.kde` -- weighted Gaussian KDE for the QACT backward
"""

from shiftguard.functional.kde import gaussian_kde, gaussian_kde_grid, kde_grid_error_bound, silverman_bandwidth
from shiftguard.functional.quantile import (
    QACTStatistics,
    channel_values,
    default_statistics,
    grounding_weights,
    qact_apply,
    qact_statistics,
    quantile_activation,
    quantile_levels,
    weighted_quantiles,
)

__all__ = [
    "QACTStatistics",
    "channel_values",
    "default_statistics",
    "grounding_weights",
    "qact_apply",
    "qact_statistics",
    "quantile_activation",
    "quantile_levels",
    "weighted_quantiles",
    "gaussian_kde",
    "gaussian_kde_grid",
    "kde_grid_error_bound",
    "silverman_bandwidth",
]

from shiftguard.functional.vmf import (  # vMF utilities [Kirchhof, Ch. 2 / App. A]
    log_vmf_normalizer,
    sample_vmf,
    vmf_log_prob,
    vmf_mean_resultant_length,
)

__all__ += ["log_vmf_normalizer", "sample_vmf", "vmf_log_prob", "vmf_mean_resultant_length"]

from shiftguard.functional.warmup import warm_up  # noqa: E402  (compile the QACT kernels ahead of use)

__all__ += ["warm_up"]
