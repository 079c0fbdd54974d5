"""HF <-> Megatron-Core parameter names and layouts (unsharded, TP=1 view).

Megatron's global (TP-agnostic) layouts, which dist-checkpointing shards for any TP:
- `linear_qkv.weight` [(nq + 2 nkv) d, h]: grouped by KV head; group g holds its
  nq/nkv query heads, then k_g, then v_g. TP splits along dim 0 in whole groups.
- `linear_fc1.weight` [2 ffn, h]: [gate; up] (SwiGLU). Megatron's sharded state dict
  stores the two halves as separate shards, so TP re-splits each half.
- Vocabulary tensors are padded to `arch.padded_vocab_size` rows with zeros.

The local spec and the TransformerEngine spec differ only in where the two
pre-norms live (`te_names`). Everything here is a pure function of tensors; no
process groups.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from megatron_tlt.models.arch import ModelArch

# Megatron local-spec per-layer name -> TE-spec name.
_TE_RENAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def te_name(name: str) -> str:
    for local, te in _TE_RENAMES.items():
        if name.endswith("." + local):
            return name[: -len(local)] + te
    return name


def local_name(name: str) -> str:
    for local, te in _TE_RENAMES.items():
        if name.endswith("." + te):
            return name[: -len(te)] + local
    return name


def hf_names(arch: ModelArch) -> list[str]:
    """Every tensor name an HF checkpoint of this arch must hold."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not arch.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{x}_proj.weight" for x in ("q", "k", "v", "o")]
        if arch.qkv_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in ("q", "k", "v")]
        if arch.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    return names


def hf_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    h, d, ffn, v = arch.hidden_size, arch.head_dim, arch.intermediate_size, arch.vocab_size
    shapes = {}
    for n in hf_names(arch):
        if n in ("model.embed_tokens.weight", "lm_head.weight"):
            shapes[n] = (v, h)
        elif n.endswith("norm.weight") and ("q_norm" in n or "k_norm" in n):
            shapes[n] = (d,)
        elif n.endswith("layernorm.weight") or n == "model.norm.weight":
            shapes[n] = (h,)
        elif n.endswith("q_proj.weight"):
            shapes[n] = (arch.q_size, h)
        elif n.endswith(("k_proj.weight", "v_proj.weight")):
            shapes[n] = (arch.kv_size, h)
        elif n.endswith("q_proj.bias"):
            shapes[n] = (arch.q_size,)
        elif n.endswith(("k_proj.bias", "v_proj.bias")):
            shapes[n] = (arch.kv_size,)
        elif n.endswith("o_proj.weight"):
            shapes[n] = (h, arch.q_size)
        elif n.endswith(("gate_proj.weight", "up_proj.weight")):
            shapes[n] = (ffn, h)
        elif n.endswith("down_proj.weight"):
            shapes[n] = (h, ffn)
    return shapes


# ---- QKV grouping ------------------------------------------------------------------

