"""An opt-in compiled decode and verify step for CPUs: ``torch.compile`` of the static-shape
forward, the CPU counterpart of :mod:`refspec.cuda_graphs`.

An eager SmolLM2 step makes about a thousand ATen calls, each with microseconds of Python and
dispatch around it; compiled, a step is one call into generated C++ (elementwise ops fused,
products sent to the same BLAS). :class:`CompiledStep` is called with ``Transformer.forward``'s
signature; ``refspec.models.prepare_target(model, compile=True)`` runs a target's steps through
it. The eager model stays the reference.

How one call runs:

1. **key**: Tk, the hidden layers asked for, the grad mode and the shape, strides, dtype and
   inference flag of every tensor input and of the cache (what the graph's guards check). The engine
   already rounds Tk up to its ``kv_bucket``; ``keys_bucket`` rounds it further for chain steps
   (the causal mask hides every extra slot). Each key is compiled once with ``dynamic=False``
   and ``fullgraph=True`` (a graph break is an error, not a silent slow path).
2. **run**: the compiled forward on the caller's own cache (written in place, as eagerly).
   Calls it cannot serve run the eager model: more than ``max_tokens_per_row`` tokens per row
   (prefill), input embeddings, or a weight copy gone stale (a weight changed or replaced since
   :class:`~refspec.models.gemm_forms.WeightCopy` made it: the graph would read the copy). The Linears
   checked are the model's at construction: wrap the model after replacing modules.
3. **account**: the compiled graph records no work; the wrapper records the forward's
   :meth:`~refspec.models.Transformer.forward_shape` as the eager forward would.

:class:`CompileStats` counts compiles (new keys), recompiles (a compile on a call whose key was
compiled before: a guard failed, which should not happen within a bucket) and the seconds the
first call of each key took (compile time included).

**Equality policy.** Inductor fuses elementwise chains and keeps their intermediates in fp32,
so compiled logits match the eager ones within rounding (not bit for bit); greedy tokens are
asserted equal in fp32 only, as for CUDA graphs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import types
from typing import Any

import torch

from refspec.cache import StaticKVCache
from refspec.config import round_up
from refspec.energy.model.work import record_forward, recording
from refspec.models.cpu_speed import copied_linears, gemm_form
from refspec.models.gemm_forms import without_onednn

log = logging.getLogger(__name__)

_NO_PATCH = contextlib.nullcontext()

DEFAULT_MAX_TOKENS_PER_ROW = 16
"""Largest S served compiled; longer forwards (prefill) run eagerly."""

DEFAULT_KEYS_BUCKET = 256
"""Tk of chain steps is rounded up to this many slots: one compile covers 256 positions (a
SmolLM2 compile takes a minute or more; the extra masked keys cost a few MB a step)."""


class CompileError(RuntimeError):
    """``torch.compile`` cannot serve this model here (no C++ compiler, a graph break)."""


@dataclasses.dataclass
class CompileStats:
    """What a :class:`CompiledStep` did.

    Attributes:
        compiles: keys compiled (one per static shape).
        recompiles: compiles on calls whose key was already compiled (guard failures).
        compiled_calls: calls served by a compiled forward.
        eager_calls: calls passed to the eager model (see ``eager_reasons``).
        eager_reasons: why, with counts.
        compile_s: wall seconds of the first call of every key (compilation included).
    """

    compiles: int = 0
    recompiles: int = 0
    compiled_calls: int = 0
    eager_calls: int = 0
    eager_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    compile_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _signature(t: torch.Tensor | None) -> tuple | None:
    """What a static graph's guards check of a tensor input: shape, strides, dtype, inference flag."""
    return None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.is_inference())


