"""Architecture description of the dense decoder families we support.

`ModelArch` is read from a Hugging Face `config.json` (Llama, Qwen2, Qwen3) and is
the one description every other module builds from: the Megatron-Core actor
(`models/mcore.py`), the HF <-> Megatron mapping (`models/hf_mapping.py`) and the
rollout engine's inference model. It is pure data: no torch modules here.

Deviations from HF, on purpose:
- `rope_scaling` of any type other than the default is refused (we do not implement
  YaRN/linear/dynamic/llama3 scaling yet, and silently ignoring it changes logits).
- Sliding-window attention (Qwen2/3 `use_sliding_window=True`) is refused likewise.
- The vocabulary is padded to a multiple of `VOCAB_PAD_MULTIPLE` (128) on the
  Megatron side. 128 is divisible by every power-of-two tensor-parallel size up to
  128, so one padded size serves every TP and a checkpoint written at one TP loads at
  another. Padded rows are zero and are stripped on export.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from megatron_tlt.errors import CheckpointError, ConfigError

VOCAB_PAD_MULTIPLE = 128

# HF `model_type` -> our family name. Families differ only in the flags below.
_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelArch:
    family: str
    """One of llama, qwen2, qwen3."""
    vocab_size: int
    """Tokenizer vocabulary size as in HF config.json (unpadded)."""
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    """Grouped-query attention: number of key/value heads (== num_heads for MHA)."""
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    """Qwen2: bias on the q, k and v projections (not on o)."""
    qk_norm: bool = False
    """Qwen3: RMSNorm over head_dim applied to q and k before RoPE."""
    torch_dtype: str = "float32"
    """dtype recorded in the HF config; the actor's compute dtype is set by config."""

    def __post_init__(self):
        if self.family not in _FAMILIES.values():
            raise ConfigError(f"model family {self.family!r} is not supported (supported: llama, qwen2, qwen3)")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"model {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameter count (unpadded vocabulary), as HF would count it."""
        h, v = self.hidden_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h

    def check_parallel(self, tp: int, pp: int) -> None:
        """Raise a ConfigError naming the values if the Megatron actor cannot hold this
        model or (tp, pp) cannot shard it."""
        if self.qkv_bias and self.family != "qwen2":
            # HF's attention_bias on llama / qwen3 biases o_proj too; the actor's output
            # projection has no bias (the rollout engine serves such a model, `generate`).
            raise ConfigError(f"attention_bias=true is not supported for training or conversion of "
                              f"{self.family} (it biases o_proj too, which the Megatron actor does not "
                              f"hold); `generate` serves such a model")
        if tp < 1 or pp < 1:
            raise ConfigError(f"tensor/pipeline parallel sizes must be >= 1, got tp={tp}, pp={pp}")
        if self.num_heads % tp:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"tensor_model_parallel_size ({tp})")
        if self.num_kv_heads % tp:
            raise ConfigError(
                f"num_key_value_heads ({self.num_kv_heads}) must be a multiple of "
                f"tensor_model_parallel_size ({tp})")
        if self.intermediate_size % tp:
            raise ConfigError(
                f"intermediate_size ({self.intermediate_size}) must be a multiple of "
                f"tensor_model_parallel_size ({tp})")
        if self.padded_vocab_size % tp:
            raise ConfigError(
                f"padded vocabulary ({self.padded_vocab_size}) must be a multiple of "
                f"tensor_model_parallel_size ({tp})")
        if self.num_layers % pp:
            raise ConfigError(
                f"num_hidden_layers ({self.num_layers}) must be a multiple of "
                f"pipeline_model_parallel_size ({pp})")

    # ---- HF config.json <-> ModelArch -------------------------------------------------

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], source: str = "config.json") -> "ModelArch":
        model_type = cfg.get("model_type")
        if model_type not in _FAMILIES:
            archs = cfg.get("architectures")
            raise ConfigError(
                f"{source}: unsupported architecture model_type={model_type!r} "
                f"(architectures={archs}); supported: {', '.join(_FAMILIES)}")
        family = _FAMILIES[model_type]
        rope_theta, rope_type = _rope(cfg, source)
        if rope_type not in (None, "default"):
            raise ConfigError(
                f"{source}: rope scaling type {rope_type!r} is not implemented; refusing to load "
                f"rather than silently changing the model (only default RoPE is supported)")
        if cfg.get("use_sliding_window"):
            raise ConfigError(f"{source}: use_sliding_window=true is not supported")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act={act!r} is not supported (only silu/SwiGLU)")
        if cfg.get("mlp_bias"):
            raise ConfigError(f"{source}: mlp_bias=true is not supported")
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            head_dim = cfg.get("head_dim") or hidden // heads
            if family == "qwen2":
                qkv_bias = True
            else:
                qkv_bias = bool(cfg.get("attention_bias", False))
            return cls(
                family=family,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=qkv_bias,
                qk_norm=(family == "qwen3"),
                torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            )
        except KeyError as e:
            raise ConfigError(f"{source}: missing required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"{source}: invalid value ({e})") from None

    @classmethod
    def from_hf_dir(cls, path: str) -> "ModelArch":
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isdir(path):
            raise CheckpointError(f"model directory not found: {path}")
        if not os.path.isfile(cfg_path):
            raise CheckpointError(f"no config.json in {path}")
        try:
            with open(cfg_path) as f:
                cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg_path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        return cls.from_hf_config(cfg, source=cfg_path)

    def to_hf_config(self) -> dict[str, Any]:
        arch_name = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                     "qwen3": "Qwen3ForCausalLM"}[self.family]
        cfg: dict[str, Any] = {
            "architectures": [arch_name],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.torch_dtype,
        }
        if self.family != "qwen2":
            cfg["attention_bias"] = self.qkv_bias
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelArch":
        return cls(**d)


def _rope(cfg: dict[str, Any], source: str) -> tuple[float, str | None]:
    """(theta, scaling type) from either the transformers<5 or >=5 config layout."""
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    theta = cfg.get("rope_theta")
    rope_type = None
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        rope_type = params.get("rope_type") or params.get("type")
    if isinstance(scaling, dict):
        rope_type = scaling.get("rope_type") or scaling.get("type") or "unknown"
    elif scaling is not None:
        raise ConfigError(f"{source}: rope_scaling={scaling!r} is not understood")
    return float(theta if theta is not None else 10000.0), rope_type
