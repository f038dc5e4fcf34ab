"""Static buffers of graph-served forwards: batch buckets, views of the KV pool, per-key inputs.

:class:`~refspec.cuda_graphs.GraphRunner` keeps one :class:`StaticBuffers` per
:class:`StepKey`; :func:`load` copies a call's real rows into the first B rows and padding
into the rest (a padded row is a fresh sequence of S tokens, see the runner's module
docstring), so the buffers' addresses never change between replays.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from refspec.cache import StaticKVCache, causal_mask


def batch_bucket(batch: int, buckets: Sequence[int]) -> int | None:
    """Smallest bucket holding ``batch`` rows, or None when ``batch`` exceeds every bucket."""
    for b in sorted(buckets):
        if b >= batch:
            return b
    return None


class CacheView(StaticKVCache):
    """The first ``batch`` rows and ``max_len`` slots of a runner's KV pool.

    Behaves as an ordinary :class:`~refspec.cache.StaticKVCache` (the engine, drafters and the
    eager model use it unchanged); its buffers are views of ``pool``, so what a graph writes
    through the pool is what the view reads.

    Args:
        pool: the runner's pool cache ``[L, R, Hkv, T_pool, D]``.
        batch: rows of the view (``<= R``).
        max_len: slots of the view (``<= T_pool``).
    """

    def __init__(self, pool: StaticKVCache, batch: int, max_len: int) -> None:  # noqa: D107
        # deliberately not StaticKVCache.__init__: the buffers are views, not new allocations
        if batch > pool.batch or max_len > pool.max_len:
            raise ValueError(f"a view of {batch} rows x {max_len} slots does not fit the pool "
                             f"({pool.batch} rows x {pool.max_len} slots)")
        self.pool = pool
        self.k = pool.k[:, :batch, :, :max_len]  # [L, B, Hkv, T, D]
        self.v = pool.v[:, :batch, :, :max_len]  # [L, B, Hkv, T, D]
        self.lengths = torch.zeros(batch, dtype=torch.long, device=pool.device)  # [B]
        self._rows = pool._rows[:batch]  # [B, 1]
        self.max_len = max_len
        self.batch = batch

    def keep_rows(self, rows: Sequence[int] | torch.Tensor) -> "CacheView":
        """Shrink the batch mid-run: keep ``rows`` (in that order) as rows ``0..n-1``.

        Copies the kept rows' K/V and lengths to the front of the pool (one gather, through a
        temporary, so overlapping rows are safe). The returned view replaces this one; later
        calls may then run in a smaller batch bucket.

        Args:
            rows: ``[n]`` indices of the rows to keep.

        Returns:
            A view of n rows.
        """
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.k.device)  # [n]
        n = idx.numel()
        if n == 0:
            raise ValueError("keep_rows needs at least one row")
        kept_k, kept_v = self.k.index_select(1, idx), self.v.index_select(1, idx)  # [L, n, Hkv, T, D]
        kept_len = self.lengths.index_select(0, idx)
        view = CacheView(self.pool, n, self.max_len)
        view.k.copy_(kept_k)
        view.v.copy_(kept_v)
        view.lengths.copy_(kept_len)
        return view


@dataclasses.dataclass(frozen=True)
class StepKey:
    """What one graph (or one set of static buffers) is specific to."""

    batch: int  # Bp, the bucket
    tokens_per_row: int  # S
    num_keys: int  # Tk
    hidden_layers: tuple[int, ...]
    logits_width: int | None  # M of logits_at [B, M], None for logits at every position
    tree: bool  # explicit slots and mask (tree verification)
    sliding: bool  # explicit sliding-window mask
    embeds: bool  # inputs_embeds instead of tokens


@dataclasses.dataclass
class StaticBuffers:
    """Static buffers of one key: inputs ``[Bp, ...]``, their padding values, outputs."""

    key: StepKey
    inputs: dict[str, torch.Tensor]
    pads: dict[str, torch.Tensor]
    logits: torch.Tensor | None = None  # [Bp, M, V] (graph output)
    hidden: list[torch.Tensor] = dataclasses.field(default_factory=list)  # [Bp, S, E] each
    graph: Any = None  # torch.cuda.CUDAGraph once captured


def allocate(key: StepKey, *, device: torch.device, sliding_window: int | None, tokens: torch.Tensor | None,
             embeds: torch.Tensor | None) -> StaticBuffers:
    """Static inputs of one key and their padding values (a padded row is a fresh sequence of S)."""
    bp, s, tk = key.batch, key.tokens_per_row, key.num_keys
    dev = device
    pad_pos = torch.arange(s, device=dev)[None].expand(bp, s).contiguous()  # [Bp, S] slots 0..S-1
    inputs: dict[str, torch.Tensor] = {"positions": torch.empty(bp, s, dtype=torch.long, device=dev)}
    pads: dict[str, torch.Tensor] = {"positions": pad_pos}
    if not key.embeds:
        assert tokens is not None, "tokens or inputs_embeds are needed"
        inputs["tokens"] = torch.empty(bp, s, dtype=torch.long, device=dev)
        pads["tokens"] = torch.zeros(bp, s, dtype=torch.long, device=dev)
    if key.embeds:
        assert embeds is not None
        e = embeds.shape[-1]
        inputs["embeds"] = torch.empty(bp, s, e, dtype=embeds.dtype, device=dev)
        pads["embeds"] = torch.zeros(bp, s, e, dtype=embeds.dtype, device=dev)
    if key.tree:
        inputs["slots"] = torch.empty(bp, s, dtype=torch.long, device=dev)
        pads["slots"] = pad_pos
        inputs["mask"] = torch.empty(bp, 1, s, tk, dtype=torch.bool, device=dev)
        pads["mask"] = causal_mask(pad_pos, tk)
    if key.sliding:
        inputs["sliding_mask"] = torch.empty(bp, 1, s, tk, dtype=torch.bool, device=dev)
        pads["sliding_mask"] = causal_mask(pad_pos, tk, sliding_window)
    if key.logits_width is not None:
        inputs["logits_at"] = torch.empty(bp, key.logits_width, dtype=torch.long, device=dev)
        pads["logits_at"] = torch.zeros(bp, key.logits_width, dtype=torch.long, device=dev)
    return StaticBuffers(key=key, inputs=inputs, pads=pads)


def load(entry: StaticBuffers, b: int, tk: int, **given: torch.Tensor | None) -> None:
    """Copy the real rows into rows ``0..B-1`` and padding into ``B..Bp-1`` (device ops only)."""
    for name, buf in entry.inputs.items():
        src = given[name]
        assert src is not None, f"static input {name!r} of this key was not given"
        if name in ("mask", "sliding_mask") and tk < buf.shape[-1]:
            buf[:b, ..., :tk].copy_(src)
            buf[:b, ..., tk:].fill_(False)  # slots beyond the caller's Tk stay invisible
        else:
            buf[:b].copy_(src)
        if b < buf.shape[0]:
            buf[b:].copy_(entry.pads[name][b:])


__all__ = ["batch_bucket", "CacheView", "StepKey", "StaticBuffers", "allocate", "load"]
