"""Running the grid: block by block, shape by shape, variant by variant, within ``--budget-s``.

Every variant's record is appended to the results as soon as its repeats are accounted, and
the results and the claims are rewritten then (:class:`~refspec.eval.paper.report.Outputs`), so
a run cut at any moment keeps its tables. No shape starts that the plan, scaled by how the run's
shapes compared with theirs so far, says would overrun the budget (the closing plots and tables
keep :data:`CLOSING_S`).
"""
from __future__ import annotations

import logging
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from refspec.config import round_up
from refspec.eval import pipeline
from refspec.eval.interrupts import reraise_interrupt
from refspec.eval.paper import acceptance
from refspec.eval.paper.grid import Block, DrafterSpec, plan_stream, step_seconds
from refspec.eval.paper.point import (Pace, ShapeRun, injection, phase_loops, requests_of, run_figures, serve_once,
                                      warm_up)
from refspec.eval.paper.targets import build_drafter, load_target

log = logging.getLogger("refspec.eval.paper")
CLOSING_S = 10.0
SUMMARY = ("window_j_per_token", "run_j_per_token", "run_net_j_per_token", "tau", "tpot_p50_s", "tpot_p99_s",
           "ttft_p50_s", "window_s", "rejected_share", "verify_intensity_modelled", "share_draft",
           "share_verify", "share_commit", "share_prefill", "share_unattributed", "verified_per_row_step",
           "agreement", "additivity_residual")


class Budget:
    """Seconds left, and planned seconds scaled by how the run's shapes compared with their plan."""

    def __init__(self, budget_s: float, t_start: float) -> None:
        self.budget_s, self.t_start = budget_s, t_start
        self.planned = self.actual = 0.0

    @property
    def spent(self) -> float:
        return time.perf_counter() - self.t_start

    def scale(self) -> float:
        return self.actual / self.planned if self.planned > 0 else 1.0

    def allows(self, planned_s: float) -> bool:
        return self.spent + planned_s * self.scale() + CLOSING_S <= self.budget_s

    def add(self, planned_s: float, actual_s: float) -> None:
        self.planned += planned_s
        self.actual += actual_s


def _shares(f: dict[str, Any]) -> dict[str, float]:
    """Each phase's share of the run's whole energy (the unattributed part included)."""
    energy, total = f.get("phase_energy_j") or {}, f.get("total_energy_j")
    if not total:
        return {}
    out = {f"share_{p}": energy.get(p, 0.0) / total for p in ("draft", "verify", "commit", "prefill")}
    out["share_unattributed"] = (f.get("unattributed_j") or 0.0) / total
    return out


