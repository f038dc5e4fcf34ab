"""What metering costs a CPU decode step: a counter read per phase against phases timed and the
counter read only over sub-windows.

Every meter brackets the same engine steps (n-gram drafter, greedy). Each one's own time inside
``begin``/``end`` is summed (the overhead it adds to the step), beside the median step time.
The counter is a RAPL-like one over a powercap tree in a temporary directory (two zones, each
read a sysfs-style file read), so a read costs what reading ``energy_uj`` costs:

* ``time``: :class:`~refspec.energy.meters.direct.TimeMeter`, the clock only (no counter at all);
* ``windowed``: :class:`~refspec.energy.meters.windowed.WindowedMeter`, the clock per phase, the
  counter at the run's start, its end and every sub-window (ten periods, here 0.1 s);
* ``fake-phase``: :class:`~refspec.energy.meters.direct.FakeMeter`, a free counter (a Python
  callable) read at every phase's begin and end: the per-phase bookkeeping alone;
* ``per-phase``: the same :class:`~refspec.energy.meters.direct.FakeMeter` over the RAPL-like
  counter, read at every phase's begin and end (what ``--meter zeus|nvml`` did before the
  windowed meter; no CUDA sync on a CPU);
* ``roofline``: :class:`~refspec.energy.meters.direct.RooflineMeter` in wall-time mode (the CPU's
  ``auto``), which prices every phase's forwards;
* ``simulated``: :class:`~refspec.energy.meters.simulated.SimulatedMeter` on the CPU profile.

Usage::

    OMP_NUM_THREADS=1 python scripts/meter_overhead.py --model tiny --steps 64 --repeats 5
    OMP_NUM_THREADS=1 python scripts/meter_overhead.py --model smollm2-135m --steps 24 --repeats 3
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from refspec.drafters.ngram import NgramDrafter  # noqa: E402
from refspec.energy.meters.direct import FakeMeter, RooflineMeter, TimeMeter  # noqa: E402
from refspec.energy.meters.make import make_meter  # noqa: E402
from refspec.energy.meters.rapl import rapl_counter  # noqa: E402
from refspec.energy.meters.timers import ClockTimer  # noqa: E402
from refspec.energy.meters.windowed import WindowedMeter  # noqa: E402
from refspec.engine import Engine, EngineConfig  # noqa: E402


class Timed:
    """A meter wrapper summing the wall time spent inside the meter's own calls."""

    def __init__(self, meter) -> None:
        self.meter, self.spent_s, self.source = meter, 0.0, meter.source

    def begin(self, name):
        t = time.perf_counter()
        self.meter.begin(name)
        self.spent_s += time.perf_counter() - t

    def end(self, name, work=()):
        t = time.perf_counter()
        m = self.meter.end(name, work)
        self.spent_s += time.perf_counter() - t
        return m


def powercap_tree(root: Path) -> Path:
    for d, name in (("intel-rapl:0", "package-0"), ("intel-rapl:0:0", "dram")):
        (root / d).mkdir(parents=True)
        (root / d / "name").write_text(name + "\n")
        (root / d / "energy_uj").write_text("123456789\n")
        (root / d / "max_energy_range_uj").write_text("262143328850\n")
    return root


def meters(root: Path) -> dict:
    rapl = lambda: rapl_counter(root=root)  # noqa: E731
    per_phase_counter = rapl()
    return {
        "time": lambda: TimeMeter(),
        "windowed": lambda: WindowedMeter(rapl(), timer=ClockTimer(), sub_window_s=0.1),
        "fake-phase": lambda: FakeMeter(time.perf_counter, lambda: 0.0),
        "per-phase": lambda: FakeMeter(time.perf_counter, lambda: per_phase_counter.read().energy_j,
                                       source="measured:rapl"),
        "roofline": lambda: RooflineMeter(make_meter("roofline:cpu", dtype_bytes=4).profile, time_source="wall_time"),
        "simulated": lambda: make_meter("simulated:cpu:period_ms=10:sample_ms=2.5", dtype_bytes=4),
    }


def load(name: str):
    if name == "tiny":
        from tiny import TINY_HF

        from refspec.models.random_models import random_model

        return random_model(dict(TINY_HF["llama"]), dtype=torch.float32)
    from refspec.eval.runtime import load_target

    return load_target(name, dtype=torch.float32, device=torch.device("cpu"), progress=False).model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny (random 3-layer llama) or a model id, e.g. smollm2-135m")
    p.add_argument("--steps", type=int, default=64, help="new tokens per row (about one step each, n-gram K 3)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    model = load(a.model)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, model.args.vocab_size, (a.batch, 24), generator=g).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        builders = meters(powercap_tree(Path(tmp)))
        spent = {k: [] for k in builders}
        step_ms = {k: [] for k in builders}
        for rep in range(a.repeats + 1):  # the first round warms up and is dropped
            for name, build in builders.items():  # interleaved: machine load hits every meter alike
                meter = Timed(build())
                events = []
                engine = Engine(model, NgramDrafter(max_n=3, trim=False), config=EngineConfig(k=3), meter=meter,
                                observers=[events.append])
                t0 = time.perf_counter()
                gen = engine.generate(prompts, max_new_tokens=a.steps)
                wall = time.perf_counter() - t0
                getattr(meter.meter, "finish_run", lambda: None)()
                if rep:
                    spent[name].append(meter.spent_s / gen.steps * 1e6)
                    step_ms[name].append(wall / gen.steps * 1e3)
    print(f"model {a.model}, batch {a.batch}, n-gram K 3, {a.steps} new tokens, {a.repeats} interleaved repeats, "
          f"{torch.get_num_threads()} thread(s); medians")
    print(f"{'meter':<10} {'meter us/step':>14} {'step ms':>9} {'meter share':>12}")
    for name in builders:
        us, ms = statistics.median(spent[name]), statistics.median(step_ms[name])
        print(f"{name:<10} {us:>14.1f} {ms:>9.2f} {us / 1e3 / ms:>11.2%}")


if __name__ == "__main__":
    main()
