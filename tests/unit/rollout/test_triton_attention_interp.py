"""The Triton kernels of the GPU rollout path == their PyTorch references, on CPU through
Triton's interpreter (TRITON_INTERPRET=1).

float32 only: the interpreter's bfloat16 `tl.dot` and rounding are not faithful, so the
bf16 grid (and the compiled kernels, CUDA graphs, H=12/2 and 28/4 with head_dim 128,
contexts > 4096) runs on the GPU in tests/gpu/test_engine_gpu.py. Sizes here are tiny:
the interpreter runs every program in Python.

Skipped when triton is not installed (CI) and on CUDA machines (the interpreter is set
up only where no GPU exists; there the GPU tests cover the compiled kernels).
"""

import pytest
import torch

from rollout_testutil import scattered_blocks, triton_interpreter  # noqa: E402

pytestmark = triton_interpreter()

import torch.nn.functional as F  # noqa: E402

from megatron_tlt.errors import ConfigError  # noqa: E402
from megatron_tlt.models.arch import ModelArch  # noqa: E402
from megatron_tlt.rollout import EngineWeights, Request, RolloutEngine, SamplingParams  # noqa: E402
from megatron_tlt.rollout.attention import AttentionMetadata, TorchPagedAttention, write_kv  # noqa: E402
from megatron_tlt.rollout.cuda_graphs import bucket_sizes  # noqa: E402
from megatron_tlt.rollout.gpu_model import (DecodeModel, qkv_rope_write_kv, rms_norm,  # noqa: E402
                                            silu_mul)
from megatron_tlt.rollout.kv_cache import PagedKVCache  # noqa: E402
from megatron_tlt.rollout.model import InferenceModel, apply_rope, rope_table  # noqa: E402
from megatron_tlt.rollout.model import rms_norm as ref_rms_norm  # noqa: E402
from megatron_tlt.rollout.triton_attention import TritonPagedAttention, paged_attention  # noqa: E402

TOL = 2e-6  # float32: max |out - ref| / max |ref|


@pytest.fixture
def one_tile_splits(monkeypatch):
    """Splits of a single key tile (MEGATRON_TLT_SPLIT_MIN_TILES=1, the default, set here
    whatever the environment says): these tiny contexts spread over several live splits,
    whose partials a merge combines (with 4-tile splits most would be one split)."""
    from megatron_tlt.rollout import triton_attention as ta
    monkeypatch.setattr(ta, "_MIN_TILES", 1)


def tree_mask(q: int, g: torch.Generator) -> torch.Tensor:
    """[Q, Q] ancestor-or-self mask of a random tree whose node i has a parent < i."""
    parent = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, q)]
    m = torch.zeros(q, q, dtype=torch.bool)
    for i in range(q):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parent[j]
    return m


def paged_case(ctx_lens, n_new, *, heads=4, kv_heads=2, head_dim=16, page=4, tree=False,
               seed=0):
    """Random cache with scattered blocks, queries and metadata. Returns q, k, v, meta."""
    g = torch.Generator().manual_seed(seed)
    bt, total = scattered_blocks(ctx_lens, page, g, 3)
    k = torch.randn(total, page, kv_heads, head_dim, generator=g)
    v = torch.randn(total, page, kv_heads, head_dim, generator=g)
    q = 2 * torch.randn(sum(n_new), heads, head_dim, generator=g)
    qs = torch.tensor([0] + torch.tensor(n_new).cumsum(0).tolist())
    tm = torch.stack([tree_mask(n_new[0], g) for _ in ctx_lens]) if tree else None
    meta = AttentionMetadata(slot_mapping=torch.zeros(sum(n_new), dtype=torch.int64),
                             query_start=qs, context_lens=torch.tensor(ctx_lens),
                             block_tables=bt, tree_mask=tm)
    return q, k, v, meta


def rel_err(out, ref) -> float:
    """Max abs error over ref's max; inf where out holds NaN or inf (as wrong as an output
    gets: a negative control that reads unwritten memory may find NaNs there, or not)."""
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).abs().max() / ref.abs().max())


CASES = [  # (name, ctx_lens, n_new, kwargs)
    ("decode", [1, 7, 40, 13], [1, 1, 1, 1], {}),
    ("decode-gqa3-page8", [1, 33, 70], [1, 1, 1], dict(heads=6, page=8)),
    ("causal", [5, 7, 40, 13], [3, 1, 5, 2], {}),
    ("causal-long-rows", [30, 9], [20, 9], dict(heads=6)),
    ("tree", [5, 9, 40, 13], [4, 4, 4, 4], dict(tree=True)),
    ("tree-gqa3", [6, 70], [6, 6], dict(tree=True, heads=6, page=8)),
]


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("name,ctx,n_new,kw", CASES, ids=[c[0] for c in CASES])
def test_paged_attention_matches_reference(name, ctx, n_new, kw, splits, one_tile_splits):
    q, k, v, meta = paged_case(ctx, n_new, **kw)
    ref = TorchPagedAttention(precise=True).forward(q, k, v, meta, None)
    scale = q.shape[-1] ** -0.5
    if name.startswith("decode"):
        out = paged_attention(q, k, v, meta.block_tables, meta.context_lens, scale=scale,
                              num_splits=splits)
    else:
        out = paged_attention(q, k, v, meta.block_tables, meta.context_lens, scale=scale,
                              query_start=meta.query_start, max_query_len=max(n_new),
                              tree_mask=meta.tree_mask, num_splits=splits)
    assert rel_err(out, ref) < TOL, f"{name} splits={splits}: error {rel_err(out, ref):.2e}"


