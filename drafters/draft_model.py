"""A smaller language model as drafter (Leviathan et al. 2023), with its own static KV cache.

Any refspec ``Transformer`` serves: a real smaller sibling (Qwen2.5-Coder 0.5B for 1.5B, the
default for larger Qwen2 targets) or the target's own first layers (``self:N``, a cheap
self-draft for tests; it accepts almost nothing untrained). A target without a pinned sibling
has no default: the drafter asks for ``--draft-model``.

Cache consistency without copies: the draft cache always holds the row's tokens up to the
target's committed length minus one. Each step's first draft forward feeds two tokens, the
last committed token and the pending one, at positions ``L-1`` and ``L``. Re-writing ``L-1``
is harmless when the drafter already had it (same token, same prefix) and is the catch-up
when every draft was accepted (the last draft was sampled, never fed). The remaining K-1
forwards feed one draft each. After S steps without a draft (K = 0 from the speculation
policy; each commits one token per row) the first forward feeds the S + 2 tokens from
``L-1-S`` on instead.
"""
from __future__ import annotations

import dataclasses

import torch

from refspec.config import round_up
from refspec.drafting import DecodeState, Draft, DrafterError
from refspec.energy.model.roofline import DrafterModel
from refspec.sampling import probs_from_logits, sample
from refspec.target import TargetForward


class DraftModelDrafter:
    """Autoregressive drafting with a smaller model.

    Args:
        model: the draft model (same vocabulary as the target): a ``Transformer``, or one readied
            by ``refspec.models.prepare_target`` (:class:`~refspec.target.TargetForward`).
        target_vocab_size: the target's V (the draft's V may be smaller, never larger).
        draft_fingerprint / target_fingerprint: tokenizer fingerprints; a mismatch is refused.
        kv_bucket: attended cache prefix granularity.
    """

    name = "draft-model"
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, model: TargetForward, *, target_vocab_size: int, draft_fingerprint: str | None = None,
                 target_fingerprint: str | None = None, kv_bucket: int = 64) -> None:
        if draft_fingerprint is not None and target_fingerprint is not None and draft_fingerprint != target_fingerprint:
            raise DrafterError(
                "the draft model's tokenizer differs from the target's (fingerprints "
                f"{draft_fingerprint[:12]} vs {target_fingerprint[:12]}): draft token ids would mean other "
                "strings to the target, so acceptance would be meaningless; pick a draft model of the same family")
        if model.args.vocab_size > target_vocab_size:
            raise DrafterError(f"draft vocabulary ({model.args.vocab_size}) is larger than the target's "
                               f"({target_vocab_size}); the tokenizers cannot be the same")
        self.model = model
        self.target_vocab = target_vocab_size
        self.kv_bucket = kv_bucket
        self.cache = None
        self.forwards = 0  # draft forwards run (a statistic for tests and reports)
        self._behind = 0  # steps committed without a propose since the last one (K = 0)
        self._drafted = False  # this step ran propose

    @property
    def dtype_bytes(self) -> int:
        return torch.finfo(self.model.dtype).bits // 8

    def reset(self, state: DecodeState) -> None:
        b, t = state.tokens.shape
        if self.cache is None or self.cache.batch != b or self.cache.max_len != t:
            self.cache = self.model.new_cache(b, t)
        self.cache.reset()
        s = int(state.prompt_lengths.max().item())
        pos = torch.arange(s, device=state.tokens.device)[None].expand(b, s)
        self.model(state.tokens[:, :s].to(self.model.device), pos, self.cache,
                   num_keys=min(t, round_up(s, self.kv_bucket)), logits_at=pos[:, :0])
        self.forwards = 0
        self._behind, self._drafted = 0, False

    def reset_rows(self, state: DecodeState, rows: torch.Tensor, hidden: list[torch.Tensor]) -> None:
        """Prefill the new prompts of ``rows`` ``[R]`` into those rows of the draft cache (their
        old entries are overwritten or never attended again)."""
        b, t = state.tokens.shape
        if self.cache is None or self.cache.batch != b or self.cache.max_len != t:
            self.cache = self.model.new_cache(b, t)
        plens = state.prompt_lengths.index_select(0, rows)  # [R]
        s = int(plens.max().item())
        pos = torch.arange(s, device=state.tokens.device)[None].expand(rows.numel(), s)
        tokens = state.tokens.index_select(0, rows)[:, :s]
        self.model(tokens.to(self.model.device), pos, self.cache.rows(rows),
                   num_keys=min(t, round_up(s, self.kv_bucket)), logits_at=pos[:, :0])

    def _next(self, logits: torch.Tensor, state: DecodeState) -> tuple[torch.Tensor, torch.Tensor | None]:
        if logits.shape[-1] < self.target_vocab:  # a draft vocabulary short of the target's
            pad = torch.full((*logits.shape[:-1], self.target_vocab - logits.shape[-1]), float("-inf"),
                             device=logits.device)
            logits = torch.cat([logits, pad], dim=-1)
        if state.sampling.greedy:
            return logits.argmax(-1), None
        q = probs_from_logits(logits, state.sampling)
        return sample(q, state.generator), q

    def propose(self, state: DecodeState, k: int) -> Draft:
        b, t = state.tokens.shape
        dev = state.tokens.device
        num_keys = min(t, round_up(state.max_length_bound + k + 1, self.kv_bucket))
        last = state.lengths  # [B] position of the pending token
        pos = (last[:, None] + torch.arange(-1 - self._behind, 1, device=dev)).clamp_(0, t - 1)  # [B, S+2]
        self._behind, self._drafted = 0, True
        inp = state.tokens.gather(1, pos)
        drafts, probs = [], []
        for i in range(k):
            logits, _ = self.model(inp, pos, self.cache, num_keys=num_keys,
                                   logits_at=torch.full((b, 1), pos.shape[1] - 1, device=dev, dtype=torch.long))
            self.forwards += 1
            tok, q = self._next(logits[:, 0], state)
            drafts.append(tok)
            probs.append(q)
            inp, pos = tok[:, None], (last + i + 1).clamp(max=t - 1)[:, None]
        tokens = torch.stack(drafts, dim=1)
        return Draft(tokens=tokens, probs=None if state.sampling.greedy else torch.stack(probs, dim=1))

    def commit(self, state: DecodeState) -> None:
        # the next propose re-derives the draft cache position from the target's; a step without
        # a draft left one more committed token unfed
        self._behind, self._drafted = self._behind + (not self._drafted), False

    def roofline_model(self, target_args) -> DrafterModel:
        """A separate model running its own layers (a truncated target runs only its first)."""
        args = self.model.args
        if self.model.num_layers != args.num_layers:
            types = args.layer_types[: self.model.num_layers]
            args = dataclasses.replace(args, num_layers=self.model.num_layers, layer_types=types)
        return DrafterModel(name="draft-model", args=args)


