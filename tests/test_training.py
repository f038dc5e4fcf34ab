"""Drafter training plumbing: datasets of target features, the loop, checkpoints and resume."""
import dataclasses
import json

import pytest
import torch
from torch import nn

from refspec.drafters import training as T
from tiny import packed_form_runs


def _sequences(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(4, 20, (1,), generator=g))
        out.append(T.TrainingSequence(tokens=torch.randint(3, 96, (length,), generator=g).tolist(),
                                      train_from=i % 3, source="test"))
    return out


@pytest.fixture(scope="module")
def dataset(tiny_models):
    return T.collect_features(tiny_models["llama"], _sequences(), (1, 3), batch_tokens=40, progress=False,
                              description={"what": "random"})


def test_collected_features_are_the_targets_hidden_states_and_argmax(tiny_models, dataset):
    m = tiny_models["llama"]
    seq = _sequences()[2]
    n = len(seq.tokens)
    toks = torch.tensor([seq.tokens])
    pos = torch.arange(n)[None]
    logits, (h1, h3) = m(toks, pos, m.new_cache(1, n), hidden_layers=(1, 3))
    a, b = int(dataset.offsets[2]), int(dataset.offsets[3])
    assert dataset.tokens[a:b].tolist() == seq.tokens
    torch.testing.assert_close(dataset.hidden[1][a:b].float(), h1[0], atol=0.05, rtol=0.02)  # stored in bf16
    torch.testing.assert_close(dataset.hidden[3][a:b].float(), h3[0], atol=0.05, rtol=0.02)
    assert dataset.labels[a:b].tolist() == logits[0].argmax(-1).tolist()
    mask = dataset.loss_mask[a:b].tolist()
    assert mask == [seq.train_from <= i < n - 1 for i in range(n)], "trained from train_from, never the last token"


def test_dataset_save_load_round_trip(dataset, tmp_path):
    dataset.save(tmp_path / "f.safetensors")
    back = T.FeatureDataset.load(tmp_path / "f.safetensors")
    assert back.layers == dataset.layers and back.description == {"what": "random"}
    for name in ("tokens", "labels", "loss_mask", "offsets"):
        assert torch.equal(getattr(back, name), getattr(dataset, name)), name
    assert torch.equal(back.hidden[3], dataset.hidden[3])


def test_sample_batch_windows_are_contiguous_and_masked(dataset):
    g = torch.Generator().manual_seed(0)
    batch = dataset.sample_batch(16, 12, g)
    assert batch.tokens.shape == (16, 12) and batch.of(3).shape == (16, 12, 64)
    assert batch.layers == (1, 3)
    flat = dataset.tokens.tolist()
    for row, valid in zip(batch.tokens.tolist(), batch.valid.tolist()):
        n = sum(valid)
        assert valid == [True] * n + [False] * (12 - n), "padding only at the end"
        window = row[:n]
        assert any(flat[i:i + n] == window for i in range(len(flat) - n + 1)), "a window is a slice of one sequence"
    assert not (batch.loss_mask & ~batch.valid).any()
    assert (batch.of(1)[~batch.valid] == 0).all()


