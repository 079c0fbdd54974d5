"""Under torchrun: randomize the engine, sync the actor into it, compare logits.

Writes JSON (from the last stage's TP rank 0): max abs diff before/after, data_ptr
stability, sync stats.
"""

import argparse
import json
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mcore", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from megatron.core import parallel_state as ps

    from megatron_tlt.models import mcore
    from megatron_tlt.models.actor import Actor
    from megatron_tlt.models.mcore_ckpt import read_meta
    from megatron_tlt.rollout import EngineWeights, RolloutEngine
    from megatron_tlt.weights.score import engine_logits
    from megatron_tlt.weights.sync import sync_actor_to_engine

    mcore.init_parallel(args.tp, args.pp, seed=3)
    meta = read_meta(args.mcore)
    arch = meta["arch"]
    actor = Actor(arch, tp=args.tp, pp=args.pp, dtype=meta["dtype"])
    actor.load(args.mcore)
    weights = EngineWeights.make_dummy(arch, seed=11 + dist.get_rank())  # random, differs from the actor
    engine = RolloutEngine(arch, weights, max_num_seqs=8, num_blocks=64, block_size=4)
    ptrs = [t.data_ptr() for t in weights.tensors()]
    tokens = torch.randint(0, arch.vocab_size, (3, 10), generator=torch.Generator().manual_seed(5))
    ref = actor.logits(tokens.to(actor.device))
    before = engine_logits(engine, tokens)
    # laziness: the TP gathers done by the time the first bucket arrives (a stage gathered
    # every layer before its first bucket: a full unsharded copy at TP > 1)
    from megatron_tlt.weights import sync as sync_mod
    calls, real_gather = [], sync_mod._tp_gather
    sync_mod._tp_gather = lambda n, p: (calls.append(n), real_gather(n, p))[1]
    buckets = sync_mod.iter_hf_buckets(actor)
    next(buckets)
    gathers_first = len(calls)
    for _ in buckets:
        pass
    sync_mod._tp_gather = real_gather
    stats = sync_actor_to_engine(actor, engine, version=7)
    after = engine_logits(engine, tokens)
    res = {"version": engine.policy_version, "ptrs_same": ptrs == [t.data_ptr() for t in weights.tensors()],
           "stats": stats, "gathers_first": gathers_first, "gathers_total": len(calls)}
    if ref is not None:
        ref = ref.float().cpu()
        res["before"] = (before - ref).abs().max().item()
        res["after"] = (after - ref).abs().max().item()
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(res, f)
    # every rank's engine must hold the same weights
    flat = torch.cat([t.reshape(-1).float() for t in weights.tensors()])
    total = flat.sum()
    gathered = [torch.zeros_like(total) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, total)
    assert all(torch.equal(g, gathered[0]) for g in gathered), "engines differ across ranks after sync"
    dist.barrier()
    mcore.destroy_parallel()


if __name__ == "__main__":
    main()