def summarise(runs: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per figure of :data:`SUMMARY`: mean over the repeats, spread (half their range), n."""
    out: dict[str, dict[str, float | None]] = {}
    for name in SUMMARY:
        xs = [r[name] for r in runs if isinstance(r.get(name), (int, float))]
        out[name] = ({"mean": statistics.mean(xs), "spread": (max(xs) - min(xs)) / 2, "n": len(xs)} if xs
                     else {"mean": None, "spread": None, "n": 0})
    return out


class Grid:
    """The run's grid over one bench: targets, streams, ledgers and the outputs they feed."""

    def __init__(self, args: Any, bench: Any, outputs: Any, budget: Budget, sources: dict[str, Any],
                 tees: dict[str, Any] | None = None, work: Path | None = None) -> None:
        self.args, self.bench, self.outputs, self.budget, self.sources = args, bench, outputs, budget, sources
        self.tees = tees or {}  # CPU: label -> a further profile, priced directly from the same runs
        self.pace = Pace()
        self.work = work or Path(tempfile.mkdtemp(prefix="refspec-paper-"))  # the runs' ledgers

    def run_block(self, block: Block, plan: dict[str, Any]) -> None:
        """Every shape of ``block`` the budget allows."""
        ks = [d.k for d in block.drafters] or [0]
        longest = self.args.prompt_len + (3 * self.args.new_tokens) // 2 + max(ks) + 2
        max_len = round_up(longest, self.args.kv_bucket)
        try:
            target = load_target(block.arch, device=self.bench.device, dtype=self.bench.dtype, seed=self.args.seed,
                                 max_batch=max(block.batches), max_k=max(ks), max_len=max_len)
        except Exception as exc:  # one block failing must not lose the others
            reraise_interrupt(exc)  # a Ctrl-C wrapped by an import on its way up
            log.exception("building %s failed", block.arch)
            self.outputs.skip(block.name, None, None, f"target build failed: {type(exc).__name__}: {exc}")
            return
        for (batch, spec), sp in zip(block.shapes(), plan["shapes"]):
            if not self.budget.allows(sp["planned_s"]):
                self.outputs.skip(block.name, batch, spec.label, f"budget {self.budget.budget_s:.0f} s: "
                                  f"{self.budget.spent:.0f} s spent, planned {sp['planned_s']:.0f} s x "
                                  f"{self.budget.scale():.2f}")
                continue
            t0 = time.perf_counter()
            self.run_shape(block, target, batch, spec)
            self.budget.add(sp["planned_s"], time.perf_counter() - t0)
            if self.bench.device.type == "cuda":
                torch.cuda.empty_cache()

    def run_shape(self, block: Block, target: Any, batch: int, spec: DrafterSpec) -> None:
        """Warm-up, then each variant's repeats, the phase loops after the first run."""
        label = f"[{self.args.profile_label}] {block.name} {block.arch} batch {batch}, {spec.label}"
        path = self.work / f"{block.name}-b{batch}-{spec.name}{spec.k}-{self.args.profile_label}.jsonl"
        sr = ShapeRun(bench=self.bench, target=target, spec=spec, batch=batch, args=self.args, ledger_path=path)
        try:
            drafter = build_drafter(spec, target, self.args.kv_bucket)
            variants = [(s, c, acceptance.resolve(self.sources[s], spec.name, c, spec.k) if spec.k else None)
                        for s, c in block.variants(batch, spec)]
            warm_s = warm_up(sr, drafter, injection(variants[0][2], self.bench.device, spec.k, 1))
            log.info("%s: warm-up %.1f s", label, warm_s)
        except Exception as exc:
            reraise_interrupt(exc)  # a Ctrl-C wrapped by an import on its way up
            log.exception("%s failed", label)
            self.outputs.skip(block.name, batch, spec.label, f"{type(exc).__name__}: {exc}")
            return
        state: dict[str, Any] = {"ledger": None, "loops": None, "tees": {}}
        try:
            for source, corpus, model in variants:
                for rec in self.variant(sr, block, drafter, source, corpus, model, state, label):
                    self.outputs.add(rec)
        finally:
            for led in [state["ledger"], *state["tees"].values()]:
                if led is not None:
                    led.close()

    def variant(self, sr: ShapeRun, block: Block, drafter: Any, source: str, corpus: str, model: Any,
                state: dict[str, Any], label: str) -> list[dict[str, Any]]:
        """One variant's repeats, accounted (a record per profile); a failure is recorded in its record."""
        spec, a = sr.spec, self.args
        rec: dict[str, Any] = {"profile": a.profile_label, "block": block.name, "arch": block.arch, "batch": sr.batch,
                               "drafter": spec.label, "kind": spec.name, "k": spec.k, "source": source,
                               "corpus": corpus, "origin": None if model is None else self.sources[source].origin,
                               "tau_model": None if model is None else model.mean_tau,
                               "injection": None if model is None else _label(model)}
        t0 = time.perf_counter()
        try:
            figures, others = self._repeats(sr, drafter, source, corpus, model, state, label)
        except Exception as exc:
            reraise_interrupt(exc)  # a Ctrl-C wrapped by an import on its way up
            log.exception("%s, %s %s failed", label, source, corpus)
            rec.update(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-2000:],
                       seconds=time.perf_counter() - t0)
            return [rec]
        out = [{**rec, **figures, "seconds": time.perf_counter() - t0}]
        return out + [{**rec, **f, "profile": name, "seconds": 0.0} for name, f in others.items()]

    def _tee_ledgers(self, sr: ShapeRun, state: dict[str, Any], run_id: str, labels: dict[str, Any]) -> list[Any]:
        """The other profiles' observers of this run, each into its own ledger run."""
        from refspec.energy.ledger.writer import Ledger
        from refspec.eval.paper.targets import ProfileTee

        out = []
        for name, profile in self.tees.items():
            led = state["tees"].get(name)
            if led is None:
                led = state["tees"][name] = Ledger(sr.ledger_path.with_suffix(f".{name}.jsonl"), run_id=run_id,
                                                   labels=labels, meter_source=f"modelled:roofline({profile.name})",
                                                   idle_w=profile.idle_w)
            else:
                led.begin_run(run_id, labels=labels)
            out.append(ProfileTee(led, sr.target.mapper, profile))
        return out

    def _repeats(self, sr: ShapeRun, drafter: Any, source: str, corpus: str, model: Any, state: dict[str, Any],
                 label: str) -> dict[str, Any]:
        a, spec, bench = self.args, sr.spec, self.bench
        tau = model.mean_tau if model is not None else 1.0
        planned = step_seconds(sr.target.arch, bench.profile, spec, sr.batch, tau, a.prompt_len + a.new_tokens // 2,
                               host=bench.device.type == "cuda")
        sp = plan_stream(batch=sr.batch, tau=tau, step_s=self.pace.step_s(sr.target.arch, spec.name, planned),
                         prefill_s=0.0, window_s=bench.windows.window_s, new_tokens=a.new_tokens)
        requests = requests_of(sr.batch, sp.requests, prompt_len=a.prompt_len, new_tokens=a.new_tokens,
                               vocab=sr.target.model.args.vocab_size, seed=a.seed)
        run_ids, clocks = [], []
        for rep in range(a.repeats):
            run_id = f"{label.split('] ')[-1].replace(' ', '_').replace(',', '')}-{source}-{corpus}-r{rep}"
            labels = {"variant": run_id, "acceptance_injected": model is not None}
            if state["ledger"] is None:
                state["ledger"] = pipeline.open_ledger(bench.meter, sr.ledger_path, run_id, labels, mode="w",
                                                       source=bench.source, idle_w=bench.idle_w)
            else:
                state["ledger"].begin_run(run_id, labels=labels)
            ledger = state["ledger"]
            accept = injection(model, bench.device, spec.k, a.seed + 7919 + rep)
            tees = self._tee_ledgers(sr, state, run_id, labels)
            res, wall, cl = serve_once(sr, ledger, drafter, accept, requests, a.seed + rep, also=tees)
            ledger.end_run()
            for tee in tees:
                tee.ledger.end_run()
            clock = sum(e.measurement.time_s for e in res.events)  # the engine's clock: no host gaps
            cpu = bench.device.type == "cpu"  # a modelled clock there; a counter's window is wall time on a GPU
            self.pace.learn(sr.target.arch, spec.name, planned, (clock if cpu else wall) / max(res.steps, 1))
            if state["loops"] is None and hasattr(bench.meter, "counter") and a.loops:
                state["loops"] = phase_loops(sr, drafter, accept, res, requests)
            pipeline.write_loops(ledger, state["loops"] or {}, bench.source)
            run_ids.append(run_id)
            clocks += cl
            log.info("%s, %s %s, repeat %d: %d requests, %d steps in %.1f s", label, source, corpus, rep,
                     len(requests), res.steps, wall)
        figures = self._figures(pipeline.read_back(sr.ledger_path), run_ids, label, source, corpus, bench.source)
        others = {name: self._figures(pipeline.read_back(led.path), run_ids, f"{label} ({name})", source, corpus,
                                      f"modelled:roofline({self.tees[name].name})")
                  for name, led in state["tees"].items()}
        figures.update(requests=len(requests), planned_step_s=planned,
                       sm_clock_mhz={"min": min(clocks), "median": statistics.median(clocks), "max": max(clocks),
                                     "reads": len(clocks)} if clocks else None,
                       loops={p: {"j_per_call": lp.j_per_step, "iterations": lp.iterations, "time_s": lp.time_s}
                              for p, lp in (state["loops"] or {}).items()})
        return figures, others

    def _figures(self, records: list[dict[str, Any]], run_ids: list[str], label: str, source: str, corpus: str,
                 fallback_source: str) -> dict[str, Any]:
        """The accounted figures of a variant's runs and their summary over the repeats."""
        runs = [run_figures(records, r, self.bench.windows.window_s) for r in run_ids]
        for f in runs:
            f.update(_shares(f))
        summary = summarise(runs)
        log.info("%s, %s %s: window J/token %s, tau %s, window %s s%s", label, source, corpus,
                 _pm(summary["window_j_per_token"]),
                 _pm(summary["tau"]), _pm(summary["window_s"]),
                 "" if all(f["window_valid"] for f in runs) else " (window INVALID: "
                 f"{'; '.join(sorted({str(f['window_invalid_reason']) for f in runs if not f['window_valid']}))})")
        return {"runs": runs, "summary": summary, "window_valid": all(f["window_valid"] for f in runs),
                "invalid_reasons": sorted({str(f["window_invalid_reason"]) for f in runs if not f["window_valid"]}),
                "energy_source": runs[0]["sources"][0] if runs[0]["sources"] else fallback_source,
                "measured": all(f["measured"] for f in runs), "phase_method": runs[0]["phase_energy_method"]}


def _label(model: Any) -> str:
    from refspec.eval.injection import injection_label

    return injection_label(model)


def _pm(s: dict[str, Any]) -> str:
    return "n/a" if s["mean"] is None else f"{s['mean']:.4g} ± {s['spread']:.2g}"


__all__ = ["Grid", "Budget", "summarise", "SUMMARY", "CLOSING_S"]
