"""Target models: logits equal transformers' on the same weights; cache and ragged batches."""
import dataclasses

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


@pytest.mark.parametrize("plan", ["column", "packed"])
def test_weight_copies_follow_weight_changes(tmp_path, plan):
    """One-row steps use the copies load_model keeps on CPU in fp32 (column-major, or packed for
    oneDNN) and equal the multi-row forward; after an in-place change or a replaced parameter the
    stale copy is not used."""
    from tiny import copy_plan, packed_form_runs, packed_plan, save_hf

    if plan == "packed" and not packed_form_runs():
        return  # calibration never offers it here (asserted by packed_form_runs)
    save_hf("llama", tmp_path)
    model = load_model(tmp_path, gemm_plan=copy_plan() if plan == "column" else packed_plan())
    assert model.weight_copy_kind == plan
    attn = model.layers[0].attn
    assert model.lm_head._copy is not None and attn.wqkv._copy is not None and attn.wo._copy is not None
    toks = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(12)[None].expand(2, 12)

    def full():
        return model(toks, pos, model.new_cache(2, 16))[0]

    def first_step():
        return model(toks[:1, :1], pos[:1, :1], model.new_cache(1, 16), num_keys=16)[0][0, 0]

    a = full()
    cache = model.new_cache(1, 16)
    for i in range(12):
        one, _ = model(toks[:1, i:i + 1], pos[:1, i:i + 1], cache, num_keys=16)
        assert (one[0, 0] - a[0, i]).abs().max().item() < 1e-4
    nudge = 0.5 * torch.randn(attn.wo.weight.shape, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        attn.wo.weight.add_(nudge)  # in place: same storage, new version
    changed = full()
    assert (changed[0, 0] - a[0, 0]).abs().max().item() > 1e-3
    assert (first_step() - changed[0, 0]).abs().max().item() < 1e-4
    zeroed = torch.zeros_like(attn.wqkv.weight)
    attn.wqkv.weight = torch.nn.Parameter(zeroed, requires_grad=False)  # replaced: new storage
    replaced = full()
    assert (replaced[0, 0] - changed[0, 0]).abs().max().item() > 1e-3
    assert (first_step() - replaced[0, 0]).abs().max().item() < 1e-4
    # a replaced sub-module is used as well (each block rebuilds the tensors it gathered)
    from refspec.models.layers import RMSNorm

    blk = model.layers[1]
    norm = RMSNorm(blk.attn_norm.weight.shape[0], blk.attn_norm.eps, blk.attn_norm.plus_one)
    with torch.no_grad():
        norm.weight.fill_(3.0)
    blk.attn_norm = norm
    renormed = full()
    assert (renormed[0, 0] - replaced[0, 0]).abs().max().item() > 1e-3
    # ... and so is a state dict loaded by assignment, which replaces every parameter
    fresh = load_model(tmp_path)
    before, _ = fresh(toks, pos, fresh.new_cache(2, 16))
    assert not torch.equal(before, renormed)
    fresh.load_state_dict(model.state_dict(), assign=True)
    again, _ = fresh(toks, pos, fresh.new_cache(2, 16))
    assert torch.equal(again, renormed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_rows_through_fp32_copies(tmp_path, monkeypatch, dtype):
    """A bf16/fp16 model on CPU keeps fp32 copies of its matrices and multiplies two or more
    rows through them (one row still runs the half-precision kernel): each product is the
    half-precision kernel's up to one rounding step, and the model's logits match a load
    without copies to half-precision accuracy; with the copies turned off none are made."""
    from tiny import copy_plan, save_hf
    from refspec.models.ops import WeightCopy, linear, use_gemm_plan

    use_gemm_plan(copy_plan())
    g = torch.Generator().manual_seed(5)
    w = torch.randn(96, 64, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    copy = WeightCopy(w, "fp32")
    assert copy.t.dtype == torch.float32 and copy.t.shape == w.shape
    for rows in (1, 2, 5, 9):
        x = torch.randn(rows, 64, generator=g).to(dtype)
        ours, ref = linear(x, w, b, copy), torch.nn.functional.linear(x, w, b)
        assert ours.dtype == dtype and ours.shape == ref.shape
        exact = x.double() @ w.double().t() + b.double()
        ulp = torch.finfo(dtype).eps * exact.abs().clamp_min(1.0)
        assert ((ours.double() - ref.double()).abs() <= ulp).all()
        assert ((ours.double() - exact).abs() <= ulp).all(), "one rounding of an fp32-accurate sum"
    # routing: several rows read the copy, one row the weight
    copy.t = torch.zeros_like(copy.t)
    x = torch.randn(2, 64, generator=g).to(dtype)
    assert torch.equal(linear(x, w, None, copy), torch.zeros(2, 96, dtype=dtype))
    assert torch.equal(linear(x[:1], w, None, copy), torch.nn.functional.linear(x[:1], w))
    # a weight being trained is multiplied itself (the copy is detached: no gradient would reach it)
    w.requires_grad_(True)
    copy = WeightCopy(w, "fp32")
    copy.t = torch.zeros_like(copy.t)
    linear(x, w, None, copy).float().sum().backward()
    assert w.grad is not None and torch.equal(w.grad, x.t().float().sum(1).expand(96, 64).to(dtype))
    with torch.no_grad():
        assert torch.equal(linear(x, w, None, copy), torch.zeros(2, 96, dtype=dtype))
    save_hf("qwen2", tmp_path)  # q/k/v bias: the addmm branch
    model = load_model(tmp_path, dtype=dtype, gemm_plan=copy_plan())
    assert all(lin._copy is not None and lin._copy.kind == "fp32"
               for lin in (model.lm_head, model.layers[0].attn.wqkv, model.layers[0].mlp.down))
    monkeypatch.setenv("REFSPEC_CPU_WEIGHT_COPIES_GIB", "0")
    plain = load_model(tmp_path, dtype=dtype, gemm_plan=copy_plan())
    assert plain.lm_head._copy is None and plain.layers[0].attn.wqkv._copy is None
    # the cost model is told what the kernels stream: fp32 copies for several rows, else dtype
    from refspec.engine import Engine

    from refspec.energy.roofline import forward_cost

    assert (model.multirow_matrix_bytes(), plain.multirow_matrix_bytes()) == (4, None)
    work = {e.phase: e.work[0] for e in Engine(model).generate([[5, 6, 7]], max_new_tokens=3).events if e.work}
    assert work["prefill"].matrix_bytes == 4 and work["prefill"].tokens_per_row == 3
    half = forward_cost(dataclasses.replace(work["prefill"], matrix_bytes=None)).weight_bytes
    assert forward_cost(work["prefill"]).weight_bytes > half  # 3 rows through the block matrices' fp32 copies
    one_row = work["verify"]
    assert one_row.rows * one_row.tokens_per_row == 1
    assert forward_cost(one_row) == forward_cost(dataclasses.replace(one_row, matrix_bytes=None))
    toks = torch.randint(3, 96, (3, 10), generator=g)
    pos = torch.arange(10)[None].expand(3, 10)
    a, _ = model(toks, pos, model.new_cache(3, 16))
    c, _ = plain(toks, pos, plain.new_cache(3, 16))
    assert (a - c).abs().max().item() < 20 * torch.finfo(dtype).eps * c.abs().max().item()
    copied = model.layers[0].attn.wqkv._copy.t
    with torch.no_grad():
        model.layers[0].attn.wqkv.weight.mul_(2)  # in place: the stale fp32 copy is not used
    assert model.layers[0].attn.wqkv._copy.of(model.layers[0].attn.wqkv.weight) is None
    d, _ = model(toks, pos, model.new_cache(3, 16))
    assert (d - a).abs().max().item() > 1e-2 and torch.equal(copied, model.layers[0].attn.wqkv._copy.t)


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


def test_weight_copy_kind_reports_what_the_model_keeps(tmp_path, monkeypatch):
    from tiny import save_hf

    from tiny import copy_plan

    save_hf("llama", tmp_path)
    assert load_model(tmp_path, gemm_plan=copy_plan()).weight_copy_kind == "column"
    assert load_model(tmp_path, dtype=torch.bfloat16, gemm_plan=copy_plan()).weight_copy_kind == "fp32"
    assert load_model(tmp_path, dtype=torch.bfloat16).weight_copy_kind is None, "the reference plan keeps none"
    monkeypatch.setenv("REFSPEC_CPU_WEIGHT_COPIES_GIB", "0")
    assert load_model(tmp_path, dtype=torch.bfloat16, gemm_plan=copy_plan()).weight_copy_kind is None
