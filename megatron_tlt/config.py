"""The typed config tree: YAML files plus dotted overrides, validated on construction.

One `@dataclass(kw_only=True)` per component, each a `ConfigSection`. Constructing a
section checks every field against its type hint (int, float, bool, str, Optional,
Literal, list[...], nested sections) and then runs the section's own cross-field
checks in `__post_init__`; every failure is a `ConfigError` naming the dotted key and
the value. So a `Config` that exists is valid, however it was built (YAML, overrides,
or Python code).

Adding a section: write a `ConfigSection` subclass (docstring line under each field,
checks in `__post_init__` after `super().__post_init__()`), and add one field for it to
`Config` (or to another section, to nest it). Its dotted path ("rollout",
"rollout.spec", ...) is assigned at import from where it sits in the tree; use
`self._key("field")` to name fields in error messages.

YAML is read with PyYAML's safe loader, changed in two places on purpose (YAML 1.2
behaviour), because the YAML 1.1 rules bite configs:
- only true/false (any case) are booleans: `spec: off` is the string 'off', not False;
- `1e-4` is a float (YAML 1.1 needs `1.0e-4`), as it is everywhere else.
The same rules are used to write configs, so `save_config` -> `load_config` round-trips.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import yaml

from megatron_tlt.errors import ConfigError

DEFAULT_SPEC_DEPTH = "1:6,32:4"
"""Default chain depth by running batch size (rollout.spec_depth, generate/bench spec
--spec-depth): 6 while one sequence runs (the long tail), else 4. Measured on one H200
(1.5B target trained 120 steps, T=0.9, 32 sequences per run). Session 16
(benchmarks/results/gpu_2026-12-04_session16, drafter top-1 0.760, draft- and
verify-ahead): batch 1 depth 6 2.50x against 2.36x at depth 7 and 2.44x at depth 5 in one
process (4.23 / 4.19 / 3.97 tokens per step, 3.18 / 3.34 / 3.07 ms per engine step), depth
5 2.50x against 2.45x at depth 7 in another; at batch 4, 16 and 32 depth 4 beat 5 (and 6
at 32) as in session 14, where depth 6-10 accepted 4.01 tokens per step at batch 1 against
3.35 at depth 4. Depth 4 keeps batch 32 within the verify graphs' 256 rows (32 x 5); a
depth-8 chain there (288 rows) verified eagerly, 0.61x."""

# --------------------------------------------------------------------------- YAML


def _yaml12_resolvers(base: type, *, keep_yaml11: bool) -> dict:
    """`base`'s implicit resolvers with YAML 1.2 bool and float rules added.

    keep_yaml11=False (reading) drops the YAML 1.1 bool/float rules and the 1.1 int rule's
    base-60 form (1.1 reads `8:4` as 484; 1.2 and this reader as the string "8:4", e.g. a
    rollout.spec_depth schedule); True (writing) keeps them, so a string either reader
    would take for something else is quoted.
    """
    replaced = () if keep_yaml11 else ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:float")
    int_rx = re.compile(r"""^(?:[-+]?0b[0-1_]+
        |[-+]?0[0-7_]+
        |[-+]?(?:0|[1-9][0-9_]*)
        |[-+]?0x[0-9a-fA-F_]+)$""", re.X)
    resolvers = {
        first: [(tag, int_rx if tag == "tag:yaml.org,2002:int" and not keep_yaml11 else rx)
                for tag, rx in entries if tag not in replaced]
        for first, entries in base.yaml_implicit_resolvers.items()
    }
    bool_rx = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
    float_rx = re.compile(
        r"""^(?:[-+]?(?:\.[0-9]+|[0-9][0-9_]*(?:\.[0-9_]*)?)(?:[eE][-+]?[0-9]+)?
            |[-+]?\.(?:inf|Inf|INF)
            |\.(?:nan|NaN|NAN))$""",
        re.X,
    )
    for tag, rx, firsts in (
        ("tag:yaml.org,2002:bool", bool_rx, "tTfF"),
        ("tag:yaml.org,2002:float", float_rx, "-+0123456789."),
    ):
        for first in firsts:
            resolvers.setdefault(first, []).append((tag, rx))
    return resolvers


class _Loader(yaml.SafeLoader):
    pass


class _Dumper(yaml.SafeDumper):
    pass


_Loader.yaml_implicit_resolvers = _yaml12_resolvers(yaml.SafeLoader, keep_yaml11=False)
_Dumper.yaml_implicit_resolvers = _yaml12_resolvers(yaml.SafeDumper, keep_yaml11=True)


def _float_ctor(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    # The int resolver runs first, so a plain integer never reaches this.
    text = loader.construct_scalar(node).replace("_", "").lower()
    if text.endswith(".inf"):
        return -math.inf if text.startswith("-") else math.inf
    if text == ".nan":
        return math.nan
    return float(text)


_Loader.add_constructor("tag:yaml.org,2002:float", _float_ctor)


def _unique_mapping(loader, node, deep=False):
    """A mapping whose keys are unique (YAML 1.2; PyYAML kept the last of a repeated key,
    dropping an earlier section silently)."""
    seen = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: construct_mapping merges it
            continue
        key = loader.construct_object(key_node, deep=deep)
        try:
            repeated = key in seen
        except TypeError:  # an unhashable key: construct_mapping's own error names it
            continue
        if repeated:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor("tag:yaml.org,2002:map", _unique_mapping)


def _parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader


def _dump_yaml(data: Any, *, flow: bool = False) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=flow, width=1 << 16)


# ------------------------------------------------------------------ type checking


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        names = [_type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in args else "")
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        return f"list of {_type_name(item)}"
    if hint is Any:
        return "any value"
    if isinstance(hint, type) and issubclass(hint, ConfigSection):
        return "a mapping of keys"
    return getattr(hint, "__name__", str(hint))


def _convert(value: Any, hint: Any, key: str) -> Any:
    """`value` checked against `hint` and converted where lossless (int -> float).

    Raises ConfigError "key must be <type>, got <value>".
    """

    def bad(extra: str = "") -> ConfigError:
        return ConfigError(f"{key} must be {_type_name(hint)}, got {value!r}{extra}")

    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if origin is Literal:
        choices = typing.get_args(hint)
        # `type(c) is type(value)` keeps True from matching a Literal[1].
        if any(value == c and type(value) is type(c) for c in choices):
            return value
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1) if isinstance(value, str) else []
        raise bad(f" (did you mean {close[0]!r}?)" if close else "")
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None:
            if type(None) in args:
                return None
            raise bad()
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, key)
            except ConfigError:
                pass
        raise bad()
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise bad()
        (item,) = typing.get_args(hint) or (Any,)
        return [_convert(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise bad()
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad()
    if hint is float:
        if isinstance(value, bool):
            raise bad()
        if isinstance(value, (int, float)) and math.isfinite(value):
            return float(value)
        raise bad(" (not a finite number)" if isinstance(value, float) else "")
    if hint is str:
        if isinstance(value, str):
            return value
        raise bad()
    if isinstance(hint, type) and issubclass(hint, ConfigSection):
        if isinstance(value, hint):
            return value
        raise bad()
    raise TypeError(f"config field {key}: unsupported type hint {hint!r}")  # a bug in this file


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _section_type(hint: Any) -> type[ConfigSection] | None:
    return hint if isinstance(hint, type) and issubclass(hint, ConfigSection) else None


class ConfigSection:
    """Base of every config dataclass: type-checks fields on construction.

    Subclasses are `@dataclass(kw_only=True)`; their `__post_init__` calls
    `super().__post_init__()` first, then does cross-field checks with `_check`.
    """

    _path: ClassVar[str] = ""
    """Dotted path of this section in the tree ("" for the root); set at import."""

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            setattr(self, f.name, _convert(getattr(self, f.name), hints[f.name], self._key(f.name)))

    @classmethod
    def _key(cls, name: str) -> str:
        """The dotted key of field `name`, as users write it ("train.steps")."""
        return f"{cls._path}.{name}" if cls._path else name

    @staticmethod
    def _check(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    def _check_min(self, name: str, low: float, *, strict: bool = False) -> None:
        """Field `name` >= low (or > low with strict=True)."""
        value = getattr(self, name)
        ok = value > low if strict else value >= low
        self._check(ok, f"{self._key(name)} must be {'>' if strict else '>='} {low}, got {value!r}")


# ------------------------------------------------------------------ the sections


@dataclass(kw_only=True)
class ArchConfig(ConfigSection):
    """Architecture of a randomly initialised policy: used when model.hf_path and
    model.mcore_ckpt are both null (SFT from scratch). Mirrors models.arch.ModelArch."""

    family: Literal["llama", "qwen2", "qwen3"] = "llama"
    """Decoder family: llama, qwen2 (QKV bias) or qwen3 (QK-norm)."""
    vocab_size: int = 100
    """Vocabulary size (at least the tokenizer's; 100 is the built-in tiny tokenizer)."""
    hidden_size: int = 128
    """Model width."""
    intermediate_size: int = 384
    """SwiGLU MLP width."""
    num_layers: int = 4
    """Decoder layers."""
    num_heads: int = 4
    """Attention (query) heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention); num_heads must be a multiple."""
    head_dim: int = 0
    """Per-head width; 0: hidden_size // num_heads."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    max_position_embeddings: int = 1024
    """Longest sequence the model is meant for (the rollout engine's default limit)."""
    tie_word_embeddings: bool = True
    """Share the input embedding with the output layer."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "max_position_embeddings"):
            self._check_min(name, 1)
        self._check_min("head_dim", 0)
        self._check_min("rope_theta", 0.0, strict=True)
        self._check_min("rms_norm_eps", 0.0, strict=True)
        self._check(self.num_heads % self.num_kv_heads == 0,
                    f"{self._key('num_heads')} ({self.num_heads}) must be a multiple of "
                    f"{self._key('num_kv_heads')} ({self.num_kv_heads})")
        self._check(self.head_dim > 0 or self.hidden_size % self.num_heads == 0,
                    f"{self._key('hidden_size')} ({self.hidden_size}) must be a multiple of "
                    f"{self._key('num_heads')} ({self.num_heads}) when {self._key('head_dim')} is 0")


@dataclass(kw_only=True)
class ModelConfig(ConfigSection):
    hf_path: str | None = None
    """Hugging Face model directory (config.json, *.safetensors, tokenizer); null: none."""
    mcore_ckpt: str | None = None
    """Megatron-Core checkpoint directory to load the actor from (wins over hf_path)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter/compute dtype of the actor and the rollout engine."""
    seq_length: int = 1024
    """Maximum tokens per sequence (prompt + response)."""
    arch: ArchConfig = field(default_factory=ArchConfig)
    """Architecture for random initialisation (only when hf_path and mcore_ckpt are null)."""
    use_te: bool | None = None
    """TransformerEngine layer spec for the actor: null = when importable on a GPU."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_min("seq_length", 1)
        for name in ("hf_path", "mcore_ckpt"):
            self._check(getattr(self, name) != "", f"{self._key(name)} must be a path or null, got ''")


@dataclass(kw_only=True)
class ParallelConfig(ConfigSection):
    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    dp: int = 1
    """Data-parallel size; tp * pp * dp must equal the world size (checked at launch)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("tp", "pp", "dp"):
            self._check_min(name, 1)


@dataclass(kw_only=True)
class OptimConfig(ConfigSection):
    lr: float = 1e-6
    """Peak learning rate (Adam)."""
    min_lr: float = 0.0
    """Learning rate at the end of the cosine or linear decay."""
    lr_warmup_steps: int = 0
    """Linear warm-up steps from 0 to lr."""
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """After the warm-up, decay from optim.lr to optim.min_lr at the last of train.steps
    updates (cosine, linear), or hold optim.lr (constant); SFT and RL alike."""
    weight_decay: float = 0.01
    """Decoupled weight decay (AdamW)."""
    adam_beta1: float = 0.9
    """Adam first-moment decay."""
    adam_beta2: float = 0.999
    """Adam second-moment decay."""
    eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables clipping."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_min("lr", 0.0, strict=True)
        self._check_min("min_lr", 0.0)
        self._check(
            self.min_lr <= self.lr,
            f"{self._key('min_lr')} ({self.min_lr}) must not exceed {self._key('lr')} ({self.lr})",
        )
        self._check_min("lr_warmup_steps", 0)
        self._check_min("weight_decay", 0.0)
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            self._check(0.0 <= value < 1.0, f"{self._key(name)} must be in [0, 1), got {value!r}")
        self._check_min("eps", 0.0, strict=True)
        self._check_min("clip_grad", 0.0)


@dataclass(kw_only=True)
class RolloutConfig(ConfigSection):
    max_new_tokens: int = 512
    """Maximum response tokens per sample."""
    temperature: float = 1.0
    """Sampling temperature; 0 means greedy. The actor's log-probs use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 disables it. `train` needs 1 (rl/loop.py check_sampling)."""
    top_k: int = 0
    """Sample among the k most likely tokens; 0 disables it. `train` needs 0 (as top_p)."""
    n_samples: int = 8
    """Samples per prompt (the GRPO group size), at least 2."""
    spec: Literal["off", "eagle", "ngram", "adaptive"] = "off"
    """Speculative decoding: off, always EAGLE drafter, always n-gram, or adaptive."""
    drafter: str | None = None
    """EAGLE drafter directory (spec=eagle): written by `python -m megatron_tlt.spec.train_drafter`."""
    spec_depth: int | str = DEFAULT_SPEC_DEPTH
    """Draft tokens per speculative step (tree depth); or by running batch size,
    "BATCH:DEPTH,..." (e.g. "1:6,8:4,32:3": 6 while one sequence runs, 4 up to 8, else 3:
    deep chains for the long tail, shallow ones for the full batch); a depth "DxK" drafts
    top-K trees for its entry (e.g. "1:6x2,8:4,32:4"). Default DEFAULT_SPEC_DEPTH: 6 at
    batch 1, else 4."""
    spec_topk: int = 1
    """Tree branching: 1 = chain; k > 1 = EAGLE-2 dynamic tree."""
    spec_num_verify: int | None = None
    """Tree nodes verified per step (the root counts); null: every drafted node."""
    spec_threshold: int | None = 32
    """Speculate only while the running batch is <= this (the long tail); null: always.
    Default 32: on one H200 (1.5B target trained 120 steps, T=0.9) EAGLE gave 1.25-1.32x at
    32 running sequences and 1.49x at 16 in session 16 (deferred drafts, draft- and
    verify-ahead; session 15's 0.99-1.01x at 32 had set 16); larger batches are not
    measured, and past 51 sequences a depth-4 verify outgrows the verify graphs' 256 rows
    and runs eagerly."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_min("max_new_tokens", 1)
        self._check_min("temperature", 0.0)
        from megatron_tlt.rollout.sampling import MIN_TEMPERATURE
        self._check(
            not 0.0 < self.temperature < MIN_TEMPERATURE,
            f"{self._key('temperature')} must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, "
            f"got {self.temperature!r}",
        )
        self._check(
            0.0 < self.top_p <= 1.0, f"{self._key('top_p')} must be in (0, 1], got {self.top_p!r}"
        )
        self._check_min("top_k", 0)
        # GRPO's group advantages (rl/advantages.py) need two samples a prompt: with one,
        # train failed only after its first rollout
        self._check(self.n_samples >= 2,
                    f"{self._key('n_samples')} must be >= 2 (GRPO normalises rewards within each "
                    f"prompt's group of samples), got {self.n_samples!r}")
        self._check_min("spec_topk", 1)
        self._check(self.spec_num_verify is None or self.spec_num_verify >= 2,
                    f"{self._key('spec_num_verify')} must be >= 2 (the root and at least one "
                    f"draft token) or null, got {self.spec_num_verify!r}")
        from megatron_tlt.spec.tree import Strategy, parse_strategy_schedule  # not the decoder
        try:
            schedule = parse_strategy_schedule(self.spec_depth)
            for _, d, k in schedule:  # each entry's own range checks
                Strategy(depth=d, topk=self.spec_topk if k is None else k,
                         num_verify_tokens=self.spec_num_verify)
        except ConfigError as e:
            raise ConfigError(f"{self._key('spec_depth')}: {e}") from None
        self._check(self.spec_threshold is None or self.spec_threshold >= 0,
                    f"{self._key('spec_threshold')} must be >= 0 or null, got {self.spec_threshold!r}")
        if schedule[0][0] is None and schedule[0][2] is None:  # one depth (an override's "5" too)
            object.__setattr__(self, "spec_depth", schedule[0][1])


@dataclass(kw_only=True)
class TrainConfig(ConfigSection):
    steps: int = 100
    """Optimizer steps (RL steps) to run."""
    global_batch_size: int = 64
    """Sequences (prompt x sample) per optimizer step, over all data-parallel ranks."""
    micro_batch_size: int = 1
    """Sequences per forward/backward pass on one data-parallel rank."""
    seed: int = 1234
    """Run seed; every random stream is derived from it."""
    out_dir: str = "runs/default"
    """Directory for config.yaml, checkpoints, metrics and logs."""
    save_interval: int = 50
    """Checkpoint every this many steps (and at the end); 0: only at the end."""
    keep_last: int = 2
    """Complete checkpoints to keep; 0 keeps all."""
    resume: str = "auto"
    """'auto': latest complete checkpoint in out_dir if any; 'none': start fresh; or a path."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_min("steps", 1)
        self._check_min("global_batch_size", 1)
        self._check_min("micro_batch_size", 1)
        self._check_min("seed", 0)
        self._check(self.out_dir != "", f"{self._key('out_dir')} must be a path, got ''")
        self._check_min("save_interval", 0)
        self._check_min("keep_last", 0)
        self._check(self.resume != "", f"{self._key('resume')} must be 'auto', 'none' or a path, got ''")


@dataclass(kw_only=True)
class LoggingConfig(ConfigSection):
    log_interval: int = 1
    """Write metrics (metrics.jsonl, TensorBoard) every this many steps and at the last;
    `sft` also at each validation."""
    tensorboard: bool = False
    """Also write TensorBoard event files under <train.out_dir>/tensorboard."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_min("log_interval", 1)


@dataclass(kw_only=True)
class DataConfig(ConfigSection):
    """Training data: built-in synthetic tasks, or a JSONL/Parquet file."""

    tasks: list[str] = field(default_factory=lambda: ["arith", "sort"])
    """Synthetic task families, cycled in this order (repeat a name to weight it)."""
    path: str | None = None
    """JSONL/Parquet dataset (instead of the synthetic tasks); null: synthetic."""
    val_path: str | None = None
    """Validation file; null: the last data.num_val records of data.path are held out."""
    prompt_field: str = "prompt"
    """Field (dotted path) of the prompt text in data files."""
    solution_field: str = "solution"
    """Field (dotted path) of the reference solution text (SFT target) in data files."""
    answer_field: str = "answer"
    """Field (dotted path) of the verifiable final answer in data files."""
    num_train: int = 20000
    """Synthetic training samples generated (train split); SFT cycles over them in epochs."""
    num_val: int = 256
    """Held-out samples for the validation loss (synthetic: the test split)."""
    tokenizer: str | None = None
    """'tiny', an HF tokenizer directory, or null: the model's own (hf_path / mcore_ckpt),
    else 'tiny'."""
    overlong: Literal["drop", "truncate"] = "drop"
    """SFT samples longer than model.seq_length + 1 tokens: drop them, or keep their start."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check(len(self.tasks) > 0 or self.path is not None,
                    f"{self._key('tasks')} must name at least one task when {self._key('path')} is null")
        self._check_min("num_train", 1)
        self._check_min("num_val", 1)
        for name in ("path", "val_path", "tokenizer"):
            self._check(getattr(self, name) != "", f"{self._key(name)} must be a value or null, got ''")
        self._check(self.val_path is None or self.path is not None,
                    f"{self._key('val_path')} ({self.val_path!r}) needs {self._key('path')}")


@dataclass(kw_only=True)
class SFTConfig(ConfigSection):
    """Supervised fine-tuning (`megatron-tlt sft`): packing, schedule, evaluation."""

    eval_interval: int = 50
    """Validation loss every this many steps (and at the end); 0: only at the end."""
    pack: bool = True
    """Several samples per row with a block-diagonal attention mask; false: one per row."""
    export_hf: bool = True
    """Write the final model in HF format to <train.out_dir>/hf (loadable by the rollout engine)."""
    exit_at_step: int = 0
    """Stop after this step (saving a checkpoint), e.g. to split a run into jobs; 0: never."""
    progress: bool = True
    """tqdm progress bar on rank 0."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_min("eval_interval", 0)
        self._check_min("exit_at_step", 0)


@dataclass(kw_only=True)
class RLConfig(ConfigSection):
    """GRPO / PPO-family settings of `megatron-tlt train`."""

    reward: str | None = None
    """A registered reward name or 'module:function'. Needed with data.path; with the
    built-in data.tasks it replaces each task's own reward (null: per task)."""
    std_normalize: bool = True
    """Divide group advantages by the group's std (GRPO); false: Dr.GRPO."""
    dapo_filter: bool = False
    """Drop groups whose rewards are all equal (they carry no gradient)."""
    clip_eps_low: float = 0.2
    """PPO clip: ratio >= 1 - clip_eps_low."""
    clip_eps_high: float = 0.2
    """PPO clip: ratio <= 1 + clip_eps_high (DAPO clip-higher when larger than clip_eps_low)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL penalty to the frozen initial policy; 0 disables (no reference model)."""
    loss_aggregation: Literal["token", "sequence"] = "token"
    """Mean over all response tokens of the step, or per response then over responses."""
    max_num_seqs: int = 256
    """Rollout engine: sequences decoded together."""
    num_kv_blocks: int = 4096
    """Rollout engine: KV-cache blocks of 16 tokens (per layer)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_min("clip_eps_low", 0.0)
        self._check_min("clip_eps_high", 0.0)
        self._check_min("kl_coef", 0.0)
        self._check_min("max_num_seqs", 1)
        self._check_min("num_kv_blocks", 1)


@dataclass(kw_only=True)
class Config(ConfigSection):
    """The whole run configuration: one field per section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Which model, in which dtype."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Megatron-Core parallel sizes."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling and speculative decoding for rollouts."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Steps, batch sizes, seed, output and checkpointing."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics logging."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training data (synthetic tasks or a file) and tokenizer."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised fine-tuning settings."""
    rl: RLConfig = field(default_factory=RLConfig)
    """GRPO / PPO-family settings of the RL loop."""

    def __post_init__(self) -> None:
        super().__post_init__()
        t, p = self.train, self.parallel
        per_step = t.micro_batch_size * p.dp
        self._check(
            t.global_batch_size % per_step == 0,
            f"train.global_batch_size ({t.global_batch_size}) must be a multiple of "
            f"train.micro_batch_size ({t.micro_batch_size}) x parallel.dp ({p.dp})",
        )
        self._check(
            self.rollout.max_new_tokens < self.model.seq_length,
            f"rollout.max_new_tokens ({self.rollout.max_new_tokens}) must be less than "
            f"model.seq_length ({self.model.seq_length}) to leave room for the prompt",
        )


def _assign_paths(cls: type[ConfigSection], prefix: str) -> None:
    for name, hint in _hints(cls).items():
        sub = _section_type(hint)
        if sub is None:
            continue
        path = f"{prefix}.{name}" if prefix else name
        assert "_path" not in sub.__dict__, f"{sub.__name__} is used twice in the config tree"
        sub._path = path
        _assign_paths(sub, path)


_assign_paths(Config, "")


# ----------------------------------------------------------------- load / save


def _known_keys(cls: type[ConfigSection]) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _all_keys(cls: type[ConfigSection], prefix: str = "") -> list[str]:
    """Every dotted key under `cls`, sections included."""
    out = []
    for name, hint in _hints(cls).items():
        if name not in _known_keys(cls):
            continue
        full = f"{prefix}.{name}" if prefix else name
        out.append(full)
        sub = _section_type(hint)
        if sub is not None:
            out.extend(_all_keys(sub, full))
    return out


def _suggest(cls: type[ConfigSection], key: str, path: str) -> str:
    """The hint in an unknown-key error: a close sibling, the same name elsewhere, or the list."""
    known = _known_keys(cls)
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.7)
    if close:
        return f"did you mean {(f'{path}.' if path else '') + close[0]!r}?"
    elsewhere = [k for k in _all_keys(Config) if k.rsplit(".", 1)[-1] == key]
    if elsewhere:
        return f"did you mean {elsewhere[0]!r}?"
    return f"known keys{' under ' + repr(path) if path else ''}: {', '.join(known)}"


def _build(cls: type[ConfigSection], data: Any, path: str) -> ConfigSection:
    """Section `cls` from a (possibly partial) mapping; unknown keys are errors."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'} must be a mapping of keys, got {data!r}")
    known = _known_keys(cls)
    hints = _hints(cls)
    kwargs = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in known:
            raise ConfigError(f"unknown config key {full!r} ({_suggest(cls, str(key), path)})")
        sub = _section_type(hints[key])
        kwargs[key] = _build(sub, value, full) if sub is not None and not isinstance(value, sub) else value
    return cls(**kwargs)


