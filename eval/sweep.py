"""Sweeps: a grid of configurations, one record per configuration, resumable and Slurm-ready.

A sweep plans every (corpus, batch, schedule, drafter, K) configuration; K = 0 is the baseline (no
drafter), planned once per (corpus, batch, schedule) whatever the drafters, and always planned (unless
``--no-baseline``) because every speculative figure is compared with it. Baselines come first,
so the comparison fields can be filled as soon as a speculative configuration finishes.

Records: one JSON line per finished configuration in ``DIR/records.jsonl`` (Slurm tasks write
``DIR/records/task-<i>.jsonl``), appended, flushed and fsynced as soon as the configuration
finishes, so Ctrl-C or a crash loses only the configuration in flight. A rerun reads every
records file, reports corrupt or truncated lines (and skips them), and runs only the
configurations without a record; a record appears once per configuration however often the
sweep is resumed (readers keep the last record of a ``config_id``).

Ledgers: ``DIR/ledger.jsonl`` (``DIR/ledgers/task-<i>.jsonl`` per Slurm task).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shlex
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from refspec.energy.ledger.writer import mark_aborted
from refspec.eval.records import compare_with_baseline, ensure_line_end
from refspec.eval.run import ConfigResult, RunConfig, prepare_configuration, resolve_defaults, run_configuration
from refspec.eval.session import Session

log = logging.getLogger(__name__)

RECORDS = "records.jsonl"
TASK_RECORDS_DIR = "records"
LEDGER = "ledger.jsonl"
TASK_LEDGERS_DIR = "ledgers"
SUMMARY = "summary.json"
SWEEP_META = "sweep.json"
SBATCH = "sweep.sbatch"


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


# ---- records files ----------------------------------------------------------------------------
@dataclasses.dataclass
class LoadedRecords:
    """Records read from a sweep directory.

    Attributes:
        records: the last ``status == "ok"`` record of each configuration, in first-seen order.
        corrupt: ``(file, line number, reason)`` of every line that could not be read.
        duplicates: how many records repeated a configuration already seen.
        files: the records files read.
    """

    records: list[dict[str, Any]]
    corrupt: list[tuple[str, int, str]]
    duplicates: int
    files: list[Path]

    @property
    def by_id(self) -> dict[str, dict[str, Any]]:
        return {r["config_id"]: r for r in self.records}


def records_files(out_dir: Path) -> list[Path]:
    """``DIR/records.jsonl`` and every ``DIR/records/*.jsonl`` that exist."""
    files = [out_dir / RECORDS] if (out_dir / RECORDS).is_file() else []
    task_dir = out_dir / TASK_RECORDS_DIR
    if task_dir.is_dir():
        files += sorted(task_dir.glob("*.jsonl"))
    return files


def read_records(files: Iterable[Path]) -> LoadedRecords:
    """Read records files, skipping (and reporting) corrupt lines; the last record of an id wins.

    Raises:
        OSError: a file that exists but cannot be read.
    """
    by_id: dict[str, dict[str, Any]] = {}
    corrupt: list[tuple[str, int, str]] = []
    duplicates = 0
    file_list = list(files)
    for path in file_list:
        text = path.read_bytes().decode("utf-8", errors="replace")
        for number, line in enumerate(text.split("\n"), start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                corrupt.append((str(path), number, f"not JSON ({exc.msg}); a truncated write?"))
                continue
            if not isinstance(rec, dict) or not isinstance(rec.get("config_id"), str):
                corrupt.append((str(path), number, "not a configuration record (no config_id)"))
                continue
            if rec.get("status") != "ok":
                continue
            if rec["config_id"] in by_id:
                duplicates += 1
                del by_id[rec["config_id"]]  # re-insert below, keeping the latest
            by_id[rec["config_id"]] = rec
    for path, number, reason in corrupt:
        log.warning("%s, line %d: skipped (%s)", path, number, reason)
    return LoadedRecords(records=list(by_id.values()), corrupt=corrupt, duplicates=duplicates, files=file_list)


def append_record(path: Path, record: Mapping[str, Any]) -> None:
    """Append one record as a JSON line, flushed and fsynced (a crash mid-line is repaired later)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    ensure_line_end(path)
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON through a temporary file and ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(obj, fh, indent=2)
            fh.write("\n")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file ordinary permissions
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def attach_baselines(records: Sequence[dict[str, Any]]) -> None:
    """Fill every speculative record's comparison fields from its baseline record (in place).

    Records from separate Slurm tasks meet here for the first time.
    """
    by_id = {r["config_id"]: r for r in records}
    for r in records:
        compare_with_baseline(r, by_id.get(r.get("baseline_config_id", "")))


# ---- running a plan ---------------------------------------------------------------------------
@dataclasses.dataclass
class SweepPaths:
    """Where a sweep (or one Slurm task of it) writes."""

    out_dir: Path
    records: Path
    ledger: Path

    @classmethod
    def for_task(cls, out_dir: Path, task: int | None) -> "SweepPaths":
        if task is None:
            return cls(out_dir=out_dir, records=out_dir / RECORDS, ledger=out_dir / LEDGER)
        return cls(out_dir=out_dir, records=out_dir / TASK_RECORDS_DIR / f"task-{task}.jsonl",
                   ledger=out_dir / TASK_LEDGERS_DIR / f"task-{task}.jsonl")


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


def run_plan(session: Session, configs: Sequence[RunConfig], paths: SweepPaths, *, resume: bool = True,
             on_result: Callable[[ConfigResult], None] | None = None,
             on_skip: Callable[[RunConfig], None] | None = None) -> list[dict[str, Any]]:
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
    done: dict[str, dict[str, Any]] = dict(existing)
    out: list[dict[str, Any]] = []
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
        result = run_configuration(session, cfg, ledger_path=paths.ledger, baseline=baseline)
        try:
            append_record(paths.records, result.record)
        except BaseException as exc:  # Ctrl-C or a full disk before the record landed: its runs do not count
            mark_aborted(paths.ledger, result.record["run_ids"], type(exc).__name__)
            raise
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


__all__ = ["SweepGrid", "plan", "LoadedRecords", "read_records", "records_files", "append_record",
           "write_json_atomic", "attach_baselines", "SweepPaths", "prepare_plan", "run_plan", "sbatch_script",
           "RECORDS", "LEDGER", "SUMMARY", "SWEEP_META", "SBATCH"]
