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
