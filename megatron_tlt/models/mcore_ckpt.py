"""Megatron-Core distributed checkpoints of the actor, and the HF safetensors reader.

A model checkpoint directory holds Megatron's dist-checkpoint (torch_dist format,
loadable at any TP/PP: the shards describe global tensors) plus `tlt_model.json`
(the ModelArch, dtype and the TP/PP it was written at) and, when known, the
tokenizer files. It is written to `<dir>.partial` and renamed into place after the
metadata, so a directory with `tlt_model.json` is always complete and a crash never
leaves something that loads.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Iterable, Optional

import torch

from megatron_tlt.errors import CheckpointError
from megatron_tlt.models.arch import ModelArch

log = logging.getLogger(__name__)

META_FILE = "tlt_model.json"
FORMAT = "megatron_tlt.mcore/1"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "generation_config.json",
                   "added_tokens.json", "chat_template.jinja")


# ---- HF safetensors ----------------------------------------------------------------

class HFCheckpointReader:
    """Lazy access to the tensors of an HF checkpoint (single file or sharded + index).

    Tensors are read one at a time (`safe_open`), so conversion holds at most one HF
    tensor beside the model.
    """

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = path
        if not os.path.isdir(path):
            raise CheckpointError(f"HF checkpoint directory not found: {path}")
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{index}: corrupt safetensors index ({e!r})") from None
            if not isinstance(weight_map, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
                raise CheckpointError(f"{index}: corrupt safetensors index (weight_map must map "
                                      f"tensor names to file names)")
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(single):
            files, weight_map = ["model.safetensors"], None
        else:
            if any(f.endswith((".bin", ".pt")) for f in os.listdir(path)):
                raise CheckpointError(f"{path}: only safetensors checkpoints are supported "
                                      f"(found .bin/.pt files; re-save with safe_serialization=True)")
            raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")
        self._handles = {}
        self._where: dict[str, str] = {}
        for fname in files:
            fpath = os.path.join(path, fname)
            if not os.path.isfile(fpath):
                raise CheckpointError(f"{path}: shard {fname} listed in the index is missing")
            try:
                h = safe_open(fpath, framework="pt", device="cpu")
            except Exception as e:  # SafetensorError, OSError: header unreadable
                raise CheckpointError(f"{fpath}: corrupt safetensors file ({e})") from None
            self._handles[fname] = h
            for key in h.keys():
                self._where[key] = fname
        if weight_map is not None:
            for key, fname in weight_map.items():
                if key not in self._where:
                    raise CheckpointError(f"{path}: tensor {key} listed in the index is not in {fname}")

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise CheckpointError(f"{self.path}: tensor {name} is missing from the checkpoint")
        fname = self._where[name]
        try:
            return self._handles[fname].get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{os.path.join(self.path, fname)}: cannot read tensor {name} ({e})") from None

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape from the safetensors header, without reading the tensor."""
        if name not in self._where:
            raise CheckpointError(f"{self.path}: tensor {name} is missing from the checkpoint")
        return tuple(self._handles[self._where[name]].get_slice(name).get_shape())

    def dtype(self) -> torch.dtype:
        first = next(iter(self._where))
        return self.get(first).dtype


# ---- metadata ----------------------------------------------------------------------

def write_meta(out_dir: str, arch: ModelArch, dtype: str, tp: int, pp: int, extra: Optional[dict] = None):
    meta = {"format": FORMAT, "arch": arch.to_dict(), "dtype": dtype, "tp": tp, "pp": pp}
    if extra:
        meta.update(extra)
    with open(os.path.join(out_dir, META_FILE), "w") as f:
        json.dump(meta, f, indent=2)


