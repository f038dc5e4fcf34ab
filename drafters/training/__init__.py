"""Drafter training: self-distilled data from the frozen target, the trainer protocol and loop, trainers.

Reading order: :mod:`~refspec.drafters.training.data` (sequences, target features, batches),
:mod:`~refspec.drafters.training.trainers` (the trainer protocol and registry),
:mod:`~refspec.drafters.training.loop` (the loop), :mod:`~refspec.drafters.training.validation`
(held-out early stopping),
:mod:`~refspec.drafters.training.eagle` and :mod:`~refspec.drafters.training.block` (one trainer
each). The command line is ``python -m refspec.eval train``.
"""
from refspec.drafters.training.data import (Batch, FeatureDataset, TrainingError, TrainingSequence, collect_features,
                                            self_distill)
from refspec.drafters.training.loop import (CHECKPOINT, TRAIN_LOG, TRAINERS, Trainer, TrainConfig, TrainResult,
                                            load_trainers, register_trainer, train)

__all__ = ["Batch", "FeatureDataset", "TrainingError", "TrainingSequence", "collect_features", "self_distill",
           "CHECKPOINT", "TRAIN_LOG", "TRAINERS", "Trainer", "TrainConfig", "TrainResult", "load_trainers",
           "register_trainer", "train"]