def test_launch_warps_rules(monkeypatch):
    """Session 26's warps: decode attention 8 while the grid has at most one program per SM
    (CPU counts 4 SMs), else 4; RMSNorm one warp per 128 padded columns, 4 to 16. A spy on
    the launch sees paged_attention pass the rule's warps, and the module knob instead
    once set (read at each launch)."""
    from megatron_tlt.rollout import gpu_model
    from megatron_tlt.rollout import triton_attention as ta
    cpu = torch.device("cpu")
    assert [ta.decode_warps(p, cpu) for p in (1, 4, 5, 64)] == [8, 8, 4, 4]
    assert [gpu_model.norm_warps(b) for b in (16, 512, 1024, 2048, 4096, 8192)] == [4, 4, 8, 16, 16, 16]
    q, k, v, meta = paged_case([40], [1])
    seen = []
    real = ta._paged_attention_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append((grid, kw["num_warps"]))
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(ta, "_paged_attention_kernel", Spy())
    paged_attention(q, k, v, meta.block_tables, meta.context_lens, scale=0.25, num_splits=1)
    paged_attention(q, k, v, meta.block_tables, meta.context_lens, scale=0.25, num_splits=3)
    monkeypatch.setattr(ta, "ATTENTION_WARPS", 2)
    paged_attention(q, k, v, meta.block_tables, meta.context_lens, scale=0.25, num_splits=3)
    assert seen == [((1, 2, 1), 8), ((1, 2, 3), 4), ((1, 2, 3), 2)]


@pytest.mark.parametrize("merge", [True, False], ids=["merge-in-kernel", "combine-kernel"])
def test_split_k_merge_in_the_kernel_or_the_combine_kernel(merge, monkeypatch, one_tile_splits):
    """Split-K partials merged by the last split program of each row tile (the default) or
    by _combine_kernel (MEGATRON_TLT_FUSED_COMBINE=0): both the reference's output, and
    the counters are back at 0 after every launch (a graph replay finds them so)."""
    from megatron_tlt.rollout import triton_attention as ta
    monkeypatch.setattr(ta, "_MERGE", merge)
    for name, ctx, n_new, kw in CASES:
        q, k, v, meta = paged_case([c + 30 for c in ctx], n_new, **kw)
        ref = TorchPagedAttention(precise=True).forward(q, k, v, meta, None)
        for splits in (2, 5):
            out = paged_attention(q, k, v, meta.block_tables, meta.context_lens, scale=q.shape[-1] ** -0.5,
                                  query_start=meta.query_start, max_query_len=max(n_new),
                                  tree_mask=meta.tree_mask, num_splits=splits)
            assert rel_err(out, ref) < TOL, (name, splits, merge)
    assert not ta.merge_counters(torch.device("cpu")).any()


def nan_filled_split_buffers(monkeypatch) -> list:
    """Split-K partial buffers filled with NaN at every launch; returns the list each
    launch's (partial outputs, maxima, sums) is appended to."""
    from megatron_tlt.rollout import triton_attention as ta
    real = ta.split_buffers
    seen = []

    def nan_filled(out, num_splits, merge_):
        po, pm, pl, lk = real(out, num_splits, merge_)
        if num_splits > 1:
            for x in (po, pm, pl):
                x.fill_(float("nan"))
        seen.append((po, pm, pl))
        return po, pm, pl, lk
    monkeypatch.setattr(ta, "split_buffers", nan_filled)
    return seen


@pytest.mark.parametrize("merge", [True, False], ids=["merge-in-kernel", "combine-kernel"])
def test_merges_read_only_what_the_splits_wrote(merge, monkeypatch, one_tile_splits):
    """Split-K partial buffers filled with NaN before each launch: splits without keys
    write nothing in decode (or only their max and sum, outside decode with
    _combine_kernel), and no merge reads an entry nobody wrote, so the outputs still match
    the reference; decode with 1 and 40 splits for a 1-key context agree bit for bit.
    Control: _combine_kernel told to read every split (decode=False) over a decode
    launch's partials returns NaN, so the fill would show a read of an unwritten entry (a
    context of one split writes no partials at all: the control takes two)."""
    from megatron_tlt.rollout import triton_attention as ta
    monkeypatch.setattr(ta, "_MERGE", merge)
    seen = nan_filled_split_buffers(monkeypatch)
    for name, ctx, n_new, kw in CASES:
        q, k, v, meta = paged_case(ctx, n_new, **kw)
        ref = TorchPagedAttention(precise=True).forward(q, k, v, meta, None)
        for splits in (3, 40):
            extra = {} if name.startswith("decode") else dict(
                query_start=meta.query_start, max_query_len=max(n_new), tree_mask=meta.tree_mask)
            out = paged_attention(q, k, v, meta.block_tables, meta.context_lens,
                                  scale=q.shape[-1] ** -0.5, num_splits=splits, **extra)
            assert not out.isnan().any() and rel_err(out, ref) < TOL, (name, splits)
    q, k, v, meta = paged_case([1, 1], [1, 1])
    one, forty = (paged_attention(q, k, v, meta.block_tables, meta.context_lens, scale=0.25,
                                  num_splits=s) for s in (1, 40))
    assert torch.equal(one, forty)
    if not merge:
        q, k, v, meta = paged_case([40, 40], [1, 1])  # 2 live one-tile splits of 40
        forty = paged_attention(q, k, v, meta.block_tables, meta.context_lens, scale=0.25,
                                num_splits=40)
        po, pm, pl = seen[-1]
        again = torch.empty_like(forty)
        ta.combine_splits(po, pm, pl, again, meta.context_lens, block_n=ta.block_n_for(q.dtype),
                          decode=False, min_tiles=1)
        assert again.isnan().all()


