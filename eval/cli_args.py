"""Arguments of ``python -m refspec.eval``: the commands, the parser of run/sweep/report, their defaults.

The checks that run before anything heavy are in :mod:`refspec.eval.cli_checks` (torch-free)
and :mod:`refspec.eval.cli_plan` (corpora, drafters, dtypes, devices, ending in a ``Plan`` of
configurations); :mod:`refspec.eval.cli` runs the plan.
"""
from __future__ import annotations

import argparse
import logging
import textwrap
from pathlib import Path
from typing import Any, Sequence

from refspec.eval.flags import OneLineParser, add_sampling_args, output_path

log = logging.getLogger(__name__)

PROG = "python -m refspec.eval"
COMMANDS = {
    "run": "one drafter configuration against plain decoding on each corpus; one table (the default command)",
    "sweep": "a grid of configurations (corpus x batch x drafter x K), one record each, resumable, Slurm-ready",
    "report": "Markdown, plots and summary.json from a run or sweep directory, with latency targets",
    "generate": "decode prompts with a target and a drafter, print the text",
    "bench": "refspec against transformers and the bandwidth floor (decode, spec, roofline)",
    "roofline": "the analytic batch x K prediction table, plots and CSV; TP crossovers; the energy policy's K",
    "paper": "the paper's seven claims on this hardware: claims.md, claims.json, plots",
    "assets": "list, fetch, verify and convert the pinned real models (and their licences)",
    "train": "train EAGLE / EAGLE-3 / block drafter heads",
    "calibrate": "show (or with --force redo) this CPU's GEMM plan and its timings",
    "dvfs": "show the SM clocks a DVFS sweep can lock",
}
"""Every command, one line each: ``python -m refspec.eval --help`` lists them in this order."""
TOOLS = {"generate": "refspec.eval.generate", "bench": "refspec.eval.bench", "roofline": "refspec.eval.roofline_cli",
         "paper": "refspec.eval.paper.cli", "assets": "refspec.eval.assets_cli", "train": "refspec.eval.train",
         "calibrate": "refspec.eval.calibrate_cli", "dvfs": "refspec.eval.dvfs_cli"}
"""Commands with parsers of their own: ``python -m refspec.eval NAME ...`` calls ``MODULE.main`` with the rest."""
PARSED = ("run", "sweep", "report")
DEFAULT_MODEL = "smollm2-135m"
DEFAULT_CORPUS = "conversation"
DEFAULT_RUN_CELLS = (("code", 1), ("conversation", 8))
"""``run``'s default (corpus, batch) cells: code repeats its prompt, so prompt lookup pays for a
five-row verify at batch 1; conversation accepts little, and at batch 8 its verify rows cost more."""
DEFAULT_DRAFTER = "ngram"
"""The default drafter: prompt lookup needs no trained head (EAGLE / block heads must be trained first)."""
DEFAULT_BATCH = 1
"""``run``'s default batch: one user, where speculation can save (``sweep`` defaults to 1,8)."""
DEFAULT_NUM_PROMPTS = None
"""No cap: a run draws as many distinct prompts as it serves requests."""
SCHEDULES = ("continuous", "static")
DEFAULT_MAX_NEW_TOKENS = 64
CORE_CORPORA = ("conversation", "code", "math", "english", "romansh")
"""What ``--corpus all`` means: one corpus of each kind of text the paper compares."""


# ---- argument parsing ---------------------------------------------------------------------------
def top_help() -> str:
    """``python -m refspec.eval --help``: the commands, one line each, and where the rest is."""
    width = max(map(len, COMMANDS))
    return "\n".join([
        f"usage: {PROG} [COMMAND] [FLAGS]", "",
        "A pure-PyTorch reference speculative decoder with an auditable energy accounting.", "",
        f"Commands ({PROG} COMMAND --help shows a command's flags):",
        *(f"  {name:<{width}}  {text}" for name, text in COMMANDS.items()), "",
        *textwrap.wrap(f"Without a command, run runs: {PROG} --drafter eagle --batch 64 is {PROG} run --drafter "
                       "eagle --batch 64.", 100),
        *textwrap.wrap("Record fields (records.jsonl, summary.json): docs/fields.md. Corpora, their sources and "
                       f"licences: docs/corpora.md; model licences: {PROG} assets list.", 100), ""])


