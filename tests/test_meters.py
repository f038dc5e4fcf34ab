"""Energy meters with fake clocks and counters: exact windows, nesting, warnings, sources."""
from __future__ import annotations

import logging
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from refspec.energy import meters
from refspec.config import ModelArgs
from refspec.energy.meters import (CounterMeter, FakeMeter, MeterError, NoGPUError, RooflineMeter, TimeMeter, ZeusMeter,
                                   make_meter)
from refspec.energy.phases import ForwardShape
from refspec.energy.roofline import HardwareProfile, forward_cost
from fakes import World


def test_fake_meter_reports_exact_deltas():
    w = World()
    m = FakeMeter(w.clock, w.energy)
    m.begin("verify")
    w.advance(0.25, 40.0)
    out = m.end("verify")
    assert (out.time_s, out.energy_j, out.source) == (0.25, 40.0, "measured:fake-counter")
    assert out.measured


def test_windows_nest_and_overlap():
    w = World()
    m = FakeMeter(w.clock, w.energy)
    m.begin("step")
    w.advance(0.5, 10.0)
    m.begin("draft")
    w.advance(0.25, 3.0)
    draft = m.end("draft")
    w.advance(0.125, 1.0)
    step = m.end("step")
    assert (draft.time_s, draft.energy_j) == (0.25, 3.0)
    assert (step.time_s, step.energy_j) == (0.875, 14.0)


def test_same_name_windows_nest_lifo():
    w = World()
    m = FakeMeter(w.clock, w.energy)
    m.begin("other")
    w.advance(1.0, 1.0)
    m.begin("other")
    w.advance(2.0, 2.0)
    assert m.end("other").energy_j == 2.0  # inner first
    assert m.end("other").energy_j == 3.0


def test_end_without_begin_is_an_error():
    m = FakeMeter(World().clock, World().energy)
    with pytest.raises(MeterError, match="without a matching begin"):
        m.end("verify")


def test_zero_delta_and_short_window_warn_once_per_name(caplog):
    w = World()
    m = FakeMeter(w.clock, w.energy, counter_period_s=0.1)
    with caplog.at_level(logging.DEBUG, logger="refspec.energy.meters"):
        for _ in range(3):
            m.begin("draft")
            w.advance(0.004, 0.0)
            assert m.end("draft").energy_j == 0.0
        m.begin("long")
        w.advance(1.0, 300.0)
        m.end("long")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "read 0 J" in warnings[0].getMessage() and "shorter than the counter period" in warnings[0].getMessage()
    assert m.short_windows.counts == {"draft": 3}


def test_time_meter_syncs_and_has_no_energy():
    ticks = iter([1.0, 1.5, 3.0, 4.0])
    syncs = []
    m = TimeMeter(sync=lambda: syncs.append(1), clock=lambda: next(ticks))
    m.begin("a")
    m.begin("b")
    b = m.end("b")
    a = m.end("a")
    assert (b.time_s, b.energy_j, b.source) == (1.5, None, "none:time-only")
    assert a.time_s == 3.0
    assert len(syncs) == 4


