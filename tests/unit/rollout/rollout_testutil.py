"""Test helpers for the rollout engine: tiny random HF models (Llama / Qwen2 / Qwen3), fp32,
saved as safetensors; engines over them; random prompts."""

import os

import pytest
import torch

from megatron_tlt.rollout import RolloutEngine, load_hf

FAMILIES = ("llama", "qwen2", "qwen3")


def triton_interpreter() -> pytest.MarkDecorator:
    """For a module of Triton-interpreter tests, called before it imports anything that
    imports triton: TRITON_INTERPRET=1 on a CPU-only machine, the whole module skipped
    without triton (CI); returns the module's pytestmark, which skips its tests where the
    interpreter is off (CUDA machines: tests/gpu covers the compiled kernels)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    return pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                              reason="Triton interpreter tests run on CPU-only machines")


def scattered_blocks(ctx_lens, page: int, g: torch.Generator, spare: int) -> tuple[torch.Tensor, int]:
    """Block tables [B, max_blocks] int64 holding each context (at least one block each) in
    randomly placed blocks of a cache of `total` blocks (`spare` unused); (tables, total)."""
    nblk = [max(1, -(-c // page)) for c in ctx_lens]
    total = sum(nblk) + spare
    perm = torch.randperm(total, generator=g)
    bt = torch.zeros(len(ctx_lens), max(nblk), dtype=torch.int64)
    at = 0
    for b, n in enumerate(nblk):
        bt[b, :n] = perm[at:at + n]
        at += n
    return bt, total


def make_hf_model(family: str, path: str, *, vocab_size: int = 300, tie: bool | None = None,
                  seed: int = 0, max_pos: int = 128, num_layers: int = 2):
    """Save a tiny random model with GQA (4 heads, 2 KV heads) and randomized norms."""
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM)
    cfg_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM),
                          "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                          "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[family]
    if tie is None:
        tie = family != "llama"
    cfg = cfg_cls(vocab_size=vocab_size, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=max_pos, rms_norm_eps=1e-6,
                  tie_word_embeddings=tie, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return model


def make_engine(model_dir: str, **kw) -> RolloutEngine:
    arch, weights = load_hf(model_dir)
    opts = dict(max_num_seqs=8, num_blocks=64, block_size=4)
    opts.update(kw)
    return RolloutEngine(arch, weights, **opts)


def prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def tiny_decode(block_tables: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor,
                *, num_blocks: int, num_splits: int = 2):
    """A two-layer Qwen2-shaped DecodeModel (hidden 64, 6 / 2 heads of 16, QKV bias; the
    fused RoPE attention unless MEGATRON_TLT_FUSED_ROPE=0 is set before the call), its
    weights, and run(): one decode forward of the batch (block size 4) over a fresh cache
    of random keys/values (seeded per layer, so every run sees the same cache)."""
    from megatron_tlt.models.arch import ModelArch
    from megatron_tlt.rollout import EngineWeights
    from megatron_tlt.rollout.gpu_model import DecodeModel
    from megatron_tlt.rollout.kv_cache import PagedKVCache
    from megatron_tlt.rollout.model import rope_table
    arch = ModelArch(family="qwen2", vocab_size=300, hidden_size=64, intermediate_size=96,
                     num_layers=2, num_heads=6, num_kv_heads=2, head_dim=16,
                     max_position_embeddings=256, tie_word_embeddings=True, qkv_bias=True)
    w = EngineWeights.make_dummy(arch, seed=3)
    cos, sin = rope_table(64, 16, 10000.0)
    model = DecodeModel(arch, w, cos, sin)
    slots = torch.stack([block_tables[b, p // 4] * 4 + p % 4 for b, p in enumerate(positions.tolist())])

    def run():
        cache = PagedKVCache(num_layers=2, num_kv_heads=2, head_dim=16, num_blocks=num_blocks,
                             block_size=4)
        for layer in range(2):
            g = torch.Generator().manual_seed(layer)
            cache.k[layer].copy_(torch.randn(cache.k[layer].shape, generator=g))
            cache.v[layer].copy_(torch.randn(cache.v[layer].shape, generator=g))
        return model.forward(token_ids, positions, slots, block_tables, positions + 1, cache,
                             num_splits=num_splits)
    return model, w, run