def _epilog() -> str:
    return (f"--corpus all means: {', '.join(CORE_CORPORA)} (name other built-ins explicitly; docs/corpora.md lists "
            "them with their licences).\n"
            "Energy: on a GPU with NVML the energy is MEASURED (Zeus, total-energy counter); elsewhere it is "
            "MODELLED by the roofline profile of the hardware, and every output says which. Record fields: "
            "docs/fields.md.")


def _drafter_help(full: bool) -> str:
    if not full:  # listing the drafters imports them (and torch); only --help shows the list
        return "none, a registered drafter (see --help), or MODULE:CLASS"
    from refspec.drafters import registry

    names = ", ".join(registry.available()) or "(none registered)"
    return f"none, a registered drafter ({names}), or MODULE:CLASS for a drafter class on the Python path"


def _add_serving(g: Any, *, sweep: bool) -> None:
    """The request stream's flags: schedule, requests, arrival rate."""
    g.add_argument("--schedule", default="continuous",
                   help=("comma-separated schedules, " if sweep else "")
                   + "continuous: --batch slots kept busy, a finished request's slot refilled with the next "
                     "request of the stream; static: lockstep batches of --batch requests that drain (for "
                     "unit comparisons)")
    g.add_argument("--requests", type=int, default=None, metavar="N",
                   help="requests served per configuration (default: 4 x batch), each a distinct corpus prompt "
                        "while the corpus has enough")
    g.add_argument("--request-rate", type=float, default=None, metavar="R",
                   help="open loop: requests arrive as a seeded Poisson process of R per second (engine clock); "
                        "default: closed loop at concurrency --batch (continuous schedule only)")
    g.add_argument("--output-len-dist", default="auto", metavar="DIST",
                   help="each request's budget below --max-new-tokens N: reference (the corpus's reference-answer "
                        "lengths, scaled so the corpus's 99th percentile maps to N), uniform:R (seeded, uniform over "
                        "[R x N, N]), fixed (N each: lockstep waves), or auto (reference where the corpus has "
                        "reference answers, else uniform:0.25); EOS still ends a request early")


def add_hardware_flags(p: argparse.ArgumentParser) -> None:
    """The hardware and measurement flags (dtype, device, meter, graphs, compile, threads, warm-up, TP, loops)."""
    h = p.add_argument_group("hardware and measurement")
    h.add_argument("--dtype", default="auto",
                   help="auto (bf16 on CUDA, fp32 on a CPU, so every greedy request equals plain decoding's: bf16 "
                        "flips near-ties), fp32, bf16 or fp16")
    h.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    h.add_argument("--meter", default="auto", metavar="SPEC",
                   help="auto (a GPU's NVML counter, else this CPU's RAPL counter, else the roofline model, labelled "
                        "modelled), zeus or nvml (NVML's counter; :gpus=0,1 sums several GPUs), rapl (CPU package "
                        "and DRAM; :domains=package,dram), roofline, roofline:PROFILE (h100, h200: time modelled "
                        "too; cpu: this CPU's benchmarked profile on measured wall time), time (no energy), or "
                        "simulated:PROFILE[:period_ms=P][:sample_ms=S][:noise=X][:seed=N]: "
                        "a counter updating every P ms (default 100) from the first S ms of each period (default "
                        "P/4), its truth the profile's modelled energy of each phase and idle power between phases, "
                        "for tests and teaching. A counter is never read per phase: phases are timed, the counter "
                        "read at the run's bounds and every :sub_window_s=W (default ten periods). With a GPU profile "
                        "the clock is modelled: a 135M model's whole run lasts about 50 ms, under one period, and "
                        "cannot be resolved; use simulated:cpu (wall time) or a large target")
    h.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="verify through CUDA graphs (default: on for CUDA, eager elsewhere)")
    h.add_argument("--compile", action="store_true",
                   help="CPU: verify and decode steps through torch.compile (opt-in; each new step shape compiles "
                        "once, a minute or more for SmolLM2; the eager step is the reference)")
    h.add_argument("--threads", default="auto",
                   help="intra-op CPU threads: a number, or auto (OMP_NUM_THREADS if set; else 1 when the load "
                        "average already reaches the core count, where threads spin against each other and a "
                        "step slows down several-fold; else every core). Each record states its threads")
    h.add_argument("--no-warmup", action="store_true", help="skip the short unrecorded warm-up generation")
    h.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor parallelism: shard the target's heads and MLP over N ranks (one GPU each, or CPU "
                        "processes with gloo); start with torchrun --nproc-per-node N -m refspec.eval ... --tp N. "
                        "Dense targets only; drafters run replicated on every rank; rank 0 writes and prints; the "
                        "ledger gives each rank's energy and the time in collectives per phase")
    h.add_argument("--phase-loops-s", type=float, default=None, metavar="S",
                   help="under a counter meter (zeus, nvml, rapl, simulated): after each configuration, run each "
                        "phase alone for S seconds at the run's shapes (at most 3600) and read the counter at the "
                        "loop's bounds, on its updates; the per-phase split's second source beside the fit over "
                        "sub-windows (default: ten counter periods, at least 1 s; 0: no loops; a shorter S runs and "
                        "the split gate refuses it)")


