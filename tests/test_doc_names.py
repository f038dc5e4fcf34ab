"""Every dotted ``refspec.…`` name the docs, docstrings and scripts mention resolves in the code.

Modules and names move; a reader following ``refspec.energy.x.y`` from a doc must land on it.
"""
from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a dotted name, not a file name (.refspec.lock), a format tag (refspec.tau-table/1) or a path
NAME = re.compile(r"(?<![\w./-])refspec(?:\.[A-Za-z_]\w*)+(?![\w/-])")
NOT_CODE = {"refspec.provenance"}  # a key of a head's config.json, not a Python name


SOURCES = ("refspec", "models", "drafters", "eval", "serve", "scripts", "docs")


def _files() -> list[Path]:
    """The Python and Markdown files a reader opens: the packages, scripts, docs and the README."""
    files = [f for d in SOURCES for pattern in ("*.py", "*.md") for f in (ROOT / d).rglob(pattern)]
    return sorted(f for f in files if "__pycache__" not in f.parts) + [ROOT / "README.md"]


def resolves(name: str) -> bool:
    """Whether ``name`` is a module, or a module's attribute chain (a dataclass field counts)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            fields = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
            if attr in fields:
                return attr == parts[-1]
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_dotted_name_resolves():
    stale = {}
    for path in _files():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for name in NAME.findall(line):
                name = name.rstrip(".")
                if name not in NOT_CODE and not name.endswith((".py", ".md")) and not resolves(name):
                    stale.setdefault(name, f"{path.relative_to(ROOT)}:{n}")
    assert not stale, "names that no longer resolve: " + ", ".join(f"{k} ({v})" for k, v in sorted(stale.items()))


def test_the_check_finds_a_stale_name():
    assert resolves("refspec.energy.model.roofline.forward_cost")
    assert resolves("refspec.eval.requests.RequestStream.unique")
    assert not resolves("refspec.energy.roofline.forward_cost")
    assert not resolves("refspec.energy.model.roofline.no_such_name")
    assert NAME.findall("a `.refspec.lock` and a `refspec.tau-table/1` file") == []
