"""Shared plumbing for training drafters on a frozen target (EAGLE heads, block drafters).

A drafter that learns from the target's hidden states needs the same few pieces, written once
and used by every trainer (steps 1 and 2 live in :mod:`refspec.drafters.training.data` and are
re-exported here):

1. **text -> sequences**: token sequences with a loss mask (which positions' next-token
   predictions count). :func:`self_distill` turns training prompts into the target's own
   greedy responses with :class:`refspec.engine.Engine` (self-distillation: the drafter learns
   what this target says, not what a dataset's authors said).
2. **sequences -> features**: :func:`collect_features` runs the frozen target over the
   sequences once and keeps, per position, the hidden states of the layers a trainer asks for
   and the target's own next-token choice (its argmax, the greedy label). The result is a
   :class:`FeatureDataset` (flat tensors plus offsets) saved as safetensors, so a resumed or
   repeated run does not run the target again.
3. **the loop**: :func:`train` optimises a trainer's module with AdamW, a warm-up + cosine
   schedule and gradient clipping, shows a tqdm progress bar, logs JSON lines, writes a
   checkpoint (module, optimizer, step, RNG states) every ``checkpoint_every`` steps and on
   Ctrl-C, resumes from it, and finally hands the module to the trainer's ``export`` with a
   provenance record (target, data, steps, final loss, wall time).

Trainers (:class:`Trainer`, registered in :data:`TRAINERS`) are described in
:mod:`~refspec.drafters.training.trainers`; held-out early stopping in
:mod:`~refspec.drafters.training.validation`.

Out directory layout (``train(out_dir=...)``): ``checkpoint.pt`` (resume state),
``best.pt`` (the module with the best held-out score, with ``val_sequences``),
``train_log.jsonl`` (one line per logged step or evaluation), ``features.safetensors`` (the dataset cache,
written by the CLI), and whatever the trainer's ``export`` writes (for EAGLE:
``model.safetensors`` + ``config.json``).

Shapes: B batch, S sequence length, E model dim, N total positions in a dataset.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from refspec.drafters.training.data import (  # noqa: F401 - the data half, re-exported
    Batch, FeatureDataset, TrainingError, TrainingSequence, collect_features, self_distill)
from refspec.drafters.training.trainers import (  # noqa: F401 - the registry, re-exported
    TRAINERS, Trainer, load_trainers, register_trainer)
from refspec.drafters.training.validation import BEST, Best, HeldOut

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"
TRAIN_LOG = "train_log.jsonl"
AUTOCAST = {None: None, "bf16": torch.bfloat16}
"""``TrainConfig.autocast`` values and the dtype each runs the forward in."""

# ---- the loop -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Settings of one training run.

    Attributes:
        steps: optimizer steps.
        batch_size: windows per step (B).
        seq_len: positions per window (S).
        lr: peak learning rate (AdamW).
        min_lr_ratio: final learning rate as a fraction of ``lr`` (cosine decay).
        warmup_steps: linear warm-up steps.
        weight_decay: AdamW weight decay.
        grad_clip: global gradient-norm clip (0 disables).
        checkpoint_every: steps between checkpoints (0: only at the end and on Ctrl-C).
        log_every: steps between log lines.
        seed: seeds the module's initialisation and the batch sampler.
        max_time_s: stop early (with a final checkpoint and export) after this much wall time.
        autocast: ``"bf16"`` runs each step's forward and loss under ``torch.autocast`` in bf16
            (parameters, gradients and AdamW stay fp32); None trains in fp32.
        val_sequences: whole sequences held out of training for early stopping (0: none; see
            :mod:`~refspec.drafters.training.validation`).
        val_every: steps between held-out evaluations.
        val_batches: held-out windows, in batches of ``batch_size``.
        val_metric: what picks the best module: ``loss`` or a metric the trainer logs.
        val_goal: ``min`` or ``max``, whether a lower or a higher ``val_metric`` is better.
        patience: held-out evaluations without a new best that stop the run (0: never).
    """

    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    checkpoint_every: int = 200
    log_every: int = 10
    seed: int = 0
    max_time_s: float | None = None
    autocast: str | None = None
    val_sequences: int = 0
    val_every: int = 100
    val_batches: int = 8
    val_metric: str = "loss"
    val_goal: str = "min"
    patience: int = 0

    def __post_init__(self) -> None:
        if self.autocast not in AUTOCAST:
            raise TrainingError(f"autocast must be one of {sorted(k for k in AUTOCAST if k)} or None, "
                                f"got {self.autocast!r}")
        for name in ("steps", "batch_size", "seq_len", "val_every", "val_batches"):
            if getattr(self, name) < 1:
                raise TrainingError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise TrainingError(f"lr must be > 0, got {self.lr}")
        if self.val_goal not in ("min", "max"):
            raise TrainingError(f"val_goal must be 'min' or 'max', got {self.val_goal!r}")
        for name in ("val_sequences", "patience"):
            if getattr(self, name) < 0:
                raise TrainingError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.val_sequences and (self.patience or self.val_metric != "loss" or self.val_goal != "min"):
            raise TrainingError("patience, val_metric and val_goal act on held-out sequences: set val_sequences too")

    def lr_at(self, step: int, elapsed_s: float = 0.0) -> float:
        """Learning rate of optimizer step ``step`` (0-based): linear warm-up, cosine decay.

        With ``max_time_s`` the decay follows whichever runs out first, steps or time, so a
        time-limited run still ends at the low learning rate.
        """
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        frac = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        if self.max_time_s:
            frac = max(frac, elapsed_s / self.max_time_s)
        frac = min(1.0, frac)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """Outcome of :func:`train`.

    Attributes:
        steps: optimizer steps done in total (over every resumed session).
        final_loss: mean loss over the last ``log_every`` steps (or fewer).
        first_loss: loss of the very first step (kept across resumes).
        train_time_s: wall time spent in the loop, summed over sessions.
        stopped_early: True when ``max_time_s`` or the held-out ``patience`` ended the run.
        export_path: what the trainer's export wrote (None if interrupted).
        metrics: the last logged metrics.
        best_step: the step whose module was exported (held-out early stopping; None without it).
        best_value: that module's held-out ``val_metric`` (None without held-out sequences).
    """

    steps: int
    final_loss: float
    first_loss: float
    train_time_s: float
    stopped_early: bool
    export_path: Path | None
    metrics: dict[str, float]
    best_step: int | None = None
    best_value: float | None = None


