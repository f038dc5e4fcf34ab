"""Running the grid: block by block, point by point, each in its own try/except, the results file
rewritten after every point, no point started that the plan says would overrun ``--budget-s``."""
from __future__ import annotations

import argparse
import logging
import time
import traceback
from typing import Any

import torch

from gpucheck.bench import Bench, load_target
from gpucheck.grid import Block, DrafterSpec
from gpucheck.phase_loops import isolated_loops, split
from gpucheck.results import Results

log = logging.getLogger("gpu_check")


class Budget:
    """Seconds left, and the plan's seconds scaled by how the run's points compared with theirs."""

    def __init__(self, budget_s: float, t_start: float) -> None:
        self.budget_s, self.t_start = budget_s, t_start
        self.planned = self.actual = 0.0

    @property
    def spent(self) -> float:
        return time.perf_counter() - self.t_start

    def scale(self) -> float:
        return self.actual / self.planned if self.planned > 0 else 1.0

    def allows(self, planned_s: float) -> bool:
        return self.spent + planned_s * self.scale() <= self.budget_s

    def add(self, planned_s: float, actual_s: float) -> None:
        self.planned += planned_s
        self.actual += actual_s


def _error(exc: BaseException) -> dict[str, Any]:
    return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}


def _phase_energy(bench: Bench, args: argparse.Namespace, p: dict[str, Any], spec: DrafterSpec,
                  recorder: Any) -> dict[str, Any]:
    """Phase-isolated loops of one point and their split; an error is recorded, not raised."""
    try:
        loops = isolated_loops(bench, args, p["batch"], spec, recorder, args.phase_loop_s)
        out = {"split": split(loops, p["run_window"]), "loops": loops}
        s = out["split"]
        log.info("  phases (%s): loops %s, fit %s, additivity residual %+.1f%%", s["energy_source"],
                 {q: round(x, 3) for q, x in s["loops_share"].items()},
                 {q: round(x, 3) for q, x in s["fit_share"].items()}, 100 * s["additivity_residual"])
        return out
    except Exception as exc:
        log.exception("phase loops of batch %d, %s failed", p["batch"], spec.label)
        return _error(exc)


def _eager(bench: Bench, args: argparse.Namespace, p: dict[str, Any], spec: DrafterSpec) -> dict[str, Any]:
    """The same point without graph capture: step time and J/token, and the graphs' gain."""
    from gpucheck.point import run_point

    keys = ("runner_mode", "step_time_s", "j_per_token", "j_per_token_net", "tpot_s", "energy_source", "tau_observed")
    corpus = p["corpus"] or "conversation"
    try:
        graphs = p
        if p.get("schedule") != "static":  # compare like with like: both static, the graph runner's and eager
            static = argparse.Namespace(**{**vars(args), "schedule": "static"})
            graphs = run_point(bench, static, p["batch"], spec, corpus)
            graphs.pop("_recorder")
        e = run_point(bench, args, p["batch"], spec, corpus, eager=True)
    except Exception as exc:
        log.exception("eager run of batch %d, %s failed", p["batch"], spec.label)
        return {"error": f"{type(exc).__name__}: {exc}"}
    out = {key: e[key] for key in keys}
    out["schedule"] = "static"
    out["graphs_static"] = {key: graphs[key] for key in keys}
    out["graph_speedup"] = e["step_time_s"]["mean"] / graphs["step_time_s"]["mean"]
    out["graph_energy_ratio"] = (graphs["j_per_token"] / e["j_per_token"]) if e["j_per_token"] else None
    log.info("  %s: step %.3f ms, %s J/token; %s is %.2fx as fast", e["runner_mode"], e["step_time_s"]["mean"] * 1e3,
             e["j_per_token"], graphs["runner_mode"], out["graph_speedup"])
    return out


def _measure(bench: Bench, args: argparse.Namespace, block: Block, batch: int, spec: DrafterSpec,
             corpus: str) -> dict[str, Any]:
    """One point with its phase loops; a failure is recorded in the point."""
    from gpucheck.point import run_point

    try:
        p = run_point(bench, args, batch, spec, corpus)
        log.info("  step %.3f ms (roofline %.3f ms), %s J/token (%s), tau %.2f", p["step_time_s"]["mean"] * 1e3,
                 p["predicted_step_time_s"] * 1e3, p["j_per_token"], p["energy_source"], p["tau_observed"])
    except Exception as exc:  # one failing point must not lose the others
        log.exception("batch %d, %s, %s failed", batch, spec.label, corpus)
        return {"arch": block.arch, "batch": batch, "k": spec.k, "drafter": spec.name, "drafter_label": spec.label,
                "corpus": corpus if spec.k else None, **_error(exc)}
    recorder = p.pop("_recorder")
    if block.phase_loops and args.phase_loop_s > 0:
        p["phase_energy"] = _phase_energy(bench, args, p, spec, recorder)
    return p


def _find(points: list[dict[str, Any]], arch: str, batch: int, spec: DrafterSpec, corpus: str) -> dict | None:
    return next((p for p in points if "error" not in p and (p["arch"], p["batch"], p["drafter_label"]) ==
                 (arch, batch, spec.label) and (p["corpus"] in (corpus, None))), None)


def run_block(bench: Bench, args: argparse.Namespace, block: Block, plan: dict[str, Any], results: Results,
              budget: Budget, sizes: dict[str, int]) -> None:
    """Every point of ``block``; an eager block adds an eager run to the matching graph point.

    ``sizes``: :func:`gpucheck.bench.load_target`'s ``max_batch``, ``max_k`` and ``eager_batch``
    over every block of this architecture (the target is built once for all of them).
    """
    d = results.data
    points, skipped = d.setdefault("points", []), d.setdefault("skipped_points", [])
    try:
        load_target(bench, args, block.arch, **sizes)
    except Exception as exc:
        log.exception("building %s failed", block.arch)
        d.setdefault("blocks", {})[block.name] = {"error": _error(exc)["error"]}
        return
    t_block = time.perf_counter()
    for (batch, spec, corpus), planned in zip(block.points(), (q["planned_s"] for q in plan["points"])):
        where = {"block": block.name, "arch": block.arch, "batch": batch, "drafter": spec.label, "corpus": corpus}
        if not budget.allows(planned):
            skipped.append({**where, "why": f"budget {budget.budget_s:.0f} s: {budget.spent:.0f} s spent, planned "
                                            f"{planned:.1f} s x {budget.scale():.2f}"})
            continue
        log.info("[%s] %s batch %d, %s, %s", block.name, block.arch, batch, spec.label, corpus)
        t0 = time.perf_counter()
        p = _find(points, block.arch, batch, spec, corpus) if block.eager else None
        if p is None:
            p = _measure(bench, args, block, batch, spec, corpus)
            p["block"] = block.name
            points.append(p)
        if block.eager and "error" not in p:
            p["eager"] = _eager(bench, args, p, spec)
        if block.eager and "eager" in p:
            p["eager"].update(seconds=time.perf_counter() - t0, planned_s=planned)
        else:
            p.update(seconds=time.perf_counter() - t0, planned_s=planned)
        budget.add(planned, time.perf_counter() - t0)
        if bench.device.type == "cuda":
            torch.cuda.empty_cache()
        results.save()
    d.setdefault("blocks", {})[block.name] = {"seconds": time.perf_counter() - t_block, "planned_s": plan["planned_s"]}
    results.save()
