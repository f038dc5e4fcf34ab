"""CLI names to drafter builders. The engine never sees this table; the CLI edge does.

A builder takes a :class:`DrafterContext` (the loaded target and the user's options) and
returns a drafter. Drafters register here when their module exists; asking for a name that
is not registered is a clear error that lists the available ones.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from refspec.drafting import DrafterError


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterContext:
    """What a builder may use.

    Attributes:
        target: the target ``Transformer``.
        target_name: model id or path of the target (to find trained heads).
        tokenizer_fingerprint: the target tokenizer's fingerprint, or None.
        dtype: torch dtype of the run.
        device: torch device of the run.
        options: drafter-specific options from the CLI (e.g. ``draft_model``, ``max_n``).
    """

    target: Any
    target_name: str
    tokenizer_fingerprint: str | None
    dtype: Any
    device: Any
    options: dict[str, Any] = dataclasses.field(default_factory=dict)


Builder = Callable[[DrafterContext], Any]
_REGISTRY: dict[str, tuple[Builder, str, int]] = {}


def register(name: str, builder: Builder, *, help: str, default_k: int) -> None:  # noqa: A002
    """Register a drafter builder under a CLI name."""
    _REGISTRY[name] = (builder, help, default_k)


def available() -> dict[str, str]:
    """Registered drafter names with their one-line help."""
    _load_builtin()
    return {name: h for name, (_, h, _) in sorted(_REGISTRY.items())}


def default_k(name: str) -> int:
    """The K a drafter runs with when the user gives none."""
    _load_builtin()
    return _REGISTRY[name][2]


def build(name: str, ctx: DrafterContext):
    """Build the drafter registered as ``name``."""
    _load_builtin()
    if name not in _REGISTRY:
        raise DrafterError(f"unknown drafter {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name][0](ctx)


_loaded = False


def call_hooks(modules: Sequence[str], hook_name: str, register: Callable) -> None:
    """Import ``refspec.drafters.<module>`` for each module that exists and call its ``hook_name(register)``.

    A module that is absent is skipped (the CLI lists only what exists); an import error
    inside a present module propagates.
    """
    import importlib

    for module in modules:
        try:
            mod = importlib.import_module(f"refspec.drafters.{module}")
        except ModuleNotFoundError as exc:
            if exc.name != f"refspec.drafters.{module}":
                raise
            continue
        hook = getattr(mod, hook_name, None)
        if hook is not None:
            hook(register)


def _load_builtin() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    call_hooks(("ngram", "draft_model", "eagle", "block"), "register_builtin", register)