@dataclasses.dataclass
class _Run:
    """The state a checkpoint holds: module, optimizer, batch sampler, counters and recent losses."""

    module: nn.Module
    params: list[nn.Parameter]
    opt: torch.optim.Optimizer
    data_gen: torch.Generator
    step: int = 0
    elapsed: float = 0.0
    first_loss: float = float("nan")
    recent: list[float] = dataclasses.field(default_factory=list)  # losses of the last log_every steps
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    best: Best = dataclasses.field(default_factory=Best)  # held-out early stopping

    def save(self, path: Path, identity: str) -> None:
        """Write the checkpoint through a temporary file and ``os.replace``."""
        tmp = path.with_name(path.name + ".tmp")
        torch.save({"identity": identity, "step": self.step, "elapsed_s": self.elapsed,
                    "recent_losses": self.recent, "first_loss": self.first_loss,
                    "best": dataclasses.asdict(self.best),
                    "module": self.module.state_dict(), "optimizer": self.opt.state_dict(),
                    "rng_torch": torch.get_rng_state(), "rng_data": self.data_gen.get_state()}, tmp)
        os.replace(tmp, path)

    def restore(self, path: Path, identity: str) -> None:
        """Continue from the checkpoint at ``path``, which must be of the same run."""
        if not path.exists():
            raise TrainingError(f"--resume: no checkpoint at {path}; run without --resume to start")
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state["identity"] != identity:
            raise TrainingError(f"the checkpoint in {path.parent} is from a different run (trainer, settings or "
                                f"options differ):\n  checkpoint: {state['identity']}\n  this run:   {identity}\n"
                                "use another --out or the original settings")
        self.module.load_state_dict(state["module"])
        self.opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng_torch"])
        self.data_gen.set_state(state["rng_data"])
        self.step, self.elapsed = int(state["step"]), float(state["elapsed_s"])
        self.recent = [float(x) for x in state.get("recent_losses", [])]
        self.first_loss = float(state.get("first_loss", float("nan")))
        self.best = Best(**state.get("best", {}))


def _identity(trainer: Trainer, config: TrainConfig, options: dict[str, Any]) -> str:
    """What must match for a checkpoint to resume this run (steps, time limits and autocast may change)."""
    loop_only = ("steps", "max_time_s", "checkpoint_every", "log_every", "autocast", "val_every", "patience")
    cfg = {k: v for k, v in dataclasses.asdict(config).items() if k not in loop_only}
    return json.dumps({"trainer": trainer.name, "config": cfg, "options": options}, sort_keys=True, default=str)


