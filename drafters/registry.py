"""CLI names to drafter builders. The engine never sees this table; the CLI edge does.

A builder takes a :class:`DrafterContext` (the loaded target and the user's options) and
returns a drafter. Three kinds of name resolve here:

* built-in names (``ngram``, ``draft-model``, ...): each drafter module registers its own
  when it exists;
* installed plug-ins: a package declares ``NAME = "module:Class"`` in the entry-point group
  ``refspec.drafters``;
* ``MODULE:CLASS``: any importable module (``sys.path`` holds the working directory under
  ``python -m``), so a drafter written outside refspec runs with no edit of refspec's files.

A plug-in class is built with ``Class.from_context(ctx)`` when it defines that classmethod,
else with ``Class(**ctx.options)`` (option values are the strings the user typed). A class
attribute ``default_k`` sets the K used when the user gives none.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
from typing import Any, Callable, Sequence

from refspec.drafting import DrafterError

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "refspec.drafters"
PROTOCOL_METHODS = ("reset", "propose", "commit")
PROTOCOL_ATTRIBUTES = ("name", "hidden_layers")
PLUGIN_DEFAULT_K = 4


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
_ENTRY_POINTS: dict[str, str] = {}  # installed plug-in name -> "module:Class", loaded when used


def register(name: str, builder: Builder, *, help: str, default_k: int) -> None:  # noqa: A002
    """Register a drafter builder under a CLI name."""
    _REGISTRY[name] = (builder, help, default_k)


def available() -> dict[str, str]:
    """Registered and installed drafter names with their one-line help."""
    _load_builtin()
    names = {name: h for name, (_, h, _) in _REGISTRY.items()}
    names.update({name: f"plug-in {spec}" for name, spec in _ENTRY_POINTS.items()})
    return dict(sorted(names.items()))


def is_plugin(name: str) -> bool:
    """True for an installed plug-in's name and for a ``MODULE:CLASS`` name (built-ins hold no colon)."""
    _load_builtin()
    return name not in _REGISTRY and (name in _ENTRY_POINTS or ":" in name)


def default_k(name: str) -> int:
    """The K a drafter runs with when the user gives none."""
    _load_builtin()
    if name in _REGISTRY:
        return _REGISTRY[name][2]
    return int(getattr(resolve(name), "default_k", PLUGIN_DEFAULT_K))


def resolve(name: str) -> Any:
    """The plug-in class behind an installed name or a ``MODULE:CLASS`` spec, checked against the protocol.

    Raises:
        DrafterError: an unknown name, a module that does not import, a missing attribute, or
            a class without the protocol's methods (one line each, saying what to fix).
    """
    _load_builtin()
    spec = _ENTRY_POINTS.get(name, name)
    if ":" not in spec:
        raise DrafterError(f"unknown drafter {name!r}; available: {', '.join(available())}, or MODULE:CLASS")
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise DrafterError(f"{spec!r} is not MODULE:CLASS (e.g. mydrafter:MyDrafter)")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        mine = exc.name is not None and (module_name + ".").startswith(exc.name + ".")
        where = "it" if mine else f"its dependency {exc.name!r}"
        raise DrafterError(f"cannot import module {module_name!r}: {where} is not on the Python path "
                           f"(run from its folder or add that folder to PYTHONPATH)") from exc
    except Exception as exc:  # a plug-in's own import error, shown in one line
        raise DrafterError(f"importing module {module_name!r} failed: {_one_line(exc)}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            where = getattr(obj, "__file__", None) or getattr(obj, "__name__", module_name)
            raise DrafterError(f"{where} has no {part!r} (from {spec!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise DrafterError(f"{spec} is a {type(obj).__name__}, not a drafter class")
    missing = [m for m in PROTOCOL_METHODS if not callable(getattr(obj, m, None))]
    if missing:
        raise DrafterError(f"{spec} is not a drafter: it lacks {', '.join(missing)} (a drafter defines "
                           f"{', '.join(PROTOCOL_METHODS)}; see refspec.drafting.Drafter)")
    return obj


def build(name: str, ctx: DrafterContext):
    """Build the drafter registered, installed or named ``MODULE:CLASS`` as ``name``."""
    _load_builtin()
    if name in _REGISTRY:
        return _REGISTRY[name][0](ctx)
    cls = resolve(name)
    if hasattr(cls, "from_context"):
        drafter = cls.from_context(ctx)
    else:
        try:
            inspect.signature(cls).bind(**ctx.options)
        except TypeError as exc:
            raise DrafterError(f"--drafter-option: drafter {name} does not take {sorted(ctx.options)} ({exc}); "
                               f"it takes {list(inspect.signature(cls).parameters) or 'no options'}") from None
        except ValueError:  # no signature to check (a builtin callable): let the call decide
            pass
        drafter = cls(**ctx.options)
    missing = [a for a in (*PROTOCOL_METHODS, *PROTOCOL_ATTRIBUTES) if not hasattr(drafter, a)]
    if missing:
        raise DrafterError(f"drafter {name} built a {type(drafter).__name__} without {', '.join(missing)} "
                           f"(see refspec.drafting.Drafter)")
    return drafter


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())


_loaded = False


def call_hooks(modules: Sequence[str], hook_name: str, register: Callable) -> None:
    """Import ``refspec.drafters.<module>`` for each module that exists and call its ``hook_name(register)``.

    A module that is absent is skipped (the CLI lists only what exists); an import error
    inside a present module propagates.
    """
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


def _load_entry_points() -> None:
    """Record installed plug-ins by name; nothing is imported until one is used."""
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _REGISTRY or ":" in ep.name or not ep.attr:
            log.warning("ignored drafter entry point %r = %r: the name is taken or holds a colon, or the value "
                        "names no class (module:Class)", ep.name, ep.value)
            continue
        _ENTRY_POINTS[ep.name] = f"{ep.module}:{ep.attr}"


def _load_builtin() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    call_hooks(("ngram", "draft_model", "eagle", "block"), "register_builtin", register)
    _load_entry_points()
