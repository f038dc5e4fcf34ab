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
def test_fused_projections_equal_the_split_ones(name, tmp_path):
    """load_model fuses q/k/v and gate/up into one GEMM each (views, no copy); the split path,
    which a replaced parameter falls back to, gives the same logits."""
    from tiny import save_hf

    save_hf(name, tmp_path)
    fused, split = load_model(tmp_path), load_model(tmp_path)
    for blk in split.layers:  # undo the fusion: give every projection its own storage again
        for lin in (blk.attn.wq, blk.attn.wk, blk.attn.wv, blk.mlp.gate, blk.mlp.up):
            lin.weight = torch.nn.Parameter(lin.weight.detach().clone(), requires_grad=False)
    attn = fused.layers[0].attn
    assert attn.wk.weight.data_ptr() == attn._qkv[0][attn.h * attn.d:].data_ptr(), "wk is a view of the fused weight"
    toks = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(12)[None].expand(2, 12)
    a, _ = fused(toks, pos, fused.new_cache(2, 16))
    b, _ = split(toks, pos, split.new_cache(2, 16))
    assert (a - b).abs().max().item() < 1e-5
    # one-row steps use the column-major copies load_model keeps on CPU in fp32
    assert fused.lm_head._col is not None and attn._qkv_col is not None
    cf, cs = fused.new_cache(1, 16), split.new_cache(1, 16)
    for i in range(12):
        one_f, _ = fused(toks[:1, i:i + 1], pos[:1, i:i + 1], cf, num_keys=16)
        one_s, _ = split(toks[:1, i:i + 1], pos[:1, i:i + 1], cs, num_keys=16)
        assert (one_f - one_s).abs().max().item() < 1e-5 and (one_f[0, 0] - a[0, i]).abs().max().item() < 1e-4
    # an in-place change of a weight is seen by one-row steps (the stale column copy is not used)
    nudge = 0.5 * torch.randn(fused.layers[0].attn.wo.weight.shape, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        fused.layers[0].attn.wo.weight.add_(nudge)
        split.layers[0].attn.wo.weight.add_(nudge)
    one, _ = fused(toks[:1, :1], pos[:1, :1], fused.new_cache(1, 16), num_keys=16)
    ref, _ = split(toks[:1, :1], pos[:1, :1], split.new_cache(1, 16), num_keys=16)
    assert (one - ref).abs().max().item() < 1e-5 and (one[0, 0] - a[0, 0]).abs().max().item() > 1e-3
    with torch.no_grad():
        fused.layers[0].attn.wo.weight.sub_(nudge)
        split.layers[0].attn.wo.weight.sub_(nudge)
    # a parameter replaced after fusion is used (the stale fused tensor is not)
    wv = fused.layers[0].attn.wv
    wv.weight = torch.nn.Parameter(torch.zeros_like(wv.weight), requires_grad=False)
    split.layers[0].attn.wv.weight.zero_()
    c, _ = fused(toks, pos, fused.new_cache(2, 16))
    d, _ = split(toks, pos, split.new_cache(2, 16))
    assert (c - a).abs().max().item() > 1e-3 and (c - d).abs().max().item() < 1e-5


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
