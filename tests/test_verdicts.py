"""Load-aware CPU verdicts: a comparison whose baseline ran under other load, or far slower than modelled, is
marked unreliable in the table, the verdict line and summary.json; every verdict names its energy source."""
from __future__ import annotations

import json

import pytest
import torch

from eval_records import record
from refspec.eval import cli
from refspec.eval.baseline import attach_baselines
from refspec.eval.load import MAX_TIME_OVER_MODEL, WHAT_TO_DO, LoadProbe, verdict_reliability
from refspec.eval.record import RunRecord
from refspec.eval.record_files import summary_json
from refspec.eval.report import format_table
from refspec.eval.report_text import verdict
import test_eval_cli
from test_eval_cli import QUIET

tiny, one_thread = test_eval_cli.tiny, test_eval_cli.one_thread


def _pair(*, load_base: float, load_spec: float, ratio_base: float = 3.0, ratio_spec: float = 3.0,
          time_source: str = "wall-clock", cpu: tuple[float, float] = (None, None), threads: int | None = None,
          **energy) -> list[RunRecord]:
    """A baseline and an ngram comparison at batch 8 on 2 CPUs, under the given 1-minute load averages
    (``cpu``: each one's CPU time over wall time, with ``threads``)."""
    def one(drafter: str, k: int, jw: float, load: float, ratio: float, cpu_per_wall: float | None) -> RunRecord:
        return record(config_id=f"{drafter}-b8", drafter=drafter, k=k, batch=8, baseline_config_id="none-b8",
                      device="cpu", time_source=time_source, window_j_per_token=jw, run_tokens_per_s=100.0 / jw,
                      energy_source=energy.get("source", "modelled:roofline(cpu-fp32-2t,wall-time)"),
                      energy_measured=energy.get("measured", False), host_load_start=load, host_load_end=load,
                      host_cpus=2, host_time_vs_model=ratio, host_cpu_per_wall=cpu_per_wall, host_threads=threads)
    return attach_baselines([one("none", 0, 0.10, load_base, ratio_base, cpu[0]),
                             one("ngram", 4, 0.08, load_spec, ratio_spec, cpu[1])])


def test_a_pair_under_different_load_is_marked_everywhere():
    base, spec = _pair(load_base=1.0, load_spec=3.2)  # two busy processes more during the comparison
    assert spec.comparison.verdict_reliable is False
    assert "different load" in spec.comparison.verdict_unreliable_reason
    assert "UNRELIABLE" in verdict(spec) and "different load" in verdict(spec)
    table = format_table([base, spec]).splitlines()
    assert sum(WHAT_TO_DO in line for line in table) == 1 and table[-1] == WHAT_TO_DO
    row = next(line for line in table if line.startswith("ngram k4 b8"))
    assert row.endswith("UNRELIABLE")
    written = summary_json([base, spec])[1]
    assert written["verdict_reliable"] is False and "different load" in written["verdict_unreliable_reason"]
    assert RunRecord.from_json(json.loads(json.dumps(written))).comparison.verdict_reliable is False


def test_a_matched_pair_is_not_marked():
    base, spec = _pair(load_base=1.1, load_spec=1.6)  # within half a load per CPU on 2 CPUs
    assert spec.comparison.verdict_reliable is True and spec.comparison.verdict_unreliable_reason is None
    assert "UNRELIABLE" not in verdict(spec)
    assert WHAT_TO_DO not in format_table([base, spec])


@pytest.mark.parametrize("slow", ["base", "spec"])
def test_a_step_far_slower_than_modelled_is_marked_under_matched_load(slow):
    ratios = {"ratio_base": 146.0 if slow == "base" else 3.0, "ratio_spec": 146.0 if slow == "spec" else 3.0}
    _, spec = _pair(load_base=1.0, load_spec=1.0, **ratios)
    assert spec.comparison.verdict_reliable is False
    assert f"146x slower than modelled (more than {MAX_TIME_OVER_MODEL:g}x" in spec.comparison.verdict_unreliable_reason


