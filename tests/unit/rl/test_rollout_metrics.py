"""The rollout's time breakdown in the RL metrics: the long tail's share (t_rollout_tail)
and the time per running-batch bucket, plus acceptance length per bucket with SD."""

from __future__ import annotations

import json

import pytest

from megatron_tlt.rl.loop import rollout_time_metrics


def test_rollout_time_metrics_buckets_and_tail():
    log = [(64, 1.0), (40, 0.5), (20, 0.25), (16, 0.125), (3, 0.0625), (1, 0.03125), (1, 0.03125)]
    m = rollout_time_metrics(log, 64, {"1": {"acceptance_length": 2.5}, "2-4": {"acceptance_length": None},
                                       "17-32": {"acceptance_length": 1.75}})
    assert m["tail_batch"] == 16 and m["rollout_steps"] == 7 and m["rollout_steps_tail"] == 4
    assert m["t_rollout_tail"] == 0.125 + 0.0625 + 0.0625
    assert m["t_rollout_b33_up"] == 1.5 and m["t_rollout_b17_32"] == 0.25 and m["t_rollout_b9_16"] == 0.125
    assert m["t_rollout_b2_4"] == 0.0625 and m["t_rollout_b1"] == 0.0625
    assert "t_rollout_b5_8" not in m  # no step ran 5-8 sequences
    assert sum(v for k, v in m.items() if k.startswith("t_rollout_b")) == sum(t for _, t in log)
    assert m["accept_len_b1"] == 2.5 and m["accept_len_b17_32"] == 1.75
    assert "accept_len_b2_4" not in m  # undefined (no verification in that bucket)
    assert rollout_time_metrics([], 3) == {"tail_batch": 1, "rollout_steps": 0, "rollout_steps_tail": 0,
                                           "t_rollout_tail": 0}


@pytest.mark.parametrize("spec", ["off", "ngram"])
def test_rl_step_reports_the_breakdown(tmp_path, spec):
    from megatron_tlt.rl.loop import RLRun
    from megatron_tlt.testing.rl_runs import tiny_rl_config

    cfg = tiny_rl_config(tmp_path, num_prompts=8, overrides=[
        "model.seq_length=48", "rollout.max_new_tokens=24", "rollout.n_samples=4", "train.global_batch_size=32",
        "train.micro_batch_size=32", f"rollout.spec={spec}", "rollout.spec_threshold=null", "train.steps=1",
        "rl.num_kv_blocks=256"])
    run = RLRun(cfg)
    run.train()  # one step, logged to metrics.jsonl
    steps = run.engine.step_log
    m = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert m["rollout_steps"] == len(steps) > 0 and m["tail_batch"] == 8  # 32 sequences / 4
    assert m["rollout_steps_tail"] == sum(1 for b, _ in steps if b <= 8)
    buckets = sum(v for k, v in m.items() if k.startswith("t_rollout_b"))
    assert 0 <= m["t_rollout_tail"] <= buckets <= m["t_rollout"]
    assert m["t_rollout_b17_32"] > 0  # the first steps ran all 32 sequences
    assert m["t_rollout_capture"] == 0.0 == run.engine.capture_seconds()  # no CUDA graphs on CPU
    accept = {k: v for k, v in m.items() if k.startswith("accept_len_b")}
    if spec == "off":
        assert not accept
    else:
        assert accept and all(v >= 1.0 for v in accept.values())


def test_capture_seconds_sums_the_engine_and_decoder_clocks():
    """RolloutEngine.capture_seconds adds the decode runner's capture clock and the
    speculative decoder's (verify math + EAGLE chain graphs); what a GPU run accumulates
    is stood in for by set clocks (CUDA graphs exist only on a GPU)."""
    import types

    from megatron_tlt.rollout.engine import RolloutEngine
    from megatron_tlt.spec.decode import SpecDecoder

    dec = SpecDecoder.__new__(SpecDecoder)
    dec._math = types.SimpleNamespace(capture_s=0.25)
    dec.drafter = types.SimpleNamespace(_chain_graphs=types.SimpleNamespace(capture_s=0.5))
    eng = RolloutEngine.__new__(RolloutEngine)
    eng.decode_runner, eng.spec_decoder = types.SimpleNamespace(capture_s=2.0), dec
    assert eng.capture_seconds() == 2.75
    dec._math, dec.drafter = None, types.SimpleNamespace()  # n-gram drafter, no fast verify
    eng.decode_runner = None
    assert eng.capture_seconds() == 0.0
