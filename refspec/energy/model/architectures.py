"""Architectures of well-known targets as Hugging Face ``config.json`` dicts (no weights), by name.

The roofline model (:mod:`refspec.energy.model.roofline`) and its CLI predict their costs; the GPU timing
runs build random-weight targets of them (:mod:`refspec.models.random_models`).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from refspec.config import ModelArgs

_GEMMA3 = dict(model_type="gemma3_text", rms_norm_eps=1e-6, rope_theta=1e6, rope_local_base_freq=1e4,
               sliding_window_pattern=6, hidden_activation="gelu_pytorch_tanh", bos_token_id=2,
               eos_token_id=[1, 106], pad_token_id=0, final_logit_softcapping=None, attn_logit_softcapping=None)

ARCHS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                         tie_word_embeddings=False, hidden_act="silu", bos_token_id=128000,
                         eos_token_id=[128001, 128008, 128009]),
    "llama-3.1-70b": dict(model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                          num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                          rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                          tie_word_embeddings=False, hidden_act="silu", bos_token_id=128000,
                          eos_token_id=[128001, 128008, 128009]),
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=False,
                     hidden_act="silu", attention_bias=False, bos_token_id=151643, eos_token_id=151645),
    "gemma-3-270m": dict(_GEMMA3, vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                         sliding_window=512, max_position_embeddings=32768),
    "gemma-3-1b": dict(_GEMMA3, vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                       num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                       sliding_window=512, max_position_embeddings=32768),
    "gemma-3-4b": dict(_GEMMA3, vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                       sliding_window=1024, max_position_embeddings=131072,
                       rope_scaling={"rope_type": "linear", "factor": 8.0}),
    "gemma-3-12b": dict(_GEMMA3, vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
                        sliding_window=1024, max_position_embeddings=131072,
                        rope_scaling={"rope_type": "linear", "factor": 8.0}),
    "gemma-3-27b": dict(_GEMMA3, vocab_size=262208, hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
                        num_attention_heads=32, num_key_value_heads=16, head_dim=128, query_pre_attn_scalar=168,
                        sliding_window=1024, max_position_embeddings=131072,
                        rope_scaling={"rope_type": "linear", "factor": 8.0}),
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
                         tie_word_embeddings=True, hidden_act="silu", bos_token_id=1, eos_token_id=2),
    # The Qwen2.5-Coder GGUFs refspec loads ship a separate output matrix (untied LM head).
    "qwen2.5-coder-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                               num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                               rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=32768,
                               tie_word_embeddings=False, hidden_act="silu", use_sliding_window=False,
                               bos_token_id=151643, eos_token_id=151645),
    "qwen2.5-coder-1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                               num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
                               rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=32768,
                               tie_word_embeddings=False, hidden_act="silu", use_sliding_window=False,
                               bos_token_id=151643, eos_token_id=151645),
    # Mixture-of-experts targets (config.json of Qwen/Qwen3-30B-A3B and mistralai/Mixtral-8x7B-v0.1).
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
                          rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=False, hidden_act="silu",
                          attention_bias=False, use_sliding_window=False, bos_token_id=151643, eos_token_id=151645),
    "mixtral-8x7b": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=1e6,
                         max_position_embeddings=32768, tie_word_embeddings=False, hidden_act="silu",
                         sliding_window=None, bos_token_id=1, eos_token_id=2),
}
"""Hugging Face style ``config.json`` dictionaries of the architectures the CLI knows."""


def dense_equivalent(args: ModelArgs) -> ModelArgs:
    """A dense model with an MoE model's active parameters: the same attention, embeddings and
    layers, one MLP of width k_e x (expert width) + any shared expert's width per layer (the
    router's X x E and the shared expert's gate are dropped).
    A dense model comes back unchanged."""
    if not args.is_moe:
        return args
    family = {"qwen3_moe": "qwen3", "mixtral": "llama", "qwen2_moe": "qwen2"}[args.family]
    width = args.num_experts_per_tok * args.moe_intermediate_size + args.shared_expert_intermediate_size
    return dataclasses.replace(args, family=family, intermediate_size=width, num_experts=0, num_experts_per_tok=0,
                               moe_intermediate_size=0, norm_topk_prob=False, dense_layers=(),
                               shared_expert_intermediate_size=0)


def arch(name: str) -> ModelArgs:
    """``ModelArgs`` of an :data:`ARCHS` entry, or of a ``config.json`` path / model directory."""
    if name in ARCHS:
        return ModelArgs.from_hf_config(ARCHS[name])
    if os.path.exists(name):
        return ModelArgs.from_file(name)
    raise ValueError(f"unknown architecture {name!r}; choose one of {', '.join(ARCHS)} or give a config.json path")
