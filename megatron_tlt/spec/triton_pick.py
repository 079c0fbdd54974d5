"""One chain level's sampled pick in one Triton kernel (the EAGLE drafter's GPU fast path);
also the greedy pick of argmax chains (`greedy_pick`, at the end).

Why: per level of a drafted chain the torch ops of a sampled pick (process_logits at
temperature T, the Exp(1) noise, the race, the draft distribution scattered into the
target vocabulary, the finiteness flag, the draft-to-target id map) are ~40 launches of
1-4 us; on the H200 a depth-4 chain at batch 1 replayed ~370 kernels in 0.9 ms, a third
of them in these picks (benchmarks/results/gpu_2026-12-03_session8). This kernel does a
level's pick for every row in one launch, writing straight into the chain's outputs.

What it computes, per row r (temperature T_r > 0; top-k and top-p off):
    s = lg / T_r (float32), q = exp(s - max s) / sum exp(s - max s)   (online max / sum)
    noise e_i = sampling.exponential_noise(key_r, draw_r + draw_offset)[i]   (same bits)
    token = argmax_i q_i / e_i over q_i > 0 (ties: lowest i; none: 0), mapped to target ids
    finite = every lg entry finite (and `ok_r`, when given)
    probs[r, ids[i]] = q_i   (the caller zeroes the other target-vocabulary entries)
These are this kernel's own roundings, not process_logits' bits (its softmax reduces in
another order and skips the second normalisation): within a few float32 ulps of it
(tests/unit/spec/test_triton_pick_interp.py, tests/gpu). Lossless all the same: the
token is drawn from exactly the q that is written (the race picks i with probability
q_i / sum q), and verification reads that q. Every CUDA drafting path (the chain graphs
and the eager chain) takes this kernel for these settings, so they agree bit for bit;
CPU keeps the torch ops (the exact reference path of the CPU tests). Taken where
`eagle_graph.fused_pick` says; kill switch MEGATRON_TLT_FUSED_PICK=0.

Imported only where triton is (CUDA paths, interpreter tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_tlt.rollout.triton_noise import _GOLDEN, _MIX1, _MIX2, _mix64, exp_noise_at
from megatron_tlt.rollout.triton_sample import _argmax_update

_BLOCK = 1024


@triton.jit
def _load_block(src, start, V: tl.constexpr, BLOCK: tl.constexpr):
    """Columns start..start + BLOCK of a row of V logits: (indices, in-row mask, float32
    values (0 past V), 1 per non-finite value else 0)."""
    idx = start + tl.arange(0, BLOCK)
    ok = idx < V
    x = tl.load(src + idx, mask=ok, other=0.0).to(tl.float32)
    return idx, ok, x, tl.where(ok & ~((x == x) & (tl.abs(x) < float("inf"))), 1, 0)


@triton.jit
def _store_pick(row, tok, bad, ids_ptr, tok_ptr, stride_tok, flag_ptr, stride_flag, ok_ptr,
                HAS_IDS: tl.constexpr, HAS_OK: tl.constexpr):
    """The row's token (mapped to target ids) and finiteness flag (no non-finite logit
    counted in `bad`, and the incoming ok)."""
    if HAS_IDS:
        tok = tl.load(ids_ptr + tok)
    tl.store(tok_ptr + row * stride_tok, tok)
    finite = tl.sum(bad, 0) == 0
    if HAS_OK:
        finite = finite & (tl.load(ok_ptr + row) != 0)
    tl.store(flag_ptr + row * stride_flag, finite.to(tl.int64))


@triton.jit
def _chain_pick_kernel(lg_ptr, stride_lg, temp_ptr, keys_ptr, stride_keys, draws_ptr, stride_draws,
                       draw_offset, ids_ptr,
                       probs_ptr, stride_probs, tok_ptr, stride_tok, flag_ptr, stride_flag, ok_ptr,
                       GOLDEN, M1, M2, TINY, V: tl.constexpr,
                       BLOCK: tl.constexpr, HAS_IDS: tl.constexpr, HAS_OK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(temp_ptr + row).to(tl.float32)
    src = lg_ptr + row * stride_lg
    # pass 1: online max and sum of exp of s = lg / T; count non-finite logits
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    z = tl.zeros((BLOCK,), tl.float32)
    bad = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, V, BLOCK):
        idx, ok, x, nonfinite = _load_block(src, start, V, BLOCK)
        bad += nonfinite
        s = tl.where(ok, x / t, float("-inf"))
        m_new = tl.maximum(m, s)
        z = z * tl.exp(m - m_new) + tl.exp(s - m_new)
        z = tl.where(m_new == float("-inf"), 0.0, z)
        m = m_new
    mx = tl.max(m, 0)
    zz = tl.sum(z * tl.exp(m - mx), 0)
    # pass 2: q, its scatter into the target vocabulary, the race
    key = tl.load(keys_ptr + row * stride_keys).to(tl.uint64, bitcast=True)
    draw = (tl.load(draws_ptr + row * stride_draws) + draw_offset).to(tl.uint64, bitcast=True)
    base = _mix64(key + (draw + 1) * GOLDEN, M1, M2)
    best = tl.full((), -1.0, tl.float32)
    best_i = tl.full((), 0, tl.int64)
    for start in range(0, V, BLOCK):
        idx, ok, x, _ = _load_block(src, start, V, BLOCK)
        q = tl.exp(x / t - mx) / zz
        if HAS_IDS:
            dst = tl.load(ids_ptr + idx, mask=ok, other=0)
        else:
            dst = idx.to(tl.int64)
        tl.store(probs_ptr + row * stride_probs + dst, q, mask=ok)
        score = q / exp_noise_at(base, idx, GOLDEN, M1, M2, TINY)
        score = tl.where(ok & (q > 0) & (score >= 0), score, -1.0)
        best, best_i = _argmax_update(score, idx, V, best, best_i)
    tok = tl.where(best >= 0, best_i, 0)
    _store_pick(row, tok, bad, ids_ptr, tok_ptr, stride_tok, flag_ptr, stride_flag, ok_ptr, HAS_IDS, HAS_OK)


def _check(name: str, lg: torch.Tensor, ids: torch.Tensor | None, ok: torch.Tensor | None) -> tuple[int, int]:
    """A pick's common input checks; returns (rows, draft vocabulary)."""
    b, v = lg.shape
    if lg.dtype != torch.float32 or lg.stride(-1) != 1:
        raise ValueError(f"{name}: lg must be float32 and contiguous in the last dim")
    if ok is not None and ok.stride(0) != 1:
        raise ValueError(f"{name}: ok must be contiguous")
    if ids is not None and ids.shape != (v,):
        raise ValueError(f"{name}: ids {tuple(ids.shape)} do not match the logits' {v} columns")
    return b, v


