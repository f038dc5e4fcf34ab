"""One shape of the grid: its warm-up, its variants served ``repeats`` times, its phase loops.

Each served run goes through the pipeline ``run`` and ``sweep`` use (:mod:`refspec.eval.pipeline`):
a ledger run of its own (a counter meter's reads recorded beside the phases), served, read back
and accounted; its figures come from the accounting alone: the steady-state window's J/token
(read by the counter over the window) and its validity, the per-phase split (attributed from
the phase loops and the fit over sub-windows, with their agreement and the additivity residual),
TPOT and TTFT percentiles, tau. The phase loops run once per shape, after its first run, at that
run's shapes, and their records are written into every run of the shape: they measure the same
forwards.

Streams: closed loop on B slots, random prompts of ``prompt_len`` tokens, budgets uniform in
[N/2, 3N/2]; request i is the same at every variant of a batch (seeded by batch and id), and as
many are served as the window needs (:func:`refspec.eval.paper.grid.plan_stream`).
"""
from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from refspec.eval import pipeline
from refspec.eval.paper.grid import LOOP_MARGIN, DrafterSpec
from refspec.eval.paper.targets import MappedMeter, MappedObserver, Target

log = logging.getLogger("refspec.eval.paper")


@dataclasses.dataclass
class Pace:
    """Measured step time over planned, per (arch, drafter kind), so later streams fit their window."""

    ratios: dict[tuple[str, str], float] = dataclasses.field(default_factory=dict)

    def step_s(self, arch: str, kind: str, planned_s: float) -> float:
        return planned_s * self.ratios.get((arch, kind), self.ratios.get((arch, "any"), 1.0))

    def learn(self, arch: str, kind: str, planned_s: float, measured_s: float) -> None:
        if planned_s > 0 and measured_s > 0:
            self.ratios[(arch, kind)] = self.ratios[(arch, "any")] = measured_s / planned_s


