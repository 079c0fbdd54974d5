"""The config tree: YAML + overrides, type checks, error messages, cross-field checks."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import typing
from dataclasses import dataclass, field

import pytest

from megatron_tlt import config as config_mod
from megatron_tlt.config import (
    Config,
    ConfigSection,
    OptimConfig,
    RolloutConfig,
    TrainConfig,
    config_from_dict,
    config_to_dict,
    format_config,
    load_config,
    parse_override,
    save_config,
)
from megatron_tlt.errors import ConfigError, TLTError


def write(tmp_path, text: str, name: str = "cfg.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def sections(cls=Config, prefix=""):
    """(dotted path, section class) for every section in the tree, root included."""
    yield prefix, cls
    for name, hint in typing.get_type_hints(cls).items():
        if isinstance(hint, type) and issubclass(hint, ConfigSection):
            yield from sections(hint, f"{prefix}.{name}" if prefix else name)


# ------------------------------------------------------------------- happy paths


def test_defaults_are_valid_and_complete():
    cfg = load_config(None, [])
    assert cfg == Config()
    assert set(config_to_dict(cfg)) == {"model", "parallel", "optim", "rollout", "train", "logging", "data", "sft", "rl"}


def test_defaults_fit_the_built_in_tiny_default():
    """`train` / `sft` without --config run the built-in tiny default: the default
    seq_length must fit its context (2048 against 1024 failed both commands at once), and
    the random-init architecture's too."""
    import json
    import os

    from megatron_tlt.sft import TINY_DEFAULT_DIR

    cfg = Config()
    with open(os.path.join(TINY_DEFAULT_DIR, "config.json")) as f:
        ctx = json.load(f)["max_position_embeddings"]
    assert cfg.model.seq_length <= ctx
    assert cfg.model.seq_length <= cfg.model.arch.max_position_embeddings
    assert cfg.rollout.max_new_tokens < cfg.model.seq_length


def test_yaml_then_overrides(tmp_path):
    path = write(
        tmp_path,
        """
model:
  dtype: bfloat16
  seq_length: 512
rollout:
  temperature: 0.5
  max_new_tokens: 128
  spec: adaptive
optim:
  lr: 3        # an int is accepted for a float field
train:
  steps: 7
logging:
  tensorboard: true
""",
    )
    cfg = load_config(path, ["rollout.temperature=0.7", "train.steps=9", "model.hf_path=null", "train.resume=none"])
    assert cfg.model.dtype == "bfloat16" and cfg.model.seq_length == 512
    assert cfg.rollout.temperature == 0.7 and cfg.rollout.spec == "adaptive"
    assert cfg.optim.lr == 3.0 and type(cfg.optim.lr) is float
    assert cfg.train.steps == 9
    assert cfg.logging.tensorboard is True
    assert cfg.model.hf_path is None
    assert cfg.train.resume == "none"
    # untouched fields keep their defaults
    assert cfg.parallel == Config().parallel


def test_yaml12_scalars(tmp_path):
    # YAML 1.1 would read `off` as False and `1e-4` as a string.
    path = write(tmp_path, "rollout:\n  spec: off\noptim:\n  lr: 1e-4\n  min_lr: 1E-5\n")
    cfg = load_config(path, ["optim.eps=1e-9"])
    assert cfg.rollout.spec == "off"
    assert cfg.optim.lr == 1e-4 and cfg.optim.min_lr == 1e-5 and cfg.optim.eps == 1e-9


def test_override_value_types():
    assert parse_override("train.steps=12") == ("train.steps", 12)
    assert parse_override("rollout.top_p=0.9") == ("rollout.top_p", 0.9)
    assert parse_override("logging.tensorboard=true") == ("logging.tensorboard", True)
    assert parse_override("model.hf_path=null") == ("model.hf_path", None)
    assert parse_override("model.hf_path=") == ("model.hf_path", None)
    assert parse_override("rollout.spec=off") == ("rollout.spec", "off")
    assert parse_override("x.y=[1, 2]") == ("x.y", [1, 2])
    # A string field keeps the text as written even if YAML reads it as a number/mapping.
    assert parse_override("train.out_dir=2024") == ("train.out_dir", "2024")
    assert parse_override("train.resume=/ckpt/a: b") == ("train.resume", "/ckpt/a: b")
    assert load_config(None, ["train.out_dir=2024"]).train.out_dir == "2024"


