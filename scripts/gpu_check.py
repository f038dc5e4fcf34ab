#!/usr/bin/env python
"""GPU check: graph tests, measured ceilings, then an 8B-shaped random-weight benchmark with injected acceptance.

Run it through ``scripts/gpu_check.sh``, which installs the project offline first. On a machine
with one NVIDIA GPU and no network, in well under 8 minutes:

1. **tests**: ``pytest -m gpu tests/test_cuda_graphs.py`` (graphs equal eager-static bit for
   bit for plain, n-gram, draft-model and EAGLE; capture of every bucket; a batch that shrinks
   mid-run; no host sync in a replay).
2. **ceilings**: a 2 GiB device-to-device copy and an 8192^3 GEMM in the run's dtype on random
   data (``gpucheck.ceilings``); the run's roofline uses them, the data sheet's stay beside.
3. **meter**: measured energy from Zeus, else NVML's total-energy counter through pynvml, else
   NVML power samples integrated; where none can be read, energy is MODELLED by the roofline
   and labelled so (``--require-measured-energy`` then exits 3 instead).
4. **benchmark**: a random-weight target of a real architecture (default Llama-3.1-8B, bf16)
   decodes random prompts at every (batch, k) of the grid with CUDA graphs for verify and draft
   steps. k > 0 drafts with the target's first layer (``self:1``: the cost shape of an EAGLE
   head) and **acceptance is injected** from ``--accept-model``, so tokens are meaningless and
   every output says so. Each point runs twice with the same seeds (a warm-up that captures
   every graph, then the measured run), in its own try/except: a failing point is recorded
   with its error and the run goes on. ``--budget-s`` stops starting points cleanly.
5. **outputs** under ``--out`` (default ``$OUT``): ``gpu_check.json`` rewritten atomically after
   every stage and point, at most four ``*.png`` plots; the shell wrapper adds
   ``gpu_check.log``. A summary is printed.

``--dry-run`` runs the same code on a CPU, except CUDA: a toy model of the same family
(hidden 256, 2 layers, vocab 2048), fp32, short prompts, eager-static runners instead of graphs
(same bucketing and padding), small ceilings, energy modelled by the roofline meter with this
CPU's profile (labelled so), and the GPU tests collected and skipped with their reason.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from gpucheck.bench import Bench, ModelledEnergyOnly, build_bench
from gpucheck.gpu_tests import run_gpu_tests, tests_failed
from gpucheck.outputs import eager_table, energy_label, make_plots, phase_table, summary_table
from gpucheck.phase_loops import isolated_loops, split
from gpucheck.point import run_point
from gpucheck.results import Results, out_problems

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("gpu_check")
EXIT_MODELLED_ONLY = 3


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="rehearse on a CPU: toy model, no CUDA, modelled energy")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_check_out")),
                   help="output folder (default: $OUT)")
    p.add_argument("--arch", default="llama-3.1-8b", help="architecture of refspec.energy.architectures.ARCHS for the target")
    p.add_argument("--batches", type=_ints, default=[1, 8, 32, 64])
    p.add_argument("--ks", type=_ints, default=[0, 3, 7, 15])
    p.add_argument("--accept-model", default="vllm-eagle3-llama3.1-8b",
                   help="acceptance model to inject: a built-in name, geometric:A, or a JSON file")
    p.add_argument("--prompt-len", type=int, default=None, help="tokens per prompt (default 512; dry run 64)")
    p.add_argument("--new-tokens", type=int, default=None, help="budget per row (default 256; dry run 32)")
    p.add_argument("--kv-bucket", type=int, default=None, help="engine kv_bucket (default 128; dry run 32)")
    p.add_argument("--budget-s", type=float, default=330.0,
                   help="start no (batch, k) point once the run has spent this many seconds, or when the last "
                        "point's duration would overrun it")
    p.add_argument("--require-measured-energy", action="store_true",
                   help=f"exit {EXIT_MODELLED_ONLY} before the benchmark when no energy counter can be read "
                        "(only the roofline model is available)")
    p.add_argument("--phase-loop-s", type=float, default=None,
                   help="seconds each phase-isolated loop (prefill, draft, verify) runs at every point for the "
                        "measured per-phase split (default 2; dry run 0.04; 0 skips them)")
    p.add_argument("--eager-batches", type=_ints, default=None,
                   help="batches whose points also run without graph capture, for graphs against eager "
                        "(default 1,32; dry run 2; empty: none)")
    p.add_argument("--tests-timeout-s", type=float, default=150.0)
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"],
                   help="weight dtype (default bf16; dry run fp32: bf16 matmuls are ~10x slower on CPUs without "
                        "AVX512-BF16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (dry run default 1)")
    args = p.parse_args(argv)
    dry = args.dry_run
    args.prompt_len = args.prompt_len if args.prompt_len is not None else 64 if dry else 512
    args.new_tokens = args.new_tokens if args.new_tokens is not None else 32 if dry else 256
    args.kv_bucket = args.kv_bucket if args.kv_bucket is not None else 32 if dry else 128
    args.dtype = args.dtype or ("fp32" if dry else "bf16")
    args.eager_batches = args.eager_batches if args.eager_batches is not None else [2] if dry else [1, 32]
    args.phase_loop_s = args.phase_loop_s if args.phase_loop_s is not None else 0.04 if dry else 2.0
    return args


def _header(args: argparse.Namespace) -> dict[str, Any]:
    import refspec

    return {"kind": "refspec gpu_check", "dry_run": args.dry_run, "complete": False,
            "date": dt.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0) if not args.dry_run else "cpu", "python": sys.version.split()[0],
            "refspec_from": str(Path(refspec.__file__).parent), "argv": sys.argv[1:],
            "grid": {"batches": args.batches, "ks": args.ks}, "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens, "kv_bucket": args.kv_bucket, "budget_s": args.budget_s}


def _phase_energy(bench: Bench, args: argparse.Namespace, p: dict[str, Any]) -> dict[str, Any]:
    """Phase-isolated loops of one point and their split; an error is recorded, not raised."""
    try:
        loops = isolated_loops(bench, args, p["batch"], p["k"], args.phase_loop_s, bench.prefill_loops)
        out = {"split": split(loops, p["run_window"]), "loops": loops}
        s = out["split"]
        log.info("  phases (%s): loops %s, fit %s, additivity residual %+.1f%%", s["energy_source"],
                 {q: round(x, 3) for q, x in s["loops_share"].items()},
                 {q: round(x, 3) for q, x in s["fit_share"].items()}, 100 * s["additivity_residual"])
        return out
    except Exception as exc:
        log.exception("phase loops of batch %d, k %d failed", p["batch"], p["k"])
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}


def _eager(bench: Bench, args: argparse.Namespace, p: dict[str, Any]) -> dict[str, Any]:
    """The same point without graph capture: step time and J/token, and the graphs' gain."""
    keys = ("runner_mode", "step_time_s", "j_per_token", "j_per_token_net", "tpot_s", "energy_source", "tau_observed")
    try:
        e = run_point(bench, args, p["batch"], p["k"], eager=True)
    except Exception as exc:
        log.exception("eager run of batch %d, k %d failed", p["batch"], p["k"])
        return {"error": f"{type(exc).__name__}: {exc}"}
    out = {key: e[key] for key in keys}
    out["graph_speedup"] = e["step_time_s"]["mean"] / p["step_time_s"]["mean"]
    out["graph_energy_ratio"] = (p["j_per_token"] / e["j_per_token"]) if e["j_per_token"] else None
    log.info("  %s: step %.3f ms, %s J/token; %s is %.2fx as fast", e["runner_mode"], e["step_time_s"]["mean"] * 1e3,
             e["j_per_token"], p["runner_mode"], out["graph_speedup"])
    return out


