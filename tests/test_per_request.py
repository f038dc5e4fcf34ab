"""Energy and acceptance per request (refspec.energy.accounting.per_request), on ledgers built by hand and
through the engine: equal requests pay equal shares, a request alone pays a step's shared cost,
the split closes on the run's energy, per-position acceptance reproduces tau, and a request's
histogram is what its own verify decisions accepted."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny import save_hf, tiny_args

from refspec.energy.accounting.headline import account
from refspec.energy.ledger.events import PhaseEvent
from refspec.energy.ledger.read import read_ledger
from refspec.energy.ledger.writer import Ledger
from refspec.energy.meters.direct import RooflineMeter
from refspec.energy.meters.measurement import Measurement
from refspec.energy.model.hardware import H200_SXM
from refspec.energy.model.roofline import forward_cost
from refspec.energy.model.work import ForwardShape
from refspec.energy.accounting.per_request import (PARTS, PerRequestError, forward_parts, pooled_acceptance, rates, request_acceptance, split_energy)

ARGS = tiny_args("llama")
K = 2


def verify_fwd(rows: int, keys_per_row: int, s: int = K + 1) -> ForwardShape:
    """A static-batch verify: ``rows`` rows of ``s`` queries over a dense ``keys_per_row`` prefix."""
    return ForwardShape(args=ARGS, rows=rows, tokens_per_row=s, context_tokens=rows * keys_per_row, dtype_bytes=2,
                        lm_head_tokens=rows * s)


def prefill_fwd(lens) -> ForwardShape:
    """A packed prefill of prompts of ``lens`` (PLAN interface 1)."""
    n = sum(lens)
    return ForwardShape(args=ARGS, rows=len(lens), tokens_per_row=max(lens), context_tokens=n, dtype_bytes=2,
                        lm_head_tokens=len(lens), query_tokens=n, attention_pairs=sum(x * x for x in lens))


class Run:
    """Writes phase events of one hand-built run through the real :class:`Ledger`; energy is the
    H200 roofline's of the work unless a phase is given measured joules."""

    def __init__(self, path, batch: int) -> None:
        self.ledger, self.batch, self.clock = Ledger(path, run_id="r"), batch, 0.0
        self.meter = RooflineMeter(H200_SXM)

    def phase(self, step, phase, slots, lengths, work=(), *, energy=None, arrivals=(), **fields) -> None:
        self.meter.begin(phase)
        m = self.meter.end(phase, tuple(work))
        if energy is not None:  # a measured phase: its own joules, whatever its work
            m = Measurement(time_s=max(m.time_s, 1e-4), energy_j=energy, source="measured:hand")
        self.ledger(PhaseEvent(step=step, phase=phase, batch=self.batch, rows_active=sum(n > 0 for n in lengths),
                               work=tuple(work), measurement=m, slot_requests=tuple(slots),
                               row_lengths=tuple(lengths), arrivals_s=tuple(arrivals), clock_s=self.clock, **fields))
        self.clock += m.time_s

    def prefill(self, step, slots, lens) -> None:
        live = [n for n in lens if n]
        self.phase(step, "prefill", slots, lens, [prefill_fwd(live)], emitted=len(live),
                   arrivals=[self.clock if r >= 0 else -1.0 for r in slots],
                   emitted_per_row=tuple(int(n > 0) for n in lens))

    def step(self, step, slots, lengths, accepted, emitted, *, keys, commit_j=None, draft_j=None) -> None:
        """Draft (no forward), verify over ``keys`` per row, commit; ``accepted``/``emitted`` per slot."""
        active = sum(n > 0 for n in lengths)
        common = dict(k=K, emitted_per_row=tuple(emitted))
        self.phase(step, "draft", slots, lengths, energy=draft_j, drafted=active * K, **common)
        self.phase(step, "verify", slots, lengths, [verify_fwd(self.batch, keys)], verified=active * (K + 1),
                   accepted=sum(max(a, 0) for a in accepted), **common)
        self.phase(step, "commit", slots, lengths, energy=commit_j, accepted=sum(max(a, 0) for a in accepted),
                   emitted=sum(emitted), **common)

    def records(self):
        self.ledger.close()
        return read_ledger(self.ledger.path, strict=True)


