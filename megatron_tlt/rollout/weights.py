"""Engine weight layout, HF safetensors loading and in-place policy updates.

Engine layout (what `model.py` reads), per decoder layer:

    qkv_weight      [q_size + 2 * kv_size, hidden]   rows: q, then k, then v (HF q/k/v_proj)
    qkv_bias        [q_size + 2 * kv_size]           Qwen2 (and attention_bias=True models)
    o_weight        [hidden, q_size]
    o_bias          [hidden]                         only Llama/Qwen3 with attention_bias=True
    q_norm, k_norm  [head_dim]                       Qwen3
    gate_up_weight  [2 * intermediate, hidden]       rows: gate, then up (HF gate/up_proj)
    down_weight     [hidden, intermediate]
    input_norm, post_attn_norm [hidden]

plus `embed` [vocab, hidden], `final_norm` [hidden] and `lm_head` [vocab, hidden]
(the *same tensor* as `embed` when the embeddings are tied). The vocabulary is the
unpadded HF one: the engine never sees Megatron's padded rows.

Every HF tensor name maps to a *view* into this storage (`hf_views`), so loading and
`update_weights` both copy into the fused tensors in place: `data_ptr()` of every
engine tensor is fixed for the engine's lifetime, which is what lets captured CUDA
graphs survive policy updates (DESIGN.md, "In-place weight updates").
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterable, Mapping

import torch

from megatron_tlt.errors import CheckpointError, TLTError
from megatron_tlt.models.arch import ModelArch

_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"
# Non-parameter buffers some HF checkpoints carry; the engine recomputes them.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(eq=False, kw_only=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv_weight: torch.Tensor  # [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size]
    q_norm: torch.Tensor | None  # [head_dim]
    k_norm: torch.Tensor | None  # [head_dim]
    o_weight: torch.Tensor  # [hidden, q_size]
    o_bias: torch.Tensor | None  # [hidden]
    post_attn_norm: torch.Tensor  # [hidden]
    gate_up_weight: torch.Tensor  # [2 * intermediate, hidden]
    down_weight: torch.Tensor  # [hidden, intermediate]


class EngineWeights:
    """The inference model's parameters in engine layout, plus the policy version."""

    def __init__(self, arch: ModelArch, *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", version: int = 0):
        self.arch = arch
        self.dtype = dtype
        self.device = torch.device(device)
        self.version = version
        a = arch
        has_o_bias = a.qkv_bias and a.family != "qwen2"  # HF Llama/Qwen3 attention_bias biases o too

        def new(*shape):
            return torch.zeros(*shape, dtype=dtype, device=self.device)

        self.embed = new(a.vocab_size, a.hidden_size)  # [vocab, hidden]
        self.final_norm = new(a.hidden_size)  # [hidden]
        self.lm_head = self.embed if a.tie_word_embeddings else new(a.vocab_size, a.hidden_size)
        qkv_rows = a.q_size + 2 * a.kv_size
        self.layers = [
            LayerWeights(
                input_norm=new(a.hidden_size),
                qkv_weight=new(qkv_rows, a.hidden_size),
                qkv_bias=new(qkv_rows) if a.qkv_bias else None,
                q_norm=new(a.head_dim) if a.qk_norm else None,
                k_norm=new(a.head_dim) if a.qk_norm else None,
                o_weight=new(a.hidden_size, a.q_size),
                o_bias=new(a.hidden_size) if has_o_bias else None,
                post_attn_norm=new(a.hidden_size),
                gate_up_weight=new(2 * a.intermediate_size, a.hidden_size),
                down_weight=new(a.hidden_size, a.intermediate_size),
            )
            for _ in range(a.num_layers)
        ]
        self._views = self._build_views()

    # ---- naming ---------------------------------------------------------------------

    def _build_views(self) -> dict[str, torch.Tensor]:
        a = self.arch
        q, kv, inter = a.q_size, a.kv_size, a.intermediate_size
        views: dict[str, torch.Tensor] = {"model.embed_tokens.weight": self.embed,
                                          "model.norm.weight": self.final_norm,
                                          "lm_head.weight": self.lm_head}
        for i, lw in enumerate(self.layers):
            p = f"model.layers.{i}."
            views[p + "input_layernorm.weight"] = lw.input_norm
            views[p + "post_attention_layernorm.weight"] = lw.post_attn_norm
            for name, (lo, hi) in (("q_proj", (0, q)), ("k_proj", (q, q + kv)),
                                   ("v_proj", (q + kv, q + 2 * kv))):
                views[p + f"self_attn.{name}.weight"] = lw.qkv_weight[lo:hi]
                if lw.qkv_bias is not None:
                    views[p + f"self_attn.{name}.bias"] = lw.qkv_bias[lo:hi]
            views[p + "self_attn.o_proj.weight"] = lw.o_weight
            if lw.o_bias is not None:
                views[p + "self_attn.o_proj.bias"] = lw.o_bias
            if lw.q_norm is not None:
                views[p + "self_attn.q_norm.weight"] = lw.q_norm
                views[p + "self_attn.k_norm.weight"] = lw.k_norm
            views[p + "mlp.gate_proj.weight"] = lw.gate_up_weight[:inter]
            views[p + "mlp.up_proj.weight"] = lw.gate_up_weight[inter:]
            views[p + "mlp.down_proj.weight"] = lw.down_weight
        return views

    def hf_views(self) -> dict[str, torch.Tensor]:
        """HF parameter name -> view into engine storage (writing the view writes the engine)."""
        return dict(self._views)

    def required_hf_names(self) -> list[str]:
        """HF names a checkpoint must provide (lm_head is optional when tied)."""
        return [n for n in self._views if not (n == "lm_head.weight" and self.arch.tie_word_embeddings)]

    def tensors(self) -> list[torch.Tensor]:
        """Every distinct storage tensor the engine owns (for data_ptr checks, memory totals)."""
        out = [self.embed, self.final_norm]
        if self.lm_head is not self.embed:
            out.append(self.lm_head)
        for lw in self.layers:
            # Not dataclasses.astuple: it deep-copies the tensors.
            out.extend(t for f in dataclasses.fields(lw) if (t := getattr(lw, f.name)) is not None)
        return out

    # ---- in-place updates --------------------------------------------------------------

    @torch.no_grad()
    def update_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy `named_tensors` (HF naming, any dtype/device) into the engine's storage.

        Partial updates are allowed (a resharder may stream buckets, each call with the same
        version). Names, types (real floating-point torch tensors with data), shapes and the
        version are checked before anything is written, so a bad call changes nothing.
        `version` (an int) must not go backwards; it becomes `self.version`.
        """
        if not isinstance(version, int) or isinstance(version, bool):
            raise TLTError(f"update_weights: policy version must be an int, got {version!r}")
        if version < self.version:
            raise TLTError(f"update_weights: policy version {version!r} is older than the "
                           f"engine's current version {self.version}")
        tied_head = None
        for name, t in named_tensors.items():
            view = self._views.get(name)
            if name == "lm_head.weight" and self.arch.tie_word_embeddings:
                tied_head = t  # checked below, against the embedding this call leaves
            if view is None:
                raise TLTError(f"update_weights: unknown tensor name {name!r} for a "
                               f"{self.arch.family} model with {self.arch.num_layers} layers")
            if not isinstance(t, torch.Tensor) or t.is_meta or not t.dtype.is_floating_point:
                what = (f"a {type(t).__name__}" if not isinstance(t, torch.Tensor) else
                        "a meta tensor (no data)" if t.is_meta else f"a {t.dtype} tensor")
                raise TLTError(f"update_weights: tensor {name!r} is {what}; expected a real "
                               f"floating-point torch.Tensor")
            if tuple(t.shape) != tuple(view.shape):
                raise TLTError(f"update_weights: tensor {name!r} has shape {tuple(t.shape)}, "
                               f"the engine expects {tuple(view.shape)}")
        if tied_head is not None:
            # Tied: the head is the embedding. HF state_dicts and hf_views() list both names
            # for one tensor, accepted; a head that differs would overwrite the embedding
            # (load_hf drops it), and with both names the dict's order would pick the winner.
            embed = named_tensors.get("model.embed_tokens.weight", self.embed)
            same = tied_head is embed or torch.equal(
                tied_head.to(self.embed.device, self.embed.dtype), embed.to(self.embed.device, self.embed.dtype))
            if not same:
                raise TLTError("update_weights: 'lm_head.weight' differs from the embedding of a model "
                               "with tied embeddings; the head is 'model.embed_tokens.weight'")
        for name, t in named_tensors.items():
            if name == "lm_head.weight" and tied_head is not None:
                continue  # the embedding's copy writes it
            self._views[name].copy_(t)
        self.version = version

    # ---- factories ------------------------------------------------------------------

    @classmethod
    def make_dummy(cls, arch: ModelArch, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu") -> "EngineWeights":
        """Random weights (norms near 1) for tests and idle ranks; no checkpoint needed."""
        w = cls(arch, dtype=dtype, device=device)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, view in w._views.items():
                if name == "lm_head.weight" and arch.tie_word_embeddings:
                    continue
                if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                    data = 1.0 + 0.1 * torch.randn(view.shape, generator=g)
                else:
                    data = 0.05 * torch.randn(view.shape, generator=g)
                view.copy_(data)
        return w


def _weight_files(model_dir: str) -> dict[str, str]:
    """HF tensor name -> safetensors file path, for single-file or sharded checkpoints."""
    if not os.path.isdir(model_dir):
        raise CheckpointError(f"model directory not found: {model_dir}")
    index_path = os.path.join(model_dir, _INDEX_FILE)
    single = os.path.join(model_dir, _SINGLE_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: not a valid safetensors index ({e})") from None
        out = {}
        for name, fname in weight_map.items():
            path = os.path.join(model_dir, fname)
            if not os.path.isfile(path):
                raise CheckpointError(f"{index_path}: shard {fname!r} (holding {name!r}) is missing")
            out[name] = path
        return out
    if os.path.isfile(single):
        from safetensors import safe_open
        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    raise CheckpointError(f"no {_SINGLE_FILE} or {_INDEX_FILE} in {model_dir} "
                          f"(only safetensors checkpoints are supported)")


def _group_by_file(names: Iterable[str], files: dict[str, str]) -> dict[str, list[str]]:
    by_file: dict[str, list[str]] = {}
    for n in names:
        by_file.setdefault(files[n], []).append(n)
    return by_file


ENGINE_DTYPES = ("float32", "bfloat16", "float16")
"""Dtype names the engine runs (mapped by models.mcore.torch_dtype)."""


def resolve_device(spec: str | None, flag: str = "--device") -> str:
    """A --device value: None or "auto" -> "cuda" when available, else "cpu"; "cpu",
    "cuda" or "cuda:i" checked against this machine, so a missing GPU is a one-line error
    before a model is read (torch raised an AssertionError on the first tensor moved)."""
    if spec is None or spec == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError):  # e.g. "gpu": torch's message lists every device type
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise TLTError(f"{flag} {str(spec)!r}: expected auto, cpu or cuda[:i]")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise TLTError(f"{flag} {str(spec)!r}: CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise TLTError(f"{flag} {str(spec)!r}: this machine has {torch.cuda.device_count()} "
                           f"CUDA device(s)")
    return str(device)


def engine_dtype(arch: ModelArch, device: str | torch.device, name: str = "auto") -> torch.dtype:
    """The dtype to run a checkpoint in: `name`, or for "auto" float32 on the CPU (the
    exact reference path of the tests) and the checkpoint's own dtype (config.json
    torch_dtype; bfloat16 when it names none the engine runs) on an accelerator."""
    from megatron_tlt.models.mcore import torch_dtype

    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):  # e.g. "gpu": torch's message lists every device type
        raise TLTError(f"--device {str(device)!r}: expected auto, cpu or cuda[:i]") from None
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        name = arch.torch_dtype if arch.torch_dtype in ENGINE_DTYPES else "bfloat16"
    if name not in ENGINE_DTYPES:
        raise TLTError(f"dtype must be auto or one of {sorted(ENGINE_DTYPES)}, got {name!r}")
    return torch_dtype(name)


@torch.no_grad()
def load_hf(model_dir: str, *, dtype: torch.dtype = torch.float32,
            device: str | torch.device = "cpu") -> tuple[ModelArch, EngineWeights]:
    """Read config.json and safetensors weights from an HF directory into engine layout,
    cast to `dtype` (float32 unless asked: pick it with `engine_dtype`).

    Raises CheckpointError naming the tensor for a missing tensor, a tensor the engine
    does not know (it would otherwise be silently dropped) or a shape mismatch.
    """
    from safetensors import safe_open

    arch = ModelArch.from_hf_dir(model_dir)
    weights = EngineWeights(arch, dtype=dtype, device=device)
    files = _weight_files(model_dir)
    views = weights.hf_views()
    for name in files:
        if name not in views and not name.endswith(_IGNORED_SUFFIXES):
            raise CheckpointError(f"{model_dir}: tensor {name!r} is not part of a {arch.family} "
                                  f"model as the engine understands it; refusing to drop it")
    missing = [n for n in weights.required_hf_names() if n not in files]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{model_dir}: tensor {missing[0]!r} is missing{more}")
    wanted = [n for n in files if n in views]
    if arch.tie_word_embeddings:
        wanted = [n for n in wanted if n != "lm_head.weight"]  # tied: the embedding is the head
    for path, names in _group_by_file(wanted, files).items():
        with safe_open(path, framework="pt") as f:
            for name in names:
                t = f.get_tensor(name)
                view = views[name]
                if tuple(t.shape) != tuple(view.shape):
                    raise CheckpointError(
                        f"{path}: tensor {name!r} has shape {tuple(t.shape)}, expected "
                        f"{tuple(view.shape)} from config.json")
                view.copy_(t)
    return arch, weights
