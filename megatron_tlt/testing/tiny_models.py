"""Tiny random Llama / Qwen2 / Qwen3 checkpoints written with `transformers`.

The defaults exercise what conversion and the actor must get right: a vocabulary
that is not a multiple of 128 (padding), grouped-query attention with 2 KV heads,
Qwen2's QKV bias, Qwen3's QK-norm, and both tied and untied embeddings.
"""

from __future__ import annotations

import os

import torch

FAMILIES = ("llama", "qwen2", "qwen3")


def tiny_hf_config(family: str, *, vocab_size: int = 250, hidden_size: int = 64, num_layers: int = 2,
                   num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 96,
                   tie_word_embeddings: bool = False, max_position_embeddings: int = 256):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    kw = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
              num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
              intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
              rms_norm_eps=1e-6, tie_word_embeddings=tie_word_embeddings, rope_theta=10000.0,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family != "qwen2":
        kw["head_dim"] = hidden_size // num_heads
    return cls(**kw)


def make_tiny_hf(path: str, family: str = "llama", seed: int = 0, dtype=torch.float32, **kw) -> str:
    """Write a random tiny HF model to `path` (safetensors) and return the path."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_hf_config(family, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():  # HF zero-inits biases and sets norms to 1: randomise all
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of an HF safetensors checkpoint directory (single file or shards)."""
    from pathlib import Path

    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out
