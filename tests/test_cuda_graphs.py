"""CUDA-graph runner: the static-shape path equals the dynamic one; padding is harmless.

CPU tests run the runner in eager-static mode (same bucketing, padding and KV pool, no
capture). GPU-marked tests compare captured graphs with eager-static runs bit for bit.
"""
import copy

import pytest
import torch

from refspec.cache import causal_mask
from refspec.cuda_graphs import CacheView, CudaGraphError, GraphRunner, batch_bucket, cuda_graphs_enabled
from refspec.drafters.draft_model import DraftModelDrafter
from refspec.drafters.ngram import NgramDrafter
from refspec.engine import Engine, EngineConfig
from refspec.models.prepare import PreparedTarget, prepare_target

EOS = [2]


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = [5, 17, 1, 30, 9, 12, 3, 25, 7, 2][:n]
    ps = [torch.randint(3, 96, (m,), generator=g).tolist() for m in lens]
    if n > 1:
        ps[1] = ps[1][:6] * 3  # repetitive: the n-gram drafter finds matches
    return ps


def _graph_wrap(capture):
    """A draft model whose steps run through a runner of their own."""
    return lambda model: PreparedTarget(model, step=GraphRunner(model, capture=capture, max_tokens_per_row=2))


def _make_drafter(name, m, wrap):
    """(drafter, k) of a name; ``wrap`` readies a draft model (its steps through a runner)."""
    if name == "plain":
        return None, 0
    if name == "ngram":
        return NgramDrafter(max_n=3), 3
    if name == "draft-model":
        return DraftModelDrafter(wrap(m.truncated(1)), target_vocab_size=m.args.vocab_size), 3
    from refspec.drafters.eagle import EagleDrafter, HeadConfig, TreeConfig, new_head

    torch.manual_seed(0)  # an untrained head: acceptance is irrelevant, shapes and hidden states are not
    kind = "eagle3" if name == "eagle3" else "eagle"
    head = new_head(HeadConfig.for_target(kind, m.args)).to(m.device).eval()
    for p in head.parameters():  # the target's dtype, rotary buffers kept in fp32 (as eagle.load_head does)
        p.data = p.data.to(m.dtype)
    tree = TreeConfig(topk=2, depth=3, budget=6) if name == "eagle2-tree" else None
    return EagleDrafter(head, m, tree=tree), (tree.budget if tree else 3)


def _engine(m, drafter_name, *, static, capture=False, **kw):
    """An engine whose verify (and draft-model) steps run through runners when ``static``."""
    wrap = _graph_wrap(capture) if static else (lambda x: x)
    drafter, k = _make_drafter(drafter_name, m, wrap)
    verify = GraphRunner(m, capture=capture) if static else None
    target = PreparedTarget(m, step=verify) if static else m
    return Engine(target, drafter, config=EngineConfig(k=k), eos_token_ids=EOS, **kw), verify


# ---- CPU: eager-static ---------------------------------------------------------------------------
@pytest.mark.parametrize("family,drafter", [("llama", "plain"), ("gemma3", "plain"), ("llama", "ngram"),
                                            ("gemma3", "ngram"), ("qwen2", "draft-model"), ("llama", "eagle3"),
                                            ("gemma3", "eagle2-tree")])
def test_static_path_equals_dynamic_token_for_token(tiny_models, family, drafter):
    m = tiny_models[family]
    for prompts in (_prompts(10)[:1], _prompts(10)):  # buckets 1 and 16 (6 padded rows)
        dynamic = _engine(m, drafter, static=False)[0].generate(prompts, max_new_tokens=12)
        engine, runner = _engine(m, drafter, static=True)
        static = engine.generate(prompts, max_new_tokens=12)
        for i, (a, b) in enumerate(zip(dynamic.tokens, static.tokens)):
            assert a == b, f"{family}/{drafter} batch {len(prompts)} row {i}: static {b} != dynamic {a}"
        assert static.accepted_per_step == dynamic.accepted_per_step
        assert runner.stats.static_calls == static.steps and runner.stats.eager_calls == 0, runner.stats


def _filled_view(runner, b, t, seed=0):
    """A view of ``b`` rows whose whole pool holds random K/V (rows are 'prefilled')."""
    view = runner.new_cache(b, t)
    g = torch.Generator().manual_seed(seed)
    pool = view.pool
    pool.k.copy_(torch.randn(pool.k.shape, generator=g))
    pool.v.copy_(torch.randn(pool.v.shape, generator=g))
    return view


