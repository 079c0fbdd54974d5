"""Sampler (exponential race, top-k/top-p, greedy) and stop conditions."""

import pytest
import torch

from rollout_testutil import make_engine, prompts
from megatron_tlt.rollout import Request, SamplingParams
import math

from megatron_tlt.rollout.sampling import (NoiseStream, StopChecker, exponential_noise, make_noise_stream,
                                           noise_bits, request_seed, sample, uniform_noise)

# chi-square critical value, 4 degrees of freedom, alpha = 1e-4 (scipy.stats.chi2.ppf(0.9999, 4)).
CHI2_DF4_1E4 = 23.5127
N_DRAWS = 20000


def _draw(logits, *, temperature=1.0, top_k=0, top_p=1.0, n=N_DRAWS, seed=0, banned=None):
    v = logits.numel()
    g = torch.Generator().manual_seed(seed)
    noise = torch.empty(n, v).exponential_(generator=g)
    out = sample(logits.expand(n, v), torch.full((n,), temperature), torch.full((n,), top_k),
                 torch.full((n,), top_p), noise, banned)
    return out, noise


def _chi2(tokens, probs):
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token outside the support"
    expected = probs[support].double() * tokens.numel()
    return float(((counts[support] - expected) ** 2 / expected).sum())


def test_exponential_race_samples_the_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    probs = torch.softmax(logits, -1)
    out, noise = _draw(logits)
    stat = _chi2(out.token_ids, probs)
    assert stat < CHI2_DF4_1E4, (f"chi2={stat:.1f} >= {CHI2_DF4_1E4} (df=4): a correct sampler "
                                 f"fails this with probability 1e-4")
    freq = torch.bincount(out.token_ids, minlength=5).double() / N_DRAWS
    assert 0.5 * (freq - probs.double()).abs().sum() < 0.02
    # Negative control: a broken race (argmax p / E^2 samples ~ sqrt(p)) must fail.
    broken = torch.argmax(probs / noise ** 2, dim=-1)
    assert _chi2(broken, probs) > 10 * CHI2_DF4_1E4


def test_top_k_top_p_temperature_distribution():
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -2.0, 4.0, 1.5])
    t, k, p = 0.8, 5, 0.95
    # Independent construction: temperature -> keep top-5 -> renormalize -> nucleus 0.95.
    probs = torch.softmax(logits.double() / t, -1)
    order = torch.argsort(probs, descending=True)
    keep = torch.zeros(8, dtype=torch.bool)
    keep[order[:k]] = True
    pk = torch.where(keep, probs, 0.0)
    pk = pk / pk.sum()
    mass = 0.0
    nucleus = torch.zeros(8, dtype=torch.bool)
    for i in order[:k]:
        if mass >= p:
            break
        nucleus[i] = True
        mass += float(pk[i])
    target = torch.where(nucleus, pk, 0.0)
    target = target / target.sum()
    assert int(nucleus.sum()) == 4  # the filters bite: 3 tokens removed by top-k, 1 by top-p
    out, _ = _draw(logits, temperature=t, top_k=k, top_p=p, seed=1)
    stat = _chi2(out.token_ids, target.float())
    assert stat < 21.108, f"chi2={stat:.1f} (df=3, false failure probability 1e-4)"
    # logprobs: temperature-scaled, BEFORE filtering; processed: under the filtered target.
    tok = out.token_ids
    torch.testing.assert_close(out.logprobs, torch.log(probs.float())[tok])
    torch.testing.assert_close(out.processed_logprobs, torch.log(target.float())[tok])


def test_greedy_ties_lowest_id_and_ban():
    logits = torch.tensor([[0.0, 5.0, 1.0, 5.0], [0.0, 5.0, 1.0, 5.0], [0.0, 5.0, 1.0, 5.0]])
    banned = torch.tensor([[False] * 4, [False] * 4, [False, True, False, False]])
    out = sample(logits, torch.zeros(3), torch.tensor([0, 1, 0]), torch.ones(3), torch.ones(3, 4), banned)
    assert out.token_ids.tolist() == [1, 1, 3]
    assert out.processed_logprobs.tolist() == [0.0, 0.0, 0.0]
    # Banned tokens are never sampled; the reported logprob ignores the ban.
    logits = torch.tensor([3.0, 0.0, 0.0, 0.0, 0.0])
    ban = torch.tensor([True, False, False, False, False]).expand(2000, 5)
    out, _ = _draw(logits, n=2000, banned=ban)
    assert (out.token_ids != 0).all()
    torch.testing.assert_close(out.logprobs, torch.log_softmax(logits, -1)[out.token_ids])


