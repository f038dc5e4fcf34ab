"""Prompt-lookup (n-gram) drafting: copy what followed the last occurrence of the row's suffix.

For each row, the longest suffix of its tokens (prompt + output, ending with the pending
token) of length ``max_n`` down to ``min_n`` that also occurs earlier in the row proposes the
K tokens that followed its most recent earlier occurrence. Rows without a match propose a
repeat of the pending token (verified, and almost always rejected, like any draft). All rows
are matched at once with tensor ops; the only Python loop runs over n.

Trimming (option ``trim``): a draft position is a position the target computes for every row
of the batch, whether or not the row found a continuation for it. Where verifying extra
positions is dear (a compute-bound verification, as on many CPUs) they cost nearly as much as
useful ones. ``trim=true`` cuts the draft to the longest continuation any row of the batch
found (0 when no row matched: that step is a plain decoding step). ``trim=auto`` (the default),
where the CPU GEMM plan measured a product-cost curve (:meth:`~refspec.models.calibration.GemmPlan.product_cost`),
picks the draft length L that pays most: the most expected tokens per second of matrix products,
``(active rows + sum over rows of gain(min(continuation, L))) / cost(B * (L + 1) rows)``, where
``gain(m)`` sums, over draft positions 1..m, how often a matched token at that position was
accepted so far (:class:`PositionAcceptance`, counted at every commit from a prior of 2^-i at
position i); so a batch where verification is dear drafts less, or not at all. The
cut length is read on the host (one extra sync per step) and varies from step to step, so the
verify shape does too: where verification is nearly free (memory-bound, and shapes should stay
static for CUDA graphs) nothing is measured and trimming is off.

Shortest match (option ``min_n``): a continuation found from a single matching token is a
weak guess; where verifying extra positions is dear, a step drafted from it costs more than it
returns, so rows draft only from matches of 2 or more tokens there and from 1-token matches
elsewhere.

Both default to ``auto``: "dear" is decided from what the active CPU GEMM plan measured on this
machine (a 5-row product against a 1-row one, :meth:`~refspec.models.calibration.GemmPlan.extra_position_cost`),
never from the device's kind: dear when it exceeds :data:`DEAR_VERIFY_RATIO`; without a
measurement (GPUs, the reference plan) verification counts as nearly free. A plan without a
cost curve (older caches, hand-made plans) trims to the longest continuation where dear.
"""
from __future__ import annotations

import torch

from refspec.drafting import DecodeState, Draft, DrafterError
from refspec.models.ops import gemm_plan

DEAR_VERIFY_RATIO = 1.5
"""A 5-row product dearer than this many 1-row products makes extra verified positions dear."""


PRIOR_WEIGHT = 8.0
"""Matched draft tokens the acceptance prior of ``trim=auto`` counts as, per position."""


class PositionAcceptance:
    """How often a matched draft token at each position was accepted (``trim=auto``)."""

    def __init__(self, k: int) -> None:
        i = torch.arange(k, dtype=torch.float64)
        self.drafted = torch.full((k,), PRIOR_WEIGHT, dtype=torch.float64)  # [K]
        self.accepted = PRIOR_WEIGHT * 0.5 ** (i + 1)  # [K] prior: position i+1 accepted at 2^-(i+1)

    def gain(self) -> list[float]:
        """``gain[m]``: expected accepted tokens of a row drafting m matched tokens (``gain[0] = 0``)."""
        return [0.0] + (self.accepted / self.drafted).cumsum(0).tolist()

    def count(self, proposed: torch.Tensor, accepted: torch.Tensor) -> None:
        """Add one step: ``proposed [B]`` matched tokens drafted per row, ``accepted [B]`` accepted."""
        pos = torch.arange(len(self.drafted), device=proposed.device)
        self.drafted += (proposed[:, None] > pos).sum(0).double().cpu()
        self.accepted += (torch.minimum(accepted, proposed)[:, None] > pos).sum(0).double().cpu()


def _dtype(dtype_bytes: int) -> torch.dtype:
    return torch.float32 if dtype_bytes == 4 else torch.bfloat16


def verification_is_dear(tokens: torch.Tensor, dtype_bytes: int) -> bool:
    """Whether the measured cost of verifying extra positions on this machine is high (see the
    module docstring); False where nothing was measured."""
    if tokens.device.type != "cpu":
        return False
    cost = gemm_plan().extra_position_cost(_dtype(dtype_bytes))
    return cost is not None and cost > DEAR_VERIFY_RATIO


def paying_length(continuations: list[int], active: int, gain: list[float], cost) -> int:
    """The draft length L maximising ``(active + sum(gain[min(c, L)])) / cost(B * (L + 1))``
    over ``0 <= L <= max(continuations)``, for ``continuations[b]`` useful tokens per row,
    ``gain`` from :meth:`PositionAcceptance.gain` and ``cost(rows)`` the measured product cost."""
    rows = len(continuations)
    best_len, best = 0, active / cost(rows)
    for length in range(1, min(max(continuations, default=0), len(gain) - 1) + 1):
        tokens = active + sum(gain[min(c, length)] for c in continuations)
        value = tokens / cost(rows * (length + 1))
        if value > best:
            best_len, best = length, value
    return best_len


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
        self.acceptance: PositionAcceptance | None = None  # for trim=auto, made at the first draft
        self._proposed: torch.Tensor | None = None  # [B] matched tokens each row's last draft carried

    def reset(self, state: DecodeState) -> None:
        """A new batch starts from the acceptance prior (so a rerun drafts the same lengths)."""
        self.acceptance, self._proposed = None, None

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
        return Draft(tokens=draft[:, :self._length(state, useful, dear, k)], probs=None)

    def _length(self, state: DecodeState, useful: torch.Tensor, dear: bool, k: int) -> int:
        """How many of the K draft positions to verify (see the module docstring)."""
        plan_cost = gemm_plan().product_cost if state.tokens.device.type == "cpu" else None
        curve = self.trim is None and plan_cost is not None and plan_cost(_dtype(state.dtype_bytes), 1) is not None
        if not (self.trim or curve or (self.trim is None and dear)):
            self._proposed = None
            return k
        per_row = (useful & ~state.done[:, None]).sum(1)  # known is a prefix: the row's useful tokens
        counts = per_row.tolist()  # host sync
        if curve:
            if self.acceptance is None or len(self.acceptance.drafted) != k:
                self.acceptance = PositionAcceptance(k)
            length = paying_length(counts, len(counts) - int(state.done.sum()), self.acceptance.gain(),
                                   lambda rows: plan_cost(_dtype(state.dtype_bytes), rows))
        else:
            length = max(counts, default=0)
        self._proposed = per_row.clamp(max=length) if curve else None
        return length

    def commit(self, state: DecodeState) -> None:
        """Count the matched draft tokens accepted (for ``trim=auto``'s acceptance estimate)."""
        if self._proposed is not None and self.acceptance is not None and self._proposed.shape == state.num_accepted.shape:
            self.acceptance.count(self._proposed, state.num_accepted)
        self._proposed = None

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
