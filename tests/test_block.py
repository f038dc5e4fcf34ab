"""The block drafter: lossless whatever its head, one head forward per step, trains, saves, loads."""

import pytest
import torch

from refspec.drafters import registry
from refspec.drafters.block import (BlockDrafter, BlockHead, BlockHeadConfig, BlockLossConfig, BlockTrainer,
                                    HeadNotFoundError, block_loss, default_feature_layers, text_labels)
from refspec.drafting import DrafterError
from refspec.engine import Engine, EngineConfig
from refspec.sampling import SamplingConfig

EOS = [2]


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = [5, 17, 1, 30, 9, 12, 3, 25, 7, 2][:n]
    return [torch.randint(3, 96, (m,), generator=g).tolist() for m in lens]


def _head(model, block_size=8, layers=1, seed=0, pending=False):
    torch.manual_seed(seed)
    cfg = BlockHeadConfig(feature_layers=default_feature_layers(model.num_layers), block_size=block_size,
                          num_layers=layers, pending_in_slots=pending)
    return BlockHead(model.args, cfg)


@pytest.mark.parametrize("family,k,layers", [("llama", 4, 1), ("gemma3", 8, 2)])
def test_greedy_block_equals_plain(tiny_models, family, k, layers):
    """Random-weight heads draft junk; verification must still reproduce plain decoding exactly."""
    m = tiny_models[family]
    for prompts in (_prompts(1), _prompts(10)):
        plain = Engine(m, eos_token_ids=EOS).generate(prompts, max_new_tokens=16)
        drafter = BlockDrafter(_head(m, layers=layers), m)
        spec = Engine(m, drafter, config=EngineConfig(k=k), eos_token_ids=EOS).generate(prompts, max_new_tokens=16)
        for i, (a, b) in enumerate(zip(plain.tokens, spec.tokens)):
            assert a == b, f"{family}/k={k} row {i} (batch {len(prompts)}): block {b} != plain {a}"


def test_perfect_head_is_accepted_and_stays_lossless(tiny_models):
    """A head whose drafts are the target's own tokens (a copy task it was trained on) must give
    tau > 1 and still equal plain decoding: exercises the context cache after long accepts."""
    m = tiny_models["llama"]
    head = _head(m, block_size=4)
    drafter = BlockDrafter(head, m)
    prompts = _prompts(4, seed=3)
    plain = Engine(m, eos_token_ids=EOS).generate(prompts, max_new_tokens=20)
    # an oracle: replace propose's output with the plain continuation, then run the real head too
    truth = {i: p + t for i, (p, t) in enumerate(zip(prompts, plain.tokens))}
    real_propose = drafter.propose

    def oracle(state, k):
        draft = real_propose(state, k)
        toks = draft.tokens.clone()
        for i in range(state.batch):
            start = int(state.lengths[i]) + 1
            seq = truth[i]
            toks[i] = torch.tensor([seq[j] if j < len(seq) else 0 for j in range(start, start + k)])
        draft.tokens = toks
        return draft

    drafter.propose = oracle
    spec = Engine(m, drafter, config=EngineConfig(k=4), eos_token_ids=EOS).generate(prompts, max_new_tokens=20)
    assert spec.tokens == plain.tokens
    assert spec.tau > 2.5


@pytest.mark.parametrize("pending", [False, True])
def test_training_forward_matches_inference(tiny_models, pending):
    """The batched training forward (many blocks per sequence, one mask) drafts exactly what
    the engine-driven drafter drafts for the same context, step after step (with and without
    the pending token's embedding in every mask slot)."""
    from refspec.drafters.block import block_training_states

    m = tiny_models["llama"]
    head = _head(m, block_size=8, layers=2, seed=1, pending=pending)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))  # move norms and fusion off their identity start
    prompt = [5, 17, 33, 8, 9, 40, 41]
    drafter = BlockDrafter(head, m)
    drafts = []
    real = drafter.propose
    drafter.propose = lambda state, k: drafts.append(real(state, k)) or drafts[-1]
    gen = Engine(m, drafter, config=EngineConfig(k=4)).generate([prompt], max_new_tokens=12)
    seq = torch.tensor([prompt + gen.tokens[0]])
    n = seq.shape[1]
    with torch.no_grad():
        _, feats = m(seq, torch.arange(n)[None], m.new_cache(1, n), logits_at=seq[:, :0],
                     hidden_layers=head.config.feature_layers)
        # the pending token of step i sits at len(prompt) + emitted tokens before step i
        starts = [len(prompt)]
        for step in gen.emitted_per_step[:-1]:
            starts.append(starts[-1] + step[0])
        anchors = torch.tensor([starts])
        h = block_training_states(head, m, feats, seq, anchors, torch.full_like(anchors, 4))
        trained = m.logits(h[:, :, :4]).argmax(-1)[0]  # [M, 4]
    for i, d in enumerate(drafts[:len(starts)]):
        assert d.tokens[0].tolist() == trained[i].tolist(), f"step {i}: inference {d.tokens[0].tolist()} " \
                                                           f"!= training forward {trained[i].tolist()}"


