"""The opt-in compiled CPU step: equal to the eager reference, one compile per static shape.

The wrapper's logic (keys, fallbacks, stale copies, recompile counting) is tested through
dynamo's ``eager`` backend (traced, no code generation: fast); the generated code through
inductor on one tiny model, its compiles shared by the tests of one module-scoped step.
"""
import pytest
import torch

from refspec.drafters.ngram import NgramDrafter
from refspec.engine import Engine, EngineConfig
from refspec.models.compiled import CompiledStep, CompileError
from refspec.models.cpu_speed import plan_gemms, weight_copy_kind
from refspec.models.prepare import PreparedTarget, prepare_target
from refspec.models.transformer import Transformer
from tiny import copy_plan, tiny_args

EOS = [2]


def _model(name="llama", seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    m = Transformer(tiny_args(name))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)  # larger than the init's scale, so rounding differences show
    m = m.to(dtype)
    m.init_buffers()
    return m.eval().requires_grad_(False)


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randint(3, 96, (m,), generator=g).tolist() for m in (9, 14, 5)[:n]]
    ps[0] = ps[0][:4] * 3  # repetitive: the n-gram drafter finds matches
    return ps


def _step_inputs(m, b, s, seed=1, slots=128):
    """A cache prefilled eagerly with 20 tokens per row, and the next ``s`` tokens."""
    g = torch.Generator().manual_seed(seed)
    with torch.inference_mode():  # inference tensors, as the engine's
        cache = m.new_cache(b, slots)
        m(torch.randint(0, 96, (b, 20), generator=g), torch.arange(20).expand(b, 20), cache, num_keys=64)
        return cache, torch.randint(0, 96, (b, s), generator=g), torch.arange(20, 20 + s).expand(b, s)


@pytest.fixture(scope="module")
def inductor_step():
    m = _model()
    return m, CompiledStep(m)


def test_compiled_logits_equal_eager_within_rounding(inductor_step):
    m, step = inductor_step
    cache, tok, pos = _step_inputs(m, 2, 1, slots=64)  # a decode step of the engine below (B=2, S=1, T=64)
    with torch.inference_mode():
        ref, _ = m(tok, pos, cache, num_keys=64)
        out, _ = step(tok, pos, cache, num_keys=64)
    assert step.stats.compiles == 1 and step.stats.compiled_calls == 1
    # fused elementwise chains round differently (fp32 throughout): a few ulps of the logits' scale
    eps = torch.finfo(torch.float32).eps
    assert (out - ref).abs().max() <= 64 * eps * ref.abs().max(), (out - ref).abs().max()
    assert not torch.equal(out, torch.zeros_like(out))


def test_greedy_decode_through_the_compiled_verify_equals_eager(inductor_step):
    m, step = inductor_step
    # plain decode (S=1) and verification of untrimmed drafts (S=K+1=4): one compile each (and
    # one more for S=1 if the engine's cache is not the 64 slots of the test above)
    for drafter, k in ((None, 0), (NgramDrafter(max_n=3, trim=False, min_n=1), 3)):
        eager = Engine(m, drafter, config=EngineConfig(k=k), eos_token_ids=EOS)
        compiled = Engine(PreparedTarget(m, step=step), drafter, config=EngineConfig(k=k), eos_token_ids=EOS)
        before = step.stats.compiled_calls
        ref, out = (e.generate(_prompts(2), max_new_tokens=24) for e in (eager, compiled))
        assert out.tokens == ref.tokens and out.accepted_per_step == ref.accepted_per_step
        assert step.stats.compiled_calls - before == out.steps  # every step compiled, prefill eager
    assert step.stats.recompiles == 0 and step.stats.compiles <= 3, step.stats


def test_no_recompile_per_step_within_a_bucket():
    m = _model()
    step = CompiledStep(m, backend="eager", keys_bucket=None)
    cache, tok, pos = _step_inputs(m, 1, 1)
    with torch.inference_mode():
        for i in range(6):  # the positions, tokens and cache contents change; the shapes do not
            step(tok + i, pos + i, cache, num_keys=64)
        assert (step.stats.compiles, step.stats.recompiles, step.stats.compiled_calls) == (1, 0, 6)
        step(tok, pos, cache, num_keys=128)  # a new key bucket: one more compile
        step(torch.cat([tok, tok], 1), torch.cat([pos, pos + 1], 1), cache, num_keys=64)  # S = 2
    assert (step.stats.compiles, step.stats.recompiles) == (3, 0), step.stats


def test_keys_bucket_rounds_chain_steps_up():
    m = _model()
    step = CompiledStep(m, backend="eager", keys_bucket=64)
    cache, tok, pos = _step_inputs(m, 1, 1)
    with torch.inference_mode():
        ref, _ = m(tok, pos, cache, num_keys=24)
        for tk in (24, 40, 64):  # one key: Tk 64 (the causal mask hides the extra slots)
            out, _ = step(tok, pos, cache, num_keys=tk)
            torch.testing.assert_close(out, ref)
    assert step.stats.compiles == 1


