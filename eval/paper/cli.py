"""``python -m refspec.eval paper``: the paper's seven claims on the hardware at hand.

On a GPU: random-weight targets of real shapes (two attention families), energy read by the
GPU's counter over windows it resolves, per-phase energy attributed from phase loops and a
fit, three repeats per variant with their spread. On a CPU: the same grid, toy forwards
priced at the real shapes with the H200 and H100 profiles through a simulated counter, every
figure MODELLED. Writes claims.md, claims.json, results.json and four plots under ``--out``,
rewritten after every variant.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from refspec.eval.cli_checks_paper import check_paper_flags
from refspec.eval.flags import EXIT_INTERRUPTED, EXIT_USAGE, OneLineParser, UsageError, output_path
from refspec.eval.outputs import check_output_dir, claimed

log = logging.getLogger("refspec.eval.paper")
GPU_BUDGET_S = 500.0  # with the shell's offline install (30 s planned): at most 530 s inside the 540 s limit
CPU_BUDGET_S = 840.0


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m refspec.eval paper", description=__doc__.split("\n\n")[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=output_path, default=Path(os.environ.get("OUT", "paper_out")),
                   help="output folder (default: $OUT, else ./paper_out)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: the GPU where CUDA runs, else the CPU (modelled)")
    p.add_argument("--profile", default="h200,h100",
                   help="CPU only: roofline profiles the simulated counter models, in order (default h200,h100)")
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"seconds of the whole command after the install (default {GPU_BUDGET_S:g} on a GPU, "
                        f"{CPU_BUDGET_S:g} on a CPU): no shape starts that the plan, scaled by the run so far, says "
                        "would overrun it")
    p.add_argument("--quick", action="store_true", help="a short grid (CI's rehearsal)")
    p.add_argument("--plan-only", action="store_true", help="print the GPU plan and exit")
    p.add_argument("--blocks", default=None, help="comma-separated blocks to run (core, family2)")
    p.add_argument("--batches", type=_ints, default=None, help="replace every block's batches, e.g. 1,16,64")
    p.add_argument("--corpora", default=None, help="replace every block's corpora, e.g. conversation,code")
    p.add_argument("--sources", default=None,
                   help="acceptance levels served at every batch: small, published, user (default published; small "
                        "also runs at the largest batch of the first block)")
    p.add_argument("--accept-model", default=None, metavar="SPEC",
                   help="the 'user' acceptance level: a built-in (vllm-eagle3-llama3.1-8b), geometric:A, or a "
                        "refspec.acceptance/1 file; added to the sources")
    p.add_argument("--accept-file", type=Path, default=None, metavar="FILE",
                   help="a refspec.acceptance/1 file as the 'user' level (the same as --accept-model FILE)")
    p.add_argument("--repeats", type=int, default=None,
                   help="served runs per variant (spread = half their range; default 3, --quick 2: too few for a "
                        "verdict, which its claims say)")
    p.add_argument("--min-window-s", type=float, default=5.0,
                   help="shortest steady-state window on a GPU, s (and at least 50 counter periods)")
    p.add_argument("--no-loops", dest="loops", action="store_false", help="skip the phase-isolated loops")
    p.add_argument("--ledgers", type=output_path, default=None, metavar="DIR",
                   help="keep every run's ledger (JSONL) in DIR (default: a temporary folder, deleted at exit)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128, help="mean budget per request (uniform in [N/2, 3N/2])")
    p.add_argument("--kv-bucket", type=int, default=128)
    p.add_argument("--require-measured-energy", action="store_true",
                   help="exit 3 before the grid when no energy counter can be read")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default 1 on a CPU)")
    p.add_argument("--seed", type=int, default=0)
    return p


def _sources(args: argparse.Namespace) -> dict[str, Any]:
    from refspec.eval.paper import acceptance

    srcs = {"small": acceptance.SMALL, "published": acceptance.PUBLISHED}
    spec = args.accept_model or (str(args.accept_file) if args.accept_file else None)
    if spec is not None:
        srcs["user"] = acceptance.user_source(spec)
        if not args.sources:
            args.sources = "published,user"
    return srcs


def _check(args: argparse.Namespace, blocks: list[Any], sources: dict[str, Any]) -> dict[tuple[str, str, str], float]:
    """Every acceptance the grid will inject, resolved now (a bad spec fails before any work); their taus."""
    from refspec.eval.acceptance_models import AcceptanceModelError
    from refspec.eval.paper import acceptance

    if args.repeats is None:  # the default: 3, the fewest a verdict rests on; --quick 2, which its claims say
        args.repeats = 2 if args.quick else 3
    if args.repeats < 1 or args.prompt_len < 1 or args.new_tokens < 2 or args.kv_bucket < 1:
        raise UsageError("--repeats, --prompt-len, --kv-bucket must be >= 1 and --new-tokens >= 2")
    taus = {}
    for b in blocks:
        for batch, spec in b.shapes():
            for source, corpus in b.variants(batch, spec) if spec.k else ():
                if source not in sources:
                    raise UsageError(f"--sources: unknown level {source!r}; choose from {sorted(sources)}")
                try:
                    m = acceptance.resolve(sources[source], spec.name, corpus, spec.k)
                except (AcceptanceModelError, OSError) as exc:
                    raise UsageError(f"acceptance ({source}): {exc}") from None
                taus[(source, spec.name, corpus)] = m.mean_tau
    return taus


def _plan(args: argparse.Namespace, blocks: list[Any], taus: dict, profile: Any, windows: Any) -> list[dict]:
    from refspec.eval.paper.grid import plan_block

    return [plan_block(b, profile, taus, windows=windows, repeats=args.repeats, prompt_len=args.prompt_len,
                       new_tokens=args.new_tokens, host=True) for b in blocks]


def _header(args: argparse.Namespace, device: str) -> dict[str, Any]:
    import torch

    import refspec

    name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU (MODELLED: H200/H100 profiles)"
    return {"kind": "refspec paper", "date": dt.datetime.now().isoformat(timespec="seconds"), "hardware": name,
            "device": device, "torch": torch.__version__, "python": sys.version.split()[0],
            "refspec_from": str(Path(refspec.__file__).parent), "argv": sys.argv[1:], "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens, "repeats": args.repeats, "budget_s": args.budget_s}


def main(argv: list[str] | None = None) -> int:
    from refspec.eval.interrupts import sigterm_as_interrupt, unwrapped_interrupts

    args = None
    try:
        args = parser().parse_args(argv)
        check_paper_flags(args)  # before torch imports and before the plan prints
        with sigterm_as_interrupt(), unwrapped_interrupts():  # a device tool's timeout ends it like Ctrl-C
            return _main(args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        written = args is not None and _variants_written(Path(args.out))
        print("\ninterrupted: " + (f"the tables in {args.out} are complete up to the last finished variant; rerun "
                                    "into a new --out for the whole grid" if written else
                                    "no variant had finished, so no table was written"), file=sys.stderr)
        return EXIT_INTERRUPTED


def _variants_written(out: Path) -> bool:
    """Whether ``out`` holds tables of at least one finished variant (they are rewritten after each)."""
    try:
        return bool(json.loads((out / "results.json").read_text()).get("variants"))
    except (OSError, ValueError, AttributeError):
        return False


def _main(args: argparse.Namespace) -> int:
    import torch

    from refspec.eval.paper import grid
    from refspec.eval.paper.bench import ASSUMED_PERIOD_S, EXIT_MODELLED_ONLY, gpu_plan_profile

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", force=True)
    logging.getLogger("refspec.engine").setLevel(logging.ERROR)
    t_start = time.perf_counter()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA GPU is visible")
    args.device = device
    args.budget_s = args.budget_s if args.budget_s is not None else GPU_BUDGET_S if device == "cuda" else CPU_BUDGET_S
    sources = _sources(args)  # before the grid: a user level joins every block's sources
    try:
        blocks = grid.select(args)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    taus = _check(args, blocks, sources)
    check_output_dir("--out", args.out)
    if args.ledgers is not None:
        check_output_dir("--ledgers", args.ledgers)
    plans = _plan(args, blocks, taus, gpu_plan_profile(), grid.Windows.for_period(ASSUMED_PERIOD_S, args.min_window_s))
    print(f"plan on an H200 (counter period {ASSUMED_PERIOD_S * 1e3:g} ms assumed until measured):\n"
          + grid.format_plan(plans, grid.FIXED_GPU_S), flush=True)
    if args.plan_only:
        return 0
    if device == "cpu" and args.require_measured_energy:
        print("error: --require-measured-energy: a CPU run's energy is modelled (simulated counter)", file=sys.stderr)
        return EXIT_MODELLED_ONLY
    torch.set_num_threads(args.threads or (1 if device == "cpu" else torch.get_num_threads()))
    from refspec.eval.paper.execute import run_all

    with claimed(args.out):  # one command writes a folder at a time
        return run_all(args, blocks, sources, taus, plans, _header(args, device), t_start)


__all__ = ["main", "parser", "GPU_BUDGET_S", "CPU_BUDGET_S"]
