"""Energy counters read only over windows they resolve: RAPL (fake powercap tree), several GPUs
(fake pynvml, fake Zeus), the windowed meter's reads and the ledger's counter records."""
from __future__ import annotations

import json
import logging
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from refspec.energy.ledger.counter_records import COUNTER_SCHEMA, CounterLedger, counter_ledger
from refspec.energy.ledger.read import read_ledger
from refspec.energy.ledger.writer import Ledger
from refspec.energy.meters import make
from refspec.energy.meters.counters import CounterMark, Unwrap, callable_counter, combine
from refspec.energy.meters.direct import RooflineMeter
from refspec.energy.meters.errors import NoCounterError, NoGPUError
from refspec.energy.meters.make import make_meter
from refspec.energy.meters.measurement import Measurement
from refspec.energy.meters.nvml import nvml_counter
from refspec.energy.meters.rapl import rapl_available, rapl_counter, rapl_zones
from refspec.energy.meters.spec import MeterSpecError, parse_meter_spec
from refspec.energy.meters.timers import ClockTimer, CudaEventTimer
from refspec.energy.meters.windowed import WindowedMeter
from refspec.energy.meters.zeus import ZeusCounter
from fakes import World


# ---- RAPL through a fake powercap tree --------------------------------------------------------
def powercap(root: Path, zones: dict[str, tuple[str, int, int]], *, nested: bool = False) -> Path:
    """Write zones ``{dir: (name, energy_uj, max_energy_range_uj)}`` under ``root`` (``nested``:
    each subzone inside its package's directory, as the device tree holds it)."""
    for d, (name, uj, max_uj) in zones.items():
        z = root / d.rsplit(":", 1)[0] / d if nested and d.count(":") == 2 else root / d
        z.mkdir(parents=True)
        (z / "name").write_text(name + "\n")
        (z / "energy_uj").write_text(f"{uj}\n")
        (z / "max_energy_range_uj").write_text(f"{max_uj}\n")
    return root


def set_uj(root: Path, zone: str, uj: int) -> None:
    (root / zone / "energy_uj").write_text(f"{uj}\n")


TREE = {"intel-rapl:0": ("package-0", 1_000_000, 10_000_000), "intel-rapl:0:0": ("core", 400_000, 10_000_000),
        "intel-rapl:0:1": ("dram", 2_000_000, 5_000_000), "intel-rapl:1": ("package-1", 0, 10_000_000),
        "intel-rapl:1:0": ("dram", 0, 5_000_000), "intel-rapl-mmio:0": ("package-0", 0, 10_000_000)}


@pytest.mark.parametrize("nested", [False, True])
def test_rapl_zones_names_and_default_domains(tmp_path, nested):
    root = powercap(tmp_path, TREE, nested=nested)
    assert [z.device for z in rapl_zones(root)] == ["package-0", "core-0", "dram-0", "package-1", "dram-1"]
    c = rapl_counter(root=root)  # packages and DRAM; core is inside its package, mmio repeats it
    assert c.source == "measured:rapl(package-0,dram-0,package-1,dram-1)" and c.period_s == 0.001
    assert rapl_counter(("package-1", "dram"), root=root).source == "measured:rapl(dram-0,package-1,dram-1)"
    assert rapl_available(root) and not rapl_available(tmp_path / "none")


def test_rapl_reads_joules_per_device_and_unwraps(tmp_path):
    root = powercap(tmp_path, TREE)
    w = World()
    c = rapl_counter(("package-0", "dram-0"), root=root, clock=w.clock)
    first = c.read()
    assert (first.energy_j, dict(first.devices), first.wall_s) == (0.0, {"package-0": 0.0, "dram-0": 0.0}, 100.0)
    set_uj(root, "intel-rapl:0", 3_500_000)  # +2.5 J
    set_uj(root, "intel-rapl:0:1", 4_900_000)  # +2.9 J
    r = c.read()
    assert r.devices == pytest.approx({"package-0": 2.5, "dram-0": 2.9}) and r.energy_j == pytest.approx(5.4)
    set_uj(root, "intel-rapl:0:1", 300_000)  # wrapped at 5 J: +0.1 J to the top, +0.3 J after
    r = c.read()
    assert r.devices["dram-0"] == pytest.approx(2.9 + 0.4) and r.energy_j == pytest.approx(5.8)


