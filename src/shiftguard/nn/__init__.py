"""``nn.Module`` wrappers over :mod:`shiftguard.functional`.

- :class:`QuantileActivation` -- QACT (000, Alg. 1-2), context modes ``"batch"`` / ``"frozen"``
- :class:`QACTBlock` -- BatchNorm -> QACT -> BatchNorm (000, Remark after Alg. 2)
- :func:`make_activation` -- ``relu`` | ``prelu`` | ``selu`` | ``qact`` by name
- :class:`QuantileClassifier` -- Linear -> QACT -> one-vs-rest probabilities (000, Sec. 3)
- :class:`SyncQuantileActivation`, :func:`convert_sync_qact` -- QACT whose context is the global
  batch of a torch.distributed job (docs/distributed.md)
"""

from shiftguard.nn.qact import ACTIVATION_NAMES, CONTEXT_MODES, QACTBlock, QuantileActivation, make_activation
from shiftguard.nn.quantile_classifier import QuantileClassifier, quantile_classifier_loss
from shiftguard.nn.sync_qact import SyncQuantileActivation, convert_sync_qact

__all__ = [
    "ACTIVATION_NAMES",
    "CONTEXT_MODES",
    "QACTBlock",
    "QuantileActivation",
    "QuantileClassifier",
    "SyncQuantileActivation",
    "convert_sync_qact",
    "make_activation",
    "quantile_classifier_loss",
]
