"""Speculation policies: specs, the fixed-rule policies, the acceptance estimate and the energy
policy's choice on hand-built cases (H200 profile, Llama-3.1-8B shapes)."""
from __future__ import annotations

import pytest
import torch

from refspec.drafters.ngram import NgramDrafter
from refspec.drafting import DecodeState, DrafterError
from refspec.energy.model.architectures import arch
from refspec.energy.model.hardware import H200_SXM
from refspec.energy.model.roofline import EAGLE_HEAD, predict_step
from refspec.policy import FixedK, KByBatch, OffAbove, PolicySpecError, parse_policy
from refspec.policy_energy import (AcceptanceTracker, EnergyPolicy, KOption, RooflineStepCost, cheapest,
                                   default_ks)
from refspec.policy_protocol import StepView
from refspec.sampling import SamplingConfig

LLAMA8B = arch("llama-3.1-8b")


def _view(active, batch=None, length_bound=512, requests=None):
    batch = batch or active
    requests = tuple(range(active)) + (-1,) * (batch - active) if requests is None else tuple(requests)
    return StepView(step=0, batch=batch, active=active, max_k=4, length_bound=length_bound, slot_requests=requests)


# ---- specs and the fixed-rule policies ------------------------------------------------------------
@pytest.mark.parametrize("text, name", [("fixed", "fixed"), ("off-above:32", "off-above:32"),
                                        ("k-by-batch:8=4,1=7,64=0,32=2", "k-by-batch:1=7,8=4,32=2,64=0"),
                                        ("energy", "energy"), ("energy:tpot_ms=50", "energy:tpot_ms=50"),
                                        ("ENERGY:tpot_ms=12.5", "energy:tpot_ms=12.5")])
def test_specs_parse_to_their_canonical_names(text, name):
    assert parse_policy(text).name == name


@pytest.mark.parametrize("text", ["", "fast", "fixed:3", "off-above", "off-above:x", "off-above:-1",
                                  "k-by-batch:", "k-by-batch:1=7,1=3", "k-by-batch:0=2", "k-by-batch:4",
                                  "energy:tpot_ms=0", "energy:tpot=5", "energy:tpot_ms=inf"])
def test_bad_specs_are_refused_with_what_is_accepted(text):
    with pytest.raises(PolicySpecError, match="--spec-policy"):
        parse_policy(text)


def test_fixed_rule_policies_choose_by_active_rows():
    assert [FixedK(3).choose(_view(n)) for n in (1, 64)] == [3, 3]
    off = OffAbove(4, 8)
    assert [off.choose(_view(n, batch=64)) for n in (1, 8, 9, 64)] == [4, 4, 0, 0] and off.ks == (0, 4)
    table = KByBatch([(1, 7), (8, 4), (32, 2), (64, 0)])
    assert [table.choose(_view(n, batch=64)) for n in (1, 7, 8, 31, 32, 63, 64)] == [7, 7, 4, 4, 2, 2, 0]
    assert KByBatch([(4, 2), (16, 0)]).choose(_view(2)) == 2, "below the first entry: the first entry's K"
    assert parse_policy("k-by-batch:1=7,64=0").max_k(4) == 7


def test_the_engine_refuses_a_policy_asking_for_more_than_its_k(tiny_models):
    from refspec.engine import Engine, EngineConfig, GenerationError

    with pytest.raises(GenerationError, match="outside"):
        Engine(tiny_models["llama"], NgramDrafter(), config=EngineConfig(k=4), policy=KByBatch([(1, 7)]))


