"""Held-out early stopping: the split, the best module exported, patience, resume, and the mix flag."""
import dataclasses
import json
import math

import pytest
import torch

from refspec.drafters import training as T
from test_training import _ProbeTrainer, tiny_cli_argv


def _noisy_labels(n_seqs=60, seed=0):
    """Random states labelled by a linear rule, half of them relabelled at random: a probe first
    learns the rule (held-out loss falls), then memorises the noise (it rises)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, 16, (n_seqs,), generator=g)
    n = int(lengths.sum())
    offsets = torch.zeros(n_seqs + 1, dtype=torch.long)
    offsets[1:] = lengths.cumsum(0)
    hidden = torch.randn(n, 64, generator=g).bfloat16()
    labels = (hidden.float() @ torch.randn(64, 96, generator=g)).argmax(-1)
    noisy = torch.rand(n, generator=g) < 0.5
    labels[noisy] = torch.randint(0, 96, (int(noisy.sum()),), generator=g)
    return T.FeatureDataset(tokens=torch.arange(n), labels=labels, loss_mask=torch.ones(n, dtype=torch.bool),
                            hidden={2: hidden}, offsets=offsets)


class _Target(torch.nn.Module):
    """Stands in for the frozen target: the probe trainer reads only ``num_layers``."""

    num_layers = 2

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))


def _cfg(steps, **kw):
    # a constant learning rate, so a shorter run follows the longer one's trajectory exactly
    return T.TrainConfig(steps=steps, batch_size=4, seq_len=12, lr=1e-2, warmup_steps=0, min_lr_ratio=1.0,
                         checkpoint_every=0, log_every=5, val_sequences=6, val_every=5, val_batches=2, **kw)


def _evaluations(out):
    lines = (out / T.TRAIN_LOG).read_text().strip().split("\n")
    return [r for r in map(json.loads, lines) if "val_loss" in r]


def _assert_same_probe(dir_a, dir_b):
    a, b = (torch.load(d / "probe.pt", weights_only=True) for d in (dir_a, dir_b))
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=0, rtol=0, msg=f"{key} differs")


def test_split_holds_out_whole_sequences_once_each():
    ds = _noisy_labels(24)
    train, held = ds.split(6, seed=3)
    assert (train.num_sequences, held.num_sequences) == (18, 6)
    pieces = [tuple(part.tokens[int(part.offsets[i]):int(part.offsets[i + 1])].tolist())
              for part in (train, held) for i in range(part.num_sequences)]
    whole = [tuple(ds.tokens[int(ds.offsets[i]):int(ds.offsets[i + 1])].tolist()) for i in range(ds.num_sequences)]
    assert sorted(pieces) == sorted(whole), "every sequence lands in exactly one part, intact"
    assert torch.equal(held.hidden[2], ds.hidden[2][torch.isin(ds.tokens, held.tokens)])
    again, _ = ds.split(6, seed=3)
    other, _ = ds.split(6, seed=4)
    assert torch.equal(again.tokens, train.tokens) and not torch.equal(other.tokens, train.tokens)
    for bad in (0, 24):
        with pytest.raises(T.TrainingError, match="between 1 and 23"):
            ds.split(bad, seed=0)


def test_the_module_with_the_lowest_held_out_loss_is_exported(tmp_path):
    ds, target = _noisy_labels(), _Target()
    res = T.train(_ProbeTrainer(), target, ds, _cfg(60), tmp_path / "long", progress=False)
    evals = _evaluations(tmp_path / "long")
    assert [r["step"] for r in evals] == list(range(0, 61, 5)), "the starting module is scored too"
    best = min(evals, key=lambda r: r["val_loss"])
    assert 0 < res.best_step == best["step"] < 60, "learning, then memorising the noise"
    assert res.best_value == pytest.approx(best["val_loss"], abs=1e-5)
    prov = json.loads((tmp_path / "long" / "provenance.json").read_text())
    assert prov["held_out"]["best_step"] == best["step"] and prov["held_out"]["sequences"] == 6
    assert prov["data"]["sequences"] == 54 and prov["steps"] == 60
    T.train(_ProbeTrainer(), target, ds, _cfg(best["step"]), tmp_path / "short", progress=False)
    _assert_same_probe(tmp_path / "long", tmp_path / "short")


class _AccuracyProbe(_ProbeTrainer):
    """The probe, also reporting its top-1 accuracy."""

    def loss(self, module, batch, target):
        h = batch.of(target.num_layers)[batch.loss_mask]
        logits = module.lin(h)
        acc = (logits.argmax(-1) == batch.labels[batch.loss_mask]).float().mean()
        return torch.nn.functional.cross_entropy(logits, batch.labels[batch.loss_mask]), {"acc": float(acc)}


def test_a_logged_metric_can_pick_the_best_module_highest_first(tmp_path):
    ds, target = _noisy_labels(), _Target()
    res = T.train(_AccuracyProbe(), target, ds, _cfg(60, val_metric="acc", val_goal="max"), tmp_path, progress=False)
    evals = _evaluations(tmp_path)
    best = max(evals, key=lambda r: r["val_acc"])  # the first of equal highs
    assert res.best_step == best["step"] and res.best_value == pytest.approx(best["val_acc"], abs=1e-5)
    assert res.best_step != min(evals, key=lambda r: r["val_loss"])["step"], "the metric chose, not the loss"
    with pytest.raises(T.TrainingError, match="not among what the trainer reports"):
        T.train(_AccuracyProbe(), target, ds, _cfg(5, val_metric="tau"), tmp_path / "bad", progress=False)
    with pytest.raises(T.TrainingError, match="val_goal"):
        _cfg(5, val_goal="up")
    with pytest.raises(T.TrainingError, match="set val_sequences too"):
        dataclasses.replace(_cfg(5), val_sequences=0, patience=3)


def test_patience_stops_the_run_after_evaluations_without_a_new_best(tmp_path):
    ds, target = _noisy_labels(), _Target()
    free = T.train(_ProbeTrainer(), target, ds, _cfg(60), tmp_path / "free", progress=False)
    patient = T.train(_ProbeTrainer(), target, ds, _cfg(60, patience=2), tmp_path / "patient", progress=False)
    assert patient.stopped_early and patient.steps == free.best_step + 2 * 5
    assert patient.best_step == free.best_step and math.isfinite(patient.best_value)


def test_resume_keeps_the_best_so_far(tmp_path):
    ds, target = _noisy_labels(), _Target()
    straight = T.train(_ProbeTrainer(), target, ds, _cfg(40), tmp_path / "a", progress=False)

    def stop_at_25(record):
        if record["step"] == 25 and "val_loss" in record:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        T.train(_ProbeTrainer(), target, ds, _cfg(40), tmp_path / "b", progress=False, on_log=stop_at_25)
    resumed = T.train(_ProbeTrainer(), target, ds, _cfg(40), tmp_path / "b", progress=False, resume=True)
    assert (resumed.best_step, resumed.best_value) == (straight.best_step, straight.best_value)
    _assert_same_probe(tmp_path / "a", tmp_path / "b")


def test_without_held_out_sequences_the_last_module_is_exported(tmp_path):
    ds, target = _noisy_labels(), _Target()
    res = T.train(_ProbeTrainer(), target, ds, dataclasses.replace(_cfg(10), val_sequences=0), tmp_path,
                  progress=False)
    assert res.best_step is None and not (tmp_path / "best.pt").exists() and not _evaluations(tmp_path)


class _CharTokenizer:
    """One token per character; a chat is its messages' text (plus 0 for the generation prompt)."""
    eos_token_ids = ()

    def encode(self, text):
        return [ord(c) for c in text]

    def encode_chat(self, messages, add_generation_prompt=True):
        return [ord(c) for m in messages for c in m["content"]] + ([0] if add_generation_prompt else [])