def train(trainer: Trainer, target, dataset: FeatureDataset, config: TrainConfig, out_dir: Path, *,
          options: dict[str, Any] | None = None, resume: bool = False, provenance: dict[str, Any] | None = None,
          progress: bool = True, on_log: Callable[[dict[str, Any]], None] | None = None) -> TrainResult:
    """Train a drafter module on a frozen target's features, with checkpoints and resume.

    Args:
        trainer: what to build, its loss and how to export it.
        target: the frozen target ``Transformer`` (its parameters are set not to require grad).
        dataset: features of the layers ``trainer.feature_layers(target)`` asks for.
        config: loop settings.
        out_dir: where checkpoints, the log and the exported drafter go.
        options: trainer-specific options (e.g. ``ttt_steps``), recorded in the checkpoint.
        resume: continue from ``out_dir/checkpoint.pt`` (its trainer, config and options must
            match, except ``steps`` and ``max_time_s``).
        provenance: extra provenance (target name, data description, command) passed to export.
        progress: show a tqdm bar.
        on_log: called with every logged record (tests, dashboards).

    Returns:
        The run's outcome; the trained drafter is written by ``trainer.export``.

    Raises:
        TrainingError: ``resume`` without a checkpoint, or one from a different run.
    """
    from tqdm.auto import tqdm

    options = dict(options or {})
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path, identity = out_dir / CHECKPOINT, _identity(trainer, config, options)
    held = None
    if config.val_sequences:
        dataset, held_data = dataset.split(config.val_sequences, config.seed)
        held = HeldOut(held_data, batch_size=config.batch_size, seq_len=config.seq_len, batches=config.val_batches,
                       seed=config.seed, path=out_dir / BEST, identity=identity, metric=config.val_metric,
                       goal=config.val_goal)
    run = _start(trainer, target, dataset, config, options)
    if resume:
        run.restore(ckpt_path, identity)
        log.info("resumed %s at step %d (%.0f s trained so far)", trainer.name, run.step, run.elapsed)
    elif ckpt_path.exists():
        log.warning("%s exists and is overwritten by this fresh run (pass resume=True to continue it)", ckpt_path)
    log_file = (out_dir / TRAIN_LOG).open("a" if resume else "w")
    bar = tqdm(total=config.steps, initial=run.step, desc=f"train {trainer.name}", unit="step", disable=not progress)
    try:
        if held is not None and run.step == 0:  # a warm-started module competes before its first step
            _validate(trainer, target, config, run, held, log_file, on_log)
        stopped_early = _loop(trainer, target, dataset, config, run, log_file=log_file, bar=bar, on_log=on_log,
                              checkpoint=lambda: run.save(ckpt_path, identity), held=held)
        if held is not None and held.last_step != run.step:  # the module the loop ended with competes too
            _validate(trainer, target, config, run, held, log_file, on_log)
    except KeyboardInterrupt:
        log.warning("interrupted at step %d; saving a checkpoint (continue with --resume)", run.step)
        run.save(ckpt_path, identity)
        raise
    finally:
        bar.close()
        log_file.close()
    run.save(ckpt_path, identity)
    if held is not None:
        held.restore_best(run.best, run.module)
        provenance = {**(provenance or {}), "held_out": held.provenance(run.best, config.val_every)}
    return _export(trainer, run, dataset, config, options, out_dir, provenance, stopped_early,
                   best=run.best if held is not None else None)


def _start(trainer: Trainer, target, dataset: FeatureDataset, config: TrainConfig, options: dict[str, Any]) -> _Run:
    """A fresh module (seeded, so a resume rebuilds the same one) and its optimizer."""
    target.requires_grad_(False)
    torch.manual_seed(config.seed)
    module = trainer.build(target, dataset, options)
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise TrainingError(f"trainer {trainer.name!r} built a module with no trainable parameters")
    opt = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay)
    return _Run(module=module, params=params, opt=opt, data_gen=torch.Generator().manual_seed(config.seed))


