"""The GPU check's grid, plan, claim tables, plots and serving window, on hand-made inputs (no run)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check  # noqa: E402
from gpucheck import claims, grid, outputs  # noqa: E402


# ---- the grid, its plan, its claims -------------------------------------------------------------
def test_drafter_specs_and_bad_grid_flags(tmp_path):
    assert grid.parse_drafters("none:0, eagle:3,block:16") == (grid.NONE, grid.EAGLE3, grid.BLOCK16)
    for bad in ("eagle:0", "none:2", "medusa:3", "block:x"):
        with pytest.raises(ValueError, match="--drafters"):
            grid.parse_drafters(bad)
    assert gpu_check.main(["--dry-run", "--skip-tests", "--out", str(tmp_path), "--drafters", "eagle:0"]) == 2
    assert gpu_check.main(["--dry-run", "--skip-tests", "--out", str(tmp_path), "--blocks", "nope"]) == 2


def test_the_gpu_plan_fits_the_default_budget_most_important_block_first():
    import dataclasses

    from gpucheck.drafting import recorded_taus
    from refspec.energy.roofline import get_profile

    h200 = dataclasses.replace(get_profile("h200"), peak_flops=780e12, bandwidth_Bps=4.3e12)
    taus = recorded_taus(None, grid.CORPORA)
    assert set(taus) == {(d, c) for d in ("eagle", "block") for c in grid.CORPORA}
    plans = [grid.plan_block(b, h200, taus, prompt_len=512, new_tokens=128, loop_s=2.0, dry=False)
             for b in grid.GPU_BLOCKS]
    assert plans[0]["block"] == "core" and plans[0]["planned_s"] == max(p["planned_s"] for p in plans)
    fixed = sum(s for name, s in gpu_check.FIXED_PLAN_S.items() if name != "install (sh)")
    required = [p for p, b in zip(plans, grid.GPU_BLOCKS) if b.needs is None]  # the optional MoE block may be cut
    assert fixed + sum(p["planned_s"] for p in required) <= gpu_check.parse_args([]).budget_s
    first = plans[0]["points"]
    assert first[0]["planned_s"] > first[5]["planned_s"]  # the second corpus reuses the captured graphs


def _pt(batch, label, j, corpus="conversation", tau=2.0):
    name, _, k = label.partition(" k") if "eagle" in label else label.partition(" ")
    k = int(k or 0)
    return {"arch": "a", "batch": batch, "k": k, "drafter": name or label, "drafter_label": label,
            "corpus": corpus if k else None, "j_per_token": j, "tau_observed": tau, "runner_mode": "graphs"}


def test_saving_crossover_and_claim_verdicts_from_exact_points():
    pts = [_pt(1, "none", 1.0), _pt(4, "none", 0.5), _pt(16, "none", 0.2),
           _pt(1, "block 8", 0.8), _pt(4, "block 8", 0.45), _pt(16, "block 8", 0.22)]
    assert [claims.saving(p, pts) for p in pts[3:]] == pytest.approx([0.2, 0.1, -0.1])
    assert claims._crossing([1, 4, 16], [0.2, 0.1, -0.1]) == pytest.approx(8.0)  # halfway in log batch
    assert claims._crossing([1, 4], [0.2, 0.1]) is None and claims._crossing([1, 4], [-0.1, -0.2]) == 1.0
    assert "holds for 1 of 1 series" in claims.claim2(pts) and "holds for 1 of 1 series" in claims.claim3(pts)
    assert "1 turned a saving at the smallest batch into a loss; 0 lost at every batch" in claims.claim3(pts)
    losing = pts[:3] + [_pt(b, "block 8", j * 2) for b, j in ((1, 1.0), (4, 0.5), (16, 0.2))]
    assert "0 turned a saving" in claims.claim3(losing) and "1 lost at every batch" in claims.claim3(losing)
    gains = pts[:3] + [_pt(b, "block 8", j * 0.5) for b, j in ((1, 1.0), (4, 0.5), (16, 0.2))]
    assert "holds for 0 of 1 series" in claims.claim3(gains)  # still a saving at batch 16


def test_plot_legends_name_their_source_and_never_call_a_model_measured(tmp_path, monkeypatch):
    import matplotlib.figure

    labels = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: labels.extend(
        t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()))

    def point(batch, label, j, source):
        p = _pt(batch, label, j)
        p.update(energy_source=source, predicted_j_per_token=j / 2, predicted_step_time_s=0.01,
                 step_time_s={"mean": 0.02}, phase_energy={"split": {"loops_share": {"draft": 0.3, "verify": 0.7}}})
        return p

    for source, word in (("modelled:roofline(h200-sxm)", "MODELLED (roofline(h200-sxm))"),
                         ("measured:nvml-total-energy(gpu0)", "measured (nvml-total-energy(gpu0))")):
        labels.clear()
        pts = [point(b, lab, j, source) for b, lab, j in ((1, "none", 1.0), (4, "none", 0.5), (1, "eagle k3", 0.8),
                                                          (4, "eagle k3", 0.6))]
        assert len(outputs.make_plots(pts, [], tmp_path, "t")) == 4
        energy = [t for t in labels if "modelled (roofline" not in t and "(wall)" not in t]
        assert energy and all(word in t for t in energy), energy
        if source.startswith("modelled"):
            assert not any("measured" in t and "wall" not in t for t in labels)


def test_serving_stream():  # its window is the accounting's: tests/test_gpu_check_serving.py
    import argparse

    from gpucheck import serving

    args = argparse.Namespace(seed=0, new_tokens=8, prompt_len=5)
    reqs = serving.stream(6, args, vocab=100)
    assert len(reqs) == 9 and [r.id for r in reqs] == list(range(9))  # 3B/2 requests, closed loop
    assert all(4 <= r.max_new_tokens <= 12 and len(r.prompt) == 5 and r.arrival_s is None for r in reqs)
    assert len({r.prompt for r in reqs}) == 9 and len(serving.stream(1, args, vocab=100)) == 4