def _fake_distill(monkeypatch, train_data) -> dict:
    """Replace self-distillation by a one-token reply; returns the prompts asked for, per source."""
    asked: dict = {}

    def fake(target, prompts, *, source, **kw):
        asked[source] = [list(p) for p in prompts]
        return [T.TrainingSequence(tokens=p + [1], train_from=len(p) - 1, source=source) for p in prompts]

    monkeypatch.setattr(train_data, "distill_with_cache", fake)
    return asked


def test_reference_prompts_are_self_distilled_too_when_asked(monkeypatch):
    """``distill_references`` adds the target's replies to the reference answers' prompts and keeps
    the references; a spec without it keeps the key it had before the field existed."""
    import hashlib

    from refspec.eval import train_data

    spec = train_data.DataSpec(chat_prompts=1, chat_references=2, math_prompts=0, math_references=0,
                               code_prompts=0, code_references=0, prose_chunks=0)
    raw = json.dumps({"model": "m", **{k: v for k, v in dataclasses.asdict(spec).items()
                                       if k not in ("distill_references", "reference_cuts")}}, sort_keys=True)
    assert spec.key("m") == hashlib.sha256(raw.encode()).hexdigest()[:12]
    both = dataclasses.replace(spec, distill_references=True)
    assert both.key("m") != spec.key("m")
    rows = [{"prompt": f"question {i}", "reference": f"answer {i}", "text": f"question {i}"} for i in range(3)]
    monkeypatch.setattr(train_data, "_train_rows",
                        lambda seed: ({"conversation": rows, "math": [], "code": []}, []))
    for s, n_distilled in ((spec, 1), (both, 3)):
        asked = _fake_distill(monkeypatch, train_data)
        seqs, desc = train_data.build_sequences(None, _CharTokenizer(), s)
        assert len(asked["conversation:self-distill"]) == n_distilled
        assert desc["sources"] == {"conversation:self-distill": n_distilled, "conversation:reference": 2}


