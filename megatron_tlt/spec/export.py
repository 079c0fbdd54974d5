"""Drafter checkpoints in an HF-EAGLE-like layout, and `megatron-tlt export-drafter`.

A drafter directory holds:

- config.json: the target's HF config fields (model_type, hidden_size, heads, rope, ...)
  with num_hidden_layers = 1 and architectures = ["MegatronTLTEagleDrafter"], plus
  "eagle_config": {format_version, feature ("final": hidden states after the target's
  final norm), fuse_layers, draft_vocab_size, target_num_hidden_layers,
  target_vocab_size, fc_bias, pair_position ("token": pair t at RoPE position t + 1)};
- model.safetensors: ONLY drafter-owned tensors, HF names — fc.weight/fc.bias,
  fuse.weight (fusion), layers.0.{input_layernorm, self_attn.{q,k,v,o}_proj,
  self_attn.{q,k}_norm, post_attention_layernorm, mlp.{gate,up,down}_proj}.*, norm.weight —
  and, for a reduced vocabulary, EAGLE-3's `d2t` (int64 offsets: target id = draft id +
  d2t[draft id]) and `t2d` (bool [target vocab]: in the draft vocabulary).

The target's embedding and LM head are not stored: the drafter uses the target's own
(`load_drafter(path, target_arch, embed, lm_head)`), so a drafter only loads against a
target with the same vocabulary and hidden size (checked, naming the field).

Differences from the EAGLE release layouts, on purpose: no embed_tokens copy (shared
with the target, never stale), and layer 0 keeps its input_layernorm (the target
family's layer math unchanged).

A training checkpoint (`DrafterTrainer.save_checkpoint`) is this layout plus
optimizer.pt and trainer_state.json; `export-drafter --ckpt DIR --out DIR` copies the
drafter part out of it after validating every tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

import torch

from megatron_tlt.errors import CheckpointError
from megatron_tlt.models.arch import ModelArch
from megatron_tlt.spec.eagle import DrafterConfig, EagleDrafter

FORMAT_VERSION = 1
ARCHITECTURE = "MegatronTLTEagleDrafter"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def drafter_hf_config(drafter: EagleDrafter) -> dict:
    c = drafter.config
    cfg = c.arch.to_hf_config()
    cfg.update({
        "architectures": [ARCHITECTURE],
        "num_hidden_layers": 1,
        "eagle_config": {
            "format_version": FORMAT_VERSION,
            "feature": "final",
            "fuse_layers": list(c.fuse_layers),
            "draft_vocab_size": c.draft_vocab_size,
            "target_num_hidden_layers": c.arch.num_layers,
            "target_vocab_size": c.arch.vocab_size,
            "fc_bias": c.fc_bias,
            "pair_position": "token",
        },
    })
    return cfg


def drafter_tensors(drafter: EagleDrafter) -> dict[str, torch.Tensor]:
    """What model.safetensors holds: drafter-owned parameters (+ d2t/t2d)."""
    out = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    ids = drafter.draft_to_target
    if ids is not None:
        ids = ids.cpu()
        out["d2t"] = ids - torch.arange(ids.numel(), dtype=torch.int64)
        t2d = torch.zeros(drafter.arch.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        out["t2d"] = t2d
    return out


def save_drafter(drafter: EagleDrafter, out_dir: str) -> str:
    """Write config.json + model.safetensors into out_dir (created; files replaced
    atomically)."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, f".{WEIGHTS_FILE}.tmp")
    save_file(drafter_tensors(drafter), tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(out_dir, WEIGHTS_FILE))
    tmp = os.path.join(out_dir, f".{CONFIG_FILE}.tmp")
    with open(tmp, "w") as f:
        json.dump(drafter_hf_config(drafter), f, indent=2)
    os.replace(tmp, os.path.join(out_dir, CONFIG_FILE))
    return out_dir


def read_drafter_config(path: str) -> tuple[DrafterConfig, dict]:
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise CheckpointError(f"drafter directory not found: {path}")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"no {CONFIG_FILE} in drafter directory {path}")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    ec = cfg.get("eagle_config")
    if cfg.get("architectures") != [ARCHITECTURE] or not isinstance(ec, dict):
        raise CheckpointError(f"{cfg_path}: not a megatron_tlt drafter (architectures="
                              f"{cfg.get('architectures')!r}, expected [{ARCHITECTURE!r}] and eagle_config)")
    if ec.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{cfg_path}: eagle_config.format_version={ec.get('format_version')!r} "
                              f"is not supported (expected {FORMAT_VERSION})")
    if ec.get("feature") != "final" or ec.get("pair_position") != "token":
        raise CheckpointError(f"{cfg_path}: feature={ec.get('feature')!r} / pair_position="
                              f"{ec.get('pair_position')!r} not supported (expected 'final' / 'token')")
    target_cfg = dict(cfg, num_hidden_layers=ec.get("target_num_hidden_layers"))
    arch = ModelArch.from_hf_config(target_cfg, source=cfg_path)
    config = DrafterConfig(arch=arch, fuse_layers=tuple(ec.get("fuse_layers") or ()),
                           draft_vocab_size=ec.get("draft_vocab_size"),
                           fc_bias=bool(ec.get("fc_bias", True)))
    return config, cfg


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    wpath = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(wpath):
        raise CheckpointError(f"no {WEIGHTS_FILE} in drafter directory {path}")
    try:
        return load_file(wpath)
    except Exception as e:  # noqa: BLE001 - safetensors' own errors: truncated, corrupt header
        msg = str(e).splitlines()[0] if str(e) else ""
        raise CheckpointError(f"{wpath}: not a readable safetensors file ({type(e).__name__}: {msg})") from None