def test_round_trip(tmp_path):
    cfg = load_config(
        None,
        [
            "rollout.spec=off",
            "train.out_dir=1e-4",  # strings that look like other types must survive
            "train.resume=yes",
            "optim.lr=2.5e-7",
            "model.dtype=float16",
            "model.hf_path=/models/x",
            "parallel.dp=2",
        ],
    )
    path = tmp_path / "sub" / "config.yaml"
    save_config(cfg, str(path))
    back = load_config(str(path), [])
    assert back == cfg
    assert back.train.out_dir == "1e-4" and back.train.resume == "yes" and back.rollout.spec == "off"
    assert config_from_dict(config_to_dict(cfg)) == cfg
    assert not list(path.parent.glob("*.tmp.*")), "temporary file left behind"


def test_format_config_lists_every_key():
    cfg = load_config(None, ["rollout.temperature=0.25"])
    text = format_config(cfg)
    for section, fields in config_to_dict(cfg).items():
        assert f"{section}:" in text.splitlines()
        for name in fields:
            assert any(line.strip().startswith(f"{name}:") for line in text.splitlines()), name
    assert any(line.split() == ["temperature:", "0.25"] for line in text.splitlines())


def test_empty_file_and_empty_section_mean_defaults(tmp_path):
    assert load_config(write(tmp_path, ""), []) == Config()
    assert load_config(write(tmp_path, "rollout:\n", "b.yaml"), []) == Config()


# ------------------------------------------------------------------------ errors


