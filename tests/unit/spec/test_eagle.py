"""EAGLE drafter: ownership of weights, packed training forward, drafting with its own
KV cache (chains and trees equal step-by-step recomputation), reduced vocabulary,
save/load in the HF-EAGLE-like layout."""

import os
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from spec_testutil import make_engine, one_thread, random_eagle, spec_models  # noqa: E402,F401

from megatron_tlt.errors import CheckpointError, ConfigError  # noqa: E402
from megatron_tlt.rollout.sampling import SamplingParams, make_noise_stream  # noqa: E402
from megatron_tlt.spec.eagle import (DrafterConfig, EagleDrafter, EagleProposer,  # noqa: E402
                                     count_frequent_tokens)
from megatron_tlt.spec.export import (export_drafter, load_drafter, save_drafter,  # noqa: E402
                                      validate_drafter_dir)
from megatron_tlt.spec.tree import Strategy  # noqa: E402


@pytest.fixture(scope="module")
def engines(spec_models):
    return {k: make_engine(v) for k, v in spec_models.items()}


def test_drafter_owns_only_its_weights(engines):
    for name in ("llama", "tied"):
        e = engines[name]
        target = [t.clone() for t in e.weights.tensors()]
        d = random_eagle(e)
        ptrs = {t.data_ptr() for t in e.weights.tensors()}
        assert not ptrs & {p.data_ptr() for p in d.parameters()}
        assert not ptrs & {t.data_ptr() for t in d.state_dict().values()}
        assert set(d.state_dict()) == {k for k, _ in d.named_parameters()}
        assert not any("embed" in k or "lm_head" in k for k in d.state_dict())
        assert d.target_embed is e.weights.embed and d.target_lm_head is e.weights.lm_head
        before = {k: v.clone() for k, v in d.state_dict().items()}
        opt = torch.optim.AdamW(d.parameters(), lr=1e-2)
        n = 12
        tokens = torch.randint(e.arch.vocab_size, (n,))
        f, logits = d.forward_packed(tokens, torch.randn(n, e.arch.hidden_size), torch.arange(1, n + 1),
                                     torch.zeros(n, dtype=torch.int64))
        (f.square().mean() + logits.logsumexp(-1).mean()).backward()
        opt.step()
        for t, ref in zip(e.weights.tensors(), target):
            assert torch.equal(t, ref), "a drafter optimizer step changed a target tensor"
            assert t.grad is None and not t.requires_grad
        # Negative control: the drafter's own weights did move.
        assert any(not torch.equal(v, before[k]) for k, v in d.state_dict().items())


def test_packed_forward_has_no_cross_sample_attention(engines):
    e = engines["qwen2"]
    d = random_eagle(e)
    h = e.arch.hidden_size
    a_tok, b_tok = torch.randint(300, (5,)), torch.randint(300, (7,))
    a_f, b_f = torch.randn(5, h), torch.randn(7, h)
    with torch.no_grad():
        fa, la = d.forward_packed(a_tok, a_f, torch.arange(1, 6), torch.zeros(5, dtype=torch.int64))
        fb, lb = d.forward_packed(b_tok, b_f, torch.arange(1, 8), torch.zeros(7, dtype=torch.int64))
        f, lg = d.forward_packed(torch.cat([a_tok, b_tok]), torch.cat([a_f, b_f]),
                                 torch.cat([torch.arange(1, 6), torch.arange(1, 8)]),
                                 torch.tensor([0] * 5 + [1] * 7))
        f_leak, _ = d.forward_packed(torch.cat([a_tok, b_tok]), torch.cat([a_f, b_f]),
                                     torch.cat([torch.arange(1, 6), torch.arange(1, 8)]),
                                     torch.zeros(12, dtype=torch.int64))
    torch.testing.assert_close(f, torch.cat([fa, fb]), rtol=0, atol=1e-5)
    torch.testing.assert_close(lg, torch.cat([la, lb]), rtol=0, atol=1e-4)
    assert not torch.allclose(f_leak[5:], fb, atol=1e-3)  # one segment: b attends to a


