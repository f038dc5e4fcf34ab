"""An ``--out`` directory belongs to one sweep definition and to one running invocation.

The definition is the hash of the plan's configuration ids (every setting that changes a figure
is in an id), stored in ``sweep.json``. A rerun with the same definition resumes; another
definition is refused, or with ``--force`` starts in ``DIR/sweep-<definition>``. While an
invocation writes, an advisory lock file names its pid; a second invocation is refused, and a
lock whose pid no longer runs on this host is stale and taken over. A directory this
invocation created and left empty (it failed before writing anything) is removed.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

from refspec.eval.flags import UsageError

log = logging.getLogger(__name__)

LOCK = ".refspec.lock"
SWEEP_META = "sweep.json"
_RECORDS = ("records.jsonl", "records")
_HALF_WRITTEN_S = 10.0  # a lock file still empty after this long was left by a crash while it was written


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
    from refspec.eval.sweep import read_records, records_files

    files = records_files(out_dir) if out_dir.is_dir() else []
    if not files:
        return None
    try:
        ids = set(read_records(files).by_id)
    except OSError as exc:
        raise UsageError(f"--out {out_dir}: cannot read its records: {exc.strerror or exc}") from None
    return definition if ids <= set(config_ids) else "other"


def write_meta(out_dir: Path, meta: dict[str, Any]) -> None:
    from refspec.eval.sweep import write_json_atomic

    write_json_atomic(out_dir / SWEEP_META, meta)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _holder(path: Path) -> dict[str, Any] | None:
    """Who holds the lock at ``path``: its record, or None when the lock is stale."""
    try:
        text = path.read_text()
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None
    try:
        holder = json.loads(text)
        pid = int(holder["pid"])
    except (ValueError, KeyError, TypeError):
        return None if age > _HALF_WRITTEN_S else {"pid": "?", "host": "?"}  # being written right now
    if holder.get("host") == socket.gethostname() and not _alive(pid):
        return None
    return holder


def running_into(out_dir: Path) -> dict[str, Any] | None:
    """The live invocation writing ``out_dir`` (its lock record), or None."""
    return _holder(out_dir / LOCK) if (out_dir / LOCK).exists() else None


def _take(path: Path, name: str) -> None:
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _holder(path)
            if holder is None:
                log.warning("removed a stale lock %s (its process is gone)", path)
                path.unlink(missing_ok=True)
                continue
            raise UsageError(f"--out {path.parent} is in use by another refspec run (pid {holder.get('pid')} on "
                             f"{holder.get('host')}); wait for it or choose another --out (delete {path} if no "
                             f"such run exists)") from None
        with os.fdopen(fd, "w") as fh:
            json.dump({"pid": os.getpid(), "host": socket.gethostname(), "since_unix_s": time.time(),
                       "what": name}, fh)
        return
    raise UsageError(f"--out {path.parent}: could not take the lock {path}; another run keeps replacing it")


@contextlib.contextmanager
def claimed(out_dir: Path, *, lock: str = LOCK) -> Iterator[Path]:
    """Create ``out_dir`` if needed and hold its lock while the body runs (released on every exit).

    On the way out, a directory this call created is removed again when it is left empty.
    """
    created = [d for d in (out_dir, *out_dir.parents) if not d.exists()]  # deepest first
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {out_dir}: cannot create it: {exc.strerror or exc}") from None
    path = out_dir / lock
    try:
        _take(path, lock)
    except BaseException:
        _remove_empty(created)
        raise
    try:
        yield out_dir
    finally:
        with contextlib.suppress(OSError, ValueError):
            if json.loads(path.read_text()).get("pid") == os.getpid():
                path.unlink()
        _remove_empty(created)


@contextlib.contextmanager
def scratch() -> Iterator[Path]:
    """A temporary directory for a run without ``--out``, named by pid so a killed run's is found later.

    Those of runs whose process is gone (SIGKILL skips every cleanup) are removed first.
    """
    import re
    import shutil
    import tempfile

    root = Path(tempfile.gettempdir())
    for old in root.glob("refspec-eval-*-*"):
        m = re.fullmatch(r"refspec-eval-(\d+)-.*", old.name)
        if m and old.is_dir() and not _alive(int(m.group(1))):
            log.info("removed %s, left by a run that was killed", old)
            shutil.rmtree(old, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix=f"refspec-eval-{os.getpid()}-") as tmp:
        yield Path(tmp)


def _remove_empty(folders: Sequence[Path]) -> None:
    for folder in folders:
        try:
            folder.rmdir()  # only when empty: nothing was written there
        except OSError:
            return


__all__ = ["definition_id", "resolve_out", "claimed", "scratch", "running_into", "write_meta", "LOCK", "SWEEP_META"]
