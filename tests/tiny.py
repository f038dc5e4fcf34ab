"""Tiny random models of each family, built through transformers so our loader is exercised."""
from __future__ import annotations

from pathlib import Path

import torch

from refspec.config import ModelArgs

TINY_HF = {
    "llama": dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                  max_position_embeddings=512, tie_word_embeddings=True, hidden_act="silu",
                  bos_token_id=1, eos_token_id=2),
    "llama3": dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-5, rope_theta=500000.0,
                   max_position_embeddings=2048, tie_word_embeddings=False, hidden_act="silu",
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                   bos_token_id=1, eos_token_id=2),
    "qwen2": dict(model_type="qwen2", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1e6,
                  max_position_embeddings=512, tie_word_embeddings=False, hidden_act="silu", use_sliding_window=False,
                  bos_token_id=1, eos_token_id=2),
    "qwen3": dict(model_type="qwen3", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e6,
                  max_position_embeddings=512, tie_word_embeddings=True, hidden_act="silu", attention_bias=False,
                  bos_token_id=1, eos_token_id=2),
    "gemma3": dict(model_type="gemma3_text", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e6,
                   rope_local_base_freq=10000.0, sliding_window=8, query_pre_attn_scalar=32,
                   max_position_embeddings=512, hidden_activation="gelu_pytorch_tanh",
                   layer_types=["sliding_attention"] * 5 + ["full_attention"],
                   bos_token_id=1, eos_token_id=2, pad_token_id=0),
}


def hf_model(name: str, seed: int = 0):
    """A transformers model of a tiny config with random (non-trivial) weights, fp32."""
    import transformers

    cfg = dict(TINY_HF[name])
    config = transformers.AutoConfig.for_model(**cfg)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():  # norms start at identity; perturb them so mapping mistakes show
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
            if n.endswith("bias"):
                p.normal_(0, 0.1)
    return model.eval()


def save_hf(name: str, path: Path, seed: int = 0):
    model = hf_model(name, seed)
    model.save_pretrained(path, safe_serialization=True)
    return model


def tiny_args(name: str) -> ModelArgs:
    return ModelArgs.from_hf_config(TINY_HF[name])


def copy_plan():
    """A CPU GEMM plan with weight copies: column-major for one fp32 row, (W x^T)^T for several;
    F.linear for one half-precision row, fp32 copies for several."""
    from refspec.models.calibration import GemmPlan

    half = {"one": "linear", "few": "fp32", "many": "fp32"}
    return GemmPlan(forms={"fp32": {"one": "column", "few": "wxt", "many": "wxt"}, "bf16": half, "fp16": half},
                    timings_s={}, machine={})


def packed_plan():
    """A CPU GEMM plan through oneDNN-packed weight copies for every fp32 product and for
    several bf16 rows (one bf16 row with oneDNN off)."""
    from refspec.models.calibration import GemmPlan

    return GemmPlan(forms={"fp32": {"one": "packed", "few": "packed", "many": "packed"},
                           "bf16": {"one": "nodnn", "few": "packed", "many": "packed"}}, timings_s={}, machine={})


def packed_form_runs(dtype=None) -> bool:
    """Whether this torch and CPU run the oneDNN ``packed`` form in ``dtype`` (fp32 by default);
    where they do not, asserts that calibration never offers it (the property to prove there)."""
    import torch

    from refspec.models import calibration as C

    dtype = torch.float32 if dtype is None else dtype
    if C.packed_supported(dtype):
        return True
    assert "packed" not in C.candidate_forms(C.dtype_name(dtype)), "an unsupported form must not be timed"
    return False


def save_tokenizer(folder: Path) -> None:
    """A 96-word WordLevel tokenizer (ids match the tiny models' vocabulary) with a chat template."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, 96)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(folder / "tokenizer.json"))
    template = ("{% for m in messages %}<s> {{ m['content'] }} {% endfor %}"
                "{% if add_generation_prompt %}w3 {% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": template,
         "tokenizer_class": "PreTrainedTokenizerFast"}))
