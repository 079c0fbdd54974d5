"""The learning-rate schedule SFT and the RL loop share (models/optim.py)."""

import math

import pytest

from megatron_tlt.config import load_config
from megatron_tlt.models.optim import lr_at, lr_for_step


def test_lr_schedule():
    kw = dict(total_steps=10, lr=1.0, min_lr=0.1, warmup_steps=2)
    cos = [lr_at(s, schedule="cosine", **kw) for s in range(10)]
    assert cos[0] == 0.5 and cos[1] == 1.0 and cos[2] == 1.0 and math.isclose(cos[-1], 0.1)
    assert all(a >= b for a, b in zip(cos[1:], cos[2:]))
    lin = [lr_at(s, schedule="linear", **kw) for s in range(10)]
    assert math.isclose(lin[-1], 0.1) and math.isclose(lin[5] - lin[6], lin[6] - lin[7])
    assert [lr_at(s, schedule="constant", **kw) for s in (0, 5, 9)] == [0.5, 1.0, 1.0]
    with pytest.raises(ValueError, match="schedule"):
        lr_at(5, schedule="step", **kw)


def test_lr_for_step_reads_the_optim_section_over_train_steps():
    cfg = load_config(None, ["optim.lr=1.0", "optim.min_lr=0.1", "optim.lr_warmup_steps=2", "train.steps=10"])
    assert cfg.optim.lr_schedule == "cosine"  # the default
    assert [lr_for_step(cfg, s) for s in (0, 1, 9)] == [0.5, 1.0, pytest.approx(0.1)]
    cfg = load_config(None, ["optim.lr=1.0", "optim.lr_schedule=constant", "train.steps=10"])
    assert {lr_for_step(cfg, s) for s in range(10)} == {1.0}
