"""Forwards bill their own work: per drafter, at prefill and at every step, the FLOPs billed to a
phase equal the FLOPs its forwards ran, counted independently by torch's FlopCounterMode
(every matrix product the kernels saw: mm/addmm for projections and LM heads, bmm/baddbmm for
attention)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from refspec.drafters.block import BlockDrafter
from refspec.drafters.block_head import BlockHead, BlockHeadConfig, default_feature_layers
from refspec.drafters.draft_model import DraftModelDrafter
from refspec.drafters.eagle import EagleDrafter, TreeConfig
from refspec.drafters.eagle_head import HeadConfig, new_head
from refspec.drafters.ngram import NgramDrafter
from refspec.energy.meters.measurement import Measurement
from refspec.energy.model.roofline import total_cost
from refspec.engine import Engine, EngineConfig


@dataclasses.dataclass
class Window:
    name: str
    work: tuple
    attention_flops: int  # bmm + baddbmm the forwards ran
    dense_flops: int  # mm + addmm: projections, fc, LM heads


class CountingMeter:
    """A meter that counts the matrix-product FLOPs run inside each window and keeps the work
    the engine billed to it."""

    source = "none:time-only"

    def __init__(self) -> None:
        self.windows: list[Window] = []
        self._mode: FlopCounterMode | None = None

    def begin(self, name: str) -> None:
        assert self._mode is None, "the engine's phases do not nest"
        self._mode = FlopCounterMode(display=False)
        self._mode.__enter__()

    def end(self, name: str, work=()) -> Measurement:
        self._mode.__exit__(None, None, None)
        counts = self._mode.get_flop_counts().get("Global", {})  # empty when no product ran
        self._mode = None
        attention = sum(v for op, v in counts.items() if "bmm" in str(op))
        self.windows.append(Window(name, tuple(work), attention, sum(counts.values()) - attention))
        return Measurement(0.0, None, self.source)


def _eagle(model, kind, tree=None):
    torch.manual_seed(0)
    vd = model.args.vocab_size // 2 if kind == "eagle3" else None
    return EagleDrafter(new_head(HeadConfig.for_target(kind, model.args, draft_vocab_size=vd)), model, tree=tree)


def _block(model):
    torch.manual_seed(0)
    cfg = BlockHeadConfig(feature_layers=default_feature_layers(model.num_layers), block_size=8)
    return BlockDrafter(BlockHead(model.args, cfg), model)


DRAFTERS = {  # name -> (builder, K)
    "none": (lambda m: None, 0),
    "ngram": (lambda m: NgramDrafter(max_n=3, trim=False), 3),
    "draft-model": (lambda m: DraftModelDrafter(m.truncated(1), target_vocab_size=m.args.vocab_size), 3),
    "eagle": (lambda m: _eagle(m, "eagle"), 3),
    "eagle3": (lambda m: _eagle(m, "eagle3"), 3),
    "block": (_block, 4),
    "tree": (lambda m: _eagle(m, "eagle", TreeConfig(topk=2, depth=3, budget=5)), 4),
}


def _run(model, name, prompts, new_tokens=6):
    build, k = DRAFTERS[name]
    meter, events = CountingMeter(), []
    Engine(model, build(model), config=EngineConfig(k=k), meter=meter, observers=[events.append]).generate(
        prompts, max_new_tokens=new_tokens)
    return meter.windows, events


def _assert_billed_equals_run(windows, label):
    assert windows[0].name == "prefill" and any(w.name == "verify" for w in windows)
    for i, w in enumerate(windows):
        billed = total_cost(w.work)
        where = f"{label}: window {i} ({w.name})"
        assert billed.attention_flops == w.attention_flops, f"{where}: attention billed {billed.attention_flops:.6g}, " \
                                                            f"run {w.attention_flops:.6g}"
        dense = billed.linear_flops + billed.lm_head_flops + billed.extra_flops
        assert dense == w.dense_flops, f"{where}: projections + LM heads billed {dense:.6g}, run {w.dense_flops:.6g}"
        if w.name in ("prefill", "verify"):
            assert w.dense_flops > 0, f"{where}: a target forward ran"
        if w.name == "commit":
            assert w.work == () and w.dense_flops == 0, f"{where}: commit runs no forward"


def _ragged(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = [5, 17, 1, 30][:n]
    ps = [torch.randint(3, 96, (m,), generator=g).tolist() for m in lens]
    ps[1] = ps[1][:6] * 3  # repetition gives the n-gram drafter matches
    return ps


@pytest.mark.parametrize("name", list(DRAFTERS))
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_billed_work_equals_run_work_at_prefill_and_every_step(tiny_models, name, family):
    windows, events = _run(tiny_models[family], name, _ragged())
    _assert_billed_equals_run(windows, f"{family}/{name}")
    drafts = [w for w in windows if w.name == "draft"]
    if name in ("none", "ngram"):
        assert all(w.work == () and w.dense_flops == 0 for w in drafts), "no drafter forward, no draft work"
    else:
        assert all(w.dense_flops > 0 for w in drafts), "every draft phase ran forwards"
    # the ledger sees exactly what the meter was handed
    assert [(e.phase, e.work) for e in events] == [(w.name, w.work) for w in windows]


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_billed_work_equals_run_work_for_a_1500_token_prompt(tiny_models, name):
    m = tiny_models["llama3"]  # a context of 2048 positions
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 96, (1500,), generator=g).tolist()
    windows, _ = _run(m, name, [prompt], new_tokens=4)
    _assert_billed_equals_run(windows, f"1500/{name}")
    prefill = windows[0]
    b_attn = total_cost(prefill.work).attention_flops
    a = m.args
    # the target's packed prompt pass alone attends 1500 queries to their own 1500 keys in every
    # layer (no key padded up to a bucket is billed)
    assert b_attn >= 4 * a.num_heads * a.head_dim * 1500 * 1500 * a.num_layers


def test_draft_model_prompt_pass_bills_no_lm_head(tiny_models):
    m = tiny_models["llama"]
    windows, _ = _run(m, "draft-model", [list(range(3, 40))])
    target_pass, draft_pass = windows[0].work
    assert target_pass.lm_head_tokens == 1, "the target's prompt pass computes the last position's logits"
    assert draft_pass.lm_head_tokens == 0, "the draft model's prompt pass computes no logits"
    assert total_cost([draft_pass]).lm_head_flops == 0


def test_eagle_prompt_pass_bills_keys_linear_in_the_prompt(tiny_models):
    m = tiny_models["llama"]
    windows, _ = _run(m, "eagle", [list(range(3, 90))])
    head_pass = windows[0].work[1]
    assert head_pass.tokens_per_row == 87 and head_pass.context_tokens == 128, "87 queries over 128 slots, not 87*88/2"


def test_padded_rows_of_a_graph_runner_are_billed(tiny_models):
    """Eager-static CUDA-graph buffers compute the padded rows of the batch bucket: they are billed."""
    from refspec.cuda_graphs import GraphRunner
    from refspec.models import PreparedTarget

    m = tiny_models["llama"]
    meter = CountingMeter()
    runner = GraphRunner(m, capture=False)
    Engine(PreparedTarget(m, step=runner), NgramDrafter(trim=False), config=EngineConfig(k=2), meter=meter).generate(
        _ragged(3), max_new_tokens=5)
    _assert_billed_equals_run(meter.windows, "graph-runner")
    verify = [w for w in meter.windows if w.name == "verify"]
    assert verify and all(w.work[0].rows == 4 for w in verify), "3 rows run in the 4-row bucket"


def test_weight_copies_are_billed_at_the_bytes_they_stream(tmp_path, monkeypatch):
    """A bf16 target on a CPU multiplies 2+ rows through fp32 copies of its matrices: the prompt
    pass of the target and of an EAGLE-1 head (which borrows the target's LM head) bill exactly the
    copies' extra bytes over a model that keeps none."""
    from tiny import save_hf

    from refspec.models import load_model

    save_hf("llama", tmp_path)
    prompts = _ragged()

    def prefill(model):
        torch.manual_seed(0)
        head = new_head(HeadConfig.for_target("eagle", model.args)).to(torch.bfloat16)
        meter = CountingMeter()
        Engine(model, EagleDrafter(head, model), config=EngineConfig(k=2, max_steps=1), meter=meter).generate(
            prompts, max_new_tokens=3)
        return total_cost(meter.windows[0].work).weight_bytes

    from tiny import copy_plan

    from refspec.models import prepare_target
    from refspec.models.cpu_speed import copied_linears, weight_copy_kind

    copied = prepare_target(load_model(tmp_path, dtype=torch.bfloat16), cpu_plan=copy_plan()).model
    assert weight_copy_kind(copied) == "fp32"
    monkeypatch.setenv("REFSPEC_CPU_WEIGHT_COPIES_GIB", "0")
    plain = prepare_target(load_model(tmp_path, dtype=torch.bfloat16), cpu_plan=copy_plan()).model
    assert weight_copy_kind(plain) is None
    extra = {id(lin): lin.gemm.copy.t.nbytes - lin.weight.nbytes for lin in copied_linears(copied)}
    lm_head = extra[id(copied.lm_head)]
    assert prefill(copied) - prefill(plain) == sum(extra.values()) + lm_head, "target's copies, then the head's LM head"