@pytest.mark.parametrize("k", [2, 4, 8])
def test_one_head_forward_per_step(tiny_models, k):
    m = tiny_models["qwen2"]
    head = _head(m, block_size=8, layers=2)
    drafter = BlockDrafter(head, m)
    calls = {"layer0": 0, "layer1": 0, "norm": 0}
    for name, mod in (("layer0", drafter.head.layers[0]), ("layer1", drafter.head.layers[1]),
                      ("norm", drafter.head.norm)):
        mod.register_forward_hook(lambda *_, n=name: calls.__setitem__(n, calls[n] + 1))
    gen = Engine(m, drafter, config=EngineConfig(k=k), eos_token_ids=EOS).generate(_prompts(3), max_new_tokens=16)
    assert gen.steps > 0
    assert calls == {"layer0": gen.steps, "layer1": gen.steps, "norm": gen.steps}, \
        f"k={k}: expected one head forward per step ({gen.steps} steps), saw {calls}"
    assert drafter.forwards == gen.steps
    draft_events = [e for e in gen.events if e.phase == "draft"]
    block = [w for e in draft_events for w in e.work if w.layers == 2]
    assert len(block) == gen.steps and all(w.tokens_per_row == k + 1 and w.lm_head_tokens == 3 * k for w in block)


def test_sampled_drafts_carry_their_distribution(tiny_models):
    m = tiny_models["llama"]
    drafter = BlockDrafter(_head(m), m)
    seen = []
    real = drafter.propose
    drafter.propose = lambda state, k: seen.append(real(state, k)) or seen[-1]
    cfg = EngineConfig(k=3, sampling=SamplingConfig(temperature=0.8))
    gen = Engine(m, drafter, config=cfg).generate(_prompts(4), max_new_tokens=8,
                                                  generator=torch.Generator().manual_seed(0))
    assert all(len(t) == 8 for t in gen.tokens)
    d = seen[0]
    assert d.probs.shape == (4, 3, 96)
    assert torch.allclose(d.probs.sum(-1), torch.ones(4, 3))
    assert bool((d.probs.gather(-1, d.tokens[..., None]) > 0).all()), "each draft has non-zero draft probability"


def test_k_beyond_block_size_is_refused(tiny_models):
    m = tiny_models["llama"]
    drafter = BlockDrafter(_head(m, block_size=4), m)
    with pytest.raises(DrafterError, match="at most 4 tokens"):
        Engine(m, drafter, config=EngineConfig(k=5)).generate(_prompts(1), max_new_tokens=4)


def test_training_lowers_loss(tiny_models):
    """Text where each token determines the next (t -> 7t + 3 mod 93, + 3): slot i must learn
    the i-step map from the block's first token; a few seconds of training must help."""
    m = tiny_models["llama"]
    head = _head(m, block_size=4)
    head.requires_grad_(True).train()
    g = torch.Generator().manual_seed(0)
    tok = torch.empty(4, 32, dtype=torch.long)
    tok[:, 0] = torch.randint(3, 96, (4,), generator=g)
    for i in range(1, 32):
        tok[:, i] = (tok[:, i - 1] * 7 + 3) % 93 + 3
    labels, mask = text_labels(tok, torch.full((4,), 32))
    with torch.no_grad():
        _, feats = m(tok, torch.arange(32)[None].expand(4, 32), m.new_cache(4, 32), logits_at=tok[:, :0],
                     hidden_layers=head.config.feature_layers)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    cfg = BlockLossConfig(anchors_per_row=16)
    losses = []
    for _ in range(30):
        loss, stats = block_loss(head, m, feats, tok, labels, mask, cfg, generator=g)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    # the tiny target's tied LM head has small weights, so logits (and the loss) move slowly
    assert last < first - 0.3, f"loss went {first:.3f} -> {last:.3f}"
    assert set(stats) == {"acc@1", "tau@4"}


