"""``python -m refspec.eval``: evaluate speculative decoding against its no-drafter baseline.

``python -m refspec.eval --help`` lists every command; three are parsed here::

    python -m refspec.eval [run] --drafter ngram --batch 8 --corpus conversation --out DIR
    python -m refspec.eval sweep --batch 1,8,64 --k 0,2,4,8 --drafter ngram,eagle,block --corpus all --out DIR
    python -m refspec.eval report DIR --latency-target 0.05

``run`` (the default) runs one drafter configuration and the baseline at the same batch on
each corpus and prints one table; ``sweep`` runs a grid, one record per configuration,
resumable, optionally as a Slurm array (``--print-sbatch``); ``report`` renders Markdown and
plots from a directory of records. Files under ``--out DIR``: ``summary.json``,
``records.jsonl``, ``ledger.jsonl`` (the audit trail), ``report.md``, PNG plots and
``sweep.json``. A DIR holds one sweep definition (:mod:`refspec.eval.sweep_dir`) and one running
command at a time (:func:`refspec.eval.outputs.claimed`): another definition is refused
(``--force``: a subfolder), and so is a second command while the first holds the lock. The
others (``generate``, ``bench``, ``paper``, ...) have their own parsers (:data:`refspec.eval.cli_args.TOOLS`).

Every flag is checked before anything heavy loads (:mod:`refspec.eval.cli_checks`); a bad one
prints one ``error:`` line naming it and exits 2, leaving nothing behind; Ctrl-C exits 130.

Only the command-line modules (this one, cli_report and the tools' ``main``) print; everything
they call logs.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

from refspec.eval.cli_args import TOOLS, normalise_argv, parser, top_help
from refspec.eval.cli_plan import Plan, build_plan
from refspec.eval.flags import EXIT_INTERRUPTED, EXIT_USAGE, UsageError, one_line
from refspec.eval.interrupts import (forget_handled_interrupt, import_holding_interrupts, import_torch,
                                     sigterm_as_interrupt, stdout_outlives_reader, unwrapped_interrupts)
from refspec.eval.outputs import LOCK, SBATCH, SUMMARY, SWEEP_META, RunPaths, claimed, scratch, write_atomic, write_json
from refspec.eval.sweep_dir import definition_id, resolve_out, write_meta

log = logging.getLogger(__name__)


# ---- running ------------------------------------------------------------------------------------
@contextlib.contextmanager
def _out_dir(path: Path | None, lock: str = LOCK) -> Iterator[tuple[Path, bool]]:
    """The output directory, locked (:func:`refspec.eval.outputs.claimed`), or a temporary one when none was given."""
    if path is not None:
        with claimed(path, lock=lock) as out:
            yield out, True
        return
    with scratch() as tmp:
        yield tmp, False


class _AcceptanceExporter:
    """Collects generations per (drafter, corpus, K) and rewrites the export file (atomically) after each.

    The models already in the file (an earlier run of a resumed sweep) are kept unless this run
    measures the same (drafter, corpus, K, model) again, so the file covers every resume.
    """

    def __init__(self, path: Path | None, command: str) -> None:
        self.path = path
        self.command = command
        self._gens: dict[tuple[str, str, int], list[Any]] = {}
        self._meta: dict[tuple[str, str, int], dict[str, Any]] = {}
        self._earlier: list[Any] = []
        if path is not None and path.exists():
            from refspec.eval.injection import load_acceptance_models

            self._earlier = load_acceptance_models(path)  # checked as one before any work (check_outputs)

    def add(self, result: Any) -> None:
        r = result.record
        if self.path is None or r.is_baseline or r.tree or r.acceptance_injected:
            return
        from refspec.eval.injection import AcceptanceModel, save_acceptance_models

        key = (r.drafter, r.corpus, r.k)
        self._gens.setdefault(key, []).extend(result.generations)
        meta = self._meta.setdefault(key, {"prompts": r.stream.requests_unique, "batches": set(), "model": r.model})
        meta["batches"].add(r.batch)
        models = []
        fresh = {(d, c, k, self._meta[(d, c, k)]["model"]) for d, c, k in self._gens}
        models += [m for m in self._earlier if (m.drafter, m.corpus, m.k, m.provenance.source_model) not in fresh]
        for (drafter, corpus, k), gens in self._gens.items():
            m = self._meta[(drafter, corpus, k)]
            models.append(AcceptanceModel.from_generation(
                gens, k, name=f"{drafter}-{Path(corpus).stem}-{Path(m['model']).name}-k{k}", drafter=drafter,
                corpus=corpus, source_model=m["model"], prompts=m["prompts"], source=self.command,
                notes=f"batches {sorted(m['batches'])}; {m['prompts']} distinct prompts over the requests "
                      f"(they repeat only beyond them)"))
        save_acceptance_models(self.path, models)


def _task_configs(args: argparse.Namespace, configs: Sequence[Any], *, sweep: bool) -> list[Any]:
    """The configurations this invocation runs: the plan, or one Slurm task's configuration."""
    if not (sweep and args.task_index is not None):
        return list(configs)
    if not 0 <= args.task_index < len(configs):
        raise UsageError(f"--task-index {args.task_index} is outside the plan's 0..{len(configs) - 1}")
    return [configs[args.task_index]]


