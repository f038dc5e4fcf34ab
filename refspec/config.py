"""Model architecture description, built from a Hugging Face ``config.json``.

``ModelArgs`` is the one architecture record every layer of refspec uses: the models build
themselves from it, the roofline model counts FLOPs and bytes from it, and the asset pipeline
writes it back as ``config.json``. It covers the llama, qwen2, qwen3 and gemma3 families and
the mixture-of-experts families qwen3_moe, mixtral and qwen2_moe (see :mod:`refspec.models.moe`).

Shape glossary used across refspec: B batch, S query length, T cache length, K draft length,
L layers, H / Hkv query / key-value heads, D head dim, E model dim, V vocab; for mixture-of-experts models X experts per layer, k_e experts routed per token.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Callable

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3", "qwen3_moe", "mixtral", "qwen2_moe")
MOE_FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe")


class ConfigError(ValueError):
    """A config.json that refspec cannot build a model from."""


def round_up(x: int, m: int) -> int:
    """``x`` rounded up to a multiple of ``m`` (cache sizes and attended keys come in buckets)."""
    return -(-x // m) * m


def read_json(path: Path, error: Callable[[str], Exception], *, missing: str, fix: str | None = None) -> Any:
    """The JSON document in ``path``, or the caller's typed error naming the file.

    Args:
        path: the file to read.
        error: the caller's error type (built from the message).
        missing: the whole message when ``path`` does not exist.
        fix: what to do about an unreadable or invalid file, appended after "; ".

    Raises:
        error: ``path`` is missing, unreadable (any other OSError) or not valid UTF-8 JSON.
    """
    tail = f"; {fix}" if fix else ""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(missing) from None
    except OSError as exc:
        raise error(f"{path} cannot be read: {exc}{tail}") from None
    except ValueError as exc:  # JSONDecodeError, and UnicodeDecodeError for a file that is not text
        raise error(f"{path} is not valid JSON: {exc}{tail}") from None


def _moe_fields(cfg: dict[str, Any], family: str, layers: int) -> dict[str, Any]:
    """Expert settings of a qwen3_moe, mixtral or qwen2_moe config (transformers 5 writes
    ``num_experts`` as ``num_local_experts``; both are read)."""
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if not experts or "num_experts_per_tok" not in cfg:
        raise ConfigError(f"a {family} config.json needs num_experts (num_local_experts) and num_experts_per_tok")
    out: dict[str, Any] = dict(num_experts=int(experts), num_experts_per_tok=int(cfg["num_experts_per_tok"]))
    if family == "mixtral":  # every layer routed, expert width = intermediate_size, top-k always renormalised
        out.update(moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True)
        return out
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    only = set(cfg.get("mlp_only_layers") or ())
    if family == "qwen2_moe":  # q/k/v biases, no q/k norms, a gated shared expert
        out.update(attention_bias=bool(cfg.get("qkv_bias", True)),
                   shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 0) or 0))
    else:
        out.update(qk_norm=True, attention_bias=bool(cfg.get("attention_bias", False)))
    out.update(moe_intermediate_size=int(cfg.get("moe_intermediate_size", cfg["intermediate_size"])),
               norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
               dense_layers=tuple(i for i in range(layers) if i in only or (i + 1) % step))
    return out


def _scaling_or_none(params: dict[str, Any] | None) -> dict[str, Any] | None:
    if not params:
        return None
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return None
    return {k: v for k, v in params.items() if k != "rope_theta"}


def _rope_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Rotary settings from either config style (``rope_theta``/``rope_scaling`` of
    transformers 4, or ``rope_parameters`` of transformers 5, per layer type for gemma3)."""
    params = cfg.get("rope_parameters")
    out: dict[str, Any] = {}
    if params and "full_attention" in params:
        full, local = params["full_attention"], params.get("sliding_attention", {})
        out["rope_theta"] = float(full.get("rope_theta", 1e6))
        out["rope_scaling"] = _scaling_or_none(full)
        out["rope_local_theta"] = float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
        return out
    if params:
        out["rope_theta"] = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        out["rope_scaling"] = _scaling_or_none(params)
    else:
        out["rope_theta"] = float(cfg.get("rope_theta", 10000.0))
        out["rope_scaling"] = _scaling_or_none(cfg.get("rope_scaling"))
    out["rope_local_theta"] = float(cfg.get("rope_local_base_freq", 10000.0))
    return out


