"""Where a block's attention writes its keys and values and what each query attends.

A decoder block is the same function in every forward; what differs is the layout of the
queries. :class:`Attention` (:mod:`refspec.models.layers`) projects and rotates q, k and v and
hands them to the forward's attention context:

- :class:`CacheAttention` (decode, verify, a lone prefill): row b's queries write their K/V at
  ``slots[b]`` of cache row b and attend the first Tk slots of that row through a mask.
- :class:`PackedAttention` (packed prefill): R prompts concatenated into one sequence of N
  tokens; prompt i's tokens write slots ``0..S_i-1`` of cache row ``rows[i]`` and attend only
  their own prompt's earlier tokens (causal, and within the window on sliding layers). No
  position past a prompt is computed and no other prompt's key is attended.

Each context also holds the rotary tables of its queries, one pair per layer kind (index 0
full-attention layers, 1 sliding-window layers).
"""
from __future__ import annotations

from typing import Sequence

import torch

from refspec.cache import causal_mask
from refspec.models.ops import attend, attention_bias

Rope = tuple[torch.Tensor, torch.Tensor]


class CacheAttention:
    """Attention of B rows of S queries over a prefix of their cache rows.

    Args:
        cache: a :class:`~refspec.cache.StaticKVCache` (or anything with its ``write``/``read``).
        slots: ``[B, S]`` cache slot of each query's key and value.
        num_keys: Tk, the prefix of slots attended.
        rope: ``(full, sliding)`` rotary tables, each ``(cos, sin)`` of ``[B, S, 1, D]``
            (sliding None without sliding layers).
        bias: ``(full, sliding)`` additive biases ``[B*Hkv, G*S, Tk]`` (see
            :func:`~refspec.models.ops.attention_bias`).
    """

    def __init__(self, cache, slots: torch.Tensor, num_keys: int, rope: tuple[Rope, Rope | None],
                 bias: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        self.cache, self.slots, self.num_keys = cache, slots, num_keys
        self.rope, self.bias = rope, bias

    def __call__(self, layer: int, sliding: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> torch.Tensor:
        """Write ``k, v [B, S, Hkv, D]`` at the slots, attend with ``q [B, S, H, D]``;
        returns ``[B, S, H*D]``."""
        b, s = q.shape[:2]
        self.cache.write(layer, self.slots, k, v)
        keys, values = self.cache.read(layer, self.num_keys)  # [B, Hkv, Tk, D] each
        return attend(q, keys, values, self.bias[sliding], scale).view(b, s, -1)


class PackedAttention:
    """Attention of R prompts packed into one sequence ``[1, N]`` (N = sum of their lengths).

    Args:
        cache: the cache written (a :class:`~refspec.cache.StaticKVCache` or a CUDA-graph
            runner's :class:`~refspec.graph_buffers.CacheView`).
        rows: ``[R]`` cache row of each prompt.
        seq_lens: R prompt lengths S_i (host ints).
        positions: ``[1, N]`` position of each token inside its prompt.
        rope: as for :class:`CacheAttention`, each table ``[1, N, 1, D]``.
        heads: ``(Hkv, G)`` of the model.
        window: the sliding window (None without sliding layers).
        dtype: the score dtype.
    """

    def __init__(self, cache, rows: torch.Tensor, seq_lens: Sequence[int], positions: torch.Tensor,
                 rope: tuple[Rope, Rope | None], heads: tuple[int, int], window: int | None,
                 dtype: torch.dtype) -> None:
        self.cache, self.rope = cache, rope
        self.spans = [(sum(seq_lens[:i]), s) for i, s in enumerate(seq_lens)]  # (start, S_i) per prompt
        self.token_rows = rows.repeat_interleave(torch.tensor(list(seq_lens), device=rows.device))  # [N]
        self.token_slots = positions[0]  # [N]
        # one bias per distinct prompt length and layer kind: [Hkv, G*S_i, S_i], causal inside the prompt
        self.bias: list[dict[int, torch.Tensor]] = []
        for win in (None, window):
            per_len = {}
            for s in sorted(set(seq_lens)):
                mask = causal_mask(torch.arange(s, device=positions.device)[None], s, win)  # [1, 1, S_i, S_i]
                per_len[s] = attention_bias(mask, *heads, dtype)
            self.bias.append(per_len)

    def __call__(self, layer: int, sliding: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> torch.Tensor:
        """Write ``k, v [1, N, Hkv, D]`` at (row, slot) of each token, attend each prompt's queries
        ``q [1, N, H, D]`` over its own keys; returns ``[1, N, H*D]``."""
        n = q.shape[1]
        self.cache.write_at(layer, self.token_rows, self.token_slots, k[0], v[0])
        keys, values = k.transpose(1, 2), v.transpose(1, 2)  # [1, Hkv, N, D]: a prompt's keys are its own tokens
        out = [attend(q[:, a:a + s], keys[:, :, a:a + s], values[:, :, a:a + s], self.bias[sliding][s], scale)
               for a, s in self.spans]  # [S_i, H*D] each
        return torch.cat(out).view(1, n, -1)


__all__ = ["CacheAttention", "PackedAttention"]
