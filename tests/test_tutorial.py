"""docs/tutorial.md quotes, exactly, what the command it names prints (scripts/energy_tutorial.py)."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from refspec.energy.accounting.serving_window import WindowRule

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "tutorial.md"
MARK = re.compile(r"<!-- tutorial: (\w+) -->\n```\n(.*?)\n```", re.S)
NUMBER = re.compile(r"(?<![\w.-])\d+\.\d+%?|(?<![\w.-])\d+%")  # decimals and percents, not names like 3.1-8B


def _script():
    spec = importlib.util.spec_from_file_location("energy_tutorial", ROOT / "scripts" / "energy_tutorial.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tutorial_quotes_what_its_command_prints():
    printed = _script().blocks()
    text = DOC.read_text()
    quoted = dict(MARK.findall(text))
    assert quoted.keys() == printed.keys(), "every block printed is quoted once, and nothing else"
    for name, block in printed.items():
        assert quoted[name] == block, f"docs/tutorial.md block {name!r} differs from the command's output"
    # every figure in the prose comes from the output (or is a rule the accounting applies)
    prose = MARK.sub("", text)
    allowed = "\n".join(printed.values()) + f" {WindowRule().min_fill:g}"
    stray = [n for n in NUMBER.findall(prose) if n not in allowed]
    assert not stray, f"figures in docs/tutorial.md that the command does not print: {stray}"
