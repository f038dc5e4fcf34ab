"""The CPU GEMM plan applied from outside (refspec.models.cpu_speed, through prepare_target): a
planned model runs the one forward of the reference model, each model follows its own plan, weight
copies follow weight changes, and the model files never import the speed machinery."""
import ast
import copy
import dataclasses
import inspect
from pathlib import Path

import pytest
import torch

from tiny import TINY_HF, copy_plan, save_hf

from refspec.models import load_model, prepare_target
from refspec.models.calibration import REFERENCE
from refspec.models.cpu_speed import weight_copy_kind
from refspec.models.gemm_forms import GemmChoice, WeightCopy, linear
from refspec.models.layers import Block, Linear
from refspec.models.prepare import PreparedTarget
from refspec.models.transformer import Transformer
from refspec.target import TargetForward

MODEL_FILES = ("transformer.py", "layers.py", "attention.py", "ops.py", "moe.py")


def test_model_files_do_not_import_the_speed_machinery():
    """The textbook files import neither the transforms nor the GEMM calibration."""
    root = Path(__file__).resolve().parents[1] / "models"
    for name in MODEL_FILES:
        tree = ast.parse((root / name).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        speed = ("cpu_speed", "calibration", "compiled", "prepare", "cuda_graphs", ".tp")
        assert not {m for m in imported if m and (m.endswith(speed) or ".tp." in m)}, name


def _outputs(m, toks):
    """Logits and hidden states of a prefill, two one-token steps and a packed prefill."""
    layers = (0, m.num_layers)
    cache = m.new_cache(2, 32)
    lg, hid = m(toks[:, :10], torch.arange(10)[None].expand(2, 10), cache, hidden_layers=layers)
    steps = [m(toks[:, i:i + 1], torch.full((2, 1), i), cache, num_keys=16)[0] for i in (10, 11)]
    packed = m.prefill(torch.cat([toks[0, :3], toks[1]]), [3, 12], m.new_cache(2, 16), torch.tensor([1, 0]),
                       hidden_layers=layers)
    return [lg, *hid, *steps, packed[0], *packed[1]]


@pytest.mark.parametrize("name", list(TINY_HF))
def test_a_planned_model_runs_the_one_block_forward_of_the_reference(name, tiny_models, monkeypatch):
    """Under a plan whose products differ from F.linear (column-major copies for one row,
    (W x^T)^T for several) every block still runs Block.forward, its layers stay the model's own
    classes, and the logits equal the reference model's within fp32 rounding."""
    reference = tiny_models[name]
    planned = copy.deepcopy(reference)
    prepared = prepare_target(planned, cpu_plan=copy_plan())
    assert prepared.model is planned and weight_copy_kind(planned) == "column"
    assert all(type(blk) is Block for blk in planned.layers) and type(planned.lm_head) is Linear
    assert reference.lm_head.gemm is None and planned.lm_head.gemm.forms == ("column", "wxt", "wxt")
    calls = []
    real = Block.forward
    monkeypatch.setattr(Block, "forward", lambda blk, x, ctx: (calls.append(id(blk)), real(blk, x, ctx))[1])
    toks = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(7))
    outs = {}
    for label, m in (("reference", reference), ("planned", planned)):
        calls.clear()
        outs[label] = _outputs(m, toks)
        assert calls == [id(blk) for blk in m.layers] * 4, f"{label}: every block through Block.forward, each forward"
    eps = torch.finfo(torch.float32).eps
    for a, b in zip(outs["reference"], outs["planned"]):
        assert (a - b).abs().max() <= 64 * eps * a.abs().max().clamp_min(1.0)
    assert not all(torch.equal(a, b) for a, b in zip(outs["reference"], outs["planned"])), "the plan's forms ran"


def test_hooks_on_a_planned_layer_fire(tiny_models):
    """The one forward calls its layers, so a forward hook (a tensor-parallel all-reduce) fires
    on a planned model too (a block's products take 2-D rows, [B*S, E])."""
    m = copy.deepcopy(tiny_models["llama"])
    prepare_target(m, cpu_plan=copy_plan())
    fired = []
    m.layers[1].attn.wo.register_forward_hook(lambda mod, inp, out: fired.append(out.shape))
    m(torch.tensor([[5, 6, 7]]), torch.arange(3)[None], m.new_cache(1, 8))
    assert fired == [torch.Size([3, 64])]