def test_walk_replays_greedy_decoding(tiny_models):
    """Walking a head's blocks over the target's greedy text (``walk``) emits, block by block, what
    greedy block decoding emits step by step; the head is first fitted to that text so it accepts."""
    from refspec.drafters.training.block import accepted_runs, walk, walk_tau

    m = tiny_models["llama3"]  # its greedy text varies (others repeat one token)
    head = _head(m, block_size=4, pending=True)
    prompts = _prompts(3, seed=5)
    plain = Engine(m).generate(prompts, max_new_tokens=24)
    seqs = [torch.tensor([p + t]) for p, t in zip(prompts, plain.tokens)]
    data = []
    for p, seq in zip(prompts, seqs):
        n = seq.shape[1]
        with torch.no_grad():
            _, feats = m(seq, torch.arange(n)[None], m.new_cache(1, n), logits_at=seq[:, :0],
                         hidden_layers=head.config.feature_layers)
        labels, mask = text_labels(seq, torch.tensor([n]))
        data.append((feats, seq, labels, mask & (torch.arange(n) >= len(p))))  # the prompt's last token: prefill's
    head.requires_grad_(True).train()
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for step in range(40):
        loss, _ = block_loss(head, m, *data[step % 3], BlockLossConfig(anchors_per_row=16), generator=g)
        opt.zero_grad()
        loss.backward()
        opt.step()
    head.requires_grad_(False).eval()
    longest = 0
    for p, (feats, seq, labels, mask) in zip(prompts, data):
        gen = Engine(m, BlockDrafter(head, m), config=EngineConfig(k=4)).generate([p], max_new_tokens=24)
        assert gen.tokens[0] == seq[0, len(p):].tolist()
        steps = [e[0] for e in gen.emitted_per_step]
        walked = walk(accepted_runs(head, m, feats, seq, labels, mask, 4), mask)[0]
        assert walked[:len(steps) - 1] == steps[:-1], f"walk {walked} != decoding {steps}"  # the last step is cut
        assert walk_tau(head, m, feats, seq, labels, mask, 4) == sum(walked) / len(walked)
        longest = max(longest, *steps)
    assert longest > 1, "the fitted head never got a draft accepted: the comparison would be vacuous"


