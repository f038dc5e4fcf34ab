"""Can the phase split fail its own checks? True, naive, roofline, old-loop and gated shares side by
side on the simulated device, at counter settings that resolve the loops and one that does not.

Run ``python3 scripts/attribution_table.py`` (defaults: SmolLM2-135M with its EAGLE head, the
conversation corpus, batches 8 and 32, three counter settings; per-request items at 16 and 64).
Each configuration runs the path of ``python -m refspec.eval run --drafter eagle --batch B
--corpus conversation --no-baseline --meter simulated:cpu:...`` (:func:`refspec.eval.run.run_configuration`:
the run, its phase-isolated loops and the loop of the whole step, all in its ledger), then:

* ``true``: the simulated device's law, integrated over each phase (what attribution should find);
* ``naive``: the counter read at each phase's bounds;
* ``roofline``: each phase priced by the roofline profile (the old simulator's truth, so the old
  loops recovered it by construction);
* ``old loops``: the loops as they ran before they ran the run's work (the draft loop without its
  catch-up, the commit loop feeding the drafter every call), priced without a gate;
* ``loops``: the loops of :mod:`refspec.phase_loops`, power x each record's time;
* ``used``: the accounting's split, or ``total only`` with the gate's reasons.

The simulator runs on this machine's wall clock (the CPU profile), so figures move from run to run
with the load; the gates and the comparison do not depend on it.
"""
from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from refspec.energy.accounting.attribution import Loop
from refspec.energy.model.hardware import HardwareProfile
from refspec.energy.ledger.read import read_ledger
from refspec.energy.accounting.phase_energy import phase_energy, shares
from refspec.energy.accounting.per_request import split_energy, split_profile
from refspec.energy.ledger.events import MeteredPhase
from refspec.energy.model.roofline import total_cost
from refspec.energy.ledger.format import phase_work, run_models
from refspec.phase_loops import LoopShapes, LoopTarget, set_up_batch, shapes_of
from refspec.sampling import SamplingConfig
from refspec.step import commit, decide, verify_forward

PHASES = ("prefill", "draft", "verify", "commit")
SETTINGS = {
    "fine": ("period_ms=1:sample_ms=1", None),
    "nvml": ("period_ms=100:sample_ms=25", None),
    "long": ("period_ms=2000:sample_ms=500", 1.5),  # loops of 1.5 s under a 2 s period
}
"""Counter settings: spec options, and the loops' seconds (None: the gate's floor)."""


def _session(args: argparse.Namespace, meter: str, loops_s: float | None) -> Any:
    from refspec.eval.session import Session

    return Session(model=args.model, dtype="bf16", device=torch.device(args.device), meter=meter, warmup=True,
                   progress=False, phase_loops_s=loops_s)


def _config(args: argparse.Namespace, batch: int, meter: str, k: int) -> Any:
    from refspec.eval.run_config import RunConfig

    return RunConfig(model=args.model, drafter="eagle", k=k, batch=batch, corpus="conversation", num_prompts=None,
                     max_new_tokens=args.max_new_tokens, dtype="bf16", device=args.device, meter=meter,
                     requests=args.requests_per_slot * batch)


def _served(args: argparse.Namespace, session: Any, batch: int, meter: str, k: int, ledger: Path) -> tuple:
    """One configuration through :func:`refspec.eval.run.run_configuration`: its result, runs and records."""
    from refspec.eval.run import prepare_configuration, run_configuration

    cfg = _config(args, batch, meter, k)
    prepare_configuration(session, cfg)
    result = run_configuration(session, cfg, ledger_path=ledger)
    records = read_ledger(ledger)
    runs = [tuple([r for r in records if r.get("run_id") == rid and r.get("kind") == kind]
                  for kind in ("phase", "counter", "loop")) for rid in result.record.stream.run_ids]
    return cfg, result, runs, records


def old_loops(t: LoopTarget, shapes: LoopShapes, meter: Any, min_s: float) -> dict[str, Loop]:
    """The draft and commit loops as they ran before: the draft loop re-proposed on a drafter whose
    features were already caught up (no catch-up forward), the commit loop handed the drafter the
    step's features every call (it fed them in its own forwards once enough piled up)."""
    no_eos = torch.tensor([-1], dtype=torch.long)
    gen = torch.Generator().manual_seed(0)
    out: dict[str, Loop] = {}
    with torch.inference_mode():
        run, draft, base = set_up_batch(t, shapes, no_eos, gen)  # unchanged: only two bodies differ
        logits, hidden = verify_forward(t.verify_fn, run, draft, base, kv_bucket=t.kv_bucket,
                                        hidden_layers=tuple(t.drafter.hidden_layers),
                                        sliding_window=getattr(t.target.args, "sliding_window", None))
        base_host = list(run.lengths_host)

        def old_commit() -> None:
            run.cache.lengths.copy_(base)
            run.lengths_host = list(base_host)
            acc, chain, kept = decide(draft, logits, hidden, base, run.cache, sampling=t.sampling, generator=gen,
                                      accept=t.accept)
            commit(run, acc, chain, kept, base, no_eos)
            t.drafter.commit(run.state)

        for name, body in (("draft", lambda: t.drafter.propose(run.state, shapes.k)), ("commit", old_commit)):
            first, calls = meter.counter.read(), 0
            while meter.counter.read().wall_s - first.wall_s < min_s:
                with MeteredPhase(meter, f"old:{name}"):
                    body()
                calls += 1
            last = meter.counter.read()
            out[name] = Loop(energy_j=last.energy_j - first.energy_j, time_s=last.wall_s - first.wall_s,
                             iterations=calls)
        meter.abandon_run()
    return out