def test_forward_parts_add_up_to_the_roofline_energy():
    for shape in (verify_fwd(4, 64), prefill_fwd([5, 40, 300]), verify_fwd(256, 4096)):  # memory- and compute-bound
        cost = forward_cost(shape)
        assert sum(forward_parts(shape, H200_SXM).values()) == pytest.approx(
            H200_SXM.energy_j(cost, H200_SXM.time_s(cost)), rel=1e-12)


def test_two_identical_requests_sharing_every_step_pay_equal_shares(tmp_path):
    run = Run(tmp_path / "l.jsonl", batch=2)
    run.prefill(-1, (0, 1), (8, 8))
    for step, (length, acc) in enumerate([(8, 2), (11, 1), (13, 0)]):
        run.step(step, (0, 1), (length + K + 1,) * 2, (acc, acc), (acc + 1,) * 2, keys=16, commit_j=0.5)
    split = split_energy(run.records(), ["r"], H200_SXM)
    a, b = split.requests[0], split.requests[1]
    assert a.energy_j == pytest.approx(b.energy_j, rel=1e-12) and a.energy_j > 0
    assert all(a.by_part_j[p] == pytest.approx(b.by_part_j[p], rel=1e-12) for p in PARTS)
    assert a.by_phase_j["commit"] == pytest.approx(3 * 0.25)  # a commit without forwards: shared equally
    assert sum(split.unattributed_j.values()) == pytest.approx(0.0, abs=1e-15) and split.closes


def test_a_longer_context_pays_more_keys_and_the_same_shared_cost(tmp_path):
    decode = Run(tmp_path / "d.jsonl", batch=2)
    decode.step(0, (0, 1), (4, 60), (0, 0), (1, 1), keys=64)
    short, long_ = (r.by_part_j for r in split_energy(decode.records(), ["r"], H200_SXM).requests.values())
    assert short["shared"] == pytest.approx(long_["shared"], rel=1e-12)
    assert short["tokens"] == pytest.approx(long_["tokens"], rel=1e-12)  # K + 1 positions each
    assert long_["keys"] / short["keys"] == pytest.approx(15, rel=1e-9)  # the keys each row attended
    prefill = Run(tmp_path / "p.jsonl", batch=2)
    prefill.prefill(-1, (0, 1), (4, 60))
    short, long_ = (r.by_part_j for r in split_energy(prefill.records(), ["r"], H200_SXM).requests.values())
    assert long_["tokens"] / short["tokens"] == pytest.approx(15, rel=1e-9)  # its prompt tokens
    assert long_["pairs"] / short["pairs"] == pytest.approx(225, rel=1e-9)  # S_i^2 pairs of a packed prefill


def test_a_request_alone_in_an_open_loop_step_pays_the_steps_shared_cost(tmp_path):
    run = Run(tmp_path / "l.jsonl", batch=4)
    run.prefill(-1, (-1, -1, 7, -1), (0, 0, 5, 0))
    run.step(0, (-1, -1, 7, -1), (0, 0, 5 + K + 1, 0), (-1, -1, 1, -1), (0, 0, 2, 0), keys=8)
    split = split_energy(run.records(), ["r"], H200_SXM)
    verify = forward_parts(verify_fwd(4, 8), H200_SXM)
    own = sum(verify[p] for p in PARTS if p != "shared") / 4  # one of four static rows did its work
    prefill = sum(forward_parts(prefill_fwd([5]), H200_SXM).values())
    assert split.requests[7].by_phase_j["verify"] == pytest.approx(verify["shared"] + own, rel=1e-12)
    assert split.requests[7].energy_j == pytest.approx(prefill + verify["shared"] + own, rel=1e-12)
    assert split.unattributed_j["idle_slots"] == pytest.approx(3 * own, rel=1e-12)  # the three empty slots
    assert split.closes


