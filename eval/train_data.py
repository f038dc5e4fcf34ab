"""Training text for ``python -m refspec.eval train``: the mix, its cache, and the target's replies.

Training text is disjoint from every evaluation prompt: it comes only from the ``train`` split
of refspec's corpora (``refspec.eval.corpora``; the split is decided by a salted hash of each
record, and :func:`~refspec.eval.corpora.catalog.assert_disjoint` is checked here again):

- the target's own greedy replies (self-distillation) to ``conversation``, ``math`` and
  ``code`` training prompts, generated with the engine;
- further training prompts with the reference answers their corpus ships (chat-templated),
  which are cheaper than decoding on a CPU;
- ``english-sotu`` training speeches, cut into chunks (prose the target continues).

Labels are always the target's own greedy next token (its argmax at every position), so a
drafter learns what this target would say even on text it did not write.

Two caches: the sequences of one :class:`DataSpec` (one file per spec), and a
:class:`ReplyCache` of every self-distilled reply a target has given, keyed by prompt, so a
larger mix decodes only the prompts it adds.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from pathlib import Path
from typing import Any, Sequence

from refspec.eval.outputs import write_atomic

SOURCES = ("conversation", "math", "code")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataSpec:
    """What text to train on (all from train splits).

    Attributes:
        chat_prompts: conversation training prompts replied to by the target (self-distilled).
        math_prompts: math training questions replied to by the target.
        code_prompts: code training prompts completed by the target.
        reply_tokens: reply budget per self-distilled prompt.
        chat_references: further conversation prompts with their reference answers, as chats
            (the target's argmax at every answer position is still the label).
        math_references: math questions with their worked answers, as chats.
        code_references: code prompts with their canonical completions.
        prose_chunks: english-sotu chunks of ``max_len`` tokens.
        max_len: longest training sequence, in tokens.
        seed: shuffles which prompts are used.
        distill_references: also self-distill the prompts of the reference answers (each then
            trains twice: on its reference and on the target's reply).
        reference_cuts: ``(source, K)`` pairs: every row of that source in the mix that has a
            reference answer is also cut inside its answer at K evenly spaced points, and the
            target's greedy continuation from each cut is trained on (more of the target's own
            text from the same prompts, which block drafters need).
    """

    chat_prompts: int = 48
    math_prompts: int = 8
    code_prompts: int = 8
    reply_tokens: int = 128
    chat_references: int = 64
    math_references: int = 16
    code_references: int = 16
    prose_chunks: int = 16
    max_len: int = 384
    seed: int = 0
    distill_references: bool = False
    reference_cuts: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        for source, k in self.reference_cuts:
            if source not in SOURCES or k < 0:
                raise ValueError(f"reference cuts take a source of {', '.join(SOURCES)} and a count >= 0, "
                                 f"got {source}={k}")

    def fields(self) -> dict[str, Any]:
        """The spec as a dict; the later fields only when set, so earlier specs keep their keys."""
        out = dataclasses.asdict(self)
        for late in ("distill_references", "reference_cuts"):
            if not out[late]:
                del out[late]
        return out

    def key(self, model: str) -> str:
        raw = json.dumps({"model": model, **self.fields()}, sort_keys=True)
        return hashlib.sha256(raw.encode()).hexdigest()[:12]

    def plan(self) -> dict[str, tuple[int, int]]:
        """(self-distilled prompts, reference answers) per source."""
        return {"conversation": (self.chat_prompts, self.chat_references),
                "math": (self.math_prompts, self.math_references),
                "code": (self.code_prompts, self.code_references)}


class ReplyCache:
    """A target's greedy replies, keyed by (prompt ids, reply budget); saved atomically as it grows."""

    def __init__(self, path: Path | None):
        self.path = path
        self._replies: dict[str, list[int]] = {}
        if path is not None and path.exists():
            self._replies = json.loads(path.read_text())["replies"]

    @staticmethod
    def _key(prompt: Sequence[int], budget: int) -> str:
        return hashlib.sha256(json.dumps([list(prompt), budget]).encode()).hexdigest()

    def __len__(self) -> int:
        return len(self._replies)

    def get(self, prompt: Sequence[int], budget: int) -> list[int] | None:
        return self._replies.get(self._key(prompt, budget))

    def put(self, prompt: Sequence[int], budget: int, reply: Sequence[int]) -> None:
        self._replies[self._key(prompt, budget)] = list(reply)

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path, json.dumps({"replies": self._replies}).encode())


def distill_with_cache(target, prompts: list[list[int]], *, budget: int, eos_token_ids: Sequence[int],
                       replies: ReplyCache, source: str, progress: bool, chunk: int = 64) -> list:
    """Self-distilled sequences for ``prompts``, decoding only those ``replies`` lacks.

    The missing prompts are decoded ``chunk`` at a time and the cache saved after each chunk,
    so an interrupted build keeps what it decoded.
    """
    from refspec.drafters.training import TrainingSequence, self_distill

    missing = [p for p in dict.fromkeys(map(tuple, prompts)) if replies.get(p, budget) is None]
    for start in range(0, len(missing), chunk):
        part = [list(p) for p in missing[start:start + chunk]]
        for seq, p in zip(self_distill(target, part, max_new_tokens=budget, batch_size=16,
                                       eos_token_ids=eos_token_ids, progress=progress, source=source), part):
            replies.put(p, budget, seq.tokens[len(p):])
        replies.save()
    return [TrainingSequence(tokens=p + replies.get(p, budget), train_from=len(p) - 1, source=source)
            for p in prompts]


def _shuffled(rows: list[dict[str, str]], seed: int) -> list[dict[str, str]]:
    rows = sorted({r["prompt"]: r for r in rows}.values(), key=lambda r: r["prompt"])
    random.Random(seed).shuffle(rows)
    return rows


