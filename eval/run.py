"""Running one evaluation configuration: engine, meter and ledger; the configuration's record.

A :class:`~refspec.eval.run_config.RunConfig` names everything that changes a figure. A
:class:`~refspec.eval.session.Session` holds what configurations share: the loaded target and
tokenizer, the energy meter, the verify callable (eager or CUDA graphs), built drafters and
encoded prompts. :func:`run_configuration` runs one configuration and returns its record, a
flat JSON-ready dict (the ``records.jsonl`` / ``summary.json`` schema, :data:`RECORD_FIELDS`).

Serving: a configuration serves a stream of ``requests`` requests
(:mod:`refspec.eval.requests`: distinct corpus prompts, closed-loop or seeded Poisson
arrivals) through :meth:`refspec.engine.Engine.serve`. ``continuous`` (the default) keeps B
slots busy, refilling each freed slot from the stream, in one ledger run; ``static`` serves
lockstep batches of B requests that drain, one ledger run each. The same stream (same ids, same
prompts) is served by a configuration and its baseline, so outputs compare request by request.

Every batch (continuous: the whole stream) is one run of one :class:`~refspec.energy.ledger.Ledger` (``run_id``
``<config id>.<attempt>.b<i>``, appended to the ledger file with flush); the ledger is the
engine's observer. The record's figures come only from the ledger records this configuration
wrote, read back from disk and pooled by :func:`refspec.energy.accounting.pool_runs`; this module
copies them into the record (:func:`refspec.eval.records.accounting_fields`) and computes none.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import logging
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from refspec.energy.accounting import Accounting, pool_runs
from refspec.eval.machine import auto_dtype, cpu_has_fast_bf16, gemm_plan_text, library_versions  # noqa: F401
from refspec.eval.records import experts_fields  # MoE targets: experts touched per step
from refspec.eval.records import (RECORD_FIELDS, RECORD_VERSION, _digest, accounting_fields, acceptance_from_tau,
                                 compare_with_baseline, describe_source, ensure_line_end, roofline_prediction)
from refspec.eval.policy_report import k_fields
from refspec.eval.prefill_work import prefill_fields
from refspec.eval.report_requests import request_fields
from refspec.eval.run_config import RunConfig
from refspec.eval.runtime import UsageError
from refspec.eval.session import Session

log = logging.getLogger(__name__)


# ---- one configuration ----------------------------------------------------------------------
@dataclasses.dataclass
class ConfigResult:
    """A finished configuration: its record and the generations behind it."""

    record: dict[str, Any]
    generations: list[Any]


def _acceptance_injection(cfg: RunConfig, device: torch.device) -> tuple[Any, dict[str, Any] | None, str | None]:
    """The engine's acceptance_fn, the injection record and its label for ``cfg`` (Nones without injection)."""
    if cfg.accept_model is None:
        return None, None, None
    if importlib.util.find_spec("refspec.eval.injection") is None:
        raise UsageError("--accept-model: refspec.eval.injection is not available in this installation")
    from refspec.eval.injection import injection_label, injection_record, make_acceptance_fn, resolve_acceptance_model

    model = resolve_acceptance_model(cfg.accept_model, k=cfg.k, drafter=cfg.drafter, corpus=cfg.corpus)
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 7919)
    label = injection_label(model)
    log.info("%s", label)
    # under a policy a step's K may be below the engine's: the model is restricted to each step's K
    k = cfg.k if cfg.spec_policy == "fixed" else None
    return make_acceptance_fn(model, gen, k=k), injection_record(model), label


def prepare_configuration(session: Session, cfg: RunConfig) -> None:
    """Load what ``cfg`` needs (prompts, drafter, injected model) so a bad setting fails before any run.

    Raises:
        UsageError, NoGPUError, DrafterError, AcceptanceModelError, CorpusError: what building them raises.
    """
    _ = session.meter  # a meter that cannot be built (zeus without a GPU) fails here
    prompts = _prompts(session, cfg)
    session.stream(cfg)  # budgets: --output-len-dist reference without reference answers fails here
    drafter = session.drafter(cfg)
    if cfg.schedule == "continuous" and drafter is not None and not callable(getattr(drafter, "reset_rows", None)):
        raise UsageError(f"drafter {cfg.drafter} has no reset_rows (a per-slot reset for refills); use "
                         f"--schedule static")
    _check_context(session, cfg, prompts, drafter)
    _acceptance_injection(cfg, session.device)


