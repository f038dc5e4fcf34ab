"""Sweeps: a grid of configurations, one record per configuration, resumable and Slurm-ready.

A sweep plans every (corpus, batch, schedule, drafter, K) configuration; K = 0 is the baseline (no
drafter), planned once per (corpus, batch, schedule) whatever the drafters, and always planned (unless
``--no-baseline``) because every speculative figure is compared with it. Baselines come first,
so the comparison fields can be filled as soon as a speculative configuration finishes.

Records (:mod:`refspec.eval.record`): one JSON line per finished configuration in
``DIR/records.jsonl`` (Slurm tasks write ``DIR/records/task-<i>.jsonl``), appended, flushed and
fsynced as soon as the configuration finishes, so Ctrl-C or a crash loses only the configuration
in flight. A rerun reads every records file, reports corrupt or truncated lines (and skips
them), and runs only the configurations without a record; a record appears once per
configuration however often the sweep is resumed (readers keep the last record of a ``config_id``).

Ledgers: ``DIR/ledger.jsonl`` (``DIR/ledgers/task-<i>.jsonl`` per Slurm task).
"""
from __future__ import annotations

import dataclasses
import logging
import shlex
from pathlib import Path
from typing import Callable, Mapping, Sequence

from refspec.eval.outputs import RunPaths
from refspec.eval.record import RunRecord
from refspec.eval.record_files import read_records, records_files
from refspec.eval.run import ConfigResult, prepare_configuration, resolve_defaults, run_configuration
from refspec.eval.run_config import RunConfig
from refspec.eval.session import Session

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SweepGrid:
    """The axes of a sweep plus the settings every configuration shares.

    Attributes:
        corpora: corpus names or prompt files.
        batches: batch sizes.
        drafters: drafter names (``none`` entries are ignored: K = 0 is the baseline).
        ks: draft lengths; 0 plans the baseline; None means each drafter's default K.
        base: settings shared by every configuration (its drafter, k, batch and corpus are
            replaced per configuration).
        baseline: plan the no-drafter baseline at every (corpus, batch).
        default_k: each drafter's default K (used when ``ks`` is None).
        schedules: ``continuous`` and/or ``static`` (None: the base configuration's).
        policies: speculation policy specs; ``fixed`` runs at every K, any other policy once
            per drafter at the largest K (its ceiling).
    """

    corpora: tuple[str, ...]
    batches: tuple[int, ...]
    drafters: tuple[str, ...]
    ks: tuple[int, ...] | None
    base: RunConfig
    baseline: bool = True
    default_k: Mapping[str, int] = dataclasses.field(default_factory=dict)
    schedules: tuple[str, ...] | None = None
    policies: tuple[str, ...] = ("fixed",)


def plan(grid: SweepGrid) -> list[RunConfig]:
    """Every configuration of ``grid`` in run order: per corpus, batch and schedule, baseline first.

    Duplicates (e.g. the same drafter listed twice) are planned once.
    """
    out: list[RunConfig] = []
    seen: set[str] = set()

    def add(cfg: RunConfig) -> None:
        if cfg.config_id not in seen:
            seen.add(cfg.config_id)
            out.append(cfg)

    drafters = [d for d in grid.drafters if d != "none"]
    cells = [dataclasses.replace(grid.base, corpus=corpus, batch=batch, schedule=schedule)
             for corpus in grid.corpora for batch in grid.batches
             for schedule in (grid.schedules or (grid.base.schedule,))]
    for cell in cells:
        if grid.baseline or (grid.ks is not None and 0 in grid.ks):
            add(cell.baseline())
        for drafter in drafters:
            ks = grid.ks if grid.ks is not None else (grid.default_k.get(drafter, 4),)
            for k in ks:
                if k == 0 or "fixed" not in grid.policies:
                    continue
                add(dataclasses.replace(cell, drafter=drafter, k=k))
            for policy in (p for p in grid.policies if p != "fixed" and max(ks) > 0):
                add(dataclasses.replace(cell, drafter=drafter, k=max(ks), spec_policy=policy))
    return out


# ---- running a plan ---------------------------------------------------------------------------
def prepare_plan(session: Session, configs: Sequence[RunConfig], out_dir: Path | None) -> list[RunConfig]:
    """``configs`` with defaults resolved, every one not yet done in ``out_dir`` checked (model context included).

    Raises:
        UsageError, DrafterError, CorpusError, ...: the first configuration that could not run.
    """
    resolved = [resolve_defaults(session, c) for c in configs]
    done = read_records(records_files(out_dir)).by_id if out_dir is not None else {}
    for cfg in resolved:
        if cfg.config_id not in done:
            prepare_configuration(session, cfg)
    return resolved


