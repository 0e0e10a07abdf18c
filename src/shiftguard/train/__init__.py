"""Training: the :class:`Trainer` loop ([QACT, App. B] protocol), crash-safe checkpoints,
class-balanced batches and the multistage large-batch step [Patel, Sec. 5.3.2]."""

from . import distributed, samplers
from .checkpoint import CheckpointError, load_checkpoint, load_latest_checkpoint, save_checkpoint
from .distributed import DistributedTrainer, GlobalBatchLoss, distributed_multistage_step
from .multistage import multistage_step
from .samplers import ClassBalancedBatchSampler
from .trainer import Trainer, to_model_input, train_val_split

__all__ = [
    "Trainer",
    "multistage_step",
    "ClassBalancedBatchSampler",
    "samplers",
    "train_val_split",
    "to_model_input",
    "save_checkpoint",
    "load_checkpoint",
    "load_latest_checkpoint",
    "CheckpointError",
    "distributed",
    "DistributedTrainer",
    "GlobalBatchLoss",
    "distributed_multistage_step",
]
