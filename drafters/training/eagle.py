"""Training of EAGLE heads: the loss module and the ``eagle``/``eagle3`` trainers.

The heads are in :mod:`refspec.drafters.eagle_head`; the data plumbing (feature collection
from the frozen target, checkpoints, the ``train`` CLI) is shared with the other trained
drafters in :mod:`refspec.drafters.training`, which finds :func:`register_trainers` here.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from refspec.drafters.eagle_head import (Eagle1Head, Eagle3Head, EagleHead, HeadConfig, eagle3_layers, load_head,
                                         new_head, save_head)
from refspec.drafting import DrafterError

log = logging.getLogger(__name__)


class EagleTrainingModule(nn.Module):
    """A head plus its training recipe; ``forward(batch, target)`` returns ``(loss, metrics)``.

    Per unrolled step j (weighted ``0.8 ** j``), over trained positions: cross-entropy of the
    draft logits against the target's greedy next token, or with ``soft_labels`` a > 0 against
    ``(1 - a) * onehot + a * p``, p the target's own distribution over the draft vocabulary
    (renormalised; it ranks the runners-up a tree drafts), weighted ``ce_weight``; for
    ``eagle`` also a smooth-L1 regression of the predicted feature onto the target's
    final-normed feature (weight 1), as EAGLE-1 trains. Positions whose label lies outside a
    reduced draft vocabulary are not trained on (EAGLE-3 does the same).

    Args:
        head: the head being trained (float32).
        ttt_steps: unrolled steps of training-time test (1 = teacher forcing only).
        noise: half-width of uniform noise added to the input target features.
        ce_weight: weight of the cross-entropy term.
        ce_fraction: share of trained positions (drawn at random each step) that enter the
            cross-entropy; the LM head over the whole vocabulary dominates the cost of an
            EAGLE-1 step on a CPU, and the regression term already sees every position.
        soft_labels: weight in [0, 1] of the target's distribution in the cross-entropy's goal;
            above 0 the batch must hold the target's final-normed layer.
    """

    def __init__(self, head: EagleHead, *, ttt_steps: int, noise: float, ce_weight: float,
                 ce_fraction: float = 1.0, soft_labels: float = 0.0) -> None:
        super().__init__()
        if ttt_steps < 1:
            raise DrafterError(f"ttt_steps must be >= 1, got {ttt_steps}")
        if not 0 < ce_fraction <= 1:
            raise DrafterError(f"ce_fraction must be in (0, 1], got {ce_fraction}")
        if not 0 <= soft_labels <= 1:
            raise DrafterError(f"soft_labels must be in [0, 1], got {soft_labels}")
        self.head = head
        self.ttt_steps, self.noise, self.ce_weight, self.ce_fraction = ttt_steps, noise, ce_weight, ce_fraction
        self.soft_labels = soft_labels
        t2d = head.t2d if isinstance(head, Eagle3Head) else torch.ones(head.config.vocab_size, dtype=torch.bool)
        self.register_buffer("in_vocab", t2d.clone(), persistent=False)
        self.register_buffer("draft_index", torch.cumsum(t2d.long(), 0) - 1, persistent=False)  # target -> draft id
        self.register_buffer("draft_ids", torch.nonzero(t2d).flatten(), persistent=False)  # draft -> target id

    @torch.no_grad()
    def target_probs(self, batch, target, trained: torch.Tensor) -> torch.Tensor:
        """``[B, S, Vd]`` the target's next-token distribution over the draft vocabulary at the
        ``trained`` positions (zero elsewhere), from its final-normed layer in the batch."""
        h = batch.of(target.num_layers)[trained]  # [N, E]
        logits = target.logits(h.to(target.lm_head.weight.dtype))[:, self.draft_ids]  # [N, Vd]
        probs = logits.new_zeros(*trained.shape, self.draft_ids.numel())
        probs[trained] = torch.softmax(logits, dim=-1)
        return probs

    def forward(self, batch, target) -> tuple[torch.Tensor, dict[str, float]]:
        head = self.head
        h0 = head.prepare([batch.of(l).float() for l in head.config.feature_layers])
        if self.noise and self.training:
            h0 = h0 + (torch.rand_like(h0) - 0.5) * (2 * self.noise)
        s = batch.tokens.shape[1]
        outs = head.unroll(lambda t: target.embed_tokens(t).float(), batch.tokens, h0, self.ttt_steps)
        trained = batch.loss_mask & self.in_vocab[batch.labels]  # [B, S]
        probs = self.target_probs(batch, target, trained) if self.soft_labels else None
        total = h0.new_zeros(())
        metrics: dict[str, float] = {}
        for j, out in enumerate(outs):
            shift = j + 1  # out^j_i predicts the feature (and the greedy label) of position i + j + 1
            mask = torch.zeros_like(trained)
            mask[:, : s - shift] = trained[:, shift:]
            n = mask.sum().clamp_min(1)
            ahead = mask[:, : s - shift]  # the predicted positions, seen from position i + j + 1
            labels = self.draft_index[batch.labels[:, shift:][ahead]]  # [M]
            picked = out[mask]  # [M, E]
            dist = probs[:, shift:][ahead] if probs is not None else None  # [M, Vd]
            if self.ce_fraction < 1:
                sub = torch.rand(labels.shape[0], device=labels.device) < self.ce_fraction
                picked, labels = picked[sub], labels[sub]
                dist = dist[sub] if dist is not None else None
            n_ce = torch.tensor(max(1, labels.shape[0]), device=labels.device)
            logits = head.draft_logits(picked, target)  # [M', Vd]
            ce = F.cross_entropy(logits, labels, reduction="sum") / n_ce
            goal_loss = ce
            if dist is not None:
                soft = -(dist * F.log_softmax(logits, dim=-1)).sum() / n_ce
                goal_loss = (1 - self.soft_labels) * ce + self.soft_labels * soft
                metrics[f"soft{j}"] = float(soft.detach())
            step_loss = self.ce_weight * goal_loss
            if isinstance(head, Eagle1Head):
                feature = batch.of(head.config.feature_layers[0])[:, shift:][ahead].float()
                reg = F.smooth_l1_loss(out[mask], feature, reduction="sum") / (n * out.shape[-1])
                step_loss = step_loss + reg
                metrics[f"reg{j}"] = float(reg.detach())
            total = total + (0.8 ** j) * step_loss
            metrics[f"ce{j}"] = float(ce.detach())
            metrics[f"acc{j}"] = float((logits.detach().argmax(-1) == labels).float().sum() / n_ce)
        return total, metrics


@dataclasses.dataclass(frozen=True)
class EagleTrainer:
    """The :class:`refspec.drafters.training.Trainer` of ``eagle`` and ``eagle3`` heads.

    Options: ``ttt_steps`` (default 1 for eagle, 3 for eagle3), ``noise`` (default 0.1 for
    eagle, 0 for eagle3), ``ce_weight`` (0.1 / 1.0), ``ce_fraction`` (0.25 / 1.0; see
    :class:`EagleTrainingModule`), ``draft_vocab_size`` (eagle3 only; default 8192, 0 keeps
    the whole vocabulary; given with ``init``, a larger size widens the saved head's vocabulary),
    ``soft_labels`` (default 0; see :class:`EagleTrainingModule`), ``init`` (a head directory to
    start from, e.g. a shipped head, so a short run refines it on new data; default: a fresh head).
    """

    name: str
    description: str
    defaults: dict[str, Any] = dataclasses.field(default_factory=dict)

    def option(self, options: dict[str, Any], key: str) -> Any:
        eagle1 = self.name == "eagle"
        base = {"ttt_steps": 1 if eagle1 else 3, "noise": 0.1 if eagle1 else 0.0,
                "ce_weight": 0.1 if eagle1 else 1.0, "ce_fraction": 0.25 if eagle1 else 1.0,
                "draft_vocab_size": 0 if eagle1 else 8192, "soft_labels": 0.0, "init": ""}
        unknown = set(options) - set(base)
        if unknown:
            raise DrafterError(f"unknown {self.name} training options {sorted(unknown)}; known: {sorted(base)}")
        return type(base[key])(options.get(key, base[key]))

    def feature_layers(self, target, options: dict[str, Any] | None = None) -> tuple[int, ...]:
        if self.name == "eagle":
            return (target.num_layers,)
        soft = self.option(options or {}, "soft_labels")  # the target's distribution comes from its last layer
        return eagle3_layers(target.num_layers) + ((target.num_layers,) if soft else ())

    def build(self, target, dataset, options: dict[str, Any]) -> nn.Module:
        vd = self.option(options, "draft_vocab_size")
        if self.name == "eagle" and vd:
            raise DrafterError("an eagle head drafts over the whole vocabulary; draft_vocab_size is for eagle3")
        init = self.option(options, "init")
        if init:
            head = self._warm_start(init, target)
            if "draft_vocab_size" in options:
                head = _widen(head, target, dataset, vd or head.config.vocab_size)
            return self._module(head.to(target.device), options)
        hc = HeadConfig.for_target(self.name, target.args, draft_vocab_size=vd or None)
        head = new_head(hc)
        if isinstance(head, Eagle3Head):
            with torch.no_grad():
                if hc.draft_vocab_size < hc.vocab_size:
                    head.set_vocab(_frequent_labels(dataset, hc.vocab_size, hc.draft_vocab_size))
                ids = head.to_target_ids(torch.arange(hc.draft_vocab_size))
                head.lm_head.weight.copy_(target.lm_head.weight.detach().float().cpu()[ids])
                head.norm.weight.copy_(target.norm.weight.detach().float().cpu())
        return self._module(head.to(target.device), options)

    def _warm_start(self, folder: str, target) -> EagleHead:
        """The head saved in ``folder`` (its kind must be this trainer's), trainable, in float32."""
        head, _ = load_head(folder, target.args)
        if head.config.kind != self.name:
            raise DrafterError(f"option init={folder} holds an {head.config.kind} head, not {self.name}")
        return head.requires_grad_(True).train()

    def _module(self, head: EagleHead, options: dict[str, Any]) -> nn.Module:
        return EagleTrainingModule(head.float(), ttt_steps=self.option(options, "ttt_steps"),
                                   noise=self.option(options, "noise"), ce_weight=self.option(options, "ce_weight"),
                                   ce_fraction=self.option(options, "ce_fraction"),
                                   soft_labels=self.option(options, "soft_labels"))

    def loss(self, module: nn.Module, batch, target) -> tuple[torch.Tensor, dict[str, float]]:
        return module(batch, target)

    def export(self, module: nn.Module, out_dir: Path, provenance: dict[str, Any]) -> Path:
        """Save the head with bfloat16 weights (half the bytes; the loader casts to the run's dtype,
        and losslessness never depends on the head's precision)."""
        return save_head(module.head, out_dir, provenance=provenance, dtype=torch.bfloat16)


def _frequent_labels(dataset, vocab_size: int, size: int, keep: torch.Tensor | None = None) -> torch.Tensor:
    """``[size]`` ascending target ids: ``keep`` (if given) plus the most frequent trained labels."""
    counts = dataset.token_counts(vocab_size).double()
    ranked = counts - torch.arange(vocab_size, dtype=torch.double) * 1e-9  # ties: lower id
    if keep is not None:
        ranked[keep] = float("inf")
    used = ranked.topk(size).indices.sort().values
    log.info("draft vocabulary: %d tokens cover %.1f%% of trained labels", size,
             100 * float(counts[used].sum() / counts.sum().clamp_min(1)))
    return used


@torch.no_grad()
def _widen(head: Eagle3Head, target, dataset, size: int) -> Eagle3Head:
    """``head`` with a draft vocabulary of ``size`` tokens: its own tokens keep their trained LM-head
    rows; the most frequent trained labels fill the rest. Their rows are the target's LM-head rows
    sent through the affine map that best takes the target's rows of the kept tokens to the trained
    ones (least squares): the trained head's output space has drifted from the target's, so the
    target's rows unmapped would outscore every trained token."""
    old = head.config.draft_vocab_size
    if size == old:
        return head
    if size < old:
        raise DrafterError(f"draft_vocab_size={size} is below the saved head's {old}; a warm start can only widen it")
    wide = new_head(dataclasses.replace(head.config, draft_vocab_size=size))
    state = {k: v for k, v in head.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    missing, unexpected = wide.load_state_dict(state, strict=False)
    assert sorted(missing) == ["d2t", "lm_head.weight", "t2d"] and not unexpected, (missing, unexpected)
    kept = head.to_target_ids(torch.arange(old))  # [old] ascending target ids
    used = _frequent_labels(dataset, head.config.vocab_size, size, keep=kept)  # [size]
    wide.set_vocab(used)
    trained = head.lm_head.weight.float()  # [old, E]
    source = torch.cat([target.lm_head.weight.detach().float().cpu(),
                        torch.ones(head.config.vocab_size, 1)], dim=1)  # [V, E + 1]
    fit = torch.linalg.lstsq(source[kept].double(), trained.double()).solution.float()  # [E + 1, E]
    rows = source[used] @ fit  # [size, E]
    is_kept = head.t2d[used]  # [size]
    rows[is_kept] = trained[(torch.cumsum(head.t2d.long(), 0) - 1)[used[is_kept]]]
    wide.lm_head.weight.copy_(rows)
    return wide.requires_grad_(True).train()


def register_trainers(register) -> None:
    """Register the ``eagle`` and ``eagle3`` trainers with :mod:`refspec.drafters.training`."""
    register(EagleTrainer("eagle", "EAGLE-1/2 head: feature regression + greedy-label cross-entropy",
                          defaults={"lr": 1e-3, "batch_size": 4, "seq_len": 256, "warmup_steps": 30}))
    register(EagleTrainer("eagle3", "EAGLE-3 head: three fused layers, training-time test, reduced vocabulary",
                          defaults={"lr": 1e-3, "batch_size": 4, "seq_len": 256, "warmup_steps": 30}))
