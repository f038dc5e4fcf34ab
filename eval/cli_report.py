"""``python -m refspec.eval report DIR``: Markdown, plots and ``summary.json`` from a directory of records.

Every record is read (its version, the fields the report needs) before anything in DIR is
rewritten, so a foreign or hand-cut record fails with one line and leaves DIR as it was; the
report holds DIR's lock while it writes (a sweep still writing there is waited for, not mixed
with). ``--latency-target`` (p99 TPOT) and ``--ttft-target`` (p99 TTFT) choose per corpus the
lowest steady-state J/token configuration meeting both; where none does, a ``note:`` line says
so and the exit status stays 0 (the report shows every miss).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Sequence

from refspec.energy.accounting.latency import Targets
from refspec.eval.baseline import attach_baselines
from refspec.eval.cli_checks import check_report_flags
from refspec.eval.flags import UsageError
from refspec.eval.outputs import LEDGER, SUMMARY, SWEEP_META, TASK_LEDGERS_DIR, claimed, write_json
from refspec.eval.record import RecordError, RunRecord
from refspec.eval.record_files import read_records, records_files, summary_json
from refspec.eval.report import format_table, write_report
from refspec.eval.report_serving import target_choices, targets_text, unmet
from refspec.eval.report_text import config_label

log = logging.getLogger(__name__)


def note_corrupt(corrupt: Sequence[tuple[str, int, str]]) -> None:
    """One stderr line naming the records lines that were skipped."""
    if corrupt:
        print(f"note: skipped {len(corrupt)} corrupt records line(s): "
              + "; ".join(f"{Path(f).name}:{n}" for f, n, _ in corrupt[:5]), file=sys.stderr)


def report(args: argparse.Namespace) -> int:
    """``python -m refspec.eval report DIR``: merge the records, check them, then rewrite summary and report."""
    check_report_flags(args)
    out_dir: Path = args.dir
    files = records_files(out_dir)
    if not files:
        raise UsageError(f"{out_dir} holds no records.jsonl (nor records/*.jsonl); run a sweep into it first")
    try:
        loaded = read_records(files, strict=True)
    except OSError as exc:
        raise UsageError(f"cannot read records in {out_dir}: {exc.strerror or exc}") from None
    except RecordError as exc:
        raise UsageError(f"report {out_dir}: {exc}") from None
    note_corrupt(loaded.corrupt)
    if not loaded.records:
        raise UsageError(f"no finished configuration in {', '.join(str(f) for f in files)}")
    targets = _targets(args, out_dir / SWEEP_META)
    _check_target_fields(loaded.records, targets, out_dir)
    with claimed(out_dir, flag="report"):
        records = attach_baselines(loaded.records)
        write_json(out_dir / SUMMARY, summary_json(records))
        ledgers = ([out_dir / LEDGER] if (out_dir / LEDGER).exists() else []) + sorted(
            (out_dir / TASK_LEDGERS_DIR).glob("*.jsonl"))
        rep = write_report(out_dir, records, latency_target_s=targets.tpot_p99_s, ttft_target_s=targets.ttft_p99_s,
                           frontier=bool(getattr(args, "frontier", False)), corrupt=loaded.corrupt, ledgers=ledgers)
    print(format_table(records))
    _print_targets(records, targets)
    print(f"\nmerged {len(files)} records file(s), {len(records)} configuration(s)"
          + (f", {loaded.duplicates} duplicate record(s) superseded" if loaded.duplicates else ""))
    print(f"wrote {rep.markdown} and {', '.join(p.name for p in rep.plots)}")
    return 0


def _targets(args: argparse.Namespace, meta: Path) -> Targets:
    """The p99 targets: the flags, else the sweep's (``sweep.json``)."""
    tpot, ttft = args.latency_target, getattr(args, "ttft_target", None)
    if (tpot is None or ttft is None) and meta.is_file():
        try:
            saved = json.loads(meta.read_text())
        except (OSError, json.JSONDecodeError):
            log.warning("could not read %s; no latency target from it", meta)
        else:
            tpot = saved.get("latency_target_s") if tpot is None else tpot
            ttft = saved.get("ttft_target_s") if ttft is None else ttft
    return Targets(tpot, ttft)


def _check_target_fields(records: Sequence[RunRecord], targets: Targets, out_dir: Path) -> None:
    """A TTFT target needs records with TTFT: none at all is an error (before anything is rewritten)."""
    if targets.ttft_p99_s is not None and not any(r.latency.ttft_p99_s is not None for r in records):
        raise UsageError(f"report {out_dir}: --ttft-target needs ttft_p99_s, which none of the {len(records)} "
                         "record(s) has (records written before serving windows, static lockstep runs: their window "
                         "and TTFT fields are absent); rerun the sweep, or drop --ttft-target")


def _print_targets(records: Sequence[RunRecord], targets: Targets) -> None:
    """The choice per corpus on stdout; a corpus where nothing meets the targets also gets a stderr note."""
    if not targets.given():
        return
    choices = target_choices(records, targets)
    print("\n" + "\n".join(targets_text(choices, targets, config_label)))
    missed = unmet(choices)
    if missed:
        print(f"note: no configuration meets {targets.text()} on {', '.join(missed)}; report.md shows by how much "
              "each one misses", file=sys.stderr)


__all__ = ["report", "note_corrupt"]
