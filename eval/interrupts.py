"""One clean interruption for every command: Ctrl-C and SIGTERM unwind alike and exit 130.

Two torch/CPython details would otherwise break that. torch's import is not interrupt-safe: a
KeyboardInterrupt raised inside it is swallowed by its extension (the run goes on), breaks a later
import, or aborts the process from C++; so interrupts wait until torch is imported. And CPython
dies of SIGINT at exit, even after the interrupt was handled, when it landed in code run by
``exec``/``eval`` of a string.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys
import threading
from typing import Any, Iterator


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (Slurm's time limit, ``kill``) unwinds like Ctrl-C: the lock released, the ledger run marked aborted."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


@contextlib.contextmanager
def unwrapped_interrupts() -> Iterator[None]:
    """An interrupt that Python wrapped on its way up leaves the block as the KeyboardInterrupt it
    was (CPython 3.11 turns one raised in a ``__set_name__``, e.g. a dataclass field's while a
    module imports mid-run, into a RuntimeError)."""
    try:
        yield
    except Exception as exc:
        if _holds_interrupt(exc):
            raise KeyboardInterrupt from exc
        raise


def reraise_interrupt(exc: BaseException) -> None:
    """For a handler that keeps going after an error: an error that carries an interrupt (see
    :func:`unwrapped_interrupts`) is the user's Ctrl-C, raised again as one."""
    if _holds_interrupt(exc):
        raise KeyboardInterrupt from exc


def _holds_interrupt(exc: BaseException) -> bool:
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        if isinstance(link, KeyboardInterrupt):
            return True
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return False


def import_torch() -> None:
    """Import torch with interrupts held back until it is done, then raise one if it came."""
    import_holding_interrupts("torch")


def import_holding_interrupts(name: str) -> None:
    """Import module ``name``; a Ctrl-C or SIGTERM meanwhile is raised once the import is done."""
    if name in sys.modules or threading.current_thread() is not threading.main_thread():
        return
    caught: list[int] = []
    held = [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) is not signal.SIG_IGN]  # ignored stays so
    before = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in held}
    try:
        importlib.import_module(name)
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    if caught:
        raise KeyboardInterrupt


class _PipeSafeStdout:
    """``sys.stdout`` that outlives its reader: once the pipe closes (``| head``), output goes to /dev/null."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_devnull()

    def _to_devnull(self) -> None:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, self._stream.fileno())  # the buffered rest, and the flush at exit, land there
        os.close(null)

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, ...
        return getattr(self._stream, name)


@contextlib.contextmanager
def stdout_outlives_reader() -> Iterator[None]:
    """A closed stdout (``... | head``) ends no command: its files, report and plots are still written."""
    if isinstance(sys.stdout, _PipeSafeStdout) or not hasattr(sys.stdout, "fileno"):
        yield
        return
    before = sys.stdout
    sys.stdout = _PipeSafeStdout(before)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stdout = before


def forget_handled_interrupt() -> None:
    """Clear CPython's unhandled-KeyboardInterrupt flag (``exec`` of a string resets it before it runs)."""
    exec("None")