@pytest.mark.real
def test_cli_holds_sequences_out_and_distills_the_reference_prompts(tmp_path):
    from refspec.eval import train

    out, data = tmp_path / "head", tmp_path / "data.json"
    argv = tiny_cli_argv(out, data) + ["--distill-references", "--steps", "2", "--batch-size", "1", "--seq-len",
                                       "64", "--val-sequences", "1", "--val-every", "1", "--quiet"]
    assert train.main(argv) == 0
    desc = json.loads(data.read_text())["description"]
    assert desc["sources"] == {"conversation:self-distill": 2, "conversation:reference": 1, "english-sotu:prose": 1}
    prov = json.loads((out / "config.json").read_text())["refspec"]["provenance"]
    assert prov["held_out"]["sequences"] == 1 and prov["data"]["sequences"] == 3
    assert prov["held_out"]["best_step"] in (0, 1, 2) and prov["held_out"]["trained_positions"] > 0
    assert (out / "best.pt").exists()


def test_reference_cuts_continue_each_answer_from_evenly_spaced_points(monkeypatch):
    """``reference_cuts`` decodes from prompt + the first 1/(K+1), 2/(K+1), ... of each reference
    answer of that source (never past the reply budget's room); other sources and older keys stay."""
    from refspec.eval import train_data

    spec = train_data.DataSpec(chat_prompts=0, chat_references=0, math_prompts=0, math_references=0,
                               code_prompts=1, code_references=1, prose_chunks=0, max_len=30, reply_tokens=10)
    cut = dataclasses.replace(spec, reference_cuts=(("code", 2),))
    assert "reference_cuts" not in spec.fields() and cut.key("m") != spec.key("m")
    rows = [{"prompt": "def f", "reference": "abcdef", "text": "def f"},
            {"prompt": "def g", "reference": "x" * 60, "text": "def g"}]
    monkeypatch.setattr(train_data, "_train_rows", lambda seed: ({"conversation": [], "math": [], "code": rows}, []))
    asked = _fake_distill(monkeypatch, train_data)
    seqs, desc = train_data.build_sequences(None, _CharTokenizer(), cut)
    ids = _CharTokenizer().encode
    # g's answer is cut to 25 tokens by max_len: 25 // 3 = 8, then 5 + 16 capped at max_len - reply_tokens = 20
    assert asked["code:cut-distill"] == [ids("def fab"), ids("def fabcd"), ids("def g" + "x" * 8),
                                         ids("def g" + "x" * 15)]
    assert desc["sources"] == {"code:self-distill": 1, "code:reference": 1, "code:cut-distill": 4}
    with pytest.raises(ValueError, match="reference cuts"):
        train_data.DataSpec(reference_cuts=(("prose", 1),))


@pytest.mark.parametrize("bad", ["code", "code=x", "prose=2"])
def test_cli_refuses_a_bad_reference_cut_in_one_line(bad, capsys):
    from refspec.eval import train

    assert train.main(["--drafter", "block", "--reference-cuts", bad, "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and ("cuts" in err[0])


def test_cli_warns_that_bf16_autocast_is_emulated_without_bf16_instructions(monkeypatch, caplog):
    from refspec.eval import machine, train

    for has_bf16 in (False, True):
        caplog.clear()
        monkeypatch.setattr(machine, "cpu_has_fast_bf16", lambda cpuinfo=None: has_bf16)
        assert train.main(["--drafter", "block", "--autocast", "bf16", "--reference-cuts", "bad", "--quiet"]) == 2
        assert ("emulated" in caplog.text) is not has_bf16