def test_prefill_and_embeddings_run_eagerly():
    m = _model()
    step = CompiledStep(m, backend="eager", max_tokens_per_row=4)
    cache, tok, pos = _step_inputs(m, 1, 5)
    with torch.inference_mode():
        ref, _ = m(tok, pos, cache, num_keys=64)
        out, _ = step(tok, pos, cache, num_keys=64)
        step(None, pos[:, :2], cache, num_keys=64, inputs_embeds=m.embed_tokens(tok[:, :2]))
    assert torch.equal(out, ref)
    assert step.stats.compiles == 0 and step.stats.eager_calls == 2, step.stats


def test_weight_copies_trace_and_a_stale_copy_runs_eagerly():
    m = _model()
    plan_gemms(m, copy_plan())
    assert weight_copy_kind(m) == "column"  # column copies for one fp32 row: the graph reads them
    step = CompiledStep(m, backend="eager")
    cache, tok, pos = _step_inputs(m, 1, 1)
    with torch.inference_mode():
        ref, _ = m(tok, pos, cache, num_keys=64)
        out, _ = step(tok, pos, cache, num_keys=64)  # fullgraph: a graph break would raise here
        torch.testing.assert_close(out, ref)
        m.layers[0].mlp.down.weight.mul_(0.5)  # in place: the column copy is stale
        ref2, _ = m(tok, pos, cache, num_keys=64)
        out2, _ = step(tok, pos, cache, num_keys=64)
        wo = m.layers[1].attn.wo
        wo.weight = torch.nn.Parameter(wo.weight * 2, requires_grad=False)  # replaced: its copy is stale too
        m.layers[0].mlp.down.gemm = None  # (no choice: that matrix is multiplied by F.linear)
        ref3, _ = m(tok, pos, cache, num_keys=64)
        out3, _ = step(tok, pos, cache, num_keys=64)
    assert torch.equal(out2, ref2) and not torch.equal(ref2, ref) and torch.equal(out3, ref3)
    assert step.stats.eager_reasons == {"a weight changed since its copy was made": 2}, step.stats


def test_work_is_recorded_as_eagerly():
    from refspec.energy.model.work import WorkRecorder

    m = _model()
    step = CompiledStep(m, backend="eager")
    cache, tok, pos = _step_inputs(m, 2, 3)
    with torch.inference_mode():
        with WorkRecorder() as ref:
            m(tok, pos, cache, num_keys=128)
        with WorkRecorder() as rec:  # Tk 64 rounded up to the cache's 128 slots: the keys it reads
            step(tok, pos, cache, num_keys=64)
    assert rec.work == ref.work and len(rec.work) == 1


def test_prepare_target_compiles_on_request_and_refuses_it_off_the_cpu_or_with_graphs():
    m = _model()
    assert prepare_target(m).step is m
    assert isinstance(prepare_target(m, compile=True).step, CompiledStep)
    with pytest.raises(CompileError, match="ask for one of them"):
        prepare_target(m, compile=True, cuda_graphs=True)
    with pytest.raises(CompileError, match="CPU"):
        prepare_target(m.to("meta"), compile=True)


def test_eval_run_with_compile_verifies_through_the_compiled_step(tmp_path, monkeypatch):
    import json

    from refspec.eval import cli
    from refspec.models import compiled, prepare
    from test_eval_cli import QUIET
    from tiny import save_hf, save_tokenizer

    made = []

    class Recorded(compiled.CompiledStep):  # dynamo-traced, ATen-run: the CLI's wiring, no codegen
        def __init__(self, model, **kw):
            super().__init__(model, backend="eager", **kw)
            made.append(self)

    monkeypatch.setattr(prepare, "CompiledStep", Recorded)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    save_hf("llama", tmp_path / "model")
    save_tokenizer(tmp_path / "model")
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": f"w{3 + i} w4 w5 w{6 + i} w4 w5", "kind": "code"})
                                              + "\n" for i in range(2)))
    records = []
    for flag in ([], ["--compile"]):
        out = tmp_path / f"out{len(flag)}"
        argv = ["--model", str(tmp_path / "model"), "--corpus", str(tmp_path / "p.jsonl"), "--max-new-tokens", "6",
                "--batch", "2", "--no-warmup", "--out", str(out), *QUIET, *flag]
        assert cli.main(argv) == 0
        records.append(json.loads((out / "summary.json").read_text()))
    assert [[r["compiled_step"] for r in recs] for recs in records] == [[False] * 2, [True] * 2]
    assert [r["output_digest"] for r in records[0]] == [r["output_digest"] for r in records[1]]
    assert len(made) == 1 and made[0].stats.compiled_calls > 0 and made[0].stats.recompiles == 0, made


def test_a_nodnn_plan_runs_the_graph_with_onednn_off():
    from refspec.models.calibration import GemmPlan

    m = _model(dtype=torch.bfloat16)
    plan_gemms(m, GemmPlan(forms={"bf16": {"one": "nodnn", "few": "linear", "many": "linear"}}, timings_s={},
                           machine={}))
    step = CompiledStep(m, backend="eager")
    cache, tok, pos = _step_inputs(m, 1, 1)
    seen = []
    real = step._fn
    step._fn = lambda *a: (seen.append(torch._C._get_mkldnn_enabled()), real(*a))[1]
    with torch.inference_mode():
        ref, _ = m(tok, pos, cache, num_keys=64)
        out, _ = step(tok, pos, cache, num_keys=64)
    assert seen == [False] and torch._C._get_mkldnn_enabled()
    assert torch.equal(out, ref)  # the same ATen products, in the same order
