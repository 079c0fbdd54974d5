"""Packing (prompt, solution) samples into rows: layout, determinism, and the block mask.

The mask test is the one that matters: a packed row's logits equal each sample's
logits run alone (Megatron-Core actor, fp32), and with a plain causal mask instead
they do not (the negative control).
"""

from __future__ import annotations

import pytest
import torch

from megatron_tlt.data.packing import (PackedRows, TokenizedSample, block_causal_mask, fits, pack,
                                       pack_all, tokenize_sample)

PAD = 0


def _samples(*specs):
    return [TokenizedSample(tuple(ids), plen) for ids, plen in specs]


def test_layout_of_two_samples_and_padding():
    # sample A: prompt [1, 10, 11], solution [20, 21], eos 2 -> 6 tokens, 5 positions
    # sample B: prompt [1, 12], solution [22], eos 2        -> 4 tokens, 3 positions
    s = _samples(([1, 10, 11, 20, 21, 2], 3), ([1, 12, 22, 2], 2))
    rows, nxt = pack(s.__getitem__, 0, 1, 10, PAD, limit=2)
    assert nxt == 2 and rows.num_samples == 2 and rows.num_tokens == 8
    assert rows.tokens.tolist() == [[1, 10, 11, 20, 21, 1, 12, 22, PAD, PAD]]
    assert rows.labels.tolist() == [[10, 11, 20, 21, 2, 12, 22, 2, PAD, PAD]]
    # loss exactly where the label is a solution token or the eos
    assert rows.loss_mask.tolist() == [[0, 0, 1, 1, 1, 0, 1, 1, 0, 0]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1]]
    assert rows.segment_ids.tolist() == [[0, 0, 0, 0, 0, 1, 1, 1, 2, 2]]


def test_block_causal_mask_matches_definition():
    seg = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 0, 0, 0]])
    mask = block_causal_mask(seg)
    assert mask.shape == (2, 1, 8, 8) and mask.dtype == torch.bool
    for b in range(2):
        for i in range(8):
            for j in range(8):
                visible = j <= i and seg[b, i] == seg[b, j]
                assert bool(mask[b, 0, i, j]) == (not visible)
    assert not mask[:, 0].all(dim=-1).any(), "no query may be fully masked (NaN softmax)"
    # one segment per row is the plain causal mask
    assert torch.equal(mask[1, 0], torch.triu(torch.ones(8, 8, dtype=torch.bool), diagonal=1))


def test_packing_is_deterministic_and_resumable():
    dummy = PackedRows.make_dummy(rows=2, seq_length=32, seed=3)
    assert torch.equal(dummy.tokens, PackedRows.make_dummy(rows=2, seq_length=32, seed=3).tokens)
    g = torch.Generator().manual_seed(0)
    pool = []
    for _ in range(200):
        n = int(torch.randint(3, 40, (), generator=g))
        pool.append(TokenizedSample(tuple(torch.randint(4, 100, (n,), generator=g).tolist()), 2))
    whole, end = pack(pool.__getitem__, 0, 8, 48, PAD)
    first, mid = pack(pool.__getitem__, 0, 4, 48, PAD)
    second, end2 = pack(pool.__getitem__, mid, 4, 48, PAD)
    assert end == end2
    for f in ("tokens", "labels", "loss_mask", "position_ids", "segment_ids"):
        assert torch.equal(getattr(whole, f), torch.cat([getattr(first, f), getattr(second, f)])), f
    # every sample before `end` appears exactly once, in order (sample ids are >= 4, PAD is 0)
    flat = whole.tokens[whole.tokens != PAD].tolist()
    assert flat == [t for i in range(end) for t in pool[i].ids[:-1]]


