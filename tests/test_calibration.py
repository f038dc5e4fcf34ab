"""CPU GEMM calibration: the fastest measured form is chosen, cached per machine unless its timing
rounds say the machine was busy, and every form computes the reference product."""
import json

import pytest
import torch
import torch.nn.functional as F

from refspec.models import calibration as C
from refspec.models import gemm_forms as G
from tiny import packed_form_runs


def table(fast: dict[tuple[str, str], str]):
    """A fake timer: 1 s for every form except the one named fast per (dtype, bucket)."""
    calls = []

    def timer(dtype, bucket, form):
        calls.append((dtype, bucket, form))
        return 0.5 if fast.get((dtype, bucket)) == form else 1.0
    return timer, calls


def test_fake_timing_table_picks_the_fast_form():
    timer, _ = table({("fp32", "one"): "column", ("fp32", "few"): "wxt", ("bf16", "many"): "fp32"})
    plan = C.calibrate(("fp32", "bf16"), timer=timer)
    assert plan.form(torch.float32, 1) == "column"
    assert plan.form(torch.float32, 8) == "wxt"
    assert plan.form(torch.bfloat16, 200) == "fp32"
    assert plan.copy_kind(torch.float32) == "column" and plan.copy_kind(torch.bfloat16) == "fp32"


def test_one_copy_kind_per_dtype_keeps_the_larger_saving():
    def timer(dtype, bucket, form):
        return {("one", "column"): 0.9, ("many", "fp32"): 0.2}.get((bucket, form), 1.0)
    plan = C.calibrate(("bf16",), timer=timer)
    assert plan.forms["bf16"]["many"] == "fp32"  # saves 0.8 s against column's 0.1 s
    assert plan.forms["bf16"]["one"] in ("linear", "wxt")
    assert plan.copy_kind(torch.bfloat16) == "fp32"


def test_unplanned_products_take_the_reference():
    assert C.REFERENCE.form(torch.float32, 1) == "linear" and C.REFERENCE.copy_kind(torch.bfloat16) is None


def test_cached_plan_is_reused(tmp_path):
    timer, calls = table({("fp32", "one"): "wxt"})
    first = C.load_or_calibrate(tmp_path, dtypes=("fp32",), timer=timer)
    n = len(calls)
    second = C.load_or_calibrate(tmp_path, dtypes=("fp32",), timer=timer)
    assert len(calls) == n and second.forms == first.forms
    saved = json.loads(C.plan_path(tmp_path, C.machine_key()).read_text())
    assert saved["forms"]["fp32"]["one"] == "wxt"


@pytest.mark.parametrize("change", ["torch", "threads"])
def test_a_new_torch_or_thread_count_recalibrates(tmp_path, monkeypatch, change):
    timer, calls = table({})
    C.load_or_calibrate(tmp_path, dtypes=("fp32",), timer=timer)
    n = len(calls)
    if change == "torch":
        monkeypatch.setattr(C.torch, "__version__", "0.0.0-other")
    else:
        threads = torch.get_num_threads()
        monkeypatch.setattr(C.torch, "get_num_threads", lambda: threads + 1)
    C.load_or_calibrate(tmp_path, dtypes=("fp32",), timer=timer)
    assert len(calls) == 2 * n


def test_a_corrupt_cache_recalibrates(tmp_path):
    timer, calls = table({})
    path = C.plan_path(tmp_path, C.machine_key())
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    C.load_or_calibrate(tmp_path, dtypes=("fp32",), timer=timer)
    assert calls and json.loads(path.read_text())["version"] == C.PLAN_VERSION


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_every_form_computes_the_reference_product(dtype, rows):
    dt = C.DTYPES[dtype]
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=g).to(dt)
    x = torch.randn(rows, 64, generator=g).to(dt)
    ref = F.linear(x.double(), w.double())
    assert set(C.candidate_forms(dtype)) >= set(C.FORMS[dtype]) - {"packed"}
    for form in C.candidate_forms(dtype):
        out = G.apply_form(form, x, w, G.make_copy(form, w))
        assert out.dtype == dt and out.shape == (rows, 96)
        # fp32: summation order only; bf16: one rounding of the fp32 accumulator (2^-8 relative)
        tol = 1e-5 if dtype == "fp32" else 2 ** -8
        assert torch.allclose(out.double(), ref, rtol=tol, atol=tol * ref.abs().max().item()), form


def test_measure_times_real_products_in_rounds():
    rounds = C.measure_rounds("fp32", {"one": ("linear", "column")}, rounds=2)
    assert len(rounds) == 2 and all(r["one"]["linear"] > 0 and r["one"]["column"] > 0 for r in rounds)
    assert C.spread(rounds) >= 0.0