def _graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process (a global counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _static_forward(model, tokens: torch.Tensor, positions: torch.Tensor, cache, slots: torch.Tensor | None,
                    mask: torch.Tensor | None, sliding_mask: torch.Tensor | None, num_keys: int,
                    logits_at: torch.Tensor | None, hidden_layers: tuple[int, ...]):
    """``Transformer.forward`` without its work record (the wrapper records outside the graph)."""
    return model.forward_unrecorded(tokens, positions, cache, num_keys, slots=slots, mask=mask,
                                    sliding_mask=sliding_mask, logits_at=logits_at, hidden_layers=hidden_layers)


class CompiledStep:
    """``torch.compile``-d static-shape forward of a model (see the module docstring).

    Args:
        model: a ``refspec.models.Transformer``.
        max_tokens_per_row: largest S compiled; longer forwards run eagerly.
        keys_bucket: round Tk of chain steps up to a multiple of this, at most the cache's T
            (fewer compiles, a few more masked keys read); None keeps the caller's Tk.
        max_keys: compiled shapes allowed before further keys run eagerly (each costs a
            compile: seconds on a small model).
        backend: ``torch.compile``'s backend: ``inductor`` (generated C++), or ``eager``
            (traced by dynamo, run by ATen: the wrapper's logic without code generation).
    """

    def __init__(self, model: Any, *, max_tokens_per_row: int = DEFAULT_MAX_TOKENS_PER_ROW,
                 keys_bucket: int | None = DEFAULT_KEYS_BUCKET, max_keys: int = 64,
                 backend: str = "inductor") -> None:
        if model.device.type != "cpu":
            raise CompileError(f"the compiled step is for CPU models (use CUDA graphs on {model.device})")
        self.model = model
        self.max_tokens_per_row = max_tokens_per_row
        self.keys_bucket = keys_bucket
        self.max_keys = max_keys
        self.stats = CompileStats()
        self._keys: set[tuple] = set()
        # dynamo keeps compiled code per code object: a copy of the forward's code per wrapper
        # keeps each wrapper's shapes (and their recompile limit) its own
        fn = types.FunctionType(_static_forward.__code__.replace(), _static_forward.__globals__, "_static_forward")
        self._fn = torch.compile(fn, backend=backend, dynamic=False, fullgraph=True)
        # the Linears that may multiply through a WeightCopy: their copies are checked before each call
        self._linears = copied_linears(model)

    def __repr__(self) -> str:
        return f"CompiledStep(keys={len(self._keys)}, compiles={self.stats.compiles})"

    def new_cache(self, batch: int, max_len: int) -> StaticKVCache:
        """The model's own cache: the compiled forward writes it in place, as the eager one does."""
        return self.model.new_cache(batch, max_len)

    def _eager_reason(self, s: int, embeds: torch.Tensor | None, key: tuple) -> str | None:
        if s > self.max_tokens_per_row:
            return f"{s} tokens per row exceed max_tokens_per_row={self.max_tokens_per_row} (prefill)"
        if embeds is not None:
            return "input embeddings are not compiled"
        if key not in self._keys and len(self._keys) >= self.max_keys:
            return f"max_keys={self.max_keys} shapes are compiled already"
        for lin in self._linears:
            copy = None if lin.gemm is None else lin.gemm.copy
            if copy is not None and copy.of(lin.weight) is None:
                return "a weight changed since its copy was made"
        return None

    def __call__(self, tokens: torch.Tensor | None, positions: torch.Tensor, cache: Any, *,
                 slots: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                 sliding_mask: torch.Tensor | None = None, num_keys: int | None = None,
                 logits_at: torch.Tensor | None = None, hidden_layers: tuple[int, ...] = (),
                 inputs_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """The model's forward, compiled for this call's static shape (see ``Transformer.forward``)."""
        b, s = positions.shape
        tk = cache.max_len if num_keys is None else int(num_keys)
        if self.keys_bucket and mask is None and sliding_mask is None:
            tk = min(cache.max_len, round_up(tk, self.keys_bucket))
        hidden_layers = tuple(hidden_layers)
        key = (tk, hidden_layers, torch.is_grad_enabled(),
               *map(_signature, (tokens, positions, slots, mask, sliding_mask, logits_at, cache.k, cache.v)))
        reason = self._eager_reason(s, inputs_embeds, key)
        if reason is not None:
            self._note_eager(reason)
            return self.model(tokens, positions, cache, slots=slots, mask=mask, sliding_mask=sliding_mask,
                              num_keys=num_keys, logits_at=logits_at, hidden_layers=hidden_layers,
                              inputs_embeds=inputs_embeds)
        new = key not in self._keys
        before, start = _graphs_compiled(), time.perf_counter()
        try:
            # a new key is one more compiled entry: allow it (dynamo stops compiling at its limit)
            with torch._dynamo.config.patch(recompile_limit=max(8, len(self._keys) + 1)) if new else _NO_PATCH:
                args = (self.model, tokens, positions, cache, slots, mask, sliding_mask, tk, logits_at, hidden_layers)
                if gemm_form(self.model, b * s) == "nodnn":  # the graph's products run as linear() would
                    logits, hidden = without_onednn(self._fn, *args)
                else:
                    logits, hidden = self._fn(*args)
        except Exception as exc:  # inductor's errors have many types; all mean "cannot compile here"
            if not new:
                raise
            raise CompileError(f"torch.compile failed for the step {key}: {type(exc).__name__}: "
                               f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}") from exc
        compiled = _graphs_compiled() - before
        if new:
            self._keys.add(key)
            self.stats.compiles += 1
            self.stats.compile_s += time.perf_counter() - start
            log.info("compiled the step for B=%d S=%d Tk=%d in %.1f s", b, s, tk, time.perf_counter() - start)
        elif compiled:
            self.stats.recompiles += 1
            log.warning("recompiled the step for B=%d S=%d Tk=%d (a guard failed)", b, s, tk)
        self.stats.compiled_calls += 1
        if recording():
            lm_rows = 0 if logits is None else logits.shape[0] * logits.shape[1]
            record_forward(self.model.forward_shape(b, s, tk, lm_rows))
        return logits, hidden

    def _note_eager(self, reason: str) -> None:
        self.stats.eager_calls += 1
        seen = self.stats.eager_reasons.get(reason, 0)
        self.stats.eager_reasons[reason] = seen + 1
        if not seen:
            log.debug("eager forward: %s", reason)


__all__ = ["CompiledStep", "CompileStats", "CompileError", "DEFAULT_MAX_TOKENS_PER_ROW", "DEFAULT_KEYS_BUCKET"]
