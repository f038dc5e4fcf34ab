"""Target features a feature drafter has not fed into its own cache yet.

EAGLE and block drafters keep a cache of the target's features, one entry per committed
position, and feed a step's features (``state.hidden`` after ``commit``) at the start of the
next ``propose``, so the draft phase is billed for it. A step the speculation policy runs with
K = 0 calls ``commit`` but no ``propose``; its features (and those of the step before it) must
still reach the drafter's cache before the next draft, or the drafter would read stale entries.
:class:`FeatureBacklog` holds every step's features since the drafter last fed its cache and
hands them over as one block per layer, each row's committed positions packed from the first
position its cache lacks.

Worked example (one row): the cache is valid below position 10 (``fed``); a K = 4 step
verified 5 positions at 10..14 and accepted 1 (advance 2: positions 10, 11 committed); a K = 0
step then committed position 12. :meth:`FeatureBacklog.take` returns the features of 10, 11,
12 in columns 0..2 (``start`` 10, ``count`` 3); the 3 rejected columns of the first step are
dropped. With one step since the last feed (fixed K) the step's own ``state.hidden`` is
returned as it is, rejected columns included (they sit past the committed length, where the
drafter overwrites them before any read).

Shapes: B batch, W columns handed over, E model dim.
"""
from __future__ import annotations

import torch

from refspec.drafting import DecodeState

DEFAULT_LIMIT = 32
"""Columns held before the owner should feed them (a long run of K = 0 steps stays bounded)."""


class FeatureBacklog:
    """Per-step target features not yet in a drafter's cache.

    Args:
        limit: columns (summed step widths) beyond which :attr:`full` asks the owner to feed them.
    """

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self.limit = limit
        self._entries: list[tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]] = []  # (hidden, prev, advance)
        self._fed: torch.Tensor | None = None  # [B] first position the drafter's cache lacks
        self._width = 0  # columns held (a host bound of W)
        self._refilled = False  # rows were reset since the last take: no fast path

    @property
    def empty(self) -> bool:
        return not self._entries

    @property
    def full(self) -> bool:
        """Whether more than ``limit`` columns are held."""
        return self._width > self.limit

    def reset(self, fed: torch.Tensor) -> None:
        """A new batch: the drafter's cache is valid below ``fed`` ``[B]`` (the prompts)."""
        self._entries, self._width, self._refilled = [], 0, False
        self._fed = fed.clone()

    def reset_rows(self, rows: torch.Tensor, fed: torch.Tensor, batch: int) -> None:
        """Rows ``[R]`` took new requests whose cache is valid below ``fed`` ``[R]``: their
        held columns (the old requests') are dropped."""
        if self._fed is None or self._fed.shape[0] != batch:
            self._entries, self._width = [], 0
            self._fed = torch.zeros(batch, dtype=torch.long, device=rows.device)
        self._fed[rows] = fed
        self._entries = [(h, prev, adv.index_fill(0, rows, 0)) for h, prev, adv in self._entries]
        self._refilled = True

    def push(self, state: DecodeState) -> None:
        """Hold the features of the step just committed (``state.hidden``, entry i at
        ``prev_lengths + i``; the first ``lengths - prev_lengths`` of them committed)."""
        assert self._fed is not None, "reset() or reset_rows() must run before push()"
        advance = state.lengths - state.prev_lengths  # [B]; 0 for a done row
        self._entries.append((list(state.hidden), state.prev_lengths.clone(), advance))
        self._width += state.hidden[0].shape[1]

    def take(self, lengths: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor] | None:
        """Hand over every held column; the cache is then valid below ``lengths`` ``[B]``.

        Returns:
            None when nothing is held; else ``(features, start [B], count [B])``: per layer
            ``[B, W, E]`` whose column j belongs to position ``start + j``, the first ``count``
            columns of each row committed.
        """
        if not self._entries:
            return None
        entries, fed = self._entries, self._fed
        self._entries, self._width, self._fed = [], 0, lengths.clone()
        if len(entries) == 1 and not self._refilled:  # the usual step: fed == prev_lengths in every row
            hidden, prev, advance = entries[0]
            return hidden, prev, advance
        self._refilled = False
        w = sum(h[0].shape[1] for h, _, _ in entries)
        out = [h.new_zeros(h.shape[0], w + 1, h.shape[2]) for h in entries[0][0]]  # column w: dump
        for hidden, prev, advance in entries:
            cols = torch.arange(hidden[0].shape[1], device=prev.device)[None]  # [1, Wi]
            idx = prev[:, None] + cols - fed[:, None]  # [B, Wi] column of each committed position
            idx = torch.where(cols < advance[:, None], idx, torch.full_like(idx, w)).clamp_(0, w)
            for buf, h in zip(out, hidden):
                buf.scatter_(1, idx[..., None].expand(-1, -1, h.shape[2]), h.to(buf.dtype))
        count = sum(adv for _, _, adv in entries)  # [B] committed positions since fed
        return [buf[:, :w] for buf in out], fed, count


__all__ = ["FeatureBacklog", "DEFAULT_LIMIT"]
