"""Random-weight targets of real architectures, for timing and energy at full size.

Timing and energy of 8B-class targets need the real shapes, not the real weights: every
weight is read once per step whatever its value. :func:`random_model` builds a
:class:`~refspec.models.Transformer` of an architecture from :data:`refspec.energy.model.architectures.ARCHS`
(Llama-3.1-8B, Qwen3-8B, Gemma 3 270M..27B, ...) directly on the target device: the modules
are created on the ``meta`` device (no memory), cast to the run's dtype there, materialised
with ``to_empty`` on the device and filled in place by an explicit generator. Host RAM never
holds the weights; an 8B model in bf16 takes 16 GB of device memory and a second or two.

Values: matrices and embeddings ``N(0, std^2)`` (default std 0.02), biases 0, norm weights
at identity (1, or 0 for Gemma's ``1 + w`` norms). With pre-norm blocks every layer's input
is RMS-normalised, so activations stay O(1) and logits stay finite (|logit| ~ std * sqrt(E)).
The outputs are meaningless text; pair such a model with injected acceptance
(:mod:`refspec.eval.injection`) and say so.

:func:`shrunk_config` keeps an architecture's family, flags and head ratios at toy sizes, for
dry runs of the full-size scripts on a CPU.
"""
from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from refspec.config import ModelArgs
from refspec.energy.model.architectures import ARCHS

log = logging.getLogger(__name__)

DEFAULT_STD = 0.02

FULL_SIZE_TARGETS = ("llama-3.1-8b", "qwen3-8b", "gemma-3-4b", "gemma-3-12b", "gemma-3-27b")
"""Architectures of :data:`refspec.energy.model.architectures.ARCHS` the GPU timing runs use as random targets."""

MOE_TARGETS = ("qwen3-30b-a3b", "mixtral-8x7b")
"""Mixture-of-experts architectures of :data:`~refspec.energy.model.architectures.ARCHS` (Qwen3-30B-A3B
fits an H200 in bf16: 61 GB of weights)."""


def arch_args(arch: str | ModelArgs | dict[str, Any]) -> ModelArgs:
    """``ModelArgs`` of an :data:`~refspec.energy.model.architectures.ARCHS` name, a HF config dict, or ModelArgs."""
    if isinstance(arch, ModelArgs):
        return arch
    if isinstance(arch, dict):
        return ModelArgs.from_hf_config(arch)
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    return ModelArgs.from_hf_config(ARCHS[arch])


