"""Block drafting (in the spirit of DFlash): one drafter forward proposes all K drafts of a step.

The head (a small transformer over the target's fused features, with K learned mask
embeddings) and its checkpoint live in :mod:`refspec.drafters.block_head`, its training in
:mod:`refspec.drafters.training.block`; this module drafts with a loaded head, finds the
trained head of a target and registers ``block`` with the drafter registry.

Each step the head reads the pending token and K mask slots, attending to a context cache of
the target's projected features, so drafting costs one head forward of K + 1 tokens per row
and an LM head over K tokens per row, whatever K is; the target verifies the block as a
chain. The target's features for the positions committed by a step arrive in ``commit``
(``state.hidden`` entries ``0..num_accepted``); they are projected into the context cache at
the start of the next ``propose`` so the draft phase is billed for it. Steps the speculation
policy runs with K = 0 commit without drafting: their features wait in a
:class:`~refspec.drafters.feature_backlog.FeatureBacklog` and are projected together at the
next draft (or in ``commit``, billed there, once more than its limit piled up).

A head trained with block size ``K_max`` serves every K <= K_max by using the first K mask
embeddings; training mixes block lengths so the shorter prefixes are in-distribution.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from refspec.cache import StaticKVCache
from refspec.config import round_up
from refspec.drafters import block_dflash, head_files
from refspec.drafters.feature_backlog import FeatureBacklog
from refspec.drafters.block_head import (CONFIG_FILE, HEAD_FORMAT, HEAD_VERSION, WEIGHTS_FILE, BlockHead,
                                         BlockHeadConfig, default_feature_layers, head_args)
from refspec.drafters.training.block import (BlockLossConfig, BlockTrainer, block_loss, block_training_states,
                                             sample_blocks, text_labels)
from refspec.drafting import DecodeState, Draft, DrafterError
from refspec.energy.model.roofline import DrafterModel
from refspec.sampling import probs_from_logits, sample

log = logging.getLogger(__name__)

__all__ = [  # the drafter's own names, then those re-exported from where they live now
    "DEFAULT_K", "HeadNotFoundError", "BlockDrafter", "head_name", "head_search_path", "QUICK_RECIPE",
    "train_command", "find_head", "register_builtin",
    "CONFIG_FILE", "HEAD_FORMAT", "HEAD_VERSION", "WEIGHTS_FILE", "BlockHead", "BlockHeadConfig",
    "default_feature_layers", "head_args", "BlockLossConfig", "BlockTrainer", "block_loss", "block_training_states",
    "sample_blocks", "text_labels",
]

DEFAULT_K = 8


class HeadNotFoundError(DrafterError):
    """No trained block head for this target (the message gives the command that makes one)."""


# ---- the drafter --------------------------------------------------------------------------------
class BlockDrafter:
    """Drafts K tokens per row with one :class:`BlockHead` forward per step.

    Args:
        head: the trained (or, in tests, random) head; cast to the target's dtype and device.
        target: the target ``Transformer`` (its embedding and LM head are used, frozen).
        kv_bucket: attended context-cache prefix granularity (static shapes per bucket).

    Attributes:
        forwards: head forwards run since the last ``reset`` (one per step).
    """

    name = "block"

    def __init__(self, head: BlockHead, target, *, kv_bucket: int = 64) -> None:
        ta = target.args
        if head.target_args.hidden_size != ta.hidden_size or head.target_args.vocab_size != ta.vocab_size:
            raise DrafterError(f"block head was built for E={head.target_args.hidden_size}, "
                               f"V={head.target_args.vocab_size}; the target has E={ta.hidden_size}, V={ta.vocab_size}")
        if max(head.config.feature_layers) > target.num_layers:
            raise DrafterError(f"block head reads target layer {max(head.config.feature_layers)} but the target has "
                               f"{target.num_layers} layers")
        self.head = head.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
        self.target = target
        self.hidden_layers: tuple[int, ...] = tuple(head.config.feature_layers)
        self.kv_bucket = kv_bucket
        self.cache: StaticKVCache | None = None
        self.forwards = 0
        self._backlog = FeatureBacklog()
        self._last_ctx: torch.Tensor | None = None  # [B, 1, E] context feature of each row's position L - 1

    @property
    def block_size(self) -> int:
        return self.head.block_size

    @property
    def dtype_bytes(self) -> int:
        return torch.finfo(self.target.dtype).bits // 8

    # ---- protocol -----------------------------------------------------------------------------
    def _ensure_cache(self, state: DecodeState) -> None:
        b, t = state.tokens.shape
        c = self.cache
        if c is None or c.batch != b or c.max_len != t or c.k.dtype != self.target.dtype:
            self.cache = self.head.new_cache(b, t, self.target.dtype, self.target.device)
            self._last_ctx = None

    @torch.inference_mode()
    def reset(self, state: DecodeState) -> None:
        self._ensure_cache(state)
        self.cache.reset()
        zero = torch.zeros_like(state.prompt_lengths)
        self._last_ctx = None
        self._absorb(list(state.hidden), zero, state.prompt_lengths)
        self._backlog.reset(state.prompt_lengths)
        self.forwards = 0

    @torch.inference_mode()
    def reset_rows(self, state: DecodeState, rows: torch.Tensor, hidden: list[torch.Tensor]) -> None:
        """Project the new prompts' features of ``rows`` ``[R]`` (``hidden``, each ``[R, S, E]``)
        into those rows of the context cache; the next ``propose`` reads each one's last prompt
        feature (features the backlog still holds for them belong to the old requests: dropped)."""
        self._ensure_cache(state)
        b, t = state.tokens.shape
        s = hidden[0].shape[1]
        pos = torch.arange(s, device=rows.device)[None].expand(rows.numel(), s).clamp(max=t - 1)  # [R, S]
        ctx = self.head.absorb(self.cache.rows(rows), [h.to(self.target.dtype) for h in hidden], pos)  # [R, S, E]
        plens = state.prompt_lengths.index_select(0, rows)  # [R]
        last = (plens - 1).clamp_min(0)  # [R] position L - 1
        if self._last_ctx is None:
            self._last_ctx = ctx.new_zeros(b, 1, ctx.shape[-1])
        self._last_ctx[rows] = ctx.gather(1, last[:, None, None].expand(-1, 1, ctx.shape[-1]))
        self._backlog.reset_rows(rows, plens, b)

    @torch.inference_mode()
    def commit(self, state: DecodeState) -> None:
        """Hold the step's features (entry i of ``state.hidden`` at ``prev_lengths + i``) for the
        next ``propose`` (billed to the draft phase); project them now when K = 0 steps have
        piled up more than the backlog's limit."""
        self._backlog.push(state)
        if self._backlog.full:
            self._absorb(*self._backlog.take(state.lengths))

    @torch.inference_mode()
    def propose(self, state: DecodeState, k: int) -> Draft:
        if not 1 <= k <= self.block_size:
            raise DrafterError(f"the block head drafts at most {self.block_size} tokens per forward (its block "
                               f"size); got k={k}. Use k <= {self.block_size} or train a head with a larger block")
        taken = self._backlog.take(state.lengths)
        if taken is not None:
            self._absorb(*taken)
        assert self.cache is not None and self._last_ctx is not None, "reset() must run before propose()"
        b, t = state.tokens.shape
        dev = state.tokens.device
        assert state.pending.shape == (b,) and state.lengths.shape == (b,), "pending and lengths are [B]"
        base = state.lengths  # [B] position of the pending token; context is every slot below it
        offs = torch.arange(k + 1, device=dev)
        positions = (base[:, None] + offs).clamp_(max=t - 1)  # [B, K+1]
        num_keys = min(t, round_up(state.max_length_bound + k, self.kv_bucket))
        visible = torch.arange(num_keys, device=dev)[None] < (base + k + 1)[:, None]  # [B, Tk]
        mask = visible[:, None, None, :].expand(b, 1, k + 1, num_keys)
        logits = self.head.draft(self.target, state.pending, k, self._last_ctx, positions, self.cache, mask,
                                 num_keys)  # [B, K, V] fp32
        self.forwards += 1
        if state.sampling.greedy:
            return Draft(tokens=logits.argmax(-1), probs=None)
        q = probs_from_logits(logits, state.sampling)  # [B, K, V]
        tokens = sample(q.reshape(b * k, -1), state.generator).view(b, k)
        return Draft(tokens=tokens, probs=q)

    def _absorb(self, hidden: list[torch.Tensor], start: torch.Tensor, count: torch.Tensor) -> None:
        """Project target features (each ``[B, S, E]``, column i at position ``start + i``) into
        the context cache; rows with ``count`` ``[B]`` > 0 committed columns take column
        ``count - 1`` (position L - 1) as their last context feature, the others keep theirs."""
        assert self.cache is not None
        s = hidden[0].shape[1]
        t = self.cache.max_len
        pos = (start[:, None] + torch.arange(s, device=start.device)).clamp_(max=t - 1)  # [B, S]
        ctx = self.head.absorb(self.cache, [h.to(self.target.dtype) for h in hidden], pos)  # [B, S, E]
        idx = (count - 1).clamp_(0, s - 1)[:, None, None].expand(-1, 1, ctx.shape[-1])
        last = ctx.gather(1, idx)  # [B, 1, E]
        self._last_ctx = last if self._last_ctx is None else torch.where((count > 0)[:, None, None], last,
                                                                         self._last_ctx)

    def roofline_model(self, target_args) -> DrafterModel:
        """One forward of K tokens per row through the head's layers (``in_fc`` fusing 2E -> E)."""
        return DrafterModel(name="block", layers=self.head.num_layers, fc_inputs=2 if self.head.in_fc is not None else 0,
                            parallel=True)


