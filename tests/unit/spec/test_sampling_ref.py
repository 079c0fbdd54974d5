"""Logit processing (temperature, top-k, top-p) and its documented tie rules."""

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


def test_top_k_keeps_k_and_every_tie_at_the_boundary():
    logits = torch.tensor([3.0, 2.0, 2.0, 1.0, 0.5])
    kept = process_logits(logits, top_k=2) > 0
    assert kept.tolist() == [True, True, True, False, False]  # the tie at rank 2 is kept
    kept = process_logits(logits, top_k=4) > 0
    assert kept.tolist() == [True, True, True, True, False]
    for disabled in (0, 5, 100):
        assert bool((process_logits(logits, top_k=disabled) > 0).all())


def test_top_p_keeps_the_shortest_prefix_and_its_ties():
    logits = logits_of(0.5, 0.2, 0.2, 0.1)
    assert (process_logits(logits, top_p=0.45) > 0).tolist() == [True, False, False, False]
    assert (process_logits(logits, top_p=0.55) > 0).tolist() == [True, True, True, False]  # tie kept
    assert (process_logits(logits, top_p=0.95) > 0).tolist() == [True, True, True, True]
    torch.testing.assert_close(process_logits(logits, top_p=0.55), torch.tensor([5 / 9, 2 / 9, 2 / 9, 0.0]))


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
