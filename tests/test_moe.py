"""Mixture-of-experts targets (qwen3_moe, mixtral): logits equal transformers' on the same
weights through our loader, every drafter is lossless on them, and the cost model bills the
experts the router chose."""
import itertools
import math

import pytest
import torch

from refspec.config import ConfigError, ModelArgs
from refspec.energy.model.experts import expected_experts, expert_parameters
from refspec.energy.model.roofline import forward_cost, layer_parameters
from refspec.energy.model.work import WorkRecorder
from refspec.models import CheckpointError, PreparedTarget, load_model
from refspec.models import moe as moe_mod

EOS = [2]
_BASE = dict(vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
MOE_HF = {
    # layer 1 is dense (mlp_only_layers): both MLP kinds in one model
    "qwen3_moe": dict(_BASE, model_type="qwen3_moe", intermediate_size=96, moe_intermediate_size=32,
                      num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[1], rms_norm_eps=1e-6, rope_theta=1e6),
    "qwen3_moe_unnormed": dict(_BASE, model_type="qwen3_moe", intermediate_size=96, moe_intermediate_size=32,
                               num_hidden_layers=2, num_experts=6, num_experts_per_tok=3, norm_topk_prob=False,
                               rms_norm_eps=1e-6, rope_theta=1e6),
    # a gated shared expert beside the routed ones, q/k/v biases
    "qwen2_moe": dict(_BASE, model_type="qwen2_moe", intermediate_size=96, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, num_hidden_layers=2, num_experts=6, num_experts_per_tok=2,
                      norm_topk_prob=False, qkv_bias=True, rms_norm_eps=1e-6, rope_theta=1e6),
    "mixtral": dict(_BASE, model_type="mixtral", intermediate_size=32, num_hidden_layers=2, num_local_experts=4,
                    num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=1e6),
}


def _hf_model(name: str, seed: int = 0):
    """A transformers model of a tiny MoE config; routers scaled up so routing is decisive
    (no near-ties a rounding difference could flip) and norms perturbed so mapping slips show."""
    import transformers

    config = transformers.AutoConfig.for_model(**MOE_HF[name])
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
            if n.endswith("bias"):
                p.normal_(0.0, 0.1)
            if n.endswith("gate.weight"):  # the routers
                p.normal_(0.0, 1.0)
    return model.eval()


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """(transformers model, our model loaded from its save_pretrained directory) per config."""
    out = {}
    for name in MOE_HF:
        hf = _hf_model(name)
        d = tmp_path_factory.mktemp(name)
        hf.save_pretrained(d)
        out[name] = (hf, load_model(d), d)
    return out


def _logits(model, toks):
    b, s = toks.shape
    lg, _ = model(toks, torch.arange(s)[None].expand(b, s), model.new_cache(b, s + 8))
    return lg


@pytest.mark.parametrize("name", list(MOE_HF))
@pytest.mark.parametrize("dispatch", moe_mod.DISPATCH)
def test_logits_match_transformers(moe_models, name, dispatch):
    hf, ours, _ = moe_models[name]
    toks = torch.randint(0, 96, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(toks).logits
    ours.set_moe_dispatch(dispatch)
    try:
        lg = _logits(ours, toks)
    finally:
        ours.set_moe_dispatch("gather")
    diff = (ref - lg).abs().max().item()
    assert diff < 1e-4, f"{name}/{dispatch}: logits differ from transformers by {diff}"
    assert torch.equal(ref.argmax(-1), lg.argmax(-1))


def test_config_fields_follow_each_family(moe_models):
    q = moe_models["qwen3_moe"][1].args
    assert (q.num_experts, q.num_experts_per_tok, q.moe_intermediate_size, q.norm_topk_prob) == (8, 2, 32, True)
    assert q.dense_layers == (1,) and q.qk_norm and [q.is_moe_layer(i) for i in range(3)] == [True, False, True]
    m = moe_models["mixtral"][1].args
    assert (m.num_experts, m.moe_intermediate_size, m.norm_topk_prob, m.qk_norm) == (4, 32, True, False)
    w = moe_models["qwen2_moe"][1].args
    assert (w.shared_expert_intermediate_size, w.attention_bias, w.qk_norm, w.norm_topk_prob) == (48, True, False, False)
    for args in (q, m, w):
        assert ModelArgs.from_hf_config(args.to_hf_config()) == args


def test_parameter_counts_equal_the_transformers_model(moe_models):
    for name, (hf, ours, _) in moe_models.items():
        assert ours.args.num_parameters() == sum(p.numel() for p in hf.parameters()), name
        assert sum(p.numel() for p in ours.parameters()) == ours.args.num_parameters(), name
        a = ours.args  # the cost model's split covers every parameter once
        per_layer = sum(sum(layer_parameters(a, i)) for i in range(a.num_layers))
        embed = a.vocab_size * a.hidden_size * (1 if a.tie_word_embeddings else 2) + a.hidden_size
        assert per_layer + a.moe_layers() * a.num_experts * expert_parameters(a) + embed == a.num_parameters(), name


@pytest.mark.parametrize("bad, msg", [({"num_experts_per_tok": 9}, "num_experts_per_tok"),
                                      ({"num_experts": None}, "num_experts")])
def test_bad_expert_configs_are_one_line_errors(bad, msg):
    cfg = {k: v for k, v in {**MOE_HF["qwen3_moe"], **bad}.items() if v is not None}
    with pytest.raises(ConfigError, match=msg) as err:
        ModelArgs.from_hf_config(cfg)
    assert "\n" not in str(err.value)


def test_fused_expert_checkpoints_load_the_same_model(moe_models, tmp_path):
    """transformers 5 keeps experts as 3-D tensors in memory; a checkpoint written from its
    state dict (fused names) loads to the same logits as the per-expert one on disk."""
    from safetensors.torch import save_file

    hf, ours, d = moe_models["qwen3_moe"]
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in sd), "transformers' in-memory form is fused"
    save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    fused = load_model(tmp_path)
    toks = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(2))
    assert torch.equal(_logits(fused, toks), _logits(ours, toks))
    del sd["model.layers.0.mlp.experts.down_proj"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing 8 keys"):
        load_model(tmp_path)


def test_a_layer_whose_experts_span_two_shards_loads(moe_models, tmp_path):
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    hf, ours, d = moe_models["mixtral"]
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    keys = sorted(tensors)  # layer 0's experts 0..1 in one shard, 2..3 in the other
    cut = keys.index("model.layers.0.block_sparse_moe.experts.2.w1.weight")
    shards = {"a.safetensors": keys[:cut], "b.safetensors": keys[cut:]}
    for name, part in shards.items():
        save_file({k: tensors[k] for k in part}, str(tmp_path / name))
    index = {"weight_map": {k: name for name, part in shards.items() for k in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    toks = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(8))
    assert torch.equal(_logits(load_model(tmp_path), toks), _logits(ours, toks))


def test_save_model_writes_per_expert_names_transformers_reads(moe_models, tmp_path):
    import transformers

    from refspec.models.loading import save_model

    hf, ours, _ = moe_models["mixtral"]
    save_model(ours, tmp_path)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    toks = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(again(toks).logits, hf(toks).logits)


def test_incremental_cache_equals_full_forward(moe_models):
    m = moe_models["qwen3_moe"][1]
    toks = torch.randint(3, 96, (2, 20), generator=torch.Generator().manual_seed(4))
    full = _logits(m, toks)
    cache = m.new_cache(2, 32)
    m(toks[:, :8], torch.arange(8)[None].expand(2, 8), cache)
    steps = [m(toks[:, i:i + 1], torch.full((2, 1), i), cache, num_keys=32)[0][:, 0] for i in range(8, 20)]
    assert (torch.stack(steps, 1) - full[:, 8:]).abs().max().item() < 1e-4


def test_dispatch_paths_agree_and_count_the_same_experts():
    torch.manual_seed(5)
    n, e, x, k, i = 13, 16, 6, 2, 8
    h = torch.randn(n, e)
    gate_up, down = torch.randn(x, 2 * i, e), torch.randn(x, e, i)
    routed = [moe_mod.route(h, torch.randn(x, e), k, True)]
    t = torch.arange(n)
    fixed = torch.stack([t % 3, 3 + t % 2], 1)  # experts 0..4; expert 5 gets no token
    routed.append((torch.rand(n, k), fixed))
    for w, idx in routed:
        a, touched_a = moe_mod.dispatch_gather(h, w, idx, gate_up, down)
        assert touched_a == len(set(idx.flatten().tolist()))
        for other in (moe_mod.dispatch_grouped, moe_mod.dispatch_dense):
            b, touched_b = other(h, w, idx, gate_up, down)
            assert torch.allclose(a, b, atol=1e-4), other.__name__
            assert int(touched_b) == touched_a, other.__name__
        for tok in range(n):  # by hand: each token's weighted sum over its own experts
            ref = sum(w[tok, j] * moe_mod._expert_mlp(h[tok], gate_up[idx[tok, j]], down[idx[tok, j]])
                      for j in range(k))
            assert torch.allclose(a[tok], ref, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dispatch", ["grouped", "dense"])
def test_graph_replays_equal_eager_and_count_experts_on_cuda(moe_models, dispatch):
    """bf16 on CUDA: a captured verify (grouped or dense dispatch) gives the eager tokens, and
    each replay updates the experts-touched counters the ledger bills from."""
    from refspec.cuda_graphs import GraphRunner
    from refspec.engine import Engine, EngineConfig

    m = moe_models["qwen3_moe"][1]
    m = m.to(device="cuda", dtype=torch.bfloat16)
    m.init_buffers("cuda")
    prompts = _prompts(6)
    try:
        m.set_moe_dispatch(dispatch)
        eager = Engine(m, _drafter("ngram", m), config=EngineConfig(k=3), eos_token_ids=EOS).generate(
            prompts, max_new_tokens=16)
        runner, events = GraphRunner(m, capture=True), []
        graph = Engine(PreparedTarget(m, step=runner), _drafter("ngram", m), config=EngineConfig(k=3),
                       observers=[events.append], eos_token_ids=EOS).generate(prompts, max_new_tokens=16)
        assert runner.stats.replays >= 3
        assert graph.tokens == eager.tokens
        counts = [w.experts_touched for ev in events if ev.phase == "verify" for w in ev.work]
        assert counts and all(0 < c <= 2 * m.args.num_experts for c in counts)
        assert len(set(counts)) > 1, "replays update the counters (they are not the capture's)"
    finally:
        m.set_moe_dispatch("gather")
        m.to(device="cpu", dtype=torch.float32)
        m.init_buffers("cpu")


def test_static_dispatch_counts_experts_without_bincount(moe_models, monkeypatch):
    """grouped and dense count routed pairs with a static-size scatter_add_ (bincount on CUDA
    reads its output size from the device, a host sync that breaks graph capture)."""
    def no_bincount(*args, **kwargs):
        raise AssertionError("bincount synchronises with the host on CUDA")

    m = moe_models["qwen3_moe"][1]
    toks = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(8))
    ref = _logits(m, toks)
    touched = m.experts_touched()
    monkeypatch.setattr(torch, "bincount", no_bincount)
    try:
        for dispatch in ("grouped", "dense"):
            m.set_moe_dispatch(dispatch)
            assert torch.allclose(_logits(m, toks), ref, atol=1e-4), dispatch
            assert m.experts_touched() == touched, dispatch
    finally:
        m.set_moe_dispatch("gather")


@pytest.mark.gpu
@pytest.mark.parametrize("dispatch", ["grouped", "dense"])
def test_recorded_capture_and_replay_do_not_sync_the_host(moe_models, dispatch):
    """A recorded graph replay (and an eager forward) of an MoE target hands its experts count on
    as a device tensor: no host read until the caller synchronises, then the eager count."""
    from refspec.cuda_graphs import GraphRunner
    from refspec.energy.model.work import WorkRecorder

    m = moe_models["qwen3_moe"][1]
    m = m.to(device="cuda", dtype=torch.bfloat16)
    m.init_buffers("cuda")
    try:
        m.set_moe_dispatch(dispatch)
        runner = GraphRunner(m, capture=True)
        view = runner.new_cache(2, 64)
        tok = torch.randint(3, 96, (2, 4), device="cuda")
        pos = torch.arange(4, device="cuda")[None].expand(2, 4) + 5
        with torch.inference_mode():
            with WorkRecorder():
                runner(tok, pos, view, num_keys=64)  # capture, recorded
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                with WorkRecorder() as rec:
                    runner(tok, pos, view, num_keys=64)  # replay
                    m(tok, pos, view, num_keys=64)  # eager
            finally:
                torch.cuda.set_sync_debug_mode("default")
        replayed, eager = (int(w.experts_touched) for w in rec.work)
        assert 0 < replayed <= m.args.moe_layers() * m.args.num_experts and replayed == eager
    finally:
        m.set_moe_dispatch("gather")
        m.to(device="cpu", dtype=torch.float32)
        m.init_buffers("cpu")


# ---- every drafter is lossless on an MoE target -------------------------------------------------
def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = [5, 17, 1, 30, 9, 12][:n]
    ps = [torch.randint(3, 96, (m,), generator=g).tolist() for m in lens]
    if n > 1:
        ps[1] = ps[1][:6] * 3
    return ps


def _drafter(kind, model):
    from refspec.drafters.draft_model import DraftModelDrafter
    from refspec.drafters.eagle import EagleDrafter
    from refspec.drafters.eagle_body import HeadConfig
    from refspec.drafters.eagle_head import new_head
    from refspec.drafters.ngram import NgramDrafter

    if kind == "ngram":
        return NgramDrafter(max_n=3)
    if kind == "draft-model":
        return DraftModelDrafter(model.truncated(1), target_vocab_size=model.args.vocab_size)
    from refspec.drafters.eagle import TreeConfig

    torch.manual_seed(6)  # an untrained head: greedy output must not depend on what it drafts
    head_kind = "eagle3" if kind == "eagle3" else "eagle"
    head = new_head(HeadConfig.for_target(head_kind, model.args, draft_vocab_size=64)).float().eval()
    tree = TreeConfig(topk=3, depth=3, budget=6) if kind == "eagle-tree" else None
    return EagleDrafter(head, model, tree=tree)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("kind", ["ngram", "draft-model", "eagle", "eagle3", "eagle-tree"])
def test_greedy_speculative_equals_plain(moe_models, name, kind):
    from refspec.engine import Engine, EngineConfig

    m = moe_models[name][1]
    for prompts in (_prompts(1), _prompts(6)):
        plain = Engine(m, eos_token_ids=EOS).generate(prompts, max_new_tokens=24)
        spec = Engine(m, _drafter(kind, m), config=EngineConfig(k=3), eos_token_ids=EOS).generate(
            prompts, max_new_tokens=24)
        for r, (a, b) in enumerate(zip(plain.tokens, spec.tokens)):
            assert a == b, f"{name}/{kind} row {r} (batch {len(prompts)}): spec {b} != plain {a}"


# ---- billing from the router's choices ----------------------------------------------------------
def test_ledger_phase_records_carry_the_experts_each_verify_touched(moe_models):
    """Every verify forward (eager, and through the eager-static graph runner) records the
    distinct experts it routed to, and the ledger's phase record sums them; a dense phase
    records null."""
    from refspec.cuda_graphs import GraphRunner
    from refspec.energy.ledger.format import experts_touched, phase_record
    from refspec.engine import Engine, EngineConfig

    m = moe_models["mixtral"][1]
    for target in (m, PreparedTarget(m, step=GraphRunner(m, capture=False))):
        events = []
        Engine(target, _drafter("ngram", m), config=EngineConfig(k=3), observers=[events.append],
               eos_token_ids=EOS).generate(_prompts(6), max_new_tokens=12)
        verify = [ev for ev in events if ev.phase == "verify"]
        assert verify
        for ev in verify:
            (shape,) = ev.work
            assert m.args.moe_layers() <= shape.experts_touched <= m.args.moe_layers() * m.args.num_experts
            assert experts_touched(phase_record(ev, "r", lambda args: 0)) == shape.experts_touched
        assert all(experts_touched(phase_record(ev, "r", lambda args: 0)) is None for ev in events if not ev.work)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_billed_bytes_are_attention_shared_and_the_routed_experts(moe_models, monkeypatch, name):
    """With the routing fixed (token t of the forward -> experts t mod X and t+1 mod X, in
    every MoE layer), the recorded forward bills exactly the shared weights, the attention
    traffic and the distinct routed experts."""
    m = moe_models[name][1]
    a = m.args
    x = a.num_experts
    moe_layers = a.moe_layers()

    def fixed_route(h, router, top_k, renormalise):
        t = torch.arange(h.shape[0])
        idx = torch.stack([t % x, (t + 1) % x], dim=1)
        return torch.full((h.shape[0], 2), 0.5, dtype=h.dtype), idx

    monkeypatch.setattr(moe_mod, "route", fixed_route)
    for rows, s in ((1, 1), (1, 2), (2, 3), (3, 4)):
        n = rows * s
        with WorkRecorder() as rec:
            m(torch.randint(3, 96, (rows, s)), torch.arange(s)[None].expand(rows, s), m.new_cache(rows, 16),
              num_keys=16)
        (shape,) = rec.work
        distinct = min(x, n + 1)  # experts {0..n} mod X
        assert shape.experts_touched == moe_layers * distinct
        cost = forward_cost(shape)
        shared = sum(layer_parameters(a, i)[0] + layer_parameters(a, i)[1] for i in range(a.num_layers))
        e = a.hidden_size
        head_and_embed = a.vocab_size * e + e + n * e  # LM head, final norm, gathered embedding rows
        expert = moe_layers * distinct * expert_parameters(a)
        assert cost.weight_bytes == 4 * (shared + head_and_embed + expert)
        assert cost.linear_flops == 2 * n * (sum(layer_parameters(a, i)[0] for i in range(a.num_layers))
                                             + moe_layers * a.num_experts_per_tok * expert_parameters(a))
        kv = 2 * a.num_kv_heads * a.head_dim * 4
        assert cost.kv_read_bytes == a.num_layers * rows * 16 * kv


def test_expected_experts_equals_enumeration_and_simulation():
    # exact: every way N tokens can each pick k of X experts
    for x, k, n in ((4, 2, 3), (5, 1, 4), (6, 3, 2)):
        combos = list(itertools.combinations(range(x), k))
        mean = sum(len(set().union(*pick)) for pick in itertools.product(combos, repeat=n)) / len(combos) ** n
        assert math.isclose(expected_experts(x, k, n), mean, rel_tol=1e-12)
    # Monte Carlo at real shapes: Qwen3-30B-A3B (128, 8) and Mixtral (8, 2)
    g = torch.Generator().manual_seed(7)
    for x, k, n in ((128, 8, 1), (128, 8, 8), (128, 8, 64), (8, 2, 3)):
        trials = 4000
        picks = torch.rand(trials, n, x, generator=g).topk(k, dim=-1).indices  # k distinct per token
        hit = torch.zeros(trials, x, dtype=torch.bool).scatter_(1, picks.reshape(trials, -1), True)
        sim = hit.sum(1).double()
        se = sim.std().item() / trials ** 0.5
        assert abs(sim.mean().item() - expected_experts(x, k, n)) < 4 * se + 1e-9, (x, k, n)
    assert expected_experts(128, 8, 1) == 8 and expected_experts(8, 2, 10_000) == pytest.approx(8)


def test_predicted_verify_reads_grow_with_the_tokens_verified():
    from refspec.energy.model.architectures import arch, dense_equivalent
    from refspec.energy.model.work import ForwardShape

    moe = arch("qwen3-30b-a3b")
    dense = dense_equivalent(moe)
    assert abs(dense.num_parameters() - moe.active_parameters()) < 0.01 * moe.active_parameters()

    def weights(args, n):
        return forward_cost(ForwardShape(args=args, rows=n, tokens_per_row=1, context_tokens=n * 64,
                                         dtype_bytes=2)).weight_bytes

    embed = lambda n: 2 * n * moe.hidden_size  # noqa: E731 - the gathered embedding rows, the same in both
    assert weights(moe, 1) == pytest.approx(weights(dense, 1), rel=0.01)  # one token: k experts = active
    grown_moe, grown_dense = weights(moe, 8) - embed(8), weights(dense, 8) - embed(8)
    assert grown_dense == pytest.approx(weights(dense, 1) - embed(1))  # dense: the same weights for 8 tokens
    per_expert = 2 * expert_parameters(moe) * moe.num_layers
    assert grown_moe - (weights(moe, 1) - embed(1)) == pytest.approx(
        per_expert * (expected_experts(128, 8, 8) - 8))


# ---- python -m refspec.eval on a random-weight MoE ----------------------------------------------
def test_eval_runs_a_random_moe_and_records_experts_per_step(moe_models, tmp_path, monkeypatch):
    """A random-weight qwen3_moe toy written by write_random_model_dir runs through the eval CLI;
    its records carry experts touched per verify step, more for k = 2 (3 tokens per row) than
    for the baseline (1), and null draft experts for the free n-gram drafter."""
    import json

    from tiny import save_tokenizer

    from refspec.eval import cli
    from refspec.models.random_models import write_random_model_dir

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    tok = tmp_path / "tok"
    tok.mkdir()
    save_tokenizer(tok)
    (tok / "config.json").write_text(json.dumps({"vocab_size": 96}))
    model = tmp_path / "moe"
    args = write_random_model_dir("qwen3-30b-a3b", str(model), tokenizer_from=str(tok), num_layers=2, hidden_size=64)
    assert args.family == "qwen3_moe" and args.num_experts == 128 and args.vocab_size == 96
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"w{3 + (j * (i + 2)) % 20}" for j in range(12)),
                                           "kind": "code"}) + "\n" for i in range(4)))
    out = tmp_path / "run"
    rc = cli.main(["--model", str(model), "--corpus", str(prompts), "--max-new-tokens", "6", "--no-progress",
                   "--no-warmup", "--drafter", "ngram", "--k", "2", "--drafter-option", "trim=false", "--batch", "2",
                   "--requests", "4", "--dtype", "fp32", "--meter", "roofline:cpu", "--out", str(out)])
    assert rc == 0
    recs = {r["drafter"]: r for r in map(json.loads, (out / "records.jsonl").read_text().splitlines())}
    base, spec = recs["none"]["experts_touched_per_step"], recs["ngram"]["experts_touched_per_step"]
    assert 2 <= base <= 2 * 2 * 8 and base < spec <= 2 * 2 * 3 * 8  # 2 layers x (B (K+1) tokens x 8) at most
    assert recs["ngram"]["draft_experts_touched_per_step"] is None
