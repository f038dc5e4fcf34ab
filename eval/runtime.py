"""The CLI edge: turning user flags into a loaded target, tokenizer and engine settings.

Everything here is for command-line tools (``refspec.generate``, ``refspec.bench``,
``refspec.eval``); library users build models and engines directly.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import torch

from refspec.eval.flags import UsageError, add_sampling_args  # noqa: F401  (re-exported: the CLIs' names)

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise UsageError(f"--dtype {name!r} is unknown; use fp32, bf16 or fp16") from None


def pick_device(name: str) -> torch.device:
    """``auto`` is CUDA when present, else CPU; an unavailable device is a clear error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device {name!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name!r} requested but this torch build sees no CUDA GPU; use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UsageError(f"--device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {name!r}: refspec runs on cpu or cuda")
    return dev


def set_threads() -> None:
    """Use every core for intra-op work unless the user set OMP_NUM_THREADS."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(os.cpu_count() or 1)


@dataclasses.dataclass
class LoadedTarget:
    """A target model ready to decode, with its tokenizer (None for weight-only directories)."""

    name: str
    path: Path
    model: Any
    tokenizer: Any | None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.tokenizer is not None:
            return tuple(self.tokenizer.eos_token_ids)
        return tuple(self.model.args.eos_token_ids)

    @property
    def fingerprint(self) -> str | None:
        return self.tokenizer.fingerprint() if self.tokenizer is not None else None


def load_target(name: str, *, dtype: torch.dtype, device: torch.device, progress: bool = True,
                tp: int = 1) -> LoadedTarget:
    """Resolve a model id (fetched on first use) or a Hugging Face directory and load it (``tp`` > 1:
    this rank's share, :func:`refspec.eval.tp_launch.load_tp_model`)."""
    from refspec.assets import resolve_model
    from refspec.models import load_model

    from refspec.assets import AssetError
    from refspec.assets.tokenizer import TokenizerError
    from refspec.config import ConfigError
    from refspec.models.loading import CheckpointError

    try:
        path = resolve_model(name, progress=progress)
        if tp > 1:
            from refspec.eval.tp_launch import load_tp_model

            model = load_tp_model(path, dtype)
        else:
            model = load_model(path, dtype=dtype, device=device)
        tok = None
        if (path / "tokenizer.json").exists():
            from refspec.assets.tokenizer import load_tokenizer

            tok = load_tokenizer(path)
    except (AssetError, CheckpointError, ConfigError, TokenizerError) as exc:  # the user's files: say which flag named them
        raise UsageError(f"--model {name}: {exc}") from exc
    return LoadedTarget(name=name, path=path, model=model, tokenizer=tok)


def encode_prompt(target: LoadedTarget, text: str, *, chat: bool) -> list[int]:
    """Token ids of a user prompt, through the chat template when asked and available."""
    tok = target.tokenizer
    if tok is None:
        raise UsageError(f"{target.path} has no tokenizer.json; pass token ids instead of text")
    if chat and tok.has_chat_template:
        rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return tok.encode(rendered, add_special_tokens=False)
    return tok.encode(text)