def _nan_equal(a, b):
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_padded_rows_change_nothing(tiny_models, family):
    """Real rows' outputs do not depend on what padded rows hold (even NaN), padded rows write
    only slots 0..S-1 of their own pool rows, and real rows only their own slots."""
    m = tiny_models[family]
    runner = GraphRunner(m, capture=False)
    b, s, t = 3, 4, 64  # bucket 4: one padded row
    view = _filled_view(runner, b, t)
    pool = view.pool
    lengths = torch.tensor([7, 20, 1])
    positions = lengths[:, None] + torch.arange(s)
    tokens = torch.randint(3, 96, (b, s), generator=torch.Generator().manual_seed(1))
    pool.k[:, b:] = float("nan")  # poison the padded row's stale KV
    pool.v[:, b:] = float("nan")
    before_k = pool.k.clone()
    with torch.inference_mode():
        logits, hidden = runner(tokens, positions, view, num_keys=32, hidden_layers=(0,))
    assert torch.isfinite(logits).all() and torch.isfinite(hidden[0]).all()
    changed = ~((pool.k == before_k) | (pool.k.isnan() & before_k.isnan()))  # [L, R, Hkv, T, D]
    changed_slots = changed.any(dim=(0, 2, 4))  # [R, T]
    for row in range(b):
        written = set(range(int(lengths[row]), int(lengths[row]) + s))
        assert set(changed_slots[row].nonzero().flatten().tolist()) <= written, f"row {row} wrote outside its slots"
    for row in range(b, pool.batch):
        assert set(changed_slots[row].nonzero().flatten().tolist()) <= set(range(s)), "pad row wrote beyond 0..S-1"

    # other junk in the padded row: bit-identical real outputs
    pool.k[:, b:] = 123.0
    with torch.inference_mode():
        logits2, hidden2 = runner(tokens, positions, view, num_keys=32, hidden_layers=(0,))
    assert torch.equal(logits, logits2) and torch.equal(hidden[0], hidden2[0])

    # the same call without padding (a plain cache with the same contents) agrees
    plain = m.new_cache(b, t)
    plain.k.copy_(view.k)
    plain.v.copy_(view.v)
    with torch.inference_mode():
        ref, ref_hidden = m(tokens, positions, plain, num_keys=32, hidden_layers=(0,))
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden[0], ref_hidden[0], rtol=1e-5, atol=1e-5)