def check_target(config: DrafterConfig, target_arch: ModelArch, source: str) -> None:
    """CheckpointError unless the drafter was made for a target of this shape."""
    a, t = config.arch, target_arch
    for field in ("family", "vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                  "intermediate_size", "qkv_bias", "qk_norm"):
        if getattr(a, field) != getattr(t, field):
            raise CheckpointError(f"{source}: drafter was built for a target with {field}="
                                  f"{getattr(a, field)!r}, but the target has {getattr(t, field)!r}")
    for i in config.fuse_layers:
        if i >= t.num_layers:
            raise CheckpointError(f"{source}: fuse layer {i} >= target num_hidden_layers {t.num_layers}")


def load_drafter(path: str, target_arch: ModelArch, target_embed: torch.Tensor,
                 target_lm_head: torch.Tensor, *, dtype: torch.dtype | None = None,
                 device: str | torch.device | None = None) -> EagleDrafter:
    """Load a drafter directory against the target's embedding and LM head (shared)."""
    config, _ = read_drafter_config(path)
    check_target(config, target_arch, path)
    config = DrafterConfig(arch=target_arch, fuse_layers=config.fuse_layers,
                           draft_vocab_size=config.draft_vocab_size, fc_bias=config.fc_bias)
    return _build(path, config, target_embed, target_lm_head, dtype, device)


def _build(path, config, embed, lm_head, dtype, device) -> EagleDrafter:
    tensors = _read_tensors(path)
    ids = None
    if config.draft_vocab_size is not None:
        for name in ("d2t", "t2d"):
            if name not in tensors:
                raise CheckpointError(f"{path}: tensor {name!r} is missing (draft_vocab_size="
                                      f"{config.draft_vocab_size})")
        d2t, t2d = tensors.pop("d2t"), tensors.pop("t2d")
        if d2t.shape != (config.draft_vocab_size,) or t2d.shape != (config.arch.vocab_size,):
            raise CheckpointError(f"{path}: d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not "
                                  f"match draft_vocab_size {config.draft_vocab_size} / vocab "
                                  f"{config.arch.vocab_size}")
        ids = d2t.to(torch.int64) + torch.arange(config.draft_vocab_size)
        if not torch.equal(t2d.bool().nonzero().squeeze(1), ids.sort().values):
            raise CheckpointError(f"{path}: d2t and t2d disagree on the draft vocabulary")
    else:
        for name in ("d2t", "t2d"):
            if name in tensors:
                raise CheckpointError(f"{path}: tensor {name!r} present but config has no draft_vocab_size")
    drafter = EagleDrafter(config, embed, lm_head, ids)
    expected = drafter.state_dict()
    for name in tensors:
        if name not in expected:
            raise CheckpointError(f"{path}: tensor {name!r} is not part of the drafter "
                                  f"(target tensors are never stored in a drafter)")
    for name, ref in expected.items():
        if name not in tensors:
            raise CheckpointError(f"{path}: tensor {name!r} is missing")
        if tuple(tensors[name].shape) != tuple(ref.shape):
            raise CheckpointError(f"{path}: tensor {name!r} has shape {tuple(tensors[name].shape)}, "
                                  f"expected {tuple(ref.shape)}")
    drafter.load_state_dict(tensors)
    if dtype is not None or device is not None:
        drafter.to(device=device, dtype=dtype)
    return drafter


def validate_drafter_dir(path: str) -> DrafterConfig:
    """Check a drafter directory on its own (target tensors stand in as meta tensors)."""
    config, _ = read_drafter_config(path)
    a = config.arch
    meta = torch.empty(a.vocab_size, a.hidden_size, device="meta")
    _build(path, config, meta, meta, None, None)
    return config


def export_drafter(ckpt: str, out: str) -> str:
    """Copy the drafter of a training checkpoint (or a drafter directory) to `out`."""
    validate_drafter_dir(ckpt)
    if os.path.abspath(ckpt) == os.path.abspath(out):
        raise CheckpointError(f"--out {out} is the checkpoint directory itself")
    if os.path.exists(out) and not os.path.isdir(out):
        raise CheckpointError(f"--out {out} exists and is not a directory")
    if os.path.isdir(out) and os.listdir(out):
        try:
            read_drafter_config(out)
        except CheckpointError:
            raise CheckpointError(f"--out {out} is a non-empty directory that holds no drafter; "
                                  f"its {CONFIG_FILE} and {WEIGHTS_FILE} would be replaced: give a "
                                  f"new or empty directory, or an earlier export") from None
    parent = os.path.dirname(os.path.abspath(out)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would hide the export from other users
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            shutil.copy2(os.path.join(ckpt, name), os.path.join(tmp, name))
        validate_drafter_dir(tmp)
        if os.path.isdir(out):
            for name in (CONFIG_FILE, WEIGHTS_FILE):
                os.replace(os.path.join(tmp, name), os.path.join(out, name))
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(args: argparse.Namespace) -> int:
    out = export_drafter(args.ckpt, args.out)
    print(f"drafter exported to {out}")
    return 0
