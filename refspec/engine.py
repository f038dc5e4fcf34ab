"""The decode engine: one loop for plain (K = 0) and speculative decoding.

Each step, for a batch of ragged rows with static shapes:

1. **draft**: the drafter proposes K tokens per row (a chain, or a tree);
2. **verify**: one target forward over the pending token and the drafts of every row;
3. **accept**: pure functions (``refspec.verify``) decide each row's accepted count and its
   recovered or bonus token;
4. **commit**: rows advance by accepted + 1, emitted tokens are appended (cut at EOS and at
   the row's budget), tree paths are compacted in the cache, the drafter updates its state;
   one host sync reads the step's counts.

Rejected KV entries stay in the cache but are never attended and are overwritten next step.
Finished rows keep riding along (static shapes) but emit nothing. Every phase is bracketed
by an :class:`~refspec.energy.phases.EnergyMeter` and reported to observers as a
:class:`~refspec.energy.phases.PhaseEvent`.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Sequence

import torch

from refspec.cache import causal_mask, tree_mask
from refspec.drafting import DecodeState, Draft, Drafter
from refspec.energy.phases import EnergyMeter, ForwardShape, Measurement, PhaseEvent, PhaseObserver
from refspec.sampling import SamplingConfig, choose, probs_from_logits
from refspec.verify import (Acceptance, emitted_tokens, greedy_accept, speculative_sample, tree_ancestors,
                            tree_greedy_accept)

log = logging.getLogger(__name__)


class GenerationError(ValueError):
    """Bad generation input (empty prompt, budget beyond the context, bad K)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Settings of one engine.

    Attributes:
        k: drafts per row per step (0 = plain decoding; a tree drafter's K is its node count).
        sampling: greedy or sampled decoding.
        kv_bucket: attend to a prefix of the cache rounded up to this many slots.
        max_steps: safety cap on decode steps (None: budget-driven).
    """

    k: int = 0
    sampling: SamplingConfig = SamplingConfig()
    kv_bucket: int = 64
    max_steps: int | None = None

    def __post_init__(self) -> None:
        if self.k < 0:
            raise GenerationError(f"k must be >= 0, got {self.k}")
        if self.kv_bucket < 1:
            raise GenerationError("kv_bucket must be >= 1")


@dataclasses.dataclass
class Generation:
    """Result of one batch.

    Attributes:
        tokens: emitted tokens per row (including a final EOS if one was produced).
        prompt_lengths: prompt length per row.
        finished_by_eos: whether each row stopped at EOS (else at its budget).
        steps: decode steps run (verify forwards).
        accepted_per_step: per step, accepted drafts per row (-1 where the row was done).
        emitted_per_step: per step, emitted tokens per row.
        events: every phase event of the batch.
    """

    tokens: list[list[int]]
    prompt_lengths: list[int]
    finished_by_eos: list[bool]
    steps: int
    accepted_per_step: list[list[int]]
    emitted_per_step: list[list[int]]
    events: list[PhaseEvent]

    @property
    def tau(self) -> float:
        """Mean accepted + 1 over the row-steps of active rows (NaN without one), as the accounting defines it."""
        from refspec.energy.accounting import tau_of_steps

        return tau_of_steps(self.accepted_per_step)

    @property
    def num_emitted(self) -> int:
        return sum(len(t) for t in self.tokens)


class _WallClock:
    """Minimal time-only meter used when the caller supplies none."""

    source = "none:time-only"

    def __init__(self) -> None:
        import time

        self._now = time.perf_counter
        self._start: dict[str, float] = {}

    def begin(self, name: str) -> None:
        self._start[name] = self._now()

    def end(self, name: str, work: tuple[ForwardShape, ...] = ()) -> Measurement:
        return Measurement(self._now() - self._start.pop(name), None, self.source)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


class Engine:
    """Plain and speculative decoding over a static KV cache.

    Args:
        target: a ``refspec.models.Transformer`` (anything with its forward signature).
        drafter: the drafter, or None for plain decoding.
        config: engine settings.
        meter: energy meter bracketing every phase (default: wall clock only).
        observers: called with every :class:`PhaseEvent` (the ledger is one).
        eos_token_ids: tokens that end a row.
        verify_fn: callable with the target forward's signature used for verify steps
            (a CUDA-graph runner may replace the eager target here); when it has a
            ``new_cache`` method, the engine's cache comes from it.
        acceptance_fn: replaces chain verification's decision, ``(draft, logits, generator)
            -> Acceptance``; used to inject a recorded acceptance-length distribution when
            timing large random-weight targets (outputs must then say so).
        on_step: called after every step with ``(step, tokens_emitted_so_far)`` (progress bars).
    """

    def __init__(self, target, drafter: Drafter | None = None, *, config: EngineConfig = EngineConfig(),
                 meter: EnergyMeter | None = None, observers: Sequence[PhaseObserver] = (),
                 eos_token_ids: Sequence[int] = (), verify_fn: Callable | None = None,
                 acceptance_fn: Callable | None = None, on_step: Callable[[int, int], None] | None = None) -> None:
        if drafter is None and config.k:
            raise GenerationError(f"k = {config.k} needs a drafter; plain decoding is k = 0")
        if drafter is not None and config.k == 0:
            raise GenerationError(f"drafter {drafter.name!r} needs k >= 1")
        self.target = target
        self.drafter = drafter
        self.config = config
        self.meter = meter if meter is not None else _WallClock()
        self.observers = list(observers)
        self.eos = torch.tensor(sorted(set(eos_token_ids)) or [-1], dtype=torch.long, device=target.device)
        self.verify_fn = verify_fn if verify_fn is not None else target
        self.acceptance_fn = acceptance_fn
        self.on_step = on_step
        self._cache = None

    # ---- helpers ------------------------------------------------------------------------------
    @property
    def dtype_bytes(self) -> int:
        return torch.finfo(self.target.dtype).bits // 8

    def _cache_for(self, batch: int, max_len: int):
        c = self._cache
        if c is None or c.batch != batch or c.max_len < max_len:
            # a verify_fn that owns the cache (a CUDA-graph runner's KV pool) provides it
            new_cache = getattr(self.verify_fn, "new_cache", None) or self.target.new_cache
            self._cache = c = new_cache(batch, max_len)
        c.reset()
        return c

    def _target_shape(self, rows: int, tokens_per_row: int, context: int, lm_tokens: int | None = None) -> ForwardShape:
        multirow = getattr(self.target, "multirow_matrix_bytes", None)
        return ForwardShape(args=self.target.args, rows=rows, tokens_per_row=tokens_per_row, context_tokens=context,
                            dtype_bytes=self.dtype_bytes, lm_head_tokens=lm_tokens, layers=self.target.num_layers,
                            matrix_bytes=multirow() if multirow is not None else None)

    def _emit(self, event: PhaseEvent, events: list[PhaseEvent]) -> None:
        events.append(event)
        for obs in self.observers:
            obs(event)

    def required_slots(self, prompt_len: int, max_new_tokens: int) -> int:
        """Cache slots one row needs: prompt, budget and one step of look-ahead."""
        lookahead = self.config.k + 1 + int(getattr(self.drafter, "extra_slots", 0) or 0)
        return prompt_len + max_new_tokens + lookahead

    def _validate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, max_len: int | None) -> int:
        if not prompts:
            raise GenerationError("no prompts given")
        if max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        v = self.target.args.vocab_size
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise GenerationError(f"prompt {i} is empty; every row needs at least one token")
            if min(p) < 0 or max(p) >= v:
                raise GenerationError(f"prompt {i} has token ids outside 0..{v - 1}")
        need = max(self.required_slots(len(p), max_new_tokens) for p in prompts)
        ctx = self.target.args.max_position_embeddings
        if need > ctx:
            raise GenerationError(
                f"longest prompt ({max(map(len, prompts))} tokens) + max_new_tokens ({max_new_tokens}) + look-ahead "
                f"needs {need} positions, beyond the model's context of {ctx}")
        if max_len is not None:
            if need > max_len:
                raise GenerationError(f"the cache holds {max_len} slots per row but this batch needs {need} "
                                      f"(prompt + max_new_tokens + k + 1); raise max_len or lower k / the budget")
            return max_len
        return _round_up(need, self.config.kv_bucket)

    # ---- the loop -----------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                 generator: torch.Generator | None = None, max_len: int | None = None) -> Generation:
        """Decode a batch of ragged prompts.

        Args:
            prompts: token ids per row (lengths may differ).
            max_new_tokens: budget per row, including the first token from prefill.
            generator: random generator for sampling (on the target's device).
            max_len: cache slots per row (default: just enough, rounded to ``kv_bucket``).

        Returns:
            The emitted tokens and per-step statistics.
        """
        cfg, drafter, dev = self.config, self.drafter, self.target.device
        t_slots = self._validate(prompts, max_new_tokens, max_len)
        b = len(prompts)
        plens = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=dev)
        s_max = int(max(len(p) for p in prompts))
        cache = self._cache_for(b, t_slots)
        tokens = torch.zeros(b, t_slots, dtype=torch.long, device=dev)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = torch.tensor(list(p), dtype=torch.long)
        out = torch.zeros(b, max_new_tokens + cfg.k + 1, dtype=torch.long, device=dev)
        events: list[PhaseEvent] = []
        hidden_layers = tuple(drafter.hidden_layers) if drafter is not None else ()

        # prefill: the whole prompt; the first token comes from its last logits
        self.meter.begin("prefill")
        positions = torch.arange(s_max, device=dev)[None].expand(b, s_max)
        logits, hidden = self.target(tokens[:, :s_max], positions, cache, num_keys=_round_up(s_max, cfg.kv_bucket),
                                     logits_at=(plens - 1)[:, None], hidden_layers=hidden_layers)
        first = choose(logits[:, 0], cfg.sampling, generator)
        cache.lengths.copy_(plens)
        tokens.scatter_(1, plens[:, None], first[:, None])
        out[:, 0] = first
        n_out = torch.ones(b, dtype=torch.long, device=dev)
        done = torch.isin(first, self.eos) | (n_out >= max_new_tokens)
        state = DecodeState(tokens=tokens, lengths=cache.lengths, prev_lengths=torch.zeros_like(plens),
                            pending=first.clone(), prompt_lengths=plens, done=done, hidden=hidden,
                            num_accepted=torch.zeros_like(plens), sampling=cfg.sampling, generator=generator,
                            step=0, max_length_bound=s_max + 1, target_args=self.target.args,
                            dtype_bytes=self.dtype_bytes)
        work = (self._target_shape(b, s_max, b * s_max, lm_tokens=b),)  # keys read per row, summed
        if drafter is not None:
            drafter.reset(state)
            work += tuple(drafter.prefill_work(state))
        m = self.meter.end("prefill", work)
        done_host = done.tolist()
        lengths_host = plens.tolist()
        self._emit(PhaseEvent(step=-1, phase="prefill", batch=b, rows_active=b, emitted=b, work=work,
                              measurement=m, emitted_per_row=tuple([1] * b)), events)

        accepted_log: list[list[int]] = []
        emitted_log: list[list[int]] = []
        step = 0
        emitted_total = b
        while not all(done_host):
            if cfg.max_steps is not None and step >= cfg.max_steps:
                log.warning("stopping after max_steps=%d with unfinished rows", cfg.max_steps)
                break
            active = b - sum(done_host)
            state.step = step
            state.max_length_bound = max(lengths_host) + 1

            # 1. draft
            self.meter.begin("draft")
            if drafter is not None:
                draft = drafter.propose(state, cfg.k)
                d_work = tuple(drafter.draft_work(state, cfg.k))
            else:
                draft = Draft(tokens=torch.zeros(b, 0, dtype=torch.long, device=dev))
                d_work = ()
            m_draft = self.meter.end("draft", d_work)
            n = draft.tokens.shape[1]
            # a chain drafter may cut its draft below K for the whole batch (n-gram trimming)
            assert n <= cfg.k or draft.tree is not None, f"drafter returned {n} tokens for k={cfg.k}"
            if n != cfg.k and self.acceptance_fn is not None and draft.tree is None:
                raise GenerationError(f"injected acceptance needs full drafts of K={cfg.k}; the drafter cut its draft "
                                      f"to {n} (turn off the n-gram option trim)")

            # 2. verify: pending + drafts, one target forward
            self.meter.begin("verify")
            inp = torch.cat([state.pending[:, None], draft.tokens], dim=1)  # [B, N+1]
            base = cache.lengths.clone()
            num_keys = min(t_slots, _round_up(max(lengths_host) + n + 1, cfg.kv_bucket))
            slots = (base[:, None] + torch.arange(n + 1, device=dev)).clamp_(max=t_slots - 1)  # [B, N+1]
            fwd_kw: dict = {}
            if draft.tree is not None:
                if not cfg.sampling.greedy:
                    raise GenerationError("tree drafting supports greedy decoding only; use a chain to sample")
                anc = tree_ancestors(draft.tree.parents)  # [B, N+1, N+1]
                depth = torch.cat([torch.zeros_like(draft.tree.depth[:, :1]), draft.tree.depth], dim=1)
                positions = base[:, None] + depth
                fwd_kw["slots"] = slots
                fwd_kw["mask"] = tree_mask(base, anc, positions, num_keys)
                window = getattr(self.target.args, "sliding_window", None)
                if window:
                    fwd_kw["sliding_mask"] = tree_mask(base, anc, positions, num_keys, window)
            else:
                positions = slots
            logits, hidden = self.verify_fn(inp, positions, cache, num_keys=num_keys, hidden_layers=hidden_layers,
                                            **fwd_kw)
            context = sum(lengths_host[i] + n + 1 for i in range(b))
            v_work = (self._target_shape(b, n + 1, context),)
            m_verify = self.meter.end("verify", v_work)

            # 3. accept
            self.meter.begin("commit")
            if draft.tree is not None:
                acc, path = tree_greedy_accept(draft.tokens, draft.tree.parents, draft.tree.depth, logits)
                chain = draft.tokens.gather(1, (path[:, 1:] - 1).clamp_min(0))  # [B, D] tokens on the path
                src = base[:, None] + path[:, 1:]
                dst = (base[:, None] + 1 + torch.arange(path.shape[1] - 1, device=dev)).clamp_(max=t_slots - 1)
                cache.compact(src.clamp_(max=t_slots - 1), dst)
                hidden = [h.gather(1, path[..., None].expand(b, path.shape[1], h.shape[-1])) for h in hidden]
            else:
                chain = draft.tokens
                acc = self._accept(draft, logits, generator)
            emit = emitted_tokens(chain, acc)  # [B, D+1]
            width = emit.shape[1]
            idx = torch.arange(width, device=dev)[None]
            n_emit = acc.num_accepted + 1
            is_eos = torch.isin(emit, self.eos) & (idx < n_emit[:, None])
            first_eos = torch.where(is_eos.any(1), is_eos.long().argmax(1), torch.full_like(n_emit, width))
            n_emit = torch.minimum(torch.minimum(n_emit, first_eos + 1), max_new_tokens - n_out)
            n_emit = torch.where(done, torch.zeros_like(n_emit), n_emit)

            # 4. commit
            keep = idx < n_emit[:, None]
            out_idx = (n_out[:, None] + idx).clamp_(max=out.shape[1] - 1)
            out.scatter_(1, out_idx, torch.where(keep, emit, out.gather(1, out_idx)))
            advance = torch.where(done, torch.zeros_like(n_emit), acc.num_accepted + 1)
            tok_idx = (cache.lengths[:, None] + 1 + idx).clamp_(max=t_slots - 1)
            write = idx < advance[:, None]
            tokens.scatter_(1, tok_idx, torch.where(write, emit, tokens.gather(1, tok_idx)))
            state.prev_lengths = base
            cache.lengths.add_(advance)
            state.pending = torch.where(done, state.pending, acc.next_token)
            n_out = n_out + n_emit
            newly_done = ~done & ((first_eos < acc.num_accepted + 1) | (n_out >= max_new_tokens))
            num_acc_active = torch.where(done, torch.full_like(n_emit, -1), acc.num_accepted)
            done = done | newly_done
            state.done = done
            state.hidden = hidden
            state.num_accepted = torch.where(num_acc_active >= 0, num_acc_active, torch.zeros_like(n_emit))
            if drafter is not None:
                drafter.commit(state)
            host = torch.stack([num_acc_active, n_emit, done.long(), advance]).tolist()  # the one host sync
            m_commit = self.meter.end("commit", ())

            acc_row, emit_row, done_host, adv_row = host[0], host[1], [bool(x) for x in host[2]], host[3]
            lengths_host = [l + a for l, a in zip(lengths_host, adv_row)]
            accepted_log.append(acc_row)
            emitted_log.append(emit_row)
            n_acc_sum = sum(a for a in acc_row if a > 0)
            n_emit_sum = sum(emit_row)
            emitted_total += n_emit_sum
            verified = active * (n + 1)
            common = dict(step=step, batch=b, rows_active=active)
            self._emit(PhaseEvent(**common, phase="draft", drafted=active * n, work=d_work, measurement=m_draft), events)
            self._emit(PhaseEvent(**common, phase="verify", verified=verified, accepted=n_acc_sum, work=v_work,
                                  measurement=m_verify), events)
            self._emit(PhaseEvent(**common, phase="commit", accepted=n_acc_sum, emitted=n_emit_sum,
                                  measurement=m_commit, emitted_per_row=tuple(emit_row)), events)
            step += 1
            if self.on_step is not None:
                self.on_step(step, emitted_total)

        counts = n_out.tolist()
        out_host = out.tolist()
        eos_set = set(self.eos.tolist())
        rows = [out_host[i][: counts[i]] for i in range(b)]
        return Generation(tokens=rows, prompt_lengths=plens.tolist(),
                          finished_by_eos=[bool(r) and r[-1] in eos_set for r in rows], steps=step,
                          accepted_per_step=accepted_log, emitted_per_step=emitted_log, events=events)

    def _accept(self, draft: Draft, logits: torch.Tensor, generator: torch.Generator | None) -> Acceptance:
        if self.acceptance_fn is not None:
            return self.acceptance_fn(draft, logits, generator)
        sampling = self.config.sampling
        if sampling.greedy:
            return greedy_accept(draft.tokens, logits)
        p = probs_from_logits(logits, sampling)
        return speculative_sample(draft.tokens, draft.probs, p, generator)
