"""Measured energy per phase: phase-isolated loops at a point's exact shapes, checked against the
measured run (``refspec.energy.attribution``).

The energy counter updates every 20-100 ms and a draft or verify forward lasts milliseconds, so
a single phase cannot be read. Each phase (prefill ``[B, P]`` and verify ``[B, k+1]`` through the
target's runner, graphs on a GPU, at the run's mid context and key bucket; the draft phase of a
recorded mid-run step through the drafter itself) is repeated for at least ``min_s`` seconds,
cut into sub-windows. Two estimates follow:

* (A) J per call of each loop x phase calls per step of the run: the phase split, and the
  additivity residual against the measured run's J per step;
* (B) a non-negative fit of phase powers over every window (the loops' sub-windows and the run
  window with its per-phase times): its share of each phase and its residual.

Their agreement is the largest difference of a phase's share between (A) and (B). Every figure
carries the meter's source: on a CPU dry run it is modelled and says so.
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import torch

from gpucheck.bench import Bench

SUB_WINDOWS = 4


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _forward(runner: Any, batch: int, tokens: int, start: int, kv_bucket: int, vocab: int,
             max_len: int) -> Callable[[], None]:
    """One static-shape forward of ``[batch, tokens]`` at positions ``start..`` of a runner's cache."""
    dev = runner.model.device
    g = torch.Generator().manual_seed(batch * 1000 + tokens)
    ids = torch.randint(0, vocab, (batch, tokens), generator=g).to(dev)
    pos = (start + torch.arange(tokens)).expand(batch, tokens).contiguous().to(dev)
    cache = runner.new_cache(batch, max_len)
    num_keys = min(cache.max_len, _round_up(start + tokens, kv_bucket))
    return lambda: runner(ids, pos, cache, num_keys=num_keys)


def _loop(bench: Bench, name: str, fn: Callable[[], None], min_s: float) -> dict[str, Any]:
    """Repeat ``fn`` for ``min_s`` seconds in ``SUB_WINDOWS`` metered sub-windows."""
    from refspec.energy.phases import WorkRecorder

    sync = torch.cuda.synchronize if bench.device.type == "cuda" else (lambda: None)
    fn()  # warm-up: captures the graph of this shape
    sync()
    windows = []
    for _ in range(SUB_WINDOWS):
        calls, t0 = 0, time.perf_counter()
        bench.meter.begin(f"loop:{name}")
        with WorkRecorder() as rec:
            while calls == 0 or time.perf_counter() - t0 < min_s / SUB_WINDOWS:
                fn()
                calls += 1
                sync()  # a few microseconds idle per call, against milliseconds of work
        m = bench.meter.end(f"loop:{name}", rec.work)
        windows.append({"calls": calls, "time_s": m.time_s, "energy_j": m.energy_j})
    calls = sum(w["calls"] for w in windows)
    energy = sum(w["energy_j"] for w in windows)
    seconds = sum(w["time_s"] for w in windows)
    return {"phase": name, "calls": calls, "time_s": seconds, "energy_j": energy, "j_per_call": energy / calls,
            "s_per_call": seconds / calls, "energy_source": m.source, "windows": windows}


def isolated_loops(bench: Bench, args: argparse.Namespace, batch: int, spec: Any, recorder: Any,
                   min_s: float) -> dict[str, Any]:
    """Prefill, verify and (k > 0) draft loops of one point, each measured once per shape.

    Loops are cached in ``bench.loops`` by shape: prefill by batch, verify by (batch, k + 1),
    the draft phase by (batch, drafter, k) (it does not depend on the corpus). The draft loop
    repeats the recorded mid-run draft phase (:func:`gpucheck.drafting.draft_call`).
    """
    vocab, mid, kvb = bench.target.args.vocab_size, args.prompt_len + args.new_tokens // 2, args.kv_bucket
    runner = bench.target_runner
    shapes: dict[str, tuple] = {"prefill": ("prefill", batch), "verify": ("verify", batch, spec.k + 1)}
    if spec.k:
        shapes["draft"] = ("draft", batch, spec.name, spec.k)
    loops = {}
    for name, key in shapes.items():
        if key not in bench.loops:
            if name == "draft":
                from gpucheck.drafting import draft_call

                fn = draft_call(recorder, spec.k)
            else:
                tokens, start = (args.prompt_len, 0) if name == "prefill" else (spec.k + 1, mid)
                fn = _forward(runner, batch, tokens, start, kvb, vocab, bench.max_len)
            bench.loops[key] = {**_loop(bench, name, fn, min_s), "rows": batch}
        loops[name] = bench.loops[key]
    return loops


def split(loops: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """Both estimates of the per-step phase split, the additivity residual and their agreement.

    Args:
        loops: from :func:`isolated_loops`.
        run: the measured run: ``energy_j``, ``time_s``, ``steps``, and per phase
            ``forwards`` (calls in the window) and ``phase_time_s``; under serving also
            ``prefill_rows`` (rows refilled in the window, priced per row of the prefill loop)
            and ``phase_time_s["prefill"]``.
    """
    from refspec.energy.attribution import Loop, additivity_check, nnls_phase_power

    phases = [p for p in ("draft", "verify") if p in loops]
    steps = run["steps"]
    calls = dict(run.get("calls", run["forwards"]))  # phase calls in the window (a draft phase may run K forwards)
    if run.get("prefill_rows") and "prefill" in loops:  # serving: refills of R rows, priced per row of the loop
        phases.append("prefill")
        calls["prefill"] = run["prefill_rows"] / loops["prefill"]["rows"]
    per_step = {p: Loop(energy_j=loops[p]["j_per_call"] * calls[p],
                        time_s=loops[p]["s_per_call"] * calls[p], iterations=steps) for p in phases}
    add = additivity_check(per_step, Loop(energy_j=run["energy_j"], time_s=run["time_s"], iterations=steps))
    energies, times = [], []
    for p in phases:
        for w in loops[p]["windows"]:
            energies.append(w["energy_j"])
            times.append([w["time_s"] if q == p else 0.0 for q in phases])
    energies.append(run["energy_j"])
    times.append([run["phase_time_s"][p] for p in phases])
    fit = nnls_phase_power(energies, times, phases)
    return {
        "phases": phases, "loops_share": add.phase_share, "loops_j_per_step": add.phase_j_per_step,
        "loops_sum_j_per_step": add.predicted_j_per_step, "run_j_per_step": add.combined_j_per_step,
        "additivity_residual": add.relative_error, "additivity_time_residual": add.time_relative_error,
        "additive_within_5pct": add.ok, "fit_power_w": fit.power_w, "fit_share": fit.share,
        "fit_relative_residual": fit.relative_residual,
        "agreement_max_share_diff": max(abs(add.phase_share[p] - fit.share[p]) for p in phases),
        "prefill_j_per_call": loops["prefill"]["j_per_call"], "prefill_s_per_call": loops["prefill"]["s_per_call"],
        "energy_source": loops["verify"]["energy_source"],
    }