# ---- finding heads and the registry ------------------------------------------------------------
def head_name(target_name: str) -> str:
    """Directory name of the block head of a target id or model directory."""
    return head_files.head_dir_name(target_name, "block")


def head_search_path(target_name: str) -> list[Path]:
    """Where a head for ``target_name`` is looked for, in order: the heads shipped with
    refspec, then ``$REFSPEC_HOME/heads``."""
    return head_files.head_search_path(target_name, "block")


#: Training settings of a quick CPU head (the first shipped SmolLM2 head's). The shipped head
#: now trained on more data for 7,000 steps (its README.md), which takes hours on a CPU.
QUICK_RECIPE = ("--dtype fp32 --chat-prompts 24 --math-prompts 8 --code-prompts 8 --reply-tokens 96 "
                "--chat-references 64 --math-references 16 --code-references 16 --prose-chunks 24 "
                "--max-len 256 --steps 500 --lr 2e-3 --max-time-min 15 --checkpoint-every 50 "
                "--option anchors_per_row=16")


def train_command(target_name: str) -> str:
    """The command that trains the block head of ``target_name`` into
    ``$REFSPEC_HOME/heads/<id>-block`` (where :func:`find_head` looks)."""
    return head_files.train_command(target_name, "block", QUICK_RECIPE)


