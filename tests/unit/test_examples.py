"""Every shipped example config parses and validates (the paths in them are not checked)."""

from pathlib import Path

import pytest

from megatron_tlt.config import load_config

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_is_valid(path):
    cfg = load_config(str(path))
    assert cfg.train.global_batch_size % cfg.rollout.n_samples == 0 or "sft" in path.name


def test_examples_exist():
    assert len(EXAMPLES) >= 3
