#!/usr/bin/env python
"""GPU check: measured ceilings, then the paper's grid on random-weight targets with injected acceptance, then graph tests.

Run it through ``scripts/gpu_check.sh``, which installs the project offline first. On a machine
with one NVIDIA GPU and no network, within ``--budget-s`` (default 400 s, tests included):

1. **ceilings**: a 2 GiB device-to-device copy and an 8192^3 GEMM in the run's dtype on random
   data (``gpucheck.ceilings``); the run's roofline uses them, the data sheet's stay beside.
2. **meter**: measured energy from Zeus, else NVML's total-energy counter through pynvml, else
   NVML power samples integrated; where none can be read, energy is MODELLED by the roofline
   and labelled so (``--require-measured-energy`` then exits 3 instead). Clocks are only read.
3. **plan**: the seconds of every block from the roofline (``gpucheck.grid``), printed first.
4. **grid**, block by block in order of importance (``gpucheck.grid.GPU_BLOCKS``): random-weight
   targets (Llama-3.1-8B, then Qwen3-8B, then a Qwen3-30B-A3B MoE where that target exists) at
   serving batches x drafters (none; an EAGLE-shaped chain head at k 3 and 7; a block head at
   block 8 and 16) x corpora (conversation, code), CUDA graphs for the target. **Acceptance is
   injected** per (drafter, corpus) from distributions recorded on the small real models
   (``gpucheck.drafting``), so tokens are meaningless and every output says so. Each point: a
   warm-up that captures its graphs (once per batch and drafter), the measured run, and the
   phase-isolated loops of its shapes (``gpucheck.phase_loops``); in its own try/except. The
   graphs-vs-eager block reruns some points without capture.
5. **tests**: ``pytest -m gpu tests/test_cuda_graphs.py`` in the time left, after the required
   blocks and before the optional MoE block.
6. **outputs** under ``--out`` (default ``$OUT``): ``gpu_check.json`` rewritten atomically after
   every point (with a table per claim of the paper and the crossover, ``gpucheck.claims``), at
   most four ``*.png`` plots; the shell wrapper adds ``gpu_check.log``. A summary is printed.

``--dry-run`` runs the same code on a CPU, except CUDA: toy models of the same families
(hidden 256, 2 layers, vocab 2048), fp32, short prompts, eager-static runners instead of graphs
(same bucketing and padding), small ceilings, energy modelled by the roofline meter with this
CPU's profile (labelled so); its plan is the GPU grid's on an H200.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import gc
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from gpucheck.bench import Bench, ModelledEnergyOnly, build_bench
from gpucheck.claims import claim_tables
from gpucheck.drafting import BLOCK_SIZE, acceptance_model, recorded_taus
from gpucheck.gpu_tests import run_gpu_tests, tests_failed
from gpucheck.grid import CORPORA, GPU_BLOCKS, Block, format_plan, plan_block, select_blocks
from gpucheck.outputs import eager_table, energy_label, make_plots, phase_table, summary_table
from gpucheck.results import Results, out_problems
from gpucheck.runner import Budget, run_block

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("gpu_check")
EXIT_MODELLED_ONLY = 3
FIXED_PLAN_S = {"install (sh)": 30.0, "start, idle, ceilings": 15.0, "target builds": 10.0, "gpu tests": 60.0}
"""Planned seconds outside the grid; the tests run after the required blocks, before the optional ones."""


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="rehearse on a CPU: toy model, no CUDA, modelled energy")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_check_out")),
                   help="output folder (default: $OUT)")
    p.add_argument("--blocks", default=None,
                   help="comma-separated blocks of the grid to run (default: all; gpucheck.grid lists them)")
    p.add_argument("--batches", type=_ints, default=None, help="replace every block's batches")
    p.add_argument("--drafters", default=None, help="replace every block's drafters, e.g. none:0,eagle:3,block:8")
    p.add_argument("--corpora", default=None, help="replace every block's corpora, e.g. conversation,code")
    p.add_argument("--accept-file", type=Path, default=None,
                   help="refspec.acceptance JSON with a model per (drafter, corpus) to inject (default: "
                        "scripts/gpucheck/acceptance_smollm2.json, recorded on SmolLM2-135M)")
    p.add_argument("--schedule", choices=["continuous", "static"], default="continuous",
                   help="continuous: each point serves a closed-loop stream on B slots (Engine.serve) and reads its "
                        "steady-state window; static: one lockstep batch (also where serve is unavailable)")
    p.add_argument("--prompt-len", type=int, default=None, help="tokens per prompt (default 512; dry run 64)")
    p.add_argument("--new-tokens", type=int, default=None, help="budget per row (default 256; dry run 32)")
    p.add_argument("--kv-bucket", type=int, default=None, help="engine kv_bucket (default 128; dry run 32)")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="seconds of the whole check (tests included): no point starts once its planned seconds "
                        "(scaled by how the run's points compared with their plan so far) would overrun it")
    p.add_argument("--require-measured-energy", action="store_true",
                   help=f"exit {EXIT_MODELLED_ONLY} before the benchmark when no energy counter can be read "
                        "(only the roofline model is available)")
    p.add_argument("--phase-loop-s", type=float, default=None,
                   help="seconds each phase-isolated loop (prefill, draft, verify) runs at every point for the "
                        "measured per-phase split (default 2; dry run 0.04; 0 skips them)")
    p.add_argument("--tests-timeout-s", type=float, default=150.0)
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"],
                   help="weight dtype (default bf16; dry run fp32: bf16 matmuls are ~10x slower on CPUs without "
                        "AVX512-BF16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (dry run default 1)")
    args = p.parse_args(argv)
    dry = args.dry_run
    args.prompt_len = args.prompt_len if args.prompt_len is not None else 32 if dry else 512
    args.new_tokens = args.new_tokens if args.new_tokens is not None else 24 if dry else 128
    args.kv_bucket = args.kv_bucket if args.kv_bucket is not None else 32 if dry else 128
    args.dtype = args.dtype or ("fp32" if dry else "bf16")
    args.phase_loop_s = args.phase_loop_s if args.phase_loop_s is not None else 0.04 if dry else 2.0
    return args


def _header(args: argparse.Namespace) -> dict[str, Any]:
    import refspec

    return {"kind": "refspec gpu_check", "dry_run": args.dry_run, "complete": False,
            "date": dt.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0) if not args.dry_run else "cpu", "python": sys.version.split()[0],
            "refspec_from": str(Path(refspec.__file__).parent), "argv": sys.argv[1:],
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens, "kv_bucket": args.kv_bucket, "budget_s": args.budget_s}


def _print_summary(results: Results, bench: Bench | None) -> None:
    d = results.data
    print(f"\n== refspec gpu_check{' (DRY RUN: toy models on CPU, no CUDA, modelled energy)' if d['dry_run'] else ''}")
    t = d.get("tests", {})
    print(f"tests: {t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped ({t['command']})" if "passed" in t
          else f"tests: {t.get('skipped', 'not run')}")
    if bench is not None:
        c = d["ceilings"]
        print(f"energy: {bench.meter_note}; idle {bench.idle_w} W")
        print(f"ceilings (this run): copy {c['copy']['best'] / 1e12:.3g} TB/s, gemm {c['gemm']['best'] / 1e12:.3g} "
              f"TFLOP/s; data sheet {bench.datasheet.name}: {bench.datasheet.bandwidth_Bps / 1e12:.3g} TB/s, "
              f"{bench.datasheet.peak_flops / 1e12:.3g} TFLOP/s")
    print(d["acceptance"]["label"])
    for name, info in d.get("blocks", {}).items():
        print(f"block {name}: " + (info.get("skipped") or info.get("error") or
                                   f"{info['seconds']:.0f} s (planned {info['planned_s']:.0f} s)"))
    points = d.get("points", [])
    print(summary_table(points))
    if any("phase_energy" in p for p in points):
        print(phase_table(points))
    if any("eager" in p for p in points):
        print(eager_table(points))
    for name, table in d.get("claims", {}).items():
        print(f"\n-- claim {name}\n{table}")
    clocks = [p["sm_clock_mhz"] for p in points if p.get("sm_clock_mhz")]
    if clocks:
        print(f"SM clock under load (read passively, never set): {min(c['min'] for c in clocks):.0f}-"
              f"{max(c['max'] for c in clocks):.0f} MHz")
    if d.get("skipped_points"):
        print(f"skipped {len(d['skipped_points'])} points: time budget")
    for problem in d.get("out_problems", []):
        print(f"WARNING: {problem}")
    print(f"wrote {results.path} and {', '.join(d.get('plots', []))} in {d['seconds']:.0f} s")


def _start(args: argparse.Namespace) -> Results | int:
    """Checks before any work: CUDA, the installed project; the first results file."""
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU visible; run with --dry-run to rehearse on a CPU", file=sys.stderr)
        return 2
    try:
        import refspec.drafters  # noqa: F401
        import refspec.eval  # noqa: F401
        import refspec.models  # noqa: F401
    except ImportError as exc:
        print(f"gpu_check: refspec is not installed ({exc}); run scripts/gpu_check.sh, which installs it offline, "
              "or `python3 -m pip install --no-index --no-deps --no-build-isolation -e .`", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    results = Results(args.out / "gpu_check.json", _header(args))
    results.save()
    return results


def _acceptance(args: argparse.Namespace, blocks: list[Block]) -> dict[str, Any]:
    """The injected distributions (one per drafter and corpus of the run) and their label."""
    from refspec.eval.injection import injection_label

    models = {}
    for b in blocks:
        for spec in b.drafters:
            for corpus in b.corpora if spec.k else ():
                m = acceptance_model(spec, corpus, args.accept_file)
                models[f"{spec.label} {corpus}"] = {"label": injection_label(m), "mean_tau": m.mean_tau,
                                                    "model": m.to_json()}
    sources = sorted({m["model"]["provenance"]["source_model"] for m in models.values()})
    return {"injected": True, "models": models, "source_model": ", ".join(sources),
            "label": f"ACCEPTANCE INJECTED per (drafter, corpus) from distributions recorded on {', '.join(sources)}: "
                     "tokens are not the model's output and acceptance is not measured",
            "note": "every k > 0 point draws accepted counts from its (drafter, corpus) model restricted to its k"}


def _plan(args: argparse.Namespace, bench: Bench, blocks: list[Block]) -> list[dict[str, Any]]:
    """Each block's planned seconds: the run's roofline on a GPU; a dry run plans the GPU grid on
    an H200 with the ceilings measured there (4.3 TB/s, 780 TFLOP/s)."""
    from refspec.energy.roofline import get_profile

    profile = bench.profile
    if args.dry_run:
        profile = dataclasses.replace(get_profile("h200"), name="h200@4.3TB/s,780TFLOP/s", peak_flops=780e12,
                                      bandwidth_Bps=4.3e12)
    taus = recorded_taus(args.accept_file, CORPORA)
    gpu_blocks = {b.name: b for b in GPU_BLOCKS}
    plans = []
    for b in blocks:
        sized = gpu_blocks.get(b.name, b) if args.dry_run else b
        prompt, new, loop_s = (512, 128, 2.0) if args.dry_run else (args.prompt_len, args.new_tokens, args.phase_loop_s)
        gpu = plan_block(sized, profile, taus, prompt_len=prompt, new_tokens=new, loop_s=loop_s, dry=args.dry_run)
        plans.append(gpu if not args.dry_run else {**plan_block(b, profile, taus, prompt_len=args.prompt_len,
                                                                new_tokens=args.new_tokens, loop_s=args.phase_loop_s,
                                                                dry=True), "gpu_plan": gpu})
    return plans


def _sizes(blocks: list[Block]) -> dict[str, dict[str, int]]:
    """Per architecture: the largest batch, k and eager batch over its blocks."""
    out: dict[str, dict[str, int]] = {}
    for b in blocks:
        s = out.setdefault(b.arch, {"max_batch": 1, "max_k": 1, "eager_batch": 0})
        s["max_batch"] = max(s["max_batch"], *b.batches)
        s["max_k"] = max(s["max_k"], *(d.k for d in b.drafters))
        if b.eager:
            s["eager_batch"] = max(s["eager_batch"], *b.batches)
    return out


def _free_target(bench: Bench) -> None:
    """Drop the target and its caches (the tests' subprocess needs the GPU's memory)."""
    bench.arch, bench.target, bench.target_runner, bench.eager_runner = None, None, None, None
    bench.heads, bench.loops, bench.warmed = {}, {}, set()
    gc.collect()
    if bench.device.type == "cuda":
        torch.cuda.empty_cache()


def _run_tests(args: argparse.Namespace, d: dict[str, Any], budget: Budget) -> None:
    """The GPU-marked tests last, in the time left (the grid's answers come first)."""
    left = min(args.tests_timeout_s, args.budget_s - budget.spent)
    if args.skip_tests:
        d["tests"] = {"skipped": "--skip-tests"}
    elif left < 20:
        d["tests"] = {"skipped": f"budget: {left:.0f} s left"}
    else:
        log.info("running the GPU-marked tests (timeout %.0f s)", left)
        d["tests"] = run_gpu_tests(ROOT, left)
        log.info("tests: %d passed, %d failed, %d skipped in %.0f s", d["tests"]["passed"], d["tests"]["failed"],
                 d["tests"]["skipped"], d["tests"]["seconds"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", force=True)
    logging.getLogger("refspec.engine").setLevel(logging.ERROR)
    t_start = time.perf_counter()
    if args.threads or args.dry_run:
        torch.set_num_threads(args.threads or 1)
    results = _start(args)
    if isinstance(results, int):
        return results
    d = results.data
    try:
        blocks = select_blocks(args)
        d["acceptance"] = _acceptance(args, blocks)
    except Exception as exc:  # a bad --blocks / --drafters / acceptance file: one line, no grid
        d.update(error=str(exc), seconds=time.perf_counter() - t_start)
        results.save()
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2
    try:
        bench = build_bench(args)
    except ModelledEnergyOnly as exc:
        d.update(error=str(exc), seconds=time.perf_counter() - t_start)
        results.save()
        print(f"gpu_check: {exc}", file=sys.stderr)
        return EXIT_MODELLED_ONLY
    d.update(energy=bench.meter_note, energy_source=bench.meter.source, energy_measured=bench.energy_measured,
             idle_w=bench.idle_w, ceilings=bench.ceilings, roofline_profile=dataclasses.asdict(bench.profile),
             datasheet_profile=dataclasses.asdict(bench.datasheet), dtype=str(bench.dtype),
             drafters={"eagle": "EAGLE-1-shaped chain head, random weights (gpucheck.drafting)",
                       "block": f"block head, block size {BLOCK_SIZE}, random weights (gpucheck.drafting)"})
    plans = _plan(args, bench, blocks)
    d["plan"] = plans
    log.info("plan (seconds from the roofline):\n%s", format_plan([p.get("gpu_plan", p) for p in plans],
                                                                   FIXED_PLAN_S))
    results.save()
    budget, sizes = Budget(args.budget_s, t_start), _sizes(blocks)
    for optional in (False, True):  # the optional blocks (an MoE target) after the tests
        if optional:
            _free_target(bench)
            _run_tests(args, d, budget)
            results.save()
        for block, plan in zip(blocks, plans):
            if (block.needs is not None) != optional:
                continue
            if not block.available():
                d.setdefault("blocks", {})[block.name] = {"skipped": f"{block.needs or block.arch} is not available"}
                continue
            run_block(bench, args, block, plan, results, budget, sizes[block.arch])
    _free_target(bench)
    _finish(args, d, bench, t_start)
    results.save()
    getattr(bench.meter, "close", lambda: None)()
    _print_summary(results, bench)
    return 1 if tests_failed(d["tests"]) or any("error" in p for p in d["points"]) else 0


def _finish(args: argparse.Namespace, d: dict[str, Any], bench: Bench, t_start: float) -> None:
    """Claim tables, plots and the closing fields, from the points alone."""
    points = d.setdefault("points", [])
    d["claims"], d["crossover"] = claim_tables(points, d["acceptance"], bench.profile,
                                               args.prompt_len + args.new_tokens // 2)
    title = f"random-weight targets, {bench.device.type}{' DRY RUN' if args.dry_run else ''}"
    d["plots"] = make_plots(points, d["crossover"], args.out, title)
    ok = [p for p in points if "error" not in p]
    d["energy_label"] = energy_label(ok or [{"energy_source": bench.meter.source}])
    d["dvfs_module_loaded"] = "refspec.energy.dvfs" in sys.modules  # the check never sets clocks
    d.update(seconds=time.perf_counter() - t_start, complete=True, out_problems=out_problems(args.out))


if __name__ == "__main__":
    sys.exit(main())