def test_overlong_and_one_per_row():
    s = _samples(([1] + list(range(10, 30)) + [2], 1), ([1, 5, 6, 2], 2), ([1, 7, 2], 1))
    assert not fits(s[0], 8) and fits(s[1], 8)
    dropped, nxt = pack(s.__getitem__, 0, 1, 8, PAD, overlong="drop", limit=3)
    assert nxt == 3 and dropped.num_samples == 2 and dropped.tokens[0, 0].item() == 1
    assert dropped.tokens[0, :5].tolist() == [1, 5, 6, 1, 7]
    cut, nxt = pack(s.__getitem__, 0, 1, 8, PAD, overlong="truncate", limit=3)
    assert nxt == 1 and cut.tokens[0].tolist() == [1] + list(range(10, 17))
    assert cut.loss_mask[0].tolist() == [1.0] * 8  # prompt_len 1: every label is solution
    single, nxt = pack(s.__getitem__, 1, 2, 8, PAD, one_per_row=True, limit=3)
    assert nxt == 3 and single.segment_ids[:, :3].tolist() == [[0, 0, 0], [0, 0, 1]]
    with pytest.raises(ValueError, match="overlong"):
        pack(s.__getitem__, 0, 1, 8, PAD, overlong="wrap")


def test_pack_all_pads_to_a_row_multiple():
    s = _samples(*[([1, 5, 6, 7, 2], 2)] * 5)
    rows = pack_all(s, 8, PAD, rows_multiple_of=4)
    assert rows.num_rows == 4 and rows.num_samples == 5
    assert rows.loss_mask[3].sum() == 0  # the padding row
    mbs = rows.microbatches(2)
    assert len(mbs) == 2 and mbs[0].attention_mask is None  # built where the batch runs
    for i, mb in enumerate(mbs):
        mask = mb.to("cpu").attention_mask
        assert mask.shape == (2, 1, 8, 8) and torch.equal(mask, rows.attention_mask()[2 * i:2 * i + 2])
    assert rows.microbatches(2, with_mask=False)[0].to("cpu").attention_mask is None


def test_tokenize_sample_matches_what_the_engine_is_fed():
    from megatron_tlt.data.tokenizer import load_tokenizer

    tok = load_tokenizer("tiny")
    s = tokenize_sample(tok, "Sort: [2,1]\n", "[1,2]\n#### [1,2]")
    assert list(s.ids[: s.prompt_len]) == tok.encode_prompt("Sort: [2,1]\n")
    assert s.ids[-1] == tok.eos_id and tok.decode(s.ids[s.prompt_len:-1]) == "[1,2]\n#### [1,2]"


# ---- the block mask on the real model ------------------------------------------------

@pytest.fixture(scope="module")
def actor():
    from megatron_tlt.models import mcore
    from megatron_tlt.models.actor import Actor
    from megatron_tlt.models.arch import ModelArch

    mcore.init_parallel(1, 1, seed=5)
    arch = ModelArch(family="llama", vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128)
    return Actor(arch, init_seed=11)


def _logits(actor, tokens, position_ids, attention_mask):
    from megatron_tlt.models import mcore
    from megatron_tlt.models.actor import MicroBatch

    mb = MicroBatch(tokens=tokens, position_ids=position_ids, attention_mask=attention_mask)
    out = actor.forward_backward([mb], lambda lg, _mb: (lg.sum() * 0, {"logits": mcore.gather_logits(lg, actor.arch)}),
                                 forward_only=True)
    return out[0]["logits"]


def test_packed_row_logits_equal_each_sample_alone(actor):
    g = torch.Generator().manual_seed(1)
    samples = [TokenizedSample(tuple(torch.randint(4, 100, (n,), generator=g).tolist()), 3) for n in (9, 14, 6)]
    rows, nxt = pack(samples.__getitem__, 0, 1, 32, PAD, limit=3)
    assert nxt == 3 and rows.num_samples == 3
    packed = _logits(actor, rows.tokens, rows.position_ids, rows.attention_mask())[0]
    causal_only = _logits(actor, rows.tokens, rows.position_ids, None)[0]
    start = 0
    worst_leak = 0.0
    for i, s in enumerate(samples):
        n = len(s) - 1
        alone = _logits(actor, torch.tensor([s.ids[:-1]]), torch.arange(n)[None], None)[0]
        torch.testing.assert_close(packed[start:start + n], alone, rtol=0, atol=1e-5)
        if i > 0:  # negative control: without the block mask, later samples see earlier ones
            worst_leak = max(worst_leak, (causal_only[start:start + n] - alone).abs().max().item())
        start += n
    assert worst_leak > 1e-2, "a plain causal mask should change the logits of the later samples"
