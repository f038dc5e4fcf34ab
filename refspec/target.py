"""What the decode loop calls on a target: :class:`TargetForward`.

The engine (:class:`~refspec.engine.Engine`), its step (:func:`refspec.step.verify_forward`,
:func:`refspec.step.prefill`), the phase loops and the draft-model drafter run a target only
through these members. A ``refspec.models.Transformer`` satisfies the protocol as built (the
reference), and so does what ``refspec.models.prepare_target`` returns for a run (the same
model with its CPU GEMM plan, compiled step, CUDA graphs or tensor-parallel share).
"""
from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch

from refspec.cache import StaticKVCache
from refspec.config import ModelArgs


@runtime_checkable
class TargetForward(Protocol):
    """A decoder the engine can run: forwards over a static cache, packed prefill, its cache.

    Attributes:
        args: the architecture (vocabulary, layers, window, ...).
        device: where its weights and caches live.
        dtype: its parameters' dtype (the cache's too).
        num_layers: L, blocks run per forward (a self-draft runs fewer than ``args`` has).
    """

    @property
    def args(self) -> ModelArgs: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def num_layers(self) -> int: ...

    def __call__(self, tokens: torch.Tensor | None, positions: torch.Tensor, cache: StaticKVCache, *,
                 slots: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                 sliding_mask: torch.Tensor | None = None, num_keys: int | None = None,
                 logits_at: torch.Tensor | None = None, hidden_layers: tuple[int, ...] = (),
                 inputs_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """Run new tokens ``[B, S]`` at ``positions [B, S]``, writing their K/V into ``cache``.

        Args:
            tokens: ``[B, S]`` token ids (None with ``inputs_embeds``).
            positions: ``[B, S]`` rotary positions.
            cache: the cache written, at ``slots`` (default: ``positions``).
            slots: ``[B, S]`` cache slots.
            mask: ``[B, 1, S, Tk]`` bool visibility for full-attention layers (default: causal).
            sliding_mask: the same for sliding-window layers.
            num_keys: Tk, the prefix of cache slots attended (default: the cache's T).
            logits_at: ``[B, M]`` query indices whose logits are wanted (default: all S).
            hidden_layers: layer outputs to return (``L``: the final-normed state).
            inputs_embeds: ``[B, S, E]`` instead of embedding ``tokens``.

        Returns:
            ``(logits [B, M, V] fp32 or None, [hidden [B, S, E] per requested layer])``.
        """
        ...

    def prefill(self, tokens: torch.Tensor, seq_lens: Sequence[int], cache: StaticKVCache, rows: torch.Tensor, *,
                hidden_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Prefill R prompts ``tokens [N]`` of ``seq_lens`` into cache ``rows [R]`` in one packed
        forward; returns ``(logits [R, V] fp32, [hidden [R, S_max, E] per requested layer])``."""
        ...

    def new_cache(self, batch: int, max_len: int) -> StaticKVCache:
        """A cache of ``batch`` rows and ``max_len`` slots this target's forwards can write."""
        ...


__all__ = ["TargetForward"]