def _prompts(session: Session, cfg: RunConfig) -> list[list[int]]:
    """The distinct prompts of ``cfg``'s request stream."""
    from refspec.eval.corpora.sources import CorpusError

    try:
        return session.prompts(cfg.corpus, cfg.num_requests, cfg.num_prompts)
    except CorpusError as exc:  # the user's prompt file or corpus name: say which flag named it
        raise UsageError(f"--corpus {cfg.corpus}: {exc}") from exc


def _check_context(session: Session, cfg: RunConfig, prompts: Sequence[Sequence[int]], drafter: Any) -> None:
    """The longest prompt, the user's budget and one step of look-ahead fit the model's context."""
    longest = max(map(len, prompts))
    lookahead = cfg.k + 1 + int(getattr(drafter, "extra_slots", 0) or 0)
    ctx = session.target.model.args.max_position_embeddings
    if longest + cfg.max_new_tokens + lookahead > ctx:
        room = ctx - longest - lookahead
        fix = f"use --max-new-tokens {room} or less" if room >= 1 else "use shorter prompts or a smaller --k"
        raise UsageError(f"--max-new-tokens {cfg.max_new_tokens} (--k {cfg.k}, {cfg.label}, corpus {cfg.corpus}): "
                         f"the longest prompt ({longest} tokens) + budget + look-ahead ({lookahead}) exceed the "
                         f"model's context of {ctx}; {fix}")


def resolve_defaults(session: Session, cfg: RunConfig) -> RunConfig:
    """``cfg`` with the draft model it will run written out, so the record names it (loads the target)."""
    if cfg.drafter != "draft-model" or "draft_model" in dict(cfg.drafter_options):
        return cfg
    from refspec.drafters.draft_model import default_draft_model, missing_draft_model

    draft = default_draft_model(session.target.model)
    if draft is None:
        raise UsageError(missing_draft_model(cfg.model))
    options = {**dict(cfg.drafter_options), "draft_model": draft}
    return dataclasses.replace(cfg, drafter_options=tuple(sorted(options.items())))


