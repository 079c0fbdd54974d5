"""Actor -> rollout engine weight sync: gather TP shards and PP stages, write in place.

The actor is a Megatron-Core model sharded TP x PP; the engine holds the whole model in
HF naming (fused QKV / gate_up inside it). One sync streams the model in buckets of one
transformer layer (plus the embedding, final norm and head): each PP stage gathers its
layer's TP shards, broadcasts the bucket to the other stages over the PP group, and every
rank maps it to HF names and copies it into its engine's existing tensors
(`EngineWeights.update_weights`): storage addresses never change, so captured CUDA
graphs stay valid, and no full extra copy of the model is ever held.

Collective over the whole model-parallel group: every TP and PP rank must call it
(engines may be `None` on ranks that host none).
"""

from __future__ import annotations

import time
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megatron_tlt.models import hf_mapping
from megatron_tlt.errors import TLTError
from megatron_tlt.models.arch import ModelArch

_NON_LAYER = ("embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight")


def _tp_gather(name: str, p: torch.Tensor) -> torch.Tensor:
    """The full (TP-unsharded) tensor, on every TP rank."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1 or not getattr(p, "tensor_model_parallel", False):
        return p.detach()
    dim = getattr(p, "partition_dim", 0)
    shards = [torch.empty_like(p) for _ in range(tp)]
    dist.all_gather(shards, p.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
    if name.endswith("mlp.linear_fc1.weight"):
        # Each rank holds [gate_r; up_r]: the global layout is [gate; up].
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=dim)


def _stage_buckets(model, arch: ModelArch) -> tuple[int, Iterator[tuple[str, dict[str, torch.Tensor]]]]:
    """(how many buckets this stage has, its buckets): the parameters, TP-gathered, keyed
    by global Megatron name. Lazy: each bucket's TP gather runs when it is asked for, so a
    sync holds one gathered layer at a time (a list gathered the whole stage first: a full
    unsharded copy of it at TP > 1). Every TP rank of the stage must consume it alike."""
    params = dict(model.named_parameters())
    decoder = getattr(model, "decoder", None)
    layers = list(decoder.layers) if decoder is not None else []
    emb = "embedding.word_embeddings.weight"
    has_emb = emb in params and bool(getattr(model, "pre_process", False))
    has_head = bool(getattr(model, "post_process", False))

    def gen():
        if has_emb:
            yield "embedding", {emb: _tp_gather(emb, params[emb])}
        for local_i, layer in enumerate(layers):
            gi = layer.layer_number - 1
            prefix = f"decoder.layers.{local_i}."
            bucket = {}
            for n, p in params.items():
                if n.startswith(prefix):
                    gname = f"decoder.layers.{gi}." + n[len(prefix):]
                    bucket[hf_mapping.local_name(gname)] = _tp_gather(n, p)
            yield f"layer{gi}", bucket
        if has_head:
            last = {"decoder.final_layernorm.weight": params["decoder.final_layernorm.weight"].detach()}
            if not arch.tie_word_embeddings:
                last["output_layer.weight"] = _tp_gather("output_layer.weight", params["output_layer.weight"])
            yield "head", last

    return int(has_emb) + len(layers) + int(has_head), gen()


def _broadcast_bucket(bucket: Optional[dict[str, torch.Tensor]], src_global: int, group, device) -> dict:
    """Broadcast a bucket (names, shapes, dtypes, then one flat buffer per dtype)."""
    meta = [None]
    if bucket is not None:
        meta = [[(n, tuple(t.shape), t.dtype) for n, t in bucket.items()]]
    dist.broadcast_object_list(meta, src=src_global, group=group)
    entries = meta[0]
    out: dict[str, torch.Tensor] = {}
    for dtype in sorted({e[2] for e in entries}, key=str):
        sel = [e for e in entries if e[2] == dtype]
        numel = sum(torch.Size(s).numel() for _, s, _ in sel)
        if bucket is not None:
            flat = torch.cat([bucket[n].reshape(-1) for n, _, _ in sel]).to(device)
        else:
            flat = torch.empty(numel, dtype=dtype, device=device)
        dist.broadcast(flat, src=src_global, group=group)
        off = 0
        for n, s, _ in sel:
            k = torch.Size(s).numel()
            out[n] = flat[off:off + k].view(s)
            off += k
    return out


def iter_hf_buckets(actor) -> Iterator[dict[str, torch.Tensor]]:
    """Collective: yields, on every rank, the whole model as HF-named buckets."""
    from megatron.core import parallel_state as ps

    arch: ModelArch = actor.arch
    model = actor.model.module if hasattr(actor.model, "module") else actor.model
    pp = ps.get_pipeline_model_parallel_world_size()
    n_mine, mine = _stage_buckets(model, arch)
    group = ps.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group) if pp > 1 else [dist.get_rank() if dist.is_initialized() else 0]
    my_stage = ps.get_pipeline_model_parallel_rank()
    device = actor.device
    for stage in range(pp):
        if pp > 1:
            # How many buckets this stage sends, so every rank loops the same number of times.
            count = [n_mine if stage == my_stage else 0]
            count_t = torch.tensor(count, device=device)
            dist.broadcast(count_t, src=ranks[stage], group=group)
            n_buckets = int(count_t.item())
        else:
            n_buckets = n_mine
        for _ in range(n_buckets):
            if pp > 1:
                local = next(mine)[1] if stage == my_stage else None
                bucket = _broadcast_bucket(local, ranks[stage], group, device)
            else:
                bucket = next(mine)[1]
            yield _to_hf(arch, bucket)


def _to_hf(arch: ModelArch, bucket: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    layers = sorted({int(n.split(".")[2]) for n in bucket if n.startswith("decoder.layers.")})
    for i in layers:
        out.update(hf_mapping.layer_mcore_to_hf(arch, i, bucket.__getitem__))
    v = arch.vocab_size
    if "embedding.word_embeddings.weight" in bucket:
        out["model.embed_tokens.weight"] = bucket["embedding.word_embeddings.weight"][:v]
    if "decoder.final_layernorm.weight" in bucket:
        out["model.norm.weight"] = bucket["decoder.final_layernorm.weight"]
    if "output_layer.weight" in bucket:
        out["lm_head.weight"] = bucket["output_layer.weight"][:v]
    return out


@torch.no_grad()
def sync_actor_to_engine(actor, engine, version: int) -> dict:
    """Copy the actor's weights into `engine` (None on ranks without one) in place.

    Returns {"seconds", "bytes", "gb_per_s", "tensors"}; the engine's policy version
    becomes `version` once every bucket is written. A version older than the engine's is
    refused before anything is written; a sync that leaves tensors out (a mapping bug)
    raises after writing the rest, and the error says the engine holds a partial update.
    """
    if engine is not None and (not isinstance(version, int) or isinstance(version, bool)
                               or version < engine.policy_version):
        raise TLTError(f"weight sync: policy version {version!r} is not an int at least the "
                       f"engine's current version {engine.policy_version}; nothing was written")
    t0 = time.perf_counter()
    nbytes = ntensors = 0
    seen: set[str] = set()
    for bucket in iter_hf_buckets(actor):
        if engine is not None:
            engine.update_weights(bucket, version=engine.policy_version)
        nbytes += sum(t.numel() * t.element_size() for t in bucket.values())
        ntensors += len(bucket)
        seen.update(bucket)
    if engine is not None:
        expected = set(hf_mapping.hf_names(actor.arch))
        if seen != expected:
            missing = sorted(expected - seen)[:3]
            raise RuntimeError(f"weight sync covered {len(seen)} of {len(expected)} tensors; missing e.g. "
                               f"{missing}: the engine now holds a partial update (policy version "
                               f"{engine.policy_version} kept); stop the run")
        engine.update_weights({}, version=version)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return {"seconds": dt, "bytes": nbytes, "gb_per_s": nbytes / dt / 1e9 if dt > 0 else 0.0, "tensors": ntensors}