def _train_rows(seed: int) -> tuple[dict[str, list[dict[str, str]]], list[str]]:
    """Shuffled train rows per source and the prose documents, checked disjoint from every eval split."""
    from refspec.eval.corpora import catalog as corpora

    rows = {name: _shuffled([dict(r) for r in corpora.load_corpus(name, split="train")], seed) for name in SOURCES}
    prose_docs = corpora.training_texts("english-sotu")
    for name, texts in [(n, [r["text"] for r in rs]) for n, rs in rows.items()] + [("english-sotu", prose_docs)]:
        corpora.assert_disjoint(texts, list(corpora.load_corpus(name, split="eval")["prompt"]))
    for name in ("english", "romansh"):  # prose eval prompts must not hide inside the speeches either
        corpora.assert_disjoint(prose_docs, list(corpora.load_corpus(name, split="eval")["prompt"]))
    return rows, prose_docs


def _prose_chunks(tokenizer, docs: list[str], spec: DataSpec) -> list[list[int]]:
    """The first ``max_len`` tokens of evenly spaced speeches."""
    chunks: list[list[int]] = []
    for doc in sorted(docs)[:: max(1, len(docs) // max(1, spec.prose_chunks))]:
        ids = tokenizer.encode(doc)
        if len(ids) >= spec.max_len:
            chunks.append(ids[:spec.max_len])
    return chunks[:spec.prose_chunks]


def build_sequences(target, tokenizer, spec: DataSpec, *, replies: ReplyCache | None = None, progress: bool = True):
    """Training sequences for ``target`` from the corpora's train splits (see the module doc).

    Returns:
        ``(sequences, description)``; description records sources, counts and the
        disjointness check.
    """
    from refspec.drafters.training import TrainingSequence

    rows, prose_docs = _train_rows(spec.seed)
    replies = replies if replies is not None else ReplyCache(None)

    def prompt_ids(source: str, text: str) -> list[int]:
        if source == "code":
            return tokenizer.encode(text)
        return tokenizer.encode_chat([{"role": "user", "content": text}])

    def reference(source: str, row: dict[str, str]) -> TrainingSequence:
        p = prompt_ids(source, row["prompt"])
        if source == "code":
            full = tokenizer.encode(row["prompt"] + row["reference"])
        else:
            full = tokenizer.encode_chat([{"role": "user", "content": row["prompt"]},
                                          {"role": "assistant", "content": row["reference"]}],
                                         add_generation_prompt=False)
        start = len(p) - 1 if full[: len(p)] == p else 0
        return TrainingSequence(tokens=full[: spec.max_len], train_from=start, source=f"{source}:reference")

    seqs: list = []
    for source, (n_distill, n_ref) in spec.plan().items():
        distilled = rows[source][:n_distill + (n_ref if spec.distill_references else 0)]
        prompts = [prompt_ids(source, r["prompt"])[:spec.max_len - spec.reply_tokens] for r in distilled]
        if prompts:
            seqs += distill_with_cache(target, prompts, budget=spec.reply_tokens, eos_token_ids=tokenizer.eos_token_ids,
                                       replies=replies, source=f"{source}:self-distill", progress=progress)
        seqs += [reference(source, r) for r in rows[source][n_distill:n_distill + n_ref] if r["reference"]]
        cuts = dict(spec.reference_cuts).get(source, 0)
        cut = [c for r in rows[source][:n_distill + n_ref] if cuts and r["reference"]
               for c in _cut_prompts(prompt_ids(source, r["prompt"]), reference(source, r).tokens, cuts,
                                     spec.max_len - spec.reply_tokens)]
        if cut:
            seqs += distill_with_cache(target, cut, budget=spec.reply_tokens, eos_token_ids=tokenizer.eos_token_ids,
                                       replies=replies, source=f"{source}:cut-distill", progress=progress)
    seqs += [TrainingSequence(tokens=c, train_from=0, source="english-sotu:prose")
             for c in _prose_chunks(tokenizer, prose_docs, spec)]
    return seqs, _describe(seqs, spec)


def _cut_prompts(prompt: list[int], full: list[int], cuts: int, longest: int) -> list[list[int]]:
    """``full`` (prompt then answer) cut inside its answer at ``cuts`` evenly spaced points, each
    at most ``longest`` tokens long; cuts that would not leave answer tokens are dropped."""
    start = next((i for i, (a, b) in enumerate(zip(prompt, full)) if a != b), min(len(prompt), len(full)))
    answer = len(full) - start
    ends = {min(start + answer * i // (cuts + 1), longest) for i in range(1, cuts + 1)}
    return [full[:e] for e in sorted(ends) if e > start]


def _describe(seqs: list, spec: DataSpec) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for s in seqs:
        counts[s.source] = counts.get(s.source, 0) + 1
    return {"sources": counts, "spec": spec.fields(), "tokens": sum(len(s.tokens) for s in seqs),
            "corpora": "train splits of refspec.eval.corpora: the target's greedy replies (self-distill) to "
                       "conversation/math/code prompts, reference answers of further prompts, english-sotu "
                       "speech chunks; the hard labels are always the target's own argmax "
                       "(soft_labels adds its distribution)",
            "disjoint_from_eval": True}


def save_sequences(path: Path, seqs, description: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({"description": description,
                                   "sequences": [dataclasses.asdict(s) for s in seqs]}).encode())


def load_sequences(path: Path):
    from refspec.drafters.training import TrainingSequence

    raw = json.loads(path.read_text())
    return [TrainingSequence(**s) for s in raw["sequences"]], raw["description"]