def _write_sbatch(args: argparse.Namespace, plan: Plan, argv: Sequence[str], out_dir: Path,
                  meta: dict[str, Any]) -> int:
    """Write the Slurm array script of the sweep and say how to submit and merge it."""
    from refspec.eval.sweep import sbatch_script

    task_argv = _strip(argv, ("--print-sbatch",), ("--task-index", "--out", "--export-acceptance"))
    task_argv += ["--out", str(out_dir.resolve()), "--no-progress"]
    path = out_dir / SBATCH
    (out_dir / "slurm").mkdir(exist_ok=True)  # Slurm opens --output before the script runs
    write_atomic(path, sbatch_script(sweep_argv=task_argv[1:], num_tasks=len(plan.configs), out_dir=out_dir,
                                     time_limit=args.slurm_time, partition=args.slurm_partition, gpus=args.slurm_gpus,
                                     tp=args.tp))
    write_json(out_dir / SWEEP_META, meta)
    print(f"wrote {path}: a Slurm array of {len(plan.configs)} tasks, one configuration each")
    print(f"submit with: sbatch {path}")
    print(f"then merge with: python -m refspec.eval report {out_dir}")
    return 0


def _writes_summary(args: argparse.Namespace, *, sweep: bool, keep: bool) -> bool:
    """Whether this invocation keeps ``summary.json`` and the report (Slurm tasks leave both to ``report``)."""
    from refspec.eval.tp_launch import writes_files

    return keep and not (sweep and args.task_index is not None) and writes_files()


def _run_configs(args: argparse.Namespace, session: Any, configs: Sequence[Any], paths: RunPaths, *, sweep: bool,
                 keep: bool, command: str) -> tuple[list[Any] | None, list[str], Any]:
    """Run ``configs``, keeping ``summary.json`` current; returns the records (None when
    interrupted), the ids skipped as done, and the records read before the run."""
    from tqdm.auto import tqdm

    from refspec.eval.baseline import attach_baselines
    from refspec.eval.cli_report import note_corrupt
    from refspec.eval.record_files import read_records, records_files, summary_json
    from refspec.eval.sweep import run_plan

    summary = _writes_summary(args, sweep=sweep, keep=keep)
    existing = read_records(records_files(paths.out_dir)) if sweep else None
    known = existing.by_id if existing is not None else {}
    note_corrupt(existing.corrupt if existing is not None else ())
    exporter = _AcceptanceExporter(args.export_acceptance, command)
    skipped: list[str] = []
    bar = tqdm(total=len(configs), unit="config", desc="configurations", file=sys.stderr,
               disable=args.no_progress or len(configs) < 2, dynamic_ncols=True)

    def on_result(result: Any) -> None:
        exporter.add(result)
        bar.update(1)
        known[result.record.config_id] = result.record
        if summary:
            mine = attach_baselines([known[c.config_id] for c in configs if c.config_id in known])
            write_json(paths.out_dir / SUMMARY, summary_json(mine))

    def on_skip(cfg: Any) -> None:
        skipped.append(cfg.config_id)
        bar.update(1)

    try:
        with _logging_to_tqdm(), unwrapped_interrupts():
            records = run_plan(session, configs, paths, resume=sweep, on_result=on_result, on_skip=on_skip)
    except KeyboardInterrupt:
        bar.close()
        print(_interrupted_line(configs, paths, keep=keep, sweep=sweep), file=sys.stderr)
        return None, skipped, existing
    bar.close()
    return records, skipped, existing