def error_of(path=None, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    message = str(info.value)
    assert "\n" not in message, "errors must fit on one line"
    return message


def test_config_error_is_value_error_and_tlt_error():
    assert issubclass(ConfigError, ValueError) and issubclass(ConfigError, TLTError)


def test_unknown_key_suggests(tmp_path):
    msg = error_of(None, ["rollout.temprature=0.7"])
    assert msg == "unknown config key 'rollout.temprature' (did you mean 'rollout.temperature'?)"
    msg = error_of(write(tmp_path, "rollot:\n  temperature: 1.0\n"))
    assert msg == "unknown config key 'rollot' (did you mean 'rollout'?)"
    # a key in the wrong section points to where it lives
    assert error_of(None, ["train.lr=1e-5"]) == "unknown config key 'train.lr' (did you mean 'optim.lr'?)"
    # nothing close: the known keys are listed
    msg = error_of(None, ["rollout.zzz=1"])
    assert msg.startswith("unknown config key 'rollout.zzz' (known keys under 'rollout': max_new_tokens")


def test_bad_types():
    assert error_of(None, ["train.steps=abc"]) == "train.steps must be int, got 'abc'"
    assert error_of(None, ["train.steps=1.5"]) == "train.steps must be int, got 1.5"
    # bool is a subclass of int; it must not pass as one (nor as a float)
    assert error_of(None, ["train.steps=true"]) == "train.steps must be int, got True"
    assert error_of(None, ["optim.lr=false"]) == "optim.lr must be float, got False"
    assert error_of(None, ["logging.tensorboard=1"]) == "logging.tensorboard must be bool, got 1"
    assert error_of(None, ["optim.lr=fast"]) == "optim.lr must be float, got 'fast'"
    assert error_of(None, ["train.out_dir=null"]) == "train.out_dir must be str, got None"
    assert error_of(None, ["rollout=3"]) == "rollout must be a mapping of keys, got 3"


def test_bad_literal():
    msg = error_of(None, ["rollout.spec=eagel"])
    assert msg == "rollout.spec must be one of 'off', 'eagle', 'ngram', 'adaptive', got 'eagel' (did you mean 'eagle'?)"
    assert error_of(None, ["model.dtype=fp8"]).startswith("model.dtype must be one of 'float32', 'bfloat16'")


def test_missing_file(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    assert error_of(missing) == f"config file {missing!r} not found"
    assert error_of(str(tmp_path)) == f"config file {str(tmp_path)!r} is a directory, not a file"


def test_bad_yaml_names_file_and_line(tmp_path):
    path = write(tmp_path, "train:\n  steps: 3\n  out_dir: [unclosed\nrollout:\n  top_k: 2\n")
    msg = error_of(path)
    assert msg.startswith(f"invalid YAML in config file {path}:")
    line = int(msg[len(f"invalid YAML in config file {path}:") :].split(":")[0])
    assert 3 <= line <= 5, msg
    assert error_of(write(tmp_path, "- a\n- b\n", "list.yaml")).endswith("must hold a mapping of sections, got list")
    # not UTF-8: was a UnicodeDecodeError traceback
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"train:\n  steps: \xff\n")
    assert error_of(str(binary)) == f"config file {str(binary)!r} is not UTF-8 text (byte 17)"


def test_save_config_under_a_file_is_one_clear_error(tmp_path):
    """train.out_dir=afile/sub: was NotADirectoryError / FileExistsError tracebacks."""
    from megatron_tlt.config import save_config

    (tmp_path / "afile").write_text("x")
    for path in (tmp_path / "afile" / "config.yaml", tmp_path / "afile" / "sub" / "config.yaml"):
        with pytest.raises(ConfigError, match="is a file, not a directory"):
            save_config(load_config(None, []), str(path))
    save_config(load_config(None, []), str(tmp_path / "ok" / "config.yaml"))  # control
    assert (tmp_path / "ok" / "config.yaml").is_file()


def test_bad_override_syntax():
    assert error_of(None, ["rollout.temperature"]) == "override 'rollout.temperature' must look like section.key=value"
    assert error_of(None, ["=3"]) == "override '=3' must look like section.key=value"
    assert error_of(None, ["train..steps=3"]).startswith("override 'train..steps=3' must look like")
    assert error_of(None, ["train.steps.x=1"]) == "cannot set 'train.steps.x': 'train.steps' is a value, not a section"
    assert error_of(None, ["train.steps=[1"]).startswith("override 'train.steps=[1': value is not valid YAML")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.tp=0"], "parallel.tp must be >= 1, got 0"),
        (["optim.lr=0"], "optim.lr must be > 0.0, got 0.0"),
        (["optim.lr=1e-5", "optim.min_lr=1e-4"], "optim.min_lr (0.0001) must not exceed optim.lr (1e-05)"),
        (["optim.adam_beta2=1.0"], "optim.adam_beta2 must be in [0, 1), got 1.0"),
        (["rollout.top_p=0"], "rollout.top_p must be in (0, 1], got 0.0"),
        (["rollout.temperature=-1"], "rollout.temperature must be >= 0.0, got -1.0"),
        (["rollout.n_samples=1"], "rollout.n_samples must be >= 2 (GRPO normalises rewards within each "
                                  "prompt's group of samples), got 1"),
        (["rollout.temperature=1e-9"], "rollout.temperature must be 0 (greedy) or at least 1e-05, got 1e-09"),
        (["train.steps=0"], "train.steps must be >= 1, got 0"),
        (["optim.lr=.inf"], "optim.lr must be float, got inf (not a finite number)"),
        (["rollout.temperature=-.inf"], "rollout.temperature must be float, got -inf (not a finite number)"),
        (["rollout.spec_topk=0"], "rollout.spec_topk must be >= 1, got 0"),
        (["rollout.spec_num_verify=-3"], "rollout.spec_num_verify must be >= 2 (the root and at least one "
                                         "draft token) or null, got -3"),
        (["rollout.spec_threshold=-1"], "rollout.spec_threshold must be >= 0 or null, got -1"),
        (
            ["train.global_batch_size=12", "train.micro_batch_size=2", "parallel.dp=4"],
            "train.global_batch_size (12) must be a multiple of train.micro_batch_size (2) x parallel.dp (4)",
        ),
        (
            ["model.seq_length=256", "rollout.max_new_tokens=256"],
            "rollout.max_new_tokens (256) must be less than model.seq_length (256) to leave room for the prompt",
        ),
    ],
)
def test_cross_field_checks(overrides, message):
    assert error_of(None, overrides) == message


