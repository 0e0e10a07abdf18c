"""shiftguard: classifiers and embedding models that stay accurate and honestly confident
under distribution shift.

Subpackages (each concept lives in the module named after it):

- ``shiftguard.functional``  pure tensor functions (quantile activation, weighted quantiles, KDE, vMF)
- ``shiftguard.nn``          ``nn.Module`` wrappers: QuantileActivation, QACTBlock, QuantileClassifier
- ``shiftguard.data``        dataset loaders, the embedded MNIST default, toy generators
- ``shiftguard.corruptions`` MNIST-C / CIFAR-10-C style corruption engine
- ``shiftguard.models``      LeNet, ResNet-18, VGG, DenseNet, MLP with swappable activations
- ``shiftguard.losses``      watershed, distance-ratio, RS@k, probabilistic-embedding losses
- ``shiftguard.heads``       NED, kNN family, temperature scaling, logistic refit
- ``shiftguard.uncertainty`` uncertainty scores, loss-prediction head
- ``shiftguard.metrics``     calibration, retrieval and uncertainty metrics
- ``shiftguard.train``       trainer, checkpoints, multistage large-batch step, distributed helpers
- ``shiftguard.evaluation``  ``evaluate(model, test, ...)``: any model, any data, under shift
- ``shiftguard.commands`` the ``shiftguard run`` / ``evaluate`` / ``report`` commands

``shiftguard.evaluate`` and ``shiftguard.EvaluationResult`` are imported on first use, so that
``import shiftguard`` stays light.
"""

from shiftguard._version import __version__

__all__ = ["evaluate", "EvaluationResult", "__version__"]


def __getattr__(name: str):
    if name in ("evaluate", "EvaluationResult"):
        from shiftguard import evaluation

        return getattr(evaluation, name)
    raise AttributeError(f"module 'shiftguard' has no attribute {name!r}")
