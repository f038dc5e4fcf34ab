#!/usr/bin/env python
"""GPU check: graph tests, then an 8B-shaped random-weight benchmark with injected acceptance.

On a machine with one NVIDIA GPU and no network, in well under 8 minutes:

1. **tests**: ``pytest -m gpu tests/test_cuda_graphs.py`` (graphs equal eager-static bit for
   bit for plain, n-gram, draft-model and EAGLE when present; capture of every bucket; a batch
   that shrinks mid-run; no host sync in a replay).
2. **benchmark**: a random-weight target of a real architecture (default Llama-3.1-8B, bf16)
   decodes random prompts at every (batch, k) of the grid (default batch 1, 8, 32, 64 and
   k 0, 3, 7, 15) with CUDA graphs for verify and draft steps. k > 0 drafts with the target's
   first layer (``self:1``: one decoder layer + LM head per draft token, the cost shape of an
   EAGLE head) and **acceptance is injected** from ``--accept-model`` (default: derived from
   vLLM's published EAGLE-3 acceptance lengths), so tokens are meaningless and every output
   says so. Each (batch, k) runs twice with the same seeds: a warm-up run that captures every
   graph the measured run will need, then the measured run. Step times come from host
   timestamps after each step's one host sync; energy from Zeus (NVML total-energy counter)
   over the measured run's steps 2..N; each step is compared with its roofline prediction
   (:mod:`refspec.energy.roofline`, the GPU's data-sheet profile) computed from the exact work the
   engine reported for that step.
3. **outputs** under ``--out`` (default ``$OUT``): ``gpu_check.json`` with every figure and
   ``*.png`` plots; a summary is printed.

``--dry-run`` runs the same code on a CPU, except CUDA: a toy model of the same family
(hidden 256, 2 layers, vocab 2048) instead of 8B shapes, fp32 instead of bf16 (bf16 GEMMs are
~10x slower on CPUs without AVX512-BF16), short prompts, eager-static runners
instead of graphs (same bucketing and padding), the roofline meter with this CPU's measured
profile instead of Zeus (energy modelled, labelled so), and the GPU tests collected and
skipped with their reason.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import logging
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("gpu_check")


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
    p.add_argument("--budget-s", type=float, default=400.0,
                   help="stop starting new (batch, k) points after this many seconds of the whole run")
    p.add_argument("--tests-timeout-s", type=float, default=240.0)
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"],
                   help="weight dtype (default bf16; dry run fp32: bf16 matmuls are ~10x slower on CPUs without "
                        "AVX512-BF16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (dry run default 1)")
    args = p.parse_args(argv)
    if args.prompt_len is None:
        args.prompt_len = 64 if args.dry_run else 512
    if args.new_tokens is None:
        args.new_tokens = 32 if args.dry_run else 256
    if args.kv_bucket is None:
        args.kv_bucket = 32 if args.dry_run else 128
    if args.dtype is None:
        args.dtype = "fp32" if args.dry_run else "bf16"
    return args


# ---- 1. tests ----------------------------------------------------------------------------------
def run_gpu_tests(timeout_s: float) -> dict[str, Any]:
    """``pytest -m gpu`` on the graph tests, in a subprocess (its GPU memory is freed on exit)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-rs", "-p", "no:cacheprovider",
           "tests/test_cuda_graphs.py"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        out += f"\n[gpu_check] pytest timed out after {timeout_s:.0f} s"
        rc = -1
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)", out)}
    return {"command": " ".join(cmd), "returncode": rc, "seconds": time.perf_counter() - t0,
            "passed": counts.get("passed", 0), "failed": counts.get("failed", 0) + counts.get("error", 0)
            + counts.get("errors", 0), "skipped": counts.get("skipped", 0), "output_tail": out[-4000:]}


# ---- 2. benchmark ------------------------------------------------------------------------------
@dataclasses.dataclass
class Setup:
    """Everything the (batch, k) points share."""

    device: torch.device
    dtype: torch.dtype
    arch_label: str
    target: Any
    target_runner: Any
    draft_runner: Any
    meter: Any
    meter_note: str
    profile: Any
    profile_note: str
    idle_w: float | None


