"""The CLI edge: turning user flags into a loaded target, tokenizer and engine settings.

Everything here is for the command-line tools (``python -m refspec.eval`` and its ``generate``,
``bench``, ...); library users build models and engines directly.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from refspec.eval.flags import UsageError, add_sampling_args  # noqa: F401  (re-exported: the CLIs' names)

if TYPE_CHECKING:
    from refspec.models import PreparedTarget, Transformer

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
    """A target model ready to decode, with its tokenizer (None for weight-only directories).

    Attributes:
        name: the model id or directory given.
        path: its resolved directory.
        model: the model (what drafters read: its layers, embedding and LM head).
        tokenizer: its tokenizer, or None.
        prepared: the model readied for the run, what the engine runs
            (:func:`refspec.models.prepare_target`: CPU GEMM plan, compiled step or CUDA graphs,
            tensor-parallel share).
    """

    name: str
    path: Path
    model: Transformer
    tokenizer: Any | None
    prepared: PreparedTarget

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.tokenizer is not None:
            return tuple(self.tokenizer.eos_token_ids)
        return tuple(self.model.args.eos_token_ids)

    @property
    def fingerprint(self) -> str | None:
        return self.tokenizer.fingerprint() if self.tokenizer is not None else None


def load_target(name: str, *, dtype: torch.dtype, device: torch.device, progress: bool = True, tp: int = 1,
                compile: bool = False, cuda_graphs: bool = False) -> LoadedTarget:
    """Resolve a model id (fetched on first use) or a Hugging Face directory, load it (``tp`` > 1:
    this rank's share, :func:`refspec.models.tp.loading.load_sharded`) and ready it for the run
    (:func:`refspec.models.prepare_target` with ``compile`` and ``cuda_graphs``).

    Raises:
        UsageError: files that do not load (the message names ``--model``), or ``--tp`` outside a
            tensor-parallel group.
    """
    from refspec.assets import AssetError, resolve_model
    from refspec.assets.tokenizer import TokenizerError
    from refspec.config import ConfigError
    from refspec.models import load_model, prepare_target
    from refspec.models.loading import CheckpointError
    from refspec.models.tp.group import active
    from refspec.models.tp.loading import load_sharded

    group = active() if tp > 1 else None
    if tp > 1 and group is None:
        raise UsageError(f"--tp {tp} outside a tensor-parallel group: start it with torchrun")
    try:
        path = resolve_model(name, progress=progress)
        if group is not None:
            model = load_sharded(path, group, dtype=dtype, device=group.device)
        else:
            model = load_model(path, dtype=dtype, device=device)
        tok = None
        if (path / "tokenizer.json").exists():
            from refspec.assets.tokenizer import load_tokenizer

            tok = load_tokenizer(path)
    except (AssetError, CheckpointError, ConfigError, TokenizerError) as exc:  # the user's files: say which flag named them
        raise UsageError(f"--model {name}: {exc}") from exc
    prepared = prepare_target(model, compile=compile, cuda_graphs=cuda_graphs, tp=group)
    return LoadedTarget(name=name, path=path, model=model, tokenizer=tok, prepared=prepared)


def encode_prompt(target: LoadedTarget, text: str, *, chat: bool) -> list[int]:
    """Token ids of a user prompt, through the chat template when asked and available."""
    tok = target.tokenizer
    if tok is None:
        raise UsageError(f"{target.path} has no tokenizer.json; pass token ids instead of text")
    if chat and tok.has_chat_template:
        rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return tok.encode(rendered, add_special_tokens=False)
    return tok.encode(text)
