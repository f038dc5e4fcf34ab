"""Prompt building: corpus rows to the token ids a target is prompted with.

Chat rows go through the tokenizer's chat template (when ``chat``), code rows are completed as
raw text, prose rows are cut to a prefix the model continues.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from refspec.eval.corpora.catalog import CORPORA, KINDS


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


def continuation_windows(full: Sequence[int], prose_tokens: int = 128) -> list[list[int]]:
    """Every continuation prompt of one prose text, for request streams longer than the corpus.

    The first is :func:`build_prompts`' own (the first ``n = min(prose_tokens, len // 2)``
    tokens, at least 1); the others are windows of the same ``n`` tokens ending at later cut
    points ``n / 4`` apart (at least 1), each leaving at least ``n / 2`` tokens of the text
    after it, so the target still continues inside the same text.
    """
    n = min(prose_tokens, max(1, len(full) // 2))
    cuts = range(n, len(full) - max(1, n // 2) + 1, max(1, n // 4))
    return [list(full[c - n:c]) for c in cuts] or [list(full[:n])]


def prose_windows(dataset: Iterable[Mapping[str, Any]], tokenizer: PromptTokenizer, *,
                  prose_tokens: int = 128) -> list[list[list[int]]]:
    """:func:`continuation_windows` of every prose row (``[]`` for chat and code rows), in order."""
    out: list[list[list[int]]] = []
    for row in dataset:
        corpus = row.get("corpus", "")
        kind = row.get("kind") or (CORPORA[corpus].kind if corpus in CORPORA else "chat")
        if kind != "prose":
            out.append([])
            continue
        full = _as_ids(tokenizer.encode(row.get("text") or row["prompt"]), "encode")
        out.append(continuation_windows(full, prose_tokens) if full else [])
    return out


__all__ = ["PromptTokenizer", "build_prompts", "continuation_windows", "prose_windows"]
