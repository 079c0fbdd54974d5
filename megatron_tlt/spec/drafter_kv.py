"""The EAGLE drafter's KV cache at rollout time: one slot per sequence in preallocated
buffers, and attention of one query per sequence over its slot (`attend_one`).

Layout: K and V are [num_slots, capacity, kv_heads, head_dim]; a sequence owns one slot,
its committed pair t at index t, and a draft level's node at depth d at index
num_pairs + d - 1 (temporary: the next step's pairs overwrite it). Slot 0.. are handed out
lowest first; a released slot goes back to the free list and is zeroed when taken again.

Sizing: both dimensions grow geometrically (powers of two, `min_capacity` at least) and
never shrink. The proposer is built without the engine's limits (EagleProposer(drafter)),
and a fixed max_num_seqs x max_model_len allocation would be paid even by tests and by
short rollouts; doubling costs O(log) copies over a run, and between growths the shapes
are static (what a CUDA graph needs). The capacity is at most twice the longest sequence
seen (a 1.5B-shaped drafter: 2 KV heads x 128 x 2 (K, V) x 2 bytes = 1 KiB per token, so
256 sequences x 4096 tokens = 1 GiB; bf16 on the GPU).

Numerics: every query attends over the slot's whole capacity with a mask (masked
scores are -inf, so their softmax weights are exactly 0 and V there must be finite:
fresh and released slots are zero, draft-level V is written through nan_to_num). The
shapes of one query's reductions then depend only on the capacity, not on the batch
or on its own length, so a sequence drafts the same bits alone as in any batch of the
same capacity. They are NOT the bits of the former per-sequence attention over exactly
len keys: CPU BLAS picks its kernel and reduction blocking from the key count (measured:
q @ k^T, the softmax sum and p @ v over len keys differ in the last ulp from the same
over len + zero-padded keys), so no padded, batched form can reproduce them.
Chain levels on CUDA (`attend_one`) use the engine's Triton paged decode kernel instead,
each slot one page: it reads keys 0..last only, so it too is independent of the batch.
"""

from __future__ import annotations

import heapq
import os

import torch

from megatron_tlt.rollout.sampling import has_triton

QUERY_TILE = 16
"""Rows per sequence in the drafting graphs' extend (its pending pairs, padded;
spec/eagle_graph.py)."""


def paged_levels(q: torch.Tensor) -> bool:
    """Whether chain levels attend with the Triton paged kernel (SlotKV.attend_one): CUDA
    queries, Triton present, MEGATRON_TLT_DRAFT_PAGED_ATTN not 0."""
    return q.is_cuda and os.environ.get("MEGATRON_TLT_DRAFT_PAGED_ATTN", "1") != "0" and has_triton()


