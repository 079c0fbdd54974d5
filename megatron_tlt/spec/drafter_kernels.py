"""The EAGLE drafter's layer through the decode model's Triton kernels (rollout/gpu_model.py,
triton_linear.py, triton_attention.py): the chain levels and extends of a CUDA engine's
drafter (EagleDrafter.kernel_layers; CPU tests under Triton's interpreter).

Why: on the H200 a drafted chain level cost ~120 us at batch 1, about 35 small kernels
around cuBLAS products that took ~49 us per layer forward against ~26 us of weight reads
(tools/profile_generate.py --kernels, benchmarks/results/gpu_2026-12-04_session17), and a
depth-6 chain was ~25 % of a speculative step. Here one forward of T rows is

    embedding, concat -> fc -> [fc bias + RMSNorm, x stored] -> QKV -> [QKV bias, q/k norm,
    RoPE, K and V written into the slots] -> paged attention -> o_proj -> [+ x, RMSNorm]
    -> gate_up -> [SiLU * up] -> down -> [+ x, final RMSNorm] -> head (float32 logits)

with each projection a bandwidth-shaped Triton GEMV with split-K planes that the next
bracketed kernel adds up (LinearPlanner's fastest row-local config: cuBLAS is not timed
here, its kernel choice depends on the row count; cuBLAS only above
MEGATRON_TLT_TRITON_ROWS rows, where no Triton config is planned, or where none runs on
the device); the post-attention add + RMSNorm in gate_up's prologue and SiLU * up in
down's where that timed faster, up to 8 rows (gpu_model.norm_linear / silu_linear):
about 15 launches, 13 with both prologues.

Same math as EagleDrafter.layer_qkv / layer_out / logits, rounded where the decode model's
kernels round (each projection's output once, after its bias; the residual sums; RMSNorm
in float32; RoPE per product), i.e. within bf16 rounding of the torch path, not its bits.
The eager chain path and the graphs' padded buckets compute the same bits: every kernel
is row-local, and the projections' configs are planned for the step's bucket (`rows`),
not for the rows one call happens to run (up to MEGATRON_TLT_TRITON_ROWS rows; a call
planned for more runs cuBLAS, whose rows may then differ in the last bits).

Non-finite values: V is written as computed (the torch path writes nan_to_num(V) and
fails the row from V's finiteness); here a non-finite K/V/q reaches the row's own
attention output, hence its logits, and the pick fails the row from those. A stale
non-finite V past a sequence's last pair is never read: the paged kernel reads keys
0..last only, and the next step's pairs overwrite those positions before any query sees
them (the masked torch attention over a slot's whole capacity would read them: this path
is only taken with the paged kernel, as chain levels on CUDA attend anyway).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_tlt.rollout.gpu_model import norm_linear, qkv_rope_write_kv, rms_norm, silu_linear
from megatron_tlt.rollout.triton_attention import paged_attention
from megatron_tlt.rollout.triton_linear import LinearPlanner, linear_into, linear_partials


def layer(d,  # EagleDrafter (its weights in the engine's dtype)
          tokens: torch.Tensor,  # [T] int64 target ids
          g: torch.Tensor,  # [T, hidden] fused feature or the drafter's own f
          positions: torch.Tensor,  # [T] int64 RoPE positions (within the drafter's table)
          kv,  # SlotKV
          slots: torch.Tensor,  # [T] int64
          index: torch.Tensor,  # [T] int64: K/V of row i go to kv[slots[i], index[i]]
          *, rows: int,  # plan the first half's projections for this many rows
          query: torch.Tensor | None = None,  # rows that go on (default: all)
          query_rows: int | None = None,  # plan the second half for this many rows
          slot_mapping: torch.Tensor | None = None,  # [T]: index + slots * kv.capacity, if at hand
          context_lens: torch.Tensor | None = None,  # [T]: index + 1, if at hand (no query)
          ) -> tuple[torch.Tensor, torch.Tensor]:  # f [Tq, hidden], logits [Tq, head_size] float32
    """One drafter layer forward with the head: every row's K/V written into its slot; the
    `query` rows attend over their slot's keys 0..index (their own included) and go on
    through the rest of the layer and the head. A caller running several levels may pass
    each level's flat K/V destinations and key counts, computed for all levels at once."""
    a = d.arch
    planner = d.planner if d.planner is not None else LinearPlanner.shared(g.device)
    eps = a.rms_norm_eps
    lay = d.layers[0]
    att, mlp = lay.self_attn, lay.mlp

    def proj(x, w, n):
        return linear_partials(x, w, planner.config(x, w, rows=n, row_local=True))

    emb = F.embedding(tokens, d.target_embed.detach())
    xin = torch.cat([emb.to(g.dtype), g], dim=-1)
    x = torch.empty(tokens.shape[0], a.hidden_size, dtype=g.dtype, device=g.device)
    y = rms_norm(proj(xin, d.fc.weight, rows), lay.input_layernorm.weight, eps, bias=d.fc.bias, sum_out=x)
    w_qkv, b_qkv = d._fused_qkv()
    if slot_mapping is None:
        slot_mapping = torch.add(index, slots, alpha=kv.capacity)
    q = qkv_rope_write_kv(proj(y, w_qkv, rows), positions, slot_mapping,
                          d.rope_cos, d.rope_sin, kv.k, kv.v, num_heads=a.num_heads,
                          num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, bias=b_qkv,
                          q_norm=att.q_norm.weight if a.qk_norm else None,
                          k_norm=att.k_norm.weight if a.qk_norm else None, eps=eps)
    n = rows
    if query is not None:
        q, x = q.index_select(0, query), x.index_select(0, query)
        slots, index = slots.index_select(0, query), index.index_select(0, query)
        n = query_rows if query_rows is not None else q.shape[0]
        context_lens = None
    if context_lens is None:
        context_lens = index + 1
    o = paged_attention(q, kv.k, kv.v, slots[:, None], context_lens, scale=d.scale)
    gate_up, x = norm_linear(planner, proj(o.reshape(o.shape[0], -1), att.o_proj.weight, n), x,
                             lay.post_attention_layernorm.weight, eps, d._fused_gate_up(),
                             bias=att.o_proj.bias, rows=n, row_local=True)
    h = silu_linear(planner, gate_up, mlp.down_proj.weight, x.dtype, rows=n, row_local=True)
    f = rms_norm(h, d.norm.weight, eps, residual=x)
    head = d.head_weight()
    logits = torch.empty(f.shape[0], head.shape[0], dtype=torch.float32, device=f.device)
    linear_into(f, head, logits, planner.config(f, head, split=False, rows=n, row_local=True))
    return f, logits