def test_request_seed_is_stable_and_distinct():
    # Pinned: changing the derivation silently breaks replay of recorded rollouts.
    assert request_seed(0, "a", 0) == 3708771627899180524
    assert request_seed(0, "a", 1) == 1367337422905379996
    assert request_seed(1, 7, 0) == 8862447191235494845
    assert request_seed(1, 7, 0) == request_seed(1, "7", 0)  # JSON int vs str ids agree
    a = make_noise_stream(0, "a", 0).exponential(10)
    b = make_noise_stream(0, "a", 0).exponential(10)
    c = make_noise_stream(0, "a", 1).exponential(10)
    assert torch.equal(a, b) and not torch.equal(a, c)


def _splitmix_ref(key: int, draw: int, index: int) -> int:
    """Plain-Python SplitMix64 (explicit modulo 2^64) of the stream position."""
    m = (1 << 64) - 1
    gold = 0x9E3779B97F4A7C15

    def mix(z):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)
    row = mix((key + (draw + 1) * gold) & m)
    return mix((row + (index + 1) * gold) & m)


def test_noise_bits_equal_plain_python_splitmix64():
    """The int64 torch ops (wrapping multiply, emulated logical shifts) give exactly the
    unsigned 64-bit reference, including keys near 2^63 and large draw counts."""
    keys = [0, 1, request_seed(0, "a", 0), (1 << 63) - 1]
    draws = [0, 5, 123456789, 1 << 40]
    bits = noise_bits(torch.tensor(keys), torch.tensor(draws), 7, "cpu")
    for r, (k, d) in enumerate(zip(keys, draws)):
        ref = [_splitmix_ref(k, d, i) for i in range(7)]
        assert [int(x) & ((1 << 64) - 1) for x in bits[r]] == ref


def test_noise_stream_draws_are_pure_functions_of_key_and_count():
    s = NoiseStream(42)
    first, second = s.exponential(5), s.exponential(5)
    assert s.draws == 2 and not torch.equal(first, second)
    batched = exponential_noise(torch.tensor([42, 42, 7]), torch.tensor([1, 0, 0]), 5, "cpu")
    assert torch.equal(batched[0], second) and torch.equal(batched[1], first)
    assert not torch.equal(batched[2], first)
    u = uniform_noise(torch.tensor([3]), torch.tensor([0]), 1000, "cpu")
    assert float(u.min()) > 0 and float(u.max()) < 1


def test_exponential_noise_distribution():
    """2^20 draws (64 streams x 16,384): KS distance to Exp(1) below 1.63 / sqrt(n)
    (the 1% critical value), mean within 5 standard errors of 1, and adjacent indices and
    adjacent draws uncorrelated (|r| < 5 / sqrt(n)). Negative control: the same draws with
    a broken mixer (no finaliser: consecutive indices differ by a constant) fail the
    correlation check."""
    n_streams, n = 64, 16384
    e = exponential_noise(torch.arange(n_streams) * 1000003, torch.zeros(n_streams, dtype=torch.int64),
                          n, "cpu").double()
    x = e.reshape(-1)
    total = x.numel()
    xs, _ = torch.sort(x)
    cdf = 1 - torch.exp(-xs)
    grid = torch.arange(1, total + 1, dtype=torch.float64) / total
    ks = float(torch.maximum((grid - cdf).abs(), (grid - 1 / total - cdf).abs()).max())
    assert ks < 1.63 / math.sqrt(total), ks
    assert abs(float(x.mean()) - 1) < 5 / math.sqrt(total)

    def corr(a, b):
        a, b = a - a.mean(), b - b.mean()
        return float((a * b).sum() / torch.sqrt((a * a).sum() * (b * b).sum()))
    assert abs(corr(e[:, :-1].reshape(-1), e[:, 1:].reshape(-1))) < 5 / math.sqrt(total)
    nxt = exponential_noise(torch.arange(n_streams) * 1000003, torch.ones(n_streams, dtype=torch.int64),
                            n, "cpu").double()
    assert abs(corr(e.reshape(-1), nxt.reshape(-1))) < 5 / math.sqrt(total)
    # negative control: raw (unmixed) Weyl sequence -> strongly correlated neighbours
    gold = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
    raw = (torch.arange(1, n + 1, dtype=torch.int64) * gold)
    bad = -torch.log(((raw >> 11) & ((1 << 53) - 1)).double().add(0.5) * 2.0 ** -53)
    assert abs(corr(bad[:-1], bad[1:])) > 5 / math.sqrt(n)