def _loop(trainer: Trainer, target, dataset: FeatureDataset, config: TrainConfig, run: _Run, *, log_file: Any,
          bar: Any, on_log: Callable[[dict[str, Any]], None] | None, checkpoint: Callable[[], None],
          held: HeldOut | None = None) -> bool:
    """Optimizer steps until ``config.steps``, the time limit or the patience; True unless the steps ran out."""
    run.module.train()
    device = next(target.parameters()).device.type
    session_start, base_elapsed = time.perf_counter(), run.elapsed
    while run.step < config.steps:
        if config.max_time_s is not None and run.elapsed >= config.max_time_s:
            log.warning("stopping at step %d: time limit of %.0f s reached", run.step, config.max_time_s)
            return True
        lr = config.lr_at(run.step, run.elapsed)
        for group in run.opt.param_groups:
            group["lr"] = lr
        batch = dataset.sample_batch(config.batch_size, config.seq_len, run.data_gen)
        with torch.autocast(device, dtype=AUTOCAST[config.autocast], enabled=config.autocast is not None):
            loss, m = trainer.loss(run.module, batch, target)
        if not torch.isfinite(loss):
            raise TrainingError(f"loss became {loss.item()} at step {run.step}; lower --lr")
        run.opt.zero_grad(set_to_none=True)
        loss.backward()
        if config.grad_clip:
            torch.nn.utils.clip_grad_norm_(run.params, config.grad_clip)
        run.opt.step()
        run.step += 1
        run.elapsed = base_elapsed + time.perf_counter() - session_start
        value = float(loss.detach())
        if math.isnan(run.first_loss) and run.step == 1:
            run.first_loss = value
        run.recent = (run.recent + [value])[-max(1, config.log_every):]
        run.metrics = {"loss": value, **m}
        bar.update(1)
        if run.step % config.log_every == 0 or run.step == config.steps:
            record = {"step": run.step, "lr": lr, "elapsed_s": round(run.elapsed, 2),
                      "loss_avg": sum(run.recent) / len(run.recent), **{k: round(v, 5) for k, v in run.metrics.items()}}
            log_file.write(json.dumps(record) + "\n")
            log_file.flush()
            bar.set_postfix(loss=f"{record['loss_avg']:.4f}")
            if on_log is not None:
                on_log(record)
        if held is not None and (run.step % config.val_every == 0 or run.step == config.steps):
            _validate(trainer, target, config, run, held, log_file, on_log)
            if config.patience and run.best.stale >= config.patience:
                log.warning("stopping at step %d: no better held-out %s in %d evaluations (best at step %d)",
                            run.step, config.val_metric, config.patience, run.best.step)
                checkpoint()
                return True
        if config.checkpoint_every and run.step % config.checkpoint_every == 0:
            checkpoint()
    return False


def _validate(trainer: Trainer, target, config: TrainConfig, run: _Run, held: HeldOut, log_file: Any,
              on_log: Callable[[dict[str, Any]], None] | None) -> None:
    """Score the module on the held-out windows, keep it if best, and log the evaluation."""
    scores = held.evaluate(trainer, run.module, target, AUTOCAST[config.autocast])
    held.observe(run.best, run.step, scores, run.module)
    record = {"step": run.step, **{k: round(v, 5) for k, v in scores.items()}, "best_step": run.best.step}
    log_file.write(json.dumps(record) + "\n")
    log_file.flush()
    if on_log is not None:
        on_log(record)


def _export(trainer: Trainer, run: _Run, dataset: FeatureDataset, config: TrainConfig, options: dict[str, Any],
            out_dir: Path, provenance: dict[str, Any] | None, stopped_early: bool, best: Best | None) -> TrainResult:
    """Hand the trained module (the held-out best, if any) to the trainer's export; the run's outcome."""
    final_loss = sum(run.recent) / len(run.recent) if run.recent else float("nan")
    prov = dict(provenance or {})
    prov.update({"trainer": trainer.name, "steps": run.step, "final_loss": round(final_loss, 5),
                 "train_time_s": round(run.elapsed, 1), "stopped_early": stopped_early,
                 "config": dataclasses.asdict(config), "options": options,
                 "data": {**dataset.description, "sequences": dataset.num_sequences,
                          "tokens": dataset.num_tokens, "trained_positions": int(dataset.loss_mask.sum())},
                 "torch": torch.__version__})
    run.module.eval()
    export_path = trainer.export(run.module, out_dir, prov)
    log.info("%s: %d steps, final loss %.4f, %.0f s; exported to %s", trainer.name, run.step, final_loss, run.elapsed,
             export_path)
    return TrainResult(steps=run.step, final_loss=final_loss, first_loss=run.first_loss, train_time_s=run.elapsed,
                       stopped_early=stopped_early, export_path=export_path, metrics=run.metrics,
                       best_step=best.step if best else None, best_value=best.value if best else None)
