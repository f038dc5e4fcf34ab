"""One (batch, drafter, corpus) point: a warm-up run that captures every graph (once per batch and
drafter), then the measured run with acceptance injected from the corpus's recorded distribution."""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch

from gpucheck.bench import Bench
from gpucheck.drafting import Recorder, acceptance_model, build_drafter
from gpucheck.grid import DrafterSpec


class PointError(RuntimeError):
    """A point could not be measured as asked (recorded in the results, the run goes on)."""


def _engine_factory(bench: Bench, args: argparse.Namespace, spec: DrafterSpec, model: Any, runner: Any,
                    record_at: int) -> Callable[[Any], Any]:
    """Engines of one point: a fresh drafter (wrapped in a :class:`Recorder`) and injection each call."""
    from refspec.engine import Engine, EngineConfig
    from refspec.eval.injection import make_acceptance_fn

    def engine(on_step: Any) -> Any:
        drafter = fn = None
        if spec.k:
            drafter = Recorder(build_drafter(spec, bench.target, args.kv_bucket, bench.heads), record_at)
            fn = make_acceptance_fn(model, torch.Generator(device=bench.device).manual_seed(args.seed + 7))
        engine.drafter = drafter
        return Engine(bench.target, drafter, config=EngineConfig(k=spec.k, kv_bucket=args.kv_bucket),
                      verify_fn=runner, acceptance_fn=fn, on_step=on_step)
    engine.drafter = None
    return engine


def _measured_run(bench: Bench, engine: Callable[[Any], Any], prompts: list[list[int]], new_tokens: int,
                  runner: Any, warm_up: bool) -> tuple[Any, Any, list[float], float, int, list[float], Any]:
    """Warm-up (unless this point's graphs are captured already), then the measured run; the
    energy window opens after the first decode step (the prefill and first step stay outside).

    Returns the generation, the window's measurement, step times (s), warm-up seconds, graph
    captures during the measured run, the SM clocks read under load (MHz; empty on a CPU), and
    the recorder holding the mid-run draft state (None for k = 0).
    """
    sync = torch.cuda.synchronize if bench.device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    recorder = None
    if warm_up:
        engine(None).generate(prompts, max_new_tokens=new_tokens)  # same path: captures every graph needed
        recorder = engine.drafter
    sync()
    warmup_s = time.perf_counter() - t0
    captures_before = runner.stats.captures
    stamps: list[float] = []
    clocks: list[float] = []

    def on_step(step: int, _emitted: int) -> None:
        stamps.append(time.perf_counter())  # after the step's host sync: its GPU work is done
        if step == 1:
            bench.meter.begin("decode")
        if bench.sm_clock is not None and step % 16 == 1:
            clocks.append(bench.sm_clock())  # passive read under load: claim 7's DVFS headroom

    gen = engine(on_step).generate(prompts, max_new_tokens=new_tokens)
    if gen.steps < 3:
        bench.meter.end("decode")
        raise PointError(f"ran {gen.steps} steps; raise --new-tokens so every point runs at least 3 "
                         f"(the energy window spans steps 2..N)")
    work = tuple(w for e in gen.events if e.step >= 1 and e.phase in ("draft", "verify") for w in e.work)
    m = bench.meter.end("decode", work)
    captures = runner.stats.captures - captures_before
    recorder = recorder if recorder is not None and recorder.state is not None else engine.drafter
    return gen, m, [b - a for a, b in zip(stamps, stamps[1:])], warmup_s, captures, clocks, recorder


def _predictions(gen: Any, profile: Any) -> tuple[list[float], float]:
    """Roofline step times of steps 1..N-1 and their energy, from the work each step reported."""
    from refspec.energy.roofline import total_cost, work_time_s

    per_step: dict[int, list] = {}
    for e in gen.events:
        if e.step >= 1 and e.phase in ("draft", "verify"):
            per_step.setdefault(e.step, []).extend(e.work)
    times = [work_time_s(per_step.get(i, []), profile) for i in range(1, gen.steps)]
    energy = sum(profile.energy_j(total_cost(per_step.get(i, [])), t) for i, t in zip(range(1, gen.steps), times))
    return times, energy