@pytest.fixture(scope="module")
def greedy_base(hf_models):
    model_dir, hf = hf_models["llama"]
    (p,) = prompts(hf.config.vocab_size, [5], seed=31)
    (r,) = make_engine(model_dir).generate(
        [Request(prompt_id=0, prompt_token_ids=p,
                 sampling_params=SamplingParams(temperature=0, max_new_tokens=12))])
    base = r.token_ids
    assert base[3] not in base[:3] and base[5] not in base[:5]
    return model_dir, p, base


def _run(model_dir, p, *, eos=(), detok=None, **params):
    eng = make_engine(model_dir, eos_token_ids=eos, detokenize=detok)
    (r,) = eng.generate([Request(prompt_id=0, prompt_token_ids=p, sampling_params=SamplingParams(
        temperature=0, max_new_tokens=12, **params))])
    assert r.error is None, r.error
    return r


def test_stop_tokens(greedy_base):
    model_dir, p, base = greedy_base
    r = _run(model_dir, p, eos=[base[3]])
    assert (r.token_ids, r.finish_reason, r.stop_reason) == (base[:4], "stop", base[3])
    r = _run(model_dir, p, stop_token_ids=(base[5],))
    assert (r.token_ids, r.finish_reason, r.stop_reason) == (base[:6], "stop", base[5])
    assert len(r.logprobs) == 6
    r = _run(model_dir, p)
    assert (r.token_ids, r.finish_reason, r.stop_reason) == (base, "length", None)


def test_min_new_tokens_bans_stop_tokens(greedy_base):
    model_dir, p, base = greedy_base
    eos = base[3]
    r = _run(model_dir, p, eos=[eos], min_new_tokens=8)
    assert r.token_ids[:3] == base[:3]
    assert eos not in r.token_ids[:8]
    assert len(r.token_ids) >= 8


def test_stop_strings(greedy_base):
    model_dir, p, base = greedy_base

    def detok(ids):
        return "".join(f"<{i}>" for i in ids)

    spanning = f"{base[4]}><{base[5]}"  # ends inside token 5's text
    r = _run(model_dir, p, detok=detok, stop_strings=(spanning, "never"))
    assert (r.token_ids, r.finish_reason, r.stop_reason) == (base[:6], "stop", spanning)
    r = _run(model_dir, p, detok=detok, stop_strings=(spanning,), min_new_tokens=7)
    assert r.finish_reason == "length"


def _byte_detok(ids):
    """Byte-level detokenizer: ids < 256 are bytes, 300 a special token that decodes to ""."""
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def _first_stop(checker, ids, prompt_len):
    """(index of the output token that first finished the request, stop_reason)."""
    for i in range(prompt_len + 1, len(ids) + 1):
        reason, stop = checker.check(ids[:i], prompt_len, False)
        if reason is not None:
            return i - prompt_len - 1, reason, stop
    return None, None, None


@pytest.mark.parametrize("case", ["emoji_bytes", "empty_specials"])
def test_stop_string_spanning_many_tokens(case):
    """A stop string longer in tokens than max_stop_len + 8 is still found, at the token that
    completes it: byte-level tokens of 4-byte characters (3 characters, 12 tokens) and a
    string split by 20 special tokens that decode to nothing. The old fixed window of
    max_stop_len + 8 tokens missed both (both ran to 'length')."""
    prompt = list("p: ".encode())
    if case == "emoji_bytes":
        stop = "\U0001F600" * 3
        out = list(b"aaaaaaaa") + list(stop.encode()) + list(b"aaaaaaa")
        want = 8 + 12 - 1
    else:
        stop = "abc"
        out = list(b"xxa") + [300] * 20 + list(b"bcxx")
        want = 2 + 20 + 2
    params = SamplingParams(max_new_tokens=len(out), stop_strings=(stop, "zq"))
    checker = StopChecker(params, [], _byte_detok)
    assert _first_stop(checker, prompt + out, len(prompt)) == (want, "stop", stop)
    # negative controls: the same output without the stop string's last byte, and the stop
    # string in the prompt only, never stop early
    cut = out[:want] + list(b"zz")
    assert _first_stop(checker, prompt + cut, len(prompt)) == (None, None, None)
    params_p = SamplingParams(max_new_tokens=8, stop_strings=("p:",))
    assert _first_stop(StopChecker(params_p, [], _byte_detok), prompt + list(b"qqqq"), len(prompt)) == (
        None, None, None)


