"""Flags every CLI shares: the errors a user can cause, their checks and one-line rendering.

Torch-free on purpose: every CLI checks its flags with these before importing anything heavy,
so a bad value fails in a fraction of a second and before a model loads.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class UsageError(ValueError):
    """A bad command-line value; the CLIs print it and exit with status 2."""


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (the usage block is for --help)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_USAGE, f"error: {self.prog}: {message} (--help lists the flags)\n")


def one_line(exc: BaseException) -> str:
    """The message of ``exc`` on one line: its first line, saying how many more there were."""
    lines = [ln for ln in str(exc).strip().split("\n") if ln.strip()] or [type(exc).__name__]
    more = f" ({len(lines) - 1} more line(s); --debug shows them)" if len(lines) > 1 else ""
    return lines[0].strip() + more


def finite(flag: str, value: float, *, low: float | None = None, high: float | None = None,
           low_open: bool = False, fix: str = "") -> float:
    """``value`` when finite and inside the bounds, else a :class:`UsageError` naming ``flag``."""
    ok = math.isfinite(value)
    ok = ok and (low is None or (value > low if low_open else value >= low))
    ok = ok and (high is None or value <= high)
    if not ok:
        bound = [f"{'>' if low_open else '>='} {low:g}" if low is not None else "",
                 f"<= {high:g}" if high is not None else ""]
        need = " and ".join(b for b in bound if b) or "finite"
        raise UsageError(f"{flag} must be a finite number {need}, got {value!r}{'; ' + fix if fix else ''}")
    return value


def integer(flag: str, value: int, *, low: int = 0, high: int | None = None, fix: str = "") -> int:
    """``value`` when ``low <= value <= high``, else a :class:`UsageError` naming ``flag``."""
    if value < low or (high is not None and value > high):
        span = f"in {low}..{high}" if high is not None else f">= {low}"
        raise UsageError(f"{flag} must be an integer {span}, got {value}{'; ' + fix if fix else ''}")
    return value


def int_list(flag: str, text: str, *, low: int = 0) -> list[int]:
    """Comma-separated integers, each ``>= low``; empty lists and non-integers name ``flag``."""
    items = [x.strip() for x in str(text).split(",") if x.strip()]
    if not items:
        raise UsageError(f"{flag} is empty (got {text!r}); give comma-separated integers, e.g. {flag} 1,8")
    try:
        values = [int(x) for x in items]
    except ValueError:
        raise UsageError(f"{flag} expects comma-separated integers, got {text!r}") from None
    bad = [v for v in values if v < low]
    if bad:
        raise UsageError(f"{flag} values must be >= {low}, got {bad[0]} in {text!r}")
    return values


def output_path(text: str) -> Path:
    """The ``type=`` of every output flag: an empty name would silently mean the current directory."""
    if not str(text).strip():
        raise argparse.ArgumentTypeError("an empty path; give a file or directory name")
    return Path(text).expanduser()


SEED_MAX = 2**63 - 2**32
"""Highest --seed: per-batch and injection seeds add small offsets and must stay within int64."""


def add_sampling_args(group) -> None:
    """The sampling flags every decoding CLI takes (``--temperature`` 0 is greedy)."""
    group.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--seed", type=int, default=0)


def check_sampling(args) -> None:
    """The sampling flags' ranges (``--temperature``, ``--top-k``, ``--top-p``, ``--seed``)."""
    finite("--temperature", args.temperature, low=0, fix="0 is greedy, e.g. --temperature 0.7")
    integer("--top-k", args.top_k, low=0, fix="0 keeps every token")
    finite("--top-p", args.top_p, low=0, high=1, low_open=True, fix="1 keeps every token")
    integer("--seed", args.seed, low=0, high=SEED_MAX)


__all__ = ["UsageError", "OneLineParser", "one_line", "finite", "integer", "int_list", "output_path",
           "add_sampling_args", "check_sampling", "EXIT_USAGE", "EXIT_INTERRUPTED", "SEED_MAX"]
