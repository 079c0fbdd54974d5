"""Paged KV cache accounting and the reference paged attention against dense SDPA."""

import pytest
import torch
import torch.nn.functional as F

from megatron_tlt.rollout.attention import AttentionMetadata, TorchPagedAttention, write_kv
from megatron_tlt.rollout.kv_cache import PagedKVCache


def _cache(num_blocks=6, block_size=4):
    return PagedKVCache(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=num_blocks,
                        block_size=block_size)


def test_allocate_free_and_slots():
    c = _cache()
    assert c.ensure(0, 5) and c.block_table(0) == [0, 1]
    assert c.ensure(1, 4) and c.block_table(1) == [2]
    assert c.ensure(0, 8) and c.block_table(0) == [0, 1]  # already enough
    assert not c.ensure(1, 17)  # needs 4 more, 3 free: nothing allocated
    assert c.block_table(1) == [2] and c.num_free_blocks == 3
    assert c.slots(0, torch.tensor([0, 3, 4, 7])).tolist() == [0, 3, 4, 7]
    assert c.slots(1, torch.tensor([1])).tolist() == [9]
    with pytest.raises(RuntimeError, match="beyond"):
        c.slots(1, torch.tensor([4]))
    c.free(0)
    assert c.num_free_blocks == 5 and c.ensure(2, 12) and c.block_table(2) == [0, 1, 3]
    c.free(1)
    c.free(2)
    c.free(99)  # unknown id: no-op
    assert c.num_free_blocks == 6 and not c.has_sequences()
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        _cache(block_size=0)


def test_move_compacts_every_layer():
    c = _cache()
    c.ensure(0, 8)
    for t in c.k + c.v:
        t.view(-1, 2, 8)[:8] = torch.arange(8.0)[:, None, None]
    c.move(0, torch.tensor([3, 5, 6]), torch.tensor([3, 4, 5]))  # keep 3, 5, 6; drop 4
    for t in c.k + c.v:
        assert t.view(-1, 2, 8)[:6, 0, 0].tolist() == [0, 1, 2, 3, 5, 6]


def test_sleep_wake():
    c = _cache()
    c.sleep()
    assert c.is_sleeping
    with pytest.raises(RuntimeError, match="asleep"):
        c.ensure(0, 1)
    c.wake()
    assert c.k[0].shape == (6, 4, 2, 8) and c.ensure(0, 1)
    with pytest.raises(RuntimeError, match="only allowed when idle"):
        c.sleep()


@pytest.mark.parametrize("precise", [True, False])
def test_paged_attention_matches_dense_sdpa(precise):
    torch.manual_seed(0)
    heads, kvh, d, bs = 4, 2, 8, 4
    c = PagedKVCache(num_layers=1, num_kv_heads=kvh, head_dim=d, num_blocks=16, block_size=bs)
    lens = [7, 1, 10]  # causal prefill of three sequences
    c.ensure(9, 8)  # a finished sequence's blocks get reused out of order below
    c.ensure(0, 7)
    c.ensure(1, 1)
    c.free(9)
    c.ensure(2, 10)
    tables = [c.block_table(i) for i in range(3)]
    assert tables[2] == [0, 1, 5]  # non-contiguous
    slots = torch.cat([c.slots(i, torch.arange(n)) for i, n in enumerate(lens)])
    t = sum(lens)
    q, k, v = torch.randn(t, heads, d), torch.randn(t, kvh, d), torch.randn(t, kvh, d)
    write_kv(c.k[0], c.v[0], slots, k, v)
    width = max(map(len, tables))
    bt = torch.tensor([tb + [0] * (width - len(tb)) for tb in tables])
    meta = AttentionMetadata(slot_mapping=slots, query_start=torch.tensor([0, 7, 8, 18]),
                             context_lens=torch.tensor(lens), block_tables=bt)
    out = TorchPagedAttention(precise=precise).forward(q, c.k[0], c.v[0], meta)
    start = 0
    for n in lens:
        qs, ks, vs = (x[start:start + n].transpose(0, 1) for x in (q, k, v))
        ref = F.scaled_dot_product_attention(qs, ks.repeat_interleave(2, 0), vs.repeat_interleave(2, 0),
                                             is_causal=True).transpose(0, 1)
        torch.testing.assert_close(out[start:start + n], ref, atol=1e-5, rtol=1e-5)
        start += n


def test_make_dummy_metadata_runs():
    meta = AttentionMetadata.make_dummy(num_seqs=3, num_new=2, block_size=4)
    c = PagedKVCache(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=3, block_size=4)
    k = torch.randn(6, 1, 4)
    write_kv(c.k[0], c.v[0], meta.slot_mapping, k, k)
    out = TorchPagedAttention().forward(torch.randn(6, 2, 4), c.k[0], c.v[0], meta)
    assert out.shape == (6, 2, 4) and torch.isfinite(out).all()
