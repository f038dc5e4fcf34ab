"""One point under continuous batching: ``Engine.serve`` keeps B slots busy with a closed-loop
stream, and the headline figures come from its steady-state window.

The stream: ``R = max(4, 3B/2)`` distinct random prompts, budgets drawn uniformly from
``[N/2, 3N/2]`` (N = ``--new-tokens``), so slots free at different steps and refills happen
mid-run. The window and the latency percentiles are the accounting's
(:mod:`refspec.energy.serving_window`, over the run's phase events read as ledger records):
decode steps ``[s0, s1)`` with ``s0`` the first step with every slot busy and ``s1`` the first
later step with an empty slot while the queue is empty; refill prefills after step s belong to
step s. The metered window starts at the first tile (step 1) when ``s0`` is 0.

Energy is read in tiles: the meter's window is closed and reopened at every ``on_step``, which
the engine calls after step s's commit and refill, so tile s holds decode step s and its refill
and the window's energy is the sum of its tiles (counter ends exact, whatever the counter's
update period). A modelled meter's tiles are priced after the run from the work each step
reported (the roofline of that work over the tile's measured time).
"""
from __future__ import annotations

import argparse
import statistics
from typing import Any, Callable

import torch


def stream(batch: int, args: argparse.Namespace, vocab: int) -> list[Any]:
    """The closed-loop request stream of a serving point (seeded by the batch)."""
    from refspec.serving import Request

    g = torch.Generator().manual_seed(args.seed + 1000 + batch)
    n = max(4, (3 * batch + 1) // 2)
    lo, hi = max(2, args.new_tokens // 2), max(3, (3 * args.new_tokens) // 2)
    budgets = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    prompts = torch.randint(0, vocab, (n, args.prompt_len), generator=g).tolist()
    return [Request(id=i, prompt=tuple(p), max_new_tokens=int(m)) for i, (p, m) in enumerate(zip(prompts, budgets))]


def served_run(bench: Any, engine: Callable[[Any], Any], requests: list[Any], batch: int
               ) -> tuple[Any, list[dict[str, Any]], list[float]]:
    """Serve ``requests`` on ``batch`` slots, metering one tile per step; the result, tiles, SM clocks."""
    tiles: list[dict[str, float]] = []
    clocks: list[float] = []
    state = {"open": False}

    def on_step(step: int, _emitted: int) -> None:  # after decode step step-1 and its refill
        if state["open"]:
            m = bench.meter.end("tile")
            tiles.append({"step": step - 1, "time_s": m.time_s, "energy_j": m.energy_j, "source": m.source})
        bench.meter.begin("tile")
        state["open"] = True
        if bench.sm_clock is not None and step % 16 == 1:
            clocks.append(bench.sm_clock())

    res = engine(on_step).serve(requests, batch=batch)
    if state["open"]:
        bench.meter.end("tile")  # the drain after the last step: outside every window
    return res, tiles, clocks


def _modelled_tiles(bench: Any, res: Any, tiles: list[dict[str, float]]) -> None:
    """Price each tile with the roofline of the work its step reported (a modelled meter)."""
    from refspec.energy.roofline import total_cost

    work: dict[int, list] = {}
    for e in res.events:
        work.setdefault(e.step, []).extend(e.work)
    for t in tiles:
        t["energy_j"] = bench.profile.energy_j(total_cost(work.get(t["step"], [])), t["time_s"])
        t["source"] = bench.meter.source


def served_figures(bench: Any, res: Any, tiles: list[dict[str, float]], model: Any) -> dict[str, Any]:
    """The point's figures over its steady-state window (and the whole run beside)."""
    from refspec.energy.roofline import forward_cost, work_time_s
    from refspec.energy.serving_window import event_steps, latency_percentiles, percentile, request_times

    if not bench.energy_measured:
        _modelled_tiles(bench, res, tiles)
    steps_of_run = event_steps(res.events)
    (s0, s1), inside = _window(steps_of_run, tiles)
    steps = {t["step"] for t in inside}
    events = [e for e in res.events if e.step in steps]
    tokens = sum(e.emitted for e in events if e.phase in ("commit", "prefill"))
    energy = sum(t["energy_j"] for t in inside)
    seconds = sum(t["time_s"] for t in inside)
    per_step_work: dict[int, list] = {}
    for e in events:
        per_step_work.setdefault(e.step, []).extend(e.work)
    predicted = [work_time_s(per_step_work.get(s, []), bench.profile) for s in sorted(steps)]
    sheet = [work_time_s(per_step_work.get(s, []), bench.datasheet) for s in sorted(steps)]
    measured = [t["time_s"] for t in inside]
    accepted = [a for s in sorted(steps) for a in res.accepted_per_step[s] if a >= 0]
    verify = [w for e in events if e.phase == "verify" for w in e.work]
    intensity = statistics.mean(forward_cost(w).intensity for w in verify) if verify else float("nan")
    latency = latency_percentiles(request_times(steps_of_run))
    net = None if bench.idle_w is None else energy - bench.idle_w * seconds
    return {
        "schedule": "continuous", "requests": len(res.requests), "window_steps": [s0, s1], "steps": res.steps,
        "measured_steps": len(inside), "window_s": seconds, "energy_j": energy, "energy_source": inside[0]["source"],
        "energy_measured": bench.energy_measured, "idle_w": bench.idle_w, "energy_net_j": net,
        "emitted_tokens": tokens, "j_per_token": energy / tokens, "j_per_token_net": None if net is None else net / tokens,
        "j_per_token_run": sum(t["energy_j"] for t in tiles) / max(1, res.num_emitted),
        "step_time_s": {"mean": statistics.mean(measured), "median": statistics.median(measured),
                        "p99": percentile(measured, 99)},
        "predicted_step_time_s": statistics.mean(predicted), "datasheet_predicted_step_time_s": statistics.mean(sheet),
        "measured_over_predicted": statistics.mean(measured) / statistics.mean(predicted),
        "predicted_j_per_token": sum(bench.profile.energy_j(_cost(per_step_work.get(s, [])), t)
                                     for s, t in zip(sorted(steps), predicted)) / tokens,
        "datasheet_predicted_j_per_token": None, "predicted_energy_source": f"modelled:roofline({bench.profile.name})",
        "tpot_s": latency["tpot_p50_s"], "tpot_p99_s": latency["tpot_p99_s"],
        "ttft_p50_s": latency["ttft_p50_s"], "ttft_p99_s": latency["ttft_p99_s"],
        "tau_observed": sum(a + 1 for a in accepted) / len(accepted) if accepted else 1.0,
        "tau_model": model.mean_tau if model else 1.0, "acceptance_injected": model is not None,
        "accept_model": model.name if model else None, "accept_provenance": model.provenance.kind if model else None,
        "verify_intensity_flop_per_byte": intensity, "ridge_flop_per_byte": bench.profile.ridge,
        "datasheet_ridge_flop_per_byte": bench.datasheet.ridge, "verify_compute_bound": intensity > bench.profile.ridge,
        "run_window": {"energy_j": energy, "time_s": seconds, "steps": len(steps), **_window_work(events)},
        "per_step_s": {"measured": [round(x, 7) for x in measured], "predicted": [round(x, 7) for x in predicted]},
    }


def _window(steps_of_run: Any, tiles: list[dict[str, float]]) -> tuple[tuple[int, int], list[dict[str, float]]]:
    """The steady-state window's step bounds [s0, s1) and the metered tiles inside it."""
    from refspec.energy.serving_window import window_bounds

    span = window_bounds(steps_of_run)
    if span is None:
        raise RuntimeError("the served run never had every slot busy: no steady-state window")
    s0, s1 = max(span[0], tiles[0]["step"] if tiles else 0), span[1]
    inside = [t for t in tiles if s0 <= t["step"] < s1]
    if len(inside) < 3:
        raise RuntimeError(f"steady-state window of {len(inside)} metered steps; raise --new-tokens")
    return (s0, s1), inside


def _window_work(events: list) -> dict[str, Any]:
    """The window's forwards and calls per phase, prefilled rows and phase times."""
    in_window = [e for e in events if e.phase in ("draft", "verify")]
    return {"forwards": {p: sum(len(e.work) for e in in_window if e.phase == p) for p in ("draft", "verify")},
            "calls": {p: len([e for e in in_window if e.phase == p]) for p in ("draft", "verify")},
            "prefill_rows": sum(e.rows_active for e in events if e.phase == "prefill"),
            "phase_time_s": {p: sum(e.measurement.time_s for e in events if e.phase == p)
                             for p in ("draft", "verify", "prefill")}}


def _cost(work: list) -> Any:
    from refspec.energy.roofline import total_cost

    return total_cost(work)
