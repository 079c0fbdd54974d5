"""Megatron-Core core attention through `torch.nn.functional.scaled_dot_product_attention`.

Without Transformer Engine the actor uses Megatron-Core's local layer spec, whose
`DotProductAttention` materialises the [b, heads, s, s] scores (a baddbmm, a softmax in
float32, a bmm): at the SFT benchmark's 2049-token rows that is memory traffic on the
order of the dense layers' time. `SDPADotProductAttention` is the same module (same
parameters, scale, GQA grouping, dropout, Megatron's mask convention: True = masked,
None = causal) with the score/softmax/context part in one SDPA call, which picks a fused
kernel on the GPU (flash for the plain causal case, memory-efficient with a mask).

Opt-in with MEGATRON_TLT_SDPA_ATTENTION=1 (`layer_spec` reads it) until timed on a GPU.
A query row whose mask hides every key gives NaN here (Megatron's fills -10000 and
returns a uniform row); the packer never builds one (data/packing.py: the padding tail
is a segment of its own).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention

SDPA_ENV = "MEGATRON_TLT_SDPA_ATTENTION"


def sdpa_enabled() -> bool:
    raw = os.environ.get(SDPA_ENV, "0")
    if raw not in ("0", "1"):
        raise ValueError(f"{SDPA_ENV} must be 0 or 1, got {raw!r}")
    return raw == "1"


class SDPADotProductAttention(DotProductAttention):
    """DotProductAttention with the attention itself in one SDPA call (module docstring)."""

    def forward(self, query: torch.Tensor,  # [sq, b, np, hn]
                key: torch.Tensor,  # [sk, b, ng, hn]
                value: torch.Tensor,  # [sk, b, ng, hn]
                attention_mask: torch.Tensor | None,  # [b, 1, sq, sk] bool, True = masked; None: causal
                attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPADotProductAttention: no packed_seq_params / attention_bias "
                                      "(pass a block mask instead, as data/packing.py does)")
        if self.softmax_offset is not None or self.scale_mask_softmax.window_size is not None:
            raise NotImplementedError("SDPADotProductAttention: vanilla softmax, no window attention")
        rep = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        mask = None if attention_mask is None else ~attention_mask
        p = self.attention_dropout.p if self.training else 0.0
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                             is_causal=attention_mask is None, scale=self.softmax_scale)
        sq, b = query.shape[0], query.shape[1]
        return ctx.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)
