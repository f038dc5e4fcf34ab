"""CUDA graphs for decode steps: static buffers per (batch bucket, tokens per row, keys).

A :class:`GraphRunner` runs a model's steps and is called exactly like the model's forward;
``refspec.models.prepare_target(model, cuda_graphs=True)`` runs a target's verify and plain
decode steps through one (``refspec.models.prepare.PreparedTarget(model, step=runner)`` with a
runner built here does the same for any runner, e.g. a draft model's), and takes the engine's
cache from its pool.

How one call runs (SGLang's scheme, adapted to refspec's static cache):

1. **bucket**: the call's B rows are padded to the smallest batch bucket ``Bp >= B``
   (default 1, 2, 4, 8, 16, 32, 64); the key is ``(Bp, S, Tk, hidden layers, logits_at
   width, tree mask?, input embeddings?)`` with S tokens per row and Tk attended key slots.
2. **copy in**: the real rows' inputs are copied into rows ``0..B-1`` of the key's static
   input buffers; rows ``B..Bp-1`` get the padding values (below). The buffers, the pool's
   views and the buckets live in :mod:`refspec.graph_buffers`.
3. **run**: on CUDA the key's graph is replayed (captured on first use, with the real inputs
   in place: warm-up and capture rewrite exactly what the step writes); elsewhere the same
   forward runs eagerly on the same static buffers ("eager-static" mode), so CPU tests cover
   every line of the bucketing and padding logic.
4. **copy out**: rows ``0..B-1`` of the static outputs are cloned (a later replay of any graph
   may overwrite static outputs; the clone is a device copy, no host sync).

**The KV pool.** A graph bakes in the addresses of the cache it writes, and the padded rows
need cache rows of their own. So the runner owns the cache: :meth:`GraphRunner.new_cache`
(the engine's cache, through its target's ``new_cache``) returns a :class:`CacheView` of the
first B rows and T slots of a pool ``[L, R, Hkv, T_pool, D]`` with ``R >= Bp``. Prefill and
every other eager forward write through the view; graphs write through the pool's first Bp
rows. One view per runner is live at a time (a new one reuses the pool). Continuous batching
refills slots eagerly through a :class:`~refspec.cache.RowView` of the view (the refilled
rows' own pool rows), while verify keeps running all B rows through the graph.

**Padding is harmless.** A padded row is a fresh sequence of length S: tokens 0, positions
and slots ``0..S-1`` (so its pending query sees one key, "length 1"), causal mask over those
slots, ``logits_at`` 0, zero input embeddings. It writes only slots ``0..S-1`` of its own pool
row ``>= B``, which no real row ever reads; rows are independent in every op of the forward,
so the padded rows' values (even NaN from stale pool contents) never reach a real row.

**No host sync in a step.** Loading, replay and copy-out are device ops; the shapes and the key
are host integers the caller already knows. Capture itself synchronises (once per key).

Calls the runner cannot serve with a graph fall back to the eager model, unchanged: a cache
that is not this runner's view, more rows than the largest bucket, more than
``max_tokens_per_row`` tokens per row (prefill), or a mask whose width is not Tk.

**Equality policy.** A graph replays the very kernels its eager-static run launches on the same
shapes, so graph output equals eager-static output bit for bit, in bf16 as in fp32 (GPU tests
assert it). Against the plain dynamic forward (B rows, no padding) the logits may differ in the
last bits because a different batch shape may select a different GEMM kernel; greedy tokens
are therefore asserted equal in fp32 only (CPU and GPU tests), never in bf16, where a near-tie
may flip.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

import torch

from refspec.cache import StaticKVCache
from refspec.config import round_up
from refspec.energy.model.work import WorkRecorder, record_forward, recording
from refspec.graph_buffers import CacheView, StaticBuffers, StepKey, allocate, batch_bucket, load

log = logging.getLogger(__name__)

DEFAULT_BATCH_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
"""Batch buckets graphs are captured for (SGLang and vLLM capture similar ladders)."""

DEFAULT_MAX_TOKENS_PER_ROW = 32
"""Largest S served by a graph; longer forwards (prefill) run eagerly."""


class CudaGraphError(RuntimeError):
    """CUDA graphs were asked for where they cannot run (no CUDA device, bad buckets)."""


@dataclasses.dataclass
class RunnerStats:
    """What a runner did (for tests and reports).

    Attributes:
        captures: graphs captured.
        replays: graph replays.
        static_calls: eager-static forwards (no capture).
        eager_calls: calls passed to the plain model (see ``eager_reasons``).
        eager_reasons: why each eager fallback happened, with counts.
    """

    captures: int = 0
    replays: int = 0
    static_calls: int = 0
    eager_calls: int = 0
    eager_reasons: dict[str, int] = dataclasses.field(default_factory=dict)


class GraphRunner:
    """Static-shape, optionally graph-captured forward of a model (see the module docstring).

    Args:
        model: a ``refspec.models.Transformer`` (or anything with its forward and
            ``new_cache``).
        capture: capture CUDA graphs (True), run eager-static (False), or decide by the
            model's device (None: capture on CUDA).
        batch_buckets: padded batch sizes.
        max_tokens_per_row: largest S served statically; longer forwards run eagerly.
        keys_bucket: round the attended key slots Tk up to a multiple of this (fewer graphs,
            a few more masked keys read); None keeps the caller's Tk.
        warmup_iters: eager runs on a side stream before a capture.

    Raises:
        CudaGraphError: ``capture=True`` for a model not on a CUDA device, or empty buckets.
    """

    def __init__(self, model: Any, *, capture: bool | None = None,
                 batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
                 max_tokens_per_row: int = DEFAULT_MAX_TOKENS_PER_ROW, keys_bucket: int | None = None,
                 warmup_iters: int = 2) -> None:
        on_cuda = model.device.type == "cuda"
        if capture is None:
            capture = on_cuda
        if capture and not on_cuda:
            raise CudaGraphError(f"CUDA graphs need a model on a CUDA device; this one is on {model.device}. "
                                 "Use capture=False (eager-static) or the plain model.")
        if not batch_buckets or min(batch_buckets) < 1:
            raise CudaGraphError(f"batch_buckets must be positive sizes, got {tuple(batch_buckets)}")
        self.model = model
        self.capture = bool(capture)
        self.batch_buckets = tuple(sorted(set(int(b) for b in batch_buckets)))
        self.max_tokens_per_row = max_tokens_per_row
        self.keys_bucket = keys_bucket
        self.warmup_iters = warmup_iters
        self.stats = RunnerStats()
        self._pool: StaticKVCache | None = None
        self._bucket_caches: dict[int, StaticKVCache] = {}
        self._entries: dict[StepKey, StaticBuffers] = {}
        self._mempool: Any = None

    def __repr__(self) -> str:
        mode = "cuda-graphs" if self.capture else "eager-static"
        return f"GraphRunner({mode}, buckets={self.batch_buckets}, graphs={len(self._entries)})"

    @property
    def mode(self) -> str:
        """``"cuda-graphs"`` or ``"eager-static"``."""
        return "cuda-graphs" if self.capture else "eager-static"

    @property
    def num_keys_prepared(self) -> int:
        """Keys with static buffers (each holds a captured graph in capture mode)."""
        return len(self._entries)

    # ---- the KV pool -----------------------------------------------------------------------
    def reserve(self, batch: int, max_len: int) -> None:
        """Make the pool hold at least ``bucket(batch)`` rows of ``max_len`` slots.

        Growing the pool reallocates it and drops every graph (they point at the old pool);
        call this once up front with the largest batch and length a run will use.
        """
        rows = max(batch_bucket(batch, self.batch_buckets) or batch, batch)
        pool = self._pool
        if pool is not None and pool.batch >= rows and pool.max_len >= max_len:
            return
        if pool is not None:
            rows, max_len = max(rows, pool.batch), max(max_len, pool.max_len)
            log.info("growing the KV pool to %d rows x %d slots; dropping %d graphs", rows, max_len,
                     len(self._entries))
        self._pool = None
        self._bucket_caches.clear()
        self._entries.clear()
        with torch.no_grad():
            self._pool = self.model.new_cache(rows, max_len)

    def new_cache(self, batch: int, max_len: int) -> CacheView:
        """A cache of ``batch`` rows and ``max_len`` slots backed by this runner's pool.

        Args:
            batch: B.
            max_len: T, slots per row.

        Returns:
            A :class:`CacheView` with lengths zero.
        """
        self.reserve(batch, max_len)
        assert self._pool is not None
        return CacheView(self._pool, batch, max_len)

    def _bucket_cache(self, rows: int) -> StaticKVCache:
        """The pool's first ``rows`` rows and all its slots: what a graph of that bucket writes."""
        c = self._bucket_caches.get(rows)
        if c is None:
            assert self._pool is not None
            c = self._bucket_caches[rows] = CacheView(self._pool, rows, self._pool.max_len)
        return c

    # ---- calls ------------------------------------------------------------------------------
    def _eager_reason(self, cache: Any, b: int, s: int, tk: int, mask: torch.Tensor | None,
                      sliding_mask: torch.Tensor | None) -> str | None:
        if not isinstance(cache, CacheView) or self._pool is None or cache.pool is not self._pool:
            return "the cache was not made by this runner's new_cache"
        if batch_bucket(b, self.batch_buckets) is None:
            return f"batch {b} exceeds the largest bucket {self.batch_buckets[-1]}"
        if s > self.max_tokens_per_row:
            return f"{s} tokens per row exceed max_tokens_per_row={self.max_tokens_per_row} (prefill)"
        if tk > self._pool.max_len:
            return f"num_keys {tk} exceeds the pool's {self._pool.max_len} slots"
        for m in (mask, sliding_mask):
            if m is not None and tuple(m.shape) != (b, 1, s, tk):
                return f"a mask of shape {tuple(m.shape)} is not [B, 1, S, Tk] = {(b, 1, s, tk)}"
        return None

    def __call__(self, tokens: torch.Tensor | None, positions: torch.Tensor, cache: StaticKVCache, *,
                 slots: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                 sliding_mask: torch.Tensor | None = None, num_keys: int | None = None,
                 logits_at: torch.Tensor | None = None, hidden_layers: tuple[int, ...] = (),
                 inputs_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """The model's forward, through static buffers (and a graph on CUDA).

        Args:
            tokens: ``[B, S]`` token ids (may be None with ``inputs_embeds``).
            positions: ``[B, S]`` rotary positions.
            cache: a :class:`CacheView` from :meth:`new_cache` (any other cache runs eagerly).
            slots: ``[B, S]`` cache slots (default: positions).
            mask: ``[B, 1, S, Tk]`` bool visibility (default: causal on positions).
            sliding_mask: ``[B, 1, S, Tk]`` for sliding-window layers.
            num_keys: Tk (default: the cache's T).
            logits_at: ``[B, M]`` query indices whose logits are wanted (default all S).
            hidden_layers: layer outputs to return (see ``Transformer.forward``).
            inputs_embeds: ``[B, S, E]`` instead of embedding ``tokens``.

        Returns:
            ``(logits [B, M, V] or None, [hidden [B, S, E] per requested layer])``, fresh
            tensors the caller owns.
        """
        b, s = positions.shape
        tk = cache.max_len if num_keys is None else int(num_keys)
        hidden_layers = tuple(hidden_layers)
        reason = self._eager_reason(cache, b, s, tk, mask, sliding_mask)
        if reason is not None:
            self._note_eager(reason)
            return self.model(tokens, positions, cache, slots=slots, mask=mask, sliding_mask=sliding_mask,
                              num_keys=num_keys, logits_at=logits_at, hidden_layers=hidden_layers,
                              inputs_embeds=inputs_embeds)
        key = self._key(b, s, tk, hidden_layers, logits_at=logits_at, tree=slots is not None or mask is not None,
                        sliding=sliding_mask is not None, embeds=inputs_embeds is not None)
        bp = key.batch
        with torch.inference_mode():
            entry = self._entries.get(key)
            if entry is None:
                window = getattr(self.model.args, "sliding_window", None)
                entry = self._entries[key] = allocate(key, device=self.model.device, sliding_window=window,
                                                      tokens=tokens, embeds=inputs_embeds)
            load(entry, b, tk, tokens=tokens, positions=positions, slots=slots, mask=mask, sliding_mask=sliding_mask,
                 logits_at=logits_at, embeds=inputs_embeds)
            if self.capture:
                if entry.graph is None:
                    with WorkRecorder():  # capture's forwards are set-up, not this call's work
                        self._capture(entry)
                entry.graph.replay()
                self.stats.replays += 1
                logits, hidden = entry.logits, entry.hidden
                if recording():  # a replay runs no Python forward: record the work of the forward it replays
                    lm_rows = 0 if logits is None else logits.shape[0] * logits.shape[1]
                    record_forward(self.model.forward_shape(bp, s, key.num_keys, lm_rows))
            else:
                logits, hidden = self._run(entry)
                self.stats.static_calls += 1
            return (None if logits is None else logits[:b].clone()), [h[:b].clone() for h in hidden]

    def _key(self, b: int, s: int, tk: int, hidden_layers: tuple[int, ...], *, logits_at: torch.Tensor | None,
             tree: bool, sliding: bool, embeds: bool) -> StepKey:
        """The graph key of a call: its batch bucket, and Tk rounded up to ``keys_bucket``."""
        assert self._pool is not None
        bp = batch_bucket(b, self.batch_buckets)
        assert bp is not None
        tk_key = tk
        if self.keys_bucket:
            tk_key = min(self._pool.max_len, round_up(tk, self.keys_bucket))
        return StepKey(batch=bp, tokens_per_row=s, num_keys=tk_key, hidden_layers=hidden_layers,
                       logits_width=None if logits_at is None else int(logits_at.shape[1]), tree=tree,
                       sliding=sliding, embeds=embeds)

    def _note_eager(self, reason: str) -> None:
        self.stats.eager_calls += 1
        seen = self.stats.eager_reasons.get(reason, 0)
        self.stats.eager_reasons[reason] = seen + 1
        if not seen:
            log.debug("eager forward: %s", reason)

    # ---- static buffers -----------------------------------------------------------------------
    def _run(self, entry: StaticBuffers) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """The forward on the static buffers against the bucket's rows of the pool."""
        key, x = entry.key, entry.inputs
        return self.model(x.get("tokens"), x["positions"], self._bucket_cache(key.batch), slots=x.get("slots"),
                          mask=x.get("mask"), sliding_mask=x.get("sliding_mask"), num_keys=key.num_keys,
                          logits_at=x.get("logits_at"), hidden_layers=key.hidden_layers,
                          inputs_embeds=x.get("embeds"))

    def _capture(self, entry: StaticBuffers) -> None:
        """Warm up on a side stream, then capture one forward into a graph (the inputs hold the
        current step's real rows, so every write is one the step makes anyway)."""
        dev = self.model.device
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(self.warmup_iters):
                self._run(entry)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            logits, hidden = self._run(entry)
        entry.graph, entry.logits, entry.hidden = graph, logits, list(hidden)
        self.stats.captures += 1
        log.debug("captured %s", entry.key)

    def capture_buckets(self, *, tokens_per_row: int, num_keys: int, batches: Sequence[int] | None = None,
                        hidden_layers: tuple[int, ...] = (), logits_width: int | None = None) -> int:
        """Prepare the static buffers (and graphs, in capture mode) of several buckets up front.

        Runs one padded forward per bucket with every row a padded row, so it writes slots
        ``0..S-1`` of pool rows: call it between generations, never while a cache view holds a
        live batch.

        Args:
            tokens_per_row: S.
            num_keys: Tk (the pool must hold that many slots: see :meth:`reserve`).
            batches: buckets to prepare (default: every bucket the pool has rows for).
            hidden_layers: hidden layers the calls will request.
            logits_width: M of ``logits_at`` the calls will pass, or None for all positions.

        Returns:
            Number of keys prepared.
        """
        if self._pool is None or self._pool.max_len < num_keys:
            raise CudaGraphError(f"reserve(batch, max_len >= {num_keys}) before capture_buckets")
        pool_rows = self._pool.batch
        todo = [b for b in (batches or self.batch_buckets) if b <= pool_rows]
        dev = self.model.device
        for bp in todo:
            assert bp in self.batch_buckets, f"{bp} is not a bucket of {self.batch_buckets}"
            s = tokens_per_row
            pos = torch.arange(s, device=dev)[None].expand(bp, s)
            at = None if logits_width is None else torch.zeros(bp, logits_width, dtype=torch.long, device=dev)
            view = CacheView(self._pool, bp, num_keys)
            self(torch.zeros(bp, s, dtype=torch.long, device=dev), pos, view, num_keys=num_keys, logits_at=at,
                 hidden_layers=hidden_layers)
        return len(todo)


# ---- CLI helpers -------------------------------------------------------------------------------
def cuda_graphs_enabled(flag: bool | None, device: torch.device | str) -> bool:
    """Resolve ``--cuda-graphs/--no-cuda-graphs``: default on for CUDA, off elsewhere.

    Raises:
        CudaGraphError: graphs explicitly requested on a non-CUDA device.
    """
    dev = torch.device(device)
    if flag is None:
        return dev.type == "cuda"
    if flag and dev.type != "cuda":
        raise CudaGraphError(f"--cuda-graphs needs a CUDA device, but this run is on {dev}; "
                             "drop the flag (graphs default to on for CUDA only) or pass --no-cuda-graphs")
    return bool(flag)


__all__ = ["GraphRunner", "CacheView", "RunnerStats", "CudaGraphError", "DEFAULT_BATCH_BUCKETS", "batch_bucket",
           "cuda_graphs_enabled"]