def _engine(session: Session, cfg: RunConfig, drafter: Any, acceptance_fn: Any, ledger: Any) -> Any:
    """The engine of ``cfg``, every phase event going to ``ledger``."""
    from refspec.engine import Engine, EngineConfig
    from refspec.eval.policy_setup import build_policy
    from refspec.sampling import SamplingConfig

    target = session.target
    sampling = SamplingConfig(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    policy = build_policy(session, cfg, drafter)
    watch = [policy.on_event] if hasattr(policy, "on_event") else []  # a policy calibrating on measured phases
    return Engine(target.prepared, drafter, config=EngineConfig(k=cfg.k, sampling=sampling), meter=session.meter,
                  observers=[ledger, *watch], eos_token_ids=target.eos_token_ids, acceptance_fn=acceptance_fn,
                  policy=policy)


def _run_labels(cfg: RunConfig, batches: int, injection_label: str | None) -> list[dict[str, Any]]:
    """The ledger header labels of each batch run."""
    injected = {"acceptance_injected": True, "injection": injection_label} if injection_label else {}
    return [{**cfg.identity(), "config_id": cfg.config_id, "batch_index": i, "batches": batches, **injected}
            for i in range(batches)]


def _decode_batches(session: Session, cfg: RunConfig, engine: Any, ledger: Any, chunks: Sequence[Sequence[Any]],
                   run_ids: Sequence[str], labels: Sequence[dict[str, Any]]) -> list[Any]:
    """Serve each chunk of requests (continuous: the whole stream; static: lockstep batches), each
    chunk a ledger run of its own (the first is open); returns the ``ServeResult`` of each."""
    from tqdm.auto import tqdm

    results = []
    with tqdm(total=sum(q.max_new_tokens for c in chunks for q in c), unit="tok", desc=cfg.label, file=sys.stderr, dynamic_ncols=True,
              disable=not session.progress, leave=False) as bar:
        for i, run_id in enumerate(run_ids):
            if i:
                ledger.begin_run(run_id, labels=labels[i])
            counted = [0]

            def on_step(step: int, emitted: int, _counted: list[int] = counted) -> None:
                bar.update(emitted - _counted[0])
                _counted[0] = emitted

            engine.on_step = on_step
            gen = torch.Generator(device=session.device).manual_seed(cfg.seed + i)
            continuous = cfg.schedule == "continuous"
            # a static chunk is a batch of its own size, as lockstep decoding ran it (a short last chunk too)
            res = engine.serve(list(chunks[i]), batch=cfg.batch if continuous else len(chunks[i]), generator=gen,
                               refill=continuous)
            results.append(res)
            bar.update(sum(q.max_new_tokens for q in chunks[i]) - counted[0])
            bar.set_postfix_str(f"batch {i + 1}/{len(run_ids)}" if cfg.is_baseline else f"tau {res.tau:.2f}")
    return results


def _record(session: Session, cfg: RunConfig, acc: Accounting, *, stream: Any, results: Sequence[Any],
            ledger_path: Path, injection: dict[str, Any] | None) -> dict[str, Any]:
    """The configuration's record: its identity, what ran, and the pooled accounting's figures."""
    served = {r.id: r for res in results for r in res.requests}
    outputs = [{"id": q.id, "prompt": list(q.prompt), "budget": q.max_new_tokens, "arrival_s": q.arrival_s,
                "tokens": list(served[q.id].tokens)} for q in stream.requests]
    output_digest, row_digests = _digest([o["tokens"] for o in outputs])
    return {
        "record_version": RECORD_VERSION, "status": "ok", "config_id": cfg.config_id, "config": cfg.identity(),
        "baseline_config_id": cfg.baseline().config_id,
        "model": cfg.model, "drafter": cfg.drafter, "k": cfg.k, "spec_policy": cfg.spec_policy, "tree": cfg.tree,
        "batch": cfg.batch,
        "corpus": cfg.corpus, "dtype": cfg.dtype, "device": cfg.device, "meter": cfg.meter,
        "temperature": cfg.temperature, "greedy": cfg.greedy, "seed": cfg.seed, "cuda_graphs": cfg.cuda_graphs,
        "compiled_step": bool(getattr(session, "compile_step", False)),
        "schedule": cfg.schedule, "requests": len(stream.requests), "requests_unique": stream.unique,
        "request_rate": cfg.request_rate, "prompts_unique": stream.unique, "rows": len(stream.requests),
        "batches": len(acc.run_ids), "max_new_tokens": cfg.max_new_tokens, "output_lengths": stream.lengths,
        "stream_digest": stream.digest, "run_ids": list(acc.run_ids),
        "ledger": ledger_path.name, **accounting_fields(acc),
        "time_source": session.time_source, "threads": torch.get_num_threads(),
        "acceptance_injected": injection is not None, "injection": injection,
        "output_digest": output_digest, "row_digests": row_digests, "request_outputs": outputs,
    }


def _phase_loops(session: Session, cfg: RunConfig, engine: Any, ledger: Any, results: Sequence[Any],
                 prompts: Sequence[Sequence[int]]) -> None:
    """Under a counter meter: end the last run (its end read), then each phase alone in a loop the
    counter resolves, at the run's shapes (:mod:`refspec.phase_loops`), written as loop records."""
    from refspec.energy.counter_log import CounterLedger
    from refspec.phase_loops import LoopTarget, run_phase_loops, shapes_of

    if not isinstance(ledger, CounterLedger) or session.phase_loops_s == 0:
        return
    ledger.end_run()  # the loops lie outside every window of the run
    shapes = shapes_of([e for res in results for e in res.events], batch=cfg.batch, k=cfg.k, prompts=prompts)
    target = LoopTarget(target=engine.target, drafter=engine.drafter, verify_fn=engine.target,
                        sampling=engine.config.sampling, kv_bucket=engine.config.kv_bucket, accept=engine.acceptance_fn)
    loops = run_phase_loops(target, shapes, session.meter, min_s=session.phase_loops_s, seed=cfg.seed)
    for phase, loop in loops.items():
        ledger.write_loop(phase, loop, session.meter.source)
    log.info("phase loops (%s): %s", session.meter.source,
             ", ".join(f"{p} {lp.j_per_step * 1e3:.3g} mJ/call x {lp.iterations}" for p, lp in loops.items()))


def _margin_fn(session: Session) -> Any:
    """The per-request audit's top-2 margin of the target (:mod:`refspec.eval.audit`), None without it."""
    if importlib.util.find_spec("refspec.eval.audit") is None:
        return None
    from refspec.eval import audit

    make = getattr(audit, "margin_fn", None)
    return None if make is None else make(session.target.model)


def run_configuration(session: Session, cfg: RunConfig, *, ledger_path: Path,
                      baseline: Mapping[str, Any] | None = None) -> ConfigResult:
    """Run one configuration, append its ledger runs, and return its record.

    Args:
        session: the shared target, meter and caches.
        cfg: the configuration.
        ledger_path: JSONL ledger to append to (one run per batch).
        baseline: the baseline's record at the same batch, for the comparison fields.

    Returns:
        The record (see :data:`RECORD_FIELDS`) and the generations.
    """
    from refspec.energy.counter_log import counter_ledger
    from refspec.energy.ledger import Ledger, mark_aborted, read_ledger

    t_start = time.perf_counter()
    prompts = _prompts(session, cfg)
    stream = session.stream(cfg)  # the same requests, budgets and arrivals for every configuration
    chunks = [stream.requests] if cfg.schedule == "continuous" else stream.chunks(cfg.batch)
    drafter = session.drafter(cfg)
    acceptance_fn, injection, inj_label = _acceptance_injection(cfg, session.device)
    attempt = uuid.uuid4().hex[:6]
    run_ids = [f"{cfg.config_id}.{attempt}.b{i}" for i in range(len(chunks))]
    labels = _run_labels(cfg, len(chunks), inj_label)
    # a counter meter's reads go into the ledger beside the phase records (refspec.energy.counter_log)
    with counter_ledger(session.meter, Ledger(ledger_path, run_id=run_ids[0], labels=labels[0], mode="a",
                                              meter_source=session.meter.source,
                                              idle_w=getattr(session.meter, "idle_w", None))) as ledger:
        engine = _engine(session, cfg, drafter, acceptance_fn, ledger)
        session.warm(engine, cfg, prompts)
        results = _decode_batches(session, cfg, engine, ledger, chunks, run_ids, labels)
        _phase_loops(session, cfg, engine, ledger, results, [q.prompt for q in stream.requests])
    try:
        # the figures come from the ledger as written to disk, never from the engine's own counts
        ledger_records = read_ledger(ledger_path, offset=ledger.start_offset)
        acc = pool_runs(ledger_records, ledger.run_ids)
        record = _record(session, cfg, acc, stream=stream, results=results, ledger_path=ledger_path,
                         injection=injection)
        record.update(experts_fields(ledger_records, ledger.run_ids))
        record.update(prefill_fields(ledger_records, ledger.run_ids, [len(q.prompt) for q in stream.requests]))
        record.update(k_fields(ledger_records, ledger.run_ids))
        record.update(request_fields(ledger_records, ledger.run_ids, results, record["request_outputs"],
                                     profile=session.roofline_profile))  # energy and acceptance per request
        record["roofline"] = roofline_prediction(session, cfg, drafter, [q.prompt for q in stream.requests], acc.tau,
                                                 budgets=[q.max_new_tokens for q in stream.requests])
        compare_with_baseline(record, baseline, **({"margin_fn": m} if (m := _margin_fn(session)) else {}))
        record.update(versions=library_versions(), cpu_gemm_plan=gemm_plan_text(session.target.prepared.cpu_plan),
                      wall_s=time.perf_counter() - t_start, created_unix_s=time.time())
    except BaseException as exc:  # its runs completed, but no record will name them: the ledger must say so
        mark_aborted(ledger_path, ledger.run_ids, type(exc).__name__)
        raise
    log.info("%s: tau %s, %.2f tok/s, J/token %s (%s)", cfg.label, "n/a" if acc.tau is None else f"{acc.tau:.3f}",
             acc.tokens_per_s or 0.0, "n/a" if acc.j_per_token is None else f"{acc.j_per_token:.4g}",
             record["energy_source_text"])
    return ConfigResult(record=record, generations=results)


__all__ = ["RunConfig", "Session", "ConfigResult", "run_configuration", "prepare_configuration", "resolve_defaults",
           "compare_with_baseline", "auto_dtype", "cpu_has_fast_bf16", "describe_source", "library_versions",
           "acceptance_from_tau", "ensure_line_end", "RECORD_FIELDS"]
