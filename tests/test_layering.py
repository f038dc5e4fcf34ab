"""The dependency rule, checked from every module's imports (module-level and function-level).

Layers, from the bottom: ``refspec.config``; the energy package; the core (every other module of
``refspec`` and its rooms); assets; models (``refspec.models.tp`` included); drafters; eval;
serve. A layer imports only from itself and the layers its row of :data:`ALLOWED` names; the
energy package imports nothing of the core but ``refspec.config``, and never
``torch.distributed``. Nothing imports serve. No two modules reach each other through imports,
not even through an import inside a function.

An edge is every ``import`` statement anywhere in a module (inside functions and
``TYPE_CHECKING`` blocks too), to the module it names (``from pkg import name`` names
``pkg.name`` when that is a module, else ``pkg``); the parent packages Python also runs are not
edges of their own.
"""
from __future__ import annotations

import ast
import tomllib
from pathlib import Path
from typing import Iterable, Mapping

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("energy", "assets", "models", "drafters", "eval", "serve")
BELOW_CORE = {"energy"}
ALLOWED: dict[str, set[str]] = {
    "energy": {"energy"},
    "core": {"core", "energy"},
    "assets": {"core", "energy", "assets"},
    "models": {"core", "energy", "assets", "models"},
    "drafters": {"core", "energy", "assets", "models", "drafters"},
    "eval": {"core", "energy", "assets", "models", "drafters", "eval"},
    "serve": {"core", "energy", "assets", "models", "drafters", "eval", "serve"},
}
ENERGY_MAY_IMPORT = {"refspec.config"}
FORBIDDEN_IN_ENERGY = ("torch.distributed",)
ENERGY_ORDER = ("model", "meters", "ledger", "accounting")  # each sub-package imports only those before it

# Known violations, each an expected failure until the branch that removes it is merged; the list
# is emptied then, never extended to let a new violation in.


def package_dirs(root: Path) -> dict[str, Path]:
    """Import name -> folder, as pyproject's ``[tool.setuptools] package-dir`` maps them."""
    config = tomllib.loads((root / "pyproject.toml").read_text())
    return {name: root / folder for name, folder in config["tool"]["setuptools"]["package-dir"].items()}