def _set_dotted(data: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        hint = _hint_at(".".join(parts[: i + 1]))
        if hint is not None and _section_type(hint) is None:
            raise ConfigError(f"cannot set {key!r}: {'.'.join(parts[: i + 1])!r} is a value, not a section")
        child = node.setdefault(part, {})
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {key!r}: {'.'.join(parts[: i + 1])!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _hint_at(key: str) -> Any:
    """The type hint of dotted `key`, or None if there is no such field."""
    cls: Any = Config
    hint = None
    for part in key.split("."):
        if _section_type(cls) is None or part not in _hints(cls):
            return None
        hint = cls = _hints(cls)[part]
    return hint


def _admits_str(hint: Any) -> bool:
    if hint is str:
        return True
    origin = typing.get_origin(hint)
    if origin is Literal:
        return any(isinstance(a, str) for a in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return any(_admits_str(a) for a in typing.get_args(hint))
    return False


def parse_override(text: str) -> tuple[str, Any]:
    """'rollout.temperature=0.7' -> ('rollout.temperature', 0.7).

    The value is YAML (ints, floats, bools, null, lists). For a field that takes a
    string, an unquoted value that YAML reads as something else (`out_dir=2024`,
    `resume=a:b`) is kept as the text written.
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override {text!r} must look like section.key=value")
    try:
        value = _parse_yaml(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        value = e
    hint = _hint_at(key)
    if value is not None and not isinstance(value, str) and hint is not None and _admits_str(hint):
        return key, raw.strip()
    if isinstance(value, yaml.YAMLError):
        raise ConfigError(f"override {text!r}: value is not valid YAML ({getattr(value, 'problem', value)})")
    return key, value


def _read_yaml_file(path: str) -> dict:
    if not os.path.isfile(path):
        what = "is a directory, not a file" if os.path.isdir(path) else "not found"
        raise ConfigError(f"config file {path!r} {what}")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path!r} is not UTF-8 text (byte {e.start + 1})") from None
    except OSError as e:
        raise ConfigError(f"config file {path!r} cannot be read ({e.strerror})") from None
    try:
        data = _parse_yaml(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
        problem = " ".join(str(getattr(e, "problem", None) or e).split())
        raise ConfigError(f"invalid YAML in config file {where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping of sections, got {type(data).__name__}")
    return data


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The Config from YAML file `path` (None: defaults), then `key=value` overrides."""
    data = _read_yaml_file(path) if path is not None else {}
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(data, key, value)
    return _build(Config, data, "")  # type: ignore[return-value]


def config_from_dict(data: dict) -> Config:
    """The Config from a nested mapping (as `config_to_dict` returns)."""
    return _build(Config, data, "")  # type: ignore[return-value]


def config_to_dict(cfg: ConfigSection) -> dict:
    """Nested plain dict of `cfg` (sections become dicts)."""
    return dataclasses.asdict(cfg)  # type: ignore[call-overload]


def save_config(cfg: ConfigSection, path: str) -> None:
    """Write `cfg` as YAML to `path` (atomically; parent directories are created)."""
    from megatron_tlt.atomic_io import write_text

    try:
        write_text(path, _dump_yaml(config_to_dict(cfg)))  # creates the directory
    except (FileExistsError, NotADirectoryError):
        parent = os.path.dirname(os.path.abspath(path))
        raise ConfigError(f"cannot write {path}: {parent} (or a directory above it) is a file, "
                          f"not a directory") from None


def format_config(cfg: ConfigSection) -> str:
    """Human-readable text of the resolved config, one aligned `key: value` per line."""
    lines: list[str] = []

    def scalar(value: Any) -> str:
        return _dump_yaml(value, flow=True).strip().removesuffix("...").strip()

    def walk(section: ConfigSection, indent: str) -> None:
        names = [f.name for f in dataclasses.fields(section)]
        width = max((len(n) for n in names), default=0)
        for name in names:
            value = getattr(section, name)
            if isinstance(value, ConfigSection):
                lines.append(f"{indent}{name}:")
                walk(value, indent + "  ")
            else:
                lines.append(f"{indent}{name + ':':<{width + 1}} {scalar(value)}")

    walk(cfg, "")
    return "\n".join(lines)