def build_setup(args: argparse.Namespace) -> Setup:
    from refspec.cuda_graphs import GraphRunner
    from refspec.energy.meters import NoGPUError, make_meter
    from refspec.models.random_models import random_model, shrunk_config
    from refspec.energy.roofline import cpu_profile, get_profile

    dry = args.dry_run
    device = torch.device("cpu" if dry else "cuda")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    arch: Any = shrunk_config(args.arch) if dry else args.arch
    label = f"{args.arch} (toy: hidden 256, 2 layers, vocab 2048)" if dry else args.arch
    t0 = time.perf_counter()
    target = random_model(arch, device=device, dtype=dtype, seed=args.seed)
    if not dry:
        torch.cuda.synchronize()
    log.info("built random %s in %.1f s", label, time.perf_counter() - t0)

    capture = not dry
    max_k = max(args.ks)
    target_runner = GraphRunner(target, capture=capture, max_tokens_per_row=max_k + 1)
    draft_runner = GraphRunner(target.truncated(1), capture=capture, max_tokens_per_row=2)
    max_len = -(-(args.prompt_len + args.new_tokens + max_k + 1) // args.kv_bucket) * args.kv_bucket
    for r in (target_runner, draft_runner):
        r.reserve(max(args.batches), max_len)

    if dry:
        profile = cpu_profile(torch.finfo(dtype).bits // 8)
        profile_note = f"this CPU's measured {args.dtype} profile (refspec.energy.roofline.cpu_profile)"
        meter = make_meter("roofline", profile=profile, time_source="measured")
        meter_note = "dry run: energy MODELLED by the roofline meter (no energy counter on this CPU)"
        idle_w = profile.idle_w
    else:
        name = torch.cuda.get_device_name(0)
        key = "h200" if "h200" in name.lower() else "h100" if "h100" in name.lower() else None
        profile = get_profile(key or "h200")
        profile_note = f"data-sheet profile {profile.name}" + ("" if key else f" (no profile for {name!r}; H200 assumed)")
        try:
            meter = make_meter("zeus")
            meter_note = f"measured by Zeus: {meter.source}"
            idle_w = meter.measure_idle_w(3.0)
        except NoGPUError as exc:
            meter = make_meter("auto")
            meter_note = f"Zeus unavailable ({exc}); fell back to {meter.source}"
            idle_w = getattr(meter, "idle_w", None)
    return Setup(device=device, dtype=dtype, arch_label=label, target=target, target_runner=target_runner,
                 draft_runner=draft_runner, meter=meter, meter_note=meter_note, profile=profile,
                 profile_note=profile_note, idle_w=idle_w)


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def run_point(setup: Setup, args: argparse.Namespace, batch: int, k: int) -> dict[str, Any]:
    """Warm-up run (captures), then the measured run of one (batch, k)."""
    from refspec.drafters.draft_model import DraftModelDrafter
    from refspec.engine import Engine, EngineConfig
    from refspec.eval.injection import make_acceptance_fn, resolve_acceptance_model
    from refspec.energy.roofline import forward_cost, total_cost, work_time_s

    target, dev = setup.target, setup.device
    g = torch.Generator().manual_seed(args.seed + batch)
    prompts = torch.randint(0, target.args.vocab_size, (batch, args.prompt_len), generator=g).tolist()
    model = resolve_acceptance_model(args.accept_model, k=k) if k else None

    def engine(on_step):
        drafter = None
        fn = None
        if k:
            drafter = DraftModelDrafter(setup.draft_runner, target_vocab_size=target.args.vocab_size,
                                        kv_bucket=args.kv_bucket)
            fn = make_acceptance_fn(model, torch.Generator(device=dev).manual_seed(args.seed + 7))
        return Engine(target, drafter, config=EngineConfig(k=k, kv_bucket=args.kv_bucket),
                      verify_fn=setup.target_runner, acceptance_fn=fn, on_step=on_step)

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    engine(None).generate(prompts, max_new_tokens=args.new_tokens)  # warm-up: same path, captures graphs
    sync()
    warmup_s = time.perf_counter() - t0
    captures_before = setup.target_runner.stats.captures + setup.draft_runner.stats.captures

    stamps: list[float] = []

    def on_step(step: int, _emitted: int) -> None:
        stamps.append(time.perf_counter())  # after the step's host sync: its GPU work is done
        if step == 1:
            setup.meter.begin("decode")

    gen = engine(on_step).generate(prompts, max_new_tokens=args.new_tokens)
    if gen.steps < 3:
        raise SystemExit(f"gpu_check: batch {batch}, k {k} ran {gen.steps} steps; raise --new-tokens so every "
                         f"point runs at least 3 (the energy window spans steps 2..N)")
    events = [e for e in gen.events if e.step >= 1]
    work = tuple(w for e in events if e.phase in ("draft", "verify") for w in e.work)
    m = setup.meter.end("decode", work)
    captures_during = setup.target_runner.stats.captures + setup.draft_runner.stats.captures - captures_before

    measured = [b - a for a, b in zip(stamps, stamps[1:])]  # steps 1..N-1
    per_step_work: dict[int, list] = {}
    for e in events:
        if e.phase in ("draft", "verify"):
            per_step_work.setdefault(e.step, []).extend(e.work)
    predicted = [work_time_s(per_step_work.get(i, []), setup.profile) for i in range(1, gen.steps)]
    pred_energy = sum(setup.profile.energy_j(total_cost(per_step_work.get(i, [])), t)
                      for i, t in zip(range(1, gen.steps), predicted))
    emitted = sum(e.emitted for e in events if e.phase == "commit")
    row_steps = sum(e.rows_active for e in events if e.phase == "verify")
    accepted = [a for step in gen.accepted_per_step[1:] for a in step if a >= 0]
    verify_shapes = [w for e in events if e.phase == "verify" for w in e.work]
    intensity = statistics.mean(forward_cost(w).intensity for w in verify_shapes) if verify_shapes else float("nan")
    energy = m.energy_j
    net = None if energy is None or setup.idle_w is None else energy - setup.idle_w * m.time_s
    mean_meas = statistics.mean(measured) if measured else float("nan")
    mean_pred = statistics.mean(predicted) if predicted else float("nan")
    tokens_per_row_step = emitted / row_steps if row_steps else float("nan")
    return {
        "batch": batch, "k": k, "steps": gen.steps, "measured_steps": len(measured),
        "warmup_s": warmup_s, "captures_during_measurement": captures_during,
        "step_time_s": {"mean": mean_meas, "median": statistics.median(measured) if measured else None,
                        "p99": _percentile(measured, 0.99) if measured else None},
        "predicted_step_time_s": mean_pred,
        "measured_over_predicted": mean_meas / mean_pred if mean_pred else None,
        "per_step_s": {"measured": [round(x, 7) for x in measured], "predicted": [round(x, 7) for x in predicted]},
        "window_s": m.time_s, "energy_j": energy, "energy_source": m.source, "idle_w": setup.idle_w,
        "energy_net_j": net, "emitted_tokens": emitted,
        "j_per_token": energy / emitted if energy is not None and emitted else None,
        "j_per_token_net": net / emitted if net is not None and emitted else None,
        "predicted_j_per_token": pred_energy / emitted if emitted else None,
        "tpot_s": mean_meas / tokens_per_row_step if row_steps else None,
        "tau_observed": (sum(a + 1 for a in accepted) / len(accepted)) if accepted else 1.0,
        "tau_model": model.mean_tau if model else 1.0,
        "acceptance_injected": bool(k), "accept_model": model.name if model else None,
        "verify_intensity_flop_per_byte": intensity, "ridge_flop_per_byte": setup.profile.ridge,
        "verify_compute_bound": intensity > setup.profile.ridge,
    }


# ---- 3. outputs --------------------------------------------------------------------------------
def make_plots(points: list[dict[str, Any]], out: Path, title: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    ks = sorted({p["k"] for p in points})

    def lines(ax, ykey, pred_key=None, ylabel=""):
        for i, k in enumerate(ks):
            pts = sorted((p for p in points if p["k"] == k), key=lambda p: p["batch"])
            xs = [p["batch"] for p in pts]
            color = f"C{i}"
            ax.plot(xs, [ykey(p) for p in pts], "o-", color=color, label=f"k={k} measured")
            if pred_key is not None:
                ax.plot(xs, [pred_key(p) for p in pts], "x--", color=color, alpha=0.7, label=f"k={k} roofline")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)

    specs = [
        ("step_time_vs_roofline.png", lambda p: p["step_time_s"]["mean"] * 1e3, lambda p: p["predicted_step_time_s"] * 1e3,
         "step time (ms)", True),
        ("energy_per_token.png", lambda p: p["j_per_token"], lambda p: p["predicted_j_per_token"], "J / output token", True),
        ("measured_over_predicted.png", lambda p: p["measured_over_predicted"], None, "measured / roofline step time",
         False),
        ("tpot.png", lambda p: p["tpot_s"] * 1e3, None, "TPOT (ms / token / user)", True),
    ]
    for name, y, yp, label, logy in specs:
        if any(y(p) is None for p in points):
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        lines(ax, y, yp, label)
        if logy:
            ax.set_yscale("log")
        ax.set_title(f"{title}\nacceptance INJECTED", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        files.append(name)
    return files


def summary_table(points: list[dict[str, Any]]) -> str:
    head = f"{'batch':>5} {'k':>3} {'steps':>5} {'step ms':>9} {'roofline':>9} {'ratio':>6} {'tau':>5} " \
           f"{'J/tok':>8} {'J/tok net':>9} {'TPOT ms':>8} {'bound':>7}"
    rows = [head]
    for p in points:
        jt = p["j_per_token"]
        jn = p["j_per_token_net"]
        rows.append(f"{p['batch']:>5} {p['k']:>3} {p['steps']:>5} {p['step_time_s']['mean'] * 1e3:>9.3f} "
                    f"{p['predicted_step_time_s'] * 1e3:>9.3f} {p['measured_over_predicted']:>6.2f} "
                    f"{p['tau_observed']:>5.2f} {jt if jt is not None else float('nan'):>8.4f} "
                    f"{jn if jn is not None else float('nan'):>9.4f} {p['tpot_s'] * 1e3:>8.3f} "
                    f"{'compute' if p['verify_compute_bound'] else 'memory':>7}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("refspec.engine").setLevel(logging.ERROR)
    t_start = time.perf_counter()
    if args.threads or args.dry_run:
        torch.set_num_threads(args.threads or 1)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU visible; run with --dry-run to rehearse on a CPU", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))
    from refspec.eval.injection import injection_label, injection_record, resolve_acceptance_model

    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "kind": "refspec gpu_check", "dry_run": args.dry_run, "date": dt.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__, "device": torch.cuda.get_device_name(0) if not args.dry_run else "cpu",
        "argv": sys.argv[1:], "grid": {"batches": args.batches, "ks": args.ks}, "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "kv_bucket": args.kv_bucket,
    }
    inj_k = max([k for k in args.ks if k] or [1])
    injected = resolve_acceptance_model(args.accept_model, k=inj_k)
    report["acceptance"] = injection_record(injected)
    report["acceptance"]["note"] = "every k > 0 point draws accepted counts from this model restricted to its k"

    if args.skip_tests:
        report["tests"] = {"skipped": "--skip-tests"}
    else:
        log.info("running the GPU-marked tests")
        report["tests"] = run_gpu_tests(args.tests_timeout_s)
        log.info("tests: %d passed, %d failed, %d skipped in %.0f s", report["tests"]["passed"],
                 report["tests"]["failed"], report["tests"]["skipped"], report["tests"]["seconds"])

    setup = build_setup(args)
    report.update(target=setup.arch_label, dtype=str(setup.dtype), energy=setup.meter_note, idle_w=setup.idle_w,
                  roofline_profile=setup.profile.name, roofline_note=setup.profile_note,
                  runner_mode=setup.target_runner.mode,
                  drafter="draft-model self:1 (the target's first layer + LM head per draft token)")
    points, skipped = [], []
    for batch in args.batches:
        for k in args.ks:
            if time.perf_counter() - t_start > args.budget_s:
                skipped.append({"batch": batch, "k": k, "why": f"time budget {args.budget_s:.0f} s spent"})
                continue
            log.info("batch %d, k %d", batch, k)
            p = run_point(setup, args, batch, k)
            points.append(p)
            log.info("  step %.3f ms (roofline %.3f ms), %s J/token, tau %.2f", p["step_time_s"]["mean"] * 1e3,
                     p["predicted_step_time_s"] * 1e3, p["j_per_token"], p["tau_observed"])
            if setup.device.type == "cuda":
                torch.cuda.empty_cache()
    report["points"], report["skipped_points"] = points, skipped
    report["runner_stats"] = {"target": dataclasses.asdict(setup.target_runner.stats),
                              "draft": dataclasses.asdict(setup.draft_runner.stats)}
    title = f"{setup.arch_label} random weights, {setup.device.type}{' DRY RUN' if args.dry_run else ''}"
    report["plots"] = make_plots(points, args.out, title) if points else []
    report["seconds"] = time.perf_counter() - t_start
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")

    print(f"\n== refspec gpu_check{' (DRY RUN: toy model on CPU, no CUDA, modelled energy)' if args.dry_run else ''}")
    print(f"target: {setup.arch_label} random weights, {setup.dtype}, runners: {setup.target_runner.mode}")
    print(f"energy: {setup.meter_note}; idle {setup.idle_w} W")
    print(f"roofline: {setup.profile_note}")
    t = report["tests"]
    if "passed" in t:
        print(f"tests: {t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped ({t['command']})")
    print(injection_label(injected))
    print(summary_table(points))
    if skipped:
        print(f"skipped {len(skipped)} points: time budget")
    print(f"wrote {args.out / 'gpu_check.json'} and {', '.join(report['plots'])} in {report['seconds']:.0f} s")
    failed = isinstance(t.get("failed"), int) and (t["failed"] > 0 or t["returncode"] not in (0, 5))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
