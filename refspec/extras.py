"""Optional dependencies, imported where they are used, with an error that names the extra.

``pip install refspec`` brings the core only; converting GGUF models needs the ``assets`` extra
and the evaluation corpora need ``corpora`` (``pip install "refspec[assets,corpora]"``).
"""
from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtraError(RuntimeError):
    """An optional dependency is not installed (the message says which extra brings it)."""


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """Import ``module`` or raise :class:`MissingExtraError` naming the pip extra that provides it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module == exc.name or module.startswith(exc.name + ".")):
            raise  # the package is there but one of its own imports failed: show that error
        raise MissingExtraError(f"{purpose} needs the {module.split('.')[0]!r} package: "
                                f"pip install \"refspec[{extra}]\"") from None
