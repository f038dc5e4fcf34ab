"""Target models: logits equal transformers' on the same weights; cache and ragged batches."""

import pytest
import torch

from tiny import TINY_HF, hf_model

from refspec.config import ConfigError, ModelArgs
from refspec.models import CheckpointError, load_model


@pytest.mark.parametrize("name", list(TINY_HF))
def test_logits_match_transformers(name, tiny_models):
    hf = hf_model(name)
    ours = tiny_models[name]
    torch.manual_seed(1)
    s = 40  # longer than the tiny gemma3 window (8), so sliding layers matter
    toks = torch.randint(0, 96, (2, s))
    with torch.no_grad():
        ref = hf(toks).logits
    lg, _ = ours(toks, torch.arange(s)[None].expand(2, s), ours.new_cache(2, 64))
    assert (ref - lg).abs().max().item() < 1e-4, f"{name}: logits differ from transformers"
    assert torch.equal(ref.argmax(-1), lg.argmax(-1))


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma3"])
def test_incremental_cache_equals_full_forward(name, tiny_models):
    m = tiny_models[name]
    toks = torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(2))
    full, _ = m(toks, torch.arange(30)[None], m.new_cache(1, 64))
    cache = m.new_cache(1, 64)
    m(toks[:, :10], torch.arange(10)[None], cache)
    steps = []
    for i in range(10, 30):
        lg, _ = m(toks[:, i:i + 1], torch.tensor([[i]]), cache, num_keys=64)
        steps.append(lg[:, 0])
    inc = torch.stack(steps, 1)
    assert (inc - full[:, 10:]).abs().max().item() < 1e-4, "cached one-token steps must equal the full forward"


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "gemma3"])
def test_fused_projections_keep_split_names(name, tmp_path):
    """q/k/v and gate/up are one matrix each (one GEMM), but state dicts, checkpoints and
    load_state_dict keep the split names; a state-dict round trip reproduces the model."""
    from safetensors.torch import load_file
    from tiny import save_hf

    from refspec.models.loading import refspec_to_hf_name

    save_hf(name, tmp_path)
    model = load_model(tmp_path)
    attn, mlp = model.layers[0].attn, model.layers[0].mlp
    hf = load_file(str(tmp_path / "model.safetensors"))
    state = model.state_dict()
    assert not any(".wqkv." in k or ".gate_up." in k for k in state), "only split names are saved"
    fam = model.args.family
    for part in ("wq", "wk", "wv"):
        key = f"layers.0.attn.{part}.weight"
        assert torch.equal(state[key], hf[refspec_to_hf_name(fam, key)])
    assert torch.equal(state["layers.0.mlp.up.weight"], hf[refspec_to_hf_name(fam, "layers.0.mlp.up.weight")])
    assert attn.wqkv.weight.shape[0] == (attn.h + 2 * attn.hkv) * attn.d
    assert mlp.gate_up.weight.shape[0] == 2 * model.args.intermediate_size
    toks = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(12)[None].expand(2, 12)
    a, _ = model(toks, pos, model.new_cache(2, 16))
    other = load_model(tmp_path)
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    other.load_state_dict(model.state_dict())
    b, _ = other(toks, pos, other.new_cache(2, 16))
    assert torch.equal(a, b)


def test_hidden_layers_returned(tiny_models):
    m = tiny_models["llama"]
    toks = torch.randint(3, 96, (2, 5))
    lg, hid = m(toks, torch.arange(5)[None].expand(2, 5), m.new_cache(2, 8), hidden_layers=(0, m.num_layers))
    assert hid[0].shape == (2, 5, 64) and hid[1].shape == (2, 5, 64)
    assert torch.allclose(m.logits(hid[1]), lg), "the final hidden state feeds the LM head"
    with pytest.raises(ValueError, match="out of range"):
        m(toks, torch.arange(5)[None].expand(2, 5), m.new_cache(2, 8), hidden_layers=(99,))


def test_bf16_forward_close_to_fp32(tiny_models, tmp_path):
    from tiny import save_hf
    save_hf("qwen2", tmp_path)
    m16 = load_model(tmp_path, dtype=torch.bfloat16)
    m32 = tiny_models["qwen2"]
    toks = torch.randint(3, 96, (1, 12))
    pos = torch.arange(12)[None]
    a, _ = m32(toks, pos, m32.new_cache(1, 16))
    b, _ = m16(toks, pos, m16.new_cache(1, 16))
    assert b.dtype == torch.float32 and (a - b).abs().max().item() < 0.1


def test_strict_loading_lists_missing_and_unexpected(tmp_path):
    from safetensors.torch import load_file, save_file
    from tiny import save_hf
    save_hf("llama", tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    sd.pop("model.layers.0.mlp.up_proj.weight")
    sd["model.layers.0.mlp.mystery.weight"] = torch.zeros(2)
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing 1 keys.*up\.weight.*unexpected 1 keys.*mystery"):
        load_model(tmp_path)


def test_config_errors():
    with pytest.raises(ConfigError, match="model_type 'gpt2'"):
        ModelArgs.from_hf_config({"model_type": "gpt2"})
    with pytest.raises(ConfigError, match="lacks the field"):
        ModelArgs.from_hf_config({"model_type": "llama", "hidden_size": 8})


def test_config_round_trip():
    for name in TINY_HF:
        a = ModelArgs.from_hf_config(TINY_HF[name])
        assert ModelArgs.from_hf_config(a.to_hf_config()) == a
