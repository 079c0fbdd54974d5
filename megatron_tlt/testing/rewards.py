"""Rewards for tests and examples with random tiny models, where exact answers never occur:
they still give groups a spread of rewards, so the policy gradient is not zero."""

import os

RAISE_ON_ANSWER_ENV = "TLT_TEST_REWARD_RAISE_ON_ANSWER"
RAISE_ON_RANK_ENV = "TLT_TEST_REWARD_RAISE_ON_RANK"


def contains_seven(response: str, answer: str) -> float:
    """1.0 when the response contains the character '7' (about a third of random 16-token
    responses over the tiny tokenizer do), else 0.0."""
    return 1.0 if "7" in response else 0.0


def digit_fraction(response: str, answer: str) -> float:
    """Fraction of the response's characters that are digits (a dense reward)."""
    return sum(c.isdigit() for c in response) / len(response) if response else 0.0


def distinct_fraction(response: str, answer: str) -> float:
    """Fraction of the response's characters that are distinct (dense; > 0 for any
    non-empty response, so also for the repetitive greedy output of a random model)."""
    return len(set(response)) / len(response) if response else 0.0


def digit_fraction_or_raise(response: str, answer: str) -> float:
    """`digit_fraction`, but raises ValueError on the prompt whose answer is the value of
    the environment variable TLT_TEST_REWARD_RAISE_ON_ANSWER (a verifier that crashes)."""
    if answer == os.environ.get(RAISE_ON_ANSWER_ENV):
        raise ValueError(f"test reward refuses answer {answer!r}")
    return digit_fraction(response, answer)


def digit_fraction_or_raise_on_rank(response: str, answer: str) -> float:
    """`digit_fraction`, but raises ValueError in the process whose torchrun RANK is the
    value of TLT_TEST_REWARD_RAISE_ON_RANK (a verifier that crashes on one rank only)."""
    rank = os.environ.get("RANK")
    if rank is not None and rank == os.environ.get(RAISE_ON_RANK_ENV):
        raise ValueError(f"test reward refuses to score on rank {rank}")
    return digit_fraction(response, answer)


def many_distinct_chars(response: str, answer: str) -> float:
    """1.0 when the response has at least 8 distinct characters, else 0.0: a binary reward
    that follows the sampler's entropy (sharper sampling repeats characters)."""
    return 1.0 if len(set(response)) >= 8 else 0.0