def test_learning_rate_warms_up_then_decays_by_steps_or_time():
    cfg = T.TrainConfig(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert cfg.lr_at(0) == pytest.approx(0.1) and cfg.lr_at(9) == pytest.approx(1.0)
    assert cfg.lr_at(10) == pytest.approx(1.0) and cfg.lr_at(100) == pytest.approx(0.1)
    timed = dataclasses.replace(cfg, max_time_s=60.0)
    assert timed.lr_at(20, elapsed_s=60.0) == pytest.approx(0.1), "a time-limited run ends at the low rate"


class _Probe(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 96)


@dataclasses.dataclass(frozen=True)
class _ProbeTrainer:
    """Minimal trainer: a linear probe from the final state to the target's greedy label."""

    name: str = "probe"
    description: str = "test probe"
    defaults: dict = dataclasses.field(default_factory=dict)

    def feature_layers(self, target):
        return (target.num_layers,)

    def build(self, target, dataset, options):
        return _Probe()

    def loss(self, module, batch, target):
        h = batch.of(target.num_layers)[batch.loss_mask]
        loss = nn.functional.cross_entropy(module.lin(h), batch.labels[batch.loss_mask])
        return loss, {"n": float(h.shape[0])}

    def export(self, module, out_dir, provenance):
        torch.save(module.state_dict(), out_dir / "probe.pt")
        (out_dir / "provenance.json").write_text(json.dumps(provenance, default=str))
        return out_dir


def _cfg(steps):
    return T.TrainConfig(steps=steps, batch_size=4, seq_len=12, lr=1e-2, warmup_steps=2, checkpoint_every=5,
                         log_every=5)


def test_training_lowers_the_loss_and_records_provenance(tiny_models, dataset, tmp_path):
    m = tiny_models["llama"]
    ds = T.collect_features(m, _sequences(12, seed=1), (m.num_layers,), progress=False)
    res = T.train(_ProbeTrainer(), m, ds, _cfg(60), tmp_path, progress=False, provenance={"target": "tiny"})
    assert res.final_loss < 0.7 * res.first_loss
    prov = json.loads((tmp_path / "provenance.json").read_text())
    assert prov["target"] == "tiny" and prov["steps"] == 60 and prov["final_loss"] == pytest.approx(res.final_loss,
                                                                                                   abs=1e-4)
    assert prov["train_time_s"] >= 0 and prov["data"]["sequences"] == 12
    lines = (tmp_path / T.TRAIN_LOG).read_text().strip().split("\n")
    assert len(lines) == 12 and json.loads(lines[-1])["step"] == 60


def test_resume_continues_exactly_where_an_interrupted_run_stopped(tiny_models, tmp_path):
    m = tiny_models["llama"]
    ds = T.collect_features(m, _sequences(8, seed=2), (m.num_layers,), progress=False)
    straight = T.train(_ProbeTrainer(), m, ds, _cfg(20), tmp_path / "a", progress=False)

    def stop_at_10(record):
        if record["step"] == 10:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        T.train(_ProbeTrainer(), m, ds, _cfg(20), tmp_path / "b", progress=False, on_log=stop_at_10)
    state = torch.load(tmp_path / "b" / T.CHECKPOINT, weights_only=True)
    assert state["step"] == 10 and "optimizer" in state and "rng_data" in state
    resumed = T.train(_ProbeTrainer(), m, ds, _cfg(20), tmp_path / "b", progress=False, resume=True)
    assert resumed.steps == straight.steps == 20
    a = torch.load(tmp_path / "a" / "probe.pt", weights_only=True)
    b = torch.load(tmp_path / "b" / "probe.pt", weights_only=True)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=0, rtol=0, msg=f"{k} differs after resume")


def test_resume_refuses_a_checkpoint_of_another_run(tiny_models, tmp_path):
    m = tiny_models["llama"]
    ds = T.collect_features(m, _sequences(4), (m.num_layers,), progress=False)
    T.train(_ProbeTrainer(), m, ds, _cfg(5), tmp_path, progress=False)
    with pytest.raises(T.TrainingError, match="different run"):
        T.train(_ProbeTrainer(), m, ds, dataclasses.replace(_cfg(5), lr=5e-3), tmp_path, progress=False, resume=True)
    with pytest.raises(T.TrainingError, match="no checkpoint"):
        T.train(_ProbeTrainer(), m, ds, _cfg(5), tmp_path / "empty", progress=False, resume=True)


def test_self_distill_returns_the_targets_greedy_replies(tiny_models):
    from refspec.engine import Engine

    m = tiny_models["qwen2"]
    prompts = [[5, 6, 7], [9] * 7, [11, 3]]
    seqs = T.self_distill(m, prompts, max_new_tokens=6, batch_size=2, progress=False)
    for p, s in zip(prompts, seqs):
        reply = Engine(m).generate([p], max_new_tokens=6).tokens[0]
        assert s.tokens == p + reply and s.train_from == len(p) - 1


def test_reply_cache_decodes_only_the_prompts_a_larger_mix_adds(tiny_models, tmp_path, monkeypatch):
    """A second, larger build reuses the first build's replies (from disk) and decodes only the new
    prompts; every sequence is still the target's greedy reply."""
    from refspec.eval.train_data import ReplyCache, distill_with_cache

    m = tiny_models["qwen2"]
    first, added = [[5, 6, 7], [9] * 7], [[11, 3], [4, 8, 15, 16]]
    decoded: list[list[int]] = []
    real = T.self_distill

    def counting(target, prompts, **kw):
        decoded.extend(map(list, prompts))
        return real(target, prompts, **kw)

    monkeypatch.setattr(T, "self_distill", counting)
    path = tmp_path / "replies.json"
    kw = dict(budget=6, eos_token_ids=(), source="s", progress=False, chunk=1)
    a = distill_with_cache(m, first, replies=ReplyCache(path), **kw)
    assert decoded == first
    b = distill_with_cache(m, first + added, replies=ReplyCache(path), **kw)
    assert decoded == first + added and b[:2] == a
    assert [(s.tokens, s.train_from) for s in b] == [(s.tokens, s.train_from) for s in real(m, first + added,
                                                     max_new_tokens=6, progress=False)]
    assert len(ReplyCache(path)) == 4 and ReplyCache(path).get([11, 3], 7) is None  # another budget is another reply