class SlotKV:
    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device, *,
                 min_capacity: int = 256):
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.min_capacity = min_capacity
        self.k = torch.zeros(0, min_capacity, kv_heads, head_dim, dtype=dtype, device=device)
        self.v = self.k.clone()
        self._free: list[int] = []  # heap
        self._next = 0  # slots below were handed out at least once

    @property
    def num_slots(self) -> int:
        return self.k.shape[0]

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    def acquire(self) -> int:
        if self._free:
            slot = heapq.heappop(self._free)
            self.k[slot].zero_()
            self.v[slot].zero_()
            return slot
        slot = self._next
        self._next += 1
        if slot >= self.num_slots:
            self._grow(max(8, 2 * self.num_slots), self.capacity)
        return slot

    def release(self, slot: int) -> None:
        heapq.heappush(self._free, slot)

    def reset(self) -> None:
        """Every slot free (zeroed when taken again); the buffers stay allocated."""
        self._free = list(range(self._next))
        heapq.heapify(self._free)

    def ensure_capacity(self, length: int) -> None:
        """Room for indices < length in every slot."""
        if length > self.capacity:
            cap = self.capacity
            while cap < length:
                cap *= 2
            self._grow(self.num_slots, cap)

    def _grow(self, slots: int, cap: int) -> None:
        k = torch.zeros(slots, cap, self.kv_heads, self.head_dim, dtype=self.dtype, device=self.device)
        v = torch.zeros_like(k)
        n, c = self.k.shape[:2]
        k[:n, :c] = self.k
        v[:n, :c] = self.v
        self.k, self.v = k, v

    def write(self, slots: torch.Tensor, index: torch.Tensor,  # [T] int64 each
              k: torch.Tensor, v: torch.Tensor) -> None:  # [T, kv_heads, head_dim]
        self.k.index_put_((slots, index), k)
        self.v.index_put_((slots, index), v)

    def attend_one(self, q: torch.Tensor,  # [N, heads, head_dim]: one query per row, RoPE applied
                   slots: torch.Tensor,  # [N] int64
                   last: torch.Tensor,  # [N] int64: the query sees keys 0..last
                   scale: float) -> torch.Tensor:  # [N, heads, head_dim]
        """One query per row (a drafted chain level). On CUDA with Triton: the engine's
        paged decode attention with each slot as one page of `capacity` tokens (one launch
        instead of ~12 torch ops, reading only keys 0..last; its own flash-style
        roundings, the same for a row alone or in any batch); elsewhere, or with
        MEGATRON_TLT_DRAFT_PAGED_ATTN=0, masked GQA attention over the slot's whole
        capacity (query head h reads KV head h // (H / KVH); a fixed number of ops). On
        the CPU the two products are broadcast multiplies and sums (the same fixed ops): a
        batched matmul over N rows may vectorise across the rows (MKL did on an AVX-512
        AMD EPYC, session 15), so a row's bits depended on how many rows shared the call;
        a sum's order per output element does not, and the CPU path is the
        batch-invariant reference."""
        if paged_levels(q):
            from megatron_tlt.rollout.triton_attention import paged_attention
            return paged_attention(q, self.k, self.v, slots[:, None], last + 1, scale=scale)
        cap = self.capacity
        seen = torch.arange(cap, device=q.device) <= last[:, None]  # [N, cap]
        return attend_masked(q, self.k.index_select(0, slots), self.v.index_select(0, slots), seen, scale)


def attend_masked(q: torch.Tensor,  # [N, heads, head_dim]: one query per row, RoPE applied
                  k: torch.Tensor,  # [N, S, kv_heads, head_dim]: each row's own keys
                  v: torch.Tensor,  # [N, S, kv_heads, head_dim]
                  seen: torch.Tensor,  # [N, S] bool: the keys the row's query sees
                  scale: float) -> torch.Tensor:  # [N, heads, head_dim]
    """Masked GQA attention of one query per row over its own S keys, a fixed number of
    ops (query head h reads KV head h // (H / KVH)); masked keys' weights are exactly 0,
    so their V must be finite. On the CPU the two products are broadcast multiplies and
    sums, which keep a row's bits independent of the other rows (SlotKV.attend_one)."""
    n, h, d = q.shape
    kvh, s = k.shape[2], k.shape[1]
    rep = h // kvh
    cpu = q.device.type == "cpu"
    qg = q.reshape(n, kvh, rep, d)
    kt = k.permute(0, 2, 1, 3)  # [N, KVH, S, D]
    if cpu:  # [N, KVH, rep, S, D] summed over D
        scores = (qg[:, :, :, None, :] * kt[:, :, None, :, :]).sum(-1) * scale
    else:
        scores = torch.matmul(qg, kt.transpose(2, 3)) * scale  # [N, KVH, rep, S]
    scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    vt = v.permute(0, 2, 1, 3)  # [N, KVH, S, D]
    if cpu:  # [N, KVH, rep, S, D] summed over S
        out = (probs[..., None] * vt[:, :, None, :, :]).sum(-2)
    else:
        out = torch.matmul(probs, vt)
    return out.reshape(n, h, d)  # [N, KVH, rep, D] -> [N, H, D]