def test_each_model_follows_its_own_plan(tiny_models):
    """No process-wide plan: preparing a second model with another plan leaves the first one's
    products (and its weight copies) as they were."""
    a, b = copy.deepcopy(tiny_models["llama"]), copy.deepcopy(tiny_models["llama"])
    prepared = prepare_target(a, cpu_plan=copy_plan())
    toks = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(2))
    before = a(toks, torch.arange(6)[None], a.new_cache(1, 8))[0]
    other = prepare_target(b, cpu_plan=REFERENCE)
    after = a(toks, torch.arange(6)[None], a.new_cache(1, 8))[0]
    assert torch.equal(before, after) and weight_copy_kind(a) == "column" and weight_copy_kind(b) is None
    assert prepared.cpu_plan.describe() and other.cpu_plan.describe() == ""
    assert {type(lin.gemm) for lin in a.modules() if isinstance(lin, Linear)} == {GemmChoice}
    assert {lin.gemm for lin in b.modules() if isinstance(lin, Linear)} == {None}


def test_load_model_only_loads(tmp_path, monkeypatch):
    """load_model plans nothing, whatever REFSPEC_GEMM_PLAN says; prepare_target resolves the plan
    it names (here: reference, so no calibration runs)."""
    save_hf("llama", tmp_path)
    monkeypatch.setenv("REFSPEC_GEMM_PLAN", "auto")
    monkeypatch.setattr("refspec.models.calibration.load_or_calibrate", lambda *a, **k: pytest.fail("calibrated"))
    m = load_model(tmp_path)
    assert all(lin.gemm is None for lin in m.modules() if isinstance(lin, Linear))
    monkeypatch.setenv("REFSPEC_GEMM_PLAN", "reference")
    assert prepare_target(m).cpu_plan is REFERENCE


def test_the_prepared_target_satisfies_the_forward_protocol(tiny_models):
    """What prepare_target returns, and the model itself, are TargetForwards with the protocol's
    signatures, and an engine over either decodes the same tokens."""
    from refspec.cuda_graphs import GraphRunner
    from refspec.engine import Engine

    m = tiny_models["llama"]
    targets = [m, prepare_target(m), PreparedTarget(m, step=GraphRunner(m, capture=False))]
    for t in targets:
        assert isinstance(t, TargetForward)
        for name in ("__call__", "prefill", "new_cache"):
            want = inspect.signature(getattr(TargetForward, name))
            got = inspect.signature(Transformer.forward if t is m and name == "__call__" else getattr(type(t), name))
            assert [(p.name, p.kind, p.default) for p in got.parameters.values()] == \
                   [(p.name, p.kind, p.default) for p in want.parameters.values()], (t, name)
        assert (t.args, t.device, t.dtype, t.num_layers) == (m.args, m.device, m.dtype, m.num_layers)
    prompts = [[5, 9, 11, 5, 9], [7, 3, 8]]
    tokens = [Engine(t).generate(prompts, max_new_tokens=6).tokens for t in targets]
    assert tokens[1:] == tokens[:1] * 2


