"""What every eval command writes, and how: one writer, one output-path check, one directory lock.

* :func:`write_atomic` writes a file through a temporary file in the same directory, fsynced
  and renamed over the target, so a reader (or a killed command) sees the old file or the new
  one, never half of one; it refuses to replace anything but a regular file (a symlink, a FIFO,
  a directory). :func:`atomic_target` is the same for writers that need a file name
  (``savefig``), :func:`append_line` appends one fsynced line (the records files).
* :func:`check_output` and :func:`check_output_dir` run before any work: a path that cannot be
  written, that is an input of the command, or that lies in a directory another live command
  holds is refused with one line naming the flag.
* :func:`claimed` holds an output directory's lock for the command's life: a second command
  writing into the same directory is refused; a lock whose process is gone is taken over.

The layout of a run or sweep directory is named here too (:class:`RunPaths`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

from refspec.energy.ledger.writer import ensure_line_end
from refspec.eval.flags import UsageError

log = logging.getLogger(__name__)

LOCK = ".refspec.lock"
RECORDS = "records.jsonl"
TASK_RECORDS_DIR = "records"
LEDGER = "ledger.jsonl"
TASK_LEDGERS_DIR = "ledgers"
SUMMARY = "summary.json"
SWEEP_META = "sweep.json"
SBATCH = "sweep.sbatch"
REPORT = "report.md"
_HALF_WRITTEN_S = 10.0  # a lock file still empty after this long was left by a crash while it was written


class OutputError(UsageError):
    """A path an output cannot be written to (the CLIs print it and exit with status 2)."""


@dataclasses.dataclass(frozen=True)
class RunPaths:
    """Where a run or sweep (or one Slurm task of it) writes its records and ledger."""

    out_dir: Path
    records: Path
    ledger: Path

    @classmethod
    def for_task(cls, out_dir: Path, task: int | None) -> "RunPaths":
        """``DIR/records.jsonl`` and ``DIR/ledger.jsonl``; a Slurm task's own files under ``records/``, ``ledgers/``."""
        if task is None:
            return cls(out_dir=out_dir, records=out_dir / RECORDS, ledger=out_dir / LEDGER)
        return cls(out_dir=out_dir, records=out_dir / TASK_RECORDS_DIR / f"task-{task}.jsonl",
                   ledger=out_dir / TASK_LEDGERS_DIR / f"task-{task}.jsonl")