def _row_tpot_p99(gen: Any, step_s: float) -> float | None:
    """p99 over rows of (steps the row decoded x the mean measured step time / its tokens)."""
    from refspec.energy.serving_window import percentile

    steps = [0] * len(gen.accepted_per_step[0]) if gen.accepted_per_step else []
    tokens = list(steps)
    for step in gen.accepted_per_step[1:]:
        for row, a in enumerate(step):
            if a >= 0:
                steps[row] += 1
                tokens[row] += a + 1
    per_row = [s * step_s / t for s, t in zip(steps, tokens) if t]
    return percentile(per_row, 99)


def run_point(bench: Bench, args: argparse.Namespace, batch: int, spec: DrafterSpec, corpus: str, *,
              eager: bool = False) -> dict[str, Any]:
    """Measure one (batch, drafter, corpus): step times, energy (with its source), tau, TPOT, both rooflines.

    ``eager`` runs the same point through the target runner without capture (``bench.eager_runner``).
    The returned dict holds the point's figures; its ``"_recorder"`` entry (removed before
    saving) holds the drafter with a mid-run state for the phase loops.
    """
    g = torch.Generator().manual_seed(args.seed + batch)
    prompts = torch.randint(0, bench.target.args.vocab_size, (batch, args.prompt_len), generator=g).tolist()
    model = acceptance_model(spec, corpus, args.accept_file) if spec.k else None
    runner = bench.eager_runner if eager else bench.target_runner
    assert runner is not None, "eager=True needs bench.eager_runner"
    tau = model.mean_tau if model else 1.0
    record_at = max(2, int(args.new_tokens / tau / 2))
    key = (batch, spec.label, runner.mode)
    warm_up = key not in bench.warmed and not eager
    factory = _engine_factory(bench, args, spec, model, runner, record_at)
    fallback = None
    if args.schedule == "continuous" and not eager:
        try:
            return _served_point(bench, args, batch, spec, corpus, model, factory, warm_up)
        except _NoContinuous as exc:
            fallback = str(exc)
    gen, m, measured, warmup_s, captures, clocks, recorder = _measured_run(
        bench, factory, prompts, args.new_tokens, runner, warm_up)
    bench.warmed.add(key)
    out = _figures(bench, gen, m, measured, model)
    out.update({"schedule": "static", "schedule_fallback": fallback, "arch": bench.arch, "batch": batch, "k": spec.k,
                "drafter": spec.name, "drafter_label": spec.label, "corpus": corpus if spec.k else None, "runner_mode": runner.mode, "warmed_up": warm_up,
                "warmup_s": warmup_s, "captures_during_measurement": captures,
                "sm_clock_mhz": {"min": min(clocks), "median": statistics.median(clocks), "max": max(clocks),
                                 "reads": len(clocks), "how": "read passively (NVML), never set"} if clocks else None,
                "_recorder": recorder})
    return out


class _NoContinuous(RuntimeError):
    """The continuous scheduler cannot run this point (no Engine.serve, or a drafter without reset_rows)."""


def _served_point(bench: Bench, args: argparse.Namespace, batch: int, spec: DrafterSpec, corpus: str, model: Any,
                  factory: Callable[[Any], Any], warm_up: bool) -> dict[str, Any]:
    """The point under continuous batching (``gpucheck.serving``): a static warm-up at the longest
    budget captures the graphs, then a closed-loop stream measured over its steady-state window."""
    from refspec.engine import Engine, GenerationError

    from gpucheck.serving import served_figures, served_run, stream

    if not hasattr(Engine, "serve"):
        raise _NoContinuous("continuous batching unavailable (no Engine.serve): static schedule")
    if spec.k and not hasattr(factory(None).drafter, "reset_rows"):
        raise _NoContinuous(f"continuous batching unavailable (drafter {spec.name} has no reset_rows): static schedule")
    requests = stream(batch, args, bench.target.args.vocab_size)
    t0 = time.perf_counter()
    recorder = None
    if warm_up:
        prompts = [list(r.prompt) for r in requests[:batch]]
        factory(None).generate(prompts, max_new_tokens=max(r.max_new_tokens for r in requests))
        recorder = factory.drafter
    warmup_s = time.perf_counter() - t0
    captures = bench.target_runner.stats.captures
    try:
        res, tiles, clocks = served_run(bench, factory, requests, batch)
    except GenerationError as exc:
        raise _NoContinuous(f"Engine.serve refused: {exc}") from exc
    bench.warmed.add((batch, spec.label, bench.target_runner.mode))
    out = served_figures(bench, res, tiles, model)
    recorder = recorder if recorder is not None and recorder.state is not None else factory.drafter
    out.update({"arch": bench.arch, "batch": batch, "k": spec.k, "drafter": spec.name, "drafter_label": spec.label,
                "corpus": corpus if spec.k else None, "runner_mode": bench.target_runner.mode, "warmed_up": warm_up,
                "warmup_s": warmup_s, "captures_during_measurement": bench.target_runner.stats.captures - captures,
                "sm_clock_mhz": {"min": min(clocks), "median": statistics.median(clocks), "max": max(clocks),
                                 "reads": len(clocks), "how": "read passively (NVML), never set"} if clocks else None,
                "_recorder": recorder})
    return out


