"""The GPU check, rehearsed on a CPU.

The rehearsal runs the device command (``bash scripts/gpu_check.sh``) with ``--dry-run`` on a
copy of the checkout, from a python that holds only what the lent GPU machine's image holds:
no refspec installed (the copy installs itself, as there), and ``zeus``, ``gguf`` and
``datasets`` made unimportable by a ``sitecustomize`` blocker. The other tests call the
check's ``main`` in process to pin one behaviour each: the budget, a failing point, the
--require-measured-energy exit, labels, the $OUT limits, the ceilings.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check  # noqa: E402
from gpucheck import ceilings, grid, outputs, results  # noqa: E402

DEVICE_COMMAND = ["bash", "scripts/gpu_check.sh"]  # what the device tool runs, in the repository root
SIZES = ["--prompt-len", "16", "--new-tokens", "8", "--kv-bucket", "16"]
TINY = ["--blocks", "core", "--batches", "1,2", "--drafters", "none:0,eagle:3", "--corpora", "conversation", *SIZES]
LENT_IMAGE_LACKS = ("zeus", "gguf", "datasets")

BLOCKER = textwrap.dedent('''
    """Make this python look like the lent GPU image: these packages are missing."""
    import sys

    BLOCKED = {blocked!r}


    class _LentImageBlocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {{name!r}} (the lent GPU image lacks it)", name=name)
            return None


    sys.meta_path.insert(0, _LentImageBlocker())
''').format(blocked=set(LENT_IMAGE_LACKS))

IMPORT_EVERY_MODULE = textwrap.dedent('''
    import importlib, pkgutil, sys
    import refspec, refspec.drafters, refspec.eval, refspec.models
    names = []
    for pkg in (refspec, refspec.models, refspec.drafters, refspec.eval):
        for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if not m.name.endswith("__main__"):
                importlib.import_module(m.name)
                names.append(m.name)
    leaked = sorted({blocked!r} & set(sys.modules))
    assert not leaked, leaked
    print(len(names), "modules import without", {blocked!r})
''').format(blocked=set(LENT_IMAGE_LACKS))


def _copy_checkout(dest: Path) -> None:
    """The files the device tool sends: tracked and untracked-not-ignored ones (outside a git
    checkout, the source tree without caches and build outputs)."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                             capture_output=True).stdout
        files = [f for f in out.decode().split("\0") if f and (ROOT / f).is_file()]
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(ROOT, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
            ".git", "__pycache__", "*.egg-info", ".pytest_cache", ".venv", "venv", "build", "dist"))
        return
    for f in files:
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, dest / f)


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    """The device command with --dry-run on a copy, from a python shaped like the lent image."""
    tmp = tmp_path_factory.mktemp("rehearsal")
    copy, out, blocker = tmp / "checkout", tmp / "out", tmp / "blocker"
    copy.mkdir()
    blocker.mkdir()
    _copy_checkout(copy)
    (blocker / "sitecustomize.py").write_text(BLOCKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(PYTHONPATH=str(blocker), PYTHON=sys.executable, OUT=str(out), REFSPEC_VENV=str(tmp / "venv"),
               OMP_NUM_THREADS="1", PIP_NO_INDEX="1")
    proc = subprocess.run([*DEVICE_COMMAND, "--dry-run", "--skip-tests", *SIZES], cwd=copy, env=env,
                          capture_output=True, text=True, timeout=240)
    return {"proc": proc, "copy": copy, "out": out, "env": env, "venv_python": tmp / "venv" / "bin" / "python"}


def test_rehearsal_installs_itself_and_runs_every_block_of_the_grid(rehearsal):
    proc, out = rehearsal["proc"], rehearsal["out"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["complete"] and report["dry_run"]
    assert Path(report["refspec_from"]) == rehearsal["copy"] / "refspec"  # the copy's own install, nothing leaked
    want = [(b.name, batch, spec.label, corpus if spec.k else None) for b in grid.DRY_BLOCKS if b.available()
            and not b.eager for batch, spec, corpus in b.points()]
    assert [(p["block"], p["batch"], p["drafter_label"], p["corpus"]) for p in report["points"]] == want
    assert all("error" not in p for p in report["points"]) and report["skipped_points"] == []
    assert {p["arch"] for p in report["points"]} >= {"llama-3.1-8b", "qwen3-8b"}  # two attention families
    assert report["ceilings"]["gemm"]["best"] > 0 and report["ceilings"]["copy"]["best"] > 0
    assert report["roofline_profile"]["peak_flops"] == report["ceilings"]["gemm"]["best"]
    core = [p for p in report["points"] if p["block"] == "core"]
    assert all("split" in p["phase_energy"] for p in core)
    assert {p["batch"] for p in report["points"] if "eager" in p} == {1}  # the dry eager block: batch 1
    for batch in {p["batch"] for p in core}:  # one prefill loop per batch, whatever the drafter or corpus
        assert len({p["phase_energy"]["split"]["prefill_j_per_call"] for p in core if p["batch"] == batch}) == 1
    assert len(report["claims"]) == 7 and report["plots"] and len(report["plots"]) <= 4
    assert report["dvfs_module_loaded"] is False  # the check never imports the clock-setting module
    assert all(p["gpu_plan"]["planned_s"] > 0 for p in report["plan"])


def test_rehearsal_labels_its_energy_modelled(rehearsal):
    report = json.loads((rehearsal["out"] / "gpu_check.json").read_text())
    assert report["energy_measured"] is False and report["energy_source"].startswith("modelled:roofline(")
    assert all(p["energy_source"].startswith("modelled:") for p in report["points"])
    assert report["energy_label"].startswith("MODELLED")
    assert "MODELLED" in rehearsal["proc"].stdout
    assert all(p["acceptance_injected"] == bool(p["k"]) for p in report["points"])
    assert report["acceptance"]["injected"] and "ACCEPTANCE INJECTED" in report["acceptance"]["label"]
    assert all("acceptance INJECTED" in table for table in report["claims"].values())


def test_rehearsal_output_fits_what_comes_back(rehearsal):
    out = rehearsal["out"]
    files = sorted(p.name for p in out.rglob("*") if p.is_file())
    assert "gpu_check.log" in files and "gpu_check.json" in files and len(files) <= results.MAX_FILES, files
    log = (out / "gpu_check.log").read_text()
    assert f"refspec from {rehearsal['copy'] / 'refspec'}" in log and "[core] llama-3.1-8b batch 4, block 8, code" in log
    assert json.loads((out / "gpu_check.json").read_text())["out_problems"] == []


def test_rehearsal_python_lacks_what_the_image_lacks_and_every_module_imports(rehearsal):
    vpy, env = str(rehearsal["venv_python"]), rehearsal["env"]
    for name in LENT_IMAGE_LACKS:
        probe = subprocess.run([vpy, "-c", f"import {name}"], env=env, capture_output=True, text=True)
        assert probe.returncode != 0 and "lent GPU image lacks it" in probe.stderr
    proc = subprocess.run([vpy, "-c", IMPORT_EVERY_MODULE], cwd=rehearsal["copy"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


# ---- in process: one behaviour each ------------------------------------------------------------
def _main(tmp_path, *flags):
    code = gpu_check.main(["--dry-run", "--skip-tests", *TINY, "--out", str(tmp_path), *flags])
    return code, json.loads((tmp_path / "gpu_check.json").read_text())


def test_require_measured_energy_exits_when_only_a_model_is_available(tmp_path):
    code, report = _main(tmp_path, "--require-measured-energy")
    assert code == gpu_check.EXIT_MODELLED_ONLY == 3
    assert "only modelled energy is available" in report["error"] and "points" not in report


def test_a_failing_point_is_recorded_and_the_rest_run(tmp_path, monkeypatch):
    from gpucheck import point

    real = point.run_point
    saved_before = []

    def flaky(bench, args, batch, spec, corpus, **kw):
        saved_before.append(len(json.loads((tmp_path / "gpu_check.json").read_text()).get("points", [])))
        if (batch, spec.k) == (1, 3):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(bench, args, batch, spec, corpus, **kw)

    monkeypatch.setattr(point, "run_point", flaky)
    code, report = _main(tmp_path)
    assert code == 1
    assert saved_before == [0, 1, 2, 3]  # the file was rewritten after every point
    failed = [p for p in report["points"] if "error" in p]
    assert [(p["batch"], p["k"]) for p in failed] == [(1, 3)] and "simulated" in failed[0]["error"]
    assert len(report["points"]) == 4 and report["complete"]


def test_budget_stops_cleanly_between_points(tmp_path):
    code, report = _main(tmp_path, "--budget-s", "0")
    assert code == 0 and report["complete"] and report["points"] == []
    assert [(p["batch"], p["drafter"]) for p in report["skipped_points"]] == [
        (1, "none"), (1, "eagle k3"), (2, "none"), (2, "eagle k3")]


def test_energy_label_never_calls_a_model_measured():
    measured = [{"energy_source": "measured:nvml-total-energy(gpu0)"}]
    assert outputs.energy_label(measured) == "measured (nvml-total-energy(gpu0))"
    mixed = measured + [{"energy_source": "modelled:roofline(h200-sxm)"}]
    assert outputs.energy_label(mixed).startswith("MODELLED")


def test_out_problems_name_what_would_not_come_back(tmp_path):
    for i in range(9):
        (tmp_path / f"f{i}.txt").write_text("x")
    (tmp_path / "a" / "b" / "c").mkdir(parents=True)
    (tmp_path / "a" / "b" / "c" / "deep.txt").write_text("x")
    with open(tmp_path / "big.bin", "wb") as f:
        f.truncate(results.MAX_FILE_BYTES)
    problems = results.out_problems(tmp_path)
    assert len(problems) == 3 and "11 files" in problems[0]
    assert any("big.bin" in p for p in problems) and any("deep.txt" in p for p in problems)


def test_ceilings_are_positive_and_replace_the_profile_figures():
    from refspec.energy.hardware import H200_SXM

    c = ceilings.measure_ceilings(torch.device("cpu"), torch.float32, ceilings.CeilingShapes(
        copy_bytes=1 << 20, gemm_n=64, repeats=2, trials=2))
    assert c["gemm"]["best"] >= c["gemm"]["median"] > 0 and c["copy"]["best"] >= c["copy"]["median"] > 0
    prof = ceilings.profile_with_ceilings(H200_SXM, c)
    assert (prof.peak_flops, prof.bandwidth_Bps, prof.benchmarked) == (c["gemm"]["best"], c["copy"]["best"], True)
    assert prof.name == "h200-sxm@run-ceilings" and prof.static_w == H200_SXM.static_w


def test_phase_split_with_exact_loops_and_run():
    from gpucheck import phase_loops

    def loop(j_per_call, s_per_call, calls=8):
        w = {"calls": calls // 2, "time_s": s_per_call * calls / 2, "energy_j": j_per_call * calls / 2}
        return {"j_per_call": j_per_call, "s_per_call": s_per_call, "windows": [w, dict(w)],
                "energy_source": "measured:fake-counter"}

    loops = {"prefill": loop(5.0, 0.5), "draft": loop(0.5, 0.01), "verify": loop(3.0, 0.02)}
    # 10 steps of 3 drafts (1.5 J) + 1 verify (3 J): 45 J if additive; the run read 50 J
    run = {"energy_j": 50.0, "time_s": 0.5, "steps": 10, "forwards": {"draft": 30, "verify": 10},
           "phase_time_s": {"draft": 0.3, "verify": 0.2}}
    s = phase_loops.split(loops, run)
    assert s["loops_j_per_step"] == {"draft": 1.5, "verify": 3.0}
    assert s["loops_share"] == pytest.approx({"draft": 1 / 3, "verify": 2 / 3})
    assert s["additivity_residual"] == pytest.approx(-0.1) and not s["additive_within_5pct"]
    assert s["prefill_j_per_call"] == 5.0 and s["energy_source"] == "measured:fake-counter"
    # the loops' windows pin each phase's power (50 W draft, 150 W verify); the run adds a misfit
    assert s["fit_power_w"]["verify"] == pytest.approx(150.0, rel=0.05) and s["fit_relative_residual"] > 0


def test_phase_split_prices_serving_refills_per_row_of_the_prefill_loop():
    from gpucheck import phase_loops

    def loop(j_per_call, s_per_call, **extra):
        w = {"calls": 4, "time_s": s_per_call * 4, "energy_j": j_per_call * 4}
        return {"j_per_call": j_per_call, "s_per_call": s_per_call, "windows": [w], "energy_source": "measured:x",
                **extra}

    loops = {"prefill": loop(5.0, 0.5, rows=4), "draft": loop(0.5, 0.01), "verify": loop(3.0, 0.02)}
    run = {"energy_j": 50.0, "time_s": 0.75, "steps": 10, "forwards": {"draft": 30, "verify": 10},
           "calls": {"draft": 30, "verify": 10}, "prefill_rows": 2,
           "phase_time_s": {"draft": 0.3, "verify": 0.2, "prefill": 0.25}}
    s = phase_loops.split(loops, run)  # 2 refilled rows = half a 4-row prefill call: 2.5 J beside 45 J
    assert s["phases"] == ["draft", "verify", "prefill"]
    assert s["loops_j_per_step"] == pytest.approx({"draft": 1.5, "verify": 3.0, "prefill": 0.25})
    assert s["additivity_residual"] == pytest.approx(-0.05)
    assert s["loops_share"]["verify"] == pytest.approx(30 / 47.5)


def test_dry_run_points_carry_a_labelled_phase_split_and_eager_run(tmp_path):
    code, report = _main(tmp_path, "--blocks", "core,graphs-vs-eager", "--drafters", "block:4", "--batches", "1")
    assert code == 0 and len(report["points"]) == 1  # the eager block reuses the core point
    p = report["points"][0]
    eager = p["eager"]
    assert eager["runner_mode"] == "eager-static" and eager["graph_speedup"] > 0
    assert eager["energy_source"].startswith("modelled:")
    split = p["phase_energy"]["split"]
    assert p["schedule"] == "continuous" and p["drafter"] == "block"
    refills = p["run_window"]["prefill_rows"]  # batch 1 serving 4 requests: refills inside the window
    assert refills > 0 and split["phases"] == ["draft", "verify", "prefill"]
    assert sum(split["loops_share"].values()) == pytest.approx(1.0) and split["energy_source"].startswith("modelled:")
    assert set(p["phase_energy"]["loops"]) == {"prefill", "draft", "verify"}
    assert p["phase_energy"]["loops"]["draft"]["calls"] >= 4  # the recorded draft phase, repeated


def _bench(tmp_path, *flags):
    from gpucheck.bench import build_bench, load_target

    args = gpu_check.parse_args(["--dry-run", *TINY, "--out", str(tmp_path), *flags])
    bench = build_bench(args)
    load_target(bench, args, "llama-3.1-8b", max_batch=2, max_k=3)
    return args, bench


def test_sm_clock_is_read_passively_during_the_measured_run(tmp_path):
    from gpucheck.point import run_point

    args, bench = _bench(tmp_path, "--new-tokens", "40")
    assert bench.sm_clock is None  # a CPU has none
    reads = iter(range(1000, 2000))
    bench.sm_clock = lambda: float(next(reads))
    p = run_point(bench, args, 1, grid.NONE, "conversation")
    n = p["sm_clock_mhz"]["reads"]
    assert n == len([s for s in range(1, p["steps"] + 1) if s % 16 == 1]) >= 2
    assert (p["sm_clock_mhz"]["min"], p["sm_clock_mhz"]["max"]) == (1000.0, 1000.0 + n - 1)


# ---- the lent machine's clocks and power limits are never changed ------------------------------
class ReadOnlyNVML(types.ModuleType):
    """A ``pynvml`` whose reads answer and whose every setter, reset or clear fails the test."""

    NVML_CLOCK_SM = 1

    class NVMLError(Exception):
        pass

    def __init__(self) -> None:
        super().__init__("pynvml")
        self.calls: list[str] = []
        self.mj = 0

    def __getattr__(self, name: str):
        if name.startswith("nvml") and any(w in name for w in ("Set", "Reset", "Clear", "Apply")):
            raise AssertionError(f"the GPU check called {name}: lent GPUs' settings must never change")
        raise AttributeError(name)

    def _log(self, name: str, value=None):
        self.calls.append(name)
        return value

    def nvmlInit(self):
        return self._log("nvmlInit")

    def nvmlShutdown(self):
        return self._log("nvmlShutdown")

    def nvmlDeviceGetHandleByIndex(self, i):
        return self._log("nvmlDeviceGetHandleByIndex", f"h{i}")

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        self.mj += 1500
        return self._log("nvmlDeviceGetTotalEnergyConsumption", self.mj)

    def nvmlDeviceGetClockInfo(self, handle, kind):
        return self._log("nvmlDeviceGetClockInfo", 1980)


def test_the_gpu_path_only_reads_nvml(tmp_path, monkeypatch):
    from gpucheck import bench as bench_mod
    from gpucheck.phase_loops import isolated_loops
    from gpucheck.point import run_point
    from refspec.energy import nvml_meter

    nv = ReadOnlyNVML()
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.setitem(sys.modules, "zeus", None)  # the lent image has no zeus: pynvml's counter is read
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    real_idle = nvml_meter.CounterMeter.measure_idle_w
    monkeypatch.setattr(nvml_meter.CounterMeter, "measure_idle_w", lambda self, seconds=5.0: real_idle(self, 0.01))
    meter, note, idle_w = bench_mod._measured_meter(False)  # what build_bench does on a GPU
    assert meter.source == "measured:nvml-total-energy(gpu0)" and note.startswith("MEASURED") and idle_w > 0
    args, bench = _bench(tmp_path)
    bench.meter, bench.sm_clock = meter, nvml_meter.sm_clock_reader(0)
    p = run_point(bench, args, 2, grid.EAGLE3, "code")
    isolated_loops(bench, args, 2, grid.EAGLE3, p.pop("_recorder"), 0.02)
    assert p["energy_source"] == "measured:nvml-total-energy(gpu0)" and p["sm_clock_mhz"]["max"] == 1980
    assert nv.calls and all(c in ("nvmlInit", "nvmlShutdown") or c.startswith("nvmlDeviceGet") for c in nv.calls)


def test_no_file_of_the_check_can_set_a_clock_or_power_limit():
    files = [ROOT / "scripts" / "gpu_check.sh", ROOT / "scripts" / "gpu_check.py",
             *sorted((ROOT / "scripts" / "gpucheck").glob("*.py"))]
    setters = ("-lgc", "-rgc", "-pl ", "--lock-gpu-clocks", "--power-limit", "-pm ", "-c ", "nvmlDeviceSet",
               "nvmlDeviceReset", "set_gpu_locked_clocks", "set_power_management_limit", "from refspec.energy.dvfs",
               "import refspec.energy.dvfs", "energy import dvfs",
               "lock_sm_clocks", "dvfs_sweep")
    for f in files:
        text = f.read_text()
        code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
        found = [w for w in setters if w in code and not (w in ("-c ", "-pl ") and "nvidia-smi" not in code)]
        assert not found, f"{f.name} mentions {found}"
