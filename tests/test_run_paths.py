"""docs/accounting.md's two paths from counter or model to the printed J/token are the files a
run really passes through: each listed file runs, and every energy file that runs is listed.

Two runs of ``python -m refspec.eval`` on a tiny model, in-process, with every Python call's file
recorded: the default CPU run (no RAPL counter here, so the roofline model on wall time, as on a
machine whose counter cannot be read) and a measured GPU run (NVML's counter through a stand-in
``pynvml`` whose counter advances at 300 W, since no GPU is here).
"""
from __future__ import annotations

import inspect
import re
import sys
import threading
import time
import types
from pathlib import Path


from test_eval_cli import QUIET, tiny  # noqa: F401  (the tiny model with a tokenizer, a fixture)

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "accounting.md"
ROW = re.compile(r"^\| \d+ \| `([^`]+)` \| \d+ \|", re.M)


def listed(title: str) -> list[str]:
    """The files of the table under the heading ``### {title}`` of docs/accounting.md."""
    text = DOC.read_text()
    start = text.index(f"### {title}")
    end = text.find("\n#", start + 4)
    return ROW.findall(text[start:end if end != -1 else None])


def traced(argv: list[str]) -> set[str]:
    """Repository-relative paths of the files whose functions ran during ``cli.main(argv)``."""
    from refspec.eval import cli

    seen: set[str] = set()

    def hook(frame, event, arg):
        if event == "call" and frame.f_code.co_flags & inspect.CO_NEWLOCALS:  # functions, not module bodies
            seen.add(frame.f_code.co_filename)

    sys.setprofile(hook)
    threading.setprofile(hook)
    try:
        assert cli.main(argv) == 0
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    out = set()
    for f in seen:
        try:
            out.add(Path(f).resolve().relative_to(ROOT).as_posix())
        except ValueError:
            pass  # outside the repository
    return out


def fake_pynvml(watts: float = 300.0) -> types.ModuleType:
    """A pynvml of one GPU whose total-energy counter (mJ) advances at ``watts`` on the host clock."""
    nv = types.ModuleType("pynvml")
    nv.NVMLError = type("NVMLError", (Exception,), {})
    t0 = time.perf_counter()
    nv.nvmlInit = nv.nvmlShutdown = lambda: None
    nv.nvmlDeviceGetHandleByIndex = lambda i: i
    nv.nvmlDeviceGetTotalEnergyConsumption = lambda h: int(1000 * watts * (time.perf_counter() - t0))
    return nv


def check(executed: set[str], path: list[str]) -> None:
    assert path, "the docs list this path"
    assert [f for f in path if f not in executed] == [], "listed but never ran"
    energy = {f for f in executed if f.startswith("refspec/energy/") and not f.endswith("__init__.py")}
    assert sorted(energy - set(path)) == [], "energy code that ran but is not listed"


def test_the_default_cpu_run_passes_through_the_listed_files(tiny, tmp_path, monkeypatch):  # noqa: F811
    from refspec.energy.meters import make
    from refspec.energy.meters.errors import NoCounterError

    def no_rapl(*a, **k):
        raise NoCounterError("no powercap here")

    monkeypatch.setattr(make, "rapl_counter", no_rapl)
    argv = ["--model", str(tiny["model"]), "--corpus", str(tiny["prompts"]), "--max-new-tokens", "6", *QUIET,
            "--batch", "2", "--requests", "4", "--out", str(tmp_path / "cpu")]
    check(traced(argv), listed("The default CPU run"))


def test_a_measured_gpu_run_passes_through_the_listed_files(tiny, tmp_path, monkeypatch):  # noqa: F811
    from refspec.eval import cli_plan

    monkeypatch.setattr(cli_plan, "_check_meter_device", lambda meter, device: None)  # the stand-in is the GPU
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    monkeypatch.setitem(sys.modules, "zeus", None)  # Zeus absent: NVML through pynvml, as on the lent GPU
    argv = ["--model", str(tiny["model"]), "--corpus", str(tiny["prompts"]), "--max-new-tokens", "6", *QUIET,
            "--batch", "2", "--requests", "4", "--meter", "nvml", "--phase-loops-s", "0.2",
            "--out", str(tmp_path / "gpu")]
    check(traced(argv), listed("A measured GPU run"))
