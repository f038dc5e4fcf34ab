"""Held-out early stopping: the trainer's loss on sequences the loop never trains on.

With ``TrainConfig.val_sequences`` > 0 the loop trains on all but that many whole sequences of
its dataset (a seeded draw, :meth:`FeatureDataset.split`). Every ``val_every`` steps it measures
the trainer's own loss and metrics on fixed windows of the held-out sequences (cut once, scored
without gradient under a fixed RNG seed, so two evaluations differ only by the module). The
module with the lowest held-out loss so far (the starting one included) is written to
``best.pt``; the export writes that module, not the last one, since a small dataset is
memorised long before the last step.
``patience`` evaluations without a new best stop the run.

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

BEST = "best.pt"


@dataclasses.dataclass
class Best:
    """The best held-out evaluation so far (part of every checkpoint, so a resume keeps it).

    Attributes:
        loss: its held-out loss (inf before the first evaluation).
        step: the optimizer step it was measured after.
        stale: evaluations since it was set.
    """

    loss: float = math.inf
    step: int = 0
    stale: int = 0


class HeldOut:
    """Fixed held-out windows, their evaluation and the best module's file."""

    def __init__(self, dataset: FeatureDataset, *, batch_size: int, seq_len: int, batches: int, seed: int,
                 path: Path, identity: str):
        gen = torch.Generator().manual_seed(seed + 1)  # not the training sampler's stream
        self.batches: list[Batch] = [dataset.sample_batch(batch_size, seq_len, gen) for _ in range(batches)]
        self.weights = [int((b.loss_mask & b.valid).sum()) for b in self.batches]  # trained positions per batch
        if not sum(self.weights):
            raise TrainingError(f"the {dataset.num_sequences} held-out sequences hold no trained position in "
                                f"{batches} windows; hold out more sequences")
        self.num_sequences = dataset.num_sequences
        self.seed, self.path, self.identity = seed, Path(path), identity
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
                for key, value in {"loss": float(loss), **metrics}.items():
                    totals[key] = totals.get(key, 0.0) + weight * float(value)
        module.train(was_training)
        return {f"val_{k}": v / sum(self.weights) for k, v in totals.items()}

    def observe(self, best: Best, step: int, val_loss: float, module: nn.Module) -> bool:
        """Count an evaluation at ``step``; a new best is saved to :attr:`path`. True when it is one."""
        self.last_step = step
        if not val_loss < best.loss:
            best.stale += 1
            return False
        best.loss, best.step, best.stale = val_loss, step, 0
        tmp = self.path.with_name(self.path.name + ".tmp")
        torch.save({"identity": self.identity, "step": step, "val_loss": val_loss, "module": module.state_dict()}, tmp)
        os.replace(tmp, self.path)
        return True

    def restore_best(self, best: Best, module: nn.Module) -> None:
        """Load the best module of this run into ``module`` (no-op before any evaluation)."""
        if not self.path.exists() or math.isinf(best.loss):
            return
        state = torch.load(self.path, map_location="cpu", weights_only=True)
        if state["identity"] != self.identity or state["step"] != best.step:
            raise TrainingError(f"{self.path} holds step {state['step']} of another run, not this run's best "
                                f"(step {best.step}); it was overwritten: train again")
        module.load_state_dict(state["module"])

    def provenance(self, best: Best, val_every: int) -> dict[str, Any]:
        return {"sequences": self.num_sequences, "windows": sum(b.tokens.shape[0] for b in self.batches),
                "trained_positions": sum(self.weights),
                "val_every": val_every, "best_step": best.step, "best_val_loss": round(best.loss, 5)}