def test_an_interrupted_reply_build_keeps_the_chunks_it_decoded(tiny_models, tmp_path, monkeypatch):
    from refspec.eval.train_data import ReplyCache, distill_with_cache

    real, calls = T.self_distill, []

    def interrupted(target, prompts, **kw):
        calls.append(prompts)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(target, prompts, **kw)

    monkeypatch.setattr(T, "self_distill", interrupted)
    path = tmp_path / "replies.json"
    with pytest.raises(KeyboardInterrupt):
        distill_with_cache(tiny_models["qwen2"], [[5, 6], [7, 8], [9, 10]], budget=4, eos_token_ids=(),
                           replies=ReplyCache(path), source="s", progress=False, chunk=1)
    kept = ReplyCache(path)
    assert len(kept) == 1 and kept.get([5, 6], 4) is not None


def test_trainers_register_through_drafter_modules():
    trainers = T.load_trainers()
    assert {"eagle", "eagle3"} <= set(trainers)
    assert all(t.name == n for n, t in trainers.items())


def test_cli_help_lists_the_drafters(capsys):
    from refspec.eval import train

    with pytest.raises(SystemExit) as exc:
        train.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--drafter" in out and "eagle3" in out and "--resume" in out


def tiny_cli_argv(out, data):
    """``train`` flags for an eagle head on a one-chat, one-reference, one-speech SmolLM2 mix."""
    return ["--drafter", "eagle", "--model", "smollm2-135m", "--out", str(out), "--data-cache", str(data),
            "--chat-prompts", "1", "--math-prompts", "0", "--code-prompts", "0", "--reply-tokens", "4",
            "--chat-references", "1", "--math-references", "0", "--code-references", "0", "--prose-chunks", "1",
            "--max-len", "64"]


@pytest.mark.real
def test_cli_trains_a_smollm2_head_from_train_splits_and_resumes(tmp_path):
    """End to end on the real target with tiny sizes: data from train splits only, export, resume."""
    from refspec.eval import train
    from refspec.drafters.eagle import load_head
    from refspec.models import load_model
    from refspec.assets import resolve_model

    out, data = tmp_path / "head", tmp_path / "data.json"
    argv = tiny_cli_argv(out, data) + ["--steps", "2", "--batch-size", "1", "--seq-len", "32", "--quiet"]
    assert train.main(argv) == 0
    desc = json.loads(data.read_text())["description"]
    assert desc["disjoint_from_eval"] and desc["sources"] == {"conversation:self-distill": 1,
                                                              "conversation:reference": 1, "english-sotu:prose": 1}
    head, prov = load_head(out, load_model(resolve_model("smollm2-135m")).args)
    assert prov["steps"] == 2 and prov["target"] == "smollm2-135m" and "--drafter eagle" in prov["command"]
    assert train.main(tiny_cli_argv(out, data) + ["--steps", "3", "--batch-size", "1", "--seq-len", "32", "--quiet",
                                                  "--resume"]) == 0
    assert json.loads((out / "config.json").read_text())["refspec"]["provenance"]["steps"] == 3