def _fake_seq(seq_id, tokens, temperature=0.0, seed=0):
    req = types.SimpleNamespace(sampling_params=SamplingParams(temperature=temperature, max_new_tokens=64),
                                prompt_id=seq_id)
    return types.SimpleNamespace(seq_id=seq_id, token_ids=list(tokens), request=req,
                                 rng=make_noise_stream(seed, seq_id, 0))


def _reference_logits(d, tokens, feats, extra):
    """Drafter logits of the last pair of a sequence whose committed pairs are
    (tokens[t+1], feats[t]) and whose drafted pairs `extra` are (token, feature)."""
    n = len(tokens) - 1
    toks = torch.tensor(tokens[1:] + [t for t, _ in extra])
    f_in = torch.cat([feats[:n]] + [f[None] for _, f in extra])
    pos = torch.arange(1, toks.numel() + 1)
    f, lg = d.forward_packed(toks, f_in, pos, torch.zeros(toks.numel(), dtype=torch.int64))
    return f[-1], lg[-1]


@pytest.mark.parametrize("draft_vocab, max_pending", [(None, 256), (48, 256), (None, 1)])
def test_drafting_matches_recomputation(engines, draft_vocab, max_pending):
    """Incremental extends (lazy, or eager with max_pending=1) + tree attention over the
    drafter's own cache give the same drafts as recomputing every path from scratch."""
    e = engines["qwen3"]
    d = random_eagle(e, seed=1, draft_vocab=draft_vocab)
    prop = EagleProposer(d, max_pending=max_pending)
    d.batch_invariant = False  # the reference runs untiled: compare with a tolerance
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(e.arch.vocab_size, (14,), generator=g).tolist()
    feats = torch.randn(13, e.arch.hidden_size, generator=g)
    seq = _fake_seq(0, tokens[:6])
    prop.observe(seq, 0, feats[:5])
    strategy = Strategy(depth=3, topk=2, num_verify_tokens=9)
    with torch.no_grad():
        for upto in (6, 9, 14):  # three steps, the sequence growing in between
            seq.token_ids = tokens[:upto]
            if upto > 6:
                prev = prop.states[0].num_features
                prop.observe(seq, prev, feats[prev:upto - 1])
            (tree,) = prop.propose([seq], strategy, [3], [seq])
            assert tree.fallback_reason is None and tree.num_drafts == 8
            assert prop.states[0].num_pairs == upto - 1
            # Every node's children are among the top-k of the reference logits along
            # its path (each drafted pair fed the drafter's own f of its parent).
            for node in range(len(tree.tokens)):
                kids = [i for i in range(1, len(tree.tokens)) if tree.parents[i] == node]
                if not kids:
                    continue
                path = []
                while node > 0:
                    path.insert(0, node)
                    node = tree.parents[node]
                f_prev, lg = _reference_logits(d, tokens[:upto], feats, [])
                extra = []
                for p in path:
                    extra.append((tree.tokens[p], f_prev))
                    f_prev, lg = _reference_logits(d, tokens[:upto], feats, extra)
                top = d.to_target_ids(lg.topk(2).indices).tolist()
                assert {tree.tokens[k] for k in kids} <= set(top), (upto, path)


def test_sampled_chain_probs_live_in_the_draft_vocabulary(engines):
    e = engines["llama"]
    d = random_eagle(e, seed=2, draft_vocab=40)
    prop = EagleProposer(d)
    seq = _fake_seq(3, list(range(10, 20)), temperature=0.7, seed=5)
    prop.observe(seq, 0, torch.randn(9, e.arch.hidden_size))
    (tree,) = prop.propose([seq], Strategy(depth=4), [4], [seq])
    assert tree.draft_probs is not None and tree.draft_probs.shape == (5, e.arch.vocab_size)
    rows = tree.draft_probs[1:]
    torch.testing.assert_close(rows.sum(-1), torch.ones(4))
    outside = torch.ones(e.arch.vocab_size, dtype=torch.bool)
    outside[d.draft_to_target] = False
    assert float(rows[:, outside].abs().max()) == 0.0
    assert all(int(t) in set(d.draft_to_target.tolist()) for t in tree.tokens[1:])
    for i, t in enumerate(tree.tokens[1:], 1):
        assert tree.draft_probs[i, t] > 0  # each token was drawn from its row