def find_head(target_name: str) -> Path:
    """The directory of the block head for ``target_name``.

    Raises:
        HeadNotFoundError: none exists; the message names the places searched and the
            command that trains one.
    """
    return head_files.find_head(target_name, "block", files=(CONFIG_FILE, WEIGHTS_FILE), recipe=QUICK_RECIPE,
                                note="a quick recipe, under 25 min on 2 CPU cores (the shipped SmolLM2 head's "
                                     "README has a longer one)",
                                error=HeadNotFoundError)


def register_builtin(register) -> None:
    """Register ``block`` (options: ``head``, a head directory, refspec's or a published DFlash
    draft; default: the trained head of the target, see :func:`find_head`)."""

    def build(ctx):
        path = ctx.options.get("head")
        folder = Path(path) if path else find_head(ctx.target_name)
        if block_dflash.is_dflash(folder):  # a published DFlash draft (see refspec.drafters.block_dflash)
            head = block_dflash.load_dflash(folder, ctx.target, dtype=ctx.dtype, device=ctx.device)
        else:
            head = BlockHead.load(folder, target_args=ctx.target.args, dtype=ctx.dtype, device=ctx.device)
        log.info("block head from %s (block size %d, %d layers)", folder, head.block_size, head.num_layers)
        return BlockDrafter(head, ctx.target)

    register("block", build, help="one forward drafts a block of K tokens from the target's features (DFlash-style)",
             default_k=DEFAULT_K)
