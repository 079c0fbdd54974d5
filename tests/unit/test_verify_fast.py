"""The verification fast path of SpecDecoder (spec/decode.py `VerifyMath`: static buffers at
a padded batch; on CPU the math runs eagerly, CUDA graphs are tested in tests/gpu) gives
exactly the general path's outputs: accept_index, accept_length and tokens with
torch.equal, logprobs and processed logprobs bit for bit, for greedy, sampled (draft_probs)
and sampled one-hot steps, batch sizes that are not buckets, several steps on the same
buffers, and steps under a min_new_tokens ban (stop ids at -inf at the nodes below the
minimum). Steps it does not cover (top-k, top-p, mixed greedy/sampled) take the general
path. A wrong draw number is detected (negative control). Also: the
one-torch.tensor TreeBatch.pack equals the per-tree one it replaced, `_ban` equals its
previous form, and the coins drawn on the device equal the CPU ones by construction."""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "spec"))

from spec_testutil import (DRAFTERS, VOCAB, make_engine, one_thread, requests,  # noqa: E402,F401
                           spec_models, tokens)

from megatron_tlt.rollout.sampling import (NoiseStream, SamplingParams, StopChecker,  # noqa: E402
                                           noise_bits, uniform_noise)
from megatron_tlt.spec.decode import SpecDecoder  # noqa: E402
from megatron_tlt.spec.sampling_ref import process_logits  # noqa: E402
from megatron_tlt.spec.tree import (DraftTree, Strategy, TreeBatch, ancestor_mask,  # noqa: E402
                                    node_depths)
from megatron_tlt.spec.verify_math import VerifyMath, sampled_probs  # noqa: E402

# ---- synthetic steps -------------------------------------------------------------------


def fake_seq(params: SamplingParams, key: int, draws: int, n_out: int):
    """What the verification reads of a scheduler Sequence."""
    rng = NoiseStream(key)
    rng.draws = draws
    return types.SimpleNamespace(
        request=types.SimpleNamespace(sampling_params=params, return_hidden_states=None),
        rng=rng, stop=StopChecker(params, (1, 2), None), token_ids=[5] * (3 + n_out), prompt_len=3)


def make_step(batch: int, vocab: int, mode: str, *, seed: int, depth: int = 4, tree: bool = False,
              temperature: float = 0.9, n_out: int = 4, **params):
    """(seqs, trees, logits [batch * Q, vocab]): random trees of 1..depth draft levels whose
    drafts often agree with the target. mode: greedy / sampled (drafts drawn from their
    draft_probs) / one_hot (temperature > 0, deterministic drafts)."""
    g = torch.Generator().manual_seed(seed)
    sizes = []
    for _ in range(batch):
        n = 1 + int(torch.randint(1, depth + 1, (), generator=g))
        if tree:
            n += int(torch.randint(0, 3, (), generator=g))
        sizes.append(n)
    q = max(sizes)
    logits = torch.randn(batch, q, vocab, generator=g) * 3.0
    t = temperature if mode != "greedy" else 0.0
    seqs, trees = [], []
    for b, n in enumerate(sizes):
        parents = [-1] + [int(torch.randint(0, i, (), generator=g)) if tree else i - 1 for i in range(1, n)]
        toks = [int(torch.randint(vocab, (), generator=g))]
        probs = torch.zeros(n, vocab) if mode == "sampled" else None
        for i in range(1, n):
            guess = logits[b, parents[i]] + 1.0 * torch.randn(vocab, generator=g)
            if mode == "sampled":
                probs[i] = process_logits(guess, t)
                toks.append(int(torch.multinomial(probs[i], 1, generator=g)))
            else:
                toks.append(int(guess.argmax()))
        trees.append(DraftTree(toks, parents, probs))
        seqs.append(fake_seq(SamplingParams(temperature=t, **params), key=1000 + 7 * b + seed,
                             draws=3 * b, n_out=n_out))
    return seqs, trees, logits.view(batch * q, vocab)


def copy_seqs(seqs, draw_offset: int = 0):
    return [fake_seq(s.request.sampling_params, s.rng.key, s.rng.draws + draw_offset,
                     len(s.token_ids) - s.prompt_len) for s in seqs]