def test_split_merge_counter_left_dirty_breaks_the_output(monkeypatch, one_tile_splits):
    """Negative control: a counter not back at 0 merges a tile before its last split has
    written (the result misses that split's keys)."""
    from megatron_tlt.rollout import triton_attention as ta
    monkeypatch.setattr(ta, "_MERGE", True)
    q, k, v, meta = paged_case([70, 40], [1, 1])
    ref = TorchPagedAttention(precise=True).forward(q, k, v, meta, None)
    lk = ta.merge_counters(torch.device("cpu"))
    lk[0] = 1  # sequence 0, KV head 0, row tile 0
    try:
        out = paged_attention(q, k, v, meta.block_tables, meta.context_lens, scale=0.25, num_splits=3)
    finally:
        lk.zero_()
    assert rel_err(out[:1], ref[:1]) > 1e-2
    assert rel_err(out[1:], ref[1:]) < TOL  # the other tiles merged as usual


def test_decode_merge_over_several_chunks_of_splits(monkeypatch, one_tile_splits):
    """Decode over more live splits than _combine_kernel merges in one chunk (16): 700
    and 530 keys in 32-key splits (22 and 17 live of 40), beside a 3-key context (one
    split, not merged), into NaN-filled partial buffers: == the reference, and == the
    unsplit kernel to float32 rounding. Control: the same merge told a 4-tile minimum
    finds fewer live splits than were written and drops keys."""
    from megatron_tlt.rollout import triton_attention as ta
    seen = nan_filled_split_buffers(monkeypatch)
    q, k, v, meta = paged_case([700, 530, 3], [1, 1, 1], page=8)
    ref = TorchPagedAttention(precise=True).forward(q, k, v, meta, None)
    one, forty = (paged_attention(q, k, v, meta.block_tables, meta.context_lens, scale=0.25,
                                  num_splits=s) for s in (1, 40))
    _, pm, _ = seen[-1]
    assert not pm[0, :, :22].isnan().any() and pm[0, :, 22:].isnan().all()  # 22 live splits
    assert not pm[1, :, :17].isnan().any() and pm[1, :, 17:].isnan().all()
    assert not forty.isnan().any() and rel_err(forty, ref) < TOL and rel_err(forty, one) < TOL
    assert torch.equal(forty[2], one[2])
    po, pm, pl = seen[-1]
    again = torch.empty_like(forty)
    ta.combine_splits(po, pm, pl, again, meta.context_lens, block_n=ta.block_n_for(q.dtype),
                      decode=True, min_tiles=4)
    assert rel_err(again[:2], ref[:2]) > 1e-3


@pytest.mark.parametrize("merge", [True, False], ids=["merge-in-kernel", "combine-kernel"])
def test_a_context_within_one_split_is_not_merged(merge, monkeypatch):
    """4-tile splits (MEGATRON_TLT_SPLIT_MIN_TILES=4; 128 keys in float32): contexts of up to
    128 keys are one live split, which writes the output itself: == num_splits=1 bit for
    bit in every mode; in
    decode (and in every mode with the in-kernel merge) the NaN-filled partial buffers stay
    NaN (nothing written, _combine_kernel skips the rows) and no merge counter moves. A
    300-key context still splits (3 live splits of 128) and matches the reference.
    Control: with one-tile splits the same decode launch writes partials."""
    from megatron_tlt.rollout import triton_attention as ta
    monkeypatch.setattr(ta, "_MERGE", merge)
    monkeypatch.setattr(ta, "_MIN_TILES", 4)
    assert ta.split_min_tiles() == 4
    seen = nan_filled_split_buffers(monkeypatch)
    for name, ctx, n_new, kw in CASES:
        q, k, v, meta = paged_case([min(c + 60, 128) for c in ctx], n_new, **kw)
        extra = {} if name.startswith("decode") else dict(
            query_start=meta.query_start, max_query_len=max(n_new), tree_mask=meta.tree_mask)
        one, eight = (paged_attention(q, k, v, meta.block_tables, meta.context_lens, scale=0.25,
                                      num_splits=s, **extra) for s in (1, 8))
        assert torch.equal(one, eight), name
        if name.startswith("decode") or merge:
            assert all(x.isnan().all() for x in seen[-1]), name
    assert not ta.merge_counters(torch.device("cpu")).any()
    q, k, v, meta = paged_case([300, 40], [1, 1])
    ref = TorchPagedAttention(precise=True).forward(q, k, v, meta, None)
    out = paged_attention(q, k, v, meta.block_tables, meta.context_lens, scale=0.25, num_splits=8)
    assert rel_err(out, ref) < TOL
    _, pm, _ = seen[-1]
    assert not pm[0, :, :3].isnan().any() and pm[0, :, 3:].isnan().all()  # 3 live splits
    assert pm[1].isnan().all()  # 40 keys: one split, no partials
    monkeypatch.setattr(ta, "_MIN_TILES", 1)
    paged_attention(q, k, v, meta.block_tables, meta.context_lens, scale=0.25, num_splits=8)
    assert not seen[-1][1][1, :, :2].isnan().any()  # 40 keys: 2 one-tile (32-key) splits