def test_rapl_errors_say_why(tmp_path, monkeypatch):
    with pytest.raises(NoCounterError, match="no readable intel-rapl zone"):
        rapl_counter(root=tmp_path)
    root = powercap(tmp_path / "a", TREE)
    with pytest.raises(NoCounterError, match="no RAPL zone matches psys under .*; there are package-0, core-0"):
        rapl_counter(("psys",), root=root)
    real = Path.read_text

    def denied(self, *a, **k):
        if self.name == "energy_uj":
            raise PermissionError(13, "Permission denied")
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", denied)
    with pytest.raises(NoCounterError, match="readable by root only"):
        rapl_counter(root=root)


def test_unwrap_counts_each_wrap_once():
    u = Unwrap(100)
    assert [u(x) for x in (90, 95, 5, 50, 10)] == [0, 5, 15, 60, 120] and u.wraps == 2
    with pytest.raises(ValueError):
        Unwrap(0)


def test_make_meter_rapl_and_auto_pick_rapl_on_a_cpu(tmp_path, monkeypatch):
    root = powercap(tmp_path, TREE)
    m = make_meter(f"rapl:domains=package:root={root}")
    assert isinstance(m, WindowedMeter) and m.source == "measured:rapl(package-0,package-1)"
    monkeypatch.setattr(make, "_cuda_sync", lambda: None)
    auto = make_meter("auto", powercap_root=root)
    assert isinstance(auto, WindowedMeter) and auto.source.startswith("measured:rapl(package-0,dram-0")
    assert isinstance(make_meter("auto", powercap_root=tmp_path / "none"), RooflineMeter)


# ---- several GPUs: pynvml and Zeus -------------------------------------------------------------
class FakeNVMLError(Exception):
    pass


def fake_pynvml(energy_mj: dict[int, list[int]], *, counter: tuple[int, ...] = (0, 1),
                instant_mw: dict[int, list[int]] | None = None, instant_refused: bool = False,
                average_mw: list[int] | None = None) -> types.ModuleType:
    """pynvml with GPUs 0 and 1: the counter pops from ``energy_mj[i]`` for GPUs in ``counter``,
    the instantaneous field from ``instant_mw[i]`` (absent when None), the average from ``average_mw``."""
    nv = types.ModuleType("pynvml")
    nv.NVMLError = FakeNVMLError
    nv.NVML_SUCCESS = 0
    nv.calls = []
    nv.nvmlInit = lambda: nv.calls.append("init")
    nv.nvmlShutdown = lambda: nv.calls.append("shutdown")
    nv.nvmlDeviceGetHandleByIndex = lambda i: i

    def total(h):
        if h not in counter:
            raise FakeNVMLError("Not Supported")
        return energy_mj[h].pop(0)

    nv.nvmlDeviceGetTotalEnergyConsumption = total
    if instant_mw is not None:
        nv.NVML_FI_DEV_POWER_INSTANT = 186

        def fields(h, ids):
            assert ids == [186]
            ret = 3 if instant_refused else 0
            mw = 0 if instant_refused else instant_mw[h].pop(0)
            return [SimpleNamespace(nvmlReturn=ret, valueType=1, value=SimpleNamespace(uiVal=mw))]

        nv.nvmlDeviceGetFieldValues = fields

    def average(h):
        if average_mw is None:
            raise FakeNVMLError("Not Supported")
        return average_mw.pop(0)

    nv.nvmlDeviceGetPowerUsage = average
    return nv


