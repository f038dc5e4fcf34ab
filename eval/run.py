"""One evaluation configuration, from its settings to its record: what ``run`` and ``sweep`` share.

A :class:`~refspec.eval.run_config.RunConfig` names everything that changes a figure; a
:class:`~refspec.eval.session.Session` holds what configurations share (target, meter, verify
callable, drafters, prompts, streams). :func:`prepare_configuration` builds what a
configuration needs so a bad setting fails before anything runs; :func:`run_configuration`
runs it through the pipeline (:mod:`refspec.eval.pipeline`) and returns its
:class:`~refspec.eval.record.RunRecord`, whose figures come from the ledger alone
(:func:`configuration_record`, which a server session's record is built by too).

Serving: ``continuous`` (the default) keeps B slots busy, refilling each freed slot from the
stream, in one ledger run; ``static`` serves lockstep batches of B requests that drain, one
ledger run each (``<config id>.<attempt>.b<i>``). A configuration and its baseline serve the
same stream (same ids, prompts, budgets and arrivals), so outputs compare request by request.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Sequence

import torch

from refspec.energy.ledger.writer import mark_aborted
from refspec.eval import pipeline
from refspec.eval.baseline import with_baseline
from refspec.eval.flags import UsageError
from refspec.eval.load import LoadProbe, host_section
from refspec.eval.machine import gemm_plan_text, library_versions
from refspec.eval.record import Host, RequestOutput, RunRecord, Stream
from refspec.eval.record_files import append_record
from refspec.eval.record_figures import accounting_sections, request_figures, roofline_figures, work_section
from refspec.eval.run_config import RunConfig
from refspec.eval.session import Session

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ConfigResult:
    """A finished configuration: its record and the engine's result of each served chunk."""

    record: RunRecord
    generations: list[Any]


# ---- before any run -----------------------------------------------------------------------------
def _injection(cfg: RunConfig, device: torch.device) -> tuple[Any, dict[str, Any] | None, str | None]:
    """The engine's acceptance_fn, the injection's record and its label (Nones without injection)."""
    if cfg.accept_model is None:
        return None, None, None
    from refspec.eval.injection import injection_label, injection_record, make_acceptance_fn, resolve_acceptance_model

    model = resolve_acceptance_model(cfg.accept_model, k=cfg.k, drafter=cfg.drafter, corpus=cfg.corpus)
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 7919)
    log.info("%s", injection_label(model))
    k = cfg.k if cfg.spec_policy == "fixed" else None  # under a policy the model is cut to each step's K
    return make_acceptance_fn(model, gen, k=k), injection_record(model), injection_label(model)


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