def chain_pick(lg: torch.Tensor,  # [B, V] float32 drafter logits (draft vocabulary)
               temperature: torch.Tensor,  # [B] float32, > 0
               keys: torch.Tensor,  # [B] int64 noise stream keys (any stride)
               draws: torch.Tensor,  # [B] int64 (any stride): the level draws number draws + draw_offset
               draw_offset: int,
               ids: torch.Tensor | None,  # [V] int64 draft -> target ids (None: identity)
               probs_out: torch.Tensor,  # [B, vocab] float32, zero outside ids (written at ids)
               tok_out: torch.Tensor,  # [B] int64 (any stride): target ids
               flag_out: torch.Tensor,  # [B] int64 (any stride): 1 where the row is finite
               ok: torch.Tensor | None = None,  # [B] bool: rows still finite before this level
               ) -> None:
    """One launch: tokens, flags and draft distributions of one chain level (module doc)."""
    b, v = _check("chain_pick", lg, ids, ok)
    if probs_out.stride(-1) != 1 or temperature.stride(0) != 1:
        raise ValueError("chain_pick: probs_out must be contiguous in the last dim, temperature contiguous")
    if b == 0:
        return
    _chain_pick_kernel[(b,)](
        lg, lg.stride(0), temperature, keys, keys.stride(0), draws, draws.stride(0), int(draw_offset),
        ids if ids is not None else keys,
        probs_out, probs_out.stride(0), tok_out, tok_out.stride(0), flag_out, flag_out.stride(0),
        ok if ok is not None else keys, _GOLDEN, _MIX1, _MIX2, torch.finfo(torch.float32).tiny, V=v,
        BLOCK=min(_BLOCK, max(16, triton.next_power_of_2(v))), HAS_IDS=ids is not None, HAS_OK=ok is not None,
        num_warps=4)


