"""The paper command's parts, one behaviour each: acceptance forms, the counter's period, the
verdict rules, the plan against the lent machine's window, real-shape pricing, the tracked tree.
The whole command is rehearsed in tests/test_paper_rehearsal.py."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from refspec.eval.paper import acceptance, claims, grid
from refspec.eval.paper.bench import gpu_plan_profile, measure_period

ROOT = Path(__file__).resolve().parents[1]


# ---- acceptance ---------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["geometric:0.8", "vllm-eagle3-llama3.1-8b", str(acceptance.SMALL_FILE),
                                  str(acceptance.PUBLISHED_FILE)])
def test_every_accept_model_form_serves_both_drafters_at_the_grid_k(spec):
    src = acceptance.user_source(spec)
    for drafter, k in (("eagle", 3), ("block", 16)):
        m = acceptance.resolve(src, drafter, "conversation", k)
        assert m.k == k and 1.0 <= m.mean_tau <= k + 1


def test_published_file_is_the_cited_derivation():
    from refspec.eval.acceptance_models import published_models
    from refspec.eval.injection import load_acceptance_models

    shipped = load_acceptance_models(acceptance.PUBLISHED_FILE)
    assert [m.to_json() for m in shipped] == [m.to_json() for m in published_models()]
    eagle = acceptance.resolve(acceptance.PUBLISHED, "eagle", "code", 3)
    assert eagle.mean_tau == pytest.approx(2.79)  # vLLM's EAGLE-3 on Llama-3.1-8B at K 3
    taus = {c: acceptance.resolve(acceptance.PUBLISHED, "block", c, 16).mean_tau for c in ("conversation", "code")}
    assert taus == pytest.approx({"conversation": 3.36, "code": 3.52})
    assert all(m.provenance.source and m.provenance.kind == "derived" for m in shipped)


def test_small_level_is_the_smollm2_recording():
    m = acceptance.resolve(acceptance.SMALL, "block", "conversation", 16)
    assert m.provenance.source_model == "smollm2-135m" and m.provenance.kind == "measured"
    assert m.mean_tau < 1.2


def test_a_file_without_the_drafter_names_what_it_holds(tmp_path):
    from refspec.eval.acceptance_models import AcceptanceModelError, geometric_model
    from refspec.eval.injection import save_acceptance_models

    path = save_acceptance_models(tmp_path / "only_ngram.json", [geometric_model(0.5, 4)])
    with pytest.raises(AcceptanceModelError, match="no model for drafter block"):
        acceptance.resolve(acceptance.user_source(str(path)), "block", "code", 16)


def test_a_bad_accept_model_is_one_line_exit_2_before_any_work(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "refspec.eval", "paper", "--device", "cpu", "--accept-model",
                           "geometric:lots", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().startswith("error:") and len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("flags", [["--accept-model", "geometric:0.8"], ["--accept-model", "vllm-eagle3-llama3.1-8b"],
                                   ["--accept-file", str(acceptance.PUBLISHED_FILE)],
                                   ["--accept-model", str(acceptance.SMALL_FILE)]])
def test_every_accept_form_the_help_names_passes_the_checks_before_the_grid(flags):
    proc = subprocess.run([sys.executable, "-m", "refspec.eval", "paper", "--plan-only", *flags], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "block core" in proc.stdout


def test_ctrl_c_exits_130_and_keeps_the_tables_written_so_far(tmp_path):
    import signal
    import time

    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "refspec.eval", "paper", "--device", "cpu", "--quick", "--out",
                             str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # even under nohup &
    deadline = time.time() + 240
    while time.time() < deadline and not (out / "results.json").exists():
        time.sleep(0.5)
    while time.time() < deadline and not json.loads((out / "results.json").read_text())["variants"]:
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "complete up to the last finished variant" in err
    claims = json.loads((out / "claims.json").read_text())
    assert [c["claim"] for c in claims] == list(range(1, 8))  # the tables of the variants done so far


# ---- the counter's period ------------------------------------------------------------------------
class _SteppingCounter:
    """A counter that changes every ``period`` s of a fake clock advanced by each read."""

    def __init__(self, period: float, step: float) -> None:
        self.period, self.step, self.t = period, step, 0.0

    def read(self):
        from refspec.energy.meters.counters import CounterRead

        self.t += self.step
        value = float(int(self.t / self.period))
        return CounterRead(energy_j=value, devices={"gpu0": value}, wall_s=self.t)


def test_measure_period_finds_the_update_period():
    c = _SteppingCounter(period=0.02, step=0.001)
    period, changes = measure_period(c, seconds=0.5, sleep_s=0.0, clock=lambda: c.t)
    assert period == pytest.approx(0.02, rel=0.06) and changes >= 20


class _WallCounter:
    """A 100 W counter on the wall clock that updates every 20 ms (a fast NVML counter)."""

    source, period_s = "measured:fake-counter(gpu0)", 0.1  # the period assumed until measured

    def read(self):
        import time

        from refspec.energy.meters.counters import CounterRead

        t = time.perf_counter()
        value = 100.0 * (t // 0.02) * 0.02
        return CounterRead(energy_j=value, devices={"gpu0": value}, wall_s=t)

    def close(self) -> None:
        pass


def test_the_gpu_meter_is_sized_by_the_period_it_measures(monkeypatch):
    import types

    from refspec.energy.meters import make
    from refspec.eval.paper import bench

    monkeypatch.setattr(make, "measured_gpu_counter", lambda gpus: _WallCounter())
    meter, period, note = bench._gpu_meter(types.SimpleNamespace(min_window_s=5.0))
    assert period == pytest.approx(0.02, rel=0.2) and meter.period_s == period and note.startswith("measured")
    assert meter.sub_window_s == pytest.approx(10 * period) and meter.idle_w == pytest.approx(100.0, rel=0.05)


def test_windows_are_counted_in_periods():
    w = grid.Windows.for_period(0.1, 5.0)
    assert (w.window_s, w.loop_s, w.sub_window_s) == (5.0, pytest.approx(1.0), pytest.approx(1.0))
    assert grid.Windows.for_period(0.2, 5.0).window_s == pytest.approx(10.0)  # at least 50 periods


# ---- verdicts -----------------------------------------------------------------------------------
def test_a_difference_inside_the_spread_is_not_resolved():
    assert claims.compare((1.0, 0.1), (1.15, 0.1)) == claims.UNRESOLVED
    assert claims.compare((1.0, 0.05), (1.15, 0.05)) == claims.HOLDS
    assert claims.compare((1.3, 0.05), (1.15, 0.05)) == claims.FAILS


def _variant(arch, batch, drafter, source, j, spread=0.0, **more):
    summary = {"window_j_per_token": {"mean": j, "spread": spread, "n": 3}}
    summary.update({k: {"mean": v, "spread": 0.0, "n": 3} for k, v in more.items()})
    return {"arch": arch, "batch": batch, "drafter": drafter, "kind": drafter.split()[0], "k": 0 if drafter == "none"
            else 16, "source": source, "corpus": "conversation", "summary": summary, "window_valid": True}


def test_block_loss_past_the_ridge_holds_and_below_it_is_not_resolved():
    profile = gpu_plan_profile()
    vs = [_variant("a", 1, "none", grid.NONE_SOURCE, 1.0), _variant("a", 64, "none", grid.NONE_SOURCE, 0.1),
          _variant("a", 1, "block k16", "published", 0.4, verify_intensity_modelled=20.0),
          _variant("a", 64, "block k16", "published", 0.15, verify_intensity_modelled=900.0)]
    checks, cross = claims.claim5(vs, profile)
    loss = [c for c in checks if "ridge" in c["check"]]
    assert [c["verdict"] for c in loss] == [claims.HOLDS] and 1 < cross[0]["crossover_batch"] < 64
    vs[-1]["summary"]["verify_intensity_modelled"]["mean"] = 50.0
    assert [c["verdict"] for c in claims.claim5(vs, profile)[0] if "ridge" in c["check"]] == [claims.UNRESOLVED]


def test_claim6_compares_speculation_with_plain_decoding_at_equal_batch():
    # speculation at batch 1 is faster and cheaper than plain batch 1: the claim fails there, whatever plain
    # decoding at batch 64 costs (a premium across batches would be a batch effect)
    vs = [_variant("a", 1, "none", grid.NONE_SOURCE, 0.9, tpot_p99_s=3e-3),
          _variant("a", 1, "block k16", "published", 0.4, tpot_p99_s=1e-3),
          _variant("a", 64, "none", grid.NONE_SOURCE, 0.1, tpot_p99_s=4e-3)]
    out = claims.claim6(vs)
    assert [c["verdict"] for c in out] == [claims.FAILS, claims.HOLDS]
    assert "batch 1: block k16 meets a tighter p99 TPOT than plain decoding at the same batch" in out[0]["check"]
    # at batch 64 speculation is faster and dearer than plain batch 64: there the premium holds
    vs.append(_variant("a", 64, "block k16", "published", 0.15, tpot_p99_s=2e-3))
    assert [c["verdict"] for c in claims.claim6(vs)] == [claims.FAILS, claims.HOLDS, claims.HOLDS]
    # speculation that is not faster at its batch meets no tighter target: nothing to weigh there
    vs[-1]["summary"]["tpot_p99_s"]["mean"] = 5e-3
    assert [c["verdict"] for c in claims.claim6(vs)] == [claims.FAILS, claims.HOLDS]


def test_figures_from_fewer_than_three_repeats_or_an_invalid_window_are_not_compared():
    a, b = _variant("a", 1, "none", grid.NONE_SOURCE, 1.0), _variant("a", 64, "none", grid.NONE_SOURCE, 0.1)
    assert [c["verdict"] for c in claims.claim1([a, b])] == [claims.HOLDS]
    b["summary"]["window_j_per_token"]["n"] = 2
    assert [c["verdict"] for c in claims.claim1([a, b])] == [claims.UNRESOLVED]
    assert claims.notes([a, b])[0].startswith("figures over 2/3 repeats each") and "fewer than 3: not compared" in \
        claims.notes([a, b])[0]
    b["summary"]["window_j_per_token"]["n"] = 3
    b.update(window_valid=False, invalid_reasons=["window 0.2 s < 5 s"])
    assert [c["verdict"] for c in claims.claim1([a, b])] == [claims.UNRESOLVED]
    assert any("window INVALID" in n and "window 0.2 s < 5 s" in n for n in claims.notes([a, b]))
    assert claims.notes([a])[-1] == "every window valid (1 variants)"


def test_each_claim_names_its_evidence_and_a_modelled_run_says_its_verdicts_restate_the_model():
    from refspec.eval.paper.report import MODEL_BANNER, claims_markdown

    vs = [_variant("a", 1, "none", grid.NONE_SOURCE, 1.0), _variant("a", 64, "none", grid.NONE_SOURCE, 0.1)]
    kw = dict(profile=gpu_plan_profile(), tau_table=acceptance.tau_table(),
              published=acceptance.published_corpus_taus(), clocks_read_only=True, sources=lambda n: ["s"])
    modelled = claims.evaluate(vs, **kw)
    assert [c["evidence"] for c in modelled][:4] == [claims.MODEL, claims.MODEL, claims.MEASURED_ACCEPTANCE,
                                                     claims.MODEL]
    md = claims_markdown([{**c, "profile": "h200", "other_profiles": []} for c in modelled],
                         {"variants": vs, "skipped": [], "repeats": 3})
    assert MODEL_BANNER in md and "| 1 | **holds** | model consequence |" in md and "3 repeats per variant" in md
    measured = claims.evaluate([{**v, "measured": True} for v in vs], **kw)
    assert measured[0]["evidence"] == claims.MEASURED
    md = claims_markdown([{**c, "profile": "h200", "other_profiles": []} for c in measured],
                         {"variants": vs, "skipped": [], "repeats": 3})
    assert MODEL_BANNER not in md


def test_claim7_is_never_given_a_verdict_where_clocks_are_read_only():
    out = claims.evaluate([], profile=gpu_plan_profile(), tau_table=acceptance.tau_table(),
                          published=acceptance.published_corpus_taus(), clocks_read_only=True, sources=lambda n: [])
    assert [c["claim"] for c in out] == list(range(1, 8))
    assert out[6]["verdict"] == claims.NOT_HERE and "needs clock control" in out[6]["figures"]["checks"][0]["check"]
    assert out[2]["verdict"] == claims.HOLDS  # from the recorded tau table
    assert all(c["verdict"] in (claims.HOLDS, claims.FAILS, claims.UNRESOLVED, claims.NOT_HERE) for c in out)


# ---- the plan -----------------------------------------------------------------------------------
def test_the_gpu_plan_fits_540_s_with_install_and_closing_included():
    from refspec.eval.paper.cli import GPU_BUDGET_S, _check, _sources, parser

    args = parser().parse_args([])  # the default three repeats: fewer resolve no energy claim
    blocks = grid.select(args)
    taus = _check(args, blocks, _sources(args))
    plans = [grid.plan_block(b, gpu_plan_profile(), taus, windows=grid.Windows.for_period(0.1, 5.0),
                             repeats=args.repeats, prompt_len=args.prompt_len, new_tokens=args.new_tokens, host=True)
             for b in blocks]
    total = sum(grid.FIXED_GPU_S.values()) + sum(p["planned_s"] for p in plans)
    assert args.repeats >= 3
    assert total <= GPU_BUDGET_S + grid.FIXED_GPU_S["install (shell)"] <= 540.0  # the device call's limit
    assert {b.arch for b in blocks} == {"llama-3.1-8b", "qwen3-8b"}  # two attention families
    runs = [v for p in plans for s in p["shapes"] for v in s["variants"]]
    assert all(v["requests"] >= 2 and v["seconds"] >= 5.0 for v in runs)  # windows of at least 5 s


def test_plan_only_prints_every_stage():
    proc = subprocess.run([sys.executable, "-m", "refspec.eval", "paper", "--plan-only"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for stage in ("install (shell)", "block core (llama-3.1-8b)", "block family2 (qwen3-8b)", "total"):
        assert stage in proc.stdout


# ---- real-shape pricing -------------------------------------------------------------------------
def test_a_toy_target_forward_is_priced_as_the_real_one():
    import torch

    from refspec.energy.model.roofline import forward_cost
    from refspec.energy.model.work import ForwardShape, WorkRecorder
    from refspec.eval.paper.targets import TOY, RealShapes
    from refspec.models.random_models import arch_args, random_model, shrunk_config

    toy = random_model(shrunk_config("llama-3.1-8b", **TOY), dtype=torch.float32)
    real = arch_args("llama-3.1-8b")
    with WorkRecorder() as rec:
        cache = toy.new_cache(2, 16)
        toy(torch.zeros(2, 3, dtype=torch.long), torch.arange(3).expand(2, 3), cache, num_keys=16)
    mapped = RealShapes(toy.args, real).shape(rec.work[0])
    want = ForwardShape(args=real, rows=2, tokens_per_row=3, context_tokens=32, dtype_bytes=2, lm_head_tokens=6)
    assert forward_cost(mapped) == forward_cost(want)
    assert forward_cost(mapped).weight_bytes > 15e9  # all 32 layers and the 128k vocabulary, bf16


# ---- what the lent machine receives -------------------------------------------------------------
def test_tracked_tree_stays_below_50_mb():
    # what the device tool sends is what git tracks: the suite runs from a clone (README)
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    files = [ROOT / f for f in out.decode().split("\0") if f]
    total = sum(f.stat().st_size for f in files if f.is_file())
    assert total < 50_000_000, f"tracked tree is {total / 1e6:.1f} MB; the lent GPU receives at most 64 MiB"


def test_nothing_in_the_command_can_set_a_clock():
    from refspec.energy.meters import dvfs

    sweep = re.escape(dvfs.__name__)  # the module that locks clocks, wherever it lives
    setter = re.compile(r"SetApplicationsClocks|SetGpuLockedClocks|SetPowerManagementLimit|ResetGpuLockedClocks|"
                        rf"set_gpu_locked_clocks|set_power_management_limit|import .*{sweep}|from {sweep}|"
                        r"nvidia-smi +-(lgc|pl|r)")
    assert setter.search(f"from {dvfs.__name__} import dvfs_sweep")
    files = [*sorted((ROOT / "eval" / "paper").glob("*.py")), ROOT / "scripts" / "gpu_check.sh"]
    hits = [f.name for f in files if setter.search(f.read_text())]
    assert files and not hits
