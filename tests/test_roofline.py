"""Roofline cost model: FLOP and byte counts against hand arithmetic, balance point, CLI."""
from __future__ import annotations

import pytest

from refspec.config import ModelArgs
from refspec.energy.model.architectures import ARCHS, arch
from refspec.energy.model.cost import Cost
from refspec.energy.model.hardware import H100_SXM, H200_SXM, HardwareProfile, cpu_profile
from refspec.energy.model.roofline import (EAGLE_HEAD, DrafterModel, compute_bound_batch, expected_tokens_per_step,
                                           forward_cost, predict_step, total_cost)
from refspec.energy.model.work import ForwardShape
from refspec.eval.roofline_cli import main

# E=64, I=128, L=2, H=4, Hkv=2, D=16, V=96, tied, no bias
TINY = ModelArgs.from_hf_config(dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     tie_word_embeddings=True))


def test_forward_cost_matches_hand_arithmetic():
    # 2 rows x 3 query tokens, each row attends 10 keys (cache length after the write), bf16
    c = forward_cost(ForwardShape(args=TINY, rows=2, tokens_per_row=3, context_tokens=20, dtype_bytes=2))
    n = 6
    attn_matrices = 64 * 16 * (2 * 4 + 2 * 2)  # q, o: E x H D; k, v: E x Hkv D -> 12288
    mlp = 3 * 64 * 128  # gate, up, down -> 24576
    norms = 2 * 64
    assert c.linear_flops == 2 * n * 2 * (attn_matrices + mlp) == 884_736
    assert c.attention_flops == 4 * 4 * 16 * 3 * (2 * 20) == 30_720  # 4 H D x S x keys, 2 layers
    assert c.lm_head_flops == 2 * n * 96 * 64 == 73_728
    assert c.extra_flops == 0
    # weights: 2 layers, final norm, 6 gathered embedding rows, the (tied) head matrix once
    assert c.weight_bytes == 2 * (2 * (attn_matrices + mlp + norms) + 64 + 6 * 64 + 96 * 64) == 161_152
    kv_per_key_layer = 2 * 2 * 16 * 2  # K and V, Hkv heads of D, 2 bytes
    assert c.kv_read_bytes == 2 * 20 * kv_per_key_layer == 5_120
    assert c.kv_write_bytes == n * 2 * kv_per_key_layer == 1_536
    assert c.activation_bytes == 2 * (n * 2 * 2 * 64 + n * 64 + n * 96) == 4_992
    assert c.flops == 884_736 + 30_720 + 73_728
    assert c.bytes == 161_152 + 5_120 + 1_536 + 4_992
    # a bf16 model whose CPU products of several rows stream fp32 copies: matrices and head at 4 bytes
    c4 = forward_cost(ForwardShape(args=TINY, rows=2, tokens_per_row=3, context_tokens=20, dtype_bytes=2,
                                   matrix_bytes=4))
    assert c4.weight_bytes == 4 * (2 * (attn_matrices + mlp) + 96 * 64) + 2 * (2 * norms + 64 + 6 * 64)
    assert (c4.flops, c4.kv_read_bytes, c4.activation_bytes) == (c.flops, c.kv_read_bytes, c.activation_bytes)
    # ... but one-row products stream the bf16 weights: a one-token head, a one-token forward
    head1 = forward_cost(ForwardShape(args=TINY, rows=2, tokens_per_row=3, context_tokens=20, dtype_bytes=2,
                                      matrix_bytes=4, lm_head_tokens=1))
    assert head1.weight_bytes == 4 * 2 * (attn_matrices + mlp) + 2 * (96 * 64 + 2 * norms + 64 + 6 * 64)
    one = dict(args=TINY, rows=1, tokens_per_row=1, context_tokens=5, dtype_bytes=2)
    assert forward_cost(ForwardShape(**one, matrix_bytes=4)) == forward_cost(ForwardShape(**one))


