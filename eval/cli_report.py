"""``python -m refspec.eval report DIR``: Markdown, plots and ``summary.json`` from a directory of records.

Every record is checked (its version, the fields the report reads) before anything in DIR is
rewritten, so a foreign or hand-cut record fails with one line and leaves DIR as it was.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any, Sequence

from refspec.eval.cli_checks import check_report_flags
from refspec.eval.flags import UsageError
from refspec.eval.outdir import running_into

log = logging.getLogger(__name__)


def note_corrupt(corrupt: Sequence[tuple[str, int, str]]) -> None:
    """One stderr line naming the records lines that were skipped."""
    if corrupt:
        print(f"note: skipped {len(corrupt)} corrupt records line(s): "
              + "; ".join(f"{Path(f).name}:{n}" for f, n, _ in corrupt[:5]), file=sys.stderr)


def report(args: argparse.Namespace) -> int:
    """``python -m refspec.eval report DIR``: merge the records, check them, then rewrite summary and report."""
    check_report_flags(args)
    from refspec.eval.report import format_table, write_report
    from refspec.eval.sweep import (LEDGER, SUMMARY, SWEEP_META, TASK_LEDGERS_DIR, attach_baselines, read_records,
                                    records_files, write_json_atomic)

    out_dir: Path = args.dir
    files = records_files(out_dir)
    if not files:
        raise UsageError(f"{out_dir} holds no records.jsonl (nor records/*.jsonl); run a sweep into it first")
    try:
        loaded = read_records(files)
    except OSError as exc:
        raise UsageError(f"cannot read records in {out_dir}: {exc.strerror or exc}") from None
    note_corrupt(loaded.corrupt)
    if not loaded.records:
        raise UsageError(f"no finished configuration in {', '.join(str(f) for f in files)}")
    _check_records(loaded.records, out_dir)
    live = running_into(out_dir)
    if live is not None:
        print(f"note: a sweep is still running into {out_dir} (pid {live.get('pid')}); this report covers the "
              f"{len(loaded.records)} configuration(s) finished so far", file=sys.stderr)
    target = args.latency_target
    if target is None and (out_dir / SWEEP_META).is_file():
        try:
            target = json.loads((out_dir / SWEEP_META).read_text()).get("latency_target_s")
        except (OSError, json.JSONDecodeError):
            log.warning("could not read %s; no latency target", out_dir / SWEEP_META)
    records = loaded.records
    attach_baselines(records)
    write_json_atomic(out_dir / SUMMARY, records)
    ledgers = ([out_dir / LEDGER] if (out_dir / LEDGER).exists() else []) + sorted(
        (out_dir / TASK_LEDGERS_DIR).glob("*.jsonl"))
    rep = write_report(out_dir, records, latency_target_s=target, corrupt=loaded.corrupt, ledgers=ledgers)
    print(format_table(records))
    print(f"\nmerged {len(files)} records file(s), {len(records)} configuration(s)"
          + (f", {loaded.duplicates} duplicate record(s) superseded" if loaded.duplicates else ""))
    print(f"wrote {rep.markdown} and {', '.join(p.name for p in rep.plots)}")
    return 0


def _check_records(records: Sequence[dict[str, Any]], out_dir: Path) -> None:
    """Every record is of this refspec's version and has what the report reads (before anything is rewritten)."""
    from refspec.eval.records import RECORD_VERSION

    for r in records:
        if r.get("record_version") != RECORD_VERSION:
            raise UsageError(f"report {out_dir}: record {r['config_id']} has record_version "
                             f"{r.get('record_version')!r}, this refspec reads {RECORD_VERSION}; rerun its sweep")
        missing = [f for f in _REPORT_FIELDS if f not in r]
        if missing:
            raise UsageError(f"report {out_dir}: record {r['config_id']} lacks {', '.join(missing)}; a record "
                             f"written by hand or cut short? Rerun its sweep")


_REPORT_FIELDS = ("drafter", "k", "batch", "corpus", "model", "tau", "energy_per_token_j", "tpot_p99_s",
                  "baseline_config_id", "energy_source")


__all__ = ["report", "note_corrupt"]