def _interrupted_line(configs: Sequence[Any], paths: RunPaths, *, keep: bool, sweep: bool) -> str:
    """What an interruption leaves: the configurations of this plan whose records are on disk."""
    if not keep:
        return "\ninterrupted: no --out DIR was given, so nothing was kept"
    from refspec.eval.record_files import read_records

    on_disk = read_records([paths.records]).by_id if paths.records.exists() else {}
    saved = sum(c.config_id in on_disk for c in configs)
    return (f"\ninterrupted: {saved} of {len(configs)} configuration(s) saved in {paths.records}; "
            f"run the same command again to {'resume' if sweep else 'redo'}")


def _execute(args: argparse.Namespace, *, sweep: bool, argv: Sequence[str]) -> int:
    from refspec.eval.cli_checks import check_run_flags
    from refspec.eval.cli_plan import check_serving_flags
    from refspec.eval.tp_launch import check_tp_flags

    check_serving_flags(args, sweep=sweep)  # the torch-free checks, before a process group forms under torchrun
    check_run_flags(args, sweep=sweep)
    check_tp_flags(args)
    import_torch()
    from refspec.eval.tp_launch import rank_out, start as start_tp

    start_tp(args)  # torchrun ... --tp N: join the group; ranks other than 0 go quiet (refspec.eval.tp_launch)
    plan = build_plan(args, sweep=sweep)
    command = "python -m refspec.eval " + " ".join(shlex.quote(a) for a in argv)
    configs = _task_configs(args, plan.configs, sweep=sweep)
    ids = [c.config_id for c in plan.configs]
    definition = definition_id(ids)
    out = None if plan.out_dir is None else resolve_out(plan.out_dir, definition, ids, force=args.force)
    if out is not None and out != plan.out_dir:
        print(f"note: {plan.out_dir} holds another sweep; --force: this one writes to {out}", file=sys.stderr)
    meta = {"command": command, "argv": list(argv), "latency_target_s": args.latency_target, "configs": ids,
            "definition": definition}
    task = args.task_index if sweep else None
    if sweep and args.print_sbatch:  # the tasks' records, not this plan, then say what the directory holds
        with _out_dir(out) as (out_dir, _):
            return _write_sbatch(args, plan, argv, out_dir, {**meta, "definition": None, "sbatch": True})
    out = rank_out(out)  # ranks other than 0 write into a scratch copy of the records
    apply_threads(args.threads)
    with _out_dir(out, LOCK if task is None else f".task-{task}.lock") as (out_dir, keep):
        return _run_and_report(args, plan, configs, out_dir, meta, keep=keep, sweep=sweep, command=command)


def _run_and_report(args: argparse.Namespace, plan: Plan, configs: Sequence[Any], out_dir: Path,
                    meta: dict[str, Any], *, keep: bool, sweep: bool, command: str) -> int:
    from refspec.eval.baseline import attach_baselines
    from refspec.eval.record_files import summary_json
    from refspec.eval.report import format_table, write_report
    from refspec.eval.session import Session
    from refspec.eval.sweep import prepare_plan

    started = time.perf_counter()
    task = args.task_index if sweep else None
    session = Session(**plan.session_kwargs)
    # every configuration is checked (model context included) before the first runs or anything is written
    configs = prepare_plan(session, configs, out_dir if sweep else None)
    if task is None and keep:
        write_meta(out_dir, meta)
    paths = RunPaths.for_task(out_dir, task)
    summary = _writes_summary(args, sweep=sweep, keep=keep)
    records, skipped, existing = _run_configs(args, session, configs, paths, sweep=sweep, keep=keep, command=command)
    if records is None:
        return EXIT_INTERRUPTED
    records = attach_baselines(records)
    if summary:
        write_json(out_dir / SUMMARY, summary_json(records))
    print(format_table(records))
    if skipped:
        print(f"\n{len(skipped)} configuration(s) were already done and skipped (resume).")
    if summary:
        rep = write_report(out_dir, records, latency_target_s=args.latency_target,
                           corrupt=existing.corrupt if existing else (),
                           ledgers=[paths.ledger] if paths.ledger.exists() else [])
        print(f"\nwrote {out_dir}: {SUMMARY}, {paths.records.name}, {paths.ledger.name}, {rep.markdown.name}, "
              + ", ".join(p.name for p in rep.plots))
    elif keep:
        print(f"\nwrote {paths.records} and {paths.ledger}")
    if args.export_acceptance is not None:
        print(f"wrote acceptance distributions to {args.export_acceptance}")
    if args.per_request_metrics is not None:
        from refspec.eval.report_requests import write_request_metrics

        lines = write_request_metrics(args.per_request_metrics, records)
        print(f"wrote {lines} per-request lines to {args.per_request_metrics}")
    print(f"wall time {time.perf_counter() - started:.1f} s")
    return 0


