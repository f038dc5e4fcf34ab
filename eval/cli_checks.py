"""Checks of ``python -m refspec.eval`` run/sweep/report flags that need no torch and no model.

They run first, so a bad number, list, combination or path fails in a fraction of a second,
before anything heavy imports and before ``--out`` is touched. Checks that need torch or the
drafter registry (device, dtype, drafter names) follow in :func:`refspec.eval.cli_plan.build_plan`.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Sequence

from refspec.energy.meters.spec import KINDS, MeterSpecError, parse_meter_spec
from refspec.eval.flags import UsageError, check_sampling, finite, int_list, integer
from refspec.eval.outputs import LEDGER, RECORDS, REPORT, SUMMARY, SWEEP_META, check_output, check_output_dir

METERS = KINDS
# The options each built-in drafter reads (its register_builtin); anything else would be stored
# in the record without having run. ``tree``/``tree_budget`` come from --tree and K.
BUILTIN_OPTIONS: dict[str, tuple[str, ...]] = {
    "ngram": ("max_n", "min_n", "trim"),
    "draft-model": ("draft_model",),
    "eagle": ("head", "tree", "tree_budget", "tree_topk", "tree_depth"),
    "eagle3": ("head", "tree", "tree_budget", "tree_topk", "tree_depth"),
    "block": ("head",),
}


def csv(flag: str, text: str) -> list[str]:
    """Comma-separated names; an empty list names ``flag``."""
    items = [x.strip() for x in str(text).split(",") if x.strip()]
    if not items:
        raise UsageError(f"{flag} is empty (got {text!r}); give one or more comma-separated names")
    return items


def parse_drafter_options(items: Sequence[str], draft_model: str | None = None) -> tuple[tuple[str, str], ...]:
    """``--drafter-option KEY=VALUE`` items (and ``--draft-model``) as sorted pairs."""
    opts: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--drafter-option expects KEY=VALUE, got {item!r}; e.g. --drafter-option max_n=4")
        opts[key.strip()] = value.strip()
    if draft_model is not None:
        if not draft_model.strip():
            raise UsageError("--draft-model is empty; give a model id, a directory or self:N")
        opts["draft_model"] = draft_model
    return tuple(sorted(opts.items()))


def check_drafter_options(drafters: Sequence[str], options: Sequence[tuple[str, str]]) -> None:
    """Refuse options no listed built-in drafter reads (plug-ins are checked against their class later)."""
    keys = {k for k, _ in options}
    if not keys:
        return
    takers = [d for d in drafters if d != "none"]
    if not takers:
        raise UsageError(f"--drafter-option/--draft-model {sorted(keys)} given without a drafter; add --drafter NAME")
    for d in takers:
        if d not in BUILTIN_OPTIONS:
            continue
        unknown = sorted(keys - set(BUILTIN_OPTIONS[d]))
        if "draft_model" in unknown:
            raise UsageError(f"--draft-model is for --drafter draft-model; drafter {d} takes none "
                             f"(its options: {', '.join(BUILTIN_OPTIONS[d])})")
        if unknown:
            raise UsageError(f"--drafter-option {unknown[0]!r}: drafter {d} does not take it; it takes "
                             f"{', '.join(BUILTIN_OPTIONS[d])}")


def check_meter(meter: str) -> None:
    """The ``--meter`` spec parses (:func:`refspec.energy.meters.spec.parse_meter_spec`)."""
    if meter.partition(":")[0].lower() not in KINDS:
        raise UsageError(f"--meter {meter!r} is unknown; use {', '.join(KINDS)} (e.g. roofline:h200, "
                         f"simulated:cpu:period_ms=100:sample_ms=25)")
    try:
        parse_meter_spec(meter)
    except MeterSpecError as exc:
        raise UsageError(f"--meter {meter!r}: {exc}") from None


def _corpus_files(corpus: str | None) -> list[Path]:
    """The prompt files among ``--corpus``'s names (inputs no output may replace)."""
    names = [x.strip() for x in str(corpus or "").split(",") if x.strip()]
    return [Path(n).expanduser() for n in names if n.endswith((".jsonl", ".json")) or "/" in n]


