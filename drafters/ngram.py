"""Prompt-lookup (n-gram) drafting: copy what followed the last occurrence of the row's suffix.

For each row, the longest suffix of its tokens (prompt + output, ending with the pending
token) of length ``max_n`` down to ``min_n`` that also occurs earlier in the row proposes the
K tokens that followed its most recent earlier occurrence. Rows without a match propose a
repeat of the pending token (verified, and almost always rejected, like any draft). All rows
are matched at once with tensor ops; the only Python loop runs over n.

Every call drafts the K tokens it is asked for, so a step's shape is the engine's choice: how
many to draft in a step (none where verifying extra positions costs more than the accepted
drafts return) is the speculation policy's decision (:mod:`refspec.policy`), made from the
cost of the hardware the run measures or models, never from the machine that runs the code.

Example: row tokens ``[7 3 9 4 7 3]`` (pending ``3``), ``max_n`` 3, K 2: the suffix ``7 3``
occurred at positions 0..1, so the draft is what followed it, ``[9 4]``.
"""
from __future__ import annotations

import torch

from refspec.drafting import DecodeState, Draft, DrafterError

ACCEPTANCE_PRIOR = 0.5
"""Per-token acceptance a speculation policy assumes before it has seen an n-gram step (a
matched token accepted at 2^-i at draft position i, as prompt lookup's trimming used to assume)."""


class NgramDrafter:
    """Deterministic prompt-lookup drafter (one-hot q when sampling).

    Args:
        max_n: longest suffix to match.
        min_n: shortest suffix to match.
        trim: accepted for old callers: only False (the drafter drafts K whenever asked;
            cutting drafts short is a speculation policy's decision now).
    """

    name = "ngram"
    hidden_layers: tuple[int, ...] = ()
    acceptance_prior = ACCEPTANCE_PRIOR

    def __init__(self, *, max_n: int = 3, min_n: int = 1, trim: bool | None = None) -> None:
        if max_n < 1 or not 1 <= min_n <= max_n:
            raise DrafterError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if trim:
            raise DrafterError("the n-gram drafter no longer trims its drafts: it drafts K when asked; choose K per "
                               "step with a speculation policy instead (--spec-policy energy, off-above:B, k-by-batch)")
        self.max_n, self.min_n = max_n, min_n

    def reset(self, state: DecodeState) -> None:
        """Nothing to forget: matches are read from ``state.tokens``."""
        return None

    def reset_rows(self, state: DecodeState, rows: torch.Tensor, hidden: list[torch.Tensor]) -> None:
        """Nothing to forget: matches are read from ``state.tokens`` below each row's length."""
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
        useful = found[:, None] & (idx <= end[:, None])  # [B, K]
        return Draft(tokens=torch.where(useful, cont, state.pending[:, None].expand(b, k)), probs=None)

    def commit(self, state: DecodeState) -> None:
        return None  # no state: the next propose reads the committed tokens

    def roofline_model(self, target_args) -> None:
        """None: a lookup runs no forward, so a prediction charges its draft phase nothing."""
        return None


def register_builtin(register) -> None:
    """Register ``ngram`` (options: ``max_n``, ``min_n``; ``trim=false`` is accepted for old command lines)."""

    def build(ctx):
        trim = str(ctx.options.get("trim", "false")).lower()
        if trim not in ("false", "0", "no"):
            raise DrafterError(f"ngram option trim={trim} is gone: the drafter drafts K when asked; choose K per step "
                               f"with --spec-policy (energy, off-above:B, k-by-batch:...)")
        try:
            max_n, min_n = int(ctx.options.get("max_n", 3)), int(ctx.options.get("min_n", 1))
        except ValueError:
            raise DrafterError(f"ngram options max_n and min_n must be integers (min_n=auto is gone: it is 1 unless "
                               f"set), got max_n={ctx.options.get('max_n', 3)!r}, "
                               f"min_n={ctx.options.get('min_n', 1)!r}") from None
        return NgramDrafter(max_n=max_n, min_n=min_n)

    register("ngram", build, help="prompt lookup: copy what followed the row's last matching n-gram", default_k=4)