def run_plan(session: Session, configs: Sequence[RunConfig], paths: RunPaths, *, resume: bool = True,
             on_result: Callable[[ConfigResult], None] | None = None,
             on_skip: Callable[[RunConfig], None] | None = None) -> list[RunRecord]:
    """Run ``configs`` in order, appending each record as soon as it finishes.

    Args:
        session: shared target and meter.
        configs: the plan.
        paths: records and ledger files.
        resume: skip configurations that already have a record in ``paths.out_dir``.
        on_result: called after each finished configuration (after its record is on disk).
        on_skip: called for each configuration skipped because it is done.

    Returns:
        The records of ``configs`` (finished now or earlier), in plan order.
    """
    existing = read_records(records_files(paths.out_dir)).by_id if resume else {}
    done: dict[str, RunRecord] = dict(existing)
    out: list[RunRecord] = []
    for cfg in configs:  # fail on a bad drafter, corpus or injection before anything runs
        if cfg.config_id not in done:
            prepare_configuration(session, cfg)
    for cfg in configs:
        if cfg.config_id in done and resume:
            log.info("%s: already done (%s), skipped", cfg.label, cfg.config_id)
            if on_skip is not None:
                on_skip(cfg)
            out.append(done[cfg.config_id])
            continue
        baseline = None if cfg.is_baseline else done.get(cfg.baseline().config_id)
        # its record lands inside: an interruption before that marks its ledger runs aborted
        result = run_configuration(session, cfg, ledger_path=paths.ledger, records_path=paths.records,
                                   baseline=baseline)
        done[cfg.config_id] = result.record
        out.append(result.record)
        if on_result is not None:
            on_result(result)
    return out


# ---- Slurm --------------------------------------------------------------------------------------
def sbatch_script(*, sweep_argv: Sequence[str], num_tasks: int, out_dir: Path, time_limit: str = "04:00:00",
                  partition: str | None = None, gpus: int = 1, cpus: int = 8, python: str = "python",
                  tp: int = 1) -> str:
    """A Slurm array script: task i runs configuration i of the same sweep.

    Args:
        sweep_argv: the sweep's arguments (without ``--print-sbatch`` and ``--task-index``).
        num_tasks: configurations in the plan.
        out_dir: the sweep directory (records land in ``out_dir/records/task-<i>.jsonl``).
        time_limit: Slurm ``--time``.
        partition: Slurm partition, or None for the cluster default.
        gpus: GPUs per task.
        cpus: CPU cores per task.
        python: the interpreter to run.
        tp: tensor-parallel ranks: each task then runs ``torchrun --nproc-per-node tp`` on one node
            with ``--gpus-per-task tp`` (its ``--tp`` is in ``sweep_argv``).
    """
    args = " ".join(shlex.quote(a) for a in sweep_argv)
    out = shlex.quote(str(out_dir.resolve()))
    lines = ["#!/bin/bash",
             "# refspec sweep: one configuration per array task; merge with",
             f"#   python -m refspec.eval report {out}",
             "#SBATCH --job-name=refspec-sweep",
             f"#SBATCH --array=0-{num_tasks - 1}",
             f"#SBATCH --time={time_limit}",
             f"#SBATCH --cpus-per-task={cpus}",
             f"#SBATCH --output={out}/slurm/%A_%a.out"]
    if tp > 1:  # one task of tp ranks on one node, a GPU each (torchrun starts the ranks)
        lines += ["#SBATCH --nodes=1", "#SBATCH --ntasks=1", f"#SBATCH --gpus-per-task={tp}"]
    elif gpus > 0:
        lines.append(f"#SBATCH --gres=gpu:{gpus}")
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    lines += ["set -euo pipefail",
              f"mkdir -p {out}/slurm",
              (f"torchrun --standalone --nproc-per-node {tp}" if tp > 1 else python)
              + f" -m refspec.eval sweep {args} --task-index \"$SLURM_ARRAY_TASK_ID\"",
              ""]
    return "\n".join(lines)


__all__ = ["SweepGrid", "plan", "prepare_plan", "run_plan", "sbatch_script"]
