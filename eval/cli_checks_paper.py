"""Checks of ``python -m refspec.eval paper``'s flags that need no torch: they run before the plan prints.

Every number is finite and inside what the grid can run; ``--out`` can become a directory that does
not hold an earlier paper run (its claims would be overwritten without a word); ``--ledgers`` likewise.
"""
from __future__ import annotations

import argparse

from refspec.eval.flags import UsageError, finite, integer
from refspec.eval.outputs import check_output_dir

PROMPT_LEN_MAX = 32_768
"""Longest prompt of the grid's requests (tokens): beyond the context of every model it prices."""
NEW_TOKENS_MAX = 32_768
FINISHED = ("claims.json", "claims.md", "results.json")
"""Files a paper run writes from its first variant on; an ``--out`` holding one is refused."""


def _blocks(text: str | None) -> None:
    if text is not None and not [n for n in text.split(",") if n.strip()]:
        raise UsageError(f"--blocks is empty (got {text!r}); give block names, e.g. --blocks core")


def check_paper_flags(args: argparse.Namespace) -> None:
    """Every numeric flag, ``--blocks`` and the output folders of ``paper``.

    Raises:
        UsageError: a value out of range (naming its flag), or an output folder that cannot take the run.
    """
    if args.budget_s is not None:
        finite("--budget-s", args.budget_s, low=0, low_open=True, fix="seconds for the whole command")
    finite("--min-window-s", args.min_window_s, low=0, low_open=True, high=3600,
           fix="seconds of the shortest steady-state window")
    if args.repeats is not None:
        integer("--repeats", args.repeats, low=1, high=100)
    integer("--prompt-len", args.prompt_len, low=1, high=PROMPT_LEN_MAX)
    integer("--new-tokens", args.new_tokens, low=2, high=NEW_TOKENS_MAX)
    integer("--kv-bucket", args.kv_bucket, low=1, high=PROMPT_LEN_MAX)
    if args.threads is not None:
        integer("--threads", args.threads, low=1, high=4096)
    integer("--seed", args.seed, low=0, high=2**63 - 1)
    _blocks(args.blocks)
    if args.plan_only:
        return  # the plan writes nothing
    check_output_dir("--out", args.out)
    done = [n for n in FINISHED if (args.out / n).exists()]
    if done:
        raise UsageError(f"--out {args.out} holds an earlier paper run ({done[0]}); choose another folder or move "
                         f"it away")
    if args.ledgers is not None:
        check_output_dir("--ledgers", args.ledgers)


__all__ = ["check_paper_flags", "PROMPT_LEN_MAX", "NEW_TOKENS_MAX", "FINISHED"]
