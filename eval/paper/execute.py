"""The paper command after its checks: bench, grid, outputs, closing summary.

One pass over the grid: on a GPU with its measured counter; on a CPU with a simulated counter
of the first ``--profile`` (the GPU's path rehearsed), each further profile priced directly from
the same runs' real-shape work (:class:`~refspec.eval.paper.targets.ProfileTee`). The first
profile's claims lead.
"""
from __future__ import annotations

import dataclasses
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from refspec.eval.paper.bench import EXIT_MODELLED_ONLY, ModelledEnergyOnly, build_bench
from refspec.eval.paper.grid import FIXED_GPU_S, format_plan, plan_block
from refspec.eval.paper.report import Outputs, energy_label
from refspec.eval.paper.run import Budget, Grid

log = logging.getLogger("refspec.eval.paper")


def _profiles(args: Any) -> list[str]:
    if args.device == "cuda":
        return ["gpu"]
    names = [p.strip().lower() for p in args.profile.split(",") if p.strip()]
    from refspec.energy.model.hardware import GPU_PROFILES

    bad = [p for p in names if p not in GPU_PROFILES]
    if bad or not names:
        from refspec.eval.flags import UsageError

        raise UsageError(f"--profile: unknown {bad or names}; choose from {sorted(GPU_PROFILES)}")
    return names


def _context(bench: Any) -> dict[str, Any]:
    return {"profile": bench.profile, "source": bench.source, "measured": bench.measured,
            "clocks_read_only": bench.device.type == "cuda", "simulated": bench.device.type == "cpu"}


def run_all(args: Any, blocks: list[Any], sources: dict[str, Any], taus: dict, plans: list[dict[str, Any]],
            header: dict[str, Any], t_start: float) -> int:
    """The pass over the grid; writes everything under ``args.out``; the exit status."""
    from refspec.energy.model.hardware import get_profile

    profiles = _profiles(args)
    args.profile, args.profile_label = profiles[0], profiles[0] if args.device == "cpu" else "gpu"
    try:
        bench = build_bench(args)
    except ModelledEnergyOnly as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_MODELLED_ONLY
    tees = {name: get_profile(name) for name in profiles[1:]}
    header.update(energy=bench.note, energy_label=energy_label([bench.source]), plan=plans,
                  plan_text=format_plan(plans, FIXED_GPU_S), counter_period_s=bench.windows.period_s,
                  counter_period=bench.period_note, windows=dataclasses.asdict(bench.windows), idle_w=bench.idle_w,
                  ceilings=bench.ceilings, dvfs_module_loaded=False,
                  acceptance={k: {"spec": s.spec, "origin": s.origin} for k, s in sources.items()},
                  profiles={args.profile_label: bench.note,
                            **{n: f"MODELLED: roofline({p.name}) of the same runs' real-shape work, modelled clock"
                               for n, p in tees.items()}})
    contexts = {args.profile_label: _context(bench)}
    contexts.update({n: {"profile": p, "source": f"modelled:roofline({p.name})", "measured": False,
                         "clocks_read_only": False, "simulated": False} for n, p in tees.items()})
    outputs = Outputs(args.out, header, contexts)
    log.info("%s; counter period %.3g s (%s); %s", bench.note, bench.windows.period_s, bench.period_note,
             bench.windows)
    own = plans
    if args.device == "cuda":  # the plan again with this GPU's ceilings and measured counter period
        own = [plan_block(b, bench.profile, taus, windows=bench.windows, repeats=args.repeats,
                          prompt_len=args.prompt_len, new_tokens=args.new_tokens, host=True) for b in blocks]
        log.info("plan with this GPU's ceilings and counter:\n%s", format_plan(own, FIXED_GPU_S))
        outputs.data["plan_measured"] = own
    work = Path(args.ledgers) if args.ledgers else Path(tempfile.mkdtemp(prefix="refspec-paper-"))
    work.mkdir(parents=True, exist_ok=True)
    outputs.data["ledgers"] = str(work) if args.ledgers else "deleted at exit (--ledgers DIR keeps them)"
    grid = Grid(args, bench, outputs, Budget(args.budget_s, t_start), sources, tees, work)
    try:
        for block, plan in zip(blocks, own):
            grid.run_block(block, plan)
    finally:
        getattr(bench.meter, "close", lambda: None)()
        if not args.ledgers:
            shutil.rmtree(work, ignore_errors=True)
    return _finish(args, outputs, t_start)


def _finish(args: Any, outputs: Outputs, t_start: float) -> int:
    from refspec.eval.paper.plots import make_plots

    d = outputs.data
    first = next(iter(outputs.contexts))
    variants = [v for v in d["variants"] if v["profile"] == first]
    d["energy_label"] = energy_label([v["energy_source"] for v in variants if "energy_source" in v]
                                     or [outputs.contexts[first]["source"]])
    d["plots"] = make_plots(variants, args.out, f"{d['hardware']} ({first}): energy {d['energy_label']}; "
                                                f"acceptance INJECTED")
    d.update(seconds=time.perf_counter() - t_start, complete=True, dvfs_module_loaded="refspec.energy.meters.dvfs"
             in sys.modules)
    outputs.save()
    d["out_problems"] = outputs.problems()
    outputs.save()
    _print_summary(outputs)
    return 1 if any("error" in v for v in d["variants"]) else 0


def _print_summary(outputs: Outputs) -> None:
    d = outputs.data
    print(f"\n== refspec paper on {d['hardware']}: energy {d['energy_label']}, acceptance INJECTED")
    for c in d["claims"]:
        others = "".join(f"; {o['profile']}: {o['verdict']}" for o in c["other_profiles"])
        print(f"claim {c['claim']}: {c['verdict']} ({c['profile']}{others}) - {c['title']}")
    if d["skipped"]:
        print(f"skipped {len(d['skipped'])} shapes: " + "; ".join(f"{s['block']} b{s['batch']} {s['drafter']}: "
                                                                  f"{s['why']}" for s in d["skipped"][:4]))
    for p in d.get("out_problems", []):
        print(f"WARNING: {p}")
    print(f"wrote {outputs.out}/claims.md, claims.json, results.json and {len(d['plots'])} plots in "
          f"{d['seconds']:.0f} s")


__all__ = ["run_all"]