class FakeMonitor:
    """ZeusMonitor's window API over a World (Zeus returns time and per-GPU energy)."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.open: dict[str, tuple[float, float]] = {}

    def begin_window(self, key: str) -> None:
        assert key not in self.open, "Zeus keys must be unique"
        self.open[key] = (self.world.t, self.world.e)

    def end_window(self, key: str) -> SimpleNamespace:
        t0, e0 = self.open.pop(key)
        return SimpleNamespace(time=self.world.t - t0, gpu_energy={0: self.world.e - e0})


def test_zeus_meter_with_fake_monitor(caplog):
    w = World()
    m = ZeusMeter(0, monitor=FakeMonitor(w), counter_period_s=0.1)
    assert m.source == "measured:nvml-total-energy(gpu0)"
    m.begin("verify")
    m.begin("verify")  # same name nested: distinct Zeus keys
    w.advance(0.5, 150.0)
    inner = m.end("verify")
    w.advance(0.5, 100.0)
    outer = m.end("verify")
    assert (inner.time_s, inner.energy_j) == (0.5, 150.0)
    assert (outer.time_s, outer.energy_j) == (1.0, 250.0)
    with caplog.at_level(logging.WARNING, logger="refspec.energy.meters"):
        m.begin("draft")
        w.advance(0.003, 0.0)
        m.end("draft")
    assert "read 0 J" in caplog.text


def test_zeus_idle_power():
    w = World()
    m = ZeusMeter(0, monitor=FakeMonitor(w))
    assert m.measure_idle_w(4.0, sleep=lambda s: w.advance(s, 4.0 * 70.0)) == 70.0
    assert m.idle_w == 70.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_zeus_meter_without_gpu_is_a_clear_error():
    with pytest.raises(NoGPUError, match="torch.cuda.is_available"):
        ZeusMeter(0)
    with pytest.raises(NoGPUError):
        make_meter("zeus")


TOY = HardwareProfile(name="toy", peak_flops=1e6, bandwidth_Bps=1e5, static_w=10.0, pj_per_flop=1e6,
                      pj_per_byte=1e7, idle_w=2.0, overhead_s=0.001)
TINY = ModelArgs.from_hf_config(dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     tie_word_embeddings=True))


def test_roofline_meter_model_time():
    shape = ForwardShape(args=TINY, rows=2, tokens_per_row=1, context_tokens=8, dtype_bytes=2)
    c = forward_cost(shape)
    m = RooflineMeter(TOY)
    m.begin("verify")
    out = m.end("verify", (shape, shape))
    t = 2 * (max(c.flops / 1e6, c.bytes / 1e5) + 0.001)
    assert out.time_s == pytest.approx(t)
    assert out.energy_j == pytest.approx(10.0 * t + 2 * (1e-6 * c.flops + 1e-5 * c.bytes))
    assert out.source == "modelled:roofline(toy)"
    m.begin("commit")
    empty = m.end("commit")
    assert (empty.time_s, empty.energy_j) == (0.0, 0.0)


def test_roofline_meter_wall_time():
    ticks = iter([10.0, 10.5])
    shape = ForwardShape(args=TINY, rows=1, tokens_per_row=1, context_tokens=3, dtype_bytes=4)
    c = forward_cost(shape)
    m = RooflineMeter(TOY, time_source="wall_time", clock=lambda: next(ticks))
    m.begin("verify")
    out = m.end("verify", (shape,))
    assert out.time_s == 0.5
    assert out.energy_j == pytest.approx(10.0 * 0.5 + 1e-6 * c.flops + 1e-5 * c.bytes)
    assert out.source == "modelled:roofline(toy,wall-time)" and not out.measured
    with pytest.raises(ValueError):
        RooflineMeter(TOY, time_source="guess")  # type: ignore[arg-type]


def test_make_meter_kinds(monkeypatch):
    w = World()
    assert make_meter("fake", clock=w.clock, energy=w.energy, source="measured:x").source == "measured:x"
    assert make_meter("time").source == "none:time-only"
    h200 = make_meter("roofline", profile="h200")
    assert h200.source == "modelled:roofline(h200-sxm)" and h200.time_source == "model"
    monkeypatch.setattr(meters, "cpu_profile", lambda dtype_bytes=2: HardwareProfile(
        name="cpu-test", peak_flops=1e9, bandwidth_Bps=1e9, static_w=1, pj_per_flop=1, pj_per_byte=1, idle_w=1,
        benchmarked=True))
    monkeypatch.setattr(meters, "nvml_energy_counter_available", lambda gpu_index=0: False)
    monkeypatch.setattr(meters, "_cuda_sync", lambda: None)
    auto = make_meter("auto", powercap_root="/nonexistent/powercap")  # no RAPL: the modelled CPU profile
    assert isinstance(auto, RooflineMeter)
    assert auto.source == "modelled:roofline(cpu-test,wall-time)" and auto.idle_w == 1
    with pytest.raises(ValueError):
        make_meter("fake")
    with pytest.raises(ValueError, match="unknown meter 'joules'"):
        make_meter("joules")
    with pytest.raises(meters.NoCounterError, match="no readable intel-rapl zone"):
        make_meter("rapl", powercap_root="/nonexistent/powercap")


# ---- NVML through pynvml (no Zeus) and Zeus's "no GPU" errors ---------------------------------
class FakeNVMLError(Exception):
    pass


def fake_pynvml(world: World, *, counter: bool = True, power_w: list[float] | None = None,
                init_fails: bool = False) -> types.ModuleType:
    """A stand-in for nvidia-ml-py's ``pynvml``: the counter is the World's energy (in mJ), the
    power reading pops from ``power_w`` (in mW, as NVML reports)."""
    nv = types.ModuleType("pynvml")
    nv.NVMLError = FakeNVMLError
    nv.calls = []

    def init():
        if init_fails:
            raise FakeNVMLError("NVML Shared Library Not Found")
        nv.calls.append("init")

    def total_energy(handle):
        assert handle == "h0"
        if not counter:
            raise FakeNVMLError("Not Supported")
        return int(round(world.e * 1000))

    def power(handle):
        if power_w is None:
            raise FakeNVMLError("Not Supported")
        return power_w.pop(0) * 1000

    nv.nvmlInit = init
    nv.nvmlShutdown = lambda: nv.calls.append("shutdown")
    nv.nvmlDeviceGetHandleByIndex = lambda i: f"h{i}"
    nv.nvmlDeviceGetTotalEnergyConsumption = total_energy
    nv.nvmlDeviceGetPowerUsage = power
    return nv


def test_nvml_total_energy_counter_through_injected_pynvml(monkeypatch):
    w = World()
    nv = fake_pynvml(w)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    syncs = []
    m = meters.nvml_meter(0, sync=lambda: syncs.append(1), clock=w.clock)
    assert isinstance(m, CounterMeter) and m.source == "measured:nvml-total-energy(gpu0)"
    m.begin("decode")
    w.advance(2.5, 875.25)
    out = m.end("decode")
    assert (out.time_s, out.energy_j, out.measured) == (2.5, 875.25, True)
    assert len(syncs) == 2
    assert m.measure_idle_w(4.0, sleep=lambda s: w.advance(s, 70.5 * s)) == 70.5
    m.close()
    m.close()
    assert nv.calls == ["init", "shutdown"]


def test_refused_counter_falls_back_to_an_exact_power_integral():
    w = World()
    # begin samples 100 W; two thread-free samples 140 W and 180 W, 1 s apart; end reads 180 W
    nv = fake_pynvml(w, counter=False, power_w=[999.0, 100.0, 140.0, 180.0, 180.0])
    m = meters.nvml_meter(0, pynvml_module=nv, clock=w.clock, start_thread=False)
    assert m.source == "measured:nvml-power-integral-of-average(gpu0)"  # no instantaneous field in this pynvml
    m.begin("decode")
    integral = m._counter.__self__  # the PowerIntegral behind the meter
    w.advance(1.0, 0.0)
    integral.sample()
    w.advance(1.0, 0.0)
    integral.sample()
    w.advance(0.5, 0.0)
    out = m.end("decode")
    # trapezoids: (100+140)/2*1 + (140+180)/2*1 + (180+180)/2*0.5
    assert out.energy_j == 120.0 + 160.0 + 90.0 and out.time_s == 2.5


def test_nvml_refusing_everything_is_a_no_gpu_error():
    w = World()
    with pytest.raises(NoGPUError, match="refused both the total-energy counter .*Not Supported"):
        meters.nvml_meter(0, pynvml_module=fake_pynvml(w, counter=False, power_w=None))
    with pytest.raises(NoGPUError, match="NVML cannot open GPU 0: NVML Shared Library Not Found"):
        meters.nvml_meter(0, pynvml_module=fake_pynvml(w, init_fails=True))


def test_measured_gpu_meter_names_every_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    with pytest.raises(NoGPUError, match=r"zeus: .*; pynvml: reading NVML needs the 'pynvml' module"):
        meters.measured_gpu_meter(0)


def test_zeus_gpu_not_supported_maps_to_the_no_gpu_path(monkeypatch):
    exc_mod = types.ModuleType("zeus.device.exception")

    class ZeusGPUNotSupportedError(Exception):
        pass

    ZeusGPUNotSupportedError.__module__ = "zeus.device.exception"

    def monitor(**kwargs):
        raise ZeusGPUNotSupportedError("GPU 0 does not support energy measurement")

    zeus = types.ModuleType("zeus")
    zmon = types.ModuleType("zeus.monitor")
    zmon.ZeusMonitor = monitor
    for name, mod in (("zeus", zeus), ("zeus.monitor", zmon), ("zeus.device.exception", exc_mod)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(NoGPUError, match="ZeusGPUNotSupportedError: GPU 0 does not support"):
        ZeusMeter(0)
    # the auto meter then takes pynvml's counter
    w = World()
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(w))
    monkeypatch.setattr(meters, "_cuda_sync", lambda: (lambda: None))
    assert make_meter("auto").source == "measured:nvml-total-energy(gpu0)"
    # an unrelated bug inside Zeus is not swallowed
    zmon.ZeusMonitor = lambda **kw: (_ for _ in ()).throw(KeyError("libamd_smi.so"))
    with pytest.raises(KeyError):
        ZeusMeter(0)
    # ... but the measured meter still reads the counter through pynvml
    assert meters.measured_gpu_meter(0).source == "measured:nvml-total-energy(gpu0)"


def test_sm_clock_reader_reads_passively_and_is_none_when_refused():
    from refspec.energy.nvml_meter import sm_clock_reader

    nv = fake_pynvml(World())
    nv.NVML_CLOCK_SM = 1
    clocks = iter([345, 1980])
    nv.nvmlDeviceGetClockInfo = lambda handle, kind: (handle, kind) == ("h0", 1) and next(clocks)
    read = sm_clock_reader(0, pynvml_module=nv)
    assert read is not None and read() == 1980.0  # the probe took 345
    assert not [name for name in vars(nv) if "Set" in name or "Reset" in name]  # nothing that could change a clock
    refused = fake_pynvml(World())
    refused.nvmlDeviceGetClockInfo = lambda handle, kind: (_ for _ in ()).throw(FakeNVMLError("Not Supported"))
    assert sm_clock_reader(0, pynvml_module=refused) is None
    assert sm_clock_reader(0, pynvml_module=fake_pynvml(World(), init_fails=True)) is None