def check_outputs(args: argparse.Namespace) -> None:
    """``--out`` can become the output directory, and each output file can be written: not a directory or a
    link, not an input of the command (a prompt file, an acceptance file), not a file the command already writes."""
    own: list[Path] = []
    if args.out is not None:
        check_output_dir("--out", args.out)
        own = [args.out / n for n in (RECORDS, LEDGER, SUMMARY, SWEEP_META, REPORT)]
    inputs = [*_corpus_files(args.corpus), *([Path(args.accept_model)] if args.accept_model else [])]
    for flag, path in (("--export-acceptance", args.export_acceptance),
                       ("--per-request-metrics", getattr(args, "per_request_metrics", None))):
        if path is not None:
            check_output(flag, path, inputs=inputs, others=own)
            own.append(path)
    if args.export_acceptance is not None and args.export_acceptance.is_file():
        _check_earlier_export(args.export_acceptance)


ACCEPTANCE_SCHEMA = "refspec.acceptance/1"
PHASE_LOOPS_MAX_S = 3600.0
"""Longest phase loop a run may ask for, s: the gate's floor is ten counter periods of at most 60 s."""


def _check_earlier_export(path: Path) -> None:
    """An existing ``--export-acceptance`` file is one this command wrote (its models are merged, never lost)."""
    try:
        schema = json.loads(path.read_text(encoding="utf-8")).get("schema")
    except (OSError, ValueError, AttributeError):
        schema = None
    if schema != ACCEPTANCE_SCHEMA:
        raise UsageError(f"--export-acceptance {path} exists and is not a {ACCEPTANCE_SCHEMA} file; choose another "
                         f"file (an export merges into its own earlier file only)")


def check_run_flags(args: argparse.Namespace, *, sweep: bool) -> tuple[list[int], list[int] | None]:
    """Every flag of ``run``/``sweep`` that needs no torch; returns the batches and the K list (None: defaults)."""
    if args.num_prompts is not None:  # None: as many distinct prompts as requests
        integer("--num-prompts", args.num_prompts, low=1)
    integer("--max-new-tokens", args.max_new_tokens, low=1, high=1_000_000)
    check_sampling(args)
    if args.latency_target is not None:
        finite("--latency-target", args.latency_target, low=0, low_open=True, fix="a p99 TPOT in seconds, e.g. 0.05")
    check_meter(args.meter)
    if getattr(args, "phase_loops_s", None) is not None:
        finite("--phase-loops-s", args.phase_loops_s, low=0, high=PHASE_LOOPS_MAX_S,
               fix="seconds per loop, or 0 for none (the longest counter period, 60 s, needs 600)")
    if args.threads != "auto":
        try:
            threads = int(args.threads)
        except ValueError:
            raise UsageError(f"--threads expects a number or auto, got {args.threads!r}") from None
        integer("--threads", threads, low=1)
        if threads > THREADS_MAX:
            raise UsageError(f"--threads {threads} is more than {THREADS_MAX} threads; give at most the cores to use")
    if sweep:
        batches = int_list("--batch", args.batch, low=1)
        ks = int_list("--k", args.k, low=0) if args.k is not None else None
    else:
        batches = [] if args.batch is None else [integer("--batch", args.batch, low=1)]  # []: the default cells
        ks = None if args.k is None else [integer("--k", args.k, low=0)]
    _check_rows(args, batches)
    drafters = csv("--drafter", args.drafter)
    if args.corpus is not None:
        csv("--corpus", args.corpus)
    if args.dtype.lower() not in ("auto", "fp32", "float32", "bf16", "bfloat16", "fp16", "float16"):
        raise UsageError(f"--dtype {args.dtype!r} is unknown; use auto, fp32, bf16 or fp16")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", args.device):
        raise UsageError(f"--device {args.device!r} is not a device; use auto, cpu, cuda or cuda:N")
    if not sweep and ks == [0] and drafters != ["none"]:
        raise UsageError(f"--k 0 with --drafter {args.drafter}: run always adds the no-drafter baseline; give "
                         f"--k >= 1 for the drafter, or --drafter none for the baseline alone")
    if not sweep and drafters == ["none"] and ks not in (None, [0]):
        raise UsageError(f"--k {args.k} needs a drafter: --drafter none is plain decoding (drop --k or name one)")
    check_drafter_options(drafters, parse_drafter_options(args.drafter_option, args.draft_model))
    _check_combinations(args, drafters, sweep=sweep)
    check_outputs(args)
    return batches, ks