def _figures(bench: Bench, gen: Any, m: Any, measured: list[float], model: Any) -> dict[str, Any]:
    """The point's figures from its generation and the measured window."""
    from refspec.energy.roofline import forward_cost
    from refspec.energy.serving_window import percentile

    events = [e for e in gen.events if e.step >= 1]
    predicted, pred_energy = _predictions(gen, bench.profile)
    sheet, sheet_energy = _predictions(gen, bench.datasheet)
    emitted = sum(e.emitted for e in events if e.phase == "commit")
    row_steps = sum(e.rows_active for e in events if e.phase == "verify")
    accepted = [a for step in gen.accepted_per_step[1:] for a in step if a >= 0]
    shapes = [w for e in events if e.phase == "verify" for w in e.work]
    intensity = statistics.mean(forward_cost(w).intensity for w in shapes) if shapes else float("nan")
    net = None if m.energy_j is None or bench.idle_w is None else m.energy_j - bench.idle_w * m.time_s
    mean_meas, mean_pred = statistics.mean(measured), statistics.mean(predicted)
    per = (lambda x: x / emitted if x is not None and emitted else None)
    in_window = [e for e in events if e.phase in ("draft", "verify")]
    run_window = {"energy_j": m.energy_j, "time_s": m.time_s, "steps": len({e.step for e in events}),
                  "forwards": {p: sum(len(e.work) for e in in_window if e.phase == p) for p in ("draft", "verify")},
                  "calls": {p: len([e for e in in_window if e.phase == p]) for p in ("draft", "verify")},
                  "phase_time_s": {p: sum(e.measurement.time_s for e in in_window if e.phase == p)
                                   for p in ("draft", "verify")}}
    return {
        "steps": gen.steps, "measured_steps": len(measured),
        "step_time_s": {"mean": mean_meas, "median": statistics.median(measured), "p99": percentile(measured, 99)},
        "predicted_step_time_s": mean_pred, "datasheet_predicted_step_time_s": statistics.mean(sheet),
        "measured_over_predicted": mean_meas / mean_pred if mean_pred else None,
        "per_step_s": {"measured": [round(x, 7) for x in measured], "predicted": [round(x, 7) for x in predicted]},
        "run_window": run_window, "window_s": m.time_s, "energy_j": m.energy_j, "energy_source": m.source,
        "energy_measured": m.measured, "idle_w": bench.idle_w, "energy_net_j": net, "emitted_tokens": emitted,
        "j_per_token": per(m.energy_j), "j_per_token_net": per(net),
        "predicted_j_per_token": per(pred_energy), "datasheet_predicted_j_per_token": per(sheet_energy),
        "predicted_energy_source": f"modelled:roofline({bench.profile.name})",
        "tpot_s": mean_meas * row_steps / emitted if emitted else None,
        "tpot_p99_s": _row_tpot_p99(gen, mean_meas),
        "tau_observed": (sum(a + 1 for a in accepted) / len(accepted)) if accepted else 1.0,
        "tau_model": model.mean_tau if model else 1.0,
        "acceptance_injected": model is not None, "accept_model": model.name if model else None,
        "accept_provenance": model.provenance.kind if model else None,
        "verify_intensity_flop_per_byte": intensity, "ridge_flop_per_byte": bench.profile.ridge,
        "datasheet_ridge_flop_per_byte": bench.datasheet.ridge, "verify_compute_bound": intensity > bench.profile.ridge,
    }