def add_engine_flags(g: Any, *, sweep: bool, full: bool) -> None:
    """The decoder's flags (``--model``, ``--drafter``, ``--k``, ``--spec-policy``, ``--tree``,
    ``--drafter-option``, ``--draft-model``), shared by ``run``, ``sweep`` and the server."""
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="model id (python -m refspec.eval assets list) or a Hugging Face directory with tokenizer.json")
    if sweep:
        g.add_argument("--drafter", default=DEFAULT_DRAFTER, help="comma-separated drafters; " + _drafter_help(full))
        g.add_argument("--k", default=None,
                       help="comma-separated draft lengths; 0 is the baseline (run once per corpus and batch); "
                            "default: each drafter's own K")
    else:
        g.add_argument("--drafter", default=DEFAULT_DRAFTER, help=_drafter_help(full))
        g.add_argument("--k", type=int, default=None, help="drafts per step (default: the drafter's)")
    g.add_argument("--spec-policy", default=None, metavar="SPEC", action="append" if sweep else "store",
                   help=("repeatable; a policy other than fixed runs once per drafter at the largest --k. "
                         if sweep else "") + "how many tokens to draft each step, up to --k: " + _policy_help())
    g.add_argument("--tree", action="store_true",
                   help="EAGLE-2 dynamic tree drafting (eagle, eagle3); K is then the tree's node budget")
    g.add_argument("--drafter-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a drafter option, e.g. head=/path/to/head or max_n=4 (repeatable)")
    g.add_argument("--draft-model", default=None, help="for --drafter draft-model: model id, directory or self:N")


