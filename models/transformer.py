"""One pure-PyTorch decoder for the llama, qwen2, qwen3 and gemma3 families and the
mixture-of-experts qwen3_moe and mixtral families (:mod:`refspec.models.moe`).

Every forward writes K/V into a :class:`refspec.cache.StaticKVCache` at per-row slots and
attends through a boolean mask built from positions (or an explicit tree mask), so step
shapes never change. Module names are refspec's own; ``refspec.models.loading`` maps
Hugging Face checkpoint names onto them.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

import torch
from torch import nn

from refspec.cache import StaticKVCache, causal_mask
from refspec.config import ModelArgs
from refspec.energy.model.work import ForwardShape, record_forward, recording
from refspec.models.attention import CacheAttention, PackedAttention
from refspec.models.layers import Block, Linear, RMSNorm
from refspec.models.moe import DISPATCH, MoE
from refspec.models.ops import attention_bias, rope_inv_freq, rope_tables


class Transformer(nn.Module):
    """Decoder-only transformer built from :class:`ModelArgs`.

    Args:
        args: architecture.
        num_layers: build only the first ``num_layers`` blocks (a cheap self-draft); the
            final norm and LM head are kept.
    """

    def __init__(self, args: ModelArgs, num_layers: int | None = None) -> None:
        super().__init__()
        self.args = args
        self.work_args = args  # what its forwards report as run (a tensor-parallel shard: its share, refspec.models.tp)
        n = args.num_layers if num_layers is None else num_layers
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args, i) for i in range(n))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.norm_plus_one)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.sliding_window = _window(args, self.layers)
        self.init_buffers()

    # ---- set-up -------------------------------------------------------------------------------
    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """(Re)compute rotary frequencies; call after loading weights onto a device."""
        a = self.args
        dev = device if device is not None else (self.embed.weight.device if self.embed.weight.device.type != "meta" else "cpu")
        global_scaling = a.rope_scaling
        self.inv_freq_global = rope_inv_freq(a.head_dim, a.rope_theta, global_scaling).to(dev)
        self.inv_freq_local = rope_inv_freq(a.head_dim, a.rope_local_theta, None).to(dev)
        for moe in self._moe_layers():
            moe.reset_touched(dev)

    def _moe_layers(self) -> list[MoE]:
        return [blk.mlp for blk in self.layers if isinstance(blk.mlp, MoE)]

    def set_moe_dispatch(self, dispatch: str) -> None:
        """Expert dispatch of every MoE layer: ``gather``, ``grouped`` or ``dense`` (:mod:`refspec.models.moe`)."""
        if dispatch not in DISPATCH:
            raise ValueError(f"MoE dispatch must be one of {DISPATCH}, got {dispatch!r}")
        for moe in self._moe_layers():
            moe.dispatch = dispatch

    def experts_touched(self) -> int | torch.Tensor | None:
        """Distinct experts the last forward routed to, summed over MoE layers (None: a dense
        model, or a forward being captured into a CUDA graph, whose work is not billed).

        On a CPU an int; on a GPU a 0-dim device tensor, a snapshot of the layers' counters taken
        without a host sync (each forward or graph replay would otherwise wait for the GPU): it
        is read with ``int()`` after the step's own synchronisation."""
        if not self.args.is_moe:
            return None  # a dense model: no layer scan
        moes = self._moe_layers()
        if not moes or (moes[0].touched.is_cuda and torch.cuda.is_current_stream_capturing()):
            return None
        total = torch.stack([m.touched for m in moes]).sum()  # [] int64, on the layers' device
        return int(total) if total.device.type == "cpu" else total

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def heads(self) -> tuple[int, int]:
        """``(Hkv, G)`` of its attention modules (a tensor-parallel shard holds a share of the heads)."""
        attn = self.layers[0].attn
        return attn.hkv, attn.h // attn.hkv

    def new_cache(self, batch: int, max_len: int) -> StaticKVCache:
        """A static cache sized for this model."""
        a = self.args
        return StaticKVCache(num_layers=self.num_layers, batch=batch, num_kv_heads=self.heads()[0], max_len=max_len,
                             head_dim=a.head_dim, dtype=self.dtype, device=self.device)

    def truncated(self, num_layers: int) -> "Transformer":
        """A model that shares this one's weights but runs only its first blocks."""
        if not 1 <= num_layers <= self.num_layers:
            raise ValueError(f"num_layers must be in 1..{self.num_layers}, got {num_layers}")
        small = Transformer.__new__(Transformer)
        nn.Module.__init__(small)
        small.args, small.work_args = self.args, self.work_args
        small.embed, small.norm, small.lm_head = self.embed, self.norm, self.lm_head
        small.layers = nn.ModuleList(list(self.layers)[:num_layers])
        small.inv_freq_global, small.inv_freq_local = self.inv_freq_global, self.inv_freq_local
        small.sliding_window = _window(self.args, small.layers)
        return small

    def multirow_matrix_bytes(self, rows: int | None = None) -> int | None:
        """Bytes per element the matrices stream in products of 2 or more rows (of ``rows`` rows,
        when given) when that differs from the parameter size, else None; for
        :attr:`refspec.energy.model.work.ForwardShape.matrix_bytes`. A plain model streams its
        parameters; a CPU GEMM plan that multiplies through copies of another dtype says so
        (:meth:`~refspec.models.gemm_forms.GemmChoice.multirow_element_bytes`, read off the LM head)."""
        gemm = self.lm_head.gemm
        return None if gemm is None else gemm.multirow_element_bytes(self.lm_head.weight, rows)

    def attention_bias(self, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """:func:`attention_bias` for this model's head layout."""
        return attention_bias(mask, *self.heads(), dtype)

    # ---- forward ------------------------------------------------------------------------------
    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Input embeddings ``[B, S, E]`` (scaled by sqrt(E) for gemma3)."""
        x = self.embed(tokens)
        if self.args.embed_scale:
            x = x * torch.tensor(self.args.hidden_size ** 0.5, dtype=x.dtype)
        return x

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """LM head on final-normed hidden states; returns fp32 logits."""
        out = self.lm_head(h).float()
        cap = self.args.final_logit_softcapping
        if cap:
            out = torch.tanh(out / cap) * cap
        return out

    def forward_shape(self, rows: int, tokens_per_row: int, num_keys: int, lm_head_tokens: int) -> ForwardShape:
        """The work of one forward of ``rows x tokens_per_row`` queries over ``num_keys`` cache
        slots per row, ``lm_head_tokens`` of which reach the LM head (what :meth:`forward` records;
        a CUDA-graph replay records the same for the forward it replays). An MoE model's shape
        carries the distinct experts its last forward routed to (:meth:`experts_touched`)."""
        sliding = self.sliding_window is not None
        return ForwardShape(args=self.work_args, rows=rows, tokens_per_row=tokens_per_row, context_tokens=rows * num_keys,
                            sliding_context_tokens=rows * num_keys if sliding else None,
                            dtype_bytes=torch.finfo(self.dtype).bits // 8, lm_head_tokens=lm_head_tokens,
                            layers=self.num_layers,
                            matrix_bytes=self.multirow_matrix_bytes(rows * tokens_per_row),
                            experts_touched=self.experts_touched())

    def prefill_shape(self, seq_lens: Sequence[int]) -> ForwardShape:
        """The work of one :meth:`prefill` of prompts of ``seq_lens``: their real tokens only, and
        per prompt dense masked attention over its own S_i keys (S_i^2 pairs per layer)."""
        n, pairs, sliding = sum(seq_lens), sum(s * s for s in seq_lens), self.sliding_window is not None
        shape = self.forward_shape(len(seq_lens), max(seq_lens), 0, len(seq_lens))
        return dataclasses.replace(shape, query_tokens=n, context_tokens=n, attention_pairs=pairs,
                                   sliding_context_tokens=n if sliding else None,
                                   sliding_attention_pairs=pairs if sliding else None,
                                   matrix_bytes=self.multirow_matrix_bytes(n))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache, *,
                slots: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                sliding_mask: torch.Tensor | None = None, num_keys: int | None = None,
                logits_at: torch.Tensor | None = None, hidden_layers: tuple[int, ...] = (),
                inputs_embeds: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """Run the decoder over new tokens, writing their K/V into ``cache``; records its
        :meth:`forward_shape` (:func:`refspec.energy.model.work.record_forward`).

        Args:
            tokens: ``[B, S]`` token ids.
            positions: ``[B, S]`` rotary positions.
            cache: static cache; entries are written at ``slots``.
            slots: ``[B, S]`` cache slots (default: ``positions``).
            mask: ``[B, 1, S, Tk]`` bool visibility for full-attention layers (default:
                causal on slots, from ``positions``).
            sliding_mask: same for sliding-window layers (default: causal + window).
            num_keys: Tk, the prefix of cache slots attended (default T). Must cover every
                slot any query may see.
            logits_at: ``[B, M]`` query indices whose logits are wanted (default all S);
                an empty ``[B, 0]`` tensor skips the LM head.
            hidden_layers: layer outputs to return: ``i < L`` is the residual stream after
                block ``i``; ``i == L`` the final-normed state.
            inputs_embeds: ``[B, S, E]`` to use instead of embedding ``tokens``.

        Returns:
            ``(logits [B, M, V] fp32 or None, [hidden [B, S, E] per requested layer])``.
        """
        tk = cache.max_len if num_keys is None else num_keys
        logits, hidden = self.forward_unrecorded(tokens, positions, cache, tk, slots=slots, mask=mask,
                                                 sliding_mask=sliding_mask, logits_at=logits_at,
                                                 hidden_layers=hidden_layers, inputs_embeds=inputs_embeds)
        if recording():
            b, s = positions.shape
            record_forward(self.forward_shape(b, s, tk, 0 if logits is None else logits.shape[0] * logits.shape[1]))
        return logits, hidden

    def forward_unrecorded(self, tokens: torch.Tensor | None, positions: torch.Tensor, cache: StaticKVCache,
                           num_keys: int, *, slots: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                           sliding_mask: torch.Tensor | None = None, logits_at: torch.Tensor | None = None,
                           hidden_layers: tuple[int, ...] = (), inputs_embeds: torch.Tensor | None = None,
                           ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """:meth:`forward` with Tk given and no work record (a compiled step records outside its graph)."""
        self._check_hidden_layers(hidden_layers)
        x = self.embed_tokens(tokens) if inputs_embeds is None else inputs_embeds  # [B, S, E]
        rope = self._rope(positions, x.dtype)
        full = causal_mask(positions, num_keys) if mask is None else mask
        if self.sliding_window is not None and sliding_mask is None:
            sliding_mask = causal_mask(positions, num_keys, self.sliding_window)
        bias = (self.attention_bias(full, x.dtype),
                None if self.sliding_window is None else self.attention_bias(sliding_mask, x.dtype))
        ctx = CacheAttention(cache, positions if slots is None else slots, num_keys, rope, bias)
        x, hidden = self._blocks(x, ctx, hidden_layers)
        logits = self._head(x, logits_at, hidden, self.num_layers in hidden_layers)
        return logits, [hidden[i] for i in hidden_layers]

    def prefill(self, tokens: torch.Tensor, seq_lens: Sequence[int], cache: StaticKVCache, rows: torch.Tensor, *,
                hidden_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Prefill R prompts of different lengths in one packed forward over their real tokens only;
        records :meth:`prefill_shape`.

        Prompt i's K/V go to cache row ``rows[i]``, slots ``0..S_i-1``; each of its tokens attends
        only the prompt's earlier tokens (causal, within the window on sliding layers). No
        position past a prompt is computed and no padded key is attended.

        Args:
            tokens: ``[N]`` the R prompts concatenated (N = sum of ``seq_lens``).
            seq_lens: R prompt lengths S_i >= 1 (host ints).
            cache: the cache written (a :class:`~refspec.cache.StaticKVCache` or a CUDA-graph
                runner's :class:`~refspec.graph_buffers.CacheView`).
            rows: ``[R]`` distinct cache row of each prompt.
            hidden_layers: as for :meth:`forward`.

        Returns:
            ``(logits [R, V] fp32 at each prompt's last token, [hidden [R, S_max, E] per
            requested layer, zero past each prompt])``.
        """
        seq_lens = [int(s) for s in seq_lens]
        r, n = len(seq_lens), sum(seq_lens)
        if not seq_lens or min(seq_lens) < 1 or max(seq_lens) > cache.max_len:
            raise ValueError(f"prefill needs 1 or more prompts of 1..{cache.max_len} tokens, got lengths {seq_lens}")
        if tuple(tokens.shape) != (n,) or tuple(rows.shape) != (r,):
            raise ValueError(f"prefill takes tokens [N={n}] and rows [R={r}], got {tuple(tokens.shape)} "
                             f"and {tuple(rows.shape)}")
        self._check_hidden_layers(hidden_layers)
        dev = tokens.device
        positions = torch.cat([torch.arange(s, device=dev) for s in seq_lens])[None]  # [1, N] place in its prompt
        x = self.embed_tokens(tokens[None])  # [1, N, E]
        ctx = PackedAttention(cache, rows.to(dev), seq_lens, positions, self._rope(positions, x.dtype),
                              self.heads(), self.sliding_window, x.dtype)
        x, hidden = self._blocks(x, ctx, hidden_layers)
        last = torch.tensor(list(itertools.accumulate(seq_lens)), device=dev) - 1  # [R] each prompt's last token
        if self.num_layers in hidden_layers:
            hidden[self.num_layers] = self.norm(x)
            logits = self.logits(hidden[self.num_layers][0, last])  # [R, V]
        else:
            logits = self.logits(self.norm(x[0, last]))
        prompt = torch.arange(r, device=dev).repeat_interleave(torch.tensor(seq_lens, device=dev))  # [N]
        padded = []
        for i in hidden_layers:  # [1, N, E] -> [R, S_max, E], zero past each prompt
            h = hidden[i]
            padded.append(h.new_zeros(r, max(seq_lens), h.shape[-1]).index_put_((prompt, positions[0]), h[0]))
        if recording():
            record_forward(self.prefill_shape(seq_lens))
        return logits, padded

    def _check_hidden_layers(self, hidden_layers: tuple[int, ...]) -> None:
        bad = sorted(i for i in hidden_layers if not 0 <= i <= self.num_layers)
        if bad:
            raise ValueError(f"hidden layers {bad} are out of range for {self.num_layers} layers")

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple:
        """Rotary tables ``(full layers, sliding layers)`` of ``positions`` (sliding None without sliding layers)."""
        full = rope_tables(positions, self.inv_freq_global, dtype)
        return full, (None if self.sliding_window is None else rope_tables(positions, self.inv_freq_local, dtype))

    def _blocks(self, x: torch.Tensor, ctx, hidden_layers: tuple[int, ...]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Every block over ``x [B, S, E]``; returns the output and the residual stream after each
        requested block."""
        hidden: dict[int, torch.Tensor] = {}
        for i, blk in enumerate(self.layers):
            x = blk(x, ctx)
            if i in hidden_layers:
                hidden[i] = x
        return x, hidden

    def _head(self, x: torch.Tensor, logits_at: torch.Tensor | None, hidden: dict[int, torch.Tensor],
              want_final: bool) -> torch.Tensor | None:
        """Final norm and LM head over ``x [B, S, E]`` (only at ``logits_at`` when given); stores
        the final-normed state in ``hidden`` when ``want_final``."""
        b = x.shape[0]
        need_logits = logits_at is None or logits_at.shape[1] > 0
        if not need_logits and not want_final:
            return None
        if logits_at is not None and not want_final:  # norm only the rows the LM head reads
            h = self.norm(x.gather(1, logits_at[..., None].expand(b, logits_at.shape[1], x.shape[-1])))
        else:
            h = self.norm(x)
            if want_final:
                hidden[self.num_layers] = h
            if logits_at is not None:
                h = h.gather(1, logits_at[..., None].expand(b, logits_at.shape[1], h.shape[-1]))
        return self.logits(h) if need_logits else None


def _window(args: ModelArgs, layers: nn.ModuleList) -> int | None:
    """The window of the sliding-attention layers, or None when no layer slides."""
    return args.sliding_window if any(blk.sliding for blk in layers) else None