def _mixed_run(path):
    """Refills, unequal lengths, an idle slot, measured commits and drafts: a run to close on."""
    run = Run(path, batch=3)
    run.prefill(-1, (0, 1, 2), (5, 17, 9))
    run.step(0, (0, 1, 2), (8, 20, 12), (2, 0, 1), (3, 1, 2), keys=32, commit_j=0.3, draft_j=0.7)
    run.prefill(0, (-1, 3, -1), (0, 11, 0))  # request 1 finished (budget 2), request 3 refills its slot
    run.step(1, (0, 3, 2), (11, 14, 14), (1, 2, 0), (2, 3, 1), keys=32, commit_j=0.3, draft_j=0.6)
    run.step(2, (0, 3, -1), (13, 17, 0), (0, 2, -1), (1, 3, 0), keys=32, commit_j=0.2, draft_j=0.4)
    return run.records(), {0: [2, 1, 0], 1: [0], 2: [1, 0], 3: [2, 2]}


def test_requests_and_unattributed_close_on_the_runs_energy(tmp_path):
    records, _ = _mixed_run(tmp_path / "l.jsonl")
    split = split_energy(records, ["r"], H200_SXM)
    total = account(records).total_energy_j
    assert split.total_j == pytest.approx(total, rel=1e-12)
    assert sum(r.energy_j for r in split.requests.values()) + sum(split.unattributed_j.values()) == pytest.approx(
        total, rel=1e-12)
    assert split.closes and abs(split.closure_error_j) <= 1e-9 * total
    assert split.unattributed_j["idle_slots"] > 0 and set(split.requests) == {0, 1, 2, 3}
    for r in split.requests.values():  # by phase and by part are two views of one charge
        assert sum(r.by_phase_j.values()) == pytest.approx(r.energy_j) == pytest.approx(sum(r.by_part_j.values()))


def test_per_position_acceptance_reproduces_tau(tmp_path):
    records, accepted = _mixed_run(tmp_path / "l.jsonl")
    reqs = request_acceptance(records, ["r"], accepted)
    pooled = pooled_acceptance(reqs.values(), K)
    tau = account(records).tau
    # (request, step) accepting 0: (1,0),(2,1),(0,2); 1: (2,0),(0,1); 2: (0,0),(3,1),(3,2)
    assert pooled["histogram"] == [3, 2, 3]
    assert pooled["tau"] == pytest.approx(tau) and 1 + sum(pooled["per_position"]) == pytest.approx(tau)
    assert pooled["per_position"] == pytest.approx([5 / 8, 3 / 8])
    assert reqs[3].acceptance_length == 3.0 and reqs[0].histogram(K) == [1, 1, 1]
    assert rates(*reqs[0].position_counts(K)) == pytest.approx([2 / 3, 1 / 3])


def test_engine_counts_that_disagree_with_the_ledger_are_refused(tmp_path):
    records, accepted = _mixed_run(tmp_path / "l.jsonl")
    with pytest.raises(PerRequestError, match="request 3, step 1"):
        request_acceptance(records, ["r"], {**accepted, 3: [1, 2]})  # step 1 emitted 3 tokens: 2 accepted
    with pytest.raises(PerRequestError, match="2 verify steps"):
        request_acceptance(records, ["r"], {**accepted, 0: [2, 1]})


class RecordingAcceptance:
    """The engine's acceptance function, wrapped: accepts a seeded random 0..K drafts per row
    (so every count occurs) and keeps each step's decisions ``[B]``."""

    def __init__(self, seed: int = 0) -> None:
        self.decisions: list[list[int]] = []
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, draft, logits, sampling, generator):
        from refspec.step import accept_chain

        acc = accept_chain(draft, logits, sampling, generator)
        k = draft.tokens.shape[1]
        n = torch.randint(0, k + 1, acc.num_accepted.shape, generator=self.gen).to(acc.num_accepted)
        self.decisions.append(n.tolist())
        return dataclasses.replace(acc, num_accepted=n)