def _free_bytes(device: torch.device) -> int:
    """Memory a new allocation can take on ``device`` (CUDA: free device memory; CPU: available RAM)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as fh:
            avail = next(int(ln.split()[1]) * 1024 for ln in fh if ln.startswith("MemAvailable:"))
        return avail
    except (OSError, StopIteration, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _check_memory(session: Session, cfg: RunConfig, prompts: Sequence[Sequence[int]]) -> None:
    """The batch's KV cache (keys and values of every row over the whole context) fits in free memory."""
    model = session.target.model
    slots = max(map(len, prompts)) + cfg.max_new_tokens + cfg.k + 1
    hkv = model.heads()[0]
    per_row = 2 * model.num_layers * hkv * model.args.head_dim * slots * model.dtype.itemsize  # bytes, K and V
    need, free = cfg.batch * per_row, _free_bytes(session.device)
    if need > free:
        rows = max(1, free // per_row)
        raise UsageError(f"--batch {cfg.batch} ({cfg.label}): its KV cache needs {need / 2**30:.1f} GiB and "
                         f"{session.device} has {free / 2**30:.1f} GiB free; use --batch {rows} or less")


def prepare_configuration(session: Session, cfg: RunConfig) -> None:
    """Load what ``cfg`` needs (prompts, stream, drafter, injected model) so a bad setting fails before any run.

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
    _check_memory(session, cfg, prompts)
    _injection(cfg, session.device)


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


# ---- serving ------------------------------------------------------------------------------------
def build_engine(session: Session, cfg: RunConfig, drafter: Any, acceptance_fn: Any, ledger: Any) -> Any:
    """The engine of ``cfg`` (its sampling, policy, meter and verify callable), every phase event going to
    ``ledger``; ``acceptance_fn`` is an injected acceptance model's (None: the drafter's own)."""
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


def serve_chunks(session: Session, cfg: RunConfig, engine: Any, ledger: Any, chunks: Sequence[Sequence[Any]],
                 run_ids: Sequence[str], labels: Sequence[dict[str, Any]]) -> list[Any]:
    """Serve each chunk of requests (continuous: the whole stream; static: lockstep batches), each
    chunk a ledger run of its own (the first is open); returns the ``ServeResult`` of each."""
    from tqdm.auto import tqdm

    continuous = cfg.schedule == "continuous"
    results = []
    with tqdm(total=sum(q.max_new_tokens for c in chunks for q in c), unit="tok", desc=cfg.label, file=sys.stderr,
              dynamic_ncols=True, disable=not session.progress, leave=False) as bar:
        for i, run_id in enumerate(run_ids):
            if i:
                ledger.begin_run(run_id, labels=labels[i])
            counted = [0]

            def on_step(step: int, emitted: int, _counted: list[int] = counted) -> None:
                bar.update(emitted - _counted[0])
                _counted[0] = emitted

            engine.on_step = on_step
            # a static chunk is a batch of its own size, as lockstep decoding ran it (a short last chunk too)
            res = pipeline.serve(engine, chunks[i], batch=cfg.batch if continuous else len(chunks[i]),
                                 seed=cfg.seed + i, device=session.device, refill=continuous)
            results.append(res)
            bar.update(sum(q.max_new_tokens for q in chunks[i]) - counted[0])
            bar.set_postfix_str(f"batch {i + 1}/{len(run_ids)}" if cfg.is_baseline else f"tau {res.tau:.2f}")
    return results


# ---- the record ---------------------------------------------------------------------------------
def _digest(rows: Sequence[Sequence[int]]) -> tuple[str, tuple[str, ...]]:
    per_row = tuple(hashlib.sha256(json.dumps(list(r)).encode()).hexdigest()[:16] for r in rows)
    return hashlib.sha256("".join(per_row).encode()).hexdigest(), per_row


def _record(session: Session, cfg: RunConfig, stream: Any, results: Sequence[Any], ledger_records: Any, acc: Any,
            *, ledger_path: Path, injection: dict[str, Any] | None, drafter: Any) -> RunRecord:
    """The configuration's record: its identity, what ran, and the accounting's figures."""
    served = {r.id: r for res in results for r in res.requests}
    asked = [RequestOutput(id=q.id, prompt=tuple(q.prompt), budget=q.max_new_tokens, arrival_s=q.arrival_s,
                           tokens=tuple(served[q.id].tokens)) for q in stream.requests]
    per_request, outputs = request_figures(ledger_records, acc, results, asked, profile=session.roofline_profile)
    output_digest, row_digests = _digest([o.tokens for o in outputs])
    prompts = [q.prompt for q in stream.requests]
    return RunRecord(
        config_id=cfg.config_id, config=cfg.identity(), baseline_config_id=cfg.baseline().config_id,
        model=cfg.model, drafter=cfg.drafter, k=cfg.k, spec_policy=cfg.spec_policy, tree=cfg.tree, batch=cfg.batch,
        corpus=cfg.corpus, dtype=cfg.dtype, device=cfg.device, meter=cfg.meter, temperature=cfg.temperature,
        greedy=cfg.greedy, seed=cfg.seed, cuda_graphs=cfg.cuda_graphs, compiled_step=session.compile_step,
        threads=torch.get_num_threads(), time_source=session.time_source, acceptance_injected=injection is not None,
        injection=injection, output_digest=output_digest, row_digests=row_digests, request_outputs=outputs,
        stream=Stream(schedule=cfg.schedule, requests=len(stream.requests), requests_unique=stream.unique,
                      request_rate=cfg.request_rate, max_new_tokens=cfg.max_new_tokens, output_lengths=stream.lengths,
                      stream_digest=stream.digest, batches=len(acc.run_ids), run_ids=tuple(acc.run_ids),
                      ledger=ledger_path.name),
        work=work_section(ledger_records, acc.run_ids, [len(p) for p in prompts]), per_request=per_request,
        roofline=roofline_prediction(session, cfg, drafter, prompts, acc.tau,
                                     [q.max_new_tokens for q in stream.requests]),
        versions=library_versions(), cpu_gemm_plan=gemm_plan_text(session.target.prepared.cpu_plan),
        **accounting_sections(acc))


def configuration_record(session: Session, cfg: RunConfig, stream: Any, results: Sequence[Any], *,
                         ledger_path: Path, start_offset: int, run_ids: Sequence[str], drafter: Any,
                         injection: dict[str, Any] | None = None, baseline: RunRecord | None = None,
                         started_s: float, host: Host | None = None) -> RunRecord:
    """The record of ``cfg`` whose ended ledger runs ``run_ids`` lie in ``ledger_path`` from byte ``start_offset``.

    Its figures come from the ledger as written to disk (:func:`refspec.eval.pipeline.read_back`), never
    from the engine's own counts; ``run`` and ``sweep`` build every record here, a server session too.

    Args:
        stream: the requests served (a :class:`~refspec.eval.requests.RequestStream`).
        results: the engine's ``ServeResult`` of each run.
        drafter: the drafter that ran (None for the baseline), for the roofline's prediction.
        injection: the injected acceptance model's record, or None.
        baseline: the baseline's record at the same batch, for the comparison section.
        started_s: ``time.perf_counter()`` when the configuration started (the record's ``wall_s``).
        host: the host's load while serving (:meth:`refspec.eval.load.LoadProbe.stop`), or None.

    Raises:
        AccountingError: the runs cannot be accounted.
    """
    from refspec.eval.audit import margin_fn

    records = pipeline.read_back(ledger_path, offset=start_offset)
    acc = pipeline.account(records, run_ids)
    record = _record(session, cfg, stream, results, records, acc, ledger_path=ledger_path, injection=injection,
                     drafter=drafter)
    if host is not None:
        record = dataclasses.replace(record, host=host_section(host, record))
    record = with_baseline(record, baseline, margin_fn=margin_fn(session.target.model))
    return dataclasses.replace(record, wall_s=time.perf_counter() - started_s, created_unix_s=time.time())


def roofline_prediction(session: Session, cfg: RunConfig, drafter: Any, prompts: Sequence[Sequence[int]],
                        tau: float | None, budgets: Sequence[int] | None = None) -> dict[str, Any] | None:
    """The roofline's (modelled) prediction of a steady-state step of ``cfg``, or None: no hardware profile,
    a tree, or a drafter without a ``roofline_model`` (a plug-in provides one the same way; None: a free
    drafter). ``budgets``: the requests' budgets (default: the cap each)."""
    profile = session.roofline_profile
    provide = None if cfg.is_baseline else getattr(drafter, "roofline_model", None)
    if profile is None or cfg.tree or (not cfg.is_baseline and provide is None):
        return None
    args = session.target.model.args
    return roofline_figures(args, profile, batch=cfg.batch, k=cfg.k, drafter_model=provide and provide(args),
                            prompts=prompts, tau=tau, budgets=budgets or [cfg.max_new_tokens],
                            dtype_bytes=session.dtype_bytes)


def _g(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def run_configuration(session: Session, cfg: RunConfig, *, ledger_path: Path, records_path: Path | None = None,
                      baseline: RunRecord | None = None) -> ConfigResult:
    """Run one configuration, append its ledger runs (and its record), and return its record.

    Its ledger runs count only with their record: any exception (Ctrl-C, SIGTERM, a closed pipe, a
    full disk) from the first run's start until the record is appended marks every one of them
    aborted, so no ledger says a run completed that no record names.

    Args:
        session: the shared target, meter and caches.
        cfg: the configuration.
        ledger_path: JSONL ledger to append to (one run per chunk).
        records_path: the records file the record is appended to (None: the caller keeps it).
        baseline: the baseline's record at the same batch, for the comparison.
    """
    t_start = time.perf_counter()
    prompts = _prompts(session, cfg)
    stream = session.stream(cfg)  # the same requests, budgets and arrivals for every configuration
    chunks = [stream.requests] if cfg.schedule == "continuous" else stream.chunks(cfg.batch)
    drafter = session.drafter(cfg)
    acceptance_fn, injection, label = _injection(cfg, session.device)
    attempt = uuid.uuid4().hex[:6]
    run_ids = [f"{cfg.config_id}.{attempt}.b{i}" for i in range(len(chunks))]
    injected = {"acceptance_injected": True, "injection": label} if label else {}
    labels = [{**cfg.identity(), "config_id": cfg.config_id, "batch_index": i, "batches": len(chunks), **injected}
              for i in range(len(chunks))]
    ledger = None
    try:
        with pipeline.open_ledger(session.meter, ledger_path, run_ids[0], labels[0]) as ledger:
            results, host = _serve_all(session, cfg, ledger, drafter, acceptance_fn, prompts, stream, chunks,
                                       run_ids, labels)
        record = configuration_record(session, cfg, stream, results, ledger_path=ledger_path,
                                      start_offset=ledger.start_offset, run_ids=ledger.run_ids, injection=injection,
                                      drafter=drafter, baseline=baseline, started_s=t_start, host=host)
        window = record.window.j_per_token if record.window is not None else None
        log.info("%s: tau %s, %.2f tok/s, J/token window %s, run %s (%s)", cfg.label, _g(record.counts.tau, ".3f"),
                 record.run.tokens_per_s or 0.0, _g(window, ".4g"), _g(record.run.j_per_token, ".4g"),
                 record.energy.energy_source_text)
        if records_path is not None:
            append_record(records_path, record)
    except BaseException as exc:  # runs that completed but that no record will name: the ledger must say so
        if ledger is not None and ledger.run_ids:
            mark_aborted(ledger_path, ledger.run_ids, type(exc).__name__)
        raise
    return ConfigResult(record=record, generations=results)


def _serve_all(session: Session, cfg: RunConfig, ledger: Any, drafter: Any, acceptance_fn: Any,
               prompts: list[list[int]], stream: Any, chunks: Sequence[Sequence[Any]], run_ids: Sequence[str],
               labels: Sequence[dict[str, Any]]) -> tuple[list[Any], Host]:
    """Warm up, serve every chunk into ``ledger`` and, under a counter, run the phase loops; returns the
    chunks' results and the host's load while they were served."""
    engine = build_engine(session, cfg, drafter, acceptance_fn, ledger)
    session.warm(engine, cfg, prompts)
    probe = LoadProbe.start()
    results = serve_chunks(session, cfg, engine, ledger, chunks, run_ids, labels)
    host = probe.stop()
    if pipeline.reads_counter(session.meter) and session.phase_loops_s != 0:
        ledger.end_run()  # under a counter: the loops lie outside every window of the run
        loops = pipeline.phase_loops(engine, session.meter, results, batch=cfg.batch, k=cfg.k,
                                     prompts=[q.prompt for q in stream.requests], min_s=session.phase_loops_s,
                                     seed=cfg.seed)
        pipeline.write_loops(ledger, loops, session.meter.source)
        log.info("phase loops (%s): %s", session.meter.source,
                 ", ".join(f"{p} {lp.j_per_step * 1e3:.3g} mJ/call x {lp.iterations}" for p, lp in loops.items()))
    return results, host


__all__ = ["ConfigResult", "prepare_configuration", "resolve_defaults", "build_engine", "serve_chunks",
           "configuration_record", "roofline_prediction", "run_configuration"]
