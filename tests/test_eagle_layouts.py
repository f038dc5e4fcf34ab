"""EAGLE heads in published layouts (EAGLE-1 with its fc bias, EAGLE-3 with its reduced
vocabulary and layer ids) load strictly, and draft losslessly."""
import json

import pytest
import torch

from refspec.drafters.eagle import EagleDrafter, Eagle3Head, load_head
from refspec.drafting import DrafterError
from refspec.engine import Engine, EngineConfig

from test_eagle import TREE, _prompts, target  # noqa: F401 - the shared prompts, tree and target fixture


def _llama_config(e=64, heads=4, kv=2, inter=128, vocab=96, **extra):
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": e,
            "num_attention_heads": heads, "num_key_value_heads": kv, "intermediate_size": inter,
            "num_hidden_layers": 1, "vocab_size": vocab, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "hidden_act": "silu", "bias": True, **extra}


def _published_eagle1(e=64, kv_dim=32, inter=128, vocab=96):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g) * 0.05  # noqa: E731
    return {"fc.weight": r(e, 2 * e), "fc.bias": r(e), "embed_tokens.weight": r(vocab, e),
            "layers.0.self_attn.q_proj.weight": r(e, e), "layers.0.self_attn.k_proj.weight": r(kv_dim, e),
            "layers.0.self_attn.v_proj.weight": r(kv_dim, e), "layers.0.self_attn.o_proj.weight": r(e, e),
            "layers.0.mlp.gate_proj.weight": r(inter, e), "layers.0.mlp.up_proj.weight": r(inter, e),
            "layers.0.mlp.down_proj.weight": r(e, inter), "layers.0.post_attention_layernorm.weight": 1 + r(e)}


def _published_eagle3(e=64, kv_dim=32, inter=128, vocab=96, draft=48):
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g) * 0.05  # noqa: E731
    used = torch.randperm(vocab, generator=g)[:draft].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    return {"fc.weight": r(e, 3 * e), "midlayer.hidden_norm.weight": 1 + r(e),
            "midlayer.input_layernorm.weight": 1 + r(e), "midlayer.post_attention_layernorm.weight": 1 + r(e),
            "midlayer.self_attn.q_proj.weight": r(e, 2 * e), "midlayer.self_attn.k_proj.weight": r(kv_dim, 2 * e),
            "midlayer.self_attn.v_proj.weight": r(kv_dim, 2 * e), "midlayer.self_attn.o_proj.weight": r(e, e),
            "midlayer.mlp.gate_proj.weight": r(inter, e), "midlayer.mlp.up_proj.weight": r(inter, e),
            "midlayer.mlp.down_proj.weight": r(e, inter), "norm.weight": 1 + r(e), "lm_head.weight": r(draft, e),
            "d2t": used - torch.arange(draft), "t2d": t2d}


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_published_eagle1_layout_loads(target, tmp_path, fmt):
    from safetensors.torch import save_file

    w = _published_eagle1()
    (tmp_path / "config.json").write_text(json.dumps(_llama_config()))
    if fmt == "safetensors":
        save_file(w, str(tmp_path / "model.safetensors"))
    else:
        torch.save(w, tmp_path / "pytorch_model.bin")
    head, prov = load_head(tmp_path, target.args)
    assert head.config.kind == "eagle" and head.config.fc_bias and prov == {}
    assert torch.equal(head.attn.wq.weight, w["layers.0.self_attn.q_proj.weight"])
    assert torch.equal(head.fc.bias, w["fc.bias"])
    assert torch.equal(head.mlp_norm.weight, w["layers.0.post_attention_layernorm.weight"])
    out = Engine(target, EagleDrafter(head, target, tree=TREE), config=EngineConfig(k=4)).generate(
        _prompts(2), max_new_tokens=8)
    assert all(len(t) == 8 for t in out.tokens)


