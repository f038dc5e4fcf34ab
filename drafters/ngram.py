"""Prompt-lookup (n-gram) drafting: copy what followed the last occurrence of the row's suffix.

For each row, the longest suffix of its tokens (prompt + output, ending with the pending
token) of length ``max_n`` down to ``min_n`` that also occurs earlier in the row proposes the
K tokens that followed its most recent earlier occurrence. Rows without a match propose a
repeat of the pending token (verified, and almost always rejected, like any draft). All rows
are matched at once with tensor ops; the only Python loop runs over n.

Trimming (option ``trim``): a draft position that no row can fill from a match is still a
position the target computes. Where verifying extra positions is dear (a compute-bound
verification, as on many CPUs) those positions cost nearly as much as useful ones, so with
``trim`` the draft is cut to the longest continuation any row of the batch found (0 when no row
matched: that step is a plain decoding step). The cut length is read on the host (one extra sync
per step) and varies from step to step, so the verify shape does too: where verification is
nearly free (memory-bound, and shapes should stay static for CUDA graphs) trimming is off.

Shortest match (option ``min_n``): a continuation found from a single matching token is a
weak guess; where verifying extra positions is dear, a step drafted from it costs more than it
returns, so rows draft only from matches of 2 or more tokens there and from 1-token matches
elsewhere.

Both default to ``auto``: "dear" is decided from what the active CPU GEMM plan measured on this
machine (a 5-row product against a 1-row one, :meth:`~refspec.models.calibration.GemmPlan.extra_position_cost`),
never from the device's kind: dear when it exceeds :data:`DEAR_VERIFY_RATIO`; without a
measurement (GPUs, the reference plan) verification counts as nearly free.
"""
from __future__ import annotations

import torch

from refspec.drafting import DecodeState, Draft, DrafterError
from refspec.models.ops import gemm_plan

DEAR_VERIFY_RATIO = 1.5
"""A 5-row product dearer than this many 1-row products makes extra verified positions dear."""


def verification_is_dear(tokens: torch.Tensor, dtype_bytes: int) -> bool:
    """Whether the measured cost of verifying extra positions on this machine is high (see the
    module docstring); False where nothing was measured."""
    if tokens.device.type != "cpu":
        return False
    cost = gemm_plan().extra_position_cost(torch.float32 if dtype_bytes == 4 else torch.bfloat16)
    return cost is not None and cost > DEAR_VERIFY_RATIO


class NgramDrafter:
    """Deterministic prompt-lookup drafter (one-hot q when sampling).

    Args:
        max_n: longest suffix to match.
        min_n: shortest suffix to match, or None for "2 where verification is dear, else 1"
            (capped at ``max_n``; see the module docstring).
        trim: cut the draft to the longest continuation found in the batch: True, False, or
            None for "where verification is dear" (see the module docstring).
    """

    name = "ngram"
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, *, max_n: int = 3, min_n: int | None = None, trim: bool | None = None) -> None:
        if max_n < 1 or (min_n is not None and not 1 <= min_n <= max_n):
            raise DrafterError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n, self.trim = max_n, min_n, trim

    def reset(self, state: DecodeState) -> None:
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
        dear = verification_is_dear(tokens, state.dtype_bytes) if None in (self.min_n, self.trim) else False
        min_n = self.min_n if self.min_n is not None else min(2 if dear else 1, self.max_n)
        found = torch.zeros(b, dtype=torch.bool, device=tokens.device)
        start = torch.zeros(b, dtype=torch.long, device=tokens.device)  # where the continuation starts
        for n in range(self.max_n, min_n - 1, -1):
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
        useful = found[:, None] & known  # [B, K]
        draft = torch.where(useful, cont, state.pending[:, None].expand(b, k))
        trim = self.trim if self.trim is not None else dear
        if trim:
            longest = int((useful & ~state.done[:, None]).sum(1).max())  # host sync; known is a prefix
            draft = draft[:, :longest]
        return Draft(tokens=draft, probs=None)

    def commit(self, state: DecodeState) -> None:
        return None

    def roofline_model(self, target_args) -> None:
        """None: a lookup runs no forward, so a prediction charges its draft phase nothing."""
        return None


def register_builtin(register) -> None:
    """Register ``ngram`` (options: ``max_n``, ``min_n`` = auto|N, ``trim`` = auto|true|false)."""

    def build(ctx):
        trim = str(ctx.options.get("trim", "auto")).lower()
        if trim not in ("auto", "true", "false", "1", "0", "yes", "no"):
            raise DrafterError(f"ngram option trim must be auto, true or false, got {trim!r}")
        min_n = str(ctx.options.get("min_n", "auto")).lower()
        try:
            return NgramDrafter(max_n=int(ctx.options.get("max_n", 3)), min_n=None if min_n == "auto" else int(min_n),
                                trim=None if trim == "auto" else trim in ("true", "1", "yes"))
        except ValueError:
            raise DrafterError(f"ngram options max_n and min_n must be integers (min_n may be auto), "
                               f"got max_n={ctx.options.get('max_n', 3)!r}, min_n={min_n!r}") from None

    register("ngram", build, help="prompt lookup: copy what followed the row's last matching n-gram", default_k=4)