def test_eagle_warm_start_refines_a_saved_head(tiny_models, tmp_path):
    """``--option init=DIR`` starts from the head in DIR (its weights, trainable) and a short run
    moves it; a head of the other kind is refused."""
    from refspec.drafters.eagle import load_head, save_head
    from refspec.drafters.training.loop import load_trainers
    from refspec.drafting import DrafterError

    m = tiny_models["llama"]
    trainers = load_trainers()
    ds = T.collect_features(m, _sequences(8, seed=2), trainers["eagle"].feature_layers(m), progress=False)
    first = T.train(trainers["eagle"], m, ds, _cfg(3), tmp_path / "a", progress=False)
    start, _ = load_head(first.export_path, m.args)
    module = trainers["eagle"].build(m, ds, {"init": str(first.export_path)})
    for (name, a), b in zip(start.state_dict().items(), module.head.state_dict().values()):
        assert torch.equal(a, b), f"{name} was not taken from the saved head"
    assert all(p.requires_grad for p in module.head.parameters())
    T.train(trainers["eagle"], m, ds, _cfg(4), tmp_path / "b", options={"init": str(first.export_path)},
            progress=False)
    moved, _ = load_head(tmp_path / "b", m.args)
    assert not torch.equal(moved.fc.weight, start.fc.weight)
    e3 = save_head(trainers["eagle3"].build(m, ds, {}).head, tmp_path / "e3")
    with pytest.raises(DrafterError, match="holds an eagle3 head"):
        trainers["eagle"].build(m, ds, {"init": str(e3)})


def test_eagle3_warm_start_widens_the_draft_vocabulary_keeping_trained_rows(tiny_models, tmp_path):
    """``init`` plus a larger ``draft_vocab_size``: the saved tokens keep their trained LM-head rows;
    the most frequent other labels join, their target rows sent through the affine map that took
    the target's rows to the trained ones; the rest is the saved head."""
    from refspec.drafters.eagle import load_head, save_head
    from refspec.drafters.training.loop import load_trainers
    from refspec.drafting import DrafterError

    m = tiny_models["llama"]
    trainer = load_trainers()["eagle3"]
    ds = T.collect_features(m, _sequences(8, seed=2), trainer.feature_layers(m), progress=False)
    saved = trainer.build(m, ds, {"draft_vocab_size": 72}).head  # 72 kept rows >= E + 1: the map is determined
    g = torch.Generator().manual_seed(5)
    drift, shift = torch.randn(64, 64, generator=g) / 8, torch.randn(64, generator=g)
    with torch.no_grad():
        saved.lm_head.weight.copy_(saved.lm_head.weight @ drift + shift)  # a trained head's drifted rows
    folder = save_head(saved, tmp_path / "e3", dtype=torch.float32)
    old, _ = load_head(folder, m.args)
    wide = trainer.build(m, ds, {"init": str(folder), "draft_vocab_size": 88}).head

    old_ids, new_ids = old.to_target_ids(torch.arange(72)), wide.to_target_ids(torch.arange(88))
    assert wide.config.draft_vocab_size == 88 and bool(wide.t2d[old_ids].all()) and int(wide.t2d.sum()) == 88
    counts = ds.token_counts(m.args.vocab_size)
    added = new_ids[~old.t2d[new_ids]]
    left = torch.ones_like(wide.t2d)
    left[new_ids] = False
    assert int(counts[added].min()) >= int(counts[left].max()), "the added tokens are the most frequent others"
    row = {int(t): wide.lm_head.weight[d] for d, t in enumerate(new_ids.tolist())}
    for d, t in enumerate(old_ids.tolist()):
        assert torch.equal(row[t], old.lm_head.weight[d]), "a saved token lost its trained row"
    target_rows = m.lm_head.weight.detach().float()
    for t in added.tolist():
        torch.testing.assert_close(row[t], target_rows[t] @ drift + shift, atol=2e-4, rtol=1e-4)
    for name, value in old.state_dict().items():
        if name not in ("lm_head.weight", "d2t", "t2d"):
            assert torch.equal(value, wide.state_dict()[name]), name
    with pytest.raises(DrafterError, match="can only widen"):
        trainer.build(m, ds, {"init": str(folder), "draft_vocab_size": 8})
    assert trainer.build(m, ds, {"init": str(folder)}).head.config.draft_vocab_size == 72


class _Sharpened:
    """A target whose logits are scaled up: the same argmax, a point mass for a distribution."""

    def __init__(self, model, scale):
        self.model, self.scale = model, scale

    def __getattr__(self, name):
        return getattr(self.model, name)

    def logits(self, h):
        return self.model.logits(h) * self.scale


