"""docs/tutorial.md quotes, exactly, what the command it names prints (scripts/energy_tutorial.py)."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from refspec.energy.accounting.serving_window import WindowRule

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "tutorial.md"
MARK = re.compile(r"<!-- tutorial: (\w+) -->\n```\n(.*?)\n```", re.S)
NUMBER = re.compile(r"(?<![\w.-])\d+\.\d+%?|(?<![\w.-])\d+%")  # decimals and percents, not names like 3.1-8B


def _script():
    spec = importlib.util.spec_from_file_location("energy_tutorial", ROOT / "scripts" / "energy_tutorial.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tutorial_quotes_what_its_command_prints():
    printed = _script().blocks()
    text = DOC.read_text()
    quoted = dict(MARK.findall(text))
    assert quoted.keys() == printed.keys(), "every block printed is quoted once, and nothing else"
    for name, block in printed.items():
        assert quoted[name] == block, f"docs/tutorial.md block {name!r} differs from the command's output"
    # every figure in the prose comes from the output (or is a rule the accounting applies)
    prose = MARK.sub("", text)
    allowed = "\n".join(printed.values()) + f" {WindowRule().min_fill:g}"
    stray = [n for n in NUMBER.findall(prose) if n not in allowed]
    assert not stray, f"figures in docs/tutorial.md that the command does not print: {stray}"


def _roofline_shares(records, profile):
    """Each phase's share when its records are priced by the roofline profile (the old simulator's truth)."""
    from refspec.energy.ledger.format import phase_work, run_models
    from refspec.energy.accounting.phase_energy import shares
    from refspec.energy.model.roofline import total_cost

    models = run_models(records, records[0]["run_id"])
    energy: dict[str, float] = {}
    for r in (r for r in records if r["kind"] == "phase"):
        energy[r["phase"]] = energy.get(r["phase"], 0.0) + profile.energy_j(total_cost(phase_work(r, models)),
                                                                            r["time_s"])
    return shares(energy)


def test_the_old_ways_fail_on_the_simulated_device_and_the_gate_says_when_the_new_one_cannot(tmp_path):
    import dataclasses

    t = _script()

    def off(a, b):
        return max(abs(a[p] - b[p]) for p in a)

    acc, records = t.run(tmp_path, "fixed", period_ms=100, sample_ms=25, seconds=20.0, k_of=lambda s: 4, loop_s=5.0)
    assert acc.phase_energy_method == "attributed-loops" and acc.attribution["split_gate"]["passed"]
    assert off(acc.phase_share, acc.phase_share_true) < 0.03, "the loops recover the truth within 3 points"
    assert off(acc.phase_share_naive, acc.phase_share_true) > 0.03, "a per-phase read does not"
    assert off(_roofline_shares(records, t.H200_SXM), acc.phase_share_true) > 0.03, "nor does the roofline's price"
    # power held up for 20 ms after a hungry phase: the isolated loops miss what the run's short phases
    # draw after verify, and the interleaved step shows it
    lag, _ = t.run(tmp_path, "lag", period_ms=100, sample_ms=25, seconds=20.0, k_of=lambda s: 4, loop_s=5.0,
                   law=dataclasses.replace(t.LAW, lag_s=20e-3))
    assert off(lag.attribution["loops_share"], lag.phase_share_true) > 0.03
    assert lag.phase_energy_method == "measured-total-only"
    assert any(r.startswith("interaction residual") for r in lag.attribution["split_gate"]["reasons"])
    # a counter period longer than the loops: refused for resolution
    slow, _ = t.run(tmp_path, "slow", period_ms=2000, sample_ms=500, seconds=20.0, k_of=lambda s: 4, loop_s=5.0)
    assert slow.phase_energy_method == "measured-total-only"
    assert "loop verify spans 5 s = 2.5 counter periods" in " ".join(slow.attribution["split_gate"]["reasons"])