def fuse_qkv(arch: ModelArch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """HF q/k/v ([nq d, ...], [nkv d, ...]) -> Megatron grouped [(nq + 2 nkv) d, ...]."""
    g, d = arch.num_kv_heads, arch.head_dim
    per = arch.num_heads // g
    rest = q.shape[1:]
    qg = q.reshape(g, per * d, *rest)
    kg = k.reshape(g, d, *rest)
    vg = v.reshape(g, d, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def split_qkv(arch: ModelArch, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d = arch.num_kv_heads, arch.head_dim
    per = arch.num_heads // g
    rest = qkv.shape[1:]
    grouped = qkv.reshape(g, (per + 2) * d, *rest)
    q, k, v = torch.split(grouped, [per * d, d, d], dim=1)
    return (q.reshape(arch.q_size, *rest).contiguous(), k.reshape(arch.kv_size, *rest).contiguous(),
            v.reshape(arch.kv_size, *rest).contiguous())


def pad_vocab(arch: ModelArch, w: torch.Tensor) -> torch.Tensor:
    pad = arch.padded_vocab_size - w.shape[0]
    if pad == 0:
        return w
    return torch.cat([w, w.new_zeros(pad, *w.shape[1:])], dim=0)


# ---- streaming conversion ----------------------------------------------------------

def mcore_names(arch: ModelArch) -> list[str]:
    """Megatron local-spec names of the full (PP=1) model."""
    names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight"]
    if not arch.tie_word_embeddings:
        names.append("output_layer.weight")
    for i in range(arch.num_layers):
        p = f"decoder.layers.{i}."
        names += [p + "input_layernorm.weight", p + "self_attention.linear_qkv.weight",
                  p + "self_attention.linear_proj.weight", p + "pre_mlp_layernorm.weight",
                  p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
        if arch.qkv_bias:
            names.append(p + "self_attention.linear_qkv.bias")
        if arch.qk_norm:
            names += [p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"]
    return names


def hf_to_mcore(arch: ModelArch, name: str, get_hf: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """The Megatron (local-spec, unsharded) tensor `name`, built from HF tensors."""
    if name == "embedding.word_embeddings.weight":
        return pad_vocab(arch, get_hf("model.embed_tokens.weight"))
    if name == "output_layer.weight":
        return pad_vocab(arch, get_hf("lm_head.weight"))
    if name == "decoder.final_layernorm.weight":
        return get_hf("model.norm.weight")
    parts = name.split(".")
    i, rest = int(parts[2]), ".".join(parts[3:])
    p = f"model.layers.{i}."
    simple = {
        "input_layernorm.weight": "input_layernorm.weight",
        "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
        "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
        "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
        "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    }
    if rest in simple:
        return get_hf(p + simple[rest])
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        return fuse_qkv(arch, *(get_hf(p + f"self_attn.{x}_proj.{kind}") for x in "qkv"))
    if rest == "mlp.linear_fc1.weight":
        return torch.cat([get_hf(p + "mlp.gate_proj.weight"), get_hf(p + "mlp.up_proj.weight")], dim=0)
    raise KeyError(f"no HF mapping for Megatron tensor {name!r}")


def layer_mcore_to_hf(arch: ModelArch, i: int,
                      get_mc: Callable[[str], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of layer i, from that layer's Megatron local-spec tensors."""
    p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
    yield p + "input_layernorm.weight", get_mc(m + "input_layernorm.weight")
    q, k, vv = split_qkv(arch, get_mc(m + "self_attention.linear_qkv.weight"))
    yield p + "self_attn.q_proj.weight", q
    yield p + "self_attn.k_proj.weight", k
    yield p + "self_attn.v_proj.weight", vv
    if arch.qkv_bias:
        qb, kb, vb = split_qkv(arch, get_mc(m + "self_attention.linear_qkv.bias"))
        yield p + "self_attn.q_proj.bias", qb
        yield p + "self_attn.k_proj.bias", kb
        yield p + "self_attn.v_proj.bias", vb
    if arch.qk_norm:
        yield p + "self_attn.q_norm.weight", get_mc(m + "self_attention.q_layernorm.weight")
        yield p + "self_attn.k_norm.weight", get_mc(m + "self_attention.k_layernorm.weight")
    yield p + "self_attn.o_proj.weight", get_mc(m + "self_attention.linear_proj.weight")
    yield p + "post_attention_layernorm.weight", get_mc(m + "pre_mlp_layernorm.weight")
    gate, up = torch.chunk(get_mc(m + "mlp.linear_fc1.weight"), 2, dim=0)
    yield p + "mlp.gate_proj.weight", gate.contiguous()
    yield p + "mlp.up_proj.weight", up.contiguous()
    yield p + "mlp.down_proj.weight", get_mc(m + "mlp.linear_fc2.weight")


def mcore_to_hf(arch: ModelArch, get_mc: Callable[[str], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) for every HF tensor, from Megatron local-spec tensors."""
    v = arch.vocab_size
    yield "model.embed_tokens.weight", get_mc("embedding.word_embeddings.weight")[:v]
    for i in range(arch.num_layers):
        yield from layer_mcore_to_hf(arch, i, get_mc)
    yield "model.norm.weight", get_mc("decoder.final_layernorm.weight")
    if not arch.tie_word_embeddings:
        yield "lm_head.weight", get_mc("output_layer.weight")[:v]