def test_published_eagle3_layout_loads_with_its_vocabulary_and_layers(target, tmp_path):
    from safetensors.torch import save_file

    w = _published_eagle3()
    cfg = _llama_config(draft_vocab_size=48, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 3]})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(w, str(tmp_path / "model.safetensors"))
    head, _ = load_head(tmp_path, target.args)
    assert isinstance(head, Eagle3Head) and head.config.draft_vocab_size == 48
    assert head.config.feature_layers == (0, 1, 2), "published ids name the layer whose input is taken"
    assert torch.equal(head.to_target_ids(torch.arange(48)), w["d2t"] + torch.arange(48))
    assert torch.equal(head.hidden_norm.weight, w["midlayer.hidden_norm.weight"])
    assert torch.equal(head.attn.wk.weight, w["midlayer.self_attn.k_proj.weight"])
    plain = Engine(target).generate(_prompts(2), max_new_tokens=10)
    spec = Engine(target, EagleDrafter(head, target), config=EngineConfig(k=3)).generate(_prompts(2), max_new_tokens=10)
    assert spec.tokens == plain.tokens


def test_a_checkpoint_with_unknown_keys_or_wrong_shapes_is_refused(target, tmp_path):
    from safetensors.torch import save_file

    w = _published_eagle1()
    w["layers.0.self_attn.extra.weight"] = torch.zeros(2)
    (tmp_path / "config.json").write_text(json.dumps(_llama_config()))
    save_file(w, str(tmp_path / "model.safetensors"))
    with pytest.raises(DrafterError, match="unexpected.*extra"):
        load_head(tmp_path, target.args)
    (tmp_path / "config.json").write_text(json.dumps(_llama_config(e=32)))
    with pytest.raises(DrafterError, match="hidden size 32"):
        load_head(tmp_path, target.args)


def test_yuhuili_eagle3_config_without_layer_ids_uses_the_default_layers(target, tmp_path):
    """yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: architectures LlamaForCausalLMEagle3, draft_vocab_size,
    target_hidden_size, no eagle_config, a copy of the target's embedding in the weights."""
    from safetensors.torch import save_file

    from refspec.drafters.eagle import eagle3_layers

    w = dict(_published_eagle3(), **{"embed_tokens.weight": torch.zeros(96, 64)})
    cfg = _llama_config(draft_vocab_size=48, target_hidden_size=64, architectures=["LlamaForCausalLMEagle3"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(w, str(tmp_path / "model.safetensors"))
    head, _ = load_head(tmp_path, target.args)
    assert head.config.feature_layers == eagle3_layers(target.num_layers) and not head.config.norm_before_residual
    plain = Engine(target).generate(_prompts(2), max_new_tokens=10)
    spec = Engine(target, EagleDrafter(head, target), config=EngineConfig(k=3)).generate(_prompts(2), max_new_tokens=10)
    assert spec.tokens == plain.tokens
    cfg["target_hidden_size"] = 128  # a head fusing a wider target's layers
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DrafterError, match="target_hidden_size 128"):
        load_head(tmp_path, target.args)


def test_specforge_eagle3_norm_before_residual_is_read_and_kept(target, tmp_path):
    """SpecForge's output: eagle_config layer ids and norm_before_residual; the residual is then
    the hidden-normed feature, and saving keeps the flag."""
    from safetensors.torch import save_file

    from refspec.drafters.eagle import save_head

    cfg = _llama_config(draft_vocab_size=48, norm_before_residual=True,
                        eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "use_aux_hidden_state": True})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(_published_eagle3(), str(tmp_path / "model.safetensors"))
    head, _ = load_head(tmp_path, target.args)
    assert head.config.norm_before_residual
    emb, h = torch.randn(1, 3, 64), torch.randn(1, 3, 64)
    _, residual = head._attn_input(emb, h)
    assert torch.allclose(residual, head.hidden_norm(h))
    again, _ = load_head(save_head(head, tmp_path / "ours"), target.args)
    assert again.config.norm_before_residual
    spec = Engine(target, EagleDrafter(head, target, tree=TREE), config=EngineConfig(k=4)).generate(
        _prompts(2), max_new_tokens=10)
    assert spec.tokens == Engine(target).generate(_prompts(2), max_new_tokens=10).tokens