THREADS_MAX = 4096
"""Most --threads (torch starts that many OpenMP threads)."""
BATCH_MAX = 4096
"""Most rows of one batch (each row holds a KV cache of the whole context)."""


def _check_rows(args: argparse.Namespace, batches: Sequence[int]) -> None:
    """No batch beyond :data:`BATCH_MAX` or beyond the requests the run serves (rows that never hold one)."""
    for batch in batches:
        integer("--batch", batch, low=1, high=BATCH_MAX)
        if args.requests is not None and batch > args.requests:
            raise UsageError(f"--batch {batch} exceeds --requests {args.requests}: the extra rows would never hold a "
                             f"request; use --batch {args.requests} or more --requests")


def _check_combinations(args: argparse.Namespace, drafters: Sequence[str], *, sweep: bool) -> None:
    if args.tree and any(d not in ("eagle", "eagle3", "none") for d in drafters):
        raise UsageError("--tree is EAGLE-2 dynamic tree drafting: use it with --drafter eagle or eagle3")
    if args.accept_model and args.export_acceptance:
        raise UsageError("--export-acceptance with --accept-model would export the injected distribution; "
                         "export from a run without injection")
    if args.accept_model and all(d == "none" for d in drafters):
        raise UsageError("--accept-model needs a drafter (k >= 1): add --drafter NAME")
    if args.accept_model and args.tree:
        raise UsageError("--accept-model injects chain acceptance only; drop --tree")
    if args.spec_policy and all(d == "none" for d in drafters):
        given = args.spec_policy if isinstance(args.spec_policy, str) else ",".join(args.spec_policy)
        raise UsageError(f"--spec-policy {given} chooses each step's K of a drafter; --drafter none drafts nothing "
                         f"(drop --spec-policy or name a drafter)")
    if args.no_baseline and all(d == "none" for d in drafters):
        raise UsageError("--no-baseline with --drafter none leaves nothing to run")
    if sweep:
        integer("--slurm-gpus", args.slurm_gpus, low=0)
        if args.task_index is not None:
            integer("--task-index", args.task_index, low=0)
        if (args.print_sbatch or args.task_index is not None) and args.out is None:
            raise UsageError("--print-sbatch and --task-index need --out DIR (the tasks share it)")


def check_report_flags(args: argparse.Namespace) -> None:
    if args.latency_target is not None:
        finite("--latency-target", args.latency_target, low=0, low_open=True, fix="a p99 TPOT in seconds, e.g. 0.05")
    if getattr(args, "ttft_target", None) is not None:
        finite("--ttft-target", args.ttft_target, low=0, low_open=True, fix="a p99 TTFT in seconds, e.g. 1.0")
    if not args.dir.is_dir():
        raise UsageError(f"report {args.dir}: not a directory; give a run or sweep --out directory")


__all__ = ["check_run_flags", "check_report_flags", "parse_drafter_options", "check_drafter_options", "csv",
           "check_outputs", "BUILTIN_OPTIONS", "METERS"]