def shrunk_config(arch: str, *, hidden_size: int = 256, num_layers: int = 2, vocab_size: int = 2048,
                  intermediate_size: int | None = None, head_dim: int = 64) -> dict[str, Any]:
    """A toy HF config of the same family as ``arch`` (flags, GQA ratio, rope kind kept; an MoE
    architecture keeps its experts and top-k, each expert a quarter of the MLP width).

    Args:
        arch: a name in :data:`~refspec.energy.model.architectures.ARCHS`.
        hidden_size: E of the toy.
        num_layers: L of the toy (Gemma keeps its sliding/full pattern over these layers).
        vocab_size: V of the toy.
        intermediate_size: MLP width (default 2 E).
        head_dim: D of the toy.

    Returns:
        A config dict for ``ModelArgs.from_hf_config``.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    cfg = copy.deepcopy(ARCHS[arch])
    ratio = cfg["num_attention_heads"] // cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    heads = max(ratio, hidden_size // head_dim)
    heads -= heads % ratio
    cfg.update(hidden_size=hidden_size, num_hidden_layers=num_layers, vocab_size=vocab_size,
               intermediate_size=intermediate_size or 2 * hidden_size, num_attention_heads=heads,
               num_key_value_heads=heads // ratio, head_dim=head_dim)
    if "moe_intermediate_size" in cfg:  # qwen3_moe: expert width half the dense width, experts as they are
        cfg["moe_intermediate_size"] = max(8, cfg["intermediate_size"] // 4)
    if "query_pre_attn_scalar" in cfg:
        cfg["query_pre_attn_scalar"] = head_dim
    if cfg.get("sliding_window"):
        cfg["sliding_window"] = min(cfg["sliding_window"], 64)
        cfg["layer_types"] = ["full_attention" if (i + 1) % 2 == 0 else "sliding_attention"
                              for i in range(num_layers)]
    for tok in ("bos_token_id", "pad_token_id"):
        if isinstance(cfg.get(tok), int) and cfg[tok] >= vocab_size:
            cfg[tok] = 1
    eos = cfg.get("eos_token_id")
    eos_list = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    cfg["eos_token_id"] = [e for e in eos_list if e < vocab_size] or [2]
    return cfg


def random_model(arch: str | ModelArgs | dict[str, Any], *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.bfloat16, seed: int = 0, std: float = DEFAULT_STD) -> Any:
    """A random-weight ``Transformer`` of a real architecture, built on ``device``.

    Args:
        arch: architecture name (:data:`~refspec.energy.model.architectures.ARCHS`), HF config dict or ModelArgs.
        device: where the weights live (they are never materialised elsewhere).
        dtype: weight dtype (bf16 for timing runs).
        seed: seed of the generator filling the weights.
        std: standard deviation of matrices and embeddings.

    Returns:
        The model in eval mode, with rotary tables on ``device``.
    """
    from refspec.models.transformer import Transformer

    args = arch_args(arch)
    dev = torch.device(device)
    with torch.device("meta"):
        model = Transformer(args)
    model = model.to(dtype=dtype).to_empty(device=dev)
    if args.tie_word_embeddings:  # to_empty may give the two modules separate tensors
        model.lm_head.weight = model.embed.weight
    gen = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(0.0 if args.norm_plus_one else 1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=gen)
    model.init_buffers(dev)
    model.eval().requires_grad_(False)
    n = sum(p.numel() for p in model.parameters())
    log.info("random %s: %.2f B parameters, %s on %s", getattr(arch, "family", arch) if not isinstance(arch, str)
             else arch, n / 1e9, dtype, dev)
    return model


__all__ = ["random_model", "shrunk_config", "arch_args", "write_random_model_dir", "FULL_SIZE_TARGETS", "MOE_TARGETS",
           "DEFAULT_STD"]


def write_random_model_dir(arch: str, path: str, *, tokenizer_from: str, seed: int = 0, num_layers: int = 2,
                           hidden_size: int = 256) -> ModelArgs:
    """Write a directory ``python -m refspec.eval --model`` loads: a random-weight toy of ``arch``
    (:func:`shrunk_config`, fp32) sized to the vocabulary of ``tokenizer_from`` (a model id or a
    directory with ``tokenizer.json``), whose tokenizer files it copies.

    Returns:
        The architecture written.
    """
    import json
    import shutil
    from pathlib import Path

    from refspec.assets import resolve_model
    from refspec.models.loading import save_model

    src = Path(tokenizer_from) if Path(tokenizer_from).is_dir() else Path(resolve_model(tokenizer_from))
    if not (src / "tokenizer.json").exists():
        raise ValueError(f"{src} has no tokenizer.json to copy")
    vocab = int(json.loads((src / "config.json").read_text())["vocab_size"])
    cfg = shrunk_config(arch, hidden_size=hidden_size, num_layers=num_layers, vocab_size=vocab)
    model = random_model(cfg, dtype=torch.float32, seed=seed)
    out = Path(path)
    save_model(model, out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    return model.args


def main(argv: list[str] | None = None) -> int:
    """``python -m refspec.models.random_models DIR --arch A --tokenizer-from M``."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m refspec.models.random_models",
                                description="Write a random-weight toy of a named architecture (shrunk_config) "
                                            "with a real tokenizer, for CPU runs of python -m refspec.eval.")
    p.add_argument("dir")
    p.add_argument("--arch", required=True, choices=sorted(ARCHS))
    p.add_argument("--tokenizer-from", default="smollm2-135m", help="model id or directory with tokenizer.json")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    try:
        args = write_random_model_dir(a.arch, a.dir, tokenizer_from=a.tokenizer_from, seed=a.seed,
                                      num_layers=a.layers, hidden_size=a.hidden)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}".splitlines()[0], file=__import__("sys").stderr)
        return 2
    print(f"wrote {a.dir}: {args.family}, {args.num_parameters() / 1e6:.1f} M parameters"
          + (f", {args.num_experts} experts (top {args.num_experts_per_tok})" if args.is_moe else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