def _run_grid(bench: Bench, args: argparse.Namespace, results: Results, t_start: float) -> None:
    """Every (batch, k) in its own try/except; the results are saved after each."""
    points, skipped = results.data.setdefault("points", []), results.data.setdefault("skipped_points", [])
    last_s = 0.0
    for batch in args.batches:
        for k in args.ks:
            spent = time.perf_counter() - t_start
            if spent + last_s > args.budget_s:
                skipped.append({"batch": batch, "k": k, "why": f"budget {args.budget_s:.0f} s: {spent:.0f} s spent, "
                                                              f"the last point took {last_s:.0f} s"})
                continue
            log.info("batch %d, k %d", batch, k)
            t0 = time.perf_counter()
            try:
                p = run_point(bench, args, batch, k)
                log.info("  step %.3f ms (roofline %.3f ms), %s J/token (%s), tau %.2f", p["step_time_s"]["mean"] * 1e3,
                         p["predicted_step_time_s"] * 1e3, p["j_per_token"], p["energy_source"], p["tau_observed"])
            except Exception as exc:  # one failing point must not lose the others
                log.exception("batch %d, k %d failed", batch, k)
                p = {"batch": batch, "k": k, "error": f"{type(exc).__name__}: {exc}",
                     "traceback": traceback.format_exc()[-3000:]}
            if "error" not in p and args.phase_loop_s > 0:
                p["phase_energy"] = _phase_energy(bench, args, p)
            if "error" not in p and batch in args.eager_batches:
                p["eager"] = _eager(bench, args, p)
            last_s = p["seconds"] = time.perf_counter() - t0
            points.append(p)
            if bench.device.type == "cuda":
                torch.cuda.empty_cache()
            results.save()