def test_through_the_engine_a_requests_histogram_is_its_own_verify_decisions(tmp_path):
    from refspec.drafters.ngram import NgramDrafter
    from refspec.engine import Engine, EngineConfig
    from refspec.models import load_model
    from refspec.serving import Request

    save_hf("llama", tmp_path / "m")
    model = load_model(tmp_path / "m")
    g = torch.Generator().manual_seed(1)
    reqs = [Request(id=i, prompt=tuple(torch.randint(3, 96, (n,), generator=g).tolist()), max_new_tokens=b)
            for i, (n, b) in enumerate(zip([5, 17, 3, 9, 12, 6], [9, 4, 14, 1, 7, 11]))]
    recorder = RecordingAcceptance()
    with Ledger(tmp_path / "l.jsonl", run_id="e") as ledger:
        res = Engine(model, NgramDrafter(max_n=3, trim=False), config=EngineConfig(k=3), observers=[ledger],
                     meter=RooflineMeter(H200_SXM), acceptance_fn=recorder).serve(reqs, batch=3)
    records = read_ledger(tmp_path / "l.jsonl", strict=True)
    ledger_steps = [r for r in records if r["kind"] == "phase" and r["phase"] == "commit"]
    assert len(ledger_steps) == len(recorder.decisions)
    own: dict[int, list[int]] = {q.id: [] for q in reqs}  # each decision goes to the request its slot held
    for rec, decided in zip(ledger_steps, recorder.decisions):
        for slot, (rid, n) in enumerate(zip(rec["slot_requests"], rec["row_lengths"])):
            if rid >= 0 and n > 0:
                own[rid].append(decided[slot])
    got = request_acceptance(records, ["e"], {q.id: q.accepted_per_step for q in res.requests})
    for rid, decisions in own.items():
        assert got[rid].histogram(3) == [decisions.count(i) for i in range(4)], f"request {rid}"
    assert sum(1 for d in own.values() if len(set(d)) > 1) >= 2, "the run exercised several counts"
    split = split_energy(records, ["e"], H200_SXM)
    assert split.closes and split.total_j == pytest.approx(account(records).total_energy_j, rel=1e-12)
    assert set(split.requests) == {q.id for q in reqs}


# ---- the CLI: record fields, the JSONL export, the report ----------------------------------------
from test_eval_cli import _base, one_thread, tiny  # noqa: E402,F401  (the tiny model and prompt file fixtures)


def test_run_writes_one_line_per_request_and_its_records_close(tiny, tmp_path, capsys):
    import json

    from refspec.eval import cli

    out, metrics = tmp_path / "run", tmp_path / "sub" / "requests.jsonl"
    rc = cli.main([*_base(tiny), "--batch", "3", "--requests", "5", "--meter", "roofline:h200", "--out", str(out),
                   "--per-request-metrics", str(metrics)])
    assert rc == 0 and f"wrote 10 per-request lines to {metrics}" in capsys.readouterr().out
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert [(x["config_id"], x["id"]) for x in lines] == [(r["config_id"], o["id"]) for r in summary
                                                          for o in r["request_outputs"]]
    assert all("prompt" not in x and "tokens" not in x and x["energy_j"] > 0 for x in lines)
    for r in summary:
        lost = sum(r["request_unattributed_j"].values())
        assert r["request_energy_closes"] and r["request_energy_sum_j"] + lost == pytest.approx(r["run_energy_j"])
        assert r["acceptance_tau_from_positions"] == pytest.approx(r["tau"])
        assert sum(o["output_tokens"] for o in r["request_outputs"]) == r["run_tokens"]
        assert sum(sum(o["accepted_hist"]) for o in r["request_outputs"]) == r["row_steps"]
    report = (out / "report.md").read_text()
    assert "What did my request cost in a batch of 3?" in report and "5 requests" in report
    assert (out / "request_energy.png").exists() and (out / "acceptance_hist.png").exists()


def test_a_per_request_metrics_path_that_is_a_directory_exits_2_before_any_run(tiny, tmp_path, capsys):
    from refspec.eval import cli

    rc = cli.main([*_base(tiny), "--out", str(tmp_path / "run"), "--per-request-metrics", str(tmp_path)])
    assert rc == 2 and "error: --per-request-metrics" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_the_documented_example():
    """docs/accounting.md section 7, by hand: section 6's verify forward split per request."""
    from test_roofline import TINY

    from refspec.energy.accounting.per_request import split_record

    shape = ForwardShape(args=TINY, rows=2, tokens_per_row=3, context_tokens=20, dtype_bytes=2)
    parts = forward_parts(shape, H200_SXM)
    assert [parts[p] for p in PARTS] == pytest.approx([2.409132e-3, 9.00762e-7, 4.42368e-8, 1.8432e-8, 2.90133e-7],
                                                      rel=1e-6)
    rec = {"step": 0, "phase": "verify", "energy_j": sum(parts.values()), "slot_requests": [0, 1],
           "row_lengths": [4, 10]}
    both, rest = split_record(rec, [shape], H200_SXM)
    assert sum(both[0].values()) == pytest.approx(1.205127e-3, rel=1e-6)
    assert sum(both[1].values()) == pytest.approx(1.205259e-3, rel=1e-6) and rest["idle_slots"] == pytest.approx(0)
    alone, rest = split_record({**rec, "slot_requests": [0, -1], "row_lengths": [4, 0]}, [shape], H200_SXM)
    assert sum(alone[0].values()) == pytest.approx(2.409759e-3, rel=1e-6)
    assert rest["idle_slots"] == pytest.approx(6.2678e-7, rel=1e-4)


