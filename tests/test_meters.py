"""Energy meters with fake clocks and counters: exact windows, nesting, sources, and the GPU
counters' fallbacks and errors."""
from __future__ import annotations

import pickle
import sys
import types

import pytest
import torch

from refspec.config import ModelArgs
from refspec.energy.meters import make
from refspec.energy.meters.direct import FakeMeter, RooflineMeter, TimeMeter
from refspec.energy.meters.errors import MeterError, NoCounterError, NoGPUError
from refspec.energy.meters.make import make_meter, measured_gpu_counter
from refspec.energy.meters.measurement import Measurement
from refspec.energy.meters.nvml import PowerIntegral, nvml_counter, sm_clock_reader
from refspec.energy.meters.zeus import ZeusCounter
from refspec.energy.model.hardware import HardwareProfile
from refspec.energy.model.roofline import forward_cost
from refspec.energy.model.work import ForwardShape
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


def test_a_measurement_is_immutable_and_copies_carry_its_resolved_time():
    calls = []
    m = Measurement(lambda: calls.append(1) or 0.25, None, "measured:x", extra=(("energy_true_j", 2.0),))
    assert m.measured and not calls  # the time is resolved only when read
    clone = pickle.loads(pickle.dumps(m))
    assert calls == [1] and clone == m and clone.time_s == m.time_s == 0.25 and calls == [1]
    with pytest.raises(AttributeError, match="immutable"):
        m.energy_j = 1.0  # type: ignore[misc]


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_zeus_counter_without_gpu_is_a_clear_error():
    with pytest.raises(NoGPUError, match="torch.cuda.is_available"):
        ZeusCounter((0,))
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
    monkeypatch.setattr(make, "cpu_profile", lambda dtype_bytes=2: HardwareProfile(
        name="cpu-test", peak_flops=1e9, bandwidth_Bps=1e9, static_w=1, pj_per_flop=1, pj_per_byte=1, idle_w=1,
        benchmarked=True))
    monkeypatch.setattr(make, "_cuda_sync", lambda: None)
    auto = make_meter("auto", powercap_root="/nonexistent/powercap")  # no RAPL: the modelled CPU profile
    assert isinstance(auto, RooflineMeter)
    assert auto.source == "modelled:roofline(cpu-test,wall-time)" and auto.idle_w == 1
    with pytest.raises(ValueError):
        make_meter("fake")
    with pytest.raises(ValueError, match="unknown meter 'joules'"):
        make_meter("joules")
    with pytest.raises(NoCounterError, match="no readable intel-rapl zone"):
        make_meter("rapl", powercap_root="/nonexistent/powercap")


# ---- NVML through pynvml (no Zeus) and Zeus's "no GPU" errors ---------------------------------
class FakeNVMLError(Exception):
    pass


def fake_pynvml(world: World, *, init_fails: bool = False) -> types.ModuleType:
    """A stand-in for nvidia-ml-py's ``pynvml``: the counter is the World's energy (in mJ)."""
    nv = types.ModuleType("pynvml")
    nv.NVMLError = FakeNVMLError
    nv.calls = []

    def init():
        if init_fails:
            raise FakeNVMLError("NVML Shared Library Not Found")
        nv.calls.append("init")

    def total_energy(handle):
        assert handle == "h0"
        return int(round(world.e * 1000))

    nv.nvmlInit = init
    nv.nvmlShutdown = lambda: nv.calls.append("shutdown")
    nv.nvmlDeviceGetHandleByIndex = lambda i: f"h{i}"
    nv.nvmlDeviceGetTotalEnergyConsumption = total_energy
    return nv


def test_power_integral_is_the_exact_trapezoid_of_its_samples():
    w = World()
    power = iter([100.0, 140.0, 180.0, 180.0])
    integral = PowerIntegral(lambda: next(power), clock=w.clock)
    assert integral.energy() == 0.0  # the first sample starts the integral
    w.advance(1.0, 0.0)
    integral.sample()
    w.advance(1.0, 0.0)
    integral.sample()
    w.advance(0.5, 0.0)
    # trapezoids: (100+140)/2*1 + (140+180)/2*1 + (180+180)/2*0.5
    assert integral.energy() == 120.0 + 160.0 + 90.0 and integral.samples == 4


def test_nvml_that_cannot_start_is_a_no_gpu_error():
    with pytest.raises(NoGPUError, match="NVML cannot open GPU 0: NVML Shared Library Not Found"):
        nvml_counter((0,), pynvml_module=fake_pynvml(World(), init_fails=True))


def test_measured_gpu_counter_names_every_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    with pytest.raises(NoGPUError, match=r"zeus: .*; pynvml: reading NVML needs the 'pynvml' module"):
        measured_gpu_counter((0,))


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
        ZeusCounter((0,))
    # the auto meter then takes pynvml's counter
    w = World()
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(w))
    monkeypatch.setattr(make, "_cuda_sync", lambda: (lambda: None))
    assert make_meter("auto").source == "measured:nvml-total-energy(gpu0)"
    # an unrelated bug inside Zeus is not swallowed
    zmon.ZeusMonitor = lambda **kw: (_ for _ in ()).throw(KeyError("libamd_smi.so"))
    with pytest.raises(KeyError):
        ZeusCounter((0,))
    # ... but the measured counter is still read through pynvml
    assert measured_gpu_counter((0,)).source == "measured:nvml-total-energy(gpu0)"


def test_sm_clock_reader_reads_passively_and_is_none_when_refused():
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
