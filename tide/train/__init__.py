"""Draft training from stored hidden states (DeepSpeed)."""

from tide.train.trainer import CycleResult, DraftTrainer

__all__ = ["CycleResult", "DraftTrainer"]
