"""Where trained drafter heads live, shared by every drafter that loads one (eagle, eagle3, block).

A head for target ``<id>`` and drafter ``<kind>`` is the directory ``<id>-<kind>``: first
among the heads shipped inside the package (``drafters/heads/``, small enough to ship), then
under ``$REFSPEC_HOME/heads/``, where ``python -m refspec.eval train`` writes by default.
A path target (a model directory) uses its directory name as the id.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from refspec.drafting import DrafterError

CONFIG = "config.json"


def shipped_heads_dir() -> Path:
    """``drafters/heads/`` inside the installed package (heads small enough to ship)."""
    return Path(__file__).resolve().parent / "heads"


def user_heads_dir() -> Path:
    """``$REFSPEC_HOME/heads/``, where trained heads are written by default."""
    from refspec.assets import refspec_home

    return refspec_home() / "heads"


def head_dir_name(target_name: str, kind: str) -> str:
    """``<model-id>-<kind>``; a path target uses its directory name as the id."""
    return f"{Path(str(target_name)).name}-{kind}"


def head_search_path(target_name: str, kind: str) -> list[Path]:
    """The directories searched for a head, in order: shipped with refspec, then ``$REFSPEC_HOME``."""
    name = head_dir_name(target_name, kind)
    return [shipped_heads_dir() / name, user_heads_dir() / name]


def train_command(target_name: str, kind: str, recipe: str = "") -> str:
    """The command that trains the ``kind`` head of ``target_name`` where :func:`find_head` looks."""
    command = f"python -m refspec.eval train --drafter {kind} --model {target_name}"
    return f"{command} {recipe}" if recipe else command


def find_head(target_name: str, kind: str, *, files: Sequence[str] = (CONFIG,), recipe: str = "",
              note: str = "", error: type[DrafterError] = DrafterError) -> Path:
    """The first directory of :func:`head_search_path` that holds every file of ``files``.

    Args:
        target_name: model id or model directory of the target.
        kind: drafter name (``eagle``, ``eagle3``, ``block``).
        files: files a head directory must hold.
        recipe: training options added to the suggested command.
        note: a remark on that command (e.g. how long it takes).
        error: the :class:`DrafterError` subclass raised.

    Raises:
        DrafterError: (``error``) none found; the message names the places searched and gives
            the exact command that trains one.
    """
    places = head_search_path(target_name, kind)
    for p in places:
        if all((p / f).is_file() for f in files):
            return p
    command = train_command(target_name, kind, recipe)
    raise error(
        f"no {kind} head for {target_name!r} (looked in {', '.join(map(str, places))}). "
        f"Train one{f' ({note})' if note else ''} with\n"
        f"  {command}\n"
        f"or pass the drafter option head=PATH (the directory of a {kind} head)")