# ---- the writer ---------------------------------------------------------------------------------
def _refuse_non_file(path: Path) -> None:
    """Raise when ``path`` exists as anything but a regular file (never followed, never replaced)."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # nothing there (a file as a parent is check_output_dir's)
        return
    if not stat.S_ISREG(mode):
        kind = ("a symlink" if stat.S_ISLNK(mode) else "a directory" if stat.S_ISDIR(mode)
                else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file")
        raise OutputError(f"{path} is {kind}; refusing to replace it with an output file")


@contextlib.contextmanager
def atomic_target(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write; on a clean exit it is fsynced and renamed over ``path``.

    Raises:
        OutputError: ``path`` exists and is not a regular file.
    """
    path = Path(path)
    _refuse_non_file(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp" + path.suffix)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file ordinary permissions
        _refuse_non_file(path)  # nothing became a link meanwhile
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic(path: Path, data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` atomically (module docstring); returns ``path``."""
    with atomic_target(path) as tmp:
        tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(path)


def write_json(path: Path, obj: Any) -> Path:
    """``obj`` as indented JSON, written atomically."""
    return write_atomic(path, json.dumps(obj, indent=2) + "\n")


def append_line(path: Path, line: str) -> None:
    """Append one line, flushed and fsynced (a line cut by a crash is ended before the next one)."""
    _refuse_non_file(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ensure_line_end(path)
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line.rstrip("\n") + "\n")
        fh.flush()
        os.fsync(fh.fileno())


# ---- the checks before any work ------------------------------------------------------------------
def _same(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def check_output_dir(flag: str, path: Path) -> None:
    """``path`` is or can become a writable directory (nothing is created here).

    Raises:
        OutputError: a file where the directory (or one of its parents) must be, or no write access.
    """
    if path.is_symlink() and not path.is_dir():
        raise OutputError(f"{flag} {path} is a symlink to no directory; give a directory")
    if path.exists() and not path.is_dir():
        raise OutputError(f"{flag} {path} is an existing file; give a directory")
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise OutputError(f"{flag} {path}: {probe} is a file, so no directory can be made under it")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise OutputError(f"{flag} {path}: {probe} is not writable; choose another place")


def check_output(flag: str, path: Path, *, inputs: Sequence[Path | None] = (), others: Sequence[Path] = ()) -> None:
    """``path`` can take this command's output file.

    Args:
        flag: the flag that named ``path`` (for the message).
        path: the output file.
        inputs: files the command reads (an output never replaces one).
        others: files the command writes under other names (two outputs never share a file).

    Raises:
        OutputError: a directory, symlink or FIFO at ``path``, an input or another output there, a
            directory another live command holds, or a parent that cannot become a directory.
    """
    try:
        _refuse_non_file(path)
    except OutputError as exc:
        raise OutputError(f"{flag} {exc}; give a file name, e.g. {path / 'out.json'}"
                          if path.is_dir() and not path.is_symlink() else f"{flag} {exc}") from None
    for given in (p for p in inputs if p is not None):
        if _same(path, Path(given)):
            raise OutputError(f"{flag} {path} is an input of this command ({given}); choose another file")
    for other in others:
        if Path(other).resolve() == path.resolve():
            raise OutputError(f"{flag} {path} is where this command writes its own {Path(other).name}; choose "
                              f"another file")
    holder = running_into(path.parent) if path.parent.is_dir() else None
    if holder is not None and holder.get("pid") != os.getpid():
        raise OutputError(f"{flag} {path}: {path.parent} is in use by another refspec run (pid {holder.get('pid')}); "
                          f"choose another place")
    check_output_dir(flag, path.parent)


# ---- the directory lock ------------------------------------------------------------------------
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
    """The live command holding ``out_dir`` (its lock record), or None."""
    return _holder(out_dir / LOCK) if (out_dir / LOCK).exists() else None


def _take(path: Path, name: str, flag: str) -> None:
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _holder(path)
            if holder is None:
                log.warning("removed a stale lock %s (its process is gone)", path)
                path.unlink(missing_ok=True)
                continue
            raise OutputError(f"{flag} {path.parent} is in use by another refspec run (pid {holder.get('pid')} on "
                              f"{holder.get('host')}); wait for it or choose another directory (delete {path} if "
                              f"no such run exists)") from None
        with os.fdopen(fd, "w") as fh:
            json.dump({"pid": os.getpid(), "host": socket.gethostname(), "since_unix_s": time.time(),
                       "what": name}, fh)
        return
    raise OutputError(f"{flag} {path.parent}: could not take the lock {path}; another run keeps replacing it")


def _remove_empty(folders: Sequence[Path]) -> None:
    for folder in folders:
        try:
            folder.rmdir()  # only when empty: nothing was written there
        except OSError:
            return


@contextlib.contextmanager
def claimed(out_dir: Path, *, lock: str = LOCK, flag: str = "--out") -> Iterator[Path]:
    """Create ``out_dir`` if needed and hold its lock while the body runs (released on every exit).

    On the way out, a directory this call created is removed again when it is left empty.
    ``flag`` names the directory in messages (``--out``, ``report``).

    Raises:
        OutputError: another live command holds the lock, or the directory cannot be created.
    """
    created = [d for d in (out_dir, *out_dir.parents) if not d.exists()]  # deepest first
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"{flag} {out_dir}: cannot create it: {exc.strerror or exc}") from None
    path = out_dir / lock
    try:
        _take(path, lock, flag)
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
    """A temporary directory for a command without ``--out``, named by pid so a killed one's is found later.

    Those of commands whose process is gone (SIGKILL skips every cleanup) are removed first.
    """
    root = Path(tempfile.gettempdir())
    for old in root.glob("refspec-eval-*-*"):
        m = re.fullmatch(r"refspec-eval-(\d+)-.*", old.name)
        if m and old.is_dir() and not _alive(int(m.group(1))):
            log.info("removed %s, left by a run that was killed", old)
            shutil.rmtree(old, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix=f"refspec-eval-{os.getpid()}-") as tmp:
        yield Path(tmp)


__all__ = ["OutputError", "RunPaths", "write_atomic", "write_json", "atomic_target", "append_line",
           "check_output", "check_output_dir", "claimed", "running_into", "scratch", "LOCK", "RECORDS",
           "TASK_RECORDS_DIR", "LEDGER", "TASK_LEDGERS_DIR", "SUMMARY", "SWEEP_META", "SBATCH", "REPORT"]
