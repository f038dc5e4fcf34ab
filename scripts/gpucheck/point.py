"""One (batch, k) point: a warm-up run that captures every graph, then the measured run."""
from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any, Callable

import torch

from gpucheck.bench import Bench


class PointError(RuntimeError):
    """A point could not be measured as asked (recorded in the results, the run goes on)."""


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def _engine_factory(bench: Bench, args: argparse.Namespace, k: int, model: Any, runners: tuple[Any, Any]
                    ) -> Callable[[Any], Any]:
    from refspec.drafters.draft_model import DraftModelDrafter
    from refspec.engine import Engine, EngineConfig
    from refspec.eval.injection import make_acceptance_fn

    def engine(on_step: Any) -> Any:
        drafter = fn = None
        if k:
            drafter = DraftModelDrafter(runners[1], target_vocab_size=bench.target.args.vocab_size,
                                        kv_bucket=args.kv_bucket)
            fn = make_acceptance_fn(model, torch.Generator(device=bench.device).manual_seed(args.seed + 7))
        return Engine(bench.target, drafter, config=EngineConfig(k=k, kv_bucket=args.kv_bucket),
                      verify_fn=runners[0], acceptance_fn=fn, on_step=on_step)
    return engine


def _measured_run(bench: Bench, engine: Callable[[Any], Any], prompts: list[list[int]], new_tokens: int,
                  runners: tuple[Any, Any]) -> tuple[Any, Any, list[float], float, int, list[float]]:
    """Warm-up, then the measured run; the energy window spans steps 2..N (step 1 holds prefill).

    Returns the generation, the window's measurement, step times (s), warm-up seconds, graph
    captures during the measured run, and the SM clocks read under load (MHz; empty on a CPU).
    """
    sync = torch.cuda.synchronize if bench.device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    engine(None).generate(prompts, max_new_tokens=new_tokens)  # same path: captures every graph needed
    sync()
    warmup_s = time.perf_counter() - t0
    captures_before = sum(r.stats.captures for r in runners)
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
    captures = sum(r.stats.captures for r in runners) - captures_before
    return gen, m, [b - a for a, b in zip(stamps, stamps[1:])], warmup_s, captures, clocks


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


def run_point(bench: Bench, args: argparse.Namespace, batch: int, k: int, *, eager: bool = False) -> dict[str, Any]:
    """Measure one (batch, k): step times, energy (with its source), tau, TPOT, both rooflines.

    ``eager`` runs the same point through the runners without capture (``bench.eager_runners``).
    """
    from refspec.energy.roofline import forward_cost
    from refspec.eval.injection import resolve_acceptance_model

    g = torch.Generator().manual_seed(args.seed + batch)
    prompts = torch.randint(0, bench.target.args.vocab_size, (batch, args.prompt_len), generator=g).tolist()
    model = resolve_acceptance_model(args.accept_model, k=k) if k else None
    runners = bench.eager_runners if eager else (bench.target_runner, bench.draft_runner)
    assert runners is not None, "eager=True needs bench.eager_runners"
    gen, m, measured, warmup_s, captures, clocks = _measured_run(bench, _engine_factory(bench, args, k, model, runners),
                                                         prompts, args.new_tokens, runners)
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
                  "phase_time_s": {p: sum(e.measurement.time_s for e in in_window if e.phase == p)
                                   for p in ("draft", "verify")}}
    return {
        "batch": batch, "k": k, "runner_mode": runners[0].mode, "steps": gen.steps, "measured_steps": len(measured), "warmup_s": warmup_s,
        "captures_during_measurement": captures,
        "step_time_s": {"mean": mean_meas, "median": statistics.median(measured), "p99": _percentile(measured, 0.99)},
        "predicted_step_time_s": mean_pred, "datasheet_predicted_step_time_s": statistics.mean(sheet),
        "measured_over_predicted": mean_meas / mean_pred if mean_pred else None,
        "per_step_s": {"measured": [round(x, 7) for x in measured], "predicted": [round(x, 7) for x in predicted]},
        "sm_clock_mhz": {"min": min(clocks), "median": statistics.median(clocks), "max": max(clocks),
                         "reads": len(clocks), "how": "read passively (NVML), never set"} if clocks else None,
        "run_window": run_window, "window_s": m.time_s, "energy_j": m.energy_j, "energy_source": m.source, "energy_measured": m.measured,
        "idle_w": bench.idle_w, "energy_net_j": net, "emitted_tokens": emitted,
        "j_per_token": per(m.energy_j), "j_per_token_net": per(net),
        "predicted_j_per_token": per(pred_energy), "datasheet_predicted_j_per_token": per(sheet_energy),
        "predicted_energy_source": f"modelled:roofline({bench.profile.name})",
        "tpot_s": mean_meas * row_steps / emitted if emitted else None,
        "tau_observed": (sum(a + 1 for a in accepted) / len(accepted)) if accepted else 1.0,
        "tau_model": model.mean_tau if model else 1.0,
        "acceptance_injected": bool(k), "accept_model": model.name if model else None,
        "verify_intensity_flop_per_byte": intensity, "ridge_flop_per_byte": bench.profile.ridge,
        "datasheet_ridge_flop_per_byte": bench.datasheet.ridge, "verify_compute_bound": intensity > bench.profile.ridge,
    }