PINNED_DRAFT = "qwen2.5-coder-0.5b"
"""The one pinned model that drafts for others: Qwen2.5-Coder-0.5B, for larger Qwen2 targets."""


def default_draft_model(target) -> str | None:
    """The draft model used when none is given: Qwen2.5-Coder-0.5B for a Qwen2 target larger than it, else None.

    No pinned model shares another target's tokenizer, and the target's own first layers accept
    almost nothing without training (an early layer's hidden state read by the final LM head),
    so a default could only lose: :func:`missing_draft_model` asks for one instead.
    """
    args = target.args
    larger = args.num_layers * args.hidden_size ** 2 > 24 * 896 ** 2  # Qwen2.5-Coder-0.5B: 24 layers of 896
    return PINNED_DRAFT if args.family == "qwen2" and larger else None


def missing_draft_model(target_name: str) -> str:
    """The one-line request for ``--draft-model`` when the target has no default draft."""
    return (f"--drafter draft-model needs --draft-model for {target_name}: no pinned model smaller than it shares "
            f"its tokenizer; give a model id or Hugging Face directory of one (a smaller sibling of the same "
            f"family), or self:N for the target's first N layers (they accept almost nothing untrained)")


def register_builtin(register) -> None:
    """Register ``draft-model`` (option ``draft_model``: a model id, a directory, or ``self:N``
    for the target's first N layers; default: Qwen2.5-Coder-0.5B for larger Qwen2 targets, else
    the option is required)."""

    def build(ctx):
        spec = ctx.options.get("draft_model")
        if spec is None:
            spec = default_draft_model(ctx.target)
        if spec is None:
            raise DrafterError(missing_draft_model(ctx.target_name))
        if str(spec).startswith("self:"):
            model = ctx.target.truncated(int(str(spec).split(":", 1)[1]))
            return DraftModelDrafter(model, target_vocab_size=ctx.target.args.vocab_size)
        from refspec.assets import resolve_model
        from refspec.models import load_model, prepare_target
        from refspec.assets.tokenizer import load_tokenizer

        path = resolve_model(str(spec))
        model = prepare_target(load_model(path, dtype=ctx.dtype, device=ctx.device))  # this machine's CPU GEMM plan
        fp = load_tokenizer(path).fingerprint() if (path / "tokenizer.json").exists() else None
        return DraftModelDrafter(model, target_vocab_size=ctx.target.args.vocab_size, draft_fingerprint=fp,
                                 target_fingerprint=ctx.tokenizer_fingerprint)

    register("draft-model", build, help="a smaller model of the same tokenizer (or the target's first layers)",
             default_k=4)
