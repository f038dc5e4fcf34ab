"""The lent GPU's command, rehearsed on a CPU in an environment shaped like that machine's image.

The device command (``bash scripts/gpu_check.sh``) runs on a copy of the checkout from a bare
virtual environment (no system site-packages) that sees only the packages the H200 image holds
(:data:`IMAGE`) and what they need, linked from this machine's install: no refspec (the copy
installs itself, offline, as it does there), no zeus, gguf or datasets. The grid is the short
one (``--quick``), so CI runs it in a few minutes; the figures are MODELLED and say so.
"""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IMAGE = ("torch", "transformers", "safetensors", "tokenizers", "numpy", "scipy", "matplotlib", "tqdm", "pytest",
         "nvidia-ml-py", "setuptools", "wheel", "pip")
"""What the lent H200's python holds (docs/gpu.md); a name not installed here is left out."""
IMAGE_LACKS = ("zeus", "gguf", "datasets")
FLAGS = ["--device", "cpu", "--quick", "--profile", "h200,h100"]


def _closure(names: tuple[str, ...]) -> set[str]:
    """The installed distributions ``names`` need, transitively (extras and markers that do not apply left out)."""
    from packaging.requirements import Requirement

    todo, seen = [n for n in names if _dist(n)], set()
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        for text in _dist(name).requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            if _dist(req.name):
                todo.append(req.name)
    return seen


def _dist(name: str):
    try:
        return md.distribution(name)
    except md.PackageNotFoundError:
        return None


def _image_view(dest: Path) -> Path:
    """A site-packages folder of symlinks to the image's distributions as installed here."""
    site = dest / "site-packages"
    site.mkdir(parents=True)
    for name in _closure(IMAGE):
        dist = _dist(name)
        top = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for entry in top:
            src = Path(dist.locate_file(entry))
            if src.exists() and not (site / entry).exists():
                (site / entry).symlink_to(src)
    return site


def _bare_venv(dest: Path, site: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True)
    purelib = subprocess.check_output([str(dest / "bin" / "python"), "-c",
                                       "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip()
    Path(purelib, "_image.pth").write_text(f"{site}\n")
    return dest / "bin" / "python"


def _copy_checkout(dest: Path) -> None:
    """What the device tool sends: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                         capture_output=True).stdout
    for f in (f for f in out.decode().split("\0") if f and (ROOT / f).is_file()):
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, dest / f)


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    # what the device tool sends is what git tracks (and does not ignore): the suite runs from a clone (README)
    assert shutil.which("git") is not None and (ROOT / ".git").exists(), "run the tests from a git clone (README)"
    tmp = tmp_path_factory.mktemp("rehearsal")
    copy, out = tmp / "checkout", tmp / "out"
    copy.mkdir()
    _copy_checkout(copy)
    python = _bare_venv(tmp / "bare", _image_view(tmp / "image"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(PYTHON=str(python), OUT=str(out), REFSPEC_VENV=str(tmp / "venv"), OMP_NUM_THREADS="1",
               PIP_NO_INDEX="1")
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", *FLAGS], cwd=copy, env=env, capture_output=True,
                          text=True, timeout=900)
    return {"proc": proc, "copy": copy, "out": out, "env": env, "python": tmp / "venv" / "bin" / "python"}


def test_the_device_command_installs_itself_and_answers_every_claim(rehearsal):
    proc, out = rehearsal["proc"], rehearsal["out"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["complete"] and Path(results["refspec_from"]) == rehearsal["copy"] / "refspec"
    claims = json.loads((out / "claims.json").read_text())
    assert [c["claim"] for c in claims] == list(range(1, 8))
    verdicts = {"holds", "fails", "not resolved", "not measurable here"}
    assert all(c["verdict"] in verdicts and c["sources"] and "checks" in c["figures"] for c in claims)
    assert claims[6]["verdict"] == "not measurable here"
    assert [o["profile"] for o in claims[0]["other_profiles"]] == ["h100"]  # both profiles in one pass
    variants = [v for v in results["variants"] if v["profile"] == "h200"]
    assert variants and all("error" not in v for v in variants) and not results["skipped"]
    assert {v["arch"] for v in variants} == {"llama-3.1-8b", "qwen3-8b"}  # two attention families
    assert all(v["summary"]["window_j_per_token"]["n"] == 2 for v in variants)  # two repeats, a spread each
    spec = [v for v in variants if v["k"]]
    assert all(v["phase_method"] == "attributed-loops" and v["loops"] for v in spec)
    assert {v["source"] for v in spec} == {"published", "small"}


def test_the_rehearsal_labels_every_figure_modelled_and_acceptance_injected(rehearsal):
    out = rehearsal["out"]
    results = json.loads((out / "results.json").read_text())
    assert results["energy_label"].startswith("MODELLED")
    assert all(v["energy_source"].startswith("modelled:") and not v["measured"] for v in results["variants"])
    assert all(v["injection"].startswith("ACCEPTANCE INJECTED") for v in results["variants"] if v["k"])
    md_text = (out / "claims.md").read_text()
    assert "MODELLED" in md_text and "INJECTED" in md_text and "| 7 | **not measurable here** |" in md_text
    assert results["dvfs_module_loaded"] is False


def test_the_outputs_fit_what_comes_back_from_the_lent_machine(rehearsal):
    out = rehearsal["out"]
    files = sorted(p.name for p in out.rglob("*") if p.is_file() and not p.name.startswith("."))
    assert {"paper.log", "claims.md", "claims.json", "results.json"} <= set(files) and len(files) <= 8, files
    assert all(p.parent == out and p.stat().st_size < 16 << 20 for p in out.rglob("*") if p.is_file())
    log = (out / "paper.log").read_text()
    assert f"refspec from {rehearsal['copy'] / 'refspec'}" in log and re.search(r"claim 7: not measurable here", log)


def test_the_image_python_lacks_what_the_image_lacks_and_every_module_imports(rehearsal):
    python, env = str(rehearsal["python"]), rehearsal["env"]
    for name in IMAGE_LACKS:
        probe = subprocess.run([python, "-c", f"import {name}"], env=env, capture_output=True, text=True)
        assert probe.returncode != 0 and "No module named" in probe.stderr, name
    code = ("import importlib, pkgutil, sys, refspec, refspec.drafters, refspec.eval, refspec.models\n"
            "for pkg in (refspec, refspec.models, refspec.drafters, refspec.eval):\n"
            "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
            "        if not m.name.endswith('__main__'): importlib.import_module(m.name)\n"
            f"assert not {set(IMAGE_LACKS)!r} & set(sys.modules)\n")
    proc = subprocess.run([python, "-c", code], cwd=rehearsal["copy"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
