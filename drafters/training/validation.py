"""Held-out early stopping: the trainer's loss and metrics on sequences the loop never trains on.

With ``TrainConfig.val_sequences`` > 0 the loop trains on all but that many whole sequences of
its dataset (a seeded draw, :meth:`FeatureDataset.split`). Every ``val_every`` steps it measures
the trainer's own loss and metrics on fixed windows of the held-out sequences (cut once, scored
without gradient under a fixed RNG seed, so two evaluations differ only by the module). The
best module so far by ``val_metric`` (the loss, lowest; or a metric the trainer logs, such as
the block trainer's ``tau@8``, highest with ``val_goal="max"``; the starting module included)
is written to ``best.pt``; the export writes that module, not the last one, since a small
dataset is memorised long before the last step. ``patience`` evaluations without a new best
stop the run.

Shapes: B batch, S sequence length.
"""
from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from refspec.drafters.training.data import Batch, FeatureDataset, TrainingError
from refspec.drafters.training.trainers import held_out_metrics

BEST = "best.pt"


@dataclasses.dataclass
class Best:
    """The best held-out evaluation so far (part of every checkpoint, so a resume keeps it).

    Attributes:
        value: its held-out ``val_metric`` (None before the first evaluation).
        step: the optimizer step it was measured after.
        stale: evaluations since it was set.
    """

    value: float | None = None
    step: int = 0
    stale: int = 0


class HeldOut:
    """Fixed held-out windows, their evaluation and the best module's file."""

    def __init__(self, dataset: FeatureDataset, *, batch_size: int, seq_len: int, batches: int, seed: int,
                 path: Path, identity: str, metric: str = "loss", goal: str = "min"):
        gen = torch.Generator().manual_seed(seed + 1)  # not the training sampler's stream
        self.batches: list[Batch] = [dataset.sample_batch(batch_size, seq_len, gen) for _ in range(batches)]
        self.weights = [int((b.loss_mask & b.valid).sum()) for b in self.batches]  # trained positions per batch
        if not sum(self.weights):
            raise TrainingError(f"the {dataset.num_sequences} held-out sequences hold no trained position in "
                                f"{batches} windows; hold out more sequences")
        self.num_sequences = dataset.num_sequences
        self.seed, self.path, self.identity = seed, Path(path), identity
        self.metric, self.goal = metric, goal
        self.last_step = -1

    def evaluate(self, trainer, module: nn.Module, target, autocast: torch.dtype | None) -> dict[str, float]:
        """``val_loss`` and ``val_<metric>`` of the trainer, averaged over the held-out windows'
        trained positions (a batch's mean weighted by its count)."""
        device = next(target.parameters()).device.type
        was_training = module.training
        module.eval()
        totals: dict[str, float] = {}
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            for batch, weight in zip(self.batches, self.weights):
                if not weight:
                    continue
                with torch.autocast(device, dtype=autocast, enabled=autocast is not None):
                    loss, metrics = trainer.loss(module, batch, target)
                    metrics = {**metrics, **held_out_metrics(trainer, module, batch, target)}
                for key, value in {"loss": float(loss), **metrics}.items():
                    totals[key] = totals.get(key, 0.0) + weight * float(value)
        module.train(was_training)
        return {f"val_{k}": v / sum(self.weights) for k, v in totals.items()}

    def observe(self, best: Best, step: int, scores: dict[str, float], module: nn.Module) -> bool:
        """Count the evaluation ``scores`` at ``step``; a new best is saved to :attr:`path`. True when it is one."""
        key = f"val_{self.metric}"
        if key not in scores:
            raise TrainingError(f"val_metric {self.metric!r} is not among what the trainer reports: "
                                f"{sorted(k[4:] for k in scores)}")
        value = scores[key]
        self.last_step = step
        if not math.isfinite(value) or (best.value is not None and
                                        not (value < best.value if self.goal == "min" else value > best.value)):
            best.stale += 1
            return False
        best.value, best.step, best.stale = value, step, 0
        tmp = self.path.with_name(self.path.name + ".tmp")
        torch.save({"identity": self.identity, "step": step, "scores": scores, "module": module.state_dict()}, tmp)
        os.replace(tmp, self.path)
        return True

    def restore_best(self, best: Best, module: nn.Module) -> None:
        """Load the best module of this run into ``module`` (no-op before any evaluation)."""
        if not self.path.exists() or best.value is None:
            return
        state = torch.load(self.path, map_location="cpu", weights_only=True)
        if state["identity"] != self.identity or state["step"] != best.step:
            raise TrainingError(f"{self.path} holds step {state['step']} of another run, not this run's best "
                                f"(step {best.step}); it was overwritten: train again")
        module.load_state_dict(state["module"])

    def provenance(self, best: Best, val_every: int) -> dict[str, Any]:
        return {"sequences": self.num_sequences, "windows": sum(b.tokens.shape[0] for b in self.batches),
                "trained_positions": sum(self.weights), "val_every": val_every, "metric": self.metric,
                "goal": self.goal, "best_step": best.step, "best_value": round(best.value, 5)}