def _strip(argv: Sequence[str], flags: Sequence[str], options: Sequence[str]) -> list[str]:
    """``argv`` without the given flags and options (``--opt V`` and ``--opt=V``)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in flags:
            continue
        if a in options:
            skip = True
            continue
        if any(a.startswith(o + "=") for o in options):
            continue
        out.append(a)
    return out


def apply_threads(requested: str) -> None:
    """Set intra-op threads from ``--threads`` (``auto`` or a checked count; see its help); say on stderr
    when ``auto`` chose one thread on a busy machine (every command of the eval and the server)."""
    import os

    import torch

    from refspec.eval.runtime import set_threads

    if requested != "auto":
        torch.set_num_threads(int(requested))  # checked by cli_checks
        return
    if "OMP_NUM_THREADS" in os.environ:
        set_threads()  # keeps the user's setting
        return
    cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    if cores > 1 and load >= cores:
        torch.set_num_threads(1)
        print(f"note: load average {load:.1f} on {cores} cores: other jobs compete for the CPU, so timings are "
              f"noisy; running 1 thread (threads spinning against each other would be several times slower). "
              f"Pass --threads {cores} to override.", file=sys.stderr)
    else:
        set_threads()


@contextlib.contextmanager
def _logging_to_tqdm() -> Iterator[None]:
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm():
        yield


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (2 for usage errors, 130 when interrupted)."""
    raw = list(sys.argv[1:] if argv is None else argv)
    try:
        with sigterm_as_interrupt(), stdout_outlives_reader():
            code = _dispatch(raw)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        code = EXIT_INTERRUPTED
    if code == EXIT_INTERRUPTED:
        forget_handled_interrupt()  # else CPython may still die of SIGINT at exit instead of exiting 130
    return code


def _dispatch(raw: list[str]) -> int:
    if raw and raw[0] in ("-h", "--help"):
        print(top_help(), end="")
        return 0
    if raw and raw[0] in TOOLS:
        import importlib

        import_holding_interrupts(TOOLS[raw[0]])  # some tools import torch at their top
        return int(importlib.import_module(TOOLS[raw[0]]).main(raw[1:]) or 0)
    return _main(raw)


def _main(raw: list[str]) -> int:
    norm = normalise_argv(raw)
    try:
        args = parser(full_help=any(a in ("-h", "--help") for a in norm)).parse_args(norm)
    except SystemExit as exc:  # argparse exits 2 on bad flags (after one line), 0 on --help
        return int(exc.code or 0)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        with unwrapped_interrupts():  # else an interrupt wrapped on its way up reads as an error
            if args.command == "report":
                from refspec.eval.cli_report import report

                return report(args)
            return _execute(args, sweep=args.command == "sweep", argv=norm)
    except (UsageError, ValueError, RuntimeError, OSError) as exc:  # the refspec errors derive from these
        if getattr(args, "debug", False):
            raise
        from refspec.eval.tp_launch import prints_error

        if prints_error(exc):  # under --tp: rank 0, or the rank whose collective failed
            print(f"error: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE


__all__ = ["main", "apply_threads"]
