"""CPU speed-ups applied from outside (refspec.models.cpu_speed): the planned model equals the
reference model, weight copies follow weight changes, and the model files never import it."""
import ast
import copy
import dataclasses
from pathlib import Path

import pytest
import torch

from tiny import TINY_HF

from refspec.models import load_model
from refspec.models.calibration import REFERENCE
from refspec.models.cpu_speed import (PlannedBlock, PlannedLinear, WeightCopy, apply_cpu_speed, linear,
                                      remove_cpu_speed, use_gemm_plan, weight_copy_kind)
from refspec.models.layers import Block

MODEL_FILES = ("transformer.py", "layers.py", "attention.py", "ops.py", "moe.py")


def test_model_files_do_not_import_the_speed_machinery():
    """The textbook files import neither the speed module nor the GEMM calibration."""
    root = Path(__file__).resolve().parents[1] / "models"
    for name in MODEL_FILES:
        tree = ast.parse((root / name).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not {m for m in imported if m and m.endswith(("cpu_speed", "calibration", "compiled"))}, name


def _reference(model):
    plain = copy.deepcopy(model)
    remove_cpu_speed(plain)
    assert not any(isinstance(m, (PlannedBlock, PlannedLinear)) for m in plain.modules())
    return plain


@pytest.mark.parametrize("name", list(TINY_HF))
def test_planned_model_equals_the_reference_model(name, tiny_models):
    """load_model's planned blocks and Linears (reference GEMM plan) give the reference model's
    logits and hidden states bit for bit, in a prefill, a packed prefill and one-token steps."""
    planned = tiny_models[name]
    assert all(type(blk) is PlannedBlock for blk in planned.layers) and type(planned.lm_head) is PlannedLinear
    plain = _reference(planned)
    toks = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(7))
    layers = (0, planned.num_layers)
    outs = []
    for m in (planned, plain):
        cache = m.new_cache(2, 32)
        lg, hid = m(toks[:, :10], torch.arange(10)[None].expand(2, 10), cache, hidden_layers=layers)
        steps = [m(toks[:, i:i + 1], torch.full((2, 1), i), cache, num_keys=16)[0] for i in (10, 11)]
        packed = m.prefill(torch.cat([toks[0, :3], toks[1]]), [3, 12], m.new_cache(2, 16), torch.tensor([1, 0]),
                           hidden_layers=layers)
        outs.append([lg, *hid, *steps, packed[0], *packed[1]])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_apply_swaps_classes_in_place_and_remove_restores_them(tiny_models):
    """Same parameters, names and state dict; a block whose sub-modules carry hooks (a
    tensor-parallel all-reduce) keeps the reference forward, and its hooks fire."""
    plain = _reference(tiny_models["llama"])
    keys, wo = list(plain.state_dict()), plain.layers[1].attn.wo.weight
    fired = []
    plain.layers[1].attn.wo.register_forward_hook(lambda mod, inp, out: fired.append(out.shape))
    apply_cpu_speed(plain, REFERENCE)
    assert [type(blk) for blk in plain.layers] == [PlannedBlock, Block, PlannedBlock]
    assert type(plain.layers[1].attn.wo) is PlannedLinear and plain.layers[1].attn.wo.weight is wo
    assert list(plain.state_dict()) == keys
    plain(torch.tensor([[5, 6, 7]]), torch.arange(3)[None], plain.new_cache(1, 8))
    assert fired == [torch.Size([1, 3, 64])]
    remove_cpu_speed(plain)
    assert {type(m) for m in plain.modules()} & {PlannedBlock, PlannedLinear} == set()
    assert "copy" not in plain.lm_head.__dict__


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
    assert weight_copy_kind(model) == plan
    attn = model.layers[0].attn
    assert model.lm_head.copy is not None and attn.wqkv.copy is not None and attn.wo.copy is not None
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
    assert all(lin.copy is not None and lin.copy.kind == "fp32"
               for lin in (model.lm_head, model.layers[0].attn.wqkv, model.layers[0].mlp.down))
    monkeypatch.setenv("REFSPEC_CPU_WEIGHT_COPIES_GIB", "0")
    plain = load_model(tmp_path, dtype=dtype, gemm_plan=copy_plan())
    assert plain.lm_head.copy is None and plain.layers[0].attn.wqkv.copy is None
    # the cost model is told what the kernels stream: fp32 copies for several rows, else dtype
    from refspec.engine import Engine

    from refspec.energy.model.roofline import forward_cost

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
    copied = model.layers[0].attn.wqkv.copy.t
    with torch.no_grad():
        model.layers[0].attn.wqkv.weight.mul_(2)  # in place: the stale fp32 copy is not used
    assert model.layers[0].attn.wqkv.copy.of(model.layers[0].attn.wqkv.weight) is None
    d, _ = model(toks, pos, model.new_cache(3, 16))
    assert (d - a).abs().max().item() > 1e-2 and torch.equal(copied, model.layers[0].attn.wqkv.copy.t)


def test_weight_copy_kind_reports_what_the_model_keeps(tmp_path, monkeypatch):
    from tiny import save_hf

    from tiny import copy_plan

    save_hf("llama", tmp_path)
    assert weight_copy_kind(load_model(tmp_path, gemm_plan=copy_plan())) == "column"
    assert weight_copy_kind(load_model(tmp_path, dtype=torch.bfloat16, gemm_plan=copy_plan())) == "fp32"
    assert weight_copy_kind(load_model(tmp_path, dtype=torch.bfloat16)) is None, "the reference plan keeps none"
    monkeypatch.setenv("REFSPEC_CPU_WEIGHT_COPIES_GIB", "0")
    assert weight_copy_kind(load_model(tmp_path, dtype=torch.bfloat16, gemm_plan=copy_plan())) is None