def test_block_loss_runs_under_bf16_autocast(tiny_models):
    """The training cache keeps its dtype when autocast hands it bf16 keys (a bf16 step's time is measured)."""
    m = tiny_models["llama"]
    head = _head(m, block_size=4, pending=True)
    head.requires_grad_(True).train()
    tok = torch.randint(3, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    labels, mask = text_labels(tok, torch.full((2,), 16))
    with torch.no_grad():
        _, feats = m(tok, torch.arange(16)[None].expand(2, 16), m.new_cache(2, 16), logits_at=tok[:, :0],
                     hidden_layers=head.config.feature_layers)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = block_loss(head, m, feats, tok, labels, mask, BlockLossConfig(anchors_per_row=4))
    loss.backward()
    assert torch.isfinite(loss) and head.mask_embed.grad is not None


def test_trainer_through_shared_plumbing_saves_and_loads(tiny_models, tmp_path):
    """BlockTrainer in refspec.drafters.training: collect features, train, export, load, draft."""
    from refspec.drafters import training

    m = tiny_models["llama"]
    trainer = training.load_trainers()["block"]
    assert isinstance(trainer, BlockTrainer)
    g = torch.Generator().manual_seed(1)
    seqs = [training.TrainingSequence(tokens=torch.randint(3, 96, (40,), generator=g).tolist(), train_from=5)
            for _ in range(6)]
    data = training.collect_features(m, seqs, trainer.feature_layers(m), progress=False)
    cfg = training.TrainConfig(steps=3, batch_size=2, seq_len=32, warmup_steps=1, checkpoint_every=0, log_every=1)
    opts = {"block_size": 4, "anchors_per_row": 4}
    res = training.train(trainer, m, data, cfg, tmp_path, options=opts, progress=False,
                         provenance={"command": "test"})
    assert res.steps == 3 and res.export_path == tmp_path
    head = BlockHead.load(tmp_path, target_args=m.args)
    assert head.block_size == 4 and head.provenance["command"] == "test"
    gen = Engine(m, BlockDrafter(head, m), config=EngineConfig(k=4), eos_token_ids=EOS).generate(
        _prompts(3), max_new_tokens=10)
    plain = Engine(m, eos_token_ids=EOS).generate(_prompts(3), max_new_tokens=10)
    assert gen.tokens == plain.tokens


def test_walk_is_scored_on_held_out_windows_only(tiny_models, tmp_path):
    """``walk@K`` is logged by every held-out evaluation (and can pick the best module), never by a training step."""
    import json

    from refspec.drafters import training

    m = tiny_models["llama"]
    trainer = training.load_trainers()["block"]
    g = torch.Generator().manual_seed(2)
    seqs = [training.TrainingSequence(tokens=torch.randint(3, 96, (40,), generator=g).tolist(), train_from=5)
            for _ in range(8)]
    data = training.collect_features(m, seqs, trainer.feature_layers(m), progress=False)
    cfg = training.TrainConfig(steps=4, batch_size=2, seq_len=32, warmup_steps=1, checkpoint_every=0, log_every=1,
                               val_sequences=3, val_every=2, val_batches=2, val_metric="walk@4", val_goal="max")
    res = training.train(trainer, m, data, cfg, tmp_path, options={"block_size": 4, "anchors_per_row": 4},
                         progress=False)
    lines = [json.loads(l) for l in (tmp_path / training.TRAIN_LOG).read_text().splitlines()]
    held = [l for l in lines if "val_loss" in l]
    assert [l["step"] for l in held] == [0, 2, 4] and all(1.0 <= l["val_walk@4"] <= 5.0 for l in held)
    assert not any("walk@4" in l or "val_walk@4" in l for l in lines if "val_loss" not in l)
    assert res.best_value == pytest.approx(max(l["val_walk@4"] for l in held), abs=1e-5)  # the log rounds


def test_warm_start_continues_a_saved_head_of_the_same_shape(tiny_models, tmp_path):
    """``init=DIR`` starts from the saved head's weights; a head of another shape is refused."""
    from refspec.drafters import training

    m = tiny_models["llama"]
    trainer = training.load_trainers()["block"]
    saved = _head(m, block_size=4, layers=1, seed=7, pending=False)
    saved.save(tmp_path / "h", dtype=None)
    opts = {"block_size": 4, "layers": 1, "fusion": int(saved.config.input_fusion), "init": str(tmp_path / "h")}
    data = training.collect_features(m, [training.TrainingSequence(tokens=list(range(3, 40)), train_from=1)],
                                     trainer.feature_layers(m), progress=False)
    built = trainer.build(m, data, opts)
    for (n, a), (_, b) in zip(saved.state_dict().items(), built.state_dict().items()):
        assert torch.equal(a, b), f"{n} is not the saved head's"
    assert all(p.requires_grad for p in built.parameters())
    with pytest.raises(DrafterError, match="another shape"):
        trainer.build(m, data, {**opts, "block_size": 6})
    with pytest.raises(DrafterError, match="saved block head's directory"):
        trainer.build(m, data, {**opts, "init": str(tmp_path / "nothing")})


@pytest.mark.parametrize("pending", [False, True])
def test_save_load_round_trip(tiny_models, tmp_path, pending):
    m = tiny_models["qwen2"]
    head = _head(m, block_size=6, layers=2, seed=4, pending=pending)
    head.save(tmp_path / "h", provenance={"note": "x"}, dtype=None)
    back = BlockHead.load(tmp_path / "h", target_args=m.args)
    assert back.config == head.config
    for (n, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), f"{n} changed in the round trip"
    with pytest.raises(DrafterError, match="trained for another target"):
        BlockHead.load(tmp_path / "h", target_args=m.args.__class__(**{**m.args.__dict__, "hidden_size": 32}))


def test_missing_head_names_the_command(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("REFSPEC_HOME", str(tmp_path))
    m = tiny_models["llama"]
    ctx = registry.DrafterContext(target=m, target_name="no-such-model", tokenizer_fingerprint=None,
                                  dtype=torch.float32, device="cpu")
    with pytest.raises(HeadNotFoundError) as err:
        registry.build("block", ctx)
    msg = str(err.value)
    assert "python -m refspec.eval train --drafter block --model no-such-model" in msg
    assert str(tmp_path / "heads" / "no-such-model-block") in msg
    assert registry.default_k("block") == 8


def test_registry_builds_from_head_option(tiny_models, tmp_path):
    m = tiny_models["llama"]
    _head(m).save(tmp_path / "h")
    ctx = registry.DrafterContext(target=m, target_name="x", tokenizer_fingerprint=None, dtype=torch.float32,
                                  device="cpu", options={"head": str(tmp_path / "h")})
    d = registry.build("block", ctx)
    assert isinstance(d, BlockDrafter) and d.block_size == 8


@pytest.mark.real
def test_smollm2_block_head_is_lossless_and_accepts(smollm2, smollm2_plain):
    """The shipped SmolLM2 head: fp32 greedy equality at batch 1 and a ragged batch, tau > 1."""
    target, tok = smollm2.model, smollm2.tokenizer
    ctx = registry.DrafterContext(target=target, target_name="smollm2-135m", tokenizer_fingerprint=None,
                                  dtype=torch.float32, device="cpu")
    drafter = registry.build("block", ctx)
    texts = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
             "The capital of France is", "1, 2, 3, 4, 5, 6,", "import numpy as np\n\ndef mean(xs):\n"]
    prompts = [tok.encode(t) for t in texts]
    eos = list(target.args.eos_token_ids)
    for batch in (prompts[:1], prompts):
        spec = Engine(target, drafter, config=EngineConfig(k=8), eos_token_ids=eos).generate(batch, max_new_tokens=32)
        assert spec.tokens == smollm2_plain(batch, 32, eos)
    # the shipped head comes from a short CPU run (tau ~1.1 on the eval corpora): some drafts must land
    assert spec.tau > 1.0, f"the trained head should be accepted now and then (tau {spec.tau:.2f})"


def test_block_verify_is_shaped_like_eagles(tiny_models):
    """Behind the block drafter the target's verify forward gets what it gets behind EAGLE at the
    same K: B x (K+1) long tokens, a chain (no tree mask, no slots), num_keys from the cache
    lengths alone, and only the feature layers the drafter reads; one verify per step."""
    from refspec.drafters.eagle import EagleDrafter, HeadConfig, new_head
    from refspec.models import PreparedTarget

    m, k = tiny_models["llama"], 4
    prompts = _prompts(6, seed=4)
    torch.manual_seed(0)
    drafters = {"block": BlockDrafter(_head(m), m),
                "eagle": EagleDrafter(new_head(HeadConfig.for_target("eagle", m.args)).eval(), m)}
    for name, drafter in drafters.items():
        calls = []

        def spy(tokens, positions, cache, calls=calls, **kw):
            want = min(cache.max_len, -(-(int(cache.lengths.max()) + k + 1) // 64) * 64)  # engine's kv_bucket 64
            given = sorted(name for name, v in kw.items() if name != "num_keys" and v is not None)
            calls.append((tuple(tokens.shape), tokens.dtype, kw["num_keys"], want, given, tuple(kw["hidden_layers"])))
            return m(tokens, positions, cache, **kw)

        spy.new_cache = m.new_cache  # a step makes the cache its forwards write
        out = Engine(PreparedTarget(m, step=spy), drafter, config=EngineConfig(k=k), eos_token_ids=EOS).generate(
            prompts, max_new_tokens=12)
        assert len(calls) == out.steps, name
        for shape, dtype, keys, want, extra, layers in calls:
            assert shape == (6, k + 1) and dtype == torch.long, (name, shape, dtype)
            assert keys == want and extra == ["hidden_layers"], (name, keys, want, extra)
            assert layers == drafter.hidden_layers, name