def _counter_ledger(tmp_path, **kw):
    """test_attribution's hand-built counter run (one request at a time, host time between steps)."""
    import json

    from test_attribution import built

    records, _, w = built(**kw)
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return read_ledger(path, strict=True), w


def test_under_a_counter_the_host_time_is_a_named_item_and_the_residual_is_the_additivity_residual(tmp_path):
    from test_attribution import HOST_W, every_loop

    records, w = _counter_ledger(tmp_path, idle_w=HOST_W, loops=every_loop(verify=255.0))
    split = split_energy(records, ["r"], H200_SXM)
    acc = account(records, min_window_s=5.0)
    assert split.method == "attributed-loops" and split.total_j == pytest.approx(w["e"])
    # the host time priced at the header's idle power, as the accounting prices it
    assert split.unattributed_j["host"] == pytest.approx(HOST_W * w["gap"]) == pytest.approx(acc.attribution["host_j"])
    # what is left is the loops' misprice of verify (5 W too much): the additivity residual's joules
    assert split.closure_error_j == pytest.approx(acc.attribution["additivity_residual"] * w["e"])
    assert split.closes and split.tolerance == 0.05 and not split.split_gate_reasons
    assert sum(split.shares.values()) == pytest.approx(1.0) and split.shares["residual"] < 0


def test_a_split_that_failed_its_gate_charges_no_request_and_does_not_close(tmp_path):
    records, w = _counter_ledger(tmp_path, idle_w=40.0, steady=True)  # no loops, an undetermined fit
    split = split_energy(records, ["r"], H200_SXM)
    assert split.method == "measured-total-only" and not split.closes
    assert all(r.energy_j == 0.0 for r in split.requests.values())
    assert split.closure_error_j == pytest.approx(split.unattributed_j["host"] - w["e"])
    assert "the fit is undetermined" in split.split_gate_reasons[0]


def test_an_engine_run_under_a_counter_names_the_host_time(tmp_path):
    """Through the engine, a simulated counter on the modelled clock: its host gaps are the host item."""
    from tiny import TINY_HF

    from refspec.drafters.ngram import NgramDrafter
    from refspec.energy.ledger.counter_records import counter_ledger
    from refspec.energy.meters.make import make_meter
    from refspec.engine import Engine, EngineConfig
    from refspec.models.random_models import random_model
    from refspec.serving import Request

    model = random_model(dict(TINY_HF["llama"]), dtype=torch.float32)
    meter = make_meter("simulated:h200:period_ms=0.002:sample_ms=0.0005:noise=0.1:seed=3:sub_window_s=0.00002")
    reqs = [Request(id=i, prompt=tuple(range(3 + i, 9 + 2 * i)), max_new_tokens=b) for i, b in enumerate([20, 6, 14])]
    with counter_ledger(meter, Ledger(tmp_path / "l.jsonl", run_id="sim", idle_w=meter.idle_w)) as ledger:
        Engine(model, NgramDrafter(max_n=3, trim=False), config=EngineConfig(k=3), meter=meter,
               observers=[ledger]).serve(reqs, batch=2)
    records = read_ledger(tmp_path / "l.jsonl", strict=True)
    split = split_energy(records, ["sim"], H200_SXM)
    acc = account(records)
    assert split.total_j == pytest.approx(acc.total_energy_j, rel=1e-12)
    assert split.unattributed_j["host"] == pytest.approx(meter.idle_w * acc.attribution["host_s"])
    # milliseconds of run: no split can bear it, so no request is charged and closure fails, saying why
    assert split.method == "measured-total-only" and not split.closes and split.split_gate_reasons
