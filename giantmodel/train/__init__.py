"""Training: the trainer loop, optimizer and schedules, precision, loss."""

from giantmodel.train.trainer import Trainer, run_training

__all__ = ["Trainer", "run_training"]