# ---- the n-gram drafter drafts K whenever asked ---------------------------------------------------
def _ngram_state(rows):
    t = max(map(len, rows)) + 8
    tokens = torch.zeros(len(rows), t, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
    lengths = torch.tensor([len(r) - 1 for r in rows])  # the last token of each row is pending
    z = torch.zeros(len(rows), dtype=torch.long)
    return DecodeState(tokens=tokens, lengths=lengths, prev_lengths=lengths,
                       pending=tokens[torch.arange(len(rows)), lengths], prompt_lengths=lengths,
                       done=torch.zeros(len(rows), dtype=torch.bool), hidden=[], num_accepted=z,
                       sampling=SamplingConfig(), generator=None, step=0, max_length_bound=int(lengths.max()) + 1,
                       target_args=None, dtype_bytes=4)


def test_ngram_drafts_every_position_it_is_asked_for():
    # row 0: suffix "7 8" occurred before, followed by "9 1" then the suffix itself: 4 known tokens
    # row 1: suffix "3" occurred before, followed by "4" only (then the pending token); row 2: no match
    rows = [[7, 8, 9, 1, 7, 8], [5, 3, 4, 3], [1, 2, 3, 6]]
    for k in (1, 6):
        draft = NgramDrafter(max_n=2).propose(_ngram_state(rows), k).tokens
        assert draft.tolist() == [[9, 1, 7, 8, 8, 8][:k], [4, 3, 3, 3, 3, 3][:k], [6] * k]
    assert NgramDrafter(max_n=2, min_n=2).propose(_ngram_state(rows), 2).tokens.tolist()[1] == [3, 3]
    with pytest.raises(DrafterError, match="spec-policy"):
        NgramDrafter(trim=True)
    with pytest.raises(DrafterError, match="min_n"):
        NgramDrafter(max_n=2, min_n=3)


# ---- acceptance estimates -------------------------------------------------------------------------
def test_tracker_counts_tried_and_accepted_positions_per_request():
    t = AcceptanceTracker(4, 0.5, prior_weight=2.0, request_weight=2.0, optimism=0.0)
    # slot 0 (request 7) accepted 2 of 4: tried 1..3, accepted 1..2; slot 1 empty; slot 2 (request 9) 4 of 4
    t.observe(4, [2, -1, 4], [7, -1, 9])
    assert t.tried == [2.0, 2.0, 2.0, 1.0] and t.accepted == [2.0, 2.0, 1.0, 1.0]
    running = t.running()
    assert running[0] == pytest.approx((2 + 1) / (2 + 2)) and running[2] == pytest.approx((1 + 1) / (2 + 2))
    own = t.rates(7)
    assert own[2] == pytest.approx((0 + 2 * running[2]) / (1 + 2)), "request 7 rejected position 3"
    assert t.rates(123) == running, "an unseen request starts from the running estimate"
    assert t.probed(7) and not t.probed(123)
    tokens = t.expected_tokens(9, (0, 1, 2))
    r = t.rates(9)
    assert tokens == pytest.approx({0: 1.0, 1: 1 + r[0], 2: 1 + r[0] + r[0] * r[1]})
    t.observe(0, [0, -1], [9, -1])  # a K = 0 step teaches nothing; request 7 left its slot
    assert t.tried == [2.0, 2.0, 2.0, 1.0] and not t.probed(7) and t.probed(9)


def test_optimism_keeps_a_request_drafting_past_its_first_rejection():
    """A step without drafts teaches nothing, so one rejected draft must not end a request's
    drafting: with a pseudo-acceptance it drafts until a run of rejections outweighs it."""
    ks = {}
    for optimism in (0.0, 1.0):
        policy, ks[optimism] = _energy(0.3, optimism=optimism), []
        for _ in range(6):  # one active row among 16 slots: drafting is near break-even here
            ks[optimism].append(cheapest(policy.options(_view(1, batch=16))).k)
            policy.tracker.observe(1, [0], [0])  # the request rejects every draft
    assert ks[0.0] == [1, 0, 0, 0, 0, 0]
    assert ks[1.0][:3] == [1, 1, 1] and ks[1.0][-1] == 0
    t = AcceptanceTracker(2, 0.5, prior_weight=1e9, request_weight=2.0, optimism=1.0)
    assert t.rates(5) == pytest.approx([(2 * 0.5 + 1) / 3] * 2), "an unseen request: running estimate and optimism"


def test_running_estimate_converges_to_the_true_acceptance():
    g = torch.Generator().manual_seed(0)
    t = AcceptanceTracker(4, 0.5)
    for step in range(2000):  # geometric acceptance a = 0.8 per position
        draws = (torch.rand(8, 4, generator=g) < 0.8).long()
        accepted = draws.cumprod(1).sum(1).tolist()
        t.observe(4, accepted, list(range(step * 8, step * 8 + 8)))
    assert t.running() == pytest.approx([0.8] * 4, abs=0.02)


# ---- the energy policy ----------------------------------------------------------------------------
def _energy(a, *, tpot_ms=None, k=4, profile=H200_SXM, optimism=0.0):
    cost = RooflineStepCost(LLAMA8B, profile, drafter=EAGLE_HEAD, dtype_bytes=2)
    return EnergyPolicy(k=k, cost=cost, tpot_ms=tpot_ms, prior=a, optimism=optimism)


def test_step_cost_equals_the_roofline_prediction_of_the_step():
    cost = RooflineStepCost(LLAMA8B, H200_SXM, drafter=EAGLE_HEAD, dtype_bytes=2, kv_bucket=1)
    for batch, k in ((1, 0), (1, 4), (64, 2)):
        time_s, energy_j = cost(batch, k, 513)  # 512 tokens committed in the longest row
        p = predict_step(LLAMA8B, H200_SXM, batch=batch, k=k, context=512, acceptance=0.5, drafter=EAGLE_HEAD)
        assert (time_s, energy_j) == pytest.approx((p.step_time_s, p.step_energy_j), rel=1e-12)


def test_roofline_policy_table_picks_the_least_j_per_token_of_the_prediction_table():
    from refspec.eval.roofline_cli import prediction_table
    from refspec.eval.roofline_policy import policy_rows

    kw = dict(batches=[1, 8, 64, 512], ks=[0, 1, 2, 4, 7], acceptances=[0.3, 0.6, 0.9], context=512,
              drafter=EAGLE_HEAD, dtype_bytes=2)
    chosen = {(r["acceptance"], r["batch"]): r for r in policy_rows(LLAMA8B, H200_SXM, **kw)}
    table = prediction_table(LLAMA8B, H200_SXM, **kw)
    for (a, b), r in chosen.items():
        cells = [t for t in table if t["acceptance"] == a and t["batch"] == b]
        best = min(cells, key=lambda t: (t["j_per_token"], t["k"]))
        assert r["k"] == best["k"] and r["j_per_token"] == pytest.approx(best["j_per_token"])
    assert chosen[(0.9, 1)]["k"] == 7 and chosen[(0.3, 512)]["k"] == 0


def test_high_acceptance_drafts_at_batch_one_on_an_h200():
    policy = _energy(0.8)
    opts = policy.options(_view(1))
    best = cheapest(opts)
    assert best.k == 4, [(o.k, o.j_per_token) for o in opts]
    assert best.j_per_token < 0.5 * opts[0].j_per_token, "memory-bound: 3.4 tokens for about one weight read"


@pytest.mark.parametrize("active, a, context", [(1024, 0.6, 64), (128, 0.3, 512), (1, 0.02, 512)])
def test_large_batch_or_low_acceptance_decodes_plainly(active, a, context):
    """Compute-bound verification (1024 rows of short context), or drafts rarely accepted."""
    policy = _energy(a)
    # every request has drafted once (no probe), a of them accepted
    hits = [int(i < round(a * active)) for i in range(active)]
    policy.observe(1, hits, list(range(active)))
    assert policy.choose(_view(active, length_bound=context + 1)) == 0
    opts = policy.last
    assert min(opts, key=lambda o: o.j_per_token).k == 0


@pytest.mark.parametrize("active", [1, 8, 32, 64, 256])
@pytest.mark.parametrize("a", [0.3, 0.6, 0.9])
def test_the_choice_is_the_least_predicted_j_per_token(active, a):
    policy = _energy(a)
    policy.observe(1, [1] * active, list(range(active)))
    k = policy.choose(_view(active))
    by_k = {o.k: o for o in policy.last}
    assert by_k[k].j_per_token == pytest.approx(min(o.j_per_token for o in policy.last))
    # the same from the roofline's own step prediction (free of the drafter's per-request counts)
    tokens = {kk: o.tokens / active for kk, o in by_k.items()}
    assert all(o.time_s > 0 and o.energy_j > 0 and tokens[kk] >= 1 for kk, o in by_k.items())


def test_the_tpot_target_is_respected():
    """At batch 64 (acceptance 0.7) the least J/token is not the fastest K (each verified
    position costs its FLOPs' energy, not time); a TPOT target between theirs moves the choice to
    the cheapest K that meets it; an impossible one to the fastest."""
    free = _energy(0.7)
    free.observe(1, [1] * 64, list(range(64)))
    free.choose(_view(64))
    best, fastest = cheapest(free.last), min(free.last, key=lambda o: o.tpot_s)
    assert best.k != fastest.k and best.tpot_s > fastest.tpot_s, "the cheapest K is not the fastest here"
    target_s = (best.tpot_s + fastest.tpot_s) / 2
    tight = _energy(0.7, tpot_ms=target_s * 1e3)
    tight.observe(1, [1] * 64, list(range(64)))
    k = tight.choose(_view(64))
    chosen = {o.k: o for o in tight.last}[k]
    meeting = [o for o in tight.last if o.tpot_s <= target_s]
    assert k != best.k and chosen.tpot_s <= target_s
    assert chosen.j_per_token == min(o.j_per_token for o in meeting)
    impossible = _energy(0.7, tpot_ms=1e-6)
    impossible.observe(1, [1] * 64, list(range(64)))
    k = impossible.choose(_view(64))
    assert {o.k: o for o in impossible.last}[k].tpot_s == min(o.tpot_s for o in impossible.last), "else the fastest"


def test_cheapest_breaks_ties_to_the_smaller_k():
    opts = [KOption(k=k, time_s=1.0, energy_j=2.0, tokens=2.0, active=1) for k in (0, 1, 2)]
    assert cheapest(opts).k == 0


def test_a_request_that_never_drafted_is_probed_only_where_a_probe_is_cheap():
    """At batch 1 with a pessimistic prior the best K is 0; K = 1 costs little more on an H200
    (memory-bound), so an unprobed request is probed once, then the estimate decides."""
    policy = _energy(0.05)
    assert policy.choose(_view(1)) == 1, "probe"
    policy.observe(1, [0], [0])
    assert policy.choose(_view(1)) == 0, "probed and rejected: plain decoding"
    big = _energy(0.05)
    assert big.choose(_view(512)) == 0, "a compute-bound probe costs too much"


def test_default_ks_are_a_small_set():
    assert default_ks(4) == (0, 1, 2, 3, 4)
    assert default_ks(16) == (0, 1, 2, 4, 8, 16)


def test_the_predicted_step_is_what_a_roofline_meter_charges(tiny_models):
    """Through the engine on a tiny target: each step's predicted time and energy (the target's
    own verify shape, a free drafter) equal what an H200 roofline meter charged its phases."""
    from refspec.energy.meters.direct import RooflineMeter
    from refspec.engine import Engine, EngineConfig

    m = tiny_models["llama"]
    cost = RooflineStepCost(m.args, H200_SXM, drafter=None, dtype_bytes=4, verify_shape=m.forward_shape, kv_bucket=16)

    class Cycling:
        name, ks, views = "cycling", (0, 1, 3), []

        def choose(self, view):
            self.views.append(view)
            return (3, 0, 1)[view.step % 3]

        def observe(self, k, accepted, slot_requests):
            pass

    seen, policy = [], Cycling()
    Engine(m, NgramDrafter(), config=EngineConfig(k=3, kv_bucket=16), meter=RooflineMeter(H200_SXM), policy=policy,
           observers=[seen.append]).generate([[5, 6, 7, 8], [9, 10] * 10], max_new_tokens=12)
    steps = {}
    for e in seen:
        if e.phase in ("draft", "verify"):
            t, j = steps.get(e.step, (0.0, 0.0))
            steps[e.step] = (t + e.measurement.time_s, j + e.measurement.energy_j)
    assert len(steps) == len(policy.views) >= 4
    for view in policy.views:
        k = (3, 0, 1)[view.step % 3]
        assert cost(view.batch, k, view.length_bound) == pytest.approx(steps[view.step], rel=1e-9)


def test_time_calibration_scales_each_k_by_what_it_measured():
    from refspec.policy_energy import REPROBE_EVERY, TimeCalibration

    cal = TimeCalibration((0, 1, 2, 4))
    assert cal.ratio(2) == 1.0 and cal.due(0) == 0, "nothing measured: the roofline as it is; explore K = 0 first"
    cal.add(0, 0, 3.0, 1.0)
    assert cal.ratio(4) == 3.0 and cal.due(1) == 4, "then the largest K; meanwhile the nearest measured scale"
    cal.add(4, 1, 7.0, 1.0)
    cal.add(4, 2, 9.0, 1.0)
    assert cal.ratio(0) == 3.0 and cal.ratio(4) == 8.0
    assert cal.ratio(1) == pytest.approx(3.0 + 5.0 / 4) and cal.ratio(2) == pytest.approx(3.0 + 5.0 / 2), "interpolated"
    assert cal.due(3) is None, "the middle K are interpolated, not explored"
    cal.add(1, 3, 4.0, 1.0)
    assert cal.ratio(1) == 4.0 and cal.ratio(2) == pytest.approx(4.0 + 4.0 / 3), "now from K = 1 and K = 4"
    assert cal.due(REPROBE_EVERY - 1) is None and cal.due(REPROBE_EVERY) == 0, "a measured K gone stale"


class _Phase:
    def __init__(self, step, phase, time_s):
        from refspec.energy.meters.measurement import Measurement

        self.step, self.phase, self.measurement = step, phase, Measurement(time_s=time_s, energy_j=None, source="t")


def test_a_measured_run_decides_by_the_time_it_measured():
    """The roofline prices every K alike (so it would draft 4), but the run measures a step of K
    at 1 + K s: after measuring each K the policy decodes plainly, and keeps doing so."""
    cost = lambda batch, k, length_bound: (1.0, 1.0)  # noqa: E731  1 s, 1 J (all static at 1 W) for any K
    modelled = EnergyPolicy(k=4, cost=cost, prior=0.5, static_w=1.0)
    modelled.observe(1, [1], [0])
    assert modelled.choose(_view(1)) == 4
    policy = EnergyPolicy(k=4, cost=cost, prior=0.5, measured=True, static_w=1.0)
    chosen = []
    for step in range(40):
        k = policy.choose(StepView(step=step, batch=1, active=1, max_k=4, length_bound=9, slot_requests=(0,)))
        chosen.append(k)
        for phase, share in (("draft", 0.1), ("verify", 0.8), ("commit", 0.1)):
            policy.on_event(_Phase(step, phase, share * (1.0 + k)))
        policy.observe(k, [min(k, 1)], [0])
    assert chosen[:2] == [0, 4], "the smallest and largest K measured at the start"
    assert set(chosen[2:]) == {0}
    by_k = {o.k: o for o in policy.last}
    assert by_k[4].time_s == pytest.approx(5.0) and by_k[4].energy_j == pytest.approx(5.0)
    assert by_k[2].time_s == pytest.approx(3.0), "interpolated between the measured K = 0 and K = 4"


def test_roofline_cli_prints_the_k_the_energy_policy_picks(capsys):
    from refspec.eval.roofline_cli import main

    assert main(["--policy", "energy", "--batch", "1,1024", "--k", "0,4", "--acceptance", "0.9,0.1"]) == 0
    out = capsys.readouterr().out
    import re

    row = {line.split()[0]: re.findall(r"(\d+) \(", line) for line in out.splitlines()
           if line.strip().startswith(("0.90", "0.10"))}
    assert row == {"0.90": ["4", "0"], "0.10": ["0", "0"]}, out
    assert main(["--policy", "energy:tpot_ms=1e-9", "--batch", "8", "--k", "0,4", "--acceptance", "0.5"]) == 0
    assert "!" in capsys.readouterr().out, "no K meets an impossible target: marked"
    assert main(["--policy", "fixed"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --policy")


def test_on_a_mixed_stream_the_policy_is_never_above_the_best_fixed_k():
    """Modelled: per-step K for the rows at hand beats one K for every composition, most at batch
    1 (a request's own K) and not at all when both kinds of request accept alike."""
    from refspec.eval.roofline_policy import mixed_rows

    kw = dict(batches=[1, 8, 64], ks=[0, 1, 2, 4, 7], context=512, drafter=EAGLE_HEAD, dtype_bytes=2)
    rows = mixed_rows(LLAMA8B, H200_SXM, mix=(0.9, 0.2), **kw)
    assert all(r["policy"] <= min(r["fixed"].values()) * (1 + 1e-12) for r in rows)
    assert rows[0]["vs_best"] < -0.05 and rows[0]["vs_best"] < rows[-1]["vs_best"] <= 0
    same = mixed_rows(LLAMA8B, H200_SXM, mix=(0.6, 0.6), **kw)
    assert all(r["vs_best"] == pytest.approx(0.0, abs=1e-12) for r in same)


def test_optimism_is_shared_by_the_rows_of_a_step():
    t = AcceptanceTracker(1, 0.3, prior_weight=1e9, request_weight=2.0, optimism=1.0)
    assert t.rates(0) == pytest.approx([(0.6 + 1) / 3])
    assert t.rates(0, shared=8) == pytest.approx([(0.6 + 1 / 8) / (2 + 1 / 8)]), "at batch 8 an eighth each"
