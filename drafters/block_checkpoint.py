"""The block head's checkpoint: ``head.safetensors`` and a ``config.json`` (format
``refspec-block-head``, version 1) recording the head's shape, the architecture of the target
it was trained for and the training provenance. Loading refuses a head trained for another target.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from refspec.config import ModelArgs, read_json
from refspec.drafting import DrafterError

log = logging.getLogger(__name__)

HEAD_FORMAT = "refspec-block-head"
HEAD_VERSION = 1
WEIGHTS_FILE = "head.safetensors"
CONFIG_FILE = "config.json"
TARGET_FIELDS = ("hidden_size", "vocab_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "family")
"""Architecture fields a head must share with the target it serves."""


def save_head(head, path: str | Path, *, provenance: dict[str, Any] | None = None,
              dtype: torch.dtype | None = torch.bfloat16) -> Path:
    """Write ``config.json`` and ``head.safetensors`` of a :class:`~refspec.drafters.block_head.BlockHead`
    into the directory ``path`` (created); ``dtype`` is the weights' storage dtype (None keeps theirs)."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {n: (p.detach().to(dtype) if dtype is not None else p.detach()).contiguous().cpu()
               for n, p in head.state_dict().items()}
    tmp = out / (WEIGHTS_FILE + ".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, out / WEIGHTS_FILE)
    meta = {"format": HEAD_FORMAT, "version": HEAD_VERSION,
            "head": {**dataclasses.asdict(head.config), "feature_layers": list(head.config.feature_layers)},
            "target_args": dataclasses.asdict(head.target_args), "provenance": provenance or {}}
    (out / CONFIG_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    log.info("saved block head (%d parameters) to %s", sum(p.numel() for p in head.parameters()), out)
    return out


def read_head_config(folder: Path, target_args: ModelArgs | None) -> tuple[dict[str, Any], ModelArgs]:
    """The checkpoint's config and the target architecture it was trained for, checked against
    ``target_args`` (see :meth:`~refspec.drafters.block_head.BlockHead.load`)."""
    cfg_file, w_file = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not cfg_file.is_file() or not w_file.is_file():
        raise DrafterError(f"{folder} is not a block head directory (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    meta = read_json(cfg_file, DrafterError, missing=f"no {CONFIG_FILE} in {folder}")
    if meta.get("format") != HEAD_FORMAT or meta.get("version") != HEAD_VERSION:
        raise DrafterError(f"{cfg_file} is not a {HEAD_FORMAT} v{HEAD_VERSION} config "
                           f"(format={meta.get('format')!r}, version={meta.get('version')!r})")
    trained_for = _args_from_json(meta["target_args"])
    if target_args is not None:
        diff = {f: (getattr(trained_for, f), getattr(target_args, f)) for f in TARGET_FIELDS
                if getattr(trained_for, f) != getattr(target_args, f)}
        if diff:
            raise DrafterError(f"block head {folder} was trained for another target: "
                               + ", ".join(f"{f} {a} (head) vs {b} (target)" for f, (a, b) in diff.items()))
    return meta, trained_for


def _args_from_json(d: dict[str, Any]) -> ModelArgs:
    # JSON gives lists where ModelArgs keeps tuples (layer_types, eos_token_ids, dense_layers, ...)
    return ModelArgs(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
