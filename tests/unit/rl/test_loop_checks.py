"""Checks the RL loop runs before any work starts, its conversion cache rule, and the test
rewards its integration tests rely on."""

import json

import pytest

from megatron_tlt.config import load_config
from megatron_tlt.errors import ConfigError
from megatron_tlt.convert import is_conversion_of, source_fingerprint
from megatron_tlt.rl.loop import check_data, check_sampling
from megatron_tlt.testing import rewards


def test_check_data_names_the_field_and_value(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "p", "answer": "a"}\n')
    check_data(load_config(None, [f"data.path={data}", "rl.reward=arith"]))
    check_data(load_config(None, []))  # synthetic tasks: nothing to check here
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(ConfigError) as e:
        check_data(load_config(None, [f"data.path={missing}", "rl.reward=arith"]))
    assert str(e.value) == f"data.path {str(missing)!r} not found"
    with pytest.raises(ConfigError, match="is a directory, not a file"):
        check_data(load_config(None, [f"data.path={tmp_path}", "rl.reward=arith"]))
    with pytest.raises(ConfigError, match=r"data.path \(.*prompts.jsonl'\) needs rl.reward .*; it is null"):
        check_data(load_config(None, [f"data.path={data}"]))


def test_check_sampling_refuses_truncated_sampling():
    check_sampling(load_config(None, ["rollout.temperature=0.7"]))  # tempered, untruncated: fine
    with pytest.raises(ConfigError, match=r"^rollout.top_k \(5\) must be 0 for RL training: the actor's log-probs"):
        check_sampling(load_config(None, ["rollout.top_k=5"]))
    with pytest.raises(ConfigError, match=r"^rollout.top_p \(0.9\) must be 1.0 for RL training"):
        check_sampling(load_config(None, ["rollout.top_p=0.9"]))


def test_cached_conversion_is_reused_only_for_its_source(tmp_path):
    """Reused only for the same directory with the same config.json and weight files (size,
    mtime): a directory rewritten in place (an SFT rerun into it) was converted once and
    its stale conversion trained and served as the KL reference."""
    hf, other, mc = tmp_path / "hf", tmp_path / "other", tmp_path / "init_mcore"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"0" * 64)
    (hf / "tokenizer.json").write_text("{}")
    assert not is_conversion_of(str(mc), str(hf))  # nothing cached yet
    mc.mkdir()
    meta = {"converted_from": str(hf), "source_files": source_fingerprint(str(hf))}
    (mc / "tlt_model.json").write_text(json.dumps(meta))
    assert is_conversion_of(str(mc), str(hf))
    assert not is_conversion_of(str(mc), str(other))
    (hf / "tokenizer.json").write_text('{"changed": 1}')  # not read by the conversion
    assert is_conversion_of(str(mc), str(hf))
    (hf / "model.safetensors").write_bytes(b"1" * 80)  # new weights in place
    assert not is_conversion_of(str(mc), str(hf))
    (mc / "tlt_model.json").write_text(json.dumps({"converted_from": str(hf)}))  # no fingerprint
    assert not is_conversion_of(str(mc), str(hf))


def test_raising_reward_raises_only_on_its_answer(monkeypatch):
    monkeypatch.setenv(rewards.RAISE_ON_ANSWER_ENV, "a3")
    assert rewards.digit_fraction_or_raise("12ab", "a2") == 0.5
    with pytest.raises(ValueError, match="test reward refuses answer 'a3'"):
        rewards.digit_fraction_or_raise("12ab", "a3")
    assert rewards.distinct_fraction("abab", "") == 0.5 and rewards.distinct_fraction("", "") == 0.0
    assert rewards.many_distinct_chars("abcdefgh", "") == 1.0 and rewards.many_distinct_chars("abababab", "") == 0.0


def _bare_run(num_prompts: int, per_step: int, *, seed: int = 0, seq_length: int = 64, max_new: int = 8):
    from megatron_tlt.data.tokenizer import load_tokenizer
    from megatron_tlt.rl.loop import RLRun, _Prompt
    from megatron_tlt.sft import TINY_DEFAULT_DIR

    run = RLRun.__new__(RLRun)
    run.cfg = load_config(None, [f"train.seed={seed}", f"model.seq_length={seq_length}",
                                 f"rollout.max_new_tokens={max_new}", "rollout.n_samples=2"])
    run.tokenizer = load_tokenizer(TINY_DEFAULT_DIR)
    run.prompts = [_Prompt(f"p{i}", f"{i} + {i} =", str(2 * i), "arith") for i in range(num_prompts)]
    run.prompts_per_step, run.dp, run.dp_rank, run.data_pos, run.step = per_step, 1, 0, 0, 0
    return run