def test_choose_num_splits_counts_min_tile_splits():
    from megatron_tlt.rollout.triton_attention import choose_num_splits
    kw = dict(sms=132, block_n=64)
    assert choose_num_splits(1, 2, 256, min_tiles=4, **kw) == 1
    assert choose_num_splits(1, 2, 256, min_tiles=1, **kw) == 4
    assert choose_num_splits(1, 2, 288, **kw) == 5  # default: one 64-key tile per split
    assert choose_num_splits(1, 2, 32768, min_tiles=4, **kw) == 64
    assert choose_num_splits(64, 2, 32768, min_tiles=4, **kw) == 3


def test_full_grid_minimum_by_programs_per_sm(monkeypatch):
    """split_min_tiles(programs, device): FULL_GRID_MIN_TILES where the programs fill 3/4
    of the SMs (CUDA only: a CPU device never, unless a test adds it), else the process
    minimum; never below the process minimum; FULL_GRID_MIN_TILES = 1 turns it off."""
    from megatron_tlt.rollout import triton_attention as ta
    monkeypatch.setattr(ta, "_MIN_TILES", 1)
    assert ta.split_min_tiles(1000, "cpu") == 1 and ta.split_min_tiles() == 1
    monkeypatch.setattr(ta, "_FULL_GRID_DEVICES", ("cuda", "cpu"))  # num_sms("cpu") == 4
    assert [ta.split_min_tiles(p, "cpu") for p in (1, 2, 3, 4, 64)] == [1, 1, 4, 4, 4]
    assert ta.choose_num_splits(1, 3, 512, sms=4, device="cpu") == 2  # 512 keys / (64 x 4); 3 wanted
    assert ta.choose_num_splits(1, 3, 512, sms=4) == 3  # no device: the process minimum
    monkeypatch.setattr(ta, "_MIN_TILES", 8)
    assert ta.split_min_tiles(3, "cpu") == 8
    monkeypatch.setattr(ta, "_MIN_TILES", 1)
    monkeypatch.setattr(ta, "FULL_GRID_MIN_TILES", 1)
    assert ta.split_min_tiles(3, "cpu") == 1


def test_decode_stages_one_only_for_one_tile_splits():
    """decode_stages: 1 while a split of the longest context holds at most one key tile
    (min_tiles included), else 2."""
    from megatron_tlt.rollout.triton_attention import decode_stages
    assert decode_stages(320, 5, 64) == 1  # 64 keys a split
    assert decode_stages(321, 5, 64) == 2  # 65
    assert decode_stages(64, 1, 64) == 1 and decode_stages(65, 1, 64) == 2
    assert decode_stages(8192, 64, 64) == 2  # 128 keys a split
    assert decode_stages(4096, 64, 64) == 1
    assert decode_stages(4096, 64, 64, min_tiles=4) == 2


def test_split_programs_caps_the_split_grid(monkeypatch):
    """SPLIT_PROGRAMS: the largest split count whose grid fits, at least 1; None: about two
    programs per SM (the choices above)."""
    from megatron_tlt.rollout import triton_attention as ta
    kw = dict(sms=132, min_tiles=1)
    assert ta.choose_num_splits(32, 4, 320, **kw) == 3  # ceil(264 / 128)
    monkeypatch.setattr(ta, "SPLIT_PROGRAMS", 132)
    assert ta.choose_num_splits(32, 4, 320, **kw) == 1  # 128 programs fit once
    assert ta.choose_num_splits(8, 4, 320, **kw) == 4
    assert ta.choose_num_splits(1, 2, 320, **kw) == 5  # the context's tiles still cap it
    assert ta.choose_num_splits(64, 4, 320, **kw) == 1  # 256 programs: never below one


def test_paged_attention_negative_controls():
    """The comparison catches a wrong block table and a dropped tree mask."""
    q, k, v, meta = paged_case([9, 40, 13], [1, 1, 1])
    ref = TorchPagedAttention().forward(q, k, v, meta, None)
    bad = meta.block_tables.flip(0).contiguous()
    out = paged_attention(q, k, v, bad, meta.context_lens, scale=0.25)
    assert rel_err(out, ref) > 1e-2
    q, k, v, meta = paged_case([9, 40], [6, 6], tree=True, seed=3)
    ref = TorchPagedAttention().forward(q, k, v, meta, None)
    out = paged_attention(q, k, v, meta.block_tables, meta.context_lens, scale=0.25,
                          query_start=meta.query_start, max_query_len=6)  # causal, not the tree
    assert rel_err(out, ref) > 1e-2