def test_yaml_merge_keys_still_merge(tmp_path):
    """The duplicate-key check leaves `<<:` merge keys to PyYAML (it refused every merge
    key: no constructor for the merge tag); a local key overrides a merged one."""
    path = write(tmp_path, "rollout:\n  <<: {temperature: 0.7, max_new_tokens: 64}\n  max_new_tokens: 32\n")
    cfg = load_config(path, [])
    assert (cfg.rollout.temperature, cfg.rollout.max_new_tokens) == (0.7, 32)
    assert config_mod._parse_yaml("a: &x {k: 1}\nb:\n  <<: *x\n  j: 2\n") == {"a": {"k": 1}, "b": {"k": 1, "j": 2}}


def test_duplicate_yaml_key_is_an_error(tmp_path):
    """A section given twice lost the first one's keys silently (YAML 1.2: keys are unique)."""
    path = write(tmp_path, "train:\n  steps: 5\nrollout:\n  top_k: 3\ntrain:\n  global_batch_size: 32\n")
    message = error_of(path)
    assert "duplicate key 'train'" in message and "cfg.yaml:5" in message, message


def test_cross_field_checks_accept_edges():
    cfg = load_config(
        None,
        ["train.global_batch_size=16", "train.micro_batch_size=2", "parallel.dp=4", "rollout.temperature=0",
         "optim.min_lr=1e-6", "optim.lr=1e-6", "model.seq_length=257", "rollout.max_new_tokens=256"],
    )  # fmt: skip
    assert cfg.train.global_batch_size == 16 and cfg.rollout.temperature == 0.0


# --------------------------------------------------- construction from Python code


def test_python_construction_is_validated():
    with pytest.raises(ConfigError, match=r"^train\.steps must be int, got 'abc'$"):
        TrainConfig(steps="abc")
    with pytest.raises(ConfigError, match=r"^rollout\.top_k must be >= 0, got -1$"):
        RolloutConfig(top_k=-1)
    with pytest.raises(ConfigError, match=r"^optim must be a mapping of keys"):
        Config(optim={"lr": 1.0})
    assert OptimConfig(lr=1).lr == 1.0  # int -> float
    # dataclasses.replace re-validates
    with pytest.raises(ConfigError, match="train.micro_batch_size"):
        dataclasses.replace(Config(), train=TrainConfig(global_batch_size=3, micro_batch_size=2))


@pytest.mark.parametrize("path, cls", list(sections()), ids=lambda v: v if isinstance(v, str) else None)
def test_every_section_type_checks_every_field(path, cls):
    """A section whose __post_init__ forgets super() would skip type checks: caught here."""
    assert cls._path == path
    for f in dataclasses.fields(cls):
        with pytest.raises(ConfigError) as info:
            cls(**{f.name: object()})
        key = f"{path}.{f.name}" if path else f.name
        assert str(info.value).startswith(f"{key} must be "), str(info.value)