def modules(dirs: Mapping[str, Path]) -> dict[str, Path]:
    """Every module's dotted name -> its file (a package is its ``__init__.py``)."""
    out: dict[str, Path] = {}
    claimed = {d.resolve() for d in dirs.values()}
    for name, folder in dirs.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder)
            if any(folder.joinpath(*rel.parts[:i]).resolve() in claimed for i in range(1, len(rel.parts))):
                continue  # a sub-folder another import name maps
            parts = [name, *rel.with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _base(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def imports(module: str, path: Path, known: Iterable[str]) -> set[str]:
    """The modules ``module`` imports anywhere in its file."""
    known = set(known)
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, path, node)
            for alias in node.names:
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return out


def graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules it imports (every import statement of the tree under ``root``)."""
    mods = modules(package_dirs(root))
    return {m: imports(m, p, mods) for m, p in mods.items()}


def layer(module: str) -> str | None:
    """The layer of a ``refspec`` module (None: outside the package)."""
    parts = module.split(".")
    if parts[0] != "refspec":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "core"


def bad_arrows(edges: Mapping[str, Iterable[str]]) -> set[tuple[str, str]]:
    """Every (importer, imported) pair the rule forbids."""
    bad = set()
    for src, targets in edges.items():
        here = layer(src)
        for dst in targets:
            there = layer(dst)
            if here == "energy" and dst.startswith(FORBIDDEN_IN_ENERGY):
                bad.add((src, dst))
            if there is None or (here == "energy" and dst in ENERGY_MAY_IMPORT):
                continue
            if there not in ALLOWED[here]:
                bad.add((src, dst))
    return bad


def energy_order_breaks(edges: Mapping[str, Iterable[str]]) -> set[tuple[str, str]]:
    """(importer, imported) pairs of energy sub-packages that import a later one (modules at the
    package's root are not placed)."""
    def place(module: str) -> int | None:
        parts = module.split(".")
        if parts[:2] != ["refspec", "energy"] or len(parts) < 4 or parts[2] not in ENERGY_ORDER:
            return None
        return ENERGY_ORDER.index(parts[2])

    return {(src, dst) for src, targets in edges.items() for dst in targets
            if place(src) is not None and place(dst) is not None and place(dst) > place(src)}


def cycles(edges: Mapping[str, Iterable[str]]) -> list[frozenset[str]]:
    """The strongly connected components of two or more modules (or one importing itself)."""
    nodes = {m: sorted(t for t in ts if t in edges) for m, ts in edges.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for start in sorted(nodes):
        if start in index:
            continue
        work = [(start, iter(nodes[start]))]  # Tarjan's algorithm without recursion
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = set()
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        comp.add(top)
                        if top == node:
                            break
                    if len(comp) > 1 or node in nodes[node]:
                        found.append(frozenset(comp))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(nodes[child])))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


@pytest.fixture(scope="module")
def edges() -> dict[str, set[str]]:
    return graph(ROOT)


def test_every_layer_is_found(edges):
    found = {layer(m) for m in edges}
    assert {"core", "energy", "assets", "models", "drafters", "eval"} <= found
    assert "refspec.config" in edges and "refspec.energy.meters.make" in edges


def test_no_arrow_breaks_the_rule(edges):
    assert sorted(bad_arrows(edges)) == []


def test_energy_sub_packages_import_only_earlier_ones(edges):
    assert sorted(energy_order_breaks(edges)) == []


def test_no_import_cycle(edges):
    assert sorted(sorted(c) for c in cycles(edges)) == []


# ---- the checker fails on a violation ---------------------------------------------------------
def write_tree(root: Path, files: Mapping[str, str]) -> Path:
    (root / "pyproject.toml").write_text('[tool.setuptools]\npackage-dir = {"refspec" = "refspec", '
                                         '"refspec.eval" = "eval"}\n')
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_checker_finds_arrows_back_up_and_function_level_cycles(tmp_path):
    root = write_tree(tmp_path, {
        "refspec/__init__.py": "",
        "refspec/config.py": "",
        "refspec/engine.py": "from refspec import policy\nfrom refspec.energy import meters\n",
        "refspec/policy.py": "def build():\n    from refspec.engine import run\n",
        "refspec/energy/__init__.py": "",
        "refspec/energy/meters.py": "from refspec.config import X\nfrom . import writer\n",
        "refspec/energy/model/__init__.py": "",
        "refspec/energy/model/roofline.py": "from refspec.energy.ledger import events\n",
        "refspec/energy/ledger/__init__.py": "",
        "refspec/energy/ledger/events.py": "from refspec.energy.model import roofline\n",
        "refspec/energy/writer.py": "from refspec.scheduler import Clock\nimport torch.distributed\n",
        "refspec/scheduler.py": "",
        "eval/__init__.py": "",
        "eval/run.py": "from ..engine import Engine\nimport refspec.serve.app\n",
    })
    g = graph(root)
    assert g["refspec.engine"] == {"refspec.policy", "refspec.energy.meters"}
    assert g["refspec.eval.run"] == {"refspec.engine", "refspec.serve.app"}  # relative to eval's own folder
    assert g["refspec.energy.meters"] == {"refspec.config", "refspec.energy.writer"}
    assert bad_arrows(g) == {("refspec.energy.writer", "refspec.scheduler"),
                             ("refspec.energy.writer", "torch.distributed"),
                             ("refspec.eval.run", "refspec.serve.app")}
    assert energy_order_breaks(g) == {("refspec.energy.model.roofline", "refspec.energy.ledger.events")}
    assert sorted(sorted(c) for c in cycles(g)) == [["refspec.energy.ledger.events", "refspec.energy.model.roofline"],
                                                   ["refspec.engine", "refspec.policy"]]
