"""The trainer protocol and registry: what the training loop needs from each kind of drafter.

A drafter's training module (``training.eagle``, ``training.block``) defines
``register_trainers(register)`` and calls ``register(Trainer(...))``; :func:`load_trainers`
imports those modules and calls their hooks, so ``python -m refspec.eval train --drafter NAME``
dispatches without the CLI knowing any drafter.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from refspec.drafters.training.data import Batch, FeatureDataset


class Trainer(Protocol):
    """What the training loop needs from one kind of drafter.

    Attributes:
        name: drafter name (``eagle``, ``eagle3``, ``block``), as on the command line.
        description: one line for ``--help``.
        defaults: :class:`TrainConfig` field overrides suited to this drafter (e.g. ``lr``).
    """

    name: str
    description: str
    defaults: dict[str, Any]

    def feature_layers(self, target, options: dict[str, Any] | None = None) -> tuple[int, ...]:
        """Target layers whose hidden states the drafter trains on (under the trainer ``options``)."""

    def build(self, target, dataset: FeatureDataset, options: dict[str, Any]) -> nn.Module:
        """A fresh trainable module (deterministic given its inputs: resume rebuilds it)."""

    def loss(self, module: nn.Module, batch: Batch, target) -> tuple[torch.Tensor, dict[str, float]]:
        """Scalar loss of one batch and named metrics (floats) to log."""

    # Optional: ``held_out_metrics(module, batch, target) -> dict[str, float]``: metrics too dear for
    # every training step, which the held-out evaluation adds to the loss's own (:func:`held_out_metrics`).

    def export(self, module: nn.Module, out_dir: Path, provenance: dict[str, Any]) -> Path:
        """Write the trained drafter where its builder finds it; returns the path written."""


def held_out_metrics(trainer: Trainer, module: nn.Module, batch: Batch, target) -> dict[str, float]:
    """The trainer's held-out-only metrics of one batch; none where it defines no such hook."""
    hook = getattr(trainer, "held_out_metrics", None)
    return hook(module, batch, target) if hook is not None else {}


TRAINERS: dict[str, Trainer] = {}
"""Registered trainers by drafter name (fill with :func:`load_trainers`)."""

_TRAINER_MODULES = ("training.eagle", "training.block")
_trainers_loaded = False


def register_trainer(trainer: Trainer) -> None:
    """Add a trainer to :data:`TRAINERS` (a later registration of a name replaces it)."""
    TRAINERS[trainer.name] = trainer


def load_trainers() -> dict[str, Trainer]:
    """Import the drafter modules that train and call their ``register_trainers`` hooks."""
    global _trainers_loaded
    if not _trainers_loaded:
        _trainers_loaded = True
        from refspec.drafters.registry import call_hooks

        call_hooks(_TRAINER_MODULES, "register_trainers", register_trainer)
    return TRAINERS
