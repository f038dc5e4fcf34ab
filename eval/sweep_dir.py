"""Which directory a sweep writes: an ``--out`` directory belongs to one sweep definition.

The definition is the hash of the plan's configuration ids (every setting that changes a figure
is in an id), stored in ``sweep.json``. A rerun with the same definition resumes; another
definition is refused, or with ``--force`` starts in ``DIR/sweep-<definition>``. While a
command writes into the directory it holds the directory's lock (:func:`refspec.eval.outputs.claimed`).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Sequence

from refspec.eval.flags import UsageError
from refspec.eval.outputs import SWEEP_META, write_json
from refspec.eval.record_files import read_records, records_files


def definition_id(config_ids: Sequence[str]) -> str:
    """The sweep definition: a short hash of its configuration ids, in any order."""
    return hashlib.sha256(json.dumps(sorted(config_ids)).encode()).hexdigest()[:12]


def _stored(out_dir: Path) -> tuple[str | None, str]:
    """The definition held in ``out_dir`` (None when it holds none) and the command that made it."""
    meta = out_dir / SWEEP_META
    if meta.is_file():
        try:
            data = json.loads(meta.read_text())
            if data.get("sbatch"):  # planned on a login node, whose device and dtype the tasks need not share
                return None, ""
            return data.get("definition") or definition_id(data["configs"]), str(data.get("command", "?"))
        except (OSError, ValueError, KeyError, TypeError):
            raise UsageError(f"--out {out_dir}: {meta} is unreadable; move it aside or choose another --out") from None
    return None, ""


def resolve_out(out_dir: Path, definition: str, config_ids: Sequence[str], *, force: bool) -> Path:
    """The directory this invocation writes: ``out_dir``, or its ``sweep-<definition>`` subfolder under ``force``.

    Raises:
        UsageError: ``out_dir`` holds another definition (and not ``force``).
    """
    theirs, command = _stored(out_dir)
    if theirs is None:
        theirs = _legacy_definition(out_dir, config_ids, definition)
    if theirs is None or theirs == definition:
        return out_dir
    sub = out_dir / f"sweep-{definition}"
    if force:
        return resolve_out(sub, definition, config_ids, force=False)
    raise UsageError(f"--out {out_dir} holds a different sweep (made by: {command or 'an earlier run'}); results "
                     f"would mix: rerun that command to resume it, choose another --out, or add --force to "
                     f"start this one in {sub}")


def _legacy_definition(out_dir: Path, config_ids: Sequence[str], definition: str) -> str | None:
    """A directory with records but no ``sweep.json``: ours when every record is a configuration of ours."""
    files = records_files(out_dir) if out_dir.is_dir() else []
    if not files:
        return None
    try:
        ids = set(read_records(files).by_id)
    except OSError as exc:
        raise UsageError(f"--out {out_dir}: cannot read its records: {exc.strerror or exc}") from None
    return definition if ids <= set(config_ids) else "other"


def write_meta(out_dir: Path, meta: dict[str, Any]) -> None:
    """``sweep.json``: the command, its configuration ids and the definition they hash to."""
    write_json(out_dir / SWEEP_META, meta)


__all__ = ["definition_id", "resolve_out", "write_meta"]
