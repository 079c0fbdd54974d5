"""rope_attention (RoPE + K/V write folded into the attention kernel, decode and tree
verify; models without q/k-norm) == qkv_rope_write_kv followed by paged_attention, bit for
bit, on CPU through Triton's interpreter; and the decode / verify forward with
MEGATRON_TLT_FUSED_ROPE=1 == without it.

float32 (the interpreter's bf16 is not faithful); the compiled bf16 kernels are compared
the same way on the GPU (tests/gpu/test_engine_gpu.py). Skipped without triton (CI) and on
CUDA machines, like every interpreter test.
"""

import pytest
import torch

from rollout_testutil import scattered_blocks, tiny_decode, triton_interpreter  # noqa: E402

pytestmark = triton_interpreter()

from megatron_tlt.models.arch import ModelArch  # noqa: E402
from megatron_tlt.rollout import EngineWeights  # noqa: E402
from megatron_tlt.rollout.gpu_model import (FUSED_ROPE_ENV, DecodeModel,  # noqa: E402
                                            qkv_rope_write_kv, rope_attention)
from megatron_tlt.rollout.kv_cache import PagedKVCache  # noqa: E402
from megatron_tlt.rollout.model import rope_table  # noqa: E402
from megatron_tlt.rollout.triton_attention import paged_attention  # noqa: E402


def random_tree(q: int, g: torch.Generator) -> tuple[torch.Tensor, list[int]]:
    """([Q, Q] ancestor-or-self mask, depth of each node) of a random tree whose node i
    has a parent < i (node 0 the root)."""
    parent = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, q)]
    mask = torch.zeros(q, q, dtype=torch.bool)
    depth = [0] * q
    for i in range(q):
        depth[i] = 0 if i == 0 else depth[parent[i]] + 1
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
    return mask, depth