def parse(rows: list[list[float]], width: int) -> dict[str, torch.Tensor]:
    t = torch.tensor(rows, dtype=torch.float64)
    return {"accept_index": t[:, :width].long(), "accept_length": t[:, width].long(),
            "tokens": t[:, width + 1:2 * width + 1].long(), "logprobs": t[:, 2 * width + 1:3 * width + 1],
            "processed_logprobs": t[:, 3 * width + 1:4 * width + 1]}


def general_path(seqs, trees, logits, vocab, impl=None) -> dict[str, torch.Tensor]:
    dec = SpecDecoder(DRAFTERS["ngram"](None), verify_impl=impl)
    batch = TreeBatch.pack(trees, [len(s.token_ids) - 1 for s in seqs], vocab)
    b, q = batch.parents.shape
    return parse(dec._verify_general(seqs, batch, logits.view(b, q, vocab)), batch.max_depth + 1)


def fast_path(math: VerifyMath, seqs, trees, logits, vocab):
    plan = VerifyMath.plan(seqs, trees, vocab)
    assert plan is not None
    probs_out = math.draft_probs_buffer(plan) if plan.mode == "sampled" else None
    TreeBatch.pack(trees, [len(s.token_ids) - 1 for s in seqs], vocab, probs_out=probs_out)
    rows, gidx = math.run(plan, seqs, trees, logits)
    return plan, parse(rows, plan.q), gidx


def mismatches(want: dict, got: dict) -> list[str]:
    """Fields where the fast outputs (Q columns) differ from the general ones (W <= Q
    columns, the rest -1 for the integer outputs)."""
    bad = []
    w = want["accept_index"].shape[1]
    for k, v in want.items():
        g = got[k]
        if v.dim() == 2:
            if k in ("accept_index", "tokens") and not bool((g[:, w:] == -1).all()):
                bad.append(k + " (extra columns)")
            g = g[:, :w]
        if not torch.equal(v, g):
            bad.append(k)
    return bad


# ---- the fast path equals the general path ---------------------------------------------


