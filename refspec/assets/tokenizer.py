"""Tokenizers without transformers at run time: ``tokenizer.json`` + ``tokenizer_config.json``.

The asset pipeline builds each tokenizer once with transformers and saves it
(:mod:`refspec.assets`); this module reloads it with the ``tokenizers`` library (well under a
second) and adds what the decode loop and the evaluation need:

- ``encode`` / ``decode`` exactly as transformers does for the same directory (the BOS rule
  lives in ``tokenizer.json``'s post-processor: Gemma adds ``<bos>``, SmolLM2 and Qwen add none);
- ``eos_token_ids``: the configured EOS plus chat end tokens (``<|im_end|>``, ``<end_of_turn>``...);
- ``apply_chat_template``: the model's Jinja chat template rendered with transformers'
  semantics (sandboxed, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``tojson``);
- ``fingerprint``: a sha256 of the vocabulary, merges and special tokens, so a draft/target pair
  with different tokenizers can be refused.
"""
from __future__ import annotations

import copy
import datetime
import functools
import hashlib
import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from refspec.config import read_json

# Special tokens that end a turn or a document in the supported families; each one present in
# the vocabulary as a special token counts as an end of sequence.
CHAT_END_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|endoftext|>", "<|end|>")
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class TokenizerError(ValueError):
    """A tokenizer directory that cannot be loaded, or a request it cannot serve."""


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json, written either as a string or as an
    ``AddedToken`` dictionary."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


@functools.lru_cache(maxsize=16)
def _compile_template(template: str):
    """Compile a chat template the way transformers does (sandboxed, same globals and filters)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text; render the body as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers overrides jinja's tojson, which would HTML-escape the text
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


class Tokenizer:
    """A saved tokenizer: ``tokenizers.Tokenizer`` plus the special tokens and chat template.

    Build with :func:`load_tokenizer`.
    """

    def __init__(self, backend: Any, config: Mapping[str, Any], source: Path) -> None:
        self._backend = backend
        self.config = dict(config)
        self.source = source
        self.special_tokens: dict[str, str] = {}
        for key in _SPECIAL_KEYS:
            text = _token_text(self.config.get(key))
            if text is not None:
                self.special_tokens[key] = text
        self.chat_template: str | None = self.config.get("chat_template") or None
        if isinstance(self.chat_template, list):  # named templates: use the default one
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default")
        self._fingerprint: str | None = None

    # ---- vocabulary ---------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def _special_id(self, key: str) -> int | None:
        text = self.special_tokens.get(key)
        return None if text is None else self._backend.token_to_id(text)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @functools.cached_property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: the configured EOS, then every chat end token present."""
        specials = {t.content for t in self._backend.get_added_tokens_decoder().values() if t.special}
        ids = [] if self.eos_token_id is None else [self.eos_token_id]
        for text in CHAT_END_TOKENS:
            tid = self._backend.token_to_id(text)
            if text in specials and tid is not None and tid not in ids:
                ids.append(tid)
        return tuple(ids)

    # ---- text <-> ids -------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds BOS where the model expects it."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode expects a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """:meth:`encode` of many texts (parallel in the Rust backend)."""
        return [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (special tokens kept unless ``skip_special_tokens``)."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # ---- chat ---------------------------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render a conversation with the model's chat template (transformers' semantics).

        Args:
            messages: ``[{"role": "user", "content": "..."}, ...]``.
            add_generation_prompt: append the header that starts the assistant's turn.
            **kwargs: extra template variables (``tools``, ``documents``, ...).

        Raises:
            TokenizerError: the tokenizer has no chat template.
        """
        if not self.chat_template:
            raise TokenizerError(f"the tokenizer at {self.source} has no chat template (a base model?); "
                                 f"encode plain text instead")
        for m in messages:
            if not isinstance(m, Mapping) or "role" not in m:
                raise TokenizerError(f"chat messages must be dicts with a 'role', got {m!r}")
        variables = {"tools": None, "documents": None, **self.special_tokens, **kwargs}
        return _compile_template(self.chat_template).render(
            messages=copy.deepcopy([dict(m) for m in messages]), add_generation_prompt=add_generation_prompt,
            **variables)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Ids of a rendered conversation; the template writes its own BOS, so none is added."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)

    # ---- identity -----------------------------------------------------------------------------
    def fingerprint(self) -> str:
        """sha256 of the vocabulary, the merges and the special tokens.

        Two tokenizers with equal fingerprints map every id to the same token, so a drafter and
        a target may exchange token ids.
        """
        if self._fingerprint is None:
            spec = json.loads(self._backend.to_str())
            model = spec.get("model", {})
            vocab = model.get("vocab", [])
            if isinstance(vocab, dict):  # BPE / WordPiece: token -> id
                entries = (f"{i}\x1f{t}" for t, i in sorted(vocab.items(), key=lambda kv: kv[1]))
            else:  # Unigram: [piece, score] in id order
                entries = (f"{i}\x1f{p[0]}\x1f{p[1]!r}" for i, p in enumerate(vocab))
            merges = ("\x1f".join(m.split(" ", 1) if isinstance(m, str) else m) for m in model.get("merges", []))
            added = (f"{t['id']}\x1f{t['content']}\x1f{int(bool(t.get('special')))}"
                     for t in sorted(spec.get("added_tokens", []), key=lambda t: t["id"]))
            special = (f"{k}\x1f{v}" for k, v in sorted(self.special_tokens.items()))
            digest = hashlib.sha256(str(model.get("type")).encode())
            for section in (entries, merges, added, special):
                digest.update(b"\x1d" + "\x1e".join(section).encode())
            self._fingerprint = digest.hexdigest()
        return self._fingerprint

    def __repr__(self) -> str:
        return (f"Tokenizer({self.source}, vocab={self.vocab_size}, bos={self.bos_token_id}, "
                f"eos={self.eos_token_ids}, chat_template={self.has_chat_template})")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load ``tokenizer.json`` (+ ``tokenizer_config.json`` when present) from a model directory.

    Args:
        path: a directory holding ``tokenizer.json``, or the ``tokenizer.json`` file itself.

    Raises:
        TokenizerError: no tokenizer.json, or a file the tokenizers library cannot read.
    """
    from tokenizers import Tokenizer as Backend

    path = Path(path)
    folder = path if path.is_dir() else path.parent
    file = folder / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise TokenizerError(f"no tokenizer.json at {folder}; fetch or convert the model with "
                             f"`python -m refspec.eval assets` first")
    try:
        backend = Backend.from_file(str(file))
    except Exception as exc:  # the Rust library raises a bare Exception
        raise TokenizerError(f"{file} is not a valid tokenizer.json: {exc}") from None
    config: dict[str, Any] = {}
    config_file = folder / "tokenizer_config.json"
    if config_file.is_file():
        config = read_json(config_file, TokenizerError, missing=f"no tokenizer_config.json at {folder}")
    template_file = folder / "chat_template.jinja"  # transformers 5 saves the template separately
    if "chat_template" not in config and template_file.is_file():
        config["chat_template"] = template_file.read_text()
    return Tokenizer(backend, config, folder)