def _case(ctx, *, heads, kvh, d, page, planes, bias, seed, q=1):
    """Random QKV planes, a cache with scattered blocks holding a random prefix, and the
    metadata of q new tokens per sequence at its context's last positions (ctx counts
    them); q == 1: decode (ctx 0 stands for a padding row: slot -1, context 1), else a
    random tree per sequence (RoPE positions prefix + depth). Returns the tensors and the
    keywords of rope_attention / qkv_rope_write_kv."""
    g = torch.Generator().manual_seed(seed)
    bt, total = scattered_blocks(ctx, page, g, 2)
    kc = torch.randn(total, page, kvh, d, generator=g)
    vc = torch.randn(total, page, kvh, d, generator=g)
    width = (heads + 2 * kvh) * d
    qkv = torch.randn(planes, len(ctx) * q, width, generator=g)
    pos, slots, masks = [], [], []
    for b, c in enumerate(ctx):
        mask, depth = random_tree(q, g) if q > 1 else (None, [0])
        masks.append(mask)
        for j in range(q):
            p = c - q + j  # cache position of new token j
            pos.append(max(c - q, 0) + depth[j])
            slots.append(int(bt[b, p // page]) * page + p % page if c > 0 else -1)
    cos, sin = rope_table(max(128, max(ctx) + q), d, 10000.0)
    kw = dict(num_heads=heads, num_kv_heads=kvh, head_dim=d,
              bias=torch.randn(width, generator=g) if bias else None)
    meta = dict(block_tables=bt, context_lens=torch.tensor([max(c, 1) for c in ctx]))
    if q > 1:
        meta.update(query_start=torch.arange(len(ctx) + 1) * q, tree_mask=torch.stack(masks))
    return qkv, torch.tensor(pos), torch.tensor(slots), cos, sin, kc, vc, meta, kw


def _separate(qkv, pos, slots, cos, sin, kc, vc, meta, kw, splits):
    q = qkv_rope_write_kv(qkv, pos, slots, cos, sin, kc, vc, **kw)
    tree = {}
    if "tree_mask" in meta:
        tree = dict(query_start=meta["query_start"], tree_mask=meta["tree_mask"],
                    max_query_len=meta["tree_mask"].shape[1])
    return paged_attention(q, kc, vc, meta["block_tables"], meta["context_lens"],
                           scale=kw["head_dim"] ** -0.5, num_splits=splits, **tree)


def _fused(qkv, pos, slots, cos, sin, kc, vc, meta, kw, splits):
    return rope_attention(qkv, pos, slots, cos, sin, kc, vc, scale=kw["head_dim"] ** -0.5,
                          num_splits=splits, **meta, **kw)


CASES = [  # (name, ctx, heads, kv heads, head_dim, page, planes, bias, new tokens)
    ("gqa3", [1, 7, 40, 13], 6, 2, 16, 4, 1, False, 1),
    ("bias-planes", [5, 33, 70], 6, 2, 16, 8, 3, True, 1),
    ("gqa2-two-planes", [2, 19, 64], 4, 2, 16, 4, 2, False, 1),
    ("head-dim-24-padding-row", [9, 0, 30], 4, 4, 24, 4, 1, True, 1),
    ("mha-one-seq", [45], 2, 2, 32, 8, 4, False, 1),
    ("two-row-tiles", [5, 30], 66, 1, 16, 4, 1, False, 1),  # 66 query heads per KV head
    ("tree-q5", [6, 41, 70], 6, 2, 16, 4, 2, True, 5),
    ("tree-q8-two-tiles", [8, 33], 12, 1, 16, 8, 1, False, 8),  # 96 rows: two row tiles
]


@pytest.mark.parametrize("merge", [False, True], ids=["combine-kernel", "merge-in-kernel"])
@pytest.mark.parametrize("splits,min_tiles", [(1, 4), (3, 1), (8, 1), (8, 4)],
                         ids=["1", "3-one-tile", "8-one-tile", "8"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fused_equals_separate_kernels(case, splits, min_tiles, merge, monkeypatch):
    """Bit for bit, with split-K merges (one-tile splits, the default: several live splits
    at these contexts) and with 4-tile splits (every context here fits in one: that split
    writes the output)."""
    from megatron_tlt.rollout import triton_attention as ta
    monkeypatch.setattr(ta, "_MERGE", merge)
    monkeypatch.setattr(ta, "_MIN_TILES", min_tiles)
    _, ctx, heads, kvh, d, page, planes, bias, q = case
    qkv, pos, slots, cos, sin, kc, vc, meta, kw = _case(
        ctx, heads=heads, kvh=kvh, d=d, page=page, planes=planes, bias=bias, seed=len(ctx) + d,
        q=q)
    k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    ref = _separate(qkv, pos, slots, cos, sin, k1, v1, meta, kw, splits)
    out = _fused(qkv, pos, slots, cos, sin, k2, v2, meta, kw, splits)
    assert not torch.equal(k1, kc)  # the new K was written
    assert torch.equal(k2, k1) and torch.equal(v2, v1)
    live = [i for i, s in enumerate(slots.tolist()) if s >= 0]  # a padding row's output is unused
    assert torch.equal(out[live], ref[live])
    assert not ta.merge_counters(torch.device("cpu")).any()


@pytest.mark.parametrize("full_merge", [True, False], ids=["merge-in-kernel", "combine-kernel"])
@pytest.mark.parametrize("q", [1, 5])
def test_full_grid_minimum_is_one_for_attention_and_merge(q, full_merge, monkeypatch):
    """FULL_GRID_MIN_TILES run on CPU (num_sms is 4 there: 3 or more programs fill 3/4):
    the fused kernel, the separate kernels and their merges (in the kernel with
    FULL_GRID_MERGE, the default, else _combine_kernel) all take the 4-tile minimum
    (128 keys in float32): fused == separate bit for bit at 8 splits, both == the
    unsplit output to float32 rounding, and the 40-key sequence (one 4-tile split, which
    writes its output itself) == unsplit bit for bit, where one-tile splits would merge two
    partials; the merge counters end at 0. Control (decode with _combine_kernel, which
    finds a row's live splits from its context length and the minimum; the verify's
    merge reads every split's sum): a merge told the one-tile minimum reads partials no
    split wrote (NaN-filled) and the comparison fails."""
    from megatron_tlt.rollout import gpu_model
    from megatron_tlt.rollout import triton_attention as ta
    monkeypatch.setattr(ta, "_MIN_TILES", 1)
    monkeypatch.setattr(ta, "_MERGE", False)
    monkeypatch.setattr(ta, "FULL_GRID_MERGE", full_merge)
    monkeypatch.setattr(ta, "_FULL_GRID_DEVICES", ("cuda", "cpu"))
    assert ta.split_min_tiles(6, "cpu") == 4 and ta.split_min_tiles(2, "cpu") == 1
    assert ta.merge_in_kernel(8, 6, "cpu") == full_merge and not ta.merge_in_kernel(8, 2, "cpu")
    real = ta.split_buffers

    def nan_filled(out, num_splits, merge_):
        bufs = real(out, num_splits, merge_)
        for x in bufs[:3] if num_splits > 1 else ():
            x.fill_(float("nan"))
        return bufs
    monkeypatch.setattr(ta, "split_buffers", nan_filled)
    monkeypatch.setattr(gpu_model, "split_buffers", nan_filled)
    case = _case([150, 40, 300], heads=6, kvh=2, d=16, page=4, planes=2, bias=True, seed=11, q=q)
    qkv, pos, slots, cos, sin, kc, vc, meta, kw = case
    k0, v0 = kc.clone(), vc.clone()
    one = _separate(qkv, pos, slots, cos, sin, k0, v0, meta, kw, 1)
    k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    ref = _separate(qkv, pos, slots, cos, sin, k1, v1, meta, kw, 8)
    out = _fused(qkv, pos, slots, cos, sin, k2, v2, meta, kw, 8)
    assert torch.equal(out, ref) and torch.equal(k2, k1) and torch.equal(v2, v1)
    assert float((out - one).abs().max() / one.abs().max()) < 1e-5
    assert torch.equal(out[q:2 * q], one[q:2 * q])  # 40 keys: one split, not merged
    assert not ta.merge_counters(torch.device("cpu")).any()
    if q == 1 and not full_merge:
        real_combine = gpu_model.combine_splits
        monkeypatch.setattr(gpu_model, "combine_splits",
                            lambda *a, **k: real_combine(*a, **{**k, "min_tiles": 1}))
        bad = _fused(qkv, pos, slots, cos, sin, kc.clone(), vc.clone(), meta, kw, 8)
        assert not torch.allclose(bad, one, rtol=1e-5, atol=1e-5)


LONG_DECODE = [c for c in CASES if c[8] == 1 and max(c[1]) > 32]  # several 32-key tiles


BEFORE_S34 = dict(ROPE_ATTENTION_PAGES_AHEAD=False, ROPE_ATTENTION_WRITE_FIRST=0,
                  ROPE_ATTENTION_OFF32=False, ROPE_ATTENTION_SAME_STRIDES=False)
"""The decode key loop's knobs as they were before session 34 made the last three default."""


@pytest.mark.parametrize("knobs", ["defaults", dict(ROPE_ATTENTION_PAGES_AHEAD=True),
                                   dict(ROPE_ATTENTION_WRITE_FIRST=1),
                                   dict(ROPE_ATTENTION_WRITE_FIRST=2),
                                   dict(ROPE_ATTENTION_PAGES_AHEAD=True, ROPE_ATTENTION_WRITE_FIRST=1),
                                   dict(ROPE_ATTENTION_PAGES_AHEAD=True, ROPE_ATTENTION_WRITE_FIRST=2),
                                   dict(ROPE_ATTENTION_OFF32=True),
                                   dict(ROPE_ATTENTION_OFF32=True, ROPE_ATTENTION_WRITE_FIRST=2),
                                   dict(ROPE_ATTENTION_OFF32=True, ROPE_ATTENTION_PAGES_AHEAD=True,
                                        ROPE_ATTENTION_WRITE_FIRST=1),
                                   dict(ROPE_ATTENTION_SAME_STRIDES=True),
                                   dict(ROPE_ATTENTION_SAME_STRIDES=True, ROPE_ATTENTION_OFF32=True,
                                        ROPE_ATTENTION_WRITE_FIRST=2)],
                         ids=["defaults", "pages-ahead", "write-first", "write-all", "ahead-first", "ahead-all",
                              "off32", "off32-all", "off32-ahead-first", "same-strides",
                              "same-off32-all"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("case", LONG_DECODE, ids=[c[0] for c in LONG_DECODE])
def test_decode_loop_knobs_equal_default(case, splits, knobs, monkeypatch):
    """gpu_model.ROPE_ATTENTION_PAGES_AHEAD (decode: each key tile's block-table entries
    loaded one iteration ahead) and ROPE_ATTENTION_WRITE_FIRST (the new token's K/V written
    before the key loop, which reads it back from the cache after the first tile, 1, or in
    every tile, 2), ROPE_ATTENTION_OFF32 (32-bit cache offsets) and _SAME_STRIDES (the
    values at the keys' offsets) read the same keys in the same order: output and cache
    writes bit for bit those of the loop before session 34 (BEFORE_S34; "defaults": today's
    defaults, decode_loop_knobs' choice: on these CPU grids WRITE_FIRST=2 with OFF32 and
    SAME_STRIDES), at
    contexts of several key tiles (float32: 32-key tiles; 70 keys in one split: three; the
    new token past the first tile). Negative control: a block table shifted by one entry
    past the first tile (what loading the wrong tile's entries would read) changes the
    output."""
    from megatron_tlt.rollout import gpu_model
    _, ctx, heads, kvh, d, page, planes, bias, q = case
    qkv, pos, slots, cos, sin, kc, vc, meta, kw = _case(
        ctx, heads=heads, kvh=kvh, d=d, page=page, planes=planes, bias=bias, seed=5, q=q)
    live = [i for i, s in enumerate(slots.tolist()) if s >= 0]
    defaults = {knob: getattr(gpu_model, knob) for knob in BEFORE_S34}
    for knob, value in BEFORE_S34.items():
        monkeypatch.setattr(gpu_model, knob, value)
    k1, v1 = kc.clone(), vc.clone()
    ref = _fused(qkv, pos, slots, cos, sin, k1, v1, meta, kw, splits)
    for knob, value in (defaults if knobs == "defaults" else knobs).items():
        monkeypatch.setattr(gpu_model, knob, value)
    k2, v2 = kc.clone(), vc.clone()
    out = _fused(qkv, pos, slots, cos, sin, k2, v2, meta, kw, splits)
    assert torch.equal(k2, k1) and torch.equal(v2, v1)
    assert torch.equal(out[live], ref[live])
    bt = meta["block_tables"].clone()
    first = 32 // page  # float32 caches: 32-key tiles
    bt[:, first:] = torch.roll(bt[:, first:], 1, dims=1)
    bad = _fused(qkv, pos, slots, cos, sin, kc.clone(), vc.clone(), dict(meta, block_tables=bt),
                 kw, splits)
    long = [i for i in live if ctx[i] > 32]
    assert long and not torch.equal(bad[long], ref[long])


def test_decode_write_first_follows_the_grid(monkeypatch):
    """ROPE_ATTENTION_WRITE_FIRST=None (the default) asks decode_write_first with the
    launch's program count (sequences x KV heads x row tiles x splits): 1 up to one program
    per SM, 2 past it; a set knob is used as given and the rule is not asked; the verify
    (tree) launch never asks."""
    from megatron_tlt.rollout import gpu_model
    from megatron_tlt.rollout.triton_attention import num_sms
    sms = num_sms("cpu")
    assert gpu_model.ROPE_ATTENTION_WRITE_FIRST is None
    assert gpu_model.decode_write_first(sms, "cpu") == 1
    assert gpu_model.decode_write_first(sms + 1, "cpu") == 2
    asked = []
    rule = gpu_model.decode_write_first
    monkeypatch.setattr(gpu_model, "decode_write_first",
                        lambda programs, device: asked.append(programs) or rule(programs, device))
    _, ctx, heads, kvh, d, page, planes, bias, q = LONG_DECODE[0]
    qkv, pos, slots, cos, sin, kc, vc, meta, kw = _case(
        ctx, heads=heads, kvh=kvh, d=d, page=page, planes=planes, bias=bias, seed=3, q=q)
    _fused(qkv, pos, slots, cos, sin, kc.clone(), vc.clone(), meta, kw, 3)
    assert asked == [len(ctx) * kvh * 3]
    monkeypatch.setattr(gpu_model, "ROPE_ATTENTION_WRITE_FIRST", 1)
    _fused(qkv, pos, slots, cos, sin, kc.clone(), vc.clone(), meta, kw, 3)
    assert asked == [len(ctx) * kvh * 3]
    tree = next(c for c in CASES if c[8] > 1)
    _, ctx, heads, kvh, d, page, planes, bias, q = tree
    monkeypatch.setattr(gpu_model, "ROPE_ATTENTION_WRITE_FIRST", None)
    qkv, pos, slots, cos, sin, kc, vc, meta, kw = _case(
        ctx, heads=heads, kvh=kvh, d=d, page=page, planes=planes, bias=bias, seed=3, q=q)
    _fused(qkv, pos, slots, cos, sin, kc.clone(), vc.clone(), meta, kw, 3)
    assert asked == [len(LONG_DECODE[0][1]) * LONG_DECODE[0][3] * 3]


def test_decode_loop_knobs_defaults_and_overrides(monkeypatch):
    """decode_loop_knobs: by default WRITE_FIRST by the grid, OFF32 where the offsets fit,
    SAME_STRIDES with WRITE_FIRST=2 only (the combinations session 34 timed and GPU-tested)
    and never for caches of unequal strides; set knobs are taken as given."""
    from megatron_tlt.rollout import gpu_model
    from megatron_tlt.rollout.triton_attention import num_sms
    sms = num_sms("cpu")
    kc = torch.zeros(4, 16, 2, 64)
    other = kc.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    big = torch.empty((2 ** 31) // (16 * 2 * 64) + 1, 16, 2, 64, device="meta")
    knobs = gpu_model.decode_loop_knobs
    assert knobs(sms, kc, kc) == (1, True, False)
    assert knobs(sms + 1, kc, kc) == (2, True, True)
    assert knobs(sms + 1, kc, other) == (2, True, False)
    assert knobs(sms + 1, big, big) == (2, False, True)
    monkeypatch.setattr(gpu_model, "ROPE_ATTENTION_SAME_STRIDES", True)
    assert knobs(sms, kc, kc) == (1, True, True) and knobs(sms, kc, other) == (1, True, False)
    monkeypatch.setattr(gpu_model, "ROPE_ATTENTION_WRITE_FIRST", 0)
    monkeypatch.setattr(gpu_model, "ROPE_ATTENTION_OFF32", False)
    monkeypatch.setattr(gpu_model, "ROPE_ATTENTION_SAME_STRIDES", False)
    assert knobs(sms + 1, kc, kc) == (0, False, False)


def test_same_strides_only_where_the_value_cache_shares_them(monkeypatch):
    """ROPE_ATTENTION_SAME_STRIDES loads the values at the keys' offsets only when the
    launch sees equal strides: a value cache laid out [blocks, kv heads, page, dim] (the
    same shape through a permuted view) keeps its own offsets, so the output still equals
    the default's bit for bit (without the host's check it reads the wrong values)."""
    from megatron_tlt.rollout import gpu_model
    _, ctx, heads, kvh, d, page, planes, bias, q = LONG_DECODE[0]
    qkv, pos, slots, cos, sin, kc, vc, meta, kw = _case(
        ctx, heads=heads, kvh=kvh, d=d, page=page, planes=planes, bias=bias, seed=9, q=q)
    live = [i for i, s in enumerate(slots.tolist()) if s >= 0]

    def other_layout(x):
        return x.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)

    ref = _fused(qkv, pos, slots, cos, sin, kc.clone(), vc.clone(), meta, kw, 1)
    v2 = other_layout(vc)
    assert v2.stride() != kc.stride() and torch.equal(v2, vc)
    monkeypatch.setattr(gpu_model, "ROPE_ATTENTION_SAME_STRIDES", True)
    out = _fused(qkv, pos, slots, cos, sin, kc.clone(), v2, meta, kw, 1)
    assert torch.equal(out[live], ref[live])


def test_offsets_fit_int32_sees_the_largest_offset():
    """offsets_fit_int32 (ROPE_ATTENTION_OFF32's check) takes a cache whose last element sits
    below 2**31 - 1 and refuses one a single block larger (meta tensors: no memory)."""
    from megatron_tlt.rollout.gpu_model import offsets_fit_int32
    per_block = 16 * 8 * 128
    fits = (2 ** 31 - 1) // per_block
    ok = torch.empty(fits, 16, 8, 128, device="meta")
    big = torch.empty(fits + 1, 16, 8, 128, device="meta")
    assert offsets_fit_int32(ok, ok) and offsets_fit_int32(torch.empty(4, 16, 2, 64))
    assert not offsets_fit_int32(ok, big) and not offsets_fit_int32(big)


@pytest.mark.parametrize("block_n", [16, 64])
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[6]], ids=["gqa3", "bias-planes", "tree-q5"])
def test_key_tile_override_matches_default_tiles(case, block_n, monkeypatch):
    """gpu_model.ROPE_ATTENTION_BLOCK_N (an A/B knob; float32 caches default to 32-key
    tiles): other tiles sum the keys in another order, so the output agrees with the
    default's within 1e-5 (not bit for bit; with splits the live splits differ too), the
    cache writes are equal, and the same comparison fails for a position off by one
    (negative control); values that are no power of two >= 16 are refused."""
    from megatron_tlt.rollout import gpu_model
    _, ctx, heads, kvh, d, page, planes, bias, q = case
    qkv, pos, slots, cos, sin, kc, vc, meta, kw = _case(
        ctx, heads=heads, kvh=kvh, d=d, page=page, planes=planes, bias=bias, seed=11, q=q)
    live = [i for i, s in enumerate(slots.tolist()) if s >= 0]
    k1, v1 = kc.clone(), vc.clone()
    ref = _fused(qkv, pos, slots, cos, sin, k1, v1, meta, kw, 3)
    monkeypatch.setattr(gpu_model, "ROPE_ATTENTION_BLOCK_N", block_n)
    k2, v2 = kc.clone(), vc.clone()
    out = _fused(qkv, pos, slots, cos, sin, k2, v2, meta, kw, 3)
    assert torch.equal(k2, k1) and torch.equal(v2, v1)
    torch.testing.assert_close(out[live], ref[live], rtol=0, atol=1e-5)
    bad = _fused(qkv, pos + 1, slots, cos, sin, kc.clone(), vc.clone(), meta, kw, 3)
    assert (bad[live] - ref[live]).abs().max() > 1e-3
    for wrong in (8, 48):
        monkeypatch.setattr(gpu_model, "ROPE_ATTENTION_BLOCK_N", wrong)
        with pytest.raises(ValueError, match="power of two"):
            _fused(qkv, pos, slots, cos, sin, kc.clone(), vc.clone(), meta, kw, 3)


@pytest.mark.parametrize("write_first", [None, 0])
@pytest.mark.parametrize("q", [1, 5])
def test_comparison_catches_a_wrong_position_and_a_missing_write(q, write_first, monkeypatch):
    """Negative controls: the same comparison fails when the fused kernel is given other
    positions (RoPE differs) or told not to write the first sequence's K/V (slot -1: the
    cache differs, and in the tree verify that sequence's output too, since it reads its
    new keys back; so does decode with WRITE_FIRST=2, decode_write_first's choice for this
    grid of 12 programs on 4 "SMs"; with 0 or 1 decode takes the new key and value from
    registers, so there the output stays the separate kernels')."""
    from megatron_tlt.rollout import gpu_model
    monkeypatch.setattr(gpu_model, "ROPE_ATTENTION_WRITE_FIRST", write_first)
    reads_back = q > 1 or (write_first is None and gpu_model.decode_write_first(2 * 2 * 3, "cpu") == 2)
    qkv, pos, slots, cos, sin, kc, vc, meta, kw = _case(
        [7, 40], heads=6, kvh=2, d=16, page=4, planes=1, bias=False, seed=5, q=q)
    k1, v1 = kc.clone(), vc.clone()
    ref = _separate(qkv, pos, slots, cos, sin, k1, v1, meta, kw, 3)
    k2, v2 = kc.clone(), vc.clone()
    out = _fused(qkv, pos + 1, slots, cos, sin, k2, v2, meta, kw, 3)
    assert not torch.equal(out, ref) and not torch.equal(k2, k1)
    assert torch.equal(v2, v1)  # V takes no RoPE
    k3, v3 = kc.clone(), vc.clone()
    no_write = slots.clone()
    no_write[:q] = -1
    out = _fused(qkv, pos, no_write, cos, sin, k3, v3, meta, kw, 3)
    assert not torch.equal(k3, k1)
    assert torch.equal(out[:q], ref[:q]) == (not reads_back)
    assert torch.equal(out[q:], ref[q:])


def test_rope_attention_argument_errors():
    qkv, pos, slots, cos, sin, kc, vc, meta, kw = _case(
        [3], heads=4, kvh=2, d=16, page=4, planes=1, bias=False, seed=0)
    with pytest.raises(ValueError, match="disagree"):
        _fused(qkv, pos, slots, cos, sin, kc, vc, meta, {**kw, "num_kv_heads": 4}, 1)
    with pytest.raises(ValueError, match="one token per sequence"):
        _fused(qkv, pos, slots, cos, sin, kc, vc,
               dict(block_tables=meta["block_tables"].repeat(2, 1),
                    context_lens=meta["context_lens"].repeat(2)), kw, 1)
    with pytest.raises(ValueError, match="go together"):
        _fused(qkv, pos, slots, cos, sin, kc, vc, {**meta, "query_start": torch.tensor([0, 1])}, kw, 1)
    with pytest.raises(TypeError, match="q_norm"):  # q/k-norm models keep the separate kernels
        _fused(qkv, pos, slots, cos, sin, kc, vc, meta, {**kw, "q_norm": torch.ones(16)}, 1)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_forward_fused_rope_equals_separate(family, monkeypatch):
    """DecodeModel with MEGATRON_TLT_FUSED_ROPE=1: the same logits and caches, bit for bit,
    over decode steps of a three-sequence batch with split-K, then a tree verify forward
    (Q = 4 per sequence). Control: only the fused model called rope_attention, once per
    layer and forward, and not for qwen3 (q/k-norm: the separate kernels)."""
    from megatron_tlt.rollout import gpu_model
    calls = []
    real = gpu_model.rope_attention
    monkeypatch.setattr(gpu_model, "rope_attention",
                        lambda *a, **k: calls.append(k.get("tree_mask") is not None) or real(*a, **k))
    arch = ModelArch(family=family, vocab_size=300, hidden_size=64, intermediate_size=96,
                     num_layers=2, num_heads=6, num_kv_heads=2, head_dim=16,
                     max_position_embeddings=256, tie_word_embeddings=family != "llama",
                     qkv_bias=family == "qwen2", qk_norm=family == "qwen3")
    w = EngineWeights.make_dummy(arch, seed=3)
    cos, sin = rope_table(64, 16, 10000.0)
    models = []
    for flag in ("0", "1"):
        monkeypatch.setenv(FUSED_ROPE_ENV, flag)
        models.append(DecodeModel(arch, w, cos, sin))
    assert (models[0].fused_rope, models[1].fused_rope) == (False, True)
    g = torch.Generator().manual_seed(4)
    caches = [PagedKVCache(num_layers=2, num_kv_heads=2, head_dim=16, num_blocks=12, block_size=4)
              for _ in models]
    for layer in range(2):
        k, v = torch.randn(caches[0].k[layer].shape, generator=g), torch.randn(caches[0].v[layer].shape, generator=g)
        for c in caches:
            c.k[layer].copy_(k)
            c.v[layer].copy_(v)
    bt = torch.tensor([[2, 5, 0, 8, 10], [1, 7, 0, 8, 10], [3, 4, 6, 9, 11]], dtype=torch.int32)
    pos = torch.tensor([5, 0, 10], dtype=torch.int32)
    ids = torch.tensor([3, 250, 7], dtype=torch.int32)

    def check(logits):
        assert torch.equal(logits[0], logits[1])
        for layer in range(2):
            assert torch.equal(caches[0].k[layer], caches[1].k[layer])
            assert torch.equal(caches[0].v[layer], caches[1].v[layer])

    slot = lambda b, p: bt[b, p // 4] * 4 + p % 4  # noqa: E731
    for _ in range(3):
        slots = torch.stack([slot(b, p) for b, p in enumerate(pos.tolist())])
        logits = [m.forward(ids, pos, slots, bt, pos + 1, c, num_splits=2)
                  for m, c in zip(models, caches)]
        check(logits)
        ids = logits[0].argmax(-1).to(torch.int32)
        pos = pos + 1
    q = 4  # a verify forward: a random tree of 4 draft tokens per sequence
    trees = [random_tree(q, g) for _ in range(3)]
    vids = torch.randint(0, 300, (3 * q,), generator=g, dtype=torch.int32)
    vpos = torch.tensor([int(pos[b]) + dep for b, (_, depth) in enumerate(trees) for dep in depth],
                        dtype=torch.int32)
    vslots = torch.stack([slot(b, int(pos[b]) + j) for b in range(3) for j in range(q)])
    mask = torch.stack([m for m, _ in trees])
    logits = [m.forward(vids, vpos, vslots, bt, pos + q, c, num_splits=3,
                        query_start=torch.arange(4, dtype=torch.int32) * q, tree_mask=mask)
              for m, c in zip(models, caches)]
    check(logits)
    # 3 decode steps, 1 verify, x 2 layers
    assert calls == ([] if family == "qwen3" else [False] * 6 + [True] * 2)


@pytest.mark.parametrize("pdl_on,mb,few_rows,budget", [
    (True, 1.5, None, 3 << 19), (False, 1.5, None, 3 << 19), (True, 1.5, 2, 3 << 20),
    (True, 1.5, 1, 3 << 19), (True, 0, 2, 0)])
def test_forward_asks_l2_for_next_weights_after_attention(pdl_on, mb, few_rows, budget, monkeypatch):
    """gpu_model.ATTN_L2_PREFETCH_MB: under PDL, each layer's fused attention launch is
    followed by l2_prefetch(o_weight, gate_up_weight, budget) before its split merge (so the
    prefetch overlaps the attention, rollout/l2_prefetch.py), and the logits are those
    without it. Without PDL nothing is asked for (negative control: a prefetch kernel would
    only run serialised between the attention and the merge). ATTN_L2_PREFETCH_MB_FEW
    (3 MB here) replaces the budget of this two-row step when ATTN_L2_PREFETCH_FEW_ROWS is 2,
    not when it is 1 or ATTN_L2_PREFETCH_MB_FEW is None; ATTN_L2_PREFETCH_MB=0 is off at
    every row count."""
    from megatron_tlt.rollout import gpu_model, pdl
    monkeypatch.setenv(FUSED_ROPE_ENV, "1")
    bt = torch.tensor([[2, 5, 0, 8], [1, 7, 3, 9]], dtype=torch.int32)
    _, w, run = tiny_decode(bt, torch.tensor([5, 12], dtype=torch.int32),
                            torch.tensor([3, 250], dtype=torch.int32), num_blocks=12)
    ref = run()
    events = []
    real_combine = gpu_model.combine_splits
    monkeypatch.setattr(gpu_model, "combine_splits",
                        lambda *a, **k: events.append("merge") or real_combine(*a, **k))
    monkeypatch.setattr(gpu_model, "l2_prefetch", lambda a, b, n: events.append(
        (a.data_ptr(), b.data_ptr(), n)) or 0)
    monkeypatch.setattr(pdl, "active", lambda: pdl_on)  # the CPU has no PDL: its wiring only
    monkeypatch.setattr(gpu_model, "ATTN_L2_PREFETCH_MB", mb)
    monkeypatch.setattr(gpu_model, "ATTN_L2_PREFETCH_MB_FEW", None if few_rows is None else 3.0)
    monkeypatch.setattr(gpu_model, "ATTN_L2_PREFETCH_FEW_ROWS", few_rows or 2)
    out = run()
    assert torch.equal(out, ref)
    want = [[(lw.o_weight.data_ptr(), lw.gate_up_weight.data_ptr(), budget), "merge"]
            if pdl_on and budget else ["merge"] for lw in w.layers]
    assert events == [e for pair in want for e in pair]


def test_l2_prefetch_ranges():
    """rollout/l2_prefetch.prefetch_ranges: the first weight's bytes from its start, then
    the second's with the rest of the budget; a tensor that is not contiguous is skipped
    (a lone range first); the byte views alias the weights (their data pointers)."""
    from megatron_tlt.rollout.l2_prefetch import prefetch_ranges
    a = torch.zeros(300, 256, dtype=torch.bfloat16)  # 153600 B
    b = torch.zeros(1000, 512, dtype=torch.bfloat16)  # 1024000 B

    def got(first, second, budget):
        (x, nx), (y, ny) = prefetch_ranges(first, second, budget)
        return x.data_ptr(), nx, y.data_ptr(), ny
    pa, pb = a.data_ptr(), b.data_ptr()
    assert got(a, b, 200_000) == (pa, 153600, pb, 46400)
    assert got(a, b, 1000) == (pa, 1000, pa, 0)  # nothing of b: a stands in
    assert got(a, None, 1 << 30)[:2] == (pa, 153600) and got(a, None, 1 << 30)[3] == 0
    assert got(b.t(), a, 1 << 20) == (pa, 153600, pa, 0)
    assert got(a, b.t(), 1 << 20) == (pa, 153600, pa, 0)
    for first, second in ((a, b), (a, b.t()), (b.t(), a), (a, None)):  # one pointer type
        (x, _), (y, _) = prefetch_ranges(first, second, 1000)
        assert x.dtype == y.dtype == torch.uint8
    assert got(b.t(), None, 1 << 20)[1] == 0
    assert got(a, b, 0)[1] == 0 and got(a, b, 0)[3] == 0
