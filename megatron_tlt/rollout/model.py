"""Inference forward of the dense Llama/Qwen2/Qwen3 decoder over a paged KV cache.

Pure math on plain tensors (`EngineWeights`); no nn.Module. All forward kinds —
prefill, decode, re-prefill after preemption and tree/chain verification — are one
varlen forward over a flattened batch of new tokens; they differ only in the
`AttentionMetadata` (see attention.py) and in which rows get logits.

Matches HF transformers numerics where it matters:
- RMSNorm in float32, `weight * normed.to(input_dtype)`;
- RoPE with HF's `rotate_half` convention, `inv_freq = 1 / theta^(2i/d)` in float32,
  cos/sin table in float32 cast to the compute dtype;
- Qwen3 q/k RMSNorm per head over head_dim *before* RoPE;
- SwiGLU `down(silu(gate(x)) * up(x))`; tied embeddings share one tensor.

Deviation, on purpose: with `batch_invariant=True` (the default; CPU reference path) every
matmul over tokens runs in fixed 16-row tiles, so a token's result does not depend on how
many other tokens share the batch (CPU BLAS picks different summation orders for
different M). With it, the same seed gives the same tokens across batch compositions
and across preemption/re-prefill. GPU kernels will need their own batch-invariant mode.

Hidden states for drafter training (`return_hidden=True`):
- `hidden_final`: after the final RMSNorm — exactly what the LM head multiplies
  (HF `output_hidden_states[-1]`); what our EAGLE-1/2-style drafter consumes;
- `hidden_pre_norm`: the residual stream after the last decoder layer, before the final
  norm.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from megatron_tlt.models.arch import ModelArch
from megatron_tlt.rollout.attention import AttentionMetadata, TorchPagedAttention, write_kv
from megatron_tlt.rollout.kv_cache import PagedKVCache
from megatron_tlt.rollout.weights import EngineWeights

_TILE = 16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., n], weight: [n]."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rope_table(max_positions: int, head_dim: int, theta: float,
               device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [max_positions, head_dim] float32, HF default-RoPE convention."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor,  # [T, heads, head_dim]
               cos: torch.Tensor,  # [T, head_dim]
               sin: torch.Tensor,  # [T, head_dim]
               ) -> torch.Tensor:
    cos = cos[:, None, :].to(x.dtype)
    sin = sin[:, None, :].to(x.dtype)
    return x * cos + _rotate_half(x) * sin


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, *,
           batch_invariant: bool = False) -> torch.Tensor:
    """x: [T, in], w: [out, in] -> [T, out]; in fixed 16-row tiles when batch_invariant."""
    if not batch_invariant or x.shape[0] == _TILE:
        return F.linear(x, w, b)
    t = x.shape[0]
    pad = (-t) % _TILE
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    out = torch.cat([F.linear(tile, w, b) for tile in x.split(_TILE)])
    return out[:t]


@dataclasses.dataclass
class ForwardOutput:
    logits: torch.Tensor  # [N, vocab] float32, rows = logits_indices
    hidden_final: torch.Tensor | None = None  # [T, hidden], after the final norm
    hidden_pre_norm: torch.Tensor | None = None  # [T, hidden], before the final norm


class InferenceModel:
    def __init__(self, arch: ModelArch, weights: EngineWeights, *, max_positions: int,
                 attention=None, batch_invariant: bool = True):
        self.arch = arch
        self.weights = weights
        self.attention = attention if attention is not None else TorchPagedAttention()
        self.batch_invariant = batch_invariant
        self.cos, self.sin = rope_table(max_positions, arch.head_dim, arch.rope_theta,
                                        weights.device)
        self.scale = arch.head_dim ** -0.5

    def _linear(self, x, w, b=None):
        return linear(x, w, b, batch_invariant=self.batch_invariant)

    @torch.no_grad()
    def forward(self,
                input_ids: torch.Tensor,  # [T] int64, new tokens of all sequences, flattened
                positions: torch.Tensor,  # [T] int64, RoPE positions
                kv_cache: PagedKVCache,
                meta: AttentionMetadata,
                logits_indices: torch.Tensor | None = None,  # [N] rows to compute logits for; None: all
                return_hidden: bool = False,
                ) -> ForwardOutput:
        a, w = self.arch, self.weights
        t = input_ids.shape[0]
        h, kvh, d = a.num_heads, a.num_kv_heads, a.head_dim
        cos, sin = self.cos[positions], self.sin[positions]
        x = w.embed[input_ids]  # [T, hidden]
        for layer, lw in enumerate(w.layers):
            residual = x
            y = rms_norm(x, lw.input_norm, a.rms_norm_eps)
            qkv = self._linear(y, lw.qkv_weight, lw.qkv_bias)  # [T, q_size + 2 * kv_size]
            q, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
            q = q.reshape(t, h, d)
            k = k.reshape(t, kvh, d)
            v = v.reshape(t, kvh, d)
            if lw.q_norm is not None:
                q = rms_norm(q, lw.q_norm, a.rms_norm_eps)
                k = rms_norm(k, lw.k_norm, a.rms_norm_eps)
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
            write_kv(kv_cache.k[layer], kv_cache.v[layer], meta.slot_mapping, k, v)
            o = self.attention.forward(q, kv_cache.k[layer], kv_cache.v[layer], meta, self.scale)
            x = residual + self._linear(o.reshape(t, h * d), lw.o_weight, lw.o_bias)
            residual = x
            y = rms_norm(x, lw.post_attn_norm, a.rms_norm_eps)
            gate, up = self._linear(y, lw.gate_up_weight).chunk(2, dim=-1)
            x = residual + self._linear(F.silu(gate) * up, lw.down_weight)
        pre_norm = x
        if return_hidden:
            final = rms_norm(x, w.final_norm, a.rms_norm_eps)
            sel = final if logits_indices is None else final[logits_indices]
        else:
            final = None
            sel = x if logits_indices is None else x[logits_indices]
            sel = rms_norm(sel, w.final_norm, a.rms_norm_eps)
        logits = self._linear(sel, w.lm_head).float()
        return ForwardOutput(logits=logits, hidden_final=final,
                             hidden_pre_norm=pre_norm if return_hidden else None)