@pytest.mark.parametrize("plan", ["column", "packed"])
def test_weight_copies_follow_weight_changes(tmp_path, plan):
    """One-row steps use the copies prepare_target keeps on CPU in fp32 (column-major, or packed
    for oneDNN) and equal the multi-row forward; after an in-place change or a replaced parameter
    the stale copy is not used."""
    from tiny import packed_form_runs, packed_plan

    if plan == "packed" and not packed_form_runs():
        return  # calibration never offers it here (asserted by packed_form_runs)
    save_hf("llama", tmp_path)
    model = load_model(tmp_path)
    prepare_target(model, cpu_plan=copy_plan() if plan == "column" else packed_plan())
    assert weight_copy_kind(model) == plan
    attn = model.layers[0].attn
    assert all(lin.gemm.copy is not None for lin in (model.lm_head, attn.wqkv, attn.wo))
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
    # a state dict loaded by assignment replaces every parameter: no copy is read
    fresh = load_model(tmp_path)
    prepare_target(fresh, cpu_plan=copy_plan())
    before, _ = fresh(toks, pos, fresh.new_cache(2, 16))
    assert not torch.equal(before, replaced)
    fresh.load_state_dict(model.state_dict(), assign=True)
    assert weight_copy_kind(fresh) is None
    again, _ = fresh(toks[:1, :1], pos[:1, :1], fresh.new_cache(1, 16), num_keys=16)
    assert (again[0, 0] - replaced[0, 0]).abs().max().item() < 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_rows_through_fp32_copies(tmp_path, monkeypatch, dtype):
    """A bf16/fp16 model on CPU keeps fp32 copies of its matrices and multiplies two or more
    rows through them (one row still runs the half-precision kernel): each product is the
    half-precision kernel's up to one rounding step, and the model's logits match a model
    without copies to half-precision accuracy; with the copies turned off none are made."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(96, 64, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    copy_ = WeightCopy(w, "fp32")
    choice = GemmChoice(dtype=dtype, forms=("linear", "fp32", "fp32"), copy=copy_)
    assert copy_.t.dtype == torch.float32 and copy_.t.shape == w.shape
    for rows in (1, 2, 5, 9):
        x = torch.randn(rows, 64, generator=g).to(dtype)
        ours, ref = linear(x, w, b, choice), torch.nn.functional.linear(x, w, b)
        assert ours.dtype == dtype and ours.shape == ref.shape
        exact = x.double() @ w.double().t() + b.double()
        ulp = torch.finfo(dtype).eps * exact.abs().clamp_min(1.0)
        assert ((ours.double() - ref.double()).abs() <= ulp).all()
        assert ((ours.double() - exact).abs() <= ulp).all(), "one rounding of an fp32-accurate sum"
    # routing: several rows read the copy, one row the weight
    copy_.t = torch.zeros_like(copy_.t)
    x = torch.randn(2, 64, generator=g).to(dtype)
    assert torch.equal(linear(x, w, None, choice), torch.zeros(2, 96, dtype=dtype))
    assert torch.equal(linear(x[:1], w, None, choice), torch.nn.functional.linear(x[:1], w))
    # a weight being trained is multiplied itself (the copy is detached: no gradient would reach it)
    w.requires_grad_(True)
    choice = dataclasses.replace(choice, copy=WeightCopy(w, "fp32"))
    choice.copy.t = torch.zeros_like(choice.copy.t)
    linear(x, w, None, choice).float().sum().backward()
    assert w.grad is not None and torch.equal(w.grad, x.t().float().sum(1).expand(96, 64).to(dtype))
    with torch.no_grad():
        assert torch.equal(linear(x, w, None, choice), torch.zeros(2, 96, dtype=dtype))
    save_hf("qwen2", tmp_path)  # q/k/v bias: the addmm branch
    model = load_model(tmp_path, dtype=dtype)
    prepare_target(model, cpu_plan=copy_plan())
    assert all(lin.gemm.copy is not None and lin.gemm.copy.kind == "fp32"
               for lin in (model.lm_head, model.layers[0].attn.wqkv, model.layers[0].mlp.down))
    monkeypatch.setenv("REFSPEC_CPU_WEIGHT_COPIES_GIB", "0")
    plain = load_model(tmp_path, dtype=dtype)
    prepare_target(plain, cpu_plan=copy_plan())
    assert plain.lm_head.gemm.copy is None and plain.layers[0].attn.wqkv.gemm.copy is None
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
    wqkv = model.layers[0].attn.wqkv
    copied = wqkv.gemm.copy.t
    with torch.no_grad():
        wqkv.weight.mul_(2)  # in place: the stale fp32 copy is not used
    assert wqkv.gemm.copy.of(wqkv.weight) is None
    d, _ = model(toks, pos, model.new_cache(3, 16))
    assert (d - a).abs().max().item() > 1e-2 and torch.equal(copied, wqkv.gemm.copy.t)


def test_weight_copy_kind_reports_what_the_model_keeps(tmp_path, monkeypatch):
    save_hf("llama", tmp_path)

    def kind(dtype, plan):
        model = load_model(tmp_path, dtype=dtype)
        prepare_target(model, cpu_plan=plan)
        return weight_copy_kind(model)

    assert kind(torch.float32, copy_plan()) == "column"
    assert kind(torch.bfloat16, copy_plan()) == "fp32"
    assert kind(torch.bfloat16, REFERENCE) is None, "the reference plan keeps none"
    monkeypatch.setenv("REFSPEC_CPU_WEIGHT_COPIES_GIB", "0")
    assert kind(torch.bfloat16, copy_plan()) is None
