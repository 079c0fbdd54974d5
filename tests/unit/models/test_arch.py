import json

import pytest

from megatron_tlt.errors import CheckpointError, ConfigError
from megatron_tlt.models.arch import ModelArch
from megatron_tlt.testing.tiny_models import FAMILIES, tiny_hf_config


@pytest.mark.parametrize("family", FAMILIES)
def test_from_hf_config(family):
    cfg = tiny_hf_config(family, vocab_size=250, num_heads=4, num_kv_heads=2).to_dict()
    arch = ModelArch.from_hf_config(cfg)
    assert arch.family == family
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (4, 2, 16)
    assert arch.qkv_bias == (family == "qwen2")
    assert arch.qk_norm == (family == "qwen3")
    assert arch.padded_vocab_size == 256 and arch.vocab_size == 250
    # our own HF config reads back to the same arch
    assert ModelArch.from_hf_config(arch.to_hf_config()) == arch


def test_old_style_rope_theta():
    cfg = tiny_hf_config("llama").to_dict()
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = 500000.0
    assert ModelArch.from_hf_config(cfg).rope_theta == 500000.0


@pytest.mark.parametrize("scaling", [{"rope_type": "yarn", "factor": 4.0}, {"type": "linear", "factor": 2.0}])
def test_rope_scaling_refused(scaling):
    cfg = tiny_hf_config("llama").to_dict()
    cfg["rope_scaling"] = scaling
    with pytest.raises(ConfigError, match="rope scaling type .* is not implemented"):
        ModelArch.from_hf_config(cfg)


def test_unsupported_architecture():
    with pytest.raises(ConfigError, match="unsupported architecture model_type='gpt2'"):
        ModelArch.from_hf_config({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})


def test_missing_field():
    cfg = tiny_hf_config("qwen2").to_dict()
    del cfg["intermediate_size"]
    with pytest.raises(ConfigError, match="missing required field 'intermediate_size'"):
        ModelArch.from_hf_config(cfg)


def test_parallel_checks_name_values():
    arch = ModelArch.from_hf_config(tiny_hf_config("llama", num_heads=4, num_kv_heads=2).to_dict())
    arch.check_parallel(2, 2)
    with pytest.raises(ConfigError, match=r"num_attention_heads \(4\) must be a multiple of tensor_model_parallel_size \(3\)"):
        arch.check_parallel(3, 1)
    with pytest.raises(ConfigError, match=r"num_key_value_heads \(2\) must be a multiple of tensor_model_parallel_size \(4\)"):
        arch.check_parallel(4, 1)
    with pytest.raises(ConfigError, match=r"num_hidden_layers \(2\) must be a multiple of pipeline_model_parallel_size \(4\)"):
        arch.check_parallel(1, 4)


def test_from_hf_dir_errors(tmp_path):
    with pytest.raises(CheckpointError, match="model directory not found"):
        ModelArch.from_hf_dir(str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="no config.json"):
        ModelArch.from_hf_dir(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        ModelArch.from_hf_dir(str(tmp_path))


def test_num_params_matches_hf(tmp_path):
    from transformers import AutoModelForCausalLM

    for family in FAMILIES:
        cfg = tiny_hf_config(family, tie_word_embeddings=(family == "qwen3"))
        model = AutoModelForCausalLM.from_config(cfg)
        arch = ModelArch.from_hf_config(json.loads(cfg.to_json_string()))
        assert arch.num_params() == sum(p.numel() for p in model.parameters()), family