def read_meta(ckpt_dir: str) -> dict:
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"Megatron checkpoint directory not found: {ckpt_dir}")
    path = os.path.join(ckpt_dir, META_FILE)
    if not os.path.isfile(path):
        if os.path.isfile(os.path.join(ckpt_dir, "model", META_FILE)):
            raise CheckpointError(f"{ckpt_dir} is a training checkpoint; its model is "
                                  f"{os.path.join(ckpt_dir, 'model')}")
        hint = " (a partial write? it lacks the metadata written last)" if os.listdir(ckpt_dir) else ""
        raise CheckpointError(f"{ckpt_dir}: not a megatron_tlt model checkpoint, {META_FILE} missing{hint}")
    try:
        with open(path) as f:
            meta = json.load(f)
        arch = ModelArch.from_dict(meta["arch"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: corrupt metadata ({e!r})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: unknown checkpoint format {meta.get('format')!r} (expected {FORMAT})")
    meta["arch"] = arch
    return meta


def check_same_arch(expected: ModelArch, found: ModelArch, where: str) -> None:
    for field, a in expected.to_dict().items():
        b = getattr(found, field)
        if a != b and field != "torch_dtype":
            raise CheckpointError(f"{where}: checkpoint has {field}={b!r} but the model has {field}={a!r}")


def copy_tokenizer_files(src: str, dst: str) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        p = os.path.join(src, name)
        if os.path.isfile(p):
            shutil.copy2(p, os.path.join(dst, name))
            copied.append(name)
    return copied


SOURCE_CONFIG_FILE = "hf_config.json"
"""The HF config.json a model checkpoint came from, kept beside it: mcore-to-hf writes its
fields the architecture does not define (bos/eos/pad token ids, initializer_range, ...)."""


def copy_source_config(src: str, dst: str) -> bool:
    """Keep the HF config of `src` (an HF directory's config.json, or the SOURCE_CONFIG_FILE
    of a model checkpoint) in `dst` as SOURCE_CONFIG_FILE; whether there was one."""
    for name in ("config.json", SOURCE_CONFIG_FILE):
        p = os.path.join(src, name)
        if os.path.isfile(p):
            shutil.copy2(p, os.path.join(dst, SOURCE_CONFIG_FILE))
            return True
    return False


# ---- save / load (collective over all ranks) ----------------------------------------

def _is_rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier():
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def save_model(model, arch: ModelArch, out_dir: str, *, dtype: str, tp: int, pp: int,
               tokenizer_from: Optional[str] = None, extra_meta: Optional[dict] = None) -> None:
    """Collective: every rank passes its model chunk; written atomically into `out_dir`."""
    from megatron.core import dist_checkpointing

    out_dir = os.path.abspath(out_dir)
    partial = out_dir + ".partial"
    if _is_rank0():
        if os.path.exists(partial):
            shutil.rmtree(partial)
        os.makedirs(partial)
    _barrier()
    dist_checkpointing.save(model.sharded_state_dict(), partial)
    _barrier()
    if _is_rank0():
        if tokenizer_from:
            copy_tokenizer_files(tokenizer_from, partial)
            copy_source_config(tokenizer_from, partial)
        write_meta(partial, arch, dtype, tp, pp, extra_meta)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(partial, out_dir)
    _barrier()


def load_model(model, arch: ModelArch, ckpt_dir: str) -> dict:
    """Collective: load a checkpoint written at any TP/PP into this rank's model chunk."""
    from megatron.core import dist_checkpointing

    meta = read_meta(ckpt_dir)
    check_same_arch(arch, meta["arch"], ckpt_dir)
    try:
        state = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)
    except Exception as e:
        raise CheckpointError(f"{ckpt_dir}: cannot load Megatron checkpoint ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from e
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise CheckpointError(f"{ckpt_dir}: checkpoint lacks {len(missing)} tensors, e.g. {missing[0]}")
    return meta


def unwrap(model):
    """The GPTModel inside DDP/Float16 wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def named_full_params(model) -> Iterable[tuple[str, torch.Tensor]]:
    for name, t in unwrap(model).state_dict().items():
        if not name.endswith("_extra_state") and isinstance(t, torch.Tensor):
            yield name, t
