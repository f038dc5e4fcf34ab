"""GGUF -> Hugging Face layout: ``config.json``, ``model.safetensors``, tokenizer files.

Every tensor is dequantized to float32 ``[out, in]``, renamed to its Hugging Face name,
llama's q/k row permutation is undone and gemma3's ``1 + w`` norms are shifted back;
``config.json`` is built from the GGUF metadata through :class:`refspec.config.ModelArgs`;
the tokenizer is built once with transformers and saved as ``tokenizer.json`` +
``tokenizer_config.json``. Weights are stored as float32 or bfloat16 (``storage_dtype``).
:func:`refspec.assets.fetch_model` converts each fetched GGUF once with :func:`convert_gguf`.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from refspec import __version__
from refspec.assets.registry import AssetError, _check_free_space, _sha256_file, _tqdm
from refspec.config import ModelArgs
from refspec.extras import require

log = logging.getLogger(__name__)


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
    kw.update(_family_options(meta, arch, family, kw, source))
    try:
        args = ModelArgs(**kw)
    except ValueError as exc:
        raise AssetError(f"{source}: inconsistent metadata: {exc}") from None
    _check_shapes(args, shapes, source)  # the metadata must describe the tensors exactly
    return args


def _family_options(meta: Any, arch: str, family: str, kw: dict[str, Any], source: Path | str) -> dict[str, Any]:
    """The :class:`ModelArgs` fields that depend on the family and on rope scaling."""
    a, out = arch + ".", {}
    scaling = meta.get(a + "rope.scaling.type", "none")
    if scaling == "linear":
        out["rope_scaling"] = {"rope_type": "linear", "factor": _f32(meta.get(a + "rope.scaling.factor"))}
    elif scaling not in ("none", None):
        raise AssetError(f"{source}: rope scaling {scaling!r} is not supported by the converter")
    if family == "qwen2" and not kw["attention_bias"]:
        raise AssetError(f"{source}: a qwen2 GGUF without attn_q.bias; the file is not a Qwen2 checkpoint")
    if family == "qwen3":
        out["qk_norm"] = True
    if family == "gemma3":
        layers, hidden, heads, head_dim = kw["num_layers"], kw["hidden_size"], kw["num_heads"], kw["head_dim"]
        pattern = meta.get(a + "attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):  # newer files: one flag per layer, True = sliding
            types = tuple("sliding" if s else "full" for s in pattern)
        else:
            types = tuple("full" if (i + 1) % int(pattern) == 0 else "sliding" for i in range(layers))
        out.update(
            qk_norm=True, sandwich_norms=True, norm_plus_one=True, embed_scale=True, hidden_act="gelu_tanh",
            sliding_window=int(meta.get(a + "attention.sliding_window")), layer_types=types,
            rope_local_theta=_f32(meta.get(a + "rope.freq_base_swa", 10000.0)),
            # llama.cpp's rule: attention scale 1/sqrt(head_dim), except Gemma 3 27B (62 layers)
            query_pre_attn_scalar=hidden // heads if layers == 62 else head_dim,
            final_logit_softcapping=meta.get(a + "final_logit_softcapping", None),
            attn_logit_softcapping=meta.get(a + "attn_logit_softcapping", None),
        )
    return out


def _check_shapes(args: ModelArgs, shapes: dict[str, tuple[int, ...]], source: Path | str) -> None:
    """Refuse a file whose tensors (by Hugging Face name) are not exactly what ``args`` describes."""
    want = expected_hf_shapes(args)
    got: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        if name == "rope_freqs.weight":
            raise AssetError(f"{source}: per-frequency rope factors (rope_freqs) are not supported")
        got[gguf_to_hf_name(args.family, name)] = shape
    if args.tie_word_embeddings:
        got.pop("lm_head.weight", None)
    missing, extra = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
    wrong = [f"{n}: file {got[n]} vs config {want[n]}" for n in sorted(want.keys() & got.keys()) if got[n] != want[n]]
    if missing or extra or wrong:
        raise AssetError(f"{source}: tensors do not match the metadata ({args.family}, {args.num_layers} layers): "
                         f"missing {missing[:6]}, unexpected {extra[:6]}, wrong shapes {wrong[:6]}")


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of ``attn_q`` / ``attn_k`` (weight or bias)."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def _hf_tensor(tensor: Any, args: ModelArgs) -> np.ndarray:
    """Dequantize one GGUF tensor into the float32 Hugging Face parameter ``[out, in]``."""
    quants = require("gguf.quants", "assets", "converting a GGUF model")

    w = np.asarray(quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
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
    gguf = require("gguf", "assets", "converting a GGUF model")

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
