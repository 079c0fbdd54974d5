"""Rewards for tests and examples with random tiny models, where exact answers never occur:
they still give groups a spread of rewards, so the policy gradient is not zero."""


def contains_seven(response: str, answer: str) -> float:
    """1.0 when the response contains the character '7' (about a third of random 16-token
    responses over the tiny tokenizer do), else 0.0."""
    return 1.0 if "7" in response else 0.0


def digit_fraction(response: str, answer: str) -> float:
    """Fraction of the response's characters that are digits (a dense reward)."""
    return sum(c.isdigit() for c in response) / len(response) if response else 0.0