def test_tree_masks_and_keys_bucket(tiny_models):
    """Explicit slots / masks (tree verification) pad and widen to the bucketed key count."""
    m = tiny_models["gemma3"]
    runner = GraphRunner(m, capture=False, keys_bucket=64)
    b, s, t = 5, 3, 128
    view = _filled_view(runner, b, t, seed=3)
    plain = m.new_cache(b, t)
    plain.k.copy_(view.k)
    plain.v.copy_(view.v)
    base = torch.tensor([4, 9, 30, 2, 11])
    anc = torch.eye(s, dtype=torch.bool).repeat(b, 1, 1)  # both nodes are children of the root
    anc[:, 1:, 0] = True
    positions = base[:, None] + torch.tensor([0, 1, 1])
    slots = base[:, None] + torch.arange(s)
    from refspec.cache import tree_mask

    mask = tree_mask(base, anc, positions, 40)
    sliding = tree_mask(base, anc, positions, 40, m.args.sliding_window)
    tokens = torch.randint(3, 96, (b, s), generator=torch.Generator().manual_seed(2))
    kw = dict(slots=slots, mask=mask, sliding_mask=sliding, num_keys=40)
    with torch.inference_mode():
        got, _ = runner(tokens, positions, view, **kw)
        want, _ = m(tokens, positions, plain, **kw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert runner.stats.static_calls == 1 and runner.stats.eager_calls == 0


def test_buckets_and_eager_fallbacks(tiny_models):
    assert [batch_bucket(x, (1, 2, 4, 8)) for x in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    m = tiny_models["llama"]
    runner = GraphRunner(m, capture=False, batch_buckets=(1, 2, 4), max_tokens_per_row=4)
    prompts = _prompts(6)  # 6 rows > largest bucket 4: every step runs eagerly, still correct
    want = Engine(m, eos_token_ids=EOS).generate(prompts, max_new_tokens=8).tokens
    got = Engine(PreparedTarget(m, step=runner), eos_token_ids=EOS).generate(prompts, max_new_tokens=8).tokens
    assert got == want
    assert runner.stats.static_calls == 0 and runner.stats.eager_calls > 0
    assert any("largest bucket" in r for r in runner.stats.eager_reasons)
    foreign = m.new_cache(1, 32)  # not the runner's pool: eager
    with torch.inference_mode():
        runner(torch.tensor([[5]]), torch.tensor([[0]]), foreign, num_keys=32)
    assert any("new_cache" in r for r in runner.stats.eager_reasons)
    view = runner.new_cache(2, 32)  # prefill-length forward: eager through the view
    with torch.inference_mode():
        runner(torch.randint(3, 96, (2, 9)), torch.arange(9)[None].expand(2, 9), view, num_keys=32)
    assert any("max_tokens_per_row" in r for r in runner.stats.eager_reasons)


def _greedy_decode_with_shrink(m, runner, prompts, steps, keep_after, keep):
    """Plain greedy decode through ``runner``; after ``keep_after`` steps drop all rows but ``keep``.

    Returns the emitted tokens of every original row (dropped rows stop early)."""
    b = len(prompts)
    t = 64
    s_max = max(map(len, prompts))
    view = runner.new_cache(b, t)
    tok = torch.zeros(b, s_max, dtype=torch.long, device=m.device)
    for i, p in enumerate(prompts):
        tok[i, : len(p)] = torch.tensor(p)
    plens = torch.tensor([len(p) for p in prompts], device=m.device)
    with torch.inference_mode():
        logits, _ = m(tok, torch.arange(s_max, device=m.device)[None].expand(b, s_max), view, num_keys=t,
                      logits_at=(plens - 1)[:, None])
        pending = logits[:, 0].argmax(-1)
        lengths = plens.clone()
        rows = list(range(b))
        out = {i: [int(x)] for i, x in enumerate(pending.tolist())}
        for step in range(steps):
            if step == keep_after:
                view = view.keep_rows(keep)
                sel = torch.tensor(keep, device=m.device)
                pending, lengths, rows = pending[sel], lengths[sel], [rows[i] for i in keep]
            logits, _ = runner(pending[:, None], lengths[:, None], view, num_keys=t)
            pending = logits[:, 0].argmax(-1)
            lengths = lengths + 1
            for r, x in zip(rows, pending.tolist()):
                out[r].append(int(x))
    return out


def test_batch_that_shrinks_mid_run_keeps_working(tiny_models):
    m = tiny_models["qwen2"]
    prompts = _prompts(6)
    want = Engine(m).generate(prompts, max_new_tokens=9).tokens
    runner = GraphRunner(m, capture=False)
    got = _greedy_decode_with_shrink(m, runner, prompts, steps=8, keep_after=3, keep=[5, 0, 3])
    for r in (5, 0, 3):
        assert got[r] == want[r], f"kept row {r}: {got[r]} != {want[r]}"
    for r in (1, 2, 4):
        assert got[r] == want[r][:4], f"dropped row {r} before it was dropped"
    assert runner.stats.eager_calls == 0


def test_capture_buckets_prepares_every_bucket_eager_static(tiny_models):
    m = tiny_models["llama"]
    runner = GraphRunner(m, capture=False)
    runner.reserve(64, 64)
    assert runner.capture_buckets(tokens_per_row=4, num_keys=64) == 7
    assert runner.num_keys_prepared == 7


def test_cuda_graph_choice_helpers(tiny_models):
    m = tiny_models["llama"]
    assert prepare_target(m).step is m, "eager unless graphs are asked for"
    assert cuda_graphs_enabled(None, "cuda") and not cuda_graphs_enabled(None, "cpu")
    with pytest.raises(CudaGraphError, match="needs a CUDA device"):
        cuda_graphs_enabled(True, "cpu")
    with pytest.raises(CudaGraphError, match="CUDA device"):
        prepare_target(m, cuda_graphs=True)
    with pytest.raises(CudaGraphError, match="CUDA device"):
        GraphRunner(m, capture=True)
    assert isinstance(PreparedTarget(m, step=GraphRunner(m, capture=False)).new_cache(3, 16), CacheView)


# ---- GPU: graphs equal eager-static bit for bit ------------------------------------------------
def _on_cuda(m, dtype):
    g = copy.deepcopy(m).to(device="cuda", dtype=dtype)
    g.init_buffers("cuda")
    return g


class _Recorder:
    """Wraps a runner, keeping every output (and forwarding ``new_cache`` so the engine uses the pool)."""

    def __init__(self, runner):
        self.runner, self.outputs = runner, []

    def new_cache(self, batch, max_len):
        return self.runner.new_cache(batch, max_len)

    def __call__(self, *args, **kwargs):
        out = self.runner(*args, **kwargs)
        self.outputs.append(out)
        return out


@pytest.mark.gpu
@pytest.mark.parametrize("family,drafter", [("llama", "plain"), ("llama", "ngram"), ("llama", "draft-model"),
                                            ("llama", "eagle"), ("llama", "eagle3"), ("gemma3", "eagle2-tree")])
def test_graphs_equal_eager_bit_for_bit_bf16(tiny_models, family, drafter):
    """bf16 greedy: graph replay == eager-static (same kernels, same shapes), logits and hidden
    states bit for bit at every step (EAGLE: the verify graph feeds the head its features; the
    head's own steps run eagerly)."""
    m = _on_cuda(tiny_models[family], torch.bfloat16)
    prompts = _prompts(10)
    runs = {}
    for capture in (False, True):
        d, k = _make_drafter(drafter, m, _graph_wrap(capture))
        rec = _Recorder(GraphRunner(m, capture=capture))
        gen = Engine(PreparedTarget(m, step=rec), d, config=EngineConfig(k=k), eos_token_ids=EOS).generate(
            prompts, max_new_tokens=16)
        runs[capture] = (gen, rec)
    (g_eager, r_eager), (g_graph, r_graph) = runs[False], runs[True]
    assert g_graph.tokens == g_eager.tokens
    assert r_graph.runner.stats.replays == len(r_graph.outputs) >= 5, "several steps ran through graphs"
    for step, ((la, ha), (lb, hb)) in enumerate(zip(r_eager.outputs, r_graph.outputs)):
        assert torch.equal(la, lb), f"step {step}: graph logits differ from eager-static"
        assert all(torch.equal(x, y) for x, y in zip(ha, hb)), f"step {step}: hidden states differ"


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", ["plain", "ngram", "draft-model", "eagle2-tree"])
def test_graphs_equal_dynamic_tokens_fp32(tiny_models, drafter):
    """fp32 (TF32 off): graph runs emit the dynamic eager engine's tokens exactly."""
    torch.backends.cuda.matmul.allow_tf32 = False
    m = _on_cuda(tiny_models["gemma3"], torch.float32)
    prompts = _prompts(10)
    want = Engine(m, eos_token_ids=EOS).generate(prompts, max_new_tokens=16).tokens
    d, k = _make_drafter(drafter, m, _graph_wrap(True))
    got = Engine(prepare_target(m, cuda_graphs=True), d, config=EngineConfig(k=k), eos_token_ids=EOS).generate(
        prompts, max_new_tokens=16).tokens
    assert got == want


@pytest.mark.gpu
def test_capture_for_every_bucket():
    from tiny import tiny_args

    from refspec.models.random_models import random_model

    m = random_model(tiny_args("llama"), device="cuda", dtype=torch.bfloat16)
    graph, static = GraphRunner(m, capture=True), GraphRunner(m, capture=False)
    for r in (graph, static):
        r.reserve(64, 64)
    assert graph.capture_buckets(tokens_per_row=4, num_keys=64) == 7
    assert graph.stats.captures == 7
    g = torch.Generator(device="cuda").manual_seed(0)
    for b in (1, 2, 3, 5, 8, 13, 16, 31, 32, 50, 64):
        vg, vs = graph.new_cache(b, 64), static.new_cache(b, 64)
        vg.pool.k.normal_(generator=g)
        vg.pool.v.normal_(generator=g)
        vs.pool.k.copy_(vg.pool.k)
        vs.pool.v.copy_(vg.pool.v)
        lengths = torch.randint(0, 40, (b,), device="cuda", generator=g)
        pos = lengths[:, None] + torch.arange(4, device="cuda")
        tok = torch.randint(0, m.args.vocab_size, (b, 4), device="cuda", generator=g)
        with torch.inference_mode():
            lg, _ = graph(tok, pos, vg, num_keys=64)
            ls, _ = static(tok, pos, vs, num_keys=64)
        assert torch.equal(lg, ls), f"batch {b}: graph != eager-static"
    assert graph.stats.captures == 7, "every batch reused its bucket's graph"


@pytest.mark.gpu
def test_shrinking_batch_with_graphs(tiny_models):
    torch.backends.cuda.matmul.allow_tf32 = False
    m = _on_cuda(tiny_models["qwen2"], torch.float32)
    prompts = _prompts(6)
    want = Engine(m).generate(prompts, max_new_tokens=9).tokens
    runner = GraphRunner(m, capture=True)
    got = _greedy_decode_with_shrink(m, runner, prompts, steps=8, keep_after=3, keep=[5, 0, 3])
    for r in (5, 0, 3):
        assert got[r] == want[r], f"kept row {r}: {got[r]} != {want[r]}"
    assert runner.stats.captures == 2, "bucket 8 before the shrink, bucket 4 after"


@pytest.mark.gpu
def test_replay_does_not_sync_the_host(tiny_models):
    m = _on_cuda(tiny_models["llama"], torch.bfloat16)
    runner = GraphRunner(m, capture=True)
    view = runner.new_cache(3, 64)
    tok = torch.randint(3, 96, (3, 4), device="cuda")
    pos = torch.arange(4, device="cuda")[None].expand(3, 4) + 5
    with torch.inference_mode():
        runner(tok, pos, view, num_keys=64)  # capture (may sync)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            runner(tok, pos, view, num_keys=64)  # replay: must not sync
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert runner.stats.replays == 2


def test_causal_pad_mask_sees_only_own_slots():
    """The padding mask: query i of a padded row sees exactly slots 0..i."""
    pad = torch.arange(4)[None]
    mask = causal_mask(pad, 8)[0, 0]
    assert mask.sum(1).tolist() == [1, 2, 3, 4] and not mask[:, 4:].any()