def test_step_prompts_repeated_across_an_epoch_boundary_get_their_own_samples():
    """A step spanning an epoch boundary (or asking more prompts than the set holds) holds
    a prompt twice: the repeat's requests take other sample indices (hence other seeds),
    so the engine does not reject them as duplicates of the first (which failed the step:
    20 of 200 steps of 4 from 10 prompts, seeds 0-19)."""
    repeats = 0
    for seed in range(20):
        run = _bare_run(10, 4, seed=seed)
        for _ in range(10):
            mine, step = run._step_prompts()
            assert mine == step
            keys = [(p.prompt_id, p.repeat) for p in step]
            assert len(set(keys)) == len(keys), keys
            repeats += sum(p.repeat > 0 for p in step)
            run.data_pos += run.prompts_per_step
    assert repeats > 0  # the case happened
    run = _bare_run(3, 8)  # more prompts a step than the set holds
    _, step = run._step_prompts()
    assert sorted(p.repeat for p in step) == [0, 0, 0, 1, 1, 1, 2, 2]


def test_repeated_prompt_rolls_out_with_distinct_requests():
    from megatron_tlt.rollout import RolloutEngine, load_hf
    from megatron_tlt.sft import TINY_DEFAULT_DIR

    run = _bare_run(2, 3)  # p?, p?, then the first again
    arch, weights = load_hf(TINY_DEFAULT_DIR)
    run.engine = RolloutEngine(arch, weights, max_num_seqs=8, num_blocks=64, block_size=16,
                               max_model_len=run.cfg.model.seq_length, eos_token_ids=[run.tokenizer.eos_id])
    mine, _ = run._step_prompts()
    assert len({p.prompt_id for p in mine}) == 2  # one prompt twice
    out = run._generate_and_score(mine)
    keys = list(zip(out["prompt_ids"], out["sample_indices"]))
    assert len(set(keys)) == len(keys) == 6, keys
    assert sorted(i for p, i in keys if p == mine[2].prompt_id) == [0, 1, 2, 3]


def test_fit_keeps_what_the_engine_accepts():
    """Prompt + rollout.max_new_tokens <= model.seq_length (the engine's max_model_len):
    one more token was kept and then rejected by the engine, failing the step."""
    from megatron_tlt.rl.loop import _Prompt

    run = _bare_run(1, 1, seq_length=64, max_new=32)
    enc = run.tokenizer.encode_prompt
    fits = next(_Prompt("fit", "x" * k, "1", "arith") for k in range(1, 200) if len(enc("x" * k)) == 32)
    over = next(_Prompt("over", "x" * k, "1", "arith") for k in range(1, 200) if len(enc("x" * k)) == 33)
    assert run._fit([fits, over]) == [fits]
    with pytest.raises(ConfigError, match=r"longer than model.seq_length \(64\) - rollout.max_new_tokens \(32\) tokens"):
        run._fit([over])


def test_train_writes_metrics_every_log_interval_steps_and_at_the_last():
    """logging.log_interval applies to `train` as to `sft` (it wrote every step): steps 2,
    4 and the last (5) of 5 at an interval of 2; checkpoints are unaffected, and each
    carries the n-gram drafter's store as the rank's state (restored on resume: at
    temperature > 0 the store decides which tokens are sampled)."""
    from types import MethodType, SimpleNamespace

    from megatron_tlt.rl.loop import RLRun
    from megatron_tlt.spec.ngram import NgramDrafter

    logged, saved = [], []
    drafter = NgramDrafter()
    drafter.load_state_dict({"format": 1, "store": [["p0", [1, 2], [[1, 2, 3, 4]]]]})
    run = SimpleNamespace(cfg=load_config(None, ["train.steps=5", "logging.log_interval=2",
                                                 "train.save_interval=1"]),
                          step=0, rank=1, data_pos=0, tokenizer_dir=None, actor=None, optimizer=None,
                          engine=SimpleNamespace(spec_decoder=SimpleNamespace(drafter=drafter)))
    for name in ("_ngram_drafter", "_rank_state", "_restore_rank_state"):
        setattr(run, name, MethodType(getattr(RLRun, name), run))

    def run_step():
        run.step += 1
        return {"reward_mean": 0.0}

    run.run_step = run_step
    run.metrics = SimpleNamespace(log=lambda step, m: logged.append(step), close=lambda: None, path="m")
    run.ckpt = SimpleNamespace(save=lambda step, *a, rank_state=None, **k: saved.append((step, rank_state)),
                               root="c")
    RLRun.train(run)
    assert logged == [2, 4, 5] and [s for s, _ in saved] == [1, 2, 3, 4, 5]
    state = saved[-1][1]["ngram_store"]
    assert state == drafter.state_dict() and state["store"][0][2] == [[1, 2, 3, 4]]
    drafter.clear_store()
    run._restore_rank_state({"ngram_store": state})
    assert drafter.state_dict() == state


def test_length_percentiles_are_nearest_rank():
    """len_p50 / p90 / p99 by nearest rank (data.tasks.length_stats' rule): int(q * n) was
    one rank high whenever q * n is whole (10 lengths: p90 was the maximum; an even count:
    p50 the upper middle value)."""
    from megatron_tlt.data.tasks import length_stats
    from megatron_tlt.rl.loop import _percentiles

    for n in (1, 3, 10, 16, 100, 257):
        xs = list(range(1, n + 1))[::-1]
        got, want = _percentiles(xs), length_stats(xs)
        assert (got["len_p50"], got["len_p90"], got["len_p99"], got["len_max"]) == (
            want["median"], want["p90"], want["p99"], want["max"]), n
    assert _percentiles(list(range(1, 11)))["len_p90"] == 9
