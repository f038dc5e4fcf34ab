"""The drawing of imports inside ``eval/``: no circle, no arrow back up, no private name borrowed.

Every import counts, at any depth of a module (a function-level import that closes a loop is
still a loop) and under ``TYPE_CHECKING``. The floors, bottom to top: what every command
stands on; what a configuration is and what it produces (the stream, the record); the pipeline
and the record's figures; running configurations; the report; the commands.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EVAL = ROOT / "eval"
FLOORS = (
    ("flags", "interrupts", "outputs", "machine", "mixed_corpus", "acceptance_models", "injection", "audit",
     "audit_noise", "bench_timing", "roofline_check", "roofline_policy", "corpora", "record_json"),
    ("prompt_sets", "requests", "policy_setup", "run_config", "record", "load", "record_files", "prefill_work", "runtime",
     "tp_launch", "roofline_tp"),
    ("pipeline", "record_figures", "baseline", "session"),
    ("run", "sweep", "sweep_dir"),
    ("report_text", "report_serving", "plots", "report_requests", "policy_report", "report"),
    ("cli", "cli_args", "cli_checks", "cli_checks_paper", "cli_plan", "cli_report", "generate", "bench", "roofline_cli",
     "assets_cli", "train", "train_data", "calibrate_cli", "dvfs_cli", "paper", "lab", "__main__", "__init__"),
)
"""Each module's floor (a package by its first name): a module imports its own floor or those below."""


def _name(path: Path) -> str:
    parts = path.relative_to(EVAL).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def _modules() -> dict[str, Path]:
    return {_name(p): p for p in EVAL.rglob("*.py")}


def _imports(path: Path, known: set[str]) -> set[tuple[str, str]]:
    """``(module, name)`` of every ``refspec.eval`` import in ``path`` (name: what ``from ... import`` took)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("refspec.eval"):
            base = node.module[len("refspec.eval"):].lstrip(".")
            for alias in node.names:
                sub = f"{base}.{alias.name}".lstrip(".")
                out.add((sub, "") if sub in known else (base or "__init__", alias.name))
        elif isinstance(node, ast.Import):
            out |= {(a.name[len("refspec.eval."):], "") for a in node.names if a.name.startswith("refspec.eval.")}
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: {t for t, _ in _imports(p, set(mods)) if t != m and t in mods} for m, p in mods.items()}


def _floor(module: str) -> int:
    head = module.split(".")[0]
    found = [i for i, names in enumerate(FLOORS) if head in names]
    assert found, f"eval/{module}: no floor; add it to FLOORS"
    return found[0]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_circle_inside_eval():
    assert _cycles(_graph()) == []


def test_no_arrow_back_up():
    graph = _graph()
    up = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if _floor(b) > _floor(a))
    assert up == [], up


def test_no_private_name_is_imported_from_another_module():
    mods = _modules()
    borrowed = sorted(f"{m} imports {name} from {src}" for m, p in mods.items() for src, name in _imports(p, set(mods))
                      if name.startswith("_") and src != m)
    assert borrowed == [], borrowed