def test_nvml_counter_sums_several_gpus_and_records_each():
    nv = fake_pynvml({0: [0, 1_000, 1_000, 3_500], 1: [0, 7_000, 7_000, 8_250]})  # the first is the probe
    w = World()
    c = nvml_counter((0, 1), pynvml_module=nv, clock=w.clock)
    assert c.source == "measured:nvml-total-energy(gpu0,gpu1)"
    r0, r1 = c.read(), c.read()
    assert dict(r0.devices) == {"gpu0": 1.0, "gpu1": 7.0} and r0.energy_j == 8.0
    assert r1.energy_j - r0.energy_j == 0.0
    r2 = c.read()
    assert dict(r2.devices) == {"gpu0": 3.5, "gpu1": 8.25} and r2.energy_j - r0.energy_j == 3.75
    c.close()
    c.close()
    assert nv.calls == ["init", "shutdown"]


def test_power_fallback_integrates_the_instantaneous_field(caplog):
    w = World()
    # gpu1 refuses the counter: its power is NVML_FI_DEV_POWER_INSTANT (probe 1 W, then 100, 300 W)
    nv = fake_pynvml({0: [0, 0, 0]}, counter=(0,), instant_mw={1: [1_000, 100_000, 300_000]},
                     average_mw=[999_000])
    c = nvml_counter((0, 1), pynvml_module=nv, clock=w.clock, start_thread=False)
    assert c.source == "measured:nvml-total-energy(gpu0)+nvml-power-integral(gpu1)"
    c.read()
    w.advance(2.0, 0.0)
    assert c.read().devices["gpu1"] == 400.0  # (100 + 300) / 2 W x 2 s; the 1 s average never read
    assert nv.nvmlDeviceGetPowerUsage(0) == 999_000


@pytest.mark.parametrize("has_field", [False, True])
def test_power_fallback_takes_the_average_with_a_reason(caplog, has_field):
    nv = fake_pynvml({}, counter=(), instant_mw={0: []} if has_field else None, instant_refused=has_field,
                     average_mw=[50_000, 50_000, 70_000])
    w = World()
    with caplog.at_level(logging.WARNING, logger="refspec.energy.meters"):
        c = nvml_counter((0,), pynvml_module=nv, clock=w.clock, start_thread=False)
    reason = "refused the instantaneous power field" if has_field else "has no NVML_FI_DEV_POWER_INSTANT"
    assert reason in caplog.text and "one-second average" in caplog.text
    assert c.source == "measured:nvml-power-integral-of-average(gpu0)"
    c.read()
    w.advance(1.0, 0.0)
    assert c.read().energy_j == 60.0


def test_nvml_counter_refusing_everything_names_the_gpu():
    nv = fake_pynvml({0: [0]}, counter=(0,))
    with pytest.raises(NoGPUError, match="GPU 1 refused both the total-energy counter"):
        nvml_counter((0, 1), pynvml_module=nv)
    assert nv.calls == ["init", "shutdown"]


class FakeMonitor:
    """ZeusMonitor's windows over per-GPU energy totals (J) advanced by hand."""

    def __init__(self) -> None:
        self.e = {0: 0.0, 1: 0.0}
        self.open: dict[str, dict[int, float]] = {}

    def begin_window(self, key):
        self.open[key] = dict(self.e)

    def end_window(self, key):
        e0 = self.open.pop(key)
        return SimpleNamespace(time=0.0, gpu_energy={i: self.e[i] - e0[i] for i in self.e})


def test_zeus_counter_chains_windows_into_cumulative_totals():
    mon = FakeMonitor()
    c = ZeusCounter((0, 1), monitor=mon, clock=lambda: 1.0)
    assert c.source == "measured:nvml-total-energy(gpu0,gpu1)"
    assert c.read().energy_j == 0.0
    mon.e = {0: 10.0, 1: 4.0}
    mid = c.read()
    mon.e = {0: 15.0, 1: 4.5}
    last = c.read()
    assert dict(mid.devices) == {"gpu0": 10.0, "gpu1": 4.0} and last.energy_j == 19.5
    assert len(mon.open) == 1  # one window stays open between reads