@triton.jit
def _greedy_pick_kernel(lg_ptr, stride_lg, ids_ptr, tok_ptr, stride_tok, flag_ptr, stride_flag, ok_ptr,
                        V: tl.constexpr, BLOCK: tl.constexpr, HAS_IDS: tl.constexpr, HAS_OK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    src = lg_ptr + row * stride_lg
    best = tl.full((), float("-inf"), tl.float32)
    best_i = tl.full((), 0, tl.int64)
    bad = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, V, BLOCK):
        idx, ok, x, nonfinite = _load_block(src, start, V, BLOCK)
        bad += nonfinite
        s = tl.where(ok & (x == x), x, float("-inf"))  # NaN never wins (its row fails anyway)
        best, best_i = _argmax_update(s, idx, V, best, best_i)
    _store_pick(row, best_i, bad, ids_ptr, tok_ptr, stride_tok, flag_ptr, stride_flag, ok_ptr, HAS_IDS, HAS_OK)


def greedy_pick(lg: torch.Tensor,  # [B, V] float32 drafter logits (draft vocabulary)
                ids: torch.Tensor | None,  # [V] int64 draft -> target ids (None: identity)
                tok_out: torch.Tensor,  # [B] int64 (any stride): target ids
                flag_out: torch.Tensor,  # [B] int64 (any stride): 1 where the row is finite
                ok: torch.Tensor | None = None,  # [B] bool: rows still finite before this level
                ) -> None:
    """One chain level's greedy pick in one launch (argmax chains: greedy targets and
    EagleProposer.one_hot_chains): token = the argmax of the logits, lowest id on ties,
    mapped to target ids; flag = every logit finite (and `ok`). The torch path takes the
    argmax of log_softmax(lg), which can differ where two logits round to one value after
    the log-sum shift: either is a valid proposal (verification does not depend on how
    the draft was chosen), and every CUDA drafting path takes this kernel, so they agree."""
    b, v = _check("greedy_pick", lg, ids, ok)
    if b == 0:
        return
    _greedy_pick_kernel[(b,)](lg, lg.stride(0), ids if ids is not None else lg, tok_out, tok_out.stride(0),
                              flag_out, flag_out.stride(0), ok if ok is not None else lg, V=v,
                              BLOCK=min(_BLOCK, max(16, triton.next_power_of_2(v))),
                              HAS_IDS=ids is not None, HAS_OK=ok is not None, num_warps=4)


def chain_pick_reference(lg, temperature, keys, draws, draw_offset, ids, vocab):
    """The kernel's math in torch ops (float32 softmax; the tests' reference): (target
    tokens [B], finite flags [B] bool, probs [B, vocab] float32)."""
    from megatron_tlt.rollout.sampling import exponential_noise
    from megatron_tlt.spec.sampling_ref import sample
    q = torch.softmax(lg.float() / temperature[:, None], dim=-1)
    noise = exponential_noise(keys, draws + draw_offset, lg.shape[-1], lg.device)
    tok = sample(q, noise)
    probs = torch.zeros(lg.shape[0], vocab, dtype=torch.float32, device=lg.device)
    if ids is None:
        probs[:, :lg.shape[-1]] = q
    else:
        probs[:, ids] = q
        tok = ids[tok]
    return tok, torch.isfinite(lg).all(-1), probs