@pytest.mark.parametrize("path, cls", list(sections()), ids=lambda v: v if isinstance(v, str) else None)
def test_every_field_has_a_docstring_and_default(path, cls):
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    documented = set()
    for stmt, nxt in zip(body, body[1:]):
        if isinstance(stmt, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            documented.add(stmt.target.id)
    for f in dataclasses.fields(cls):
        assert f.name in documented, f"{path or 'Config'}.{f.name} has no docstring line"
        assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING, f.name


def test_list_and_optional_fields_in_a_new_section():
    """Adding a section: a subclass with list/Optional/Literal fields gets the same checks."""

    @dataclass(kw_only=True)
    class Extra(ConfigSection):
        ids: list[int] = field(default_factory=list)
        """Some ids."""
        scale: float | None = None
        """Optional scale."""
        mode: typing.Literal["a", "b"] = "a"
        """Mode."""

    assert Extra(ids=[1, 2], scale=2).scale == 2.0
    with pytest.raises(ConfigError, match=r"^ids\[1\] must be int, got 'x'$"):
        Extra(ids=[1, "x"])
    with pytest.raises(ConfigError, match=r"^ids must be list of int, got 3$"):
        Extra(ids=3)
    with pytest.raises(ConfigError, match=r"^scale must be float or null, got 'big'$"):
        Extra(scale="big")
    with pytest.raises(ConfigError, match=r"^mode must be one of 'a', 'b', got True$"):
        Extra(mode=True)


def test_yaml_loader_is_safe(tmp_path):
    path = write(tmp_path, "train: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(path, [])
    assert config_mod._parse_yaml("a: 1") == {"a": 1}


def test_spec_depth_schedule(tmp_path):
    """rollout.spec_depth: one depth, or depths by running batch size as a string; YAML's
    1.1 base-60 ints are not read (8:4 would be 484), and the file round-trips; the RL
    run's decoder takes the schedule (control: an int gives one depth everywhere)."""
    import types

    from megatron_tlt.rl.loop import RLRun
    assert load_config(None, ["rollout.spec_depth=5"]).rollout.spec_depth == 5
    cfg = load_config(None, ["rollout.spec_depth=8:4", "rollout.spec=ngram"])
    assert cfg.rollout.spec_depth == "8:4"
    path = tmp_path / "c.yaml"
    save_config(cfg, str(path))
    assert load_config(str(path), []).rollout.spec_depth == "8:4"
    cfg = load_config(None, ["rollout.spec_depth=1:6,8:4,32:3", "rollout.spec=ngram", "rollout.spec_threshold=64"])
    dec = RLRun._spec_decoder(types.SimpleNamespace(cfg=cfg), None)
    assert [dec.choose(b).depth for b in (1, 5, 8, 20, 64)] == [6, 4, 4, 3, 3] and dec.choose(65) is None
    one = RLRun._spec_decoder(types.SimpleNamespace(cfg=load_config(None, ["rollout.spec=ngram",
                                                                            "rollout.spec_depth=4"])), None)
    assert {one.choose(b).depth for b in (1, 8, 16)} == {4}
    tree = RLRun._spec_decoder(types.SimpleNamespace(cfg=load_config(None, ["rollout.spec=ngram",
                                                                             "rollout.spec_depth=1:6x2,8:4"])), None)
    assert [(tree.choose(b).depth, tree.choose(b).topk) for b in (1, 2)] == [(6, 2), (4, 1)]
    assert load_config(None, ["rollout.spec_depth=5x2"]).rollout.spec_depth == "5x2"
    for bad in ("1:6x0", "5x0", "0"):
        with pytest.raises(ConfigError, match="spec_depth"):
            load_config(None, [f"rollout.spec_depth={bad}"])
    # The default (config.DEFAULT_SPEC_DEPTH, also generate's and bench spec's): 6 while one
    # sequence runs, else 4 (above the last bound too); with rollout.spec_threshold's
    # default, SD only while at most 32 sequences run.
    assert load_config(None, []).rollout.spec_threshold == 32
    dflt = RLRun._spec_decoder(types.SimpleNamespace(cfg=load_config(None, ["rollout.spec=ngram"])), None)
    assert [dflt.choose(b).depth for b in (1, 2, 16, 32)] == [6, 4, 4, 4]
    assert dflt.choose(33) is None and dflt.choose(256) is None
    always = RLRun._spec_decoder(types.SimpleNamespace(cfg=load_config(
        None, ["rollout.spec=ngram", "rollout.spec_threshold=null"])), None)
    assert [always.choose(b).depth for b in (1, 2, 32, 33, 256)] == [6, 4, 4, 4, 4]
    from megatron_tlt.bench_spec import parse_args as bench_spec_args
    from megatron_tlt.config import DEFAULT_SPEC_DEPTH
    from megatron_tlt.rollout.cli import add_generate_args
    assert load_config(None, []).rollout.spec_depth == DEFAULT_SPEC_DEPTH == "1:6,32:4"
    assert bench_spec_args(["--model", "m"]).spec_depth == DEFAULT_SPEC_DEPTH
    gen = argparse.ArgumentParser()
    add_generate_args(gen)
    assert gen.parse_args(["--model", "m", "--prompts", "p", "--out", "o"]).spec_depth == DEFAULT_SPEC_DEPTH
    msg = error_of(None, ["rollout.spec_depth=8:0"])
    assert msg.startswith("rollout.spec_depth: spec depth schedule '8:0'"), msg