def requests_of(batch: int, n: int, *, prompt_len: int, new_tokens: int, vocab: int, seed: int) -> list[Any]:
    """Request ids 0..n-1 of a batch's stream: request i is the same whatever n is."""
    from refspec.serving import Request

    out = []
    lo, hi = max(2, new_tokens // 2), max(3, (3 * new_tokens) // 2)
    for i in range(n):
        g = torch.Generator().manual_seed(seed * 1_000_003 + batch * 10_007 + i)
        budget = int(torch.randint(lo, hi + 1, (1,), generator=g))
        out.append(Request(id=i, prompt=tuple(torch.randint(0, vocab, (prompt_len,), generator=g).tolist()),
                           max_new_tokens=budget))
    return out


def injection(model: Any, device: torch.device, k: int, seed: int) -> Any:
    """The engine's acceptance function drawing from ``model`` (None: the model's own acceptance)."""
    from refspec.eval.injection import make_acceptance_fn

    return None if model is None else make_acceptance_fn(model, torch.Generator(device=device).manual_seed(seed), k=k)


@dataclasses.dataclass
class ShapeRun:
    """What one shape needs: the bench, its target, the drafter spec, the run's settings."""

    bench: Any
    target: Target
    spec: DrafterSpec
    batch: int
    args: Any
    ledger_path: Path

    @property
    def meter(self) -> Any:
        m = self.bench.meter
        return MappedMeter(m, self.target.mapper) if self.target.mapper is not None else m

    def engine(self, drafter: Any, accept: Any, observers: list[Any], on_step: Any = None) -> Any:
        from refspec.engine import Engine, EngineConfig
        from refspec.models.prepare import PreparedTarget

        return Engine(PreparedTarget(self.target.model, step=self.target.runner), drafter,
                      config=EngineConfig(k=self.spec.k, kv_bucket=self.args.kv_bucket), meter=self.meter,
                      observers=observers, acceptance_fn=accept, on_step=on_step)


def warm_up(sr: ShapeRun, drafter: Any, accept: Any) -> float:
    """An unrecorded serve at the longest budget: every graph of the shape is captured before a window opens."""
    from refspec.engine import Engine, EngineConfig
    from refspec.models.prepare import PreparedTarget

    t0 = time.perf_counter()
    budget = (3 * sr.args.new_tokens) // 2 if sr.bench.device.type == "cuda" else 4
    reqs = requests_of(sr.batch, sr.batch + 1, prompt_len=sr.args.prompt_len, new_tokens=2 * budget // 3 or 1,
                       vocab=sr.target.model.args.vocab_size, seed=sr.args.seed + 17)
    reqs = [dataclasses.replace(r, max_new_tokens=budget) for r in reqs]
    quiet = Engine(PreparedTarget(sr.target.model, step=sr.target.runner), drafter,
                   config=EngineConfig(k=sr.spec.k, kv_bucket=sr.args.kv_bucket), acceptance_fn=accept)
    quiet.serve(reqs, batch=sr.batch, max_len=sr.target.max_len)
    if sr.bench.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _clock_sampler(bench: Any, clocks: list[float]) -> Callable[[int, int], None] | None:
    if bench.sm_clock is None:
        return None

    def on_step(step: int, _emitted: int) -> None:
        if step % 32 == 1:
            clocks.append(bench.sm_clock())  # read passively under load, never set
    return on_step


def serve_once(sr: ShapeRun, ledger: Any, drafter: Any, accept: Any, requests: list[Any], seed: int,
               also: Sequence[Any] = ()) -> tuple[Any, float, list[float]]:
    """One served run into the open ledger run (and ``also`` observers); returns the result, its
    wall seconds and the SM clocks read under load."""
    clocks: list[float] = []
    obs = MappedObserver(ledger, sr.target.mapper) if sr.target.mapper is not None else ledger
    engine = sr.engine(drafter, accept, [obs, *also], _clock_sampler(sr.bench, clocks))
    t0 = time.perf_counter()
    res = pipeline.serve(engine, requests, batch=sr.batch, seed=seed, device=sr.bench.device,
                         max_len=sr.target.max_len)
    if sr.bench.device.type == "cuda":
        torch.cuda.synchronize()
    return res, time.perf_counter() - t0, clocks


def phase_loops(sr: ShapeRun, drafter: Any, accept: Any, res: Any, requests: list[Any]) -> dict[str, Any]:
    """Each phase alone at the run's shapes, for at least ten counter periods of the counter's clock
    (the loops time themselves on the meter's clock, modelled or not)."""
    return pipeline.phase_loops(sr.engine(drafter, accept, []), sr.meter, [res], batch=sr.batch, k=sr.spec.k,
                                prompts=[q.prompt for q in requests], min_s=LOOP_MARGIN * sr.bench.windows.loop_s,
                                seed=sr.args.seed, verify_fn=sr.target.loop_runner)


def _modelled_intensity(records: list[dict[str, Any]], run_id: str) -> float | None:
    """Mean FLOP/byte of the run's verify forwards (the roofline of their reported shapes)."""
    from refspec.energy.ledger.format import phase_work, run_models
    from refspec.energy.model.roofline import forward_cost

    models = run_models(records, run_id)
    shapes = [w for r in records if r.get("run_id") == run_id and r.get("kind") == "phase" and r["phase"] == "verify"
              for w in phase_work(r, models)]
    return statistics.mean(forward_cost(w).intensity for w in shapes) if shapes else None


def run_figures(records: Any, run_id: str, window_s: float) -> dict[str, Any]:
    """The figures of one run, all from the accounting of its ledger records."""
    acc = pipeline.account(records, [run_id], min_window_s=window_s)
    w = acc.window
    att = acc.attribution or {}
    return {
        "run_id": run_id, "window_j_per_token": acc.window_j_per_token, "run_j_per_token": acc.j_per_token,
        "run_net_j_per_token": acc.net_j_per_token, "window_s": None if w is None else w.time_s,
        "window_steps": None if w is None else w.steps, "window_counter_reads": None if w is None else w.counter_reads,
        "window_valid": acc.window_valid, "window_invalid_reason": acc.window_invalid_reason,
        "mean_active_rows": acc.mean_active_rows, "tau": acc.tau, "steps": acc.steps, "emitted": acc.emitted,
        "verified_per_row_step": acc.verified / acc.row_steps if acc.row_steps else None,
        "tpot_p50_s": acc.tpot_p50_s, "tpot_p99_s": acc.tpot_p99_s, "ttft_p50_s": acc.ttft_p50_s,
        "phase_energy_j": acc.phase_energy_j, "phase_share": acc.phase_share,
        "unattributed_j": acc.unattributed_energy_j, "total_energy_j": acc.total_energy_j,
        "phase_energy_method": acc.phase_energy_method, "phase_share_true": acc.phase_share_true,
        "loops_share": att.get("loops_share"), "fit_share": att.get("fit_share"), "agreement": att.get("agreement"),
        "additivity_residual": att.get("additivity_residual"), "rejected_share": acc.rejected_share,
        "decode_time_s": acc.decode_time_s, "sources": list(acc.sources), "measured": acc.measured,
        "verify_intensity_modelled": _modelled_intensity(records, run_id),
    }


__all__ = ["Pace", "ShapeRun", "requests_of", "warm_up", "serve_once", "phase_loops", "run_figures", "injection"]