def test_a_pair_that_shared_the_cores_is_marked_even_under_matched_load():
    """Two busy loops on both cores through both runs: the load averages match, the step times stay
    under 10x the model, but each run got about one CPU for its two threads (0.95-0.99 measured)."""
    _, spec = _pair(load_base=1.6, load_spec=1.7, cpu=(0.99, 0.95), threads=2)
    assert spec.comparison.verdict_reliable is False
    assert spec.comparison.verdict_unreliable_reason == (
        "it got 0.95 CPUs for its 2 threads (48% of a core each, under 75%: other jobs shared the cores); its baseline "
        "got 0.99 CPUs for its 2 threads (50% of a core each, under 75%: other jobs shared the cores)")
    # alone on the cores an OpenMP team keeps each thread busy (1.99 of 2 measured); one thread on one core too
    assert _pair(load_base=1.0, load_spec=1.0, cpu=(1.99, 1.98), threads=2)[1].comparison.verdict_reliable is True
    assert _pair(load_base=1.0, load_spec=1.0, cpu=(0.99, 0.98), threads=1)[1].comparison.verdict_reliable is True


def test_modelled_time_is_reliable_whatever_the_load():
    _, spec = _pair(load_base=0.1, load_spec=8.0, ratio_spec=1000.0, time_source="modelled")
    assert spec.comparison.verdict_reliable is True


def test_nothing_recorded_judges_nothing_and_an_older_record_still_reads():
    old = record(config_id="ngram-b8", drafter="ngram", k=4, batch=8, device="cpu", record_version=4)
    assert old.host.load_start is None and old.comparison.verdict_reliable is None
    assert verdict_reliability(old, old) == (None, None)


@pytest.mark.parametrize("source,measured,words", [
    ("modelled:roofline(cpu-fp32-2t,wall-time)", False, "energy modelled"),
    ("measured:rapl", True, "energy measured by rapl"),
    ("modelled:simulated-counter(h200)", False, "energy simulated")])
def test_every_verdict_line_names_its_energy_source(source, measured, words):
    _, spec = _pair(load_base=1.0, load_spec=1.0, source=source, measured=measured)
    assert f"({'steady-state window J/token'}, {words}, at " in verdict(spec)


def test_the_probe_records_load_and_cpu_time_over_wall_time():
    probe = LoadProbe.start()
    sum(i * i for i in range(200_000))  # some CPU work on this thread
    host = probe.stop()
    assert host.wall_s > 0 and host.cpu_s >= 0 and host.cpus >= 1 and host.threads == torch.get_num_threads()
    assert host.cpu_per_wall == pytest.approx(host.cpu_s / host.wall_s)
    assert host.load_start is None or (host.load_start >= 0 and host.load_end >= 0)


def test_a_real_small_run_records_the_host_and_judges_its_verdict(tiny, tmp_path):
    argv = ["--model", str(tiny["model"]), "--corpus", str(tiny["prompts"]), "--max-new-tokens", "6", "--batch", "2",
            "--requests", "4", "--drafter", "ngram", *QUIET, "--out", str(tmp_path / "r")]
    assert cli.main(argv) == 0
    base, spec = json.loads((tmp_path / "r" / "summary.json").read_text())
    for r in (base, spec):
        assert r["host_wall_s"] > 0 and r["host_cpu_s"] >= 0 and r["host_cpu_per_wall"] is not None
        assert r["host_cpus"] >= 1 and r["host_step_time_s"] > 0
        assert r["host_load_start"] is not None and r["host_load_end"] is not None
    if spec["host_time_vs_model"] is not None:  # a roofline prediction: the ratio is measured over modelled
        assert spec["host_time_vs_model"] == pytest.approx(spec["host_step_time_s"] / spec["host_model_step_time_s"])
    assert spec["verdict_reliable"] in (True, False)
    assert (spec["verdict_unreliable_reason"] is None) == spec["verdict_reliable"]


def test_judging_and_reporting_records_needs_no_torch():
    """The load rules and the report read records only: importing them must not load torch (a second)."""
    import subprocess
    import sys

    code = "import sys, refspec.eval.load, refspec.eval.report; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).returncode == 0
