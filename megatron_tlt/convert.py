"""Offline checkpoint conversion, HF safetensors <-> Megatron-Core dist-checkpoint.

Runs in ONE process whatever the target TP/PP: Megatron's dist-checkpoint stores
global tensors, so we build the unsharded (TP=1, PP=1) model once, stream the HF
tensors into it one at a time, and save; a later run loads that checkpoint at any
TP/PP that divides the model (checked here, up front, for the --tp/--pp asked for).
Peak memory is one model copy plus one HF tensor (mcore-to-hf: the model plus one
output shard of at most `shard_bytes`).

Weights are never re-cast: the Megatron model is built in the HF checkpoint's dtype,
so HF -> mcore -> HF is bit-exact.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import torch
from tqdm import tqdm

from megatron_tlt.errors import CheckpointError, ConfigError
from megatron_tlt.models import hf_mapping, mcore, mcore_ckpt
from megatron_tlt.models.arch import ModelArch

log = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _dtype_name(dt: torch.dtype, where: str) -> str:
    if dt not in _DTYPE_NAMES:
        raise CheckpointError(f"{where}: unsupported tensor dtype {dt}")
    return _DTYPE_NAMES[dt]


def _build_full_model(arch: ModelArch, dtype: str):
    mcore.init_parallel(1, 1)
    cfg = mcore.transformer_config(arch, tp=1, pp=1, dtype=dtype, perform_initialization=False)
    model = mcore.build_gpt_model(arch, cfg, use_te=False)
    model.requires_grad_(False)
    return model


def check_output_dir(out_dir: str, source: str) -> None:
    """CheckpointError unless a conversion may write `out_dir`: it must not be the source,
    inside it or contain it, and an existing one is replaced only when it is empty or a
    model directory (tlt_model.json or config.json in it); anything else would be deleted."""
    out, src = os.path.realpath(out_dir), os.path.realpath(source)
    if out == src or out.startswith(src + os.sep) or src.startswith(out + os.sep):
        raise CheckpointError(f"--out {out_dir} is, contains or lies inside the source {source}")
    if not os.path.exists(out):
        return
    if not os.path.isdir(out):
        raise CheckpointError(f"--out {out_dir} exists and is not a directory")
    names = os.listdir(out)
    if names and not {"tlt_model.json", "config.json"} & set(names):
        raise CheckpointError(f"--out {out_dir} is a non-empty directory that holds no model "
                              f"(no tlt_model.json or config.json); it would be replaced: give a "
                              f"new or empty directory")


def hf_to_mcore(hf_dir: str, out_dir: str, tp: int = 1, pp: int = 1, progress: bool = True) -> str:
    check_output_dir(out_dir, hf_dir)
    arch = ModelArch.from_hf_dir(hf_dir)
    arch.check_parallel(tp, pp)
    reader = mcore_ckpt.HFCheckpointReader(hf_dir)
    expected = hf_mapping.hf_shapes(arch)
    for name, shape in expected.items():  # every check before any work starts
        if name not in reader:
            raise CheckpointError(f"{hf_dir}: tensor {name} is missing from the checkpoint")
        if reader.shape(name) != shape:
            raise CheckpointError(f"{hf_dir}: tensor {name} has shape {reader.shape(name)}, "
                                  f"config.json implies {shape}")
    unknown = [k for k in reader.keys() if k not in expected and not k.endswith("rotary_emb.inv_freq")
               and not (arch.tie_word_embeddings and k == "lm_head.weight")]
    if unknown:
        raise CheckpointError(f"{hf_dir}: {len(unknown)} unexpected tensors for {arch.family}, e.g. {unknown[0]}")
    dtype = _dtype_name(reader.dtype(), hf_dir)

    def get_hf(name: str) -> torch.Tensor:
        t = reader.get(name)
        if tuple(t.shape) != expected[name]:
            raise CheckpointError(f"{hf_dir}: tensor {name} has shape {tuple(t.shape)}, "
                                  f"config.json implies {expected[name]}")
        if t.dtype != reader_dtype:
            raise CheckpointError(f"{hf_dir}: tensor {name} is {t.dtype}, others are {reader_dtype}")
        return t

    reader_dtype = mcore.torch_dtype(dtype)
    model = _build_full_model(arch, dtype)
    params = dict(mcore_ckpt.named_full_params(model))
    names = hf_mapping.mcore_names(arch)
    missing = [n for n in names if n not in params]
    if missing:  # our mapping and Megatron's module tree disagree: a bug, not user input
        raise RuntimeError(f"Megatron model lacks expected parameters: {missing[:3]}")
    for name in tqdm(names, desc="hf-to-mcore", unit="tensor", disable=not progress):
        src = hf_mapping.hf_to_mcore(arch, name, get_hf)
        params[name].copy_(src)
    mcore_ckpt.save_model(model, arch, out_dir, dtype=dtype, tp=tp, pp=pp, tokenizer_from=hf_dir,
                          extra_meta={"converted_from": os.path.abspath(hf_dir),
                                      "source_files": source_fingerprint(hf_dir)})
    log.info("wrote %s (%s, %d layers, loadable at tp=%d pp=%d)", out_dir, arch.family, arch.num_layers, tp, pp)
    return out_dir


_SOURCE_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json")


def source_fingerprint(hf_dir: str) -> dict[str, list[int]]:
    """{file name: [size, mtime_ns]} of the files a conversion reads (config.json and the
    weight files): rewriting the directory in place (an SFT rerun into the same
    directory) changes it."""
    out = {}
    for name in sorted(os.listdir(hf_dir)):
        if name == "config.json" or name.endswith(_SOURCE_SUFFIXES):
            st = os.stat(os.path.join(hf_dir, name))
            out[name] = [st.st_size, st.st_mtime_ns]
    return out


def is_conversion_of(mcore_dir: str, hf_dir: str) -> bool:
    """Whether `mcore_dir` is a complete `hf_to_mcore` conversion of `hf_dir` as it is now:
    a cached conversion of another model (model.hf_path changed) or of this directory
    before its files were rewritten (size or mtime of config.json or a weight file) must
    not be reused; neither must one written before conversions recorded their sources'
    fingerprint."""
    meta = os.path.join(mcore_dir, "tlt_model.json")
    if not os.path.isfile(meta):
        return False
    with open(meta) as f:
        m = json.load(f)
    if m.get("converted_from") != os.path.abspath(hf_dir) or not os.path.isdir(hf_dir):
        return False
    return m.get("source_files") == source_fingerprint(hf_dir)


def mcore_to_hf(mcore_dir: str, out_dir: str, shard_bytes: int = 5 * 2**30, progress: bool = True) -> str:
    from safetensors.torch import save_file

    meta = mcore_ckpt.read_meta(mcore_dir)
    check_output_dir(out_dir, mcore_dir)
    arch: ModelArch = meta["arch"]
    model = _build_full_model(arch, meta["dtype"])
    mcore_ckpt.load_model(model, arch, mcore_dir)
    params = dict(mcore_ckpt.named_full_params(model))

    partial = os.path.abspath(out_dir) + ".partial"
    if os.path.exists(partial):
        shutil.rmtree(partial)
    os.makedirs(partial)
    shard: dict[str, torch.Tensor] = {}
    shard_size = 0
    weight_map: dict[str, str] = {}
    files: list[str] = []

    def flush():
        nonlocal shard, shard_size
        if shard:
            fname = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, os.path.join(partial, fname), metadata={"format": "pt"})
            for k in shard:
                weight_map[k] = fname
            files.append(fname)
            shard, shard_size = {}, 0

    total = len(hf_mapping.hf_names(arch))
    out_dtype = mcore.torch_dtype(meta["dtype"])
    total_size = 0
    for name, t in tqdm(hf_mapping.mcore_to_hf(arch, params.__getitem__), total=total,
                        desc="mcore-to-hf", unit="tensor", disable=not progress):
        nbytes = t.numel() * t.element_size()
        total_size += t.numel() * out_dtype.itemsize
        if shard and shard_size + nbytes > shard_bytes:
            flush()
        # Megatron may keep some weights (norms) in fp32 inside a bf16 model; values that came
        # from the HF checkpoint are exactly representable in its dtype.
        shard[name] = t.detach().to("cpu", out_dtype).contiguous().clone()
        shard_size += nbytes
    flush()
    if len(files) == 1:
        os.replace(os.path.join(partial, files[0]), os.path.join(partial, "model.safetensors"))
    else:
        with open(os.path.join(partial, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total_size}, "weight_map": weight_map}, f, indent=2)
    # the source model's config.json (token ids, ...) under the architecture's fields
    cfg = {}
    source = os.path.join(mcore_dir, mcore_ckpt.SOURCE_CONFIG_FILE)
    if os.path.isfile(source):
        try:
            with open(source) as f:
                cfg = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{source}: unreadable ({e!r})") from None
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{source}: not a JSON object")
        try:  # another model's config (a tokenizer taken from elsewhere) would lend its fields
            mcore_ckpt.check_same_arch(arch, ModelArch.from_hf_config(cfg, source), source)
        except (ConfigError, CheckpointError, KeyError, TypeError, ValueError) as e:
            log.warning("%s describes another model (%s); config.json from the architecture alone",
                        source, e)
            cfg = {}
    cfg.update(arch.to_hf_config())
    cfg["torch_dtype"] = meta["dtype"]
    if "dtype" in cfg:  # newer transformers write dtype for torch_dtype
        cfg["dtype"] = meta["dtype"]
    with open(os.path.join(partial, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    mcore_ckpt.copy_tokenizer_files(mcore_dir, partial)
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.replace(partial, out_dir)
    log.info("wrote %s", out_dir)
    return out_dir
