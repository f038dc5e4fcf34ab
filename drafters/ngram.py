"""Prompt-lookup (n-gram) drafting: copy what followed the last occurrence of the row's suffix.

For each row, the longest suffix of its tokens (prompt + output, ending with the pending
token) of length ``max_n`` down to ``min_n`` that also occurs earlier in the row proposes the
K tokens that followed its most recent earlier occurrence. Rows without a match propose a
repeat of the pending token (verified, and almost always rejected, like any draft). All rows
are matched at once with tensor ops; the only Python loop runs over n.
"""
from __future__ import annotations

import torch

from refspec.drafting import DecodeState, Draft, DrafterError
from refspec.phases import ForwardShape


class NgramDrafter:
    """Deterministic prompt-lookup drafter (one-hot q when sampling).

    Args:
        max_n: longest suffix to match.
        min_n: shortest suffix to match.
    """

    name = "ngram"
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, *, max_n: int = 3, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise DrafterError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n

    def reset(self, state: DecodeState) -> None:
        return None

    def propose(self, state: DecodeState, k: int) -> Draft:
        tokens = state.tokens  # [B, T]
        b, t = tokens.shape
        end = state.lengths  # [B] index of the pending token (the suffix ends here)
        span = min(t, state.max_length_bound + 1)  # only the filled prefix can match
        seq = tokens[:, :span]
        found = torch.zeros(b, dtype=torch.bool, device=tokens.device)
        start = torch.zeros(b, dtype=torch.long, device=tokens.device)  # where the continuation starts
        for n in range(self.max_n, self.min_n - 1, -1):
            if n >= span:
                continue
            offs = torch.arange(n, device=tokens.device)
            suffix_idx = (end[:, None] - n + 1 + offs).clamp_min(0)  # [B, n]
            suffix = tokens.gather(1, suffix_idx)
            windows = seq.unfold(1, n, 1)  # [B, span-n+1, n]
            hit = (windows == suffix[:, None, :]).all(-1)  # [B, span-n+1]
            j = torch.arange(hit.shape[1], device=tokens.device)
            # an earlier occurrence must end before the pending token, leaving a continuation
            valid = hit & (j[None] + n <= end[:, None]) & (end[:, None] - n + 1 >= 0)
            last = torch.where(valid, j[None], torch.full_like(j[None], -1)).max(1).values  # most recent
            new = (last >= 0) & ~found
            start = torch.where(new, last + n, start)
            found |= new
        idx = (start[:, None] + torch.arange(k, device=tokens.device)).clamp(max=t - 1)
        cont = tokens.gather(1, idx)  # [B, K]
        # continuation entries beyond the row's known tokens are unknown: repeat the pending token
        known = idx <= end[:, None]
        draft = torch.where(found[:, None] & known, cont, state.pending[:, None].expand(b, k))
        return Draft(tokens=draft, probs=None)

    def commit(self, state: DecodeState) -> None:
        return None

    def draft_work(self, state: DecodeState, k: int) -> tuple[ForwardShape, ...]:
        return ()

    def prefill_work(self, state: DecodeState) -> tuple[ForwardShape, ...]:
        return ()


def register_builtin(register) -> None:
    """Register ``ngram`` (options: ``max_n``, ``min_n``)."""

    def build(ctx):
        return NgramDrafter(max_n=int(ctx.options.get("max_n", 3)), min_n=int(ctx.options.get("min_n", 1)))

    register("ngram", build, help="prompt lookup: copy what followed the row's last matching n-gram", default_k=4)