def test_count_frequent_tokens():
    ids = count_frequent_tokens([[5, 5, 5, 2, 2, 9], torch.tensor([9, 9, 9, 1])], 12, 3)
    assert ids.tolist() == [2, 5, 9]
    assert count_frequent_tokens([[3]], 6, 3).tolist() == [0, 1, 3]  # ties -> lower id
    with pytest.raises(ConfigError, match="draft vocabulary size 7"):
        count_frequent_tokens([[1]], 6, 7)


def test_fusion_config(engines):
    e = engines["llama"]
    cfg = DrafterConfig(arch=e.arch, fuse_layers=(0, 1))
    d = EagleDrafter(cfg, e.weights.embed, e.weights.lm_head)
    assert d.fuse.weight.shape == (e.arch.hidden_size, 2 * e.arch.hidden_size)
    f, _ = d.forward_packed(torch.arange(4), torch.randn(4, 2 * e.arch.hidden_size), torch.arange(1, 5),
                            torch.zeros(4, dtype=torch.int64))
    assert f.shape == (4, e.arch.hidden_size)
    with pytest.raises(ConfigError, match="per-layer target hidden states"):
        EagleProposer(d)
    with pytest.raises(ConfigError, match="fuse_layers entry 2"):
        DrafterConfig(arch=e.arch, fuse_layers=(2,))


