"""Published block drafters: a DFlash draft (z-lab/dflash layout, synthetic tiny weights) loads
through ``--drafter block --drafter-option head=DIR``, maps every key, and drafts losslessly."""
import json

import pytest
import torch

from refspec.drafters import registry
from refspec.drafters.block import BlockDrafter, BlockHead
from refspec.drafters.block_dflash import default_layer_ids, is_dflash, load_dflash
from refspec.drafting import DrafterError
from refspec.engine import Engine, EngineConfig

EOS = [2]
MASK = 95  # the tiny targets' last token id plays DFlash's <|MASK|>


def _config(e=64, layers=2, heads=4, kv=2, d=16, inter=96, block=5, ids=(0, 2), **extra):
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": e, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": d, "intermediate_size": inter,
           "rms_norm_eps": 1e-6, "rope_theta": 1e6, "attention_bias": False, "block_size": block,
           "num_target_layers": 3, "tie_word_embeddings": False, "vocab_size": 96,
           "dflash_config": {"target_layer_ids": list(ids), "mask_token_id": MASK}}
    cfg.update(extra)
    return cfg


def _weights(e=64, layers=2, heads=4, kv=2, d=16, inter=96, feats=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.05
    w = {"fc.weight": r(e, feats * e), "hidden_norm.weight": 1 + r(e), "norm.weight": 1 + r(e)}
    for i in range(layers):
        p = f"layers.{i}."
        w.update({p + "input_layernorm.weight": 1 + r(e), p + "post_attention_layernorm.weight": 1 + r(e),
                  p + "self_attn.q_proj.weight": r(heads * d, e), p + "self_attn.k_proj.weight": r(kv * d, e),
                  p + "self_attn.v_proj.weight": r(kv * d, e), p + "self_attn.o_proj.weight": r(e, heads * d),
                  p + "self_attn.q_norm.weight": 1 + r(d), p + "self_attn.k_norm.weight": 1 + r(d),
                  p + "mlp.gate_proj.weight": r(inter, e), p + "mlp.up_proj.weight": r(inter, e),
                  p + "mlp.down_proj.weight": r(e, inter)})
    return w


def _write(folder, cfg, w):
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(w, str(folder / "model.safetensors"))
    return folder


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 90, (m,), generator=g).tolist() for m in [5, 17, 1, 30, 9, 12][:n]]


@pytest.fixture
def dflash_dir(tmp_path):
    return _write(tmp_path / "dflash", _config(), _weights())


def test_dflash_layout_maps_every_key_and_takes_its_layers_from_the_config(tiny_models, dflash_dir):
    m = tiny_models["llama"]  # a Llama target: the DFlash layers are Qwen3 layers all the same
    w = _weights()
    head = load_dflash(dflash_dir, m)
    assert is_dflash(dflash_dir)
    assert head.config.feature_layers == (0, 2) and head.block_size == 4 and not head.config.input_fusion
    assert head.args.qk_norm and head.args.num_heads == 4 and head.args.intermediate_size == 96
    assert torch.equal(head.fc.weight, w["fc.weight"]) and torch.equal(head.ctx_norm.weight, w["hidden_norm.weight"])
    sd = head.state_dict()
    for ours, theirs in [("attn.wk", "self_attn.k_proj"), ("attn.k_norm", "self_attn.k_norm"),
                         ("attn_norm", "input_layernorm"), ("mlp.down", "mlp.down_proj"), ("attn.wo", "self_attn.o_proj")]:
        assert torch.equal(sd[f"layers.1.{ours}.weight"], w[f"layers.1.{theirs}.weight"]), ours
    assert torch.equal(head.mask_embed, m.embed.weight[MASK].detach().expand(4, -1)), "every mask slot: <|MASK|>"


def test_dflash_head_loads_through_the_registry_and_drafts_losslessly(tiny_models, dflash_dir):
    m = tiny_models["llama"]
    ctx = registry.DrafterContext(target=m, target_name="tiny", tokenizer_fingerprint=None, dtype=torch.float32,
                                  device=m.device, options={"head": str(dflash_dir)})
    drafter = registry.build("block", ctx)
    assert isinstance(drafter, BlockDrafter) and drafter.hidden_layers == (0, 2)
    prompts = _prompts(6)
    plain = Engine(m, eos_token_ids=EOS).generate(prompts, max_new_tokens=12)
    spec = Engine(m, drafter, config=EngineConfig(k=4), eos_token_ids=EOS).generate(prompts, max_new_tokens=12)
    assert spec.tokens == plain.tokens
    with pytest.raises(DrafterError, match="at most 4 tokens"):  # block_size 5 = the anchor + 4 masks
        Engine(m, drafter, config=EngineConfig(k=5), eos_token_ids=EOS).generate(prompts, max_new_tokens=4)


def test_a_loaded_dflash_head_saves_and_reloads_as_a_refspec_head(tiny_models, dflash_dir, tmp_path):
    m = tiny_models["llama"]
    head = load_dflash(dflash_dir, m)
    again = BlockHead.load(head.save(tmp_path / "ours", dtype=None), target_args=m.args)
    assert again.args.qk_norm and again.config.layer_args == head.config.layer_args
    for (n, a), (_, b) in zip(head.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n


def test_dflash_layouts_it_cannot_express_are_refused(tiny_models, tmp_path):
    m = tiny_models["llama"]
    w = _weights()
    extra = dict(w, **{"layers.0.attention_conv.base_kernel": torch.zeros(2, 2, 64)})  # DFlash-2
    with pytest.raises(DrafterError, match="unexpected.*attention_conv"):
        load_dflash(_write(tmp_path / "a", _config(), extra), m)
    with pytest.raises(DrafterError, match="missing.*layers.1.mlp.up_proj"):
        load_dflash(_write(tmp_path / "b", _config(), {k: v for k, v in w.items() if k != "layers.1.mlp.up_proj.weight"}), m)
    with pytest.raises(DrafterError, match="hidden size 32"):
        load_dflash(_write(tmp_path / "c", _config(e=32), w), m)
    with pytest.raises(DrafterError, match="sliding"):
        load_dflash(_write(tmp_path / "d", _config(layer_types=["sliding_attention"] * 2), w), m)
    bad_mask = _config()
    bad_mask["dflash_config"]["mask_token_id"] = 500
    with pytest.raises(DrafterError, match="mask_token_id 500"):
        load_dflash(_write(tmp_path / "e", bad_mask, w), m)


def test_default_target_layers_follow_dflash():
    assert default_layer_ids(36, 1) == [18]
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
