"""A drafter to copy: propose what last followed each token in the row (a bigram table).

Copy this file anywhere, rename the class and run it without touching refspec::

    python -m refspec.eval --drafter example:BigramDrafter --drafter-option learn_output=false

(from the copy's folder; here it is also ``refspec.drafters.example:BigramDrafter``).
``docs/drafters.md`` walks through writing, registering, testing and measuring a drafter.

Worked example: row ``a b c a`` with pending token ``a`` and K = 3. The table says ``a`` was
last followed by ``b`` (position 0 -> 1), ``b`` by ``c``, ``c`` by ``a``: the draft is
``b c a``. A token never seen with a successor repeats itself (verified and, like any draft,
most likely rejected).
"""
from __future__ import annotations

import torch

from refspec.drafting import DecodeState, Draft, DrafterError


class BigramDrafter:
    """Deterministic bigram drafter: runs no forward, so it costs nothing in the roofline.

    Args:
        learn_output: learn from the emitted tokens too (``"true"``), or from the prompt only.
    """

    name = "bigram"
    hidden_layers: tuple[int, ...] = ()  # target layers whose hidden states we read: none
    default_k = 4  # K when the user gives no --k

    def __init__(self, *, learn_output: str = "true") -> None:
        if str(learn_output).lower() not in ("true", "false"):
            raise DrafterError(f"bigram option learn_output must be true or false, got {learn_output!r}")
        self.learn_output = str(learn_output).lower() == "true"
        self.k = 0

    def reset(self, state: DecodeState) -> None:
        b, v = state.batch, state.target_args.vocab_size
        # last[b, t]: latest position of token t in row b whose successor is known, or -1
        self.last = torch.full((b, v), -1, dtype=torch.long, device=state.tokens.device)
        span = min(state.tokens.shape[1], state.max_length_bound)
        self._learn(state, torch.arange(span, device=state.tokens.device)[None].expand(b, span))

    def reset_rows(self, state: DecodeState, rows: torch.Tensor, hidden: list[torch.Tensor]) -> None:
        """Rows ``rows`` ``[R]`` hold new prompts (continuous batching): forget their table, learn the prompts."""
        b, v, dev = state.batch, state.target_args.vocab_size, state.tokens.device
        if getattr(self, "last", None) is None or self.last.shape != (b, v):
            self.last = torch.full((b, v), -1, dtype=torch.long, device=dev)
        lengths = state.lengths.index_select(0, rows)  # [R]
        span = int(lengths.max())
        positions = torch.arange(span, device=dev)[None].expand(rows.numel(), span)  # [R, span]
        where = torch.where(positions < lengths[:, None], positions, torch.full_like(positions, -1))
        table = torch.full((rows.numel(), v), -1, dtype=torch.long, device=dev)
        tokens = state.tokens.index_select(0, rows).gather(1, positions)
        self.last[rows] = table.scatter_reduce_(1, tokens, where, reduce="amax")

    def propose(self, state: DecodeState, k: int) -> Draft:
        self.k = k
        token, out = state.pending, []  # [B]
        for _ in range(k):
            at = self.last.gather(1, token[:, None])  # [B, 1]
            follower = state.tokens.gather(1, at + 1)[:, 0]  # at + 1 <= lengths: a known token
            token = torch.where(at[:, 0] >= 0, follower, token)
            out.append(token)
        return Draft(tokens=torch.stack(out, dim=1), probs=None)  # probs None: one-hot q

    def commit(self, state: DecodeState) -> None:
        if self.learn_output:  # positions prev_lengths .. lengths - 1 gained their successor
            self._learn(state, state.prev_lengths[:, None] + torch.arange(self.k + 1, device=state.tokens.device))

    def roofline_model(self, target_args: object) -> None:
        """No forward runs: None tells the roofline prediction this drafter is free."""
        return None

    def _learn(self, state: DecodeState, positions: torch.Tensor) -> None:
        """Record tokens at ``positions`` ``[B, W]`` that lie before the row's pending token."""
        known = positions < state.lengths[:, None]
        positions = positions.clamp(max=state.tokens.shape[1] - 1)
        where = torch.where(known, positions, torch.full_like(positions, -1))
        self.last.scatter_reduce_(1, state.tokens.gather(1, positions), where, reduce="amax")