def test_save_load_round_trip(engines, tmp_path):
    from safetensors import safe_open
    e = engines["qwen2"]
    d = random_eagle(e, seed=4, draft_vocab=50)
    save_drafter(d, str(tmp_path / "dr"))
    with safe_open(str(tmp_path / "dr" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert keys == set(d.state_dict()) | {"d2t", "t2d"}
    d2 = load_drafter(str(tmp_path / "dr"), e.arch, e.weights.embed, e.weights.lm_head)
    assert torch.equal(d2.draft_to_target, d.draft_to_target)
    for k, v in d.state_dict().items():
        assert torch.equal(d2.state_dict()[k], v), k
    x = (torch.arange(6), torch.randn(6, e.arch.hidden_size), torch.arange(1, 7), torch.zeros(6, dtype=torch.int64))
    with torch.no_grad():
        assert torch.equal(d.forward_packed(*x)[1], d2.forward_packed(*x)[1])
    # export-drafter copies and re-validates.
    export_drafter(str(tmp_path / "dr"), str(tmp_path / "out"))
    assert validate_drafter_dir(str(tmp_path / "out")).draft_vocab_size == 50


def test_load_errors_name_the_problem(engines, spec_models, tmp_path):
    from safetensors.torch import load_file, save_file
    e = engines["qwen2"]
    path = str(tmp_path / "dr")
    save_drafter(random_eagle(e), path)
    wfile = os.path.join(path, "model.safetensors")
    good = load_file(wfile)
    with pytest.raises(CheckpointError, match="hidden_size=64, but the target has 32"):
        other = e.arch.__class__(**{**e.arch.to_dict(), "hidden_size": 32, "head_dim": 8})
        load_drafter(path, other, e.weights.embed, e.weights.lm_head)
    save_file({**good, "embed_tokens.weight": e.weights.embed.clone()}, wfile)
    with pytest.raises(CheckpointError, match="'embed_tokens.weight' is not part of the drafter"):
        validate_drafter_dir(path)
    save_file({k: v for k, v in good.items() if k != "fc.weight"}, wfile)
    with pytest.raises(CheckpointError, match="'fc.weight' is missing"):
        validate_drafter_dir(path)
    save_file({**good, "norm.weight": torch.ones(3)}, wfile)
    with pytest.raises(CheckpointError, match=r"'norm.weight' has shape \(3,\)"):
        validate_drafter_dir(path)
    with pytest.raises(CheckpointError, match="drafter directory not found"):
        validate_drafter_dir(str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="not a megatron_tlt drafter"):
        validate_drafter_dir(spec_models["qwen2"])  # a target model, not a drafter
    # a truncated weights file and an --out that is a file were tracebacks (SafetensorError,
    # NotADirectoryError), not the CLI contract's one-line errors
    save_file(good, wfile)
    export_drafter(path, str(tmp_path / "ok"))  # control: the intact directory exports
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(CheckpointError, match="--out .*afile exists and is not a directory"):
        export_drafter(path, str(afile))
    with open(wfile, "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError, match=r"model.safetensors: not a readable safetensors file \(SafetensorError"):
        validate_drafter_dir(path)


def test_export_never_replaces_a_directory_that_holds_no_drafter(engines, tmp_path):
    """export-drafter --out pointing at another model's directory (a typo for the target
    model) is refused before anything is written (its config.json and model.safetensors
    were replaced); an earlier export is updated in place; a new export is readable by
    others under the umask (mkdtemp's 0700 was renamed into place)."""
    path = str(tmp_path / "dr")
    save_drafter(random_eagle(engines["qwen2"]), path)
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (target / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(CheckpointError, match="non-empty directory that holds no drafter"):
        export_drafter(path, str(target))
    assert (target / "model.safetensors").read_bytes() == b"weights"
    assert sorted(os.listdir(tmp_path)) == ["dr", "target"]  # no temporary directory left
    old = os.umask(0o022)
    try:
        export_drafter(path, str(tmp_path / "new"))
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "new").st_mode & 0o777 == 0o755
    export_drafter(path, str(tmp_path / "new"))  # an earlier export: updated
    assert validate_drafter_dir(str(tmp_path / "new")).draft_vocab_size == validate_drafter_dir(path).draft_vocab_size


def _ragged_batch(e, temps, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    seqs, feats = [], []
    for sid, (t, n) in enumerate(zip(temps, lengths)):
        toks = torch.randint(e.arch.vocab_size, (n + 4,), generator=g).tolist()
        seqs.append((sid, toks, t))
        feats.append(torch.randn(n + 3, e.arch.hidden_size, generator=g))
    return seqs, feats


def _draft_steps(d, seqs, feats, groups, caps, batched=True):
    """Three propose steps (the sequences growing by 1, 3 and 2 tokens in between: ragged
    pending pairs) for each group of sequence indices, each group on its own proposer.
    Returns per sequence the list of its trees."""
    out = {}
    for group in groups:
        prop = EagleProposer(d)
        prop.batched = batched
        fake = {i: _fake_seq(seqs[i][0], seqs[i][1][:len(seqs[i][1]) - 4], temperature=seqs[i][2], seed=7)
                for i in group}
        for i in group:
            prop.observe(fake[i], 0, feats[i][:len(fake[i].token_ids) - 1])
        for grow in (0, 1, 3):
            for i in group:
                if grow:
                    n0 = len(fake[i].token_ids)
                    fake[i].token_ids = seqs[i][1][:n0 + grow]
                    prop.observe(fake[i], n0 - 1, feats[i][n0 - 1:n0 - 1 + grow])
            trees = prop.propose([fake[i] for i in group], Strategy(depth=4), [caps[i] for i in group],
                                 [fake[i] for i in group])
            for i, t in zip(group, trees):
                out.setdefault(i, []).append(t)
    return out


@pytest.mark.parametrize("draft_vocab", [None, 48])
def test_batched_chains_equal_each_sequence_alone(engines, draft_vocab):
    """Chains of a batch of 5 ragged sequences (different lengths, pending pairs, caps,
    greedy and sampled rows) are bit for bit the chains of each sequence drafted alone
    (tokens and draft probabilities), and agree with the per-sequence path (batched=False:
    attention over exactly len keys, so equal up to rounding)."""
    e = engines["qwen2"]
    d = random_eagle(e, seed=4, draft_vocab=draft_vocab)
    seqs, feats = _ragged_batch(e, [0.0, 0.9, 0.0, 1.0, 0.7], [3, 11, 6, 20, 8], seed=1)
    caps = [4, 2, 4, 3, 1]
    with torch.no_grad():
        batch = _draft_steps(d, seqs, feats, [list(range(5))], caps)
        alone = _draft_steps(d, seqs, feats, [[i] for i in range(5)], caps)
        ref = _draft_steps(d, seqs, feats, [list(range(5))], caps, batched=False)
    for i in range(5):
        for step, (tb, ta, tr) in enumerate(zip(batch[i], alone[i], ref[i])):
            assert tb.fallback_reason is None and tb.num_drafts == caps[i], (i, step)
            assert tb.tokens == ta.tokens and tb.parents == ta.parents, (i, step)
            assert (tb.draft_probs is None) == (seqs[i][2] == 0.0)
            if tb.draft_probs is not None:
                assert torch.equal(tb.draft_probs, ta.draft_probs), (i, step)
            assert tb.tokens == tr.tokens, (i, step)
            if tb.draft_probs is not None:
                torch.testing.assert_close(tb.draft_probs, tr.draft_probs, rtol=0, atol=1e-5)


def _count_ops(fn):
    from torch.overrides import TorchFunctionMode
    import torch.nn.functional as F

    counts = {"cat": 0, "linear": 0}

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.cat:
                counts["cat"] += 1
            elif func is F.linear:
                counts["linear"] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return counts


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_batched_chain_op_count_does_not_grow_with_batch(engines, temperature):
    """torch.cat / linear calls of one propose (one pair pending per sequence, depth 4)
    are the same for 1 and for 8 sequences; the per-sequence path (negative control)
    grows. (Up to 16 rows per linear: the drafter's batch-invariant linear runs one call
    per 16-row tile.)"""
    e = engines["llama"]
    d = random_eagle(e, seed=5)

    def counts(batch, batched):
        prop = EagleProposer(d)
        prop.batched = batched
        g = torch.Generator().manual_seed(3)
        seqs = []
        for sid in range(batch):
            toks = torch.randint(e.arch.vocab_size, (10,), generator=g).tolist()
            s = _fake_seq(sid, toks[:9], temperature=temperature, seed=1)
            f = torch.randn(9, e.arch.hidden_size, generator=g)
            prop.observe(s, 0, f[:8])
            with torch.no_grad():
                prop.propose([s], Strategy(depth=4), [4], [s])
            s.token_ids = toks
            prop.observe(s, 8, f[8:])
            seqs.append(s)
        c = _count_ops(lambda: prop.propose(seqs, Strategy(depth=4), [4] * batch, seqs))
        return c

    one, eight = counts(1, True), counts(8, True)
    assert one == eight, (one, eight)
    ref_one, ref_eight = counts(1, False), counts(8, False)
    assert ref_eight["cat"] > ref_one["cat"], (ref_one, ref_eight)


def test_drafter_kv_slots_grow_release_and_reset(engines):
    """Slots and capacity grow by doubling with the content kept (drafts still agree with
    the per-sequence path); a released slot is reused (lowest first) and zeroed; reset
    frees every slot."""
    e = engines["qwen3"]
    d = random_eagle(e, seed=6)
    seqs, feats = _ragged_batch(e, [0.0, 0.8, 0.0], [5, 9, 13], seed=2)
    caps = [4, 4, 3]
    with torch.no_grad():
        ref = _draft_steps(d, seqs, feats, [[0, 1, 2]], caps, batched=False)
        prop = EagleProposer(d, min_kv_capacity=4)
        fake = [_fake_seq(sid, toks[:len(toks) - 4], temperature=t, seed=7) for sid, toks, t in seqs]
        for s, f in zip(fake, feats):
            prop.observe(s, 0, f[:len(s.token_ids) - 1])
        trees = prop.propose(fake, Strategy(depth=4), caps, fake)
    assert prop.kv.capacity == 16 and prop.kv.num_slots == 8  # 13 + 4 drafts > 8
    for i, t in enumerate(trees):
        assert t.tokens == ref[i][0].tokens
        if t.draft_probs is not None:
            torch.testing.assert_close(t.draft_probs, ref[i][0].draft_probs, rtol=0, atol=1e-5)
    slot1 = prop.states[1].slot
    assert float(prop.kv.k[slot1].abs().sum()) > 0
    prop.release(fake[1])
    late = _fake_seq(9, [1, 2, 3])
    prop.observe(late, 0, torch.randn(2, e.arch.hidden_size))
    assert prop.states[9].slot == slot1 and float(prop.kv.k[slot1].abs().sum()) == 0
    prop.reset()
    assert not prop.states
    prop.observe(late, 0, torch.randn(2, e.arch.hidden_size))
    assert prop.states[9].slot == 0 and float(prop.kv.v[0].abs().sum()) == 0


@pytest.mark.parametrize("invariant", [True, False])
def test_proposer_follows_the_engines_batch_invariance(spec_models, invariant):
    """SpecDecoder binds the drafter to the engine: 16-row matmul tiles (batch-invariant)
    only where the engine is (the CPU default); a non-invariant engine (a CUDA engine's
    default) gets plain products, one weight read per linear. Greedy SD stays lossless
    either way, and each 16-row tile costs one product (counted)."""
    from spec_testutil import requests, tokens

    from megatron_tlt.rollout import model as rollout_model
    from megatron_tlt.spec.decode import SpecDecoder

    reqs = requests(300, [5, 11, 3, 8, 6], max_new_tokens=12)
    plain = make_engine(spec_models["llama"], batch_invariant=invariant)
    base = plain.generate(reqs)
    eng = make_engine(spec_models["llama"], batch_invariant=invariant)
    prop = EagleProposer(random_eagle(eng))
    assert prop.drafter.batch_invariant  # until bound
    eng.spec_decoder = SpecDecoder(prop, Strategy(depth=3))
    res = eng.generate(reqs)
    assert prop.drafter.batch_invariant is invariant
    assert tokens(res) == tokens(base)
    assert eng.spec_decoder.metrics.summary()["total"]["num_drafts"] > 0
    calls = []
    linear = rollout_model.F.linear

    def counted(x, w, b=None):
        calls.append(x.shape[0])
        return linear(x, w, b)
    rollout_model.F.linear = counted
    try:
        d = prop.drafter
        d.logits(torch.zeros(20, d.arch.hidden_size))  # 20 rows through the drafter's head
    finally:
        rollout_model.F.linear = linear
    assert calls == ([16, 16] if invariant else [20])


def test_attend_one_rows_are_batch_invariant_on_cpu():
    """SlotKV.attend_one on the CPU (the reference path): each row's output is bit for bit
    the same whether it is attended alone or among 13 rows (the batched matmul it used
    before broke this on an AVX-512 AMD EPYC: draft probabilities 1e-8 apart, session 15),
    and equals float64 attention within float32 rounding. Control: one key fewer changes
    the output."""
    from megatron_tlt.spec.drafter_kv import SlotKV
    g = torch.Generator().manual_seed(5)
    kv = SlotKV(2, 16, torch.float32, "cpu", min_capacity=48)
    slots = [kv.acquire() for _ in range(6)]
    kv.k.copy_(torch.randn(kv.k.shape, generator=g))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g))
    n = 13
    q = torch.randn(n, 6, 16, generator=g)
    sl = torch.tensor([slots[i % 6] for i in range(n)])
    last = torch.randint(0, 48, (n,), generator=g)
    batched = kv.attend_one(q, sl, last, 0.25)
    for i in range(n):
        assert torch.equal(kv.attend_one(q[i:i + 1], sl[i:i + 1], last[i:i + 1], 0.25)[0], batched[i]), i
    k = kv.k.double()[sl].repeat_interleave(3, dim=2)  # [N, cap, H, D]
    v = kv.v.double()[sl].repeat_interleave(3, dim=2)
    s = torch.einsum("nhd,nchd->nhc", q.double(), k) * 0.25
    s = s.masked_fill(torch.arange(48)[None, None, :] > last[:, None, None], float("-inf"))
    ref = torch.einsum("nhc,nchd->nhd", torch.softmax(s, -1), v)
    torch.testing.assert_close(batched.double(), ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(kv.attend_one(q, sl, (last - 1).clamp(min=0), 0.25)[last > 0], batched[last > 0])
