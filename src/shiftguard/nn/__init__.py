"""``nn.Module`` wrappers over :mod:`shiftguard.functional`.

- :class:`QuantileActivation` -- QACT [QACT, Alg. 1-2], context modes ``"batch"`` / ``"frozen"``
- :class:`QACTBlock` -- BatchNorm -> QACT -> BatchNorm [QACT, Remark after Alg. 2]
- :class:`BNActBlock`, :func:`twin_activation` -- BatchNorm -> ReLU/PReLU/SELU -> BatchNorm, the
  BatchNorm twin of the QACT block (``bn-relu-bn``, ``bn-prelu-bn``, ``bn-selu-bn``; docs/qact.md)
- :func:`make_activation` -- ``relu`` | ``prelu`` | ``selu`` | ``qact`` | ``bn-relu-bn`` |
  ``bn-prelu-bn`` | ``bn-selu-bn`` by name
- :class:`QuantileClassifier` -- Linear -> QACT -> one-vs-rest probabilities [QACT, Sec. 3]
- :class:`SyncQuantileActivation`, :func:`convert_sync_qact` -- QACT whose context is the global
  batch of a torch.distributed job (docs/distributed.md)
- :class:`MaxPool2d`, :class:`AdaptiveAvgPool2d` -- torch's pooling modules with faster paths
  where the result is the same (2 x 2 max pooling on the CPU; an adaptive pool to the input's size)
- :func:`convert_activations` -- put QACT (or relu/prelu/selu, or a BatchNorm twin ``bn-relu-bn``, ...)
  into any model in place of its activation modules; :func:`has_qact`, :func:`set_context`,
  :func:`qact_context`, :func:`fit_context` -- manage the QACT context of a whole model (docs/qact.md)
"""

from shiftguard.nn.convert import (
    DEFAULT_ACTIVATION_TYPES,
    ConvertedActivation,
    convert_activations,
    fit_context,
    has_qact,
    qact_context,
    set_context,
)
from shiftguard.nn.pool import AdaptiveAvgPool2d, MaxPool2d
from shiftguard.nn.qact import (
    ACTIVATION_NAMES,
    BN_BLOCK_ACTIVATIONS,
    CONTEXT_MODES,
    TWIN_BASES,
    BNActBlock,
    QACTBlock,
    QuantileActivation,
    make_activation,
    twin_activation,
)
from shiftguard.nn.quantile_classifier import QuantileClassifier, quantile_classifier_loss
from shiftguard.nn.sync_qact import SyncQuantileActivation, convert_sync_qact

__all__ = [
    "ACTIVATION_NAMES",
    "AdaptiveAvgPool2d",
    "BNActBlock",
    "BN_BLOCK_ACTIVATIONS",
    "CONTEXT_MODES",
    "ConvertedActivation",
    "DEFAULT_ACTIVATION_TYPES",
    "MaxPool2d",
    "QACTBlock",
    "QuantileActivation",
    "QuantileClassifier",
    "SyncQuantileActivation",
    "TWIN_BASES",
    "convert_activations",
    "convert_sync_qact",
    "fit_context",
    "has_qact",
    "make_activation",
    "qact_context",
    "quantile_classifier_loss",
    "set_context",
    "twin_activation",
]
