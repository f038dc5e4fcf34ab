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
by an :class:`~refspec.energy.phases.EnergyMeter` through a
:class:`~refspec.energy.phases.MeteredPhase` and reported to observers as a
:class:`~refspec.energy.phases.PhaseEvent`; the work a phase is billed is what the forwards run
inside it recorded (target, draft model, drafter heads), never a declaration beside them.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Sequence

import torch

from refspec.cache import tree_mask
from refspec.drafting import DecodeState, Draft, Drafter
from refspec.energy.meters import TimeMeter
from refspec.energy.phases import EnergyMeter, MeteredPhase, PhaseEvent, PhaseObserver
from refspec.sampling import SamplingConfig, choose, probs_from_logits
from refspec.verify import emitted_tokens, greedy_accept, speculative_sample
from refspec.verify_tree import tree_ancestors, tree_greedy_accept, tree_speculative_sample

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


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclasses.dataclass
class _Batch:
    """What the loop carries between steps (device tensors, and the host copies of one sync)."""

    state: DecodeState
    cache: object  # the target's StaticKVCache (or a CUDA-graph runner's view of its pool)
    slots: int  # T, cache slots per row
    out: torch.Tensor  # [B, budget + K + 1] emitted tokens
    n_out: torch.Tensor  # [B] tokens emitted so far
    done_host: list[bool]
    lengths_host: list[int]
    events: list[PhaseEvent]