def _add_common(p: argparse.ArgumentParser, *, sweep: bool, full: bool) -> None:
    g = p.add_argument_group("what to run")
    add_engine_flags(g, sweep=sweep, full=full)
    if sweep:
        g.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
        g.add_argument("--corpus", default=DEFAULT_CORPUS, help="comma-separated corpora, prompt .jsonl files, or all")
    else:
        g.add_argument("--batch", type=int, default=None,
                       help=f"rows decoded together (default {DEFAULT_BATCH}; with neither --batch nor --corpus: "
                            + ", ".join(f"{c} at batch {b}" for c, b in DEFAULT_RUN_CELLS)
                            + ", a case where speculation saves and one where it loses)")
        g.add_argument("--corpus", default=None,
                       help=f"corpus name, comma-separated names, a prompt .jsonl file, or all "
                            f"(default {','.join(c for c, _ in DEFAULT_RUN_CELLS)})")
    g.add_argument("--num-prompts", type=int, default=DEFAULT_NUM_PROMPTS,
                   help="at most this many distinct prompts from each corpus (default: as many as --requests; "
                        "requests beyond them repeat prompts cyclically)")
    _add_serving(g, sweep=sweep)
    g.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                   help="the budget cap N: each request's own budget is at most N (see --output-len-dist)")
    add_sampling_args(g)
    g.add_argument("--no-chat", action="store_true", help="do not render chat prompts with the chat template")
    g.add_argument("--no-baseline", action="store_true", help="skip the no-drafter baseline")
    add_hardware_flags(p)
    a = p.add_argument_group("acceptance injection")
    a.add_argument("--accept-model", default=None, metavar="NAME|FILE",
                   help="inject acceptance from a recorded distribution (vllm-eagle3-llama3.1-8b, geometric:A, or "
                        "a refspec.acceptance/1 JSON file): outputs are then labelled INJECTED")
    a.add_argument("--export-acceptance", type=output_path, default=None, metavar="FILE",
                   help="write the measured acceptance distribution of each drafter configuration to FILE")
    o = p.add_argument_group("output")
    o.add_argument("--latency-target", type=float, default=None, metavar="SECONDS",
                   help="p99 TPOT target: the report marks the lowest-energy configuration meeting it")
    o.add_argument("--out", type=output_path, default=None, metavar="DIR",
                   help="write summary.json, records.jsonl, ledger.jsonl, report.md and plots here")
    o.add_argument("--force", action="store_true",
                   help="when DIR holds a different sweep, start this one in a subfolder of DIR instead of refusing")
    o.add_argument("--per-request-metrics", type=output_path, default=None, metavar="FILE",
                   help="write one JSON line per request of every configuration to FILE: its J and J/token, output "
                        "tokens, verify steps, accepted-drafts histogram, acceptance per draft position, TTFT, TPOT "
                        "and end-to-end latency")
    o.add_argument("--no-progress", action="store_true", help="no progress bars")
    o.add_argument("--debug", action="store_true", help="show tracebacks")


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's and epilog's line breaks and shows every default (a help that says
    its own default in words is left as it is)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None and "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def parser(full_help: bool = True) -> argparse.ArgumentParser:
    """The parser of run, sweep and report; ``full_help=False`` skips the drafter list, which imports every drafter."""
    fmt = _Formatter
    p = OneLineParser(prog=PROG, description=top_help(), formatter_class=fmt, add_help=False)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser("run", help=COMMANDS["run"],
                         description="Run one drafter configuration and the no-drafter baseline at the same batch "
                                     f"on each corpus; print one table. Other commands: {PROG} --help.",
                         epilog=_epilog(), formatter_class=fmt)
    _add_common(run, sweep=False, full=full_help)
    sw = sub.add_parser("sweep", help=COMMANDS["sweep"],
                        description="Run every (corpus, batch, drafter, k) configuration; one record per "
                                    "configuration in DIR/records.jsonl; a rerun skips finished ones.",
                        epilog=_epilog(), formatter_class=fmt)
    _add_common(sw, sweep=True, full=full_help)
    s = sw.add_argument_group("cluster")
    s.add_argument("--print-sbatch", action="store_true",
                   help="write DIR/sweep.sbatch, a Slurm array running one configuration per task, and exit")
    s.add_argument("--task-index", type=int, default=None, help="run only configuration i of the plan (Slurm)")
    s.add_argument("--slurm-time", default="04:00:00", help="Slurm --time per task")
    s.add_argument("--slurm-partition", default=None, help="Slurm partition")
    s.add_argument("--slurm-gpus", type=int, default=1, help="GPUs per task")
    rep = sub.add_parser("report", help=COMMANDS["report"],
                         description="Merge DIR/records.jsonl and DIR/records/*.jsonl (Slurm tasks) and write "
                                     "DIR/report.md, DIR/summary.json and PNG plots.",
                         epilog=_epilog(), formatter_class=fmt)
    rep.add_argument("dir", type=Path, help="a run or sweep directory")
    rep.add_argument("--latency-target", type=float, default=None, metavar="SECONDS",
                     help="p99 TPOT target (default: the sweep's): per corpus, the configuration with the lowest "
                          "steady-state J/token meeting every target is chosen; the others show by how much they miss")
    rep.add_argument("--ttft-target", type=float, default=None, metavar="SECONDS",
                     help="p99 TTFT target (arrival to first token, queueing included), with or without "
                          "--latency-target")
    rep.add_argument("--frontier", action="store_true",
                     help="add the energy-latency frontier: per corpus and batch, the lowest J/token any run reached "
                          "at each median-TPOT target (fixed-K runs and policies with energy:tpot_ms=T swept)")
    rep.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def normalise_argv(argv: Sequence[str]) -> list[str]:
    """``run`` is the default command: insert it unless a command is given."""
    argv = list(argv)
    return argv if argv and argv[0] in COMMANDS else ["run", *argv]


def _policy_help() -> str:
    from refspec.policy import SPEC_HELP

    return SPEC_HELP