def test_qwen2_bias_and_sliding_window_caps_keys():
    qwen = ModelArgs.from_hf_config(dict(model_type="qwen2", vocab_size=96, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    c = forward_cost(ForwardShape(args=qwen, rows=1, tokens_per_row=1, context_tokens=5, dtype_bytes=4))
    bias = 16 * (4 + 2 * 2)
    assert c.weight_bytes == 4 * (64 * 16 * 12 + 3 * 64 * 128 + 2 * 64 + bias + 64 + 64 + 96 * 64)
    gemma = ModelArgs.from_hf_config(dict(model_type="gemma3_text", vocab_size=96, hidden_size=64,
                                          intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                                          num_key_value_heads=1, head_dim=32, sliding_window=8,
                                          layer_types=["sliding_attention"] * 5 + ["full_attention"]))
    c = forward_cost(ForwardShape(args=gemma, rows=2, tokens_per_row=1, context_tokens=40, dtype_bytes=2))
    keys = 5 * 2 * 8 + 40  # sliding layers read 8 keys per row, the global layer all 20 per row
    assert c.attention_flops == 4 * 4 * 32 * 1 * keys
    assert c.kv_read_bytes == keys * 2 * 1 * 32 * 2


def test_a_packed_prefill_costs_its_prompts_once_and_reads_the_weights_once():
    # prompts of 5, 3 and 2 tokens packed into one forward: N = 10 query tokens, sum S_i^2 = 38 pairs
    lens = (5, 3, 2)
    packed = forward_cost(ForwardShape(args=TINY, rows=3, tokens_per_row=5, query_tokens=10, context_tokens=10,
                                       attention_pairs=38, lm_head_tokens=3, dtype_bytes=2))
    alone = [forward_cost(ForwardShape(args=TINY, rows=1, tokens_per_row=s, context_tokens=s, lm_head_tokens=1,
                                       dtype_bytes=2)) for s in lens]
    for field in ("linear_flops", "attention_flops", "lm_head_flops", "kv_read_bytes", "kv_write_bytes",
                  "activation_bytes"):
        assert getattr(packed, field) == sum(getattr(c, field) for c in alone), field
    assert packed.attention_flops == 4 * 4 * 16 * 38 * 2  # 4 H D per pair, 2 layers
    assert packed.linear_flops == 2 * 10 * 2 * (12288 + 24576)  # 10 tokens, not 3 rows x 5
    shared = packed.weight_bytes - 2 * 10 * 64  # every weight but the 10 gathered embedding rows
    assert sum(c.weight_bytes for c in alone) == 3 * shared + 2 * 10 * 64, "alone, each prompt reads them again"
    padded = forward_cost(ForwardShape(args=TINY, rows=3, tokens_per_row=5, context_tokens=15, lm_head_tokens=3,
                                       dtype_bytes=2))
    assert padded.flops > packed.flops, "rows padded to the longest prompt compute more"
    with pytest.raises(ValueError, match="query_tokens"):
        forward_cost(ForwardShape(args=TINY, rows=3, tokens_per_row=5, query_tokens=16, context_tokens=10,
                                  dtype_bytes=2))


def test_sliding_layers_take_their_own_reported_pairs():
    gemma = ModelArgs.from_hf_config(dict(model_type="gemma3_text", vocab_size=96, hidden_size=64,
                                          intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=1, head_dim=32, sliding_window=4,
                                          layer_types=["sliding_attention", "full_attention"]))
    # prompts of 6 and 2 packed: each layer kind computes the pairs the forward reports for it
    c = forward_cost(ForwardShape(args=gemma, rows=2, tokens_per_row=6, query_tokens=8, context_tokens=8,
                                  sliding_context_tokens=6, attention_pairs=40, sliding_attention_pairs=25,
                                  dtype_bytes=2))
    assert c.attention_flops == 4 * 4 * 32 * (40 + 25)
    assert c.kv_read_bytes == (8 + 6) * 2 * 1 * 32 * 2
    # without reported pairs each layer derives S x its keys, as before
    d = forward_cost(ForwardShape(args=gemma, rows=2, tokens_per_row=6, context_tokens=8, sliding_context_tokens=6,
                                  dtype_bytes=2))
    assert d.attention_flops == 4 * 4 * 32 * 6 * (8 + 6)


def test_overrides_layers_lm_head_and_extras():
    shape = ForwardShape(args=TINY, rows=1, tokens_per_row=1, context_tokens=4, dtype_bytes=2, layers=1,
                         lm_head_rows=10, lm_head_tokens=0, extra_weight_bytes=100, extra_flops=7)
    c = forward_cost(shape)
    assert c.lm_head_flops == 0
    assert c.weight_bytes == 2 * (12288 + 24576 + 128 + 64 + 64) + 100  # no head matrix: no token reaches it
    assert c.extra_flops == 7
    assert total_cost([shape, shape]) == c + c


def test_llama_8b_matches_reference_figures():
    a = arch("llama-3.1-8b")
    c = forward_cost(ForwardShape(args=a, rows=1, tokens_per_row=1, context_tokens=1, dtype_bytes=2))
    assert c.flops == pytest.approx(15e9, rel=0.03)  # Llama-3.1-8B: about 15 GFLOP per token
    assert c.weight_bytes == pytest.approx(15e9, rel=0.03)  # ~15 GB of weights
    assert a.kv_bytes_per_token(2) == 131_072


def test_every_arch_builds():
    for name in ARCHS:
        a = arch(name)
        assert a.num_parameters() > 0, name
    assert arch("gemma-3-1b").num_parameters() == 999_885_952  # Keras-hub's published count


@pytest.mark.parametrize("profile", [H100_SXM, H200_SXM])
@pytest.mark.parametrize("k", [0, 1, 3, 7])
def test_verify_turns_compute_bound_near_ridge(profile, k):
    b = compute_bound_batch(arch("llama-3.1-8b"), profile, k=k, context=0)
    assert b is not None
    assert abs(b * (k + 1) - profile.ridge) / profile.ridge < 0.1  # B (k+1) ~ ridge at short context


def test_context_raises_the_crossover():
    a = arch("llama-3.1-8b")
    short = compute_bound_batch(a, H200_SXM, k=3, context=0)
    long = compute_bound_batch(a, H200_SXM, k=3, context=2048)
    assert short is not None and (long is None or long > short)
    assert compute_bound_batch(a, H200_SXM, k=0, context=2048) is None  # T=1 never beats its own KV reads


def test_profile_time_and_energy_formula():
    p = HardwareProfile(name="toy", peak_flops=100.0, bandwidth_Bps=10.0, static_w=2.0, pj_per_flop=1e12,
                        pj_per_byte=2e12, idle_w=1.0, overhead_s=0.5)
    c = Cost(linear_flops=300.0, weight_bytes=20.0)
    assert p.ridge == 10.0
    assert p.time_s(c) == max(300 / 100, 20 / 10) + 0.5 == 3.5
    assert p.energy_j(c, 3.5) == 2.0 * 3.5 + 1.0 * 300 + 2.0 * 20


def test_expected_tokens_per_step():
    assert expected_tokens_per_step(0.8, 3) == pytest.approx((1 - 0.8**4) / 0.2)
    assert expected_tokens_per_step(1.0, 3) == 4
    assert expected_tokens_per_step(0.0, 5) == 1
    with pytest.raises(ValueError):
        expected_tokens_per_step(1.5, 1)


def test_speculation_saves_at_small_batch_and_costs_at_large():
    a = arch("llama-3.1-8b")

    def saving(batch, k, acc):
        base = predict_step(a, H100_SXM, batch=batch, k=0, context=512, acceptance=acc)
        spec = predict_step(a, H100_SXM, batch=batch, k=k, context=512, acceptance=acc)
        return 1 - spec.j_per_token / base.j_per_token

    assert saving(1, 3, 0.8) > 0.3
    assert saving(256, 7, 0.6) < 0  # compute-bound verify with low acceptance: a loss
    assert saving(1, 7, 0.8) > saving(256, 7, 0.8)  # the saving shrinks as the batch grows


def test_predict_step_parts_add_up():
    a = arch("smollm2-135m")
    p = predict_step(a, H200_SXM, batch=4, k=3, context=100, acceptance=0.5, drafter=EAGLE_HEAD)
    assert p.step_time_s == pytest.approx(p.draft_time_s + p.verify_time_s)
    assert p.step_energy_j == pytest.approx(p.draft_energy_j + p.verify_energy_j)
    assert p.j_per_token == pytest.approx(p.step_energy_j / (4 * expected_tokens_per_step(0.5, 3)))


def test_a_free_drafter_is_charged_no_forward_and_no_launch_overhead():
    """n-gram lookup runs no forward: its draft phase costs nothing, not K launch overheads."""
    a = arch("smollm2-135m")
    assert H200_SXM.overhead_s > 0, "the bug this guards against needs a per-forward overhead"
    plain = predict_step(a, H200_SXM, batch=4, k=3, context=100, acceptance=0.5, drafter=None)
    for drafter in (None, DrafterModel(name="ngram", fraction=0.0)):
        free = predict_step(a, H200_SXM, batch=4, k=3, context=100, acceptance=0.5, drafter=drafter)
        assert free.draft_time_s == 0.0 and free.draft_energy_j == 0.0
        assert free.step_time_s == plain.verify_time_s
    costly = predict_step(a, H200_SXM, batch=4, k=3, context=100, acceptance=0.5,
                          drafter=DrafterModel(name="tiny", fraction=1e-9))
    assert costly.draft_time_s >= 3 * H200_SXM.overhead_s, "a drafter that runs forwards pays their launches"


def test_cpu_profile_is_benchmarked():
    p = cpu_profile(4, weight_mib=8)  # small matrix: fast (a real profile streams 64 MiB)
    assert p.benchmarked and p.peak_flops > 1e8 and p.bandwidth_Bps > 1e8
    assert p.name.startswith("cpu-fp32-")


def test_cli_prints_table_and_writes_plot(tmp_path, capsys):
    rc = main(["--model", "smollm2-135m", "--gpu", "h200", "--batch", "1,64", "--k", "0,3",
               "--acceptance", "0.7", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "modelled:roofline(h200-sxm)" in out and "compute-bound" in out
    assert len(list(tmp_path.glob("*.png"))) == 1 and len(list(tmp_path.glob("*.csv"))) == 1
    assert main(["--model", "no-such-model"]) == 2


def test_a_plug_in_drafter_gets_a_prediction_from_its_own_cost_model():
    """The eval asks the drafter (no table of names): a class defined here, outside refspec,
    gets a prediction; a drafter without ``roofline_model`` gets none; None is a free drafter."""
    from types import SimpleNamespace

    from refspec.eval.run import roofline_prediction

    a = arch("smollm2-135m")
    session = SimpleNamespace(roofline_profile=H200_SXM, target=SimpleNamespace(model=SimpleNamespace(args=a)),
                              dtype_bytes=2)
    cfg = SimpleNamespace(tree=False, is_baseline=False, k=3, batch=2, max_new_tokens=16)

    class PlugIn:
        def roofline_model(self, target_args):
            assert target_args is a
            return DrafterModel(name="plug-in", fraction=0.25)

    class Free:
        def roofline_model(self, target_args):
            return None

    p = roofline_prediction(session, cfg, PlugIn(), [[1] * 100], 2.0)
    free = roofline_prediction(session, cfg, Free(), [[1] * 100], 2.0)
    assert p["drafter_model"] == "plug-in" and free["drafter_model"] == "free"
    assert p["tpot_s"] > free["tpot_s"], "the plug-in's draft forwards cost time, the free drafter's none"
    assert roofline_prediction(session, cfg, object(), [[1] * 100], 2.0) is None


def test_builtin_drafters_describe_their_own_cost(tiny_models):
    from refspec.drafters.block import BlockDrafter
    from refspec.drafters.block_head import BlockHead, BlockHeadConfig
    from refspec.drafters.draft_model import DraftModelDrafter
    from refspec.drafters.eagle import EagleDrafter
    from refspec.drafters.eagle_head import HeadConfig, new_head
    from refspec.drafters.ngram import NgramDrafter

    m = tiny_models["gemma3"]
    a = m.args
    assert NgramDrafter().roofline_model(a) is None
    dm = DraftModelDrafter(m.truncated(2), target_vocab_size=a.vocab_size).roofline_model(a)
    assert dm.args.num_layers == 2 and dm.args.layer_types == a.layer_types[:2], "a truncated draft runs 2 layers"
    e3 = EagleDrafter(new_head(HeadConfig.for_target("eagle3", a, draft_vocab_size=32)), m).roofline_model(a)
    assert (e3.fc_inputs, e3.lm_head_rows) == (3, 32)
    blk = BlockDrafter(BlockHead(a, BlockHeadConfig(feature_layers=(1, 3), num_layers=2)), m).roofline_model(a)
    assert blk.parallel and blk.layers == 2


# ---- mixture-of-experts targets -----------------------------------------------------------------
def _brute_loss_batches(target, k, a, batches):
    from refspec.energy.model.roofline import predict_step

    kw = dict(profile=H200_SXM, context=512, acceptance=a)
    return [b for b in batches if predict_step(target, batch=b, k=k, **kw).j_per_token
            > predict_step(target, batch=b, k=0, **kw).j_per_token]


@pytest.mark.parametrize("name, k, a", [("llama-3.1-8b", 3, 0.6), ("qwen3-30b-a3b", 3, 0.6),
                                        ("qwen3-30b-a3b", 7, 0.8), ("mixtral-8x7b", 7, 0.6)])
def test_loss_regions_equal_a_batch_by_batch_scan(name, k, a):
    from refspec.eval.roofline_cli import loss_regions

    target = arch(name)
    regions = loss_regions(target, H200_SXM, k=k, context=512, acceptance=a, max_batch=300)
    brute = _brute_loss_batches(target, k, a, range(1, 301))
    assert [b for lo, hi in regions for b in range(lo, hi + 1)] == brute
    if not target.is_moe:
        assert len(regions) == 1 and regions[0][1] == 300 and regions[0][0] > 1  # dense: only at large batch


def test_moe_speculation_loses_at_small_batch_where_its_dense_equivalent_saves():
    """Verification of B(K+1) tokens reads more distinct experts than decoding B, so at batch 1
    an MoE target loses energy to speculation that a dense model of equal active parameters
    saves; at batch 64 k=0 already reads nearly every expert and the MoE saves again."""
    from refspec.energy.model.architectures import dense_equivalent

    for name in ("qwen3-30b-a3b", "mixtral-8x7b"):
        moe = arch(name)
        assert _brute_loss_batches(moe, 7, 0.6, [1, 64]) == [1], name
        assert _brute_loss_batches(dense_equivalent(moe), 7, 0.6, [1]) == [], name


def test_cli_shows_an_moe_target_beside_its_dense_equivalent(capsys):
    rc = main(["--model", "qwen3-30b-a3b", "--batch", "1,64", "--k", "0,7", "--acceptance", "0.6"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "3.35 B active" in out and "dense J/tok" in out and "experts/L" in out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("a=0.60 k=7"))
    assert "loses energy at B 1.." in line and "dense equivalent:" in line and "of 128 experts/layer" in line
    row = next(ln.split() for ln in out.splitlines() if ln.split()[:3] == ["0.60", "7", "1"])
    assert float(row[6].rstrip("%")) < 0 < float(row[-1].rstrip("%"))  # MoE loses, dense saves at batch 1