def test_stop_string_seen_during_min_new_tokens_never_fires_later():
    """A stop string completed (and ignored) within min_new_tokens is not reported by a
    later token whose own text does not hold it: here the token completing a 2-byte
    character, whose previous tail decoded to a replacement character (the old check then
    searched the whole tail and stopped at token 6 on "ab" from tokens 1-2). Control: the
    same stop string completed after min_new_tokens stops at the token completing it."""
    prompt = list(b"Q: ")
    out = list(b"abxy") + list("\u00e9".encode()) + list(b"zz")
    params = SamplingParams(max_new_tokens=20, min_new_tokens=4, stop_strings=("ab",))
    checker = StopChecker(params, [], _byte_detok)
    assert _first_stop(checker, prompt + out, len(prompt)) == (None, None, None)
    later = list(b"xyzw") + list("\u00e9".encode()) + list(b"ab")
    assert _first_stop(checker, prompt + later, len(prompt)) == (7, "stop", "ab")
    # completed by the min_new_tokens-th token itself: it stops there (a `>` for `>=` ran on
    # to max_new_tokens and every other test passed)
    at_limit = StopChecker(params, [], _byte_detok)
    assert _first_stop(at_limit, prompt + list(b"xyab") + list(b"zzzz"), len(prompt)) == (3, "stop", "ab")


def test_top_p_below_float32_keeps_the_most_likely_token():
    """A top_p the check accepts but float32 rounds to 0 (1e-50) keeps the most likely token,
    as the docstring promises, in the sampler and in speculative decoding's target
    distribution (one shared rule): before, every token was dropped, the sampler returned
    token 0 and a NaN processed logprob."""
    from megatron_tlt.spec.sampling_ref import process_logits

    SamplingParams(top_p=1e-50).check(4)
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0]] * 2)
    noise = exponential_noise(torch.tensor([7, 7]), torch.tensor([0, 0]), 4, "cpu")
    out = sample(logits, torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.tensor([1e-50, 1e-50]), noise)
    assert out.token_ids.tolist() == [2, 2]
    assert torch.isfinite(out.processed_logprobs).all() and float(out.processed_logprobs[0]) == 0.0
    q = process_logits(logits[:1], 1.0, 0, 1e-50)
    assert torch.equal(q, torch.tensor([[0.0, 0.0, 1.0, 0.0]]))


def test_top_k_beyond_int64_is_refused_by_the_check():
    """A top_k torch cannot hold is the request's own error at the check, not a crash of
    the whole batch in the sampler."""
    from megatron_tlt.errors import TLTError

    SamplingParams(top_k=2 ** 63 - 1).check(10)
    with pytest.raises(TLTError, match="top_k must be an integer"):
        SamplingParams(top_k=2 ** 63).check(10)


def _sample_two_passes(logits, temperature, noise, banned=None):
    """`sample` without filters as it was before the shared pass: log_softmax taken twice."""
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits.float() / t[:, None]
    lp_all = torch.log_softmax(scaled, dim=-1)
    proc = scaled if banned is None else scaled.masked_fill(banned, float("-inf"))
    proc_lp = torch.log_softmax(proc, dim=-1)
    tok = torch.where(greedy, proc.argmax(-1), (proc_lp.exp() / noise).argmax(-1))
    lp = lp_all.gather(1, tok[:, None])[:, 0]
    plp = torch.where(greedy, torch.zeros_like(lp), proc_lp.gather(1, tok[:, None])[:, 0])
    return tok, lp, plp


@pytest.mark.parametrize("filters", [False, True], ids=["graph_path", "tensor_filters_off"])
def test_sample_without_ban_shares_the_log_softmax_pass(filters):
    """Without a ban or an active filter the processed logprobs reuse logprobs' pass: the
    same tokens, logprobs and processed logprobs, bit for bit, as two passes. With a ban
    the second pass stays (equal to two passes there too), and its processed logprobs of
    sampled rows differ from the logprobs (a reuse under a ban would make them equal)."""
    g = torch.Generator().manual_seed(3)
    b, v = 9, 501
    logits = torch.randn(b, v, generator=g) * 3
    temp = torch.tensor([0.0, 0.9, 1.0, 1.3, 0.5, 0.0, 2.0, 0.7, 1.0])
    noise = torch.empty(b, v).exponential_(generator=g)
    k = torch.zeros(b, dtype=torch.int64) if filters else None
    p = torch.ones(b) if filters else None
    out = sample(logits, temp, k, p, noise)
    want = _sample_two_passes(logits, temp, noise)
    assert torch.equal(out.token_ids, want[0])
    assert torch.equal(out.logprobs, want[1]) and torch.equal(out.processed_logprobs, want[2])
    banned = torch.zeros(b, v, dtype=torch.bool)
    banned[:, :50] = True
    out_b = sample(logits, temp, k, p, noise, banned)
    want_b = _sample_two_passes(logits, temp, noise, banned)
    assert torch.equal(out_b.token_ids, want_b[0]) and torch.equal(out_b.processed_logprobs, want_b[2])
    sampled = temp > 0
    assert not torch.equal(out_b.processed_logprobs[sampled], out_b.logprobs[sampled])