def test_backend_prefill_sdpa_and_generic_decode():
    """Backend 'triton': fresh prompts via SDPA (K/V read back by slot mapping), a mixed
    batch through the kernel."""
    for ctx, n_new in (([5, 7, 5, 1], [5, 7, 5, 1]), ([5, 7, 12], [1, 7, 3])):
        q, k, v, meta = paged_case(ctx, n_new, heads=6)
        page = k.shape[1]
        meta.slot_mapping = torch.cat([
            meta.block_tables[b, pos // page] * page + pos % page
            for b, (c, n) in enumerate(zip(ctx, n_new)) for pos in [torch.arange(c - n, c)]])
        ref = TorchPagedAttention().forward(q, k, v, meta, None)
        out = TritonPagedAttention().forward(q, k, v, meta, None)
        assert rel_err(out, ref) < TOL


def test_fused_kernels_match_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 40, generator=g)
    res = torch.randn(5, 40, generator=g)
    w = 1 + 0.1 * torch.randn(40, generator=g)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), ref_rms_norm(x, w, 1e-6), atol=1e-6, rtol=1e-6)
    r = res.clone()
    out = rms_norm(x, w, 1e-6, residual=r)
    torch.testing.assert_close(r, res + x, atol=0, rtol=0)
    torch.testing.assert_close(out, ref_rms_norm(res + x, w, 1e-6), atol=1e-6, rtol=1e-6)

    gu = torch.randn(3, 2 * 1100, generator=g)
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul(gu), F.silu(gate) * up, atol=1e-6, rtol=1e-6)

    heads, kvh, d, page = 6, 2, 16, 4
    cos, sin = rope_table(64, d, 10000.0)
    for qk_norm, with_bias in ((False, False), (False, True), (True, True)):
        qkv = torch.randn(3, (heads + 2 * kvh) * d, generator=g)
        pos = torch.tensor([0, 17, 63])
        slots = torch.tensor([5, -1, 9])  # -1: padding row, must not be written
        qn = 1 + 0.1 * torch.randn(d, generator=g) if qk_norm else None
        kn = 1 + 0.1 * torch.randn(d, generator=g) if qk_norm else None
        kc = torch.zeros(4, page, kvh, d)
        vc = torch.zeros(4, page, kvh, d)
        bias = torch.randn((heads + 2 * kvh) * d, generator=g) if with_bias else None
        q = qkv_rope_write_kv(qkv, pos, slots, cos, sin, kc, vc, num_heads=heads,
                              num_kv_heads=kvh, head_dim=d, bias=bias, q_norm=qn, k_norm=kn)
        rq, rk, rv = (qkv if bias is None else qkv + bias).split([heads * d, kvh * d, kvh * d], dim=-1)
        rq, rk, rv = rq.reshape(3, heads, d), rk.reshape(3, kvh, d), rv.reshape(3, kvh, d)
        if qk_norm:
            rq, rk = ref_rms_norm(rq, qn, 1e-6), ref_rms_norm(rk, kn, 1e-6)
        rq, rk = apply_rope(rq, cos[pos], sin[pos]), apply_rope(rk, cos[pos], sin[pos])
        kr, vr = torch.zeros_like(kc), torch.zeros_like(vc)
        write_kv(kr, vr, slots[[0, 2]], rk[[0, 2]], rv[[0, 2]])
        torch.testing.assert_close(q, rq, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(kc, kr, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(vc, vr, atol=0, rtol=0)


def _weights(arch, seed):
    """Random weights scaled so greedy tokens vary (a tiny random model otherwise repeats)."""
    w = EngineWeights.make_dummy(arch, seed=seed)
    with torch.no_grad():
        for lw in w.layers:
            for t in (lw.qkv_weight, lw.o_weight, lw.gate_up_weight, lw.down_weight):
                t.mul_(4)
    return w


def _arch(family, tie):
    return ModelArch(family=family, vocab_size=300, hidden_size=64, intermediate_size=96,
                     num_layers=2, num_heads=6, num_kv_heads=2, head_dim=16,
                     max_position_embeddings=256, tie_word_embeddings=tie,
                     qkv_bias=family == "qwen2", qk_norm=family == "qwen3")


@pytest.mark.parametrize("family,tie", [("qwen2", True), ("qwen3", False)])
def test_decode_model_matches_inference_model(family, tie):
    """The fused decode forward == the reference forward (logits and the K/V it writes)."""
    arch = _arch(family, tie)
    w = _weights(arch, seed=1)
    ref_model = InferenceModel(arch, w, max_positions=64, batch_invariant=False)
    fast = DecodeModel(arch, w, ref_model.cos, ref_model.sin)
    caches = [PagedKVCache(num_layers=2, num_kv_heads=2, head_dim=16, num_blocks=8,
                           block_size=4) for _ in range(2)]
    g = torch.Generator().manual_seed(2)
    for c in caches:  # an existing prefix
        for layer in range(2):
            c.k[layer].copy_(torch.randn(c.k[layer].shape, generator=g))
            c.v[layer].copy_(torch.randn(c.v[layer].shape, generator=g))
        g = torch.Generator().manual_seed(2)
    ids = torch.tensor([3, 250, 7])
    pos = torch.tensor([5, 0, 10])
    bt = torch.tensor([[2, 5, 0], [1, 0, 0], [3, 4, 6]])
    slots = torch.stack([bt[b, p // 4] * 4 + p % 4 for b, p in enumerate(pos.tolist())])
    meta = AttentionMetadata(slot_mapping=slots, query_start=torch.arange(4),
                             context_lens=pos + 1, block_tables=bt)
    ref = ref_model.forward(ids, pos, caches[0], meta).logits
    out = fast.forward(ids.to(torch.int32), pos.to(torch.int32), slots.to(torch.int32),
                       bt.to(torch.int32), (pos + 1).to(torch.int32), caches[1], num_splits=2)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    for layer in range(2):
        torch.testing.assert_close(caches[1].k[layer], caches[0].k[layer], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(caches[1].v[layer], caches[0].v[layer], atol=1e-5, rtol=1e-5)


def _requests(vocab, specs, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [Request(prompt_id=i, prompt_token_ids=torch.randint(0, vocab, (n,), generator=g).tolist(),
                    sampling_params=SamplingParams(temperature=0.0, max_new_tokens=m,
                                                   min_new_tokens=lo))
            for i, (n, m, lo) in enumerate(specs)]


def test_engine_triton_backend_matches_torch_backend():
    """Engine with the decode runner (eager, padded buckets) == the reference engine:
    same greedy tokens, logprobs to rounding; includes a non-bucket batch (3 -> 4), a
    stop token banned by min_new_tokens, and a request finishing early."""
    arch = _arch("qwen2", True)
    w = _weights(arch, seed=5)
    reqs = _requests(300, [(5, 7, 0), (1, 5, 0), (17, 6, 6)])
    ref_engine = RolloutEngine(arch, w, max_num_seqs=4, num_blocks=48, block_size=4)
    ref = ref_engine.generate(reqs)
    stop = ref[2].token_ids[1]  # request 2 must not stop on it (min_new_tokens=6)
    ref_engine = RolloutEngine(arch, w, max_num_seqs=4, num_blocks=48, block_size=4,
                               eos_token_ids=(stop,))
    ref = ref_engine.generate(reqs)
    eng = RolloutEngine(arch, w, max_num_seqs=4, num_blocks=48, block_size=4,
                        eos_token_ids=(stop,), attention_backend="triton")
    out = eng.generate(reqs)
    assert eng.decode_runner is not None and eng.decode_runner.num_steps > 0
    assert eng.decode_runner.buckets == [1, 2, 4]
    assert len(ref[2].token_ids) == 6
    for a, b in zip(ref, out):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs),
                                   atol=1e-4, rtol=1e-4)
        assert b.processed_logprobs == [0.0] * len(b.token_ids)


@pytest.mark.parametrize("fused", [False, True], ids=["generic", "fused-decode-model"])
def test_engine_verify_forward_tree_matches_torch_backend(fused, monkeypatch):
    """Tree verify on the triton backend == the torch backend: through the generic forward,
    and through the decode runner's fused kernels (what a CUDA engine uses; forced here)."""
    arch = _arch("qwen3", False)
    w = _weights(arch, seed=6)
    logits, hidden = [], []
    if fused:
        monkeypatch.setattr(RolloutEngine, "_fused_verify", lambda self: self.decode_runner is not None)
    for backend in ("torch", "triton"):
        eng = RolloutEngine(arch, w, max_num_seqs=4, num_blocks=48, block_size=4,
                            attention_backend=backend)
        seqs = [eng.add_sequence(r) for r in _requests(300, [(6, 8, 0), (11, 8, 0)])]
        out = eng.forward_pending(seqs)
        eng.sample_and_append(seqs, out.logits)
        eng.forward_pending(seqs)  # one decode step (the runner on triton)
        q = 5
        g = torch.Generator().manual_seed(0)
        mask = torch.stack([tree_mask(q, g) for _ in seqs])
        depth = mask.sum(-1) - 1
        base = torch.tensor([s.num_computed for s in seqs])[:, None]
        tokens = torch.randint(0, 300, (2, q), generator=g)
        lg, h = eng.verify_forward(seqs, tokens, base + depth, mask, return_hidden="final")
        logits.append(lg)
        hidden.append(h)
    torch.testing.assert_close(logits[1], logits[0], atol=5e-5, rtol=5e-5)
    torch.testing.assert_close(hidden[1], hidden[0], atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("family,tie", [("qwen2", True), ("qwen3", False)])
def test_fused_prefill_matches_generic_prefill(family, tie, monkeypatch):
    """MEGATRON_TLT_FUSED_PREFILL=1: the prefill through DecodeRunner.extend (the fused
    decode model, one causal paged-attention launch per layer; `_fused_verify` forced as on
    a CUDA engine) == the generic forward: each sequence's last-token logits, every row's
    hidden states and the KV pool, for ragged prompts (1, 5 and 17 tokens over blocks of
    4), then an extend of mixed lengths over a committed prefix (1, 3, 1 new tokens); greedy
    generate gives the same tokens. Negative control: unset, extend is never called."""
    from megatron_tlt.rollout.cuda_graphs import DecodeRunner
    arch = _arch(family, tie)
    w = _weights(arch, seed=7)
    monkeypatch.setattr(RolloutEngine, "_fused_verify", lambda self: self.decode_runner is not None)
    calls = []
    real = DecodeRunner.extend

    def counted(self, *a, **k):
        calls.append(a[3])  # max_query_len
        return real(self, *a, **k)
    monkeypatch.setattr(DecodeRunner, "extend", counted)
    runs = []
    for fused in ("0", "1"):
        monkeypatch.setenv("MEGATRON_TLT_FUSED_PREFILL", fused)
        calls.clear()
        eng = RolloutEngine(arch, w, max_num_seqs=4, num_blocks=48, block_size=4, attention_backend="triton")
        seqs = [eng.add_sequence(r) for r in _requests(300, [(1, 6, 0), (5, 6, 0), (17, 6, 0)], seed=3)]
        first = eng.forward_pending(seqs, return_hidden=True)
        eng.sample_and_append(seqs, first.logits)
        seqs[1].token_ids.extend([7, 11])  # three pending tokens over its committed prefix
        second = eng.forward_pending(seqs, return_hidden=True)
        kv = (eng.cache.k[1].clone(), eng.cache.v[0].clone())
        gen = RolloutEngine(arch, w, max_num_seqs=4, num_blocks=48, block_size=4, attention_backend="triton")
        tokens = [r.token_ids for r in gen.generate(_requests(300, [(1, 6, 0), (5, 6, 0), (17, 6, 0)], seed=4))]
        runs.append((first, second, kv, tokens, list(calls)))
    (g1, g2, gkv, gtok, gcalls), (f1, f2, fkv, ftok, fcalls) = runs
    assert gcalls == [] and fcalls[:2] == [17, 3], (gcalls, fcalls)
    for a, b in ((g1, f1), (g2, f2)):
        assert b.logits.shape == a.logits.shape == (3, arch.vocab_size)
        torch.testing.assert_close(b.logits, a.logits, atol=5e-5, rtol=5e-5)
        torch.testing.assert_close(b.hidden_final, a.hidden_final, atol=5e-5, rtol=5e-5)
        torch.testing.assert_close(b.hidden_pre_norm, a.hidden_pre_norm, atol=5e-5, rtol=5e-5)
    assert g1.hidden_final.shape[0] == 23 and g2.hidden_final.shape[0] == 5
    for a, b in zip(gkv, fkv):
        torch.testing.assert_close(b, a, atol=5e-5, rtol=5e-5)
    assert ftok == gtok


class _Replay:
    """Stands in for a captured graph: replay() runs the same forward on the same static
    views (the interpreter cannot capture)."""

    def __init__(self, fn):
        self.replay = fn


def _static_verify_capture(self, bucket, q, v):
    hidden = {}
    self._fill_verify_padding(v, 0, q)
    self._verify_forward(bucket, q, v, {})  # the warm-up: all rows padding

    def replay():
        h = {}
        self._verify_forward(bucket, q, v, h)
        hidden.update(h)
    self._vgraphs[(bucket, q)] = (_Replay(replay), hidden)
    self._kv_ptr = self.cache.k[0].data_ptr()


def _static_decode_capture(self):
    """Stands in for the decode graphs' capture, which the runner does before its first
    verify graph: graphs that must not be replayed (the decode steps here run eagerly)."""
    def replay():
        raise AssertionError("a decode graph stand-in was replayed")
    self._graphs.update({b: _Replay(replay) for b in self.buckets})
    self._kv_ptr = self.cache.k[0].data_ptr()
    self.num_captures += 1


@pytest.mark.parametrize("control", [False, True], ids=["padded", "no-padding-control"])
def test_verify_static_buffers_match_eager_verify(control, monkeypatch):
    """The verify-graph path of the decode runner (static buffers, padding sequences, a
    graph per (bucket, Q); replay stood in for) == the eager fused verify: logits, hidden
    states and the KV pool, across a 4-sequence verify and then a 3-sequence
    one in the same bucket, whose padding rows still hold the 4th sequence's slots (in
    between, the roots are committed and a decode step writes new tokens after them),
    then the same 3 sequences with a tree mask instead of chains (the static mask is
    only re-sent when it changes: a stale chain mask would change node 2's logits), then
    twice through verify_chains_output (drafts given as a tensor, the named chain mask:
    re-sent after the tree's, then kept).
    Control: without re-padding, those stale rows overwrite the 4th sequence's new KV
    with the old drafts', and the comparison must see it."""
    from megatron_tlt.rollout.cuda_graphs import DecodeRunner
    monkeypatch.setattr(RolloutEngine, "_fused_verify", lambda self: self.decode_runner is not None)
    monkeypatch.setattr(DecodeRunner, "_capture_verify", _static_verify_capture)
    monkeypatch.setattr(DecodeRunner, "capture", _static_decode_capture)
    if control:
        fill = DecodeRunner._pad_verify_rows
        monkeypatch.setattr(DecodeRunner, "_pad_verify_rows",
                            lambda self, st, bsz, q: fill(self, st, bsz, q) if bsz == 0 else None)
    arch = _arch("qwen3", False)
    w = _weights(arch, seed=6)
    runs = []
    for static in (True, False):
        eng = RolloutEngine(arch, w, max_num_seqs=4, num_blocks=48, block_size=4,
                            attention_backend="triton")
        seqs = [eng.add_sequence(r) for r in _requests(300, [(6, 8, 0), (11, 8, 0), (3, 8, 0), (9, 8, 0)])]
        out = eng.forward_pending(seqs)
        eng.sample_and_append(seqs, out.logits)
        out = eng.forward_pending(seqs)  # one decode step (eager runner)
        eng.sample_and_append(seqs, out.logits)  # the verify's root is pending
        eng.decode_runner.use_graphs = static  # verify through the static path from here
        g = torch.Generator().manual_seed(0)
        got = []
        for n, q, kind in ((4, 3, "chain"), (3, 3, "chain"), (3, 3, "tree"), (3, 3, "drafts"), (3, 3, "drafts")):
            mask = torch.ones(q, q, dtype=torch.bool).tril()
            depth = torch.arange(q)
            if kind == "tree":  # nodes 1 and 2 both children of the root
                mask[2, 1], depth = False, torch.tensor([0, 1, 1])
            mask = mask.expand(n, q, q)
            base = torch.tensor([s.num_computed for s in seqs[:n]])[:, None]
            tokens = torch.randint(0, 300, (n, q), generator=g)
            if kind == "drafts":  # the deferred step's entry: chains, drafts "on the device"
                o = eng.verify_chains_output(seqs[:n], q - 1, tokens[:, 1:], return_hidden=True)
            else:
                o = eng.verify_forward_output(seqs[:n], tokens, base + depth, mask, return_hidden=True)
            got.append((o.logits.clone(), o.hidden_final.clone()))
            if n == 4:  # keep the roots only, then a plain decode step of new tokens
                for s in seqs:
                    eng.commit_kv(s, [0])
                    eng.append_token(s, (s.token_ids[-1] + 1) % 300, 0.0, 0.0)
                eng.decode_runner.use_graphs = False
                eng.forward_pending(seqs)
                eng.decode_runner.use_graphs = static
        runs.append((got, eng.cache.k[1].clone(), eng.decode_runner))
    (s_out, s_k, s_runner), (e_out, e_k, e_runner) = runs
    assert s_runner.num_verify_graphs == 1 and s_runner.num_verify_replays == 5
    assert e_runner.num_verify_replays == 0
    for a, b in zip(s_out, e_out):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, atol=5e-5, rtol=5e-5)
    if control:
        assert not torch.allclose(s_k, e_k, atol=1e-3)
    else:
        torch.testing.assert_close(s_k, e_k, atol=5e-5, rtol=5e-5)


def test_runner_configuration_errors():
    assert bucket_sizes(None, 64) == [1, 2, 4, 8, 16, 32, 64]
    assert bucket_sizes(None, 100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert bucket_sizes([8, 1, 32], 20) == [1, 8, 20]
    with pytest.raises(ConfigError, match="batch sizes"):
        bucket_sizes([0], 4)
    arch = _arch("qwen2", True)
    w = EngineWeights.make_dummy(arch)
    with pytest.raises(ConfigError, match="CUDA device"):
        RolloutEngine(arch, w, attention_backend="triton", cuda_graphs=True)
    with pytest.raises(ConfigError, match="attention_backend='triton'"):
        RolloutEngine(arch, w, cuda_graphs=True)


def test_spec_plain_steps_take_the_runner_with_hidden_states(monkeypatch):
    """A speculative decoder's plain steps (here: batch above the SD threshold) need the
    hidden states of every token for the drafter; they are served by the decode runner
    (DecodeRunner.decode(return_hidden=True)) rather than the generic forward. Against a
    run where the runner refuses them (the old behaviour): the same greedy tokens, the
    drafter observes the same positions with the same features (to float32 rounding of
    the fused kernels), and the runner served more steps."""
    from megatron_tlt.rollout.cuda_graphs import DecodeRunner
    from megatron_tlt.spec.decode import SpecDecoder
    from megatron_tlt.spec.eagle import DrafterConfig, EagleDrafter, EagleProposer
    from megatron_tlt.spec.tree import Strategy

    arch = _arch("qwen2", True)
    w = _weights(arch, seed=5)
    reqs = _requests(300, [(5, 12, 0), (3, 9, 0), (9, 14, 0)])

    def run():
        eng = RolloutEngine(arch, w, max_num_seqs=4, num_blocks=64, block_size=4, attention_backend="triton")
        d = EagleDrafter(DrafterConfig(arch=arch), w.embed, w.lm_head)
        d.reset_parameters(0, std=0.1)
        prop = EagleProposer(d)
        seen = {}
        observe = prop.observe

        def record(seq, start, hidden):
            for i in range(hidden.shape[0]):
                seen[(seq.request.prompt_id, start + i)] = hidden[i].clone()
            observe(seq, start, hidden)
        prop.observe = record
        eng.spec_decoder = SpecDecoder(prop, Strategy(depth=2), threshold=2)
        out = eng.generate(reqs)
        assert eng.spec_decoder.metrics.summary()["total"]["num_drafts"] > 0  # SD ran too
        return [r.token_ids for r in out], seen, eng.decode_runner.num_steps

    tokens, seen, served = run()
    decode = DecodeRunner.decode
    monkeypatch.setattr(DecodeRunner, "decode",
                        lambda self, seqs, return_hidden=False: None if return_hidden else decode(self, seqs))
    old_tokens, old_seen, old_served = run()
    assert tokens == old_tokens
    assert served > old_served == 0  # every plain step of this run needs hidden states
    assert seen.keys() == old_seen.keys()
    for k in seen:
        torch.testing.assert_close(seen[k], old_seen[k], atol=1e-5, rtol=1e-5)


def test_prefill_reads_nothing_back_per_layer(monkeypatch):
    """A ragged prefill (lengths 5, 9, 5: two groups) on the triton backend takes the
    lengths from the host lists RolloutEngine._metadata built and sends every group's row
    index to the device once per forward (not once per group and layer, each from pageable
    memory, and two device reads per layer, which made the host wait for the device every
    layer on a GPU); the logits equal those of metadata without the host lists (the old
    per-layer reads), bit for bit."""
    from megatron_tlt.rollout import triton_attention as ta
    arch = _arch("qwen2", True)
    assert arch.num_layers >= 2
    w = _weights(arch, seed=5)
    calls = []
    real = ta.to_device
    monkeypatch.setattr(ta, "to_device", lambda t, d: calls.append(t.numel()) or real(t, d))
    reads = []
    real_tolist = torch.Tensor.tolist
    out = {}
    for host in (True, False):
        eng = RolloutEngine(arch, w, max_num_seqs=4, num_blocks=48, block_size=4, attention_backend="triton")
        if not host:  # metadata as other builders make it: lengths read from the device
            real_md = eng._metadata

            def md(*a, real_md=real_md, **k):
                meta, head = real_md(*a, **k)
                meta.host_query_start = meta.host_context_lens = None
                return meta, head
            monkeypatch.setattr(eng, "_metadata", md)
        seqs = [eng.add_sequence(r) for r in _requests(300, [(5, 4, 0), (9, 4, 0), (5, 4, 0)])]
        calls.clear()
        monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.numel()) or real_tolist(t))
        reads.clear()
        out[host] = eng.forward_pending(seqs).logits.clone()
        monkeypatch.setattr(torch.Tensor, "tolist", real_tolist)
        if host:
            assert calls == [19]  # one copy: 5 + 5 rows of one group, 9 of the other
            assert reads == []
        else:
            assert len(reads) == 2 * arch.num_layers  # the control: two reads per layer
    assert torch.equal(out[True], out[False])