def _gemma3_fields(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    """Gemma 3's norms, scalings, soft-caps and its sliding/full layer pattern."""
    types = cfg.get("layer_types")
    if types is None:
        pattern = cfg.get("sliding_window_pattern", 6)
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    return dict(qk_norm=True, sandwich_norms=True, norm_plus_one=True, embed_scale=True, hidden_act="gelu_tanh",
                query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"), sliding_window=cfg.get("sliding_window", 512),
                final_logit_softcapping=cfg.get("final_logit_softcapping"),
                attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
                layer_types=tuple("sliding" if t.startswith("sliding") else "full" for t in types))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelArgs:
    """Architecture of a decoder-only transformer (all sizes in elements, not bytes)."""

    family: str
    vocab_size: int
    hidden_size: int  # E
    intermediate_size: int
    num_layers: int  # L
    num_heads: int  # H
    num_kv_heads: int  # Hkv
    head_dim: int  # D
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_local_theta: float = 10000.0  # gemma3 sliding layers
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qwen2: bias on q, k, v
    qk_norm: bool = False  # qwen3, gemma3
    sandwich_norms: bool = False  # gemma3: four norms per block
    norm_plus_one: bool = False  # gemma3: RMSNorm scales by (1 + w)
    embed_scale: bool = False  # gemma3: embeddings times sqrt(E)
    hidden_act: str = "silu"  # silu | gelu_tanh
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # per layer: "full" or "sliding"
    query_pre_attn_scalar: float | None = None  # gemma3 attention scale
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    num_experts: int = 0  # X, routed experts per MoE layer (0: a dense model)
    num_experts_per_tok: int = 0  # k_e, experts each token is routed to
    moe_intermediate_size: int = 0  # MLP width of one expert
    norm_topk_prob: bool = False  # renormalise the k_e routing weights to sum to 1 (mixtral always)
    dense_layers: tuple[int, ...] = ()  # MoE families: layers with a dense MLP (intermediate_size) instead
    shared_expert_intermediate_size: int = 0  # qwen2_moe: an always-on expert of this width, sigmoid-gated

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(f"unknown family {self.family!r}; refspec supports {FAMILIES}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if self.family in MOE_FAMILIES and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"{self.family} needs 1 <= num_experts_per_tok <= num_experts, got "
                              f"{self.num_experts_per_tok} of {self.num_experts}")

    # ---- derived sizes -------------------------------------------------------------------
    def is_sliding(self, layer: int) -> bool:
        """Whether ``layer`` uses sliding-window attention."""
        return bool(self.layer_types) and self.layer_types[layer] == "sliding"

    @property
    def is_moe(self) -> bool:
        """Whether any layer routes tokens to experts."""
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is a routed mixture of experts."""
        return self.is_moe and layer not in self.dense_layers

    def moe_layers(self, layers: int | None = None) -> int:
        """MoE layers among the first ``layers`` (default all)."""
        n = self.num_layers if layers is None else layers
        return sum(self.is_moe_layer(i % self.num_layers) for i in range(n))

    @property
    def attn_scale(self) -> float:
        base = self.query_pre_attn_scalar if self.query_pre_attn_scalar else self.head_dim
        return 1.0 / math.sqrt(base)

    def num_parameters(self, include_embedding: bool = True, active: bool = False) -> int:
        """Parameter count (the LM head counts once when tied; routers count; ``active``: only
        k_e experts per MoE layer)."""
        e, d = self.hidden_size, self.head_dim
        attn = e * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.attention_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        norms = e * (4 if self.sandwich_norms else 2) + (2 * d if self.qk_norm else 0)
        moe = self.moe_layers()
        experts = self.num_experts if active is False else self.num_experts_per_tok
        shared = 3 * e * self.shared_expert_intermediate_size + (e if self.shared_expert_intermediate_size else 0)
        mlp = (3 * e * self.intermediate_size * (self.num_layers - moe)
               + moe * (self.num_experts * e + shared + experts * 3 * e * self.moe_intermediate_size))
        total = self.num_layers * (attn + norms) + mlp + e
        if include_embedding:
            total += self.vocab_size * e * (1 if self.tie_word_embeddings else 2)
        return total

    def active_parameters(self, include_embedding: bool = True) -> int:
        """Parameters one token reads: every expert-free weight and k_e experts per MoE layer."""
        return self.num_parameters(include_embedding, active=True)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one context token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    # ---- (de)serialisation ------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArgs":
        """Build from a Hugging Face ``config.json`` dictionary."""
        if "text_config" in cfg:  # multimodal Gemma 3 wrapper
            cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", "gemma3_text")}
        mt = cfg.get("model_type", "")
        family = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                  "gemma3_text": "gemma3", "gemma3": "gemma3", "qwen3_moe": "qwen3_moe", "mixtral": "mixtral",
                  "qwen2_moe": "qwen2_moe"}.get(mt)
        if family is None:
            raise ConfigError(f"model_type {mt!r} is not supported; refspec loads llama, qwen2, qwen3, gemma3_text, "
                              f"qwen3_moe, mixtral and qwen2_moe")
        try:
            hidden = cfg["hidden_size"]
            heads = cfg["num_attention_heads"]
            layers = cfg["num_hidden_layers"]
            kw: dict[str, Any] = dict(
                family=family,
                vocab_size=cfg["vocab_size"],
                hidden_size=hidden,
                intermediate_size=cfg["intermediate_size"],
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=cfg.get("num_key_value_heads", heads),
                head_dim=cfg.get("head_dim") or hidden // heads,
            )
        except KeyError as exc:
            raise ConfigError(f"config.json lacks the field {exc.args[0]!r}") from None
        kw["rms_norm_eps"] = cfg.get("rms_norm_eps", 1e-6)
        kw.update(_rope_fields(cfg))
        kw["max_position_embeddings"] = cfg.get("max_position_embeddings", 8192)
        kw["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", family == "gemma3"))
        eos = cfg.get("eos_token_id")
        kw["eos_token_ids"] = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        kw["bos_token_id"] = cfg.get("bos_token_id")
        kw["pad_token_id"] = cfg.get("pad_token_id")
        if family == "llama":
            kw["attention_bias"] = bool(cfg.get("attention_bias", False))
        if family == "qwen2":
            kw["attention_bias"] = True
            kw["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", False))
        if family == "qwen3":
            kw["qk_norm"] = True
            kw["attention_bias"] = bool(cfg.get("attention_bias", False))
        if family in MOE_FAMILIES:
            kw.update(_moe_fields(cfg, family, layers))
        if family == "gemma3":
            kw.update(_gemma3_fields(cfg, layers))
        elif (cfg.get("use_sliding_window") or family == "mixtral") and cfg.get("sliding_window"):
            raise ConfigError("sliding-window attention is only supported for gemma3 in refspec")
        act = cfg.get("hidden_act") or cfg.get("hidden_activation")
        if family != "gemma3" and act not in (None, "silu"):
            raise ConfigError(f"hidden_act {act!r} is not supported for {family}")
        return cls(**kw)

    def to_hf_config(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` dictionary that ``from_hf_config`` reads back."""
        model_type = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}.get(
            self.family, self.family)
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "gemma3": "Gemma3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}[self.family]
        cfg: dict[str, Any] = {
            "architectures": [arch],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "float32",
        }
        if self.family == "llama":
            cfg.update(hidden_act="silu", attention_bias=self.attention_bias, mlp_bias=False)
        elif self.family in ("qwen2", "qwen3"):
            cfg.update(hidden_act="silu", use_sliding_window=False, sliding_window=None)
            if self.family == "qwen3":
                cfg["attention_bias"] = self.attention_bias
        elif self.family in MOE_FAMILIES:
            cfg.update(hidden_act="silu", sliding_window=None, num_experts_per_tok=self.num_experts_per_tok)
            if self.family == "mixtral":
                cfg["num_local_experts"] = self.num_experts
            else:
                cfg.update(num_experts=self.num_experts, moe_intermediate_size=self.moe_intermediate_size,
                           norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=1,
                           mlp_only_layers=list(self.dense_layers), attention_bias=self.attention_bias,
                           use_sliding_window=False)
                if self.family == "qwen2_moe":
                    cfg.update(qkv_bias=cfg.pop("attention_bias"),
                               shared_expert_intermediate_size=self.shared_expert_intermediate_size)
        else:
            cfg.update(
                hidden_activation="gelu_pytorch_tanh",
                query_pre_attn_scalar=self.query_pre_attn_scalar or self.head_dim,
                sliding_window=self.sliding_window,
                rope_local_base_freq=self.rope_local_theta,
                layer_types=["sliding_attention" if t == "sliding" else "full_attention" for t in self.layer_types],
                final_logit_softcapping=self.final_logit_softcapping,
                attn_logit_softcapping=self.attn_logit_softcapping,
                attention_bias=False,
            )
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelArgs":
        """Read a ``config.json`` (or the directory holding one)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        return cls.from_hf_config(read_json(p, ConfigError, missing=f"no config.json at {p}"))
