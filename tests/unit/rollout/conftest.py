"""Fixtures for the rollout tests (helpers live in rollout_testutil.py)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rollout_testutil import FAMILIES, make_hf_model  # noqa: E402


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """family -> (model dir, HF model)."""
    out = {}
    for i, fam in enumerate(FAMILIES):
        d = str(tmp_path_factory.mktemp(f"tiny_{fam}"))
        vocab = {"llama": 300, "qwen2": 300, "qwen3": 257}[fam]
        out[fam] = (d, make_hf_model(fam, d, vocab_size=vocab, seed=10 + i))
    return out