@pytest.mark.parametrize("mode", ["greedy", "sampled", "one_hot"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_fast_path_equals_general_path(mode, tree):
    vocab = 97
    math = VerifyMath("cpu", vocab, use_graphs=False)
    used = set()
    # Several steps on one VerifyMath: the buffers are reused (padding rows hold an earlier
    # step's rows), grown (6 -> 8 rows of 5+ nodes), and batches are mostly not buckets.
    for step, batch in enumerate([3, 1, 6, 5, 8, 3, 2, 7]):
        seqs, trees, logits = make_step(batch, vocab, mode, seed=step, tree=tree)
        mine = copy_seqs(seqs)
        want = general_path(seqs, trees, logits, vocab)
        plan, got, gidx = fast_path(math, mine, trees, logits, vocab)
        used.add(plan.bucket)
        assert plan.mode == mode and plan.bucket >= batch
        assert mismatches(want, got) == [], (step, batch)
        assert [s.rng.draws for s in mine] == [s.rng.draws for s in seqs]  # same draws taken
        q = plan.q
        for b in range(batch):  # the hidden-state rows of the accepted path
            acc = int(got["accept_length"][b])
            assert gidx[b, :acc + 1].tolist() == [b * q + j for j in got["accept_index"][b, :acc + 1].tolist()]
        if mode != "greedy":
            assert (want["processed_logprobs"] < 0).any()  # not all zeros: the check has teeth
    assert math.num_steps == 8 and used == {1, 2, 4, 8}
    assert math.num_captures == 0  # CPU: no graphs


@pytest.mark.parametrize("mode", ["greedy", "sampled", "one_hot"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_fast_path_with_a_ban_equals_general_path(mode, tree):
    """min_new_tokens = 6 with 4 tokens out: stop ids 1 and 2 banned at depths 0 and 1,
    allowed deeper. Their logits are raised so that without the ban they would win often
    (negative control: the general path's outputs change when the ban is lifted)."""
    vocab = 97
    math = VerifyMath("cpu", vocab, use_graphs=False)
    differ = 0
    for step, batch in enumerate([3, 6, 1, 5]):
        seqs, trees, logits = make_step(batch, vocab, mode, seed=40 + step, tree=tree,
                                        min_new_tokens=6, max_new_tokens=20)
        logits[:, 1] += 6.0
        logits[:, 2] += 5.0
        mine = copy_seqs(seqs)
        want = general_path(seqs, trees, logits, vocab)
        plan, got, _ = fast_path(math, mine, trees, logits, vocab)
        assert plan.ban == 2
        assert mismatches(want, got) == [], (step, batch)
        assert [s.rng.draws for s in mine] == [s.rng.draws for s in seqs]
        free = [fake_seq(SamplingParams(temperature=s.request.sampling_params.temperature),
                         1000 + 7 * b + 40 + step, 3 * b, 4) for b, s in enumerate(seqs)]
        differ += mismatches(want, general_path(free, trees, logits, vocab)) != []
    assert differ > 0  # the ban changes outputs: the comparison above has teeth


def test_fast_path_with_the_reference_op():
    """impl="reference" (the PyTorch spec of the kernels) on both paths."""
    vocab = 61
    math = VerifyMath("cpu", vocab, use_graphs=False, impl="reference")
    for step, mode in enumerate(["sampled", "one_hot", "greedy"]):
        seqs, trees, logits = make_step(5, vocab, mode, seed=10 + step, tree=True)
        mine = copy_seqs(seqs)
        want = general_path(seqs, trees, logits, vocab, impl="reference")
        _, got, _ = fast_path(math, mine, trees, logits, vocab)
        assert mismatches(want, got) == [], mode


def test_fast_path_reads_logits_in_place_or_copies():
    """Logits whose storage holds bucket x Q rows are read in place; others are copied into
    the static buffer. Same outputs either way."""
    vocab = 50
    seqs, trees, logits = make_step(3, vocab, "sampled", seed=3)
    q = logits.shape[0] // 3
    big = torch.randn(4 * q, vocab)  # a larger buffer whose first 3 * Q rows are the logits
    big[:3 * q] = logits
    math = VerifyMath("cpu", vocab, use_graphs=False)
    plan = VerifyMath.plan(seqs, trees, vocab)
    src, ptr = math._source(plan, big[:3 * q])
    assert ptr == big.data_ptr() and src.data_ptr() == big.data_ptr()
    src, ptr = math._source(plan, logits.clone())
    assert ptr is None and src.data_ptr() != logits.data_ptr()
    want = general_path(copy_seqs(seqs), trees, logits, vocab)
    for lg in (big[:3 * q], logits):
        _, got, _ = fast_path(VerifyMath("cpu", vocab, use_graphs=False), copy_seqs(seqs), trees, lg, vocab)
        assert mismatches(want, got) == []


def test_in_place_graph_address_policy():
    """With graphs, one in-place graph per (mode, bucket, Q): the first address wins; an
    address seen on two steps in a row takes over (dropping the old graph); alternating
    addresses are copied and never cause a recapture. (The policy only: the graphs
    themselves are tested on CUDA.)"""
    vocab = 10
    seqs, trees, _ = make_step(2, vocab, "greedy", seed=0, depth=1)
    math = VerifyMath("cpu", vocab, use_graphs=False)
    math.use_graphs = True  # exercise the policy without capturing
    plan = VerifyMath.plan(seqs, trees, vocab)
    a, b, c = (torch.zeros(plan.bucket * plan.q, vocab) for _ in range(3))
    key = (plan.mode, plan.bucket, plan.q)
    assert math._source(plan, a)[1] == a.data_ptr()
    math._graphs[key + (a.data_ptr(), 0)] = "graph of a"
    math._graphs[key + (a.data_ptr(), 2)] = "graph of a, with a ban table of width 2"
    for x in (b, a, c, a, b, a):  # alternating: a stays, the others are copied
        assert math._source(plan, x)[1] == (a.data_ptr() if x is a else None)
    assert len(math._graphs) == 2
    assert math._source(plan, b)[1] is None and math._source(plan, b)[1] == b.data_ptr()
    assert not math._graphs  # both dropped: a moved to b
    assert math._source(plan, a)[1] is None


def test_negative_control_wrong_draw_number_is_detected():
    """The comparison has power: the fast path fed draw numbers one off (the coins from the
    exp-noise's draw) no longer matches."""
    vocab = 97
    math = VerifyMath("cpu", vocab, use_graphs=False)
    bad = 0
    for step in range(3):
        seqs, trees, logits = make_step(8, vocab, "sampled", seed=20 + step)
        mine = copy_seqs(seqs, draw_offset=1)
        want = general_path(seqs, trees, logits, vocab)
        _, got, _ = fast_path(math, mine, trees, logits, vocab)
        bad += int((want["tokens"] != got["tokens"][:, :want["tokens"].shape[1]]).any(1).sum())
        assert "tokens" in mismatches(want, got)
    assert bad >= 6, bad


# ---- which steps take the fast path ----------------------------------------------------


def test_plan_covers_only_the_common_case():
    vocab = 97
    base = dict(vocab=vocab, seed=0)
    for mode in ("greedy", "sampled", "one_hot"):
        seqs, trees, _ = make_step(5, mode=mode, **base)
        plan = VerifyMath.plan(seqs, trees, vocab)
        assert plan is not None and (plan.mode, plan.batch, plan.bucket) == (mode, 5, 8)
    for kw in (dict(top_k=40), dict(top_p=0.9)):
        seqs, trees, _ = make_step(5, mode="sampled", **base, **kw)
        assert VerifyMath.plan(seqs, trees, vocab) is None, kw
    # a min_new_tokens ban: fast, with a ban table of the two stop ids
    seqs, trees, _ = make_step(5, mode="sampled", **base, min_new_tokens=6, max_new_tokens=20)
    assert VerifyMath.plan(seqs, trees, vocab).ban == 2
    os.environ["MEGATRON_TLT_VERIFY_FAST_BAN"] = "0"  # the switch back to the general path
    try:
        assert VerifyMath.plan(seqs, trees, vocab) is None
    finally:
        del os.environ["MEGATRON_TLT_VERIFY_FAST_BAN"]
    # top_k disabled by -1 or >= vocab is the common case
    for k in (-1, vocab):
        seqs, trees, _ = make_step(5, mode="sampled", **base, top_k=k)
        assert VerifyMath.plan(seqs, trees, vocab) is not None
    # min_new_tokens already reached: no ban
    seqs, trees, _ = make_step(5, mode="greedy", **base, min_new_tokens=3, max_new_tokens=20)
    assert VerifyMath.plan(seqs, trees, vocab).ban == 0
    # mixed greedy and sampled rows
    g, gt, _ = make_step(2, mode="greedy", **base)
    s, st, _ = make_step(2, mode="one_hot", **base)
    assert VerifyMath.plan(g + s, gt + st, vocab) is None
    # batches past the largest bucket, and bucket x Q past the row cap
    seqs, trees, _ = make_step(65, mode="greedy", **base, depth=1)
    assert VerifyMath.plan(seqs, trees, vocab) is None
    seqs, trees, _ = make_step(64, mode="greedy", **base, depth=8)
    assert VerifyMath.plan(seqs, trees, vocab) is None


# ---- end to end: generate with the fast path on and off --------------------------------


def _generate(model_dir, reqs, drafter, strategy, fast: bool):
    engine = make_engine(model_dir, eos_token_ids=(3,))
    dec = SpecDecoder(DRAFTERS[drafter](engine), strategy, fast_verify=fast)
    calls = {"general": 0}
    general = dec._verify_general

    def counted(*a, **kw):
        calls["general"] += 1
        return general(*a, **kw)

    dec._verify_general = counted
    engine.spec_decoder = dec
    res = engine.generate(reqs)
    fast_steps = dec._math.num_steps if dec._math is not None else 0
    return res, fast_steps, calls["general"], dec


CASES = {
    "eagle chain sampled": ("eagle", Strategy(depth=4), dict(temperature=0.9)),
    "eagle tree sampled": ("eagle", Strategy(depth=3, topk=2, num_verify_tokens=6), dict(temperature=0.7)),
    "ngram tree sampled": ("ngram", Strategy(depth=3, topk=2, num_verify_tokens=6), dict(temperature=0.7)),
    "eagle tree greedy": ("eagle", Strategy(depth=3, topk=2, num_verify_tokens=6), dict(temperature=0.0)),
    "target chain greedy": ("target", Strategy(depth=3), dict(temperature=0.0)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_generate_fast_equals_general(spec_models, case):
    drafter, strategy, params = CASES[case]
    d = spec_models["qwen2"]
    reqs = requests(VOCAB["qwen2"], [5, 11, 3, 8, 6], n=1, prompt_seed=4, max_new_tokens=20, seed=5, **params)
    ref, f0, g0, _ = _generate(d, reqs, drafter, strategy, fast=False)
    res, f1, g1, dec = _generate(d, reqs, drafter, strategy, fast=True)
    assert f0 == 0 and g0 > 0
    assert f1 > 0 and g1 == 0, (f1, g1)
    if drafter != "ngram":  # random weights: n-gram guesses are rarely accepted
        assert dec.metrics.summary()["total"]["accepted"] > 0
    assert tokens(res) == tokens(ref)
    for a, b in zip(res, ref):
        assert a.logprobs == b.logprobs and a.processed_logprobs == b.processed_logprobs
        assert a.finish_reason == b.finish_reason and a.spec_stats == b.spec_stats


@pytest.mark.parametrize("params", [dict(temperature=0.9, top_k=40), dict(temperature=0.9, top_p=0.9),
                                    dict(temperature=0.9, min_new_tokens=8, stop_token_ids=(7,)),
                                    dict(temperature=0.0, min_new_tokens=8, stop_token_ids=(7,))],
                         ids=["top_k", "top_p", "ban_sampled", "ban_greedy"])
def test_generate_fast_or_general_by_coverage(spec_models, params):
    """top-k / top-p steps take the general path; min_new_tokens bans (stop ids 3 and 7)
    the fast one; the tokens and logprobs equal those of the general path alone."""
    d = spec_models["qwen2"]
    reqs = requests(VOCAB["qwen2"], [5, 11, 3], prompt_seed=5, max_new_tokens=20, seed=6, **params)
    ref, _, _, _ = _generate(d, reqs, "eagle", Strategy(depth=3), fast=False)
    res, fast_steps, general_steps, _ = _generate(d, reqs, "eagle", Strategy(depth=3), fast=True)
    if "min_new_tokens" in params:
        assert fast_steps > 0 and general_steps == 0
    else:
        assert fast_steps == 0 and general_steps > 0
    assert tokens(res) == tokens(ref)
    for a, b in zip(res, ref):
        assert a.logprobs == b.logprobs and a.processed_logprobs == b.processed_logprobs


def test_generate_with_hidden_states_fast(spec_models):
    """return_hidden_states through the fast path's device gather index."""
    d = spec_models["qwen2"]
    reqs = requests(VOCAB["qwen2"], [5, 11, 3], prompt_seed=6, max_new_tokens=12, temperature=0.0)
    for r in reqs:
        r.return_hidden_states = "final"
    ref, _, _, _ = _generate(d, reqs, "eagle", Strategy(depth=3), fast=False)
    res, fast_steps, _, _ = _generate(d, reqs, "eagle", Strategy(depth=3), fast=True)
    assert fast_steps > 0 and tokens(res) == tokens(ref)
    for a, b in zip(res, ref):
        assert torch.equal(a.hidden_states, b.hidden_states)


def test_sleep_frees_the_verify_buffers(spec_models):
    """engine.sleep() drops the fast path's big buffers (the trainer gets the memory back);
    the next generate rebuilds them and emits the same tokens as before the sleep."""
    d = spec_models["qwen2"]
    reqs = requests(VOCAB["qwen2"], [5, 11, 3], prompt_seed=7, max_new_tokens=12, seed=8, temperature=0.9)
    ref, _, _, dec = _generate(d, reqs, "eagle", Strategy(depth=3), fast=True)
    engine = make_engine(d, eos_token_ids=(3,))
    engine.spec_decoder = dec
    dec.reset()
    first = engine.generate(reqs)
    assert dec._math._dp is not None and dec._math._rows > 0  # sampled: static draft probs
    engine.sleep()
    assert dec._math._dp is None and dec._math._logits is None and dec._math._rows == 0
    engine.wake()
    again = engine.generate(reqs)
    assert dec._math._dp is not None
    assert tokens(first) == tokens(again) == tokens(ref)


# ---- pieces ----------------------------------------------------------------------------


def test_sampled_probs_is_process_logits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 4, 300, generator=g) * 4
    logits[0, 1, :7] = float("-inf")
    temp = torch.tensor([0.9, 0.5, 1.0, 1.7, 0.9])
    want = process_logits(logits, temp[:, None].expand(5, 4))
    assert torch.equal(sampled_probs(logits, temp), want)
    assert torch.equal(sampled_probs(logits, torch.full((5,), 0.9)), process_logits(logits, 0.9))


def _splitmix_reference(key: int, draw: int, i: int) -> int:
    """noise_bits in Python integers (mod 2^64): what every device must compute."""
    m = (1 << 64) - 1

    def mix(z):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)

    row = mix((key + (draw + 1) * 0x9E3779B97F4A7C15) & m)
    return mix((row + (i + 1) * 0x9E3779B97F4A7C15) & m)


def test_coins_are_device_independent_by_construction():
    """The fast path draws coins on the device where the general path draws them on the
    CPU. noise_bits is exact integer arithmetic (checked against Python integers), and
    uniform_noise is float32(k + 1/2) * 2^-24 of the top 24 bits k: one correctly rounded
    addition (round-half-even for k >= 2^23), the same on every IEEE device. The GPU test
    compares the devices directly."""
    keys = torch.tensor([0, 1, 2**62 + 12345, 987654321987654321])
    draws = torch.tensor([0, 5, 17, 2**20])
    bits = noise_bits(keys, draws, 6, "cpu")
    for b in range(4):
        for i in range(6):
            want = _splitmix_reference(int(keys[b]), int(draws[b]), i)
            assert int(bits[b, i]) & ((1 << 64) - 1) == want
    many_keys = torch.arange(4096, dtype=torch.int64) * 7919
    k = ((noise_bits(many_keys, torch.zeros(4096, dtype=torch.int64), 64, "cpu") >> 40) & ((1 << 24) - 1))
    want = (k.double() + 0.5).float() * 2.0 ** -24  # exact value, one rounding to float32
    assert torch.equal(uniform_noise(many_keys, torch.zeros(4096, dtype=torch.int64), 64, "cpu"), want)
    assert bool((k >= 2**23).any())  # the rounded half is exercised


def _old_pack(trees, root_positions, vocab):
    """TreeBatch.pack before it built its tables with one torch.tensor call."""
    b = len(trees)
    n = max(len(t.tokens) for t in trees)
    parents = torch.full((b, n), -1, dtype=torch.int64)
    tokens_ = torch.full((b, n), -1, dtype=torch.int64)
    with_probs = [t.draft_probs for t in trees if t.draft_probs is not None]
    probs = torch.zeros(b, n, vocab, device=with_probs[0].device) if with_probs else None
    for i, t in enumerate(trees):
        k = len(t.tokens)
        parents[i, :k] = torch.tensor(t.parents, dtype=torch.int64)
        tokens_[i, :k] = torch.tensor(t.tokens, dtype=torch.int64)
        if probs is not None:
            if t.draft_probs is not None:
                probs[i, :k] = t.draft_probs.float()
            else:
                probs[i, torch.arange(1, k), tokens_[i, 1:k]] = 1.0
    depth = node_depths(parents)
    positions = torch.tensor(root_positions, dtype=torch.int64)[:, None] + depth
    return TreeBatch(parents=parents, draft_tokens=tokens_, query_tokens=tokens_.clamp(min=0),
                     positions=positions, tree_mask=ancestor_mask(parents), draft_probs=probs,
                     num_nodes=[len(t.tokens) for t in trees], max_depth=int(depth.max()))


def _random_tree(g, n, vocab, probs: bool) -> DraftTree:
    parents = [-1] + [int(torch.randint(0, i, (), generator=g)) for i in range(1, n)]
    toks = torch.randint(vocab, (n,), generator=g).tolist()
    return DraftTree(toks, parents, torch.rand(n, vocab, generator=g) if probs else None)


@pytest.mark.parametrize("sizes, with_probs", [
    ([5, 5, 5], [True] * 3),  # sampled chains of one length: one torch.stack
    ([5, 3, 5, 1 + 1], [True, True, False, True]),  # mixed lengths and one-hot rows
    ([4, 6], [False, False]),  # no draft_probs
    ([70, 12, 64], [True, False, False]),  # > 63 nodes (the old pack: ancestor_mask, not int64 bit masks)
])
def test_pack_equals_previous_pack(sizes, with_probs):
    g = torch.Generator().manual_seed(sum(sizes))
    vocab = 23
    trees = [_random_tree(g, n, vocab, p) for n, p in zip(sizes, with_probs)]
    roots = [10 * i + 3 for i in range(len(trees))]
    old, new = _old_pack(trees, roots, vocab), TreeBatch.pack(trees, roots, vocab)
    for f in ("parents", "draft_tokens", "query_tokens", "positions", "tree_mask", "draft_probs"):
        a, b = getattr(old, f), getattr(new, f)
        assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b)), f
    assert (old.num_nodes, old.max_depth) == (new.num_nodes, new.max_depth)
    if any(with_probs):  # into a larger static buffer
        buf = torch.full((len(trees) + 2, max(sizes), vocab), 9.0)
        packed = TreeBatch.pack(trees, roots, vocab, probs_out=buf)
        assert packed.draft_probs.data_ptr() == buf.data_ptr()
        assert torch.equal(buf[:len(trees)], old.draft_probs) and bool((buf[len(trees):] == 9.0).all())
        with pytest.raises(ValueError, match="probs_out"):
            TreeBatch.pack(trees, roots, vocab, probs_out=buf[:, :, :-1])


def _old_ban(seqs, logits, depth):
    out = None
    for b, s in enumerate(seqs):
        n_out = len(s.output_ids)
        for d in range(int(depth[b].max()) + 1):
            ban = s.stop.banned_ids(n_out + d)
            if ban:
                if out is None:
                    out = logits.clone()
                rows = (depth[b] == d).nonzero().squeeze(1)
                idx = torch.tensor(sorted(ban))
                out[b, rows[:, None], idx[None, :]] = float("-inf")
    return logits if out is None else out


def test_ban_equals_previous_ban():
    vocab = 20
    for n_outs in ([0, 1, 2, 3], [5, 6, 7, 8], [2, 9, 0, 4]):
        seqs, trees, logits = make_step(4, vocab, "greedy", seed=1, tree=True, min_new_tokens=4,
                                        max_new_tokens=30, stop_token_ids=(9,))
        for s, n in zip(seqs, n_outs):
            s.token_ids = [5] * (s.prompt_len + n)
            s.output_ids = s.token_ids[s.prompt_len:]
        batch = TreeBatch.pack(trees, [0] * 4, vocab)
        depth = batch.positions - batch.positions[:, :1]
        raw = logits.view(4, -1, vocab)
        assert torch.equal(SpecDecoder._ban(seqs, raw, depth), _old_ban(seqs, raw, depth)), n_outs


def test_spec_decoder_passes_the_fused_probs_choice():
    """SpecDecoder.fused_verify_probs reaches VerifyMath (bench spec's eagle-torchprobs sets
    it False); None leaves VerifyMath's default, off on CPU."""
    eng = types.SimpleNamespace(device=torch.device("cpu"), arch=types.SimpleNamespace(vocab_size=50))
    for choice, want in ((None, False), (False, False), (True, True)):
        dec = SpecDecoder(DRAFTERS["ngram"](None))
        dec.fused_verify_probs = choice
        assert dec.verify_math(eng).fused_probs is want, choice