def test_eagle3_soft_labels_train_on_the_targets_distribution(tiny_models):
    """``soft_labels``: each unrolled step's goal is the target's own next-token distribution at the
    label's position, renormalised over the draft vocabulary (checked position by position); a
    point-mass target gives back the greedy-label loss; the final layer joins the features."""
    from refspec.drafters.training.loop import load_trainers
    from refspec.drafting import DrafterError

    m = tiny_models["llama"]
    trainer = load_trainers()["eagle3"]
    opts = {"draft_vocab_size": 72, "ttt_steps": 2}
    assert m.num_layers not in trainer.feature_layers(m, opts)
    layers = trainer.feature_layers(m, {**opts, "soft_labels": 1.0})
    assert layers[-1] == m.num_layers
    ds = T.collect_features(m, _sequences(8, seed=2), layers, progress=False)
    batch = ds.sample_batch(3, 24, torch.Generator().manual_seed(0))
    soft = trainer.build(m, ds, {**opts, "soft_labels": 1.0}).eval()
    head = soft.head
    with torch.no_grad():
        loss, metrics = soft(batch, m)
        h0 = head.prepare([batch.of(l).float() for l in head.config.feature_layers])
        outs = head.unroll(lambda t: m.embed_tokens(t).float(), batch.tokens, h0, 2)
        ids = head.to_target_ids(torch.arange(72))
        want = 0.0
        for j, out in enumerate(outs):
            terms = []
            for b in range(3):
                for i in range(24 - j - 1):
                    p = i + j + 1  # out[b, i] of step j predicts the label at position p
                    if batch.loss_mask[b, p] and head.t2d[batch.labels[b, p]]:
                        goal = torch.softmax(m.logits(batch.of(m.num_layers)[b, p].float())[ids], -1)
                        q = torch.log_softmax(head.draft_logits(out[b, i][None], m)[0], -1)
                        terms.append(-(goal * q).sum())
            assert len(terms) > 10
            want += 0.8 ** j * torch.stack(terms).mean()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)

    hard = trainer.build(m, ds, opts).eval()
    hard.head.load_state_dict(head.state_dict())
    with torch.no_grad():
        hard_loss, _ = hard(batch, m)
        point_loss, _ = soft(batch, _Sharpened(m, 1e4))
        mixed = trainer.build(m, ds, {**opts, "soft_labels": 0.25}).eval()
        mixed.head.load_state_dict(head.state_dict())
        mixed_loss, _ = mixed(batch, m)
    torch.testing.assert_close(point_loss, hard_loss, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(mixed_loss, 0.75 * hard_loss + 0.25 * loss, rtol=1e-5, atol=1e-5)
    with pytest.raises(DrafterError, match="soft_labels must be in"):
        trainer.build(m, ds, {**opts, "soft_labels": 1.5})


def test_eagle1_soft_labels_mix_the_targets_distribution_into_the_goal(tiny_models):
    """EAGLE-1 (whole vocabulary, the final layer already its feature): soft_labels=a is
    ``(1 - a) * hard + a * soft`` on the cross-entropy term, the regression term untouched; a
    point-mass target gives back the greedy-label loss."""
    from refspec.drafters.training.loop import load_trainers

    m = tiny_models["llama"]
    trainer = load_trainers()["eagle"]
    opts = {"ce_fraction": 1.0, "noise": 0.0}
    assert trainer.feature_layers(m, {**opts, "soft_labels": 1.0}) == (m.num_layers,)
    ds = T.collect_features(m, _sequences(8, seed=3), (m.num_layers,), progress=False)
    batch = ds.sample_batch(3, 24, torch.Generator().manual_seed(1))
    modules = {a: trainer.build(m, ds, {**opts, "soft_labels": a}).eval() for a in (0.0, 0.5, 1.0)}
    for module in modules.values():
        module.head.load_state_dict(modules[0.0].head.state_dict())
    peaked = _Sharpened(m, 5.0)  # a random tiny target is nearly uniform: soft and hard goals would agree
    with torch.no_grad():
        losses = {a: module(batch, peaked) for a, module in modules.items()}
        point, _ = modules[1.0](batch, _Sharpened(m, 1e4))
    (hard, hard_terms), (soft, soft_terms) = losses[0.0], losses[1.0]
    assert "soft0" in soft_terms and "soft0" not in hard_terms
    head = modules[1.0].head
    with torch.no_grad():  # soft0 by hand: the target's distribution at each label's position
        out = head.unroll(lambda t: m.embed_tokens(t).float(), batch.tokens,
                          head.prepare([batch.of(m.num_layers).float()]), 1)[0]  # [B, S, E]
        mask = batch.loss_mask[:, 1:]  # out[:, i] predicts the label at i + 1
        goal = torch.softmax(peaked.logits(batch.of(m.num_layers)[:, 1:][mask].float()), -1)
        q = torch.log_softmax(head.draft_logits(out[:, :-1][mask], peaked), -1)
        want = float(-(goal * q).sum(-1).mean())
        q_hard = float(-q.gather(1, batch.labels[:, 1:][mask][:, None]).mean())
    assert mask.sum() > 10 and abs(want - q_hard) > 1e-4, "the check needs goals that differ"
    assert soft_terms["soft0"] == pytest.approx(want, rel=1e-5)
    assert hard_terms["ce0"] == pytest.approx(q_hard, rel=1e-5)
    torch.testing.assert_close(float(soft - hard), 0.1 * (soft_terms["soft0"] - hard_terms["ce0"]), rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(losses[0.5][0], 0.5 * (hard + soft), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(point, hard, rtol=1e-4, atol=1e-5)


@dataclasses.dataclass(frozen=True)
class _ThroughLMHead(_ProbeTrainer):
    """A probe whose only gradient path runs through the frozen target's LM head (as the block
    head's loss and EAGLE-1's cross-entropy do)."""

    def build(self, target, dataset, options):
        return nn.Linear(target.args.hidden_size, target.args.hidden_size)

    def loss(self, module, batch, target):
        h = batch.of(target.num_layers)[batch.loss_mask]
        return nn.functional.cross_entropy(target.logits(module(h)), batch.labels[batch.loss_mask]), {}

    def export(self, module, out_dir, provenance):
        return out_dir


def test_training_gradients_pass_the_targets_lm_head_under_a_packed_gemm_plan(tiny_models, tmp_path):
    """A CPU GEMM plan's oneDNN 'packed' product has no backward (its gradient would silently vanish):
    ``linear`` bypasses it while a gradient is recorded, so the loop trains under the machine's plan."""
    import copy

    from refspec.models import calibration as C
    from refspec.models import cpu_speed

    if not packed_form_runs():
        return  # calibration never offers it here (asserted by packed_form_runs)
    m = copy.deepcopy(tiny_models["llama"])
    packed = C.GemmPlan(forms={"fp32": {b: "packed" for b in C.BUCKETS}}, timings_s={}, machine={})
    cpu_speed.plan_gemms(m, packed)
    assert cpu_speed.weight_copy_kind(m) == "packed"
    ds = T.collect_features(m, _sequences(8, seed=3), (m.num_layers,), progress=False)
    h = torch.randn(3, m.args.hidden_size, requires_grad=True)
    # outside the loop too, linear() bypasses the packed copy while a gradient to its input is recorded
    assert torch.autograd.grad(m.logits(h).sum(), h, allow_unused=True)[0] is not None
    seen = []
    trainer = _ThroughLMHead()
    torch.manual_seed(0)
    start = trainer.build(m, ds, {}).weight.detach().clone()
    orig_loss = trainer.loss

    def loss(module, batch, target):
        out = orig_loss(module, batch, target)
        seen.append(torch.autograd.grad(out[0], module.weight, retain_graph=True, allow_unused=True)[0])
        return out

    object.__setattr__(trainer, "loss", loss)
    T.train(trainer, m, ds, _cfg(2), tmp_path, progress=False)
    assert all(g is not None and g.abs().sum() > 0 for g in seen)
    assert cpu_speed.weight_copy_kind(m) == "packed" and m.lm_head.gemm.forms == ("packed",) * 3


def test_bf16_autocast_trains_with_fp32_weights_and_may_change_on_resume(tiny_models, tmp_path):
    m = tiny_models["llama"]
    ds = T.collect_features(m, _sequences(12, seed=1), (m.num_layers,), progress=False)
    seen, trainer = [], _ProbeTrainer()
    orig_loss = trainer.loss

    def loss(module, batch, target):
        seen.append(torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu"))
        return orig_loss(module, batch, target)

    object.__setattr__(trainer, "loss", loss)
    bf16 = dataclasses.replace(_cfg(60), autocast="bf16")
    res = T.train(trainer, m, ds, bf16, tmp_path, progress=False)
    assert seen == [torch.bfloat16] * 60 and res.final_loss < 0.7 * res.first_loss
    state = torch.load(tmp_path / "probe.pt", weights_only=True)
    assert all(v.dtype == torch.float32 for v in state.values()), "master weights stay fp32"
    resumed = T.train(trainer, m, ds, _cfg(70), tmp_path, progress=False, resume=True)  # on in fp32
    assert resumed.steps == 70 and seen[60:] == [False] * 10
    with pytest.raises(T.TrainingError, match="autocast"):
        T.TrainConfig(autocast="fp8")