class Engine:
    """Plain and speculative decoding over a static KV cache.

    Args:
        target: a ``refspec.models.Transformer`` (anything with its forward signature).
        drafter: the drafter, or None for plain decoding.
        config: engine settings.
        meter: energy meter bracketing every phase (default: wall time, synchronising CUDA).
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
        sync = torch.cuda.synchronize if target.device.type == "cuda" else None
        self.meter = meter if meter is not None else TimeMeter(sync=sync)
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
        run = self._prefill(prompts, max_new_tokens, self._validate(prompts, max_new_tokens, max_len), generator)
        state, cache, b = run.state, run.cache, len(prompts)
        accepted_log: list[list[int]] = []
        emitted_log: list[list[int]] = []
        step, emitted_total = 0, b
        while not all(run.done_host):
            if cfg.max_steps is not None and step >= cfg.max_steps:
                log.warning("stopping after max_steps=%d with unfinished rows", cfg.max_steps)
                break
            active = b - sum(run.done_host)
            state.step = step
            state.max_length_bound = max(run.lengths_host) + 1

            # 1. draft: up to K tokens per row (a chain) or N nodes (a tree)
            with MeteredPhase(self.meter, "draft") as draft_phase:
                draft = drafter.propose(state, cfg.k) if drafter is not None else \
                    Draft(tokens=torch.zeros(b, 0, dtype=torch.long, device=dev))
            n = draft.tokens.shape[1]
            # a chain drafter may cut its draft below K for the whole batch (n-gram trimming)
            assert n <= cfg.k or draft.tree is not None, f"drafter returned {n} tokens for k={cfg.k}"
            if n != cfg.k and self.acceptance_fn is not None and draft.tree is None:
                raise GenerationError(f"injected acceptance needs full drafts of K={cfg.k}; the drafter cut its draft "
                                      f"to {n} (turn off the n-gram option trim)")

            # 2. verify: the pending token and the drafts of every row, one target forward
            with MeteredPhase(self.meter, "verify") as verify_phase:
                base = cache.lengths.clone()  # [B] cache length before the step
                logits, hidden = self._verify(run, draft, base)  # logits [B, N+1, V]

            with MeteredPhase(self.meter, "commit") as commit_phase:
                # 3. accept: per row, the longest verified prefix of drafts plus one target token
                acc, chain, hidden = self._decide(run, draft, logits, hidden, base, generator)
                emit = emitted_tokens(chain, acc)  # [B, D+1]: accepted drafts, then the bonus/recovered token
                idx = torch.arange(emit.shape[1], device=dev)[None]
                n_emit = acc.num_accepted + 1
                # a row emits up to and including its first EOS, and never beyond its budget
                is_eos = torch.isin(emit, self.eos) & (idx < n_emit[:, None])
                first_eos = torch.where(is_eos.any(1), is_eos.long().argmax(1), torch.full_like(n_emit, emit.shape[1]))
                n_emit = torch.minimum(torch.minimum(n_emit, first_eos + 1), max_new_tokens - run.n_out)
                done = state.done
                n_emit = torch.where(done, torch.zeros_like(n_emit), n_emit)

                # 4. commit: emit, append to the row's tokens, advance the cache by accepted + 1
                keep = idx < n_emit[:, None]
                out_idx = (run.n_out[:, None] + idx).clamp_(max=run.out.shape[1] - 1)
                run.out.scatter_(1, out_idx, torch.where(keep, emit, run.out.gather(1, out_idx)))
                advance = torch.where(done, torch.zeros_like(n_emit), acc.num_accepted + 1)  # KV of accepted + pending
                tok_idx = (cache.lengths[:, None] + 1 + idx).clamp_(max=run.slots - 1)
                write = idx < advance[:, None]
                state.tokens.scatter_(1, tok_idx, torch.where(write, emit, state.tokens.gather(1, tok_idx)))
                state.prev_lengths = base
                cache.lengths.add_(advance)  # rejected entries beyond the new length are never read again
                state.pending = torch.where(done, state.pending, acc.next_token)
                run.n_out = run.n_out + n_emit
                newly_done = ~done & ((first_eos < acc.num_accepted + 1) | (run.n_out >= max_new_tokens))
                num_acc_active = torch.where(done, torch.full_like(n_emit, -1), acc.num_accepted)  # -1: row was done
                state.done = done | newly_done
                state.hidden = hidden
                state.num_accepted = num_acc_active.clamp_min(0)
                if drafter is not None:
                    drafter.commit(state)
                host = torch.stack([num_acc_active, n_emit, state.done.long(), advance]).tolist()  # the one host sync

            acc_row, emit_row, adv_row = host[0], host[1], host[3]
            run.done_host = [bool(x) for x in host[2]]
            run.lengths_host = [length + a for length, a in zip(run.lengths_host, adv_row)]
            accepted_log.append(acc_row)
            emitted_log.append(emit_row)
            n_acc_sum, n_emit_sum = sum(a for a in acc_row if a > 0), sum(emit_row)
            emitted_total += n_emit_sum
            common = dict(step=step, batch=b, rows_active=active)
            self._emit(PhaseEvent(**common, phase="draft", drafted=active * n, work=draft_phase.work,
                                  measurement=draft_phase.measurement), run.events)
            self._emit(PhaseEvent(**common, phase="verify", verified=active * (n + 1), accepted=n_acc_sum,
                                  work=verify_phase.work, measurement=verify_phase.measurement), run.events)
            self._emit(PhaseEvent(**common, phase="commit", accepted=n_acc_sum, emitted=n_emit_sum,
                                  work=commit_phase.work, measurement=commit_phase.measurement,
                                  emitted_per_row=tuple(emit_row)), run.events)
            step += 1
            if self.on_step is not None:
                self.on_step(step, emitted_total)
        return self._result(run, prompts, step, accepted_log, emitted_log)

    def _prefill(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, t_slots: int,
                 generator: torch.Generator | None) -> _Batch:
        """The whole prompt in one target forward (the first token comes from its last logits),
        then the drafter's reset; one metered ``prefill`` phase."""
        cfg, drafter, dev = self.config, self.drafter, self.target.device
        b = len(prompts)
        plens = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=dev)  # [B]
        s_max = int(max(len(p) for p in prompts))
        cache = self._cache_for(b, t_slots)
        tokens = torch.zeros(b, t_slots, dtype=torch.long, device=dev)  # [B, T]
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = torch.tensor(list(p), dtype=torch.long)
        out = torch.zeros(b, max_new_tokens + cfg.k + 1, dtype=torch.long, device=dev)
        hidden_layers = tuple(drafter.hidden_layers) if drafter is not None else ()
        with MeteredPhase(self.meter, "prefill") as phase:
            positions = torch.arange(s_max, device=dev)[None].expand(b, s_max)  # [B, S]
            logits, hidden = self.target(tokens[:, :s_max], positions, cache,
                                         num_keys=min(t_slots, _round_up(s_max, cfg.kv_bucket)),
                                         logits_at=(plens - 1)[:, None], hidden_layers=hidden_layers)
            first = choose(logits[:, 0], cfg.sampling, generator)  # [B]
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
            if drafter is not None:
                drafter.reset(state)
        run = _Batch(state=state, cache=cache, slots=t_slots, out=out, n_out=n_out, done_host=done.tolist(),
                     lengths_host=plens.tolist(), events=[])
        self._emit(PhaseEvent(step=-1, phase="prefill", batch=b, rows_active=b, emitted=b, work=phase.work,
                              measurement=phase.measurement, emitted_per_row=tuple([1] * b)), run.events)
        return run

    def _verify(self, run: _Batch, draft: Draft, base: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One target forward over ``[pending, drafts]`` of every row at slots ``base + i``.

        Returns:
            ``(logits [B, N+1, V], hidden states the drafter asked for, each [B, N+1, E])``.
        """
        dev, n = self.target.device, draft.tokens.shape[1]
        inp = torch.cat([run.state.pending[:, None], draft.tokens], dim=1)  # [B, N+1]
        num_keys = min(run.slots, _round_up(max(run.lengths_host) + n + 1, self.config.kv_bucket))
        slots = (base[:, None] + torch.arange(n + 1, device=dev)).clamp_(max=run.slots - 1)  # [B, N+1]
        hidden_layers = tuple(self.drafter.hidden_layers) if self.drafter is not None else ()
        fwd_kw: dict = {}
        positions = slots
        if draft.tree is not None:
            anc = tree_ancestors(draft.tree.parents)  # [B, N+1, N+1]
            depth = torch.cat([torch.zeros_like(draft.tree.depth[:, :1]), draft.tree.depth], dim=1)  # [B, N+1]
            positions = base[:, None] + depth  # a node sits at its depth past the committed prefix
            fwd_kw["slots"] = slots
            fwd_kw["mask"] = tree_mask(base, anc, positions, num_keys)
            window = getattr(self.target.args, "sliding_window", None)
            if window:
                fwd_kw["sliding_mask"] = tree_mask(base, anc, positions, num_keys, window)
        return self.verify_fn(inp, positions, run.cache, num_keys=num_keys, hidden_layers=hidden_layers, **fwd_kw)

    def _decide(self, run: _Batch, draft: Draft, logits: torch.Tensor, hidden: list[torch.Tensor],
                base: torch.Tensor, generator: torch.Generator | None):
        """Acceptance of a chain, or of a tree path (greedy match, or recursive rejection sampling
        over each node's children), its KV and features compacted onto the chain slots ``base + 1 ..``.

        Returns:
            ``(Acceptance, chain [B, D] drafted tokens in emission order, hidden)``.
        """
        if draft.tree is None:
            if self.acceptance_fn is not None:
                return self.acceptance_fn(draft, logits, generator), draft.tokens, hidden
            if self.config.sampling.greedy:
                return greedy_accept(draft.tokens, logits), draft.tokens, hidden
            p = probs_from_logits(logits, self.config.sampling)  # [B, K+1, V] target distributions
            return speculative_sample(draft.tokens, draft.probs, p, generator), draft.tokens, hidden
        b, dev, t = base.shape[0], base.device, run.slots
        tr, p = draft.tree, None if self.config.sampling.greedy else probs_from_logits(logits, self.config.sampling)
        acc, path = tree_greedy_accept(draft.tokens, tr.parents, tr.depth, logits) if p is None else \
            tree_speculative_sample(draft.tokens, tr.parents, tr.depth, draft.probs, p, generator)  # path [B, D+1]
        chain = draft.tokens.gather(1, (path[:, 1:] - 1).clamp_min(0))  # [B, D] tokens on the path
        src = (base[:, None] + path[:, 1:]).clamp_(max=t - 1)
        dst = (base[:, None] + 1 + torch.arange(path.shape[1] - 1, device=dev)).clamp_(max=t - 1)
        run.cache.compact(src, dst)
        hidden = [h.gather(1, path[..., None].expand(b, path.shape[1], h.shape[-1])) for h in hidden]
        return acc, chain, hidden

    def _result(self, run: _Batch, prompts: Sequence[Sequence[int]], steps: int, accepted_log: list[list[int]],
                emitted_log: list[list[int]]) -> Generation:
        counts = run.n_out.tolist()
        out_host = run.out.tolist()
        eos_set = set(self.eos.tolist())
        rows = [out_host[i][: counts[i]] for i in range(len(prompts))]
        return Generation(tokens=rows, prompt_lengths=[len(p) for p in prompts],
                          finished_by_eos=[bool(r) and r[-1] in eos_set for r in rows], steps=steps,
                          accepted_per_step=accepted_log, emitted_per_step=emitted_log, events=run.events)