def roofline_shares(phases: Sequence[Mapping[str, Any]], models: Mapping[int, Any],
                    profile: HardwareProfile) -> dict[str, float]:
    """Each phase's share when its records are priced by the roofline profile (work and time)."""
    energy: dict[str, float] = {}
    for r in phases:
        e = profile.energy_j(total_cost(phase_work(r, models)), float(r["time_s"]))
        energy[r["phase"]] = energy.get(r["phase"], 0.0) + e
    return shares(energy)


def one(args: argparse.Namespace, batch: int, setting: str, out_dir: Path) -> dict[str, Any]:
    """One configuration at one counter setting: its shares, gate and interaction figure."""
    spec, loops_s = SETTINGS[setting]
    meter = f"simulated:cpu:{spec}:seed={args.seed}"
    session = _session(args, meter, loops_s)
    ledger = out_dir / f"b{batch}-{setting}.jsonl"
    cfg, result, runs, records = _served(args, session, batch, meter, args.k, ledger)
    idle = session.meter.idle_w
    new = phase_energy(runs, host_w=idle)
    shapes = shapes_of([e for g in result.generations for e in g.events], batch=batch, k=cfg.k,
                       prompts=[q.prompt for q in session.stream(cfg).requests])
    target = LoopTarget(target=session.target.model, drafter=session.drafter(cfg),
                        verify_fn=session.target.prepared,
                        sampling=SamplingConfig())
    old = old_loops(target, shapes, session.meter, loops_s or max(10 * session.meter.period_s, 1.0))
    old_records = [{"kind": "loop", "phase": p, "energy_j": lp.energy_j, "time_s": lp.time_s,
                    "iterations": lp.iterations, "source": "old"} for p, lp in old.items()]
    kept = [r for r in runs[-1][2] if r["phase"] in ("verify", "prefill")]  # the loops the change left alone
    old_pe = phase_energy([*runs[:-1], (runs[-1][0], runs[-1][1], kept + old_records)], host_w=idle)
    phases = [r for run in runs for r in run[0]]
    run_ids = list(result.record.stream.run_ids)
    return {"batch": batch, "setting": setting, "meter": meter, "true": new.share_true, "naive": new.share_naive,
            "roofline": roofline_shares(phases, run_models(records, run_ids[0]), session.meter.profile),
            "old loops": old_pe.share_loops, "loops": new.share_loops,
            "used": shares({p: sum(r["energy_j"] for run in new.records for r in run if r["phase"] == p)
                            for p in PHASES}) if new.method == "attributed-loops" else None,
            "method": new.method, "gate": new.split_gate, "interaction": new.interaction_residual,
            "interaction_points": new.interaction_points,
            "additivity": new.additivity_residual, "ledger": ledger, "run_ids": run_ids}


def table(row: Mapping[str, Any]) -> str:
    """One configuration's shares side by side (a column per estimate), its gate and residuals."""
    cols = ("true", "naive", "roofline", "old loops", "loops", "used")
    lines = [f"eagle b{row['batch']}, {row['setting']} ({row['meter']}): method {row['method']}",
             f"{'phase':<9}" + "".join(f"{c:>11}" for c in cols)]
    for p in PHASES:
        cells = [row[c].get(p) if row[c] else None for c in cols]
        lines.append(f"{p:<9}" + "".join(f"{'-' if x is None else format(100 * x, '.1f') + '%':>11}" for x in cells))
    gate = row["gate"]
    verdict = "n/a" if gate is None else "passed" if gate.passed else "FAILED: " + "; ".join(gate.reasons)
    fmt = lambda x: "n/a" if x is None else f"{x:+.1%}"  # noqa: E731
    lines.append(f"split gate {verdict}; additivity residual {fmt(row['additivity'])}; "
                 f"interaction residual {fmt(row['interaction'])} (up to "
                 f"{'n/a' if row['interaction_points'] is None else format(row['interaction_points'], '.1f')} points)")
    return "\n".join(lines)


def items(args: argparse.Namespace, batch: int, out_dir: Path) -> str:
    """Per-request named items of eagle at ``batch``: modelled per phase (the H200 roofline, exact
    closure) and under the NVML-like simulated counter (attributed, when its split passes its gate)."""
    lines = []
    for meter in ("roofline:h200", f"simulated:cpu:{SETTINGS['nvml'][0]}:seed={args.seed}"):
        session = _session(args, meter, None)
        cfg, result, runs, records = _served(args, session, batch, meter, args.k,
                                             out_dir / f"items-b{batch}-{meter.split(':')[0]}.jsonl")
        run_ids = list(result.record.stream.run_ids)
        split = split_energy(records, run_ids, split_profile(None, [session.meter.source]))
        assert split is not None
        if split.split_gate_reasons:
            lines.append(f"eagle b{batch}, {meter}: no per-request split, {split.method}: "
                         f"{'; '.join(split.split_gate_reasons)}")
            continue
        parts = ", ".join(f"{name} {100 * x:.1f}%" for name, x in split.shares.items())
        lines.append(f"eagle b{batch}, {meter}, {split.method}: {parts} of {split.total_j:.4g} J; residual "
                     f"{split.closure_error_j:+.4g} J -> {'closes' if split.closes else 'DOES NOT CLOSE'} "
                     f"(tolerance {split.tolerance:g})")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--batches", default="8,32")
    p.add_argument("--item-batches", default="16,64")
    p.add_argument("--settings", default="fine,nvml,long")
    p.add_argument("--requests-per-slot", type=int, default=4)
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="keep the ledgers here (default: a temporary folder)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        for b in (int(x) for x in args.batches.split(",") if x):
            for s in (x for x in args.settings.split(",") if x):
                print(table(one(args, b, s, out)) + "\n", flush=True)
        for b in (int(x) for x in args.item_batches.split(",") if x):
            print(items(args, b, out), flush=True)


if __name__ == "__main__":
    main()