def test_combined_counter_names_every_device():
    w = World()
    gpu = callable_counter(w.energy, source="measured:fake(gpu0)", device="gpu0", period_s=0.1)
    cpu = callable_counter(lambda: 2.0, source="measured:fake(cpu)", device="package-0", period_s=0.001)
    both = combine([gpu, cpu])
    assert both.period_s == 0.1 and both.read().devices == {"gpu0": 5000.0, "package-0": 2.0}


# ---- the windowed meter ---------------------------------------------------------------------------
def windowed(w: World, period_s: float = 0.1, **kw) -> WindowedMeter:
    counter = callable_counter(w.energy, source="measured:fake-counter", period_s=period_s, clock=w.clock)
    return WindowedMeter(counter, clock=w.clock, **kw)


class CountingTimer:
    """Phase times that resolve lazily, counting resolutions."""

    def __init__(self, w: World) -> None:
        self.w, self.resolved = w, 0

    def start(self):
        return self.w.t

    def stop(self, t0, work=()):
        t1 = self.w.t

        def resolve():
            self.resolved += 1
            return t1 - t0

        return resolve


def step(m: WindowedMeter, w: World, phases=(("draft", 0.003), ("verify", 0.012), ("commit", 0.002))):
    out = []
    for name, dt in phases:
        m.begin(name)
        w.advance(dt, 300.0 * dt)
        out.append(m.end(name))
    return out


def test_windowed_meter_reads_at_start_sub_windows_and_end_never_per_phase():
    w = World()
    m = windowed(w)
    assert m.sub_window_s == 1.0  # ten periods of 0.1 s
    measurements = [x for _ in range(200) for x in step(m, w)]  # 200 steps of 17 ms: 3.4 s
    assert all(x.energy_j is None and x.source == "measured:fake-counter" for x in measurements)
    marks = [(i, mk.reason, mk.at_end) for i, x in enumerate(measurements) for mk in x.marks]
    assert marks[0] == (0, "start", False)
    subs = [i for i, reason, _ in marks if reason == "sub"]
    assert len(subs) == 3 and all(i % 3 == 2 for i in subs)  # taken at the end of commits only
    reads = [mk.read for x in measurements for mk in x.marks]
    assert all(b.wall_s - a.wall_s >= 1.0 for a, b in zip(reads, reads[1:]))
    assert m.reads == 4
    end = m.finish_run()
    assert end.energy_j - reads[0].energy_j == pytest.approx(300.0 * 200 * 0.017)
    assert m.finish_run() is None and m.reads == 5
    assert step(m, w)[0].marks[0].reason == "start"  # the next run starts with its own read


def test_windowed_meter_resolves_time_lazily_and_refuses_short_sub_windows():
    w = World()
    timer = CountingTimer(w)
    m = windowed(w, timer=timer)
    draft = step(m, w)[0]
    assert timer.resolved == 0 and isinstance(draft, Measurement)
    assert draft.time_s == pytest.approx(0.003) and draft.time_s == pytest.approx(0.003) and timer.resolved == 1
    with pytest.raises(ValueError, match="shorter than 10 periods"):
        windowed(w, sub_window_s=0.5)


def test_windowed_meter_warns_on_a_run_too_short_to_resolve(caplog):
    w = World()
    m = windowed(w)
    step(m, w)
    with caplog.at_level(logging.WARNING, logger="refspec.energy.meters"):
        m.finish_run()
    assert "cannot be resolved" in caplog.text


def test_windowed_meter_idle_power():
    w = World()
    m = windowed(w)
    assert m.measure_idle_w(4.0, sleep=lambda s: w.advance(s, 70.0 * s)) == 70.0