def _print_summary(results: Results, bench: Bench | None) -> None:
    d = results.data
    print(f"\n== refspec gpu_check{' (DRY RUN: toy model on CPU, no CUDA, modelled energy)' if d['dry_run'] else ''}")
    t = d.get("tests", {})
    if "passed" in t:
        print(f"tests: {t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped ({t['command']})")
    if bench is not None:
        c = d["ceilings"]
        print(f"target: {bench.arch_label} random weights, {bench.dtype}, runners: {bench.target_runner.mode}")
        print(f"energy: {bench.meter_note}; idle {bench.idle_w} W")
        print(f"ceilings (this run): copy {c['copy']['best'] / 1e12:.3g} TB/s, gemm {c['gemm']['best'] / 1e12:.3g} "
              f"TFLOP/s; data sheet {bench.datasheet.name}: {bench.datasheet.bandwidth_Bps / 1e12:.3g} TB/s, "
              f"{bench.datasheet.peak_flops / 1e12:.3g} TFLOP/s")
        print(d["acceptance"]["label"])
        print(summary_table(d.get("points", [])))
        if any("phase_energy" in p for p in d.get("points", [])):
            print(phase_table(d["points"]))
        if any("eager" in p for p in d.get("points", [])):
            print(eager_table(d["points"]))
    clocks = [p["sm_clock_mhz"] for p in d.get("points", []) if p.get("sm_clock_mhz")]
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
    from refspec.eval.injection import injection_label, injection_record, resolve_acceptance_model

    d = results.data
    injected = resolve_acceptance_model(args.accept_model, k=max([k for k in args.ks if k] or [1]))
    d["acceptance"] = {**injection_record(injected), "label": injection_label(injected),
                       "note": "every k > 0 point draws accepted counts from this model restricted to its k"}
    if args.skip_tests:
        d["tests"] = {"skipped": "--skip-tests"}
    else:
        log.info("running the GPU-marked tests")
        d["tests"] = run_gpu_tests(ROOT, args.tests_timeout_s)
        log.info("tests: %d passed, %d failed, %d skipped in %.0f s", d["tests"]["passed"], d["tests"]["failed"],
                 d["tests"]["skipped"], d["tests"]["seconds"])
    results.save()
    try:
        bench = build_bench(args)
    except ModelledEnergyOnly as exc:
        d.update(error=str(exc), seconds=time.perf_counter() - t_start)
        results.save()
        print(f"gpu_check: {exc}", file=sys.stderr)
        return EXIT_MODELLED_ONLY
    d.update(target=bench.arch_label, dtype=str(bench.dtype), energy=bench.meter_note,
             energy_source=bench.meter.source, energy_measured=bench.energy_measured, idle_w=bench.idle_w,
             ceilings=bench.ceilings, roofline_profile=dataclasses.asdict(bench.profile),
             datasheet_profile=dataclasses.asdict(bench.datasheet), runner_mode=bench.target_runner.mode,
             drafter="draft-model self:1 (the target's first layer + LM head per draft token)")
    results.save()
    _run_grid(bench, args, results, t_start)
    d["runner_stats"] = {"target": dataclasses.asdict(bench.target_runner.stats),
                         "draft": dataclasses.asdict(bench.draft_runner.stats)}
    title = f"{bench.arch_label} random weights, {bench.device.type}{' DRY RUN' if args.dry_run else ''}"
    d["plots"] = make_plots(d["points"], args.out, title)
    d["energy_label"] = energy_label([p for p in d["points"] if "error" not in p] or [{"energy_source": bench.meter.source}])
    d.update(seconds=time.perf_counter() - t_start, complete=True, out_problems=out_problems(args.out))
    results.save()
    getattr(bench.meter, "close", lambda: None)()
    _print_summary(results, bench)
    return 1 if tests_failed(d["tests"]) or any("error" in p for p in d["points"]) else 0


if __name__ == "__main__":
    sys.exit(main())
