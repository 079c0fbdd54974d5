"""Attention over the paged KV cache: metadata and the torch reference backend.

One attention call serves every forward kind. The new tokens of sequence b (rows
`query_start[b]:query_start[b+1]` of the flattened batch, Q of them) have had their K/V
written at the *last* Q of the `context_lens[b]` cache positions the sequence attends to.
Each new token sees

- every earlier cache position (the committed prefix), and
- among the Q new tokens: itself and its predecessors (causal; prefill, decode,
  re-prefill after preemption) or exactly what `tree_mask[b]` allows (verify).

The reference backend is the spec for the GPU kernels (Triton/FlashInfer-style paged
attention slots in behind the same `AttentionMetadata`). It loops over sequences in
Python, which is slow and fine: it runs on CPU for tests. With `precise=True` scores,
softmax and the value sum run in float64 and round to the compute dtype once; rounding
absorbs the dependence of BLAS summation order on shapes, so a token's attention output
is (up to ~1e-9-probability rounding ties) the same whether it is computed in a
prefill, a decode step or a re-prefill after preemption.
"""

from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass(kw_only=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot each new token's K/V is written to
    query_start: torch.Tensor  # [B + 1] int64: new tokens of seq b are rows query_start[b]:query_start[b+1]
    context_lens: torch.Tensor  # [B] int64: cache positions seq b attends to (new ones last)
    block_tables: torch.Tensor  # [B, max_blocks] int64: block ids, padded with 0
    tree_mask: torch.Tensor | None = None  # [B, Q, Q] bool: new token i sees new token j; None: causal
    host_query_start: list[int] | None = None
    """query_start as a host list when the builder had it (RolloutEngine._metadata): a
    backend that needs the lengths on the host reads them here instead of from the
    device, which would wait for every queued kernel, once per layer."""
    host_context_lens: list[int] | None = None
    """context_lens as a host list, likewise."""
    derived: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    """Tensors a backend derives from this metadata once per forward and reuses in every
    layer (e.g. the prefill's row index per group of equal lengths)."""

    def host_lengths(self) -> tuple[list[int], list[int]]:
        """(query_start, context_lens) as host lists: the builder's when it gave them, else
        read from the tensors (a device-to-host copy each)."""
        qs = self.host_query_start if self.host_query_start is not None else self.query_start.tolist()
        ctx = self.host_context_lens if self.host_context_lens is not None else self.context_lens.tolist()
        return qs, ctx

    @property
    def num_seqs(self) -> int:
        return self.context_lens.numel()

    @classmethod
    def make_dummy(cls, *, num_seqs: int = 1, num_new: int = 1, block_size: int = 16,
                   device: str | torch.device = "cpu") -> "AttentionMetadata":
        """Decode-shaped metadata: seq b owns block b and attends to its first `num_new`
        positions, all new. For tests and idle ranks."""
        assert num_new <= block_size
        pos = torch.arange(num_new)
        slots = torch.cat([b * block_size + pos for b in range(num_seqs)])
        return cls(slot_mapping=slots.to(device),
                   query_start=(torch.arange(num_seqs + 1) * num_new).to(device),
                   context_lens=torch.full((num_seqs,), num_new, dtype=torch.int64, device=device),
                   block_tables=torch.arange(num_seqs, dtype=torch.int64, device=device)[:, None])


def write_kv(k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
             v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
             slot_mapping: torch.Tensor,  # [T] int64
             k: torch.Tensor,  # [T, num_kv_heads, head_dim]
             v: torch.Tensor,  # [T, num_kv_heads, head_dim]
             ) -> None:
    kvh, d = k_cache.shape[-2:]
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


class TorchPagedAttention:
    """Reference paged attention (GQA: query head h reads KV head h // (H / KVH), as HF)."""

    name = "torch"

    def __init__(self, *, precise: bool = True):
        self.precise = precise

    def forward(self,
                q: torch.Tensor,  # [T, num_heads, head_dim], RoPE applied
                k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
                v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
                meta: AttentionMetadata,
                scale: float | None = None,
                ) -> torch.Tensor:  # [T, num_heads, head_dim]
        num_heads, head_dim = q.shape[1:]
        _, block_size, kvh, _ = k_cache.shape
        rep = num_heads // kvh
        scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
        work = torch.float64 if self.precise else torch.float32
        flat_k = k_cache.view(-1, kvh, head_dim)
        flat_v = v_cache.view(-1, kvh, head_dim)
        out = torch.empty_like(q)
        starts, lens = meta.host_lengths()
        for b in range(meta.num_seqs):
            qs, qe, ctx = starts[b], starts[b + 1], lens[b]
            n_new = qe - qs
            if n_new == 0:
                continue
            pos = torch.arange(ctx, device=q.device)
            slots = meta.block_tables[b, pos // block_size] * block_size + pos % block_size
            k = flat_k[slots].to(work).repeat_interleave(rep, dim=1).transpose(0, 1)  # [H, ctx, D]
            v = flat_v[slots].to(work).repeat_interleave(rep, dim=1).transpose(0, 1)  # [H, ctx, D]
            qb = q[qs:qe].to(work).transpose(0, 1)  # [H, n_new, D]
            scores = torch.matmul(qb, k.transpose(1, 2)) * scale  # [H, n_new, ctx]
            prefix = ctx - n_new
            if meta.tree_mask is not None:
                new_mask = meta.tree_mask[b, :n_new, :n_new].to(torch.bool)
            else:
                new_mask = torch.ones(n_new, n_new, dtype=torch.bool, device=q.device).tril()
            visible = torch.cat([torch.ones(n_new, prefix, dtype=torch.bool, device=q.device),
                                 new_mask], dim=1)  # [n_new, ctx]
            scores = scores.masked_fill(~visible, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[qs:qe] = torch.matmul(probs, v).transpose(0, 1).to(q.dtype)
        return out


BACKENDS = {"torch": TorchPagedAttention}


def make_backend(name: str, **kwargs):
    if name == "triton":  # imported on demand: needs triton (a GPU, or TRITON_INTERPRET=1)
        try:
            from megatron_tlt.rollout.triton_attention import TritonPagedAttention
        except ImportError as e:
            raise ValueError(f"attention backend 'triton' needs the triton package ({e})") from None
        return TritonPagedAttention(**kwargs)
    try:
        return BACKENDS[name](**kwargs)
    except KeyError:
        raise ValueError(f"attention backend {name!r} is not available "
                         f"(available: {', '.join(BACKENDS)}, triton)") from None