# ---- counter records in the ledger ----------------------------------------------------------------
def test_counter_records_sit_on_the_engine_clock_beside_null_phase_energy(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny import TINY_HF

    from refspec.drafters.ngram import NgramDrafter
    from refspec.engine import Engine, EngineConfig
    from refspec.models.random_models import random_model

    model = random_model(dict(TINY_HF["llama"]), dtype=torch.float32)
    w = World()
    ticks = {"n": 0}

    def clock():  # every read of the clock is 2 ms later, the counter draws 100 W
        ticks["n"] += 1
        w.advance(0.002, 0.2)
        return w.t

    counter = callable_counter(w.energy, source="measured:fake-counter", period_s=0.005, clock=clock)
    meter = WindowedMeter(counter, clock=clock, timer=ClockTimer(clock))
    path = tmp_path / "ledger.jsonl"
    with counter_ledger(meter, Ledger(path, run_id="r0")) as ledger:
        assert isinstance(ledger, CounterLedger)
        engine = Engine(model, NgramDrafter(max_n=3, trim=False), config=EngineConfig(k=3), meter=meter,
                        observers=[ledger])
        engine.generate([[1, 2, 3, 4], [5, 6, 7]], max_new_tokens=24)
        ledger.begin_run("r1")
        engine.generate([[9, 8, 7]], max_new_tokens=8)
    recs = read_ledger(path, strict=True)
    for run in ("r0", "r1"):
        phases = [r for r in recs if r["kind"] == "phase" and r["run_id"] == run]
        counts = [r for r in recs if r["kind"] == "counter" and r["run_id"] == run]
        assert all(r["energy_j"] is None and r["source"] == "measured:fake-counter" for r in phases)
        assert counts[0]["reason"] == "start" and counts[-1]["reason"] == "end"
        assert {r["reason"] for r in counts[1:-1]} <= {"sub"} and len(counts) < len(phases) / 2
        assert set(counts[0]) == set(COUNTER_SCHEMA) - {"energy_true_j"}
        first, last = phases[0], phases[-1]
        assert counts[0]["clock_s"] == first["clock_s"] == 0.0
        assert counts[-1]["clock_s"] == pytest.approx(last["clock_s"] + last["time_s"])
        for c in counts[1:-1]:  # each sub read follows a commit or prefill and sits at its end
            before = max((p for p in phases if p["clock_s"] < c["clock_s"]), key=lambda p: p["clock_s"])
            assert before["phase"] in ("commit", "prefill")
            assert c["clock_s"] == pytest.approx(before["clock_s"] + before["time_s"])
        walls = [c["wall_s"] for c in counts]
        assert all(b - a >= meter.sub_window_s >= 0.05 for a, b in zip(walls[:-2], walls[1:-1]))  # ten periods
        assert counts[-1]["energy_j"] - counts[0]["energy_j"] == pytest.approx(100.0 * (walls[-1] - walls[0]))
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    kinds = [x["kind"] for x in lines]
    assert kinds.index("counter") < kinds.index("phase")  # the start read precedes the first phase
    end_records = [i for i, x in enumerate(lines) if x["kind"] == "end"]
    assert lines[end_records[0] - 1]["reason"] == "end"  # each run's end read precedes its end record


def test_aborted_run_writes_no_end_read_and_plain_meters_keep_the_bare_ledger(tmp_path):
    w = World()
    meter = windowed(w)
    with pytest.raises(RuntimeError):
        with counter_ledger(meter, Ledger(tmp_path / "a.jsonl", run_id="a")) as ledger:
            meter.begin("prefill")
            raise RuntimeError("boom")
    recs = read_ledger(tmp_path / "a.jsonl")
    assert [r["kind"] for r in recs] == ["run", "end"] and recs[-1]["status"] == "aborted"
    assert meter.finish_run() is None  # re-armed
    bare = Ledger(tmp_path / "b.jsonl")
    assert counter_ledger(make_meter("roofline:h200"), bare) is bare
    bare.close()


def test_marks_ride_on_measurements():
    read = callable_counter(lambda: 1.0, source="measured:x").read()
    m = Measurement(0.5, None, "measured:x", marks=[CounterMark(read, "start", at_end=False)])
    assert (m.time_s, m.energy_j, m.marks[0].reason, m.extra) == (0.5, None, "start", ())


# ---- the meter spec ------------------------------------------------------------------------------
def test_meter_spec_parses_kinds_profiles_and_options():
    s = parse_meter_spec("simulated:h200:period_ms=50:sample_ms=12.5:noise=0.05:seed=7:sub_window_s=2")
    assert (s.kind, s.profile) == ("simulated", "h200")
    assert dict(s.options) == {"period_ms": 50.0, "sample_ms": 12.5, "noise": 0.05, "seed": 7, "sub_window_s": 2.0}
    assert parse_meter_spec("nvml:gpus=0,1").options == {"gpus": (0, 1)}
    assert parse_meter_spec("roofline:cpu").profile == "cpu" and parse_meter_spec("auto").kind == "auto"


@pytest.mark.parametrize("spec,match", [
    ("joules", "unknown meter 'joules'"), ("zeus:h200", "zeus takes no profile"),
    ("simulated:period_ms=100:h200", "comes right after simulated"), ("simulated:tpu", "a profile is one of"),
    ("rapl:gpus=0", "option 'gpus' does not go with rapl"), ("nvml:gpus=0,0", "distinct GPU indices"),
    ("simulated:cpu:period_ms=0", "must be > 0"), ("simulated:cpu:noise=-1", "must be >= 0"),
    ("simulated:cpu:seed=1.5", "not an integer"), ("simulated:cpu:period_ms=20:sample_ms=25", "exceeds period_ms"),
    ("simulated:cpu:seed=1:seed=2", "given twice"), ("time:sub_window_s=1", "it takes no options"),
])
def test_meter_spec_errors_say_what_fits(spec, match):
    with pytest.raises(MeterSpecError, match=match):
        parse_meter_spec(spec)


def test_make_meter_nvml_with_several_gpus(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml({0: [0] * 4, 1: [0] * 4}))
    m = make_meter("nvml:gpus=0,1:sub_window_s=3")
    assert isinstance(m, WindowedMeter) and m.source == "measured:nvml-total-energy(gpu0,gpu1)"
    assert m.sub_window_s == 3.0
    with pytest.raises(ValueError, match="shorter than 10 periods"):
        make_meter("nvml:gpus=0:sub_window_s=0.5")


def test_cli_checks_the_spec_and_the_session_passes_it_through():
    from refspec.eval.cli_checks import check_meter
    from refspec.eval.flags import UsageError
    from refspec.eval.session import Session

    check_meter("simulated:cpu:period_ms=100:sample_ms=25:noise=0.02:seed=1")
    with pytest.raises(UsageError, match="--meter 'bogus' is unknown"):
        check_meter("bogus")
    with pytest.raises(UsageError, match="--meter 'simulated:cpu:sample_ms=200': sample_ms=200 exceeds period_ms=100"):
        check_meter("simulated:cpu:sample_ms=200")
    session = Session(model="unused", dtype="fp32", device=torch.device("cpu"),
                      meter="simulated:h200:period_ms=50:sample_ms=12.5")
    assert session.meter.source == "modelled:simulated-counter(h200-sxm,P=50ms,S=12.5ms)"
    assert session.time_source == "modelled" and session.meter.idle_w == 70.0
    short = "simulated:h200:period_ms=100:sub_window_s=0.5"
    with pytest.raises(UsageError, match=f"--meter '{short}': .*shorter than 10 periods"):
        Session(model="unused", dtype="fp32", device=torch.device("cpu"), meter=short).meter


def test_cuda_event_timer_records_without_sync_and_resolves_when_read(monkeypatch):
    log = []

    class FakeEvent:  # torch.cuda.Event's timing API: record, synchronize, elapsed_time in ms
        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self):
            self.t = len(log)
            log.append("record")

        def synchronize(self):
            log.append("sync")

        def elapsed_time(self, end):
            return 1000.0 * (end.t - self.t)

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    timer = CudaEventTimer()
    resolve = timer.stop(timer.start())
    assert log == ["record", "record"]  # nothing waited for the GPU inside the phase
    assert resolve() == 1.0 and log[-1] == "sync"
