"""Phase-isolated loops: the counter is read at loop bounds only, each loop runs the run's shapes."""
import time

import pytest
import torch

from refspec.drafters.ngram import NgramDrafter
from refspec.energy.ledger.events import MeteredPhase
from refspec.energy.meters.counters import callable_counter
from refspec.energy.meters.windowed import WindowedMeter
from refspec.phase_loops import LoopShapes, LoopTarget, run_phase_loops
from refspec.sampling import SamplingConfig
from test_eval_cli import one_thread, tiny  # noqa: F401  (fixtures)

POWER_W = 40.0


class CountingCounter:
    """A counter of constant power over the wall clock, counting its reads."""

    def __init__(self):
        t0 = time.perf_counter()
        self.inner = callable_counter(lambda: POWER_W * (time.perf_counter() - t0), source="measured:fake",
                                      period_s=0.005)
        self.source, self.period_s, self.reads = self.inner.source, self.inner.period_s, 0

    def read(self):
        self.reads += 1
        return self.inner.read()

    def close(self):
        pass


class WorkSpy(WindowedMeter):
    """A windowed meter that keeps the work of every phase it closes."""

    def __init__(self, counter):
        super().__init__(counter)
        self.work: dict[str, list] = {}

    def end(self, name, work=()):
        self.work.setdefault(name, []).append(work)
        return super().end(name, work)


def _shapes(k, batch=3, refill=2):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (9, 14, 5, 11)]
    prompts[1] = prompts[1][:4] * 4  # repetitive: the n-gram drafter finds matches
    return LoopShapes(batch=batch, k=k, prompts=prompts, keys=40, refill=refill)


@pytest.mark.parametrize("k", [0, 3])
def test_each_loop_reads_the_counter_at_its_bounds_only(tiny_models, k):
    m = tiny_models["llama"]
    counter = CountingCounter()
    meter = WindowedMeter(counter)
    drafter = NgramDrafter(max_n=2, trim=False) if k else None
    loops = run_phase_loops(LoopTarget(target=m, drafter=drafter, verify_fn=m, sampling=SamplingConfig()),
                            _shapes(k), meter, min_s=0.05)
    assert set(loops) == ({"draft", "verify", "commit", "prefill"} if k else {"verify", "commit", "prefill"})
    for name, loop in loops.items():
        assert loop.iterations >= 2 and loop.time_s >= 0.05, name
        assert loop.energy_j == pytest.approx(POWER_W * loop.time_s, rel=1e-3), name  # energy and time read microseconds apart
    # two reads per loop, plus the start read the first loop iteration's phase takes: never one per iteration
    assert counter.reads <= 2 * len(loops) + 1 < sum(loop.iterations for loop in loops.values())
    with MeteredPhase(meter, "draft"):  # the loops left no counter run open: the next phase starts one
        pass
    assert counter.reads == 2 * len(loops) + 2


def test_loops_run_the_runs_shapes(tiny_models):
    m = tiny_models["llama"]
    meter = WorkSpy(CountingCounter())
    shapes = _shapes(3)
    run_phase_loops(LoopTarget(target=m, drafter=NgramDrafter(max_n=2, trim=False), verify_fn=m,
                               sampling=SamplingConfig()), shapes, meter, min_s=0.02)
    verify = [w for ws in meter.work["loop:verify"] for w in ws]
    assert verify and all(w.rows == shapes.batch and w.tokens_per_row == shapes.k + 1 for w in verify)
    assert all(w.context_tokens >= shapes.batch * shapes.keys for w in verify), "verify attends the run's keys"
    prefill = [w for ws in meter.work["loop:prefill"] for w in ws]
    real = sum(len(p) for p in shapes.prompts[:shapes.refill])
    assert prefill and all(w.rows == shapes.refill and w.query_tokens == real for w in prefill)
    assert all(ws == () for ws in meter.work["loop:draft"]), "an n-gram lookup runs no forward"


def test_bad_shapes_are_refused(tiny_models):
    m = tiny_models["llama"]
    with pytest.raises(ValueError, match="refill group"):
        run_phase_loops(LoopTarget(target=m, drafter=None, verify_fn=m, sampling=SamplingConfig()),
                        _shapes(0, batch=3, refill=4), WindowedMeter(CountingCounter()), min_s=0.01)


def test_a_counter_metered_run_writes_its_loops(tmp_path, tiny):
    """Through the CLI under a simulated counter: each configuration's ledger gets one loop record
    per phase it has, after its run's end, and the accounting reads them."""
    import json

    from refspec.eval import cli

    rc = cli.main(["--model", str(tiny["model"]), "--corpus", str(tiny["prompts"]), "--max-new-tokens", "6",
                   "--no-progress", "--no-warmup", "--drafter", "ngram", "--batch", "2", "--requests", "4",
                   "--meter", "simulated:cpu:period_ms=5:sample_ms=5", "--phase-loops-s", "0.1",
                   "--out", str(tmp_path)])
    assert rc == 0
    lines = [json.loads(x) for x in (tmp_path / "ledger.jsonl").read_text().split("\n") if x.strip()]
    loops: dict[str, set] = {}
    for r in lines:
        if r["kind"] == "loop":
            loops.setdefault(r["run_id"].split(".")[0], set()).add(r["phase"])
            assert r["iterations"] >= 1 and r["time_s"] >= 0.1 and r["energy_j"] > 0
    assert sorted(map(sorted, loops.values())) == [["commit", "draft", "prefill", "verify"],
                                                   ["commit", "prefill", "verify"]]
    from refspec.energy.accounting.headline import account

    for run_id in {r["run_id"] for r in lines if r["kind"] == "loop"}:
        acc = account([r for r in lines if r.get("run_id") == run_id])
        assert acc.phase_energy_method == "attributed-loops", "the loops are the split's first source"


def test_a_clock_that_stands_still_does_not_hang_a_loop(tiny_models):
    """Under a modelled clock a phase without forwards (commit) takes no time: the wall clock ends its loop."""
    m = tiny_models["llama"]
    meter = WindowedMeter(CountingCounter(), clock=lambda: 7.0)
    loops = run_phase_loops(LoopTarget(target=m, drafter=None, verify_fn=m, sampling=SamplingConfig()),
                            _shapes(0), meter, min_s=0.05)
    assert all(loop.iterations >= 1 for loop in loops.values())
