"""Shared plumbing for training drafters on a frozen target (EAGLE heads, block drafters).

A drafter that learns from the target's hidden states needs the same few pieces, written once
here and used by every trainer:

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

Trainers register in :data:`TRAINERS` through a module hook: a drafter's training module
(``eagle_training``, ``block_training``) defines ``register_trainers(register)`` and calls
``register(Trainer(...))``; :func:`load_trainers` imports those modules and calls their hooks,
so ``python -m refspec.drafters.train --drafter NAME`` dispatches without the CLI knowing any
drafter.

Out directory layout (``train(out_dir=...)``): ``checkpoint.pt`` (resume state),
``train_log.jsonl`` (one line per logged step), ``features.safetensors`` (the dataset cache,
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
from typing import Any, Callable, Iterable, Protocol, Sequence

import torch
from torch import nn

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"
TRAIN_LOG = "train_log.jsonl"


class TrainingError(RuntimeError):
    """Training cannot start or resume (the message says what to change)."""


# ---- datasets -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Batch:
    """A batch of training windows cut from a :class:`FeatureDataset`.

    Attributes:
        tokens: ``[B, S]`` token ids (0 past a window's end).
        hidden: one ``[B, S, E]`` float32 tensor per dataset layer, in ``FeatureDataset.layers``
            order; ``hidden[j][b, i]`` is the target's state at position i of the window.
        labels: ``[B, S]`` the target's greedy next token after position i (its argmax).
        loss_mask: ``[B, S]`` bool, whether position i's next-token prediction is trained on
            (False on prompts the target did not write and past a window's end).
        valid: ``[B, S]`` bool, whether position i holds a real token.
        layers: the layer of each entry of ``hidden``.
    """

    tokens: torch.Tensor
    hidden: list[torch.Tensor]
    labels: torch.Tensor
    loss_mask: torch.Tensor
    valid: torch.Tensor
    layers: tuple[int, ...] = ()

    def of(self, layer: int) -> torch.Tensor:
        """``[B, S, E]`` hidden states of one target layer."""
        try:
            return self.hidden[self.layers.index(layer)]
        except ValueError:
            raise TrainingError(f"the batch holds layers {self.layers}, not {layer}") from None


@dataclasses.dataclass
class FeatureDataset:
    """Sequences with the frozen target's hidden states, stored flat.

    Sequence ``d`` occupies rows ``offsets[d]:offsets[d+1]`` of every flat tensor.

    Attributes:
        tokens: ``[N]`` token ids.
        labels: ``[N]`` the target's argmax after each position (its greedy next token).
        loss_mask: ``[N]`` bool, positions whose next-token prediction is trained on.
        hidden: ``{layer: [N, E]}`` hidden states (``Transformer.forward`` numbering: ``i < L``
            residual after block i, ``L`` final-normed), usually stored in bfloat16.
        offsets: ``[D+1]`` sequence boundaries.
        description: free-form provenance of the text (recorded in exported heads).
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    hidden: dict[int, torch.Tensor]
    offsets: torch.Tensor
    description: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        assert self.labels.shape == (n,) and self.loss_mask.shape == (n,), "tokens, labels, loss_mask: [N]"
        assert int(self.offsets[-1]) == n, f"offsets end at {int(self.offsets[-1])}, expected {n}"
        for layer, h in self.hidden.items():
            assert h.shape[0] == n, f"hidden layer {layer} has {h.shape[0]} rows, expected {n}"

    @property
    def layers(self) -> tuple[int, ...]:
        """Stored layers, ascending (the order of ``Batch.hidden``)."""
        return tuple(sorted(self.hidden))

    @property
    def num_sequences(self) -> int:
        return self.offsets.shape[0] - 1

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]

    @property
    def lengths(self) -> torch.Tensor:
        """``[D]`` tokens per sequence."""
        return self.offsets[1:] - self.offsets[:-1]

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """``[V]`` how often each token is a trained-on label (for reduced draft vocabularies)."""
        return torch.bincount(self.labels[self.loss_mask], minlength=vocab_size)

    def select_layers(self, layers: Iterable[int]) -> "FeatureDataset":
        """A view holding only ``layers`` (raises if one is missing)."""
        layers = tuple(layers)
        missing = [l for l in layers if l not in self.hidden]
        if missing:
            raise TrainingError(f"the dataset holds layers {self.layers}, not {missing}; collect features again")
        return dataclasses.replace(self, hidden={l: self.hidden[l] for l in layers})

    def sample_batch(self, batch_size: int, seq_len: int, generator: torch.Generator) -> Batch:
        """Cut ``batch_size`` random windows of ``seq_len`` positions.

        Sequences are drawn with probability proportional to their length (so every position
        is about equally likely); a window starts uniformly inside its sequence and is padded
        with invalid positions when the sequence is shorter.

        Args:
            batch_size: B.
            seq_len: S.
            generator: CPU generator (its state is part of every checkpoint).
        """
        lengths = self.lengths.float()
        docs = torch.multinomial(lengths, batch_size, replacement=True, generator=generator)  # [B]
        lens = self.lengths[docs]
        room = (lens - seq_len).clamp_min(0)
        start = (torch.rand(batch_size, generator=generator) * (room + 1).float()).long().clamp_max(room)
        idx = self.offsets[docs][:, None] + start[:, None] + torch.arange(seq_len)[None]  # [B, S]
        valid = (start[:, None] + torch.arange(seq_len)[None]) < lens[:, None]
        idx = torch.where(valid, idx, torch.zeros_like(idx))
        tokens = torch.where(valid, self.tokens[idx], torch.zeros_like(idx))
        labels = torch.where(valid, self.labels[idx], torch.zeros_like(idx))
        loss_mask = self.loss_mask[idx] & valid
        hidden = [self.hidden[l][idx].float() * valid[..., None] for l in self.layers]
        return Batch(tokens=tokens, hidden=hidden, labels=labels, loss_mask=loss_mask, valid=valid,
                     layers=self.layers)

    # -- persistence ------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        """Write the dataset as one safetensors file (atomically)."""
        from safetensors.torch import save_file

        tensors = {"tokens": self.tokens.contiguous(), "labels": self.labels.contiguous(),
                   "loss_mask": self.loss_mask.to(torch.uint8).contiguous(), "offsets": self.offsets.contiguous()}
        tensors.update({f"hidden.{l}": h.contiguous() for l, h in self.hidden.items()})
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        save_file(tensors, str(tmp), metadata={"description": json.dumps(self.description, sort_keys=True)})
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> "FeatureDataset":
        """Read a dataset written by :meth:`save`."""
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            t = {k: f.get_tensor(k) for k in f.keys()}
        hidden = {int(k.split(".", 1)[1]): v for k, v in t.items() if k.startswith("hidden.")}
        return cls(tokens=t["tokens"], labels=t["labels"], loss_mask=t["loss_mask"].bool(), hidden=hidden,
                   offsets=t["offsets"], description=json.loads(meta.get("description", "{}")))


@dataclasses.dataclass(frozen=True)
class TrainingSequence:
    """One training sequence before features are collected.

    Attributes:
        tokens: token ids.
        train_from: first position whose next-token prediction is trained on (e.g. the last
            prompt token of a self-distilled chat, so only the target's own reply counts).
        source: where the text came from (for provenance counts).
    """

    tokens: list[int]
    train_from: int = 0
    source: str = ""


@torch.inference_mode()
def self_distill(target, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, batch_size: int = 8,
                 eos_token_ids: Sequence[int] = (), progress: bool = True, source: str = "self-distill",
                 ) -> list[TrainingSequence]:
    """The target's own greedy replies to training prompts, as training sequences.

    Prompts are decoded in batches of similar length with plain (k = 0) decoding of
    :class:`refspec.engine.Engine`; each sequence is prompt + reply, trained from the last
    prompt token on.

    Args:
        target: the frozen target ``Transformer``.
        prompts: token ids per prompt (already chat-templated where the target expects it).
        max_new_tokens: reply budget per prompt.
        batch_size: rows decoded together.
        eos_token_ids: tokens that end a reply.
        progress: show a tqdm bar.
        source: label recorded in each sequence.

    Returns:
        One sequence per prompt, in the order of ``prompts``.
    """
    from tqdm.auto import tqdm

    from refspec.engine import Engine

    engine = Engine(target, eos_token_ids=eos_token_ids)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[TrainingSequence | None] = [None] * len(prompts)
    bar = tqdm(total=len(prompts), desc="self-distill", unit="prompt", disable=not progress)
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        gen = engine.generate([list(prompts[i]) for i in rows], max_new_tokens=max_new_tokens)
        for i, reply in zip(rows, gen.tokens):
            p = list(prompts[i])
            out[i] = TrainingSequence(tokens=p + list(reply), train_from=len(p) - 1, source=source)
        bar.update(len(rows))
    bar.close()
    return [s for s in out if s is not None]


@torch.inference_mode()
def collect_features(target, sequences: Sequence[TrainingSequence], layers: Iterable[int], *,
                     max_len: int = 512, batch_tokens: int = 4096, storage_dtype: torch.dtype = torch.bfloat16,
                     progress: bool = True, description: dict[str, Any] | None = None) -> FeatureDataset:
    """Run the frozen target over training sequences and keep what drafters learn from.

    Args:
        target: the frozen target ``Transformer`` (any dtype; bf16 is 2-4x faster on CPU).
        sequences: the training sequences (cut to ``max_len`` tokens).
        layers: hidden layers to keep (``Transformer.forward`` numbering).
        max_len: longest sequence kept, in tokens.
        batch_tokens: padded tokens per target forward (rows * longest row).
        storage_dtype: dtype of the stored hidden states.
        progress: show a tqdm bar.
        description: provenance of the text, stored with the dataset.

    Returns:
        The dataset; ``labels`` are the target's argmax at every position and the last
        position of each sequence is never trained on (its next token is unknown).
    """
    from tqdm.auto import tqdm

    layers = tuple(sorted(set(layers)))
    final = target.num_layers
    want = tuple(sorted(set(layers) | {final}))
    seqs = [s for s in sequences if len(s.tokens) >= 2]
    if len(seqs) < len(sequences):
        log.warning("dropped %d sequences shorter than 2 tokens", len(sequences) - len(seqs))
    if not seqs:
        raise TrainingError("no training sequence has 2 or more tokens")
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i].tokens))
    pieces: dict[int, list] = {}
    bar = tqdm(total=sum(min(len(s.tokens), max_len) for s in seqs), desc="target features", unit="tok",
               disable=not progress)
    dev = target.device
    i = 0
    while i < len(order):
        longest = min(len(seqs[order[i]].tokens), max_len)
        rows = order[i:i + max(1, batch_tokens // longest)]
        i += len(rows)
        b = len(rows)
        toks = torch.zeros(b, longest, dtype=torch.long)
        for r, d in enumerate(rows):
            t = seqs[d].tokens[:max_len]
            toks[r, : len(t)] = torch.tensor(t, dtype=torch.long)
        toks = toks.to(dev)
        cache = target.new_cache(b, longest)
        pos = torch.arange(longest, device=dev)[None].expand(b, longest)
        _, hidden = target(toks, pos, cache, logits_at=pos[:, :0], hidden_layers=want)
        by_layer = dict(zip(want, hidden))
        labels = torch.cat([target.logits(by_layer[final][:, j:j + 256]).argmax(-1)
                            for j in range(0, longest, 256)], dim=1)  # [B, S]
        for r, d in enumerate(rows):
            n = min(len(seqs[d].tokens), max_len)
            mask = torch.zeros(n, dtype=torch.bool)
            mask[max(0, seqs[d].train_from): n - 1] = True
            pieces[d] = [toks[r, :n].cpu(), labels[r, :n].cpu(), mask,
                         {l: by_layer[l][r, :n].to(storage_dtype).cpu() for l in layers}]
            bar.update(n)
    bar.close()
    parts = [pieces[d] for d in range(len(seqs))]
    lengths = torch.tensor([p[0].shape[0] for p in parts])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    return FeatureDataset(tokens=torch.cat([p[0] for p in parts]), labels=torch.cat([p[1] for p in parts]),
                          loss_mask=torch.cat([p[2] for p in parts]),
                          hidden={l: torch.cat([p[3][l] for p in parts]) for l in layers}, offsets=offsets,
                          description=dict(description or {}))


# ---- trainers -------------------------------------------------------------------------------


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

    def feature_layers(self, target) -> tuple[int, ...]:
        """Target layers whose hidden states the drafter trains on."""

    def build(self, target, dataset: FeatureDataset, options: dict[str, Any]) -> nn.Module:
        """A fresh trainable module (deterministic given its inputs: resume rebuilds it)."""

    def loss(self, module: nn.Module, batch: Batch, target) -> tuple[torch.Tensor, dict[str, float]]:
        """Scalar loss of one batch and named metrics (floats) to log."""

    def export(self, module: nn.Module, out_dir: Path, provenance: dict[str, Any]) -> Path:
        """Write the trained drafter where its builder finds it; returns the path written."""


TRAINERS: dict[str, Trainer] = {}
"""Registered trainers by drafter name (fill with :func:`load_trainers`)."""

_TRAINER_MODULES = ("eagle_training", "block_training")
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

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise TrainingError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise TrainingError(f"lr must be > 0, got {self.lr}")

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
        stopped_early: True when ``max_time_s`` ended the run.
        export_path: what the trainer's export wrote (None if interrupted).
        metrics: the last logged metrics.
    """

    steps: int
    final_loss: float
    first_loss: float
    train_time_s: float
    stopped_early: bool
    export_path: Path | None
    metrics: dict[str, float]


def _save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def _identity(trainer: Trainer, config: TrainConfig, options: dict[str, Any]) -> str:
    """What must match for a checkpoint to resume this run (steps and time limits may change)."""
    cfg = {k: v for k, v in dataclasses.asdict(config).items() if k not in ("steps", "max_time_s", "checkpoint_every",
                                                                            "log_every")}
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
    ckpt_path = out_dir / CHECKPOINT
    identity = _identity(trainer, config, options)
    target.requires_grad_(False)

    torch.manual_seed(config.seed)
    module = trainer.build(target, dataset, options)
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise TrainingError(f"trainer {trainer.name!r} built a module with no trainable parameters")
    opt = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay)
    data_gen = torch.Generator().manual_seed(config.seed)
    step, elapsed, first_loss = 0, 0.0, float("nan")
    recent: list[float] = []  # losses of the last log_every steps
    if resume:
        if not ckpt_path.exists():
            raise TrainingError(f"--resume: no checkpoint at {ckpt_path}; run without --resume to start")
        state = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        if state["identity"] != identity:
            raise TrainingError(f"the checkpoint in {out_dir} is from a different run (trainer, settings or "
                                f"options differ):\n  checkpoint: {state['identity']}\n  this run:   {identity}\n"
                                "use another --out or the original settings")
        module.load_state_dict(state["module"])
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng_torch"])
        data_gen.set_state(state["rng_data"])
        step, elapsed = int(state["step"]), float(state["elapsed_s"])
        recent = [float(x) for x in state.get("recent_losses", [])]
        first_loss = float(state.get("first_loss", float("nan")))
        log.info("resumed %s at step %d (%.0f s trained so far)", trainer.name, step, elapsed)
    elif ckpt_path.exists():
        log.warning("%s exists and is overwritten by this fresh run (pass resume=True to continue it)", ckpt_path)

    def checkpoint() -> None:
        _save_checkpoint(ckpt_path, {"identity": identity, "step": step, "elapsed_s": elapsed,
                                     "recent_losses": recent, "first_loss": first_loss,
                                     "module": module.state_dict(), "optimizer": opt.state_dict(),
                                     "rng_torch": torch.get_rng_state(), "rng_data": data_gen.get_state()})

    module.train()
    metrics: dict[str, float] = {}
    stopped_early = False
    log_file = (out_dir / TRAIN_LOG).open("a" if resume else "w")
    bar = tqdm(total=config.steps, initial=step, desc=f"train {trainer.name}", unit="step", disable=not progress)
    session_start = time.perf_counter()
    base_elapsed = elapsed
    try:
        while step < config.steps:
            if config.max_time_s is not None and elapsed >= config.max_time_s:
                stopped_early = True
                log.warning("stopping at step %d: time limit of %.0f s reached", step, config.max_time_s)
                break
            lr = config.lr_at(step, elapsed)
            for group in opt.param_groups:
                group["lr"] = lr
            batch = dataset.sample_batch(config.batch_size, config.seq_len, data_gen)
            loss, m = trainer.loss(module, batch, target)
            if not torch.isfinite(loss):
                raise TrainingError(f"loss became {loss.item()} at step {step}; lower --lr")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if config.grad_clip:
                torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
            opt.step()
            step += 1
            elapsed = base_elapsed + time.perf_counter() - session_start
            value = float(loss.detach())
            if math.isnan(first_loss) and step == 1:
                first_loss = value
            recent = (recent + [value])[-max(1, config.log_every):]
            metrics = {"loss": value, **m}
            bar.update(1)
            if step % config.log_every == 0 or step == config.steps:
                record = {"step": step, "lr": lr, "elapsed_s": round(elapsed, 2), "loss_avg": sum(recent) / len(recent),
                          **{k: round(v, 5) for k, v in metrics.items()}}
                log_file.write(json.dumps(record) + "\n")
                log_file.flush()
                bar.set_postfix(loss=f"{record['loss_avg']:.4f}")
                if on_log is not None:
                    on_log(record)
            if config.checkpoint_every and step % config.checkpoint_every == 0:
                checkpoint()
    except KeyboardInterrupt:
        log.warning("interrupted at step %d; saving a checkpoint (continue with --resume)", step)
        checkpoint()
        raise
    finally:
        bar.close()
        log_file.close()
    checkpoint()
    final_loss = sum(recent) / len(recent) if recent else float("nan")
    prov = dict(provenance or {})
    prov.update({"trainer": trainer.name, "steps": step, "final_loss": round(final_loss, 5),
                 "train_time_s": round(elapsed, 1), "stopped_early": stopped_early,
                 "config": dataclasses.asdict(config), "options": options,
                 "data": {**dataset.description, "sequences": dataset.num_sequences,
                          "tokens": dataset.num_tokens, "trained_positions": int(dataset.loss_mask.sum())},
                 "torch": torch.__version__})
    module.eval()
    export_path = trainer.export(module, out_dir, prov)
    log.info("%s: %d steps, final loss %.4f, %.0f s; exported to %s", trainer.name, step, final_loss, elapsed,
             export_path)
    return TrainResult(steps=step, final_loss=final_loss, first_loss=first_loss, train_time_s=elapsed,
                       stopped_early=stopped_early, export_path=export_path, metrics=metrics)
