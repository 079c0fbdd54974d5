"""Logit processing (temperature, top-k, top-p) and its documented tie rules (the sampler's)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_tlt.spec.sampling_ref import process_logits, sample


def logits_of(*probs: float) -> torch.Tensor:
    return torch.tensor([math.log(p) if p > 0 else float("-inf") for p in probs])


def test_temperature_only_is_a_tempered_softmax():
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0))
    for t in (0.3, 1.0, 2.5):
        got = process_logits(logits, temperature=t)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, torch.softmax(logits / t, -1))


def test_top_k_keeps_exactly_k_lowest_ids_on_ties():
    logits = torch.tensor([3.0, 2.0, 2.0, 1.0, 0.5])
    kept = process_logits(logits, top_k=2) > 0
    assert kept.tolist() == [True, True, False, False, False]  # the tie at rank 2: lowest id
    kept = process_logits(logits, top_k=4) > 0
    assert kept.tolist() == [True, True, True, True, False]
    tie_first = torch.tensor([2.0, 3.0, 2.0, 1.0, 0.5])
    assert (process_logits(tie_first, top_k=2) > 0).tolist() == [True, True, False, False, False]
    for disabled in (0, 5, 100):
        assert bool((process_logits(logits, top_k=disabled) > 0).all())


def test_top_p_keeps_the_shortest_prefix_lowest_ids_on_ties():
    logits = logits_of(0.5, 0.2, 0.2, 0.1)
    assert (process_logits(logits, top_p=0.45) > 0).tolist() == [True, False, False, False]
    assert (process_logits(logits, top_p=0.55) > 0).tolist() == [True, True, False, False]
    assert (process_logits(logits, top_p=0.95) > 0).tolist() == [True, True, True, True]
    # the mass before token 1 equals top_p exactly: the prefix already reaches it, token 1 is
    # dropped (a `<=` kept it and every other test passed)
    exact = logits_of(0.5, 0.25, 0.25)
    assert (process_logits(exact, top_p=0.5) > 0).tolist() == [True, False, False]
    torch.testing.assert_close(process_logits(logits, top_p=0.55), torch.tensor([5 / 7, 2 / 7, 0.0, 0.0]))


def _engine_distribution(logits, temperature, top_k, top_p):
    """The distribution rollout.sampling.sample draws from, read off the sampler itself:
    per (row, token v) a race whose noise favours v alone (E_v = 1e-30, others 1e30) picks
    v exactly when v may be sampled, and reports log p(v) as processed_logprobs."""
    from megatron_tlt.rollout.sampling import sample
    b, v = logits.shape
    rows = logits.repeat_interleave(v, 0)
    noise = torch.full((b * v, v), 1e30)
    noise[torch.arange(b * v), torch.arange(v).repeat(b)] = 1e-30
    out = sample(rows, temperature.repeat_interleave(v), top_k.repeat_interleave(v),
                 top_p.repeat_interleave(v), noise)
    hit = (out.token_ids == torch.arange(v).repeat(b)).view(b, v)
    return torch.where(hit, out.processed_logprobs.view(b, v).exp(), 0.0)


def _tie_keeping_support(logits, top_k, top_p):
    """The rule before session 41 (every token tied with the boundary kept, by value)."""
    kth = logits.sort(-1, descending=True).values.gather(-1, (top_k - 1).clamp(min=0)[:, None])
    x = torch.where((top_k[:, None] > 0) & (logits < kth), float("-inf"), logits)
    probs = torch.softmax(x, -1)
    sp = probs.sort(-1, descending=True).values
    pos = (sp.double().cumsum(-1) < top_p[:, None].double()).sum(-1, keepdim=True).clamp(max=logits.shape[1] - 1)
    return (probs > 0) & ((probs >= sp.gather(-1, pos)) | (top_p[:, None] >= 1))


def test_target_distribution_is_the_samplers_on_boundary_ties():
    """process_logits (speculative decoding's target and draft rule) equals the distribution
    the engine's sampler draws from, support exactly (torch.equal) and probabilities to
    float32 rounding, on logits with ties at the top-k / top-p boundary: a 0.25 grid over
    48 tokens (bf16 logits of a 152k vocabulary tie there as often: bf16 keeps 8 bits).
    Control: the rule process_logits had before session 41 (ties kept by value,
    `_tie_keeping_support`, equal to it on these rows) keeps another support on 10 of them."""
    gen = torch.Generator().manual_seed(7)
    b, v = 64, 48
    logits = (torch.randn(b, v, generator=gen) * 8).round() / 4
    temperature = torch.full((b,), 0.8)
    top_k = torch.randint(1, 12, (b,), generator=gen)
    top_p = torch.rand(b, generator=gen) * 0.6 + 0.3
    top_p[::4] = 1.0  # top-k alone
    top_k[1::4] = 0  # top-p alone
    want = _engine_distribution(logits, temperature, top_k, top_p)
    got = process_logits(logits, temperature, top_k, top_p)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)
    old = _tie_keeping_support(logits / 0.8, top_k, top_p)
    differ = int((old != (want > 0)).any(-1).sum())
    assert differ >= 5, f"only {differ} rows with a boundary tie: the control has no power"


def test_order_is_temperature_then_top_k_then_top_p():
    logits = logits_of(0.4, 0.3, 0.2, 0.1)
    # top-k 3 -> (0.4, 0.3, 0.2)/0.9; top-p 0.7 on that keeps 0.444 + 0.333 >= 0.7.
    got = process_logits(logits, top_k=3, top_p=0.7)
    torch.testing.assert_close(got, torch.tensor([4 / 7, 3 / 7, 0.0, 0.0]))
    hot = process_logits(logits, temperature=0.5, top_k=2)
    torch.testing.assert_close(hot, torch.tensor([16 / 25, 9 / 25, 0.0, 0.0]))


def test_temperature_zero_is_greedy_with_lowest_id_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [float("nan"), 0.0, -1.0, 0.0]])
    got = process_logits(logits, temperature=0.0, top_k=1, top_p=0.5)
    assert got.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]


def test_per_row_parameters_match_scalar_processing():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 50, generator=gen)
    temperature = torch.tensor([[0.7, 1.0, 0.0], [1.3, 0.5, 1.0]])
    top_k = torch.tensor([[0, 5, 3], [10, 0, 1]])
    top_p = torch.tensor([[0.9, 1.0, 0.5], [0.3, 0.8, 1.0]])
    got = process_logits(logits, temperature, top_k, top_p)
    for i in range(2):
        for j in range(3):
            want = process_logits(logits[i, j], float(temperature[i, j]), int(top_k[i, j]), float(top_p[i, j]))
            torch.testing.assert_close(got[i, j], want)
    torch.testing.assert_close(got.sum(-1), torch.ones(2, 3))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, "temperature must be >= 0, got -0.1"),
        ({"top_k": -1}, "top_k must be >= 0, got -1"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": torch.tensor([0.5, 1.5])}, r"top_p must be in \(0, 1\], got 1.5"),
    ],
)
def test_bad_parameters_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        process_logits(torch.zeros(2, 4), **kwargs)


def test_sample_never_draws_outside_the_support():
    gen = torch.Generator().manual_seed(2)
    probs = process_logits(torch.randn(20000, 16, generator=gen), top_k=3)
    tokens = sample(probs, torch.empty(20000, 16).exponential_(generator=gen))
    assert bool((probs.gather(1, tokens.unsqueeze(1)) > 0).all())