@pytest.mark.parametrize("form", ["column", "wxt", "linear", "packed"])
def test_linear_takes_the_plans_form_and_equals_the_reference(form):
    from refspec.models.gemm_forms import GemmChoice, WeightCopy, linear

    if form == "packed" and not packed_form_runs():
        return  # calibration never offers it here (asserted by packed_form_runs)
    plan = C.GemmPlan(forms={"fp32": {b: form for b in C.BUCKETS}}, timings_s={}, machine={})
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    kind = form if form in G.COPY_FORMS else "column"
    choice = GemmChoice(dtype=torch.float32, forms=plan.forms_of(torch.float32), copy=WeightCopy(w, kind))
    for rows in (1, 5, 40):
        x = torch.randn(rows, 64, generator=g)
        assert torch.allclose(linear(x, w, b, choice), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        xt = torch.randn(64, rows, generator=g).t()  # a column-major activation
        assert torch.allclose(linear(xt, w, b, choice), F.linear(xt, w, b), rtol=1e-5, atol=1e-5)
    # routing: only the plan's copy form reads the copy
    choice.copy.t = G.make_copy(kind, torch.zeros_like(w))
    out = linear(torch.randn(1, 64, generator=g), w, None, choice)
    assert torch.equal(out, torch.zeros(1, 96)) == (form in G.COPY_FORMS)
    w.add_(1.0)  # a changed weight: the stale copy is not read
    x = torch.randn(3, 64, generator=g)
    assert torch.allclose(linear(x, w, None, choice), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_packed_form_in_half_precision_rounds_like_the_reference():
    for dt in (torch.bfloat16, torch.float16):
        if not packed_form_runs(dt):
            continue  # oneDNN refuses fp16 on CPUs without fp16 conversion instructions; never offered
        g = torch.Generator().manual_seed(3)
        w, x = torch.randn(96, 64, generator=g).to(dt), torch.randn(5, 64, generator=g).to(dt)
        out = G.apply_form("packed", x, w, G.make_copy("packed", w))
        ref = F.linear(x.double(), w.double())
        assert out.dtype == dt and torch.allclose(out.double(), ref, rtol=2 ** -7, atol=2 ** -7 * ref.abs().max().item())


def test_resolve_plan_reads_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("REFSPEC_GEMM_PLAN", "reference")
    assert C.resolve_plan(torch.float32) is C.REFERENCE
    monkeypatch.setenv("REFSPEC_GEMM_PLAN", "fastest-please")
    with pytest.raises(ValueError, match="REFSPEC_GEMM_PLAN"):
        C.resolve_plan(torch.float32)
    monkeypatch.setenv("REFSPEC_GEMM_PLAN", "auto")
    monkeypatch.setenv("REFSPEC_HOME", str(tmp_path))
    monkeypatch.setattr(C, "measure_rounds", lambda d, buckets, timer: [
        {b: {f: {"wxt": 0.5}.get(f, 1.0) for f in fs} for b, fs in buckets.items()}] * 3)
    plan = C.resolve_plan(torch.float32)
    assert plan.forms["fp32"] == {"one": "wxt", "few": "wxt", "many": "wxt"}
    assert C.plan_path(tmp_path, C.machine_key()).exists()
    assert plan.extra_position_cost(torch.float32) == 1.0


def test_notable_cpu_flags_are_read_from_the_flags_line(monkeypatch):
    monkeypatch.setattr(C, "_cpu_fields", lambda: ("Some CPU", "fpu sse2 avx2 fma avx512f avx512_bf16 amx_tile"))
    assert C.notable_cpu_flags() == ["avx2", "fma", "avx512f", "avx512_bf16", "amx_tile"]
    monkeypatch.setattr(C, "_cpu_fields", lambda: ("Other", ""))
    assert C.notable_cpu_flags() == []


def test_nodnn_form_equals_the_reference_and_restores_onednn(monkeypatch):
    from refspec.models.gemm_forms import GemmChoice, linear

    timer, _ = table({("bf16", "one"): "nodnn"})
    plan = C.calibrate(("bf16",), timer=timer)
    assert plan.form(torch.bfloat16, 1) == "nodnn" and plan.copy_kind(torch.bfloat16) is None
    choice = GemmChoice(dtype=torch.bfloat16, forms=plan.forms_of(torch.bfloat16))
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(96, 64, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16()
    x = torch.randn(1, 64, generator=g).bfloat16()
    before = torch._C._get_mkldnn_enabled()
    seen = []
    real = G.without_onednn
    monkeypatch.setattr(G, "without_onednn", lambda fn, *a: (seen.append(fn), real(fn, *a))[1])
    out = linear(x, w, b, choice)
    assert seen == [F.linear], "the product took the nodnn form"
    assert torch._C._get_mkldnn_enabled() == before
    ref = F.linear(x.double(), w.double(), b.double())
    # one rounding of the fp32 accumulator, and of the bias add
    assert out.dtype == torch.bfloat16 and torch.allclose(out.double(), ref, rtol=2 ** -7, atol=2 ** -7)
    with pytest.raises(RuntimeError):  # a failing product still restores the flag
        G.without_onednn(F.linear, x, w[:, :3])
    assert torch._C._get_mkldnn_enabled() == before


def test_packed_form_passes_gradients_to_its_input():
    """A frozen weight's packed copy is bypassed while a gradient to the input is recorded
    (oneDNN's packed product has no backward: the gradient would silently vanish)."""
    from refspec.models.gemm_forms import GemmChoice, WeightCopy, linear

    if not packed_form_runs():
        return  # calibration never offers it here (asserted by packed_form_runs)
    g = torch.Generator().manual_seed(4)
    w = torch.randn(96, 64, generator=g)
    choice = GemmChoice(dtype=torch.float32, forms=("packed",) * 3, copy=WeightCopy(w, "packed"))
    x = torch.randn(5, 64, generator=g, requires_grad=True)
    linear(x, w, None, choice).square().sum().backward()
    ref = x.detach().clone().requires_grad_(True)
    F.linear(ref, w).square().sum().backward()
    assert x.grad is not None and torch.allclose(x.grad, ref.grad, rtol=1e-5, atol=1e-5)


def test_without_copies_takes_the_fastest_copy_free_forms():
    def timer(dtype, bucket, form):
        return {("one", "column"): 0.1, ("one", "wxt"): 0.5, ("few", "packed"): 0.1, ("few", "linear"): 0.6,
                ("few", "wxt"): 0.7, ("many", "packed"): 0.1, ("many", "wxt"): 0.4}.get((bucket, form), 1.0)
    plan = C.calibrate(("fp32",), timer=timer)
    assert plan.copy_kind(torch.float32) is not None
    free = plan.without_copies(torch.float32)
    assert free.forms["fp32"] == {"one": "wxt", "few": "linear", "many": "wxt"}
    assert free.copy_kind(torch.float32) is None and free.form(torch.float32, 8) == "linear"
    assert C.REFERENCE.without_copies(torch.float32) is C.REFERENCE


def test_a_model_whose_copies_do_not_fit_runs_copy_free_forms(tmp_path, monkeypatch):
    from refspec.models import load_model, prepare_target
    from refspec.models.cpu_speed import weight_copy_kind
    from tiny import save_hf

    def timer(dtype, bucket, form):
        return {"column": 0.1, "wxt": 0.5}.get(form, 1.0)
    plan = C.calibrate(("fp32",), timer=timer)
    save_hf("llama", tmp_path)
    monkeypatch.setenv("REFSPEC_CPU_WEIGHT_COPIES_GIB", "0")
    model = load_model(tmp_path)
    prepared = prepare_target(model, cpu_plan=plan)
    assert weight_copy_kind(model) is None and prepared.cpu_plan.forms["fp32"] == {b: "wxt" for b in C.BUCKETS}
    assert model.lm_head.gemm.forms == ("wxt",) * 3


def busy(spread: float):
    """A fake timer whose every other round takes ``1 + spread`` times as long (another job
    competing for the machine), with column fastest for one row."""
    calls, per_round = [], len(G.FORMS["fp32"]) * len(C.BUCKETS)  # an fp32 round times each form per bucket

    def timer(dtype, bucket, form):
        calls.append((dtype, bucket, form))
        slow = 1.0 + spread if (len(calls) - 1) // per_round % 2 else 1.0  # the load comes and goes
        return slow * (0.5 if (bucket, form) == ("one", "column") else 1.0)
    return timer, calls


def test_a_busy_calibration_is_refused_uncached_and_not_redone(tmp_path, caplog):
    """Rounds differing by more than BUSY_SPREAD: the dtype takes the reference form, nothing is
    written, the warning names the retry command, and the process does not time it again."""
    timer, calls = busy(0.5)
    with caplog.at_level("WARNING", logger="refspec.models.calibration"):
        plan = C.load_or_calibrate(tmp_path, dtypes=("fp32",), timer=timer)
    assert plan.form(torch.float32, 1) == "linear" and "fp32" not in plan.forms
    assert not C.plan_path(tmp_path, C.machine_key()).exists()
    assert "python -m refspec.eval calibrate --force" in caplog.text and "refused" in caplog.text
    n = len(calls)
    C.load_or_calibrate(tmp_path, dtypes=("fp32",), timer=timer)
    assert len(calls) == n, "a refused dtype is not timed again in this process"
    quiet, _ = table({("fp32", "one"): "column"})
    forced = C.load_or_calibrate(tmp_path, dtypes=("fp32",), timer=quiet, force=True)
    assert forced.form(torch.float32, 1) == "column" and C.plan_path(tmp_path, C.machine_key()).exists()


def test_a_quiet_calibration_is_cached_with_its_spread(tmp_path):
    timer, _ = busy(0.05)  # within BUSY_SPREAD
    plan = C.load_or_calibrate(tmp_path, dtypes=("fp32",), timer=timer)
    assert plan.form(torch.float32, 1) == "column" and C.trusted(plan, "fp32")
    saved = json.loads(C.plan_path(tmp_path, C.machine_key()).read_text())
    assert saved["forms"]["fp32"]["one"] == "column" and 0.0 < saved["spread"]["fp32"] <= C.BUSY_SPREAD


def test_rounds_pick_each_forms_best_and_spread_compares_their_totals():
    rounds = [{"one": {"linear": 1.0, "wxt": 2.0}}, {"one": {"linear": 1.5, "wxt": 1.8}}]
    assert C._best(rounds) == {"one": {"linear": 1.0, "wxt": 1.8}}
    assert C.spread(rounds) == pytest.approx(3.3 / 3.0 - 1.0)
