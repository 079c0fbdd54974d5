import sys
import torch
sys.path.insert(0, "tests/gpu")
from test_engine_gpu import _rope_case, HEAD_DIM  # noqa
from megatron_tlt.rollout.gpu_model import rope_attention, qkv_rope_write_kv
from megatron_tlt.rollout.triton_attention import paged_attention

torch.set_printoptions(precision=5, linewidth=200)
for (heads, kvh, planes, bias, qkn, q, ctx) in [(12, 2, 1, False, False, 1, [5, 17]),
                                                 (12, 2, 4, True, False, 1, [5, 17]),
                                                 (12, 2, 1, False, False, 5, [9, 40])]:
    qkv, pos, slots, cos, sin, kc, vc, meta, kw = _rope_case(
        ctx, heads=heads, kvh=kvh, page=16, dtype=torch.bfloat16, planes=planes, bias=bias,
        qk_norm=qkn, seed=1, q=q)
    for splits in (1, 8):
        k1, v1 = kc.clone(), vc.clone()
        qr = qkv_rope_write_kv(qkv, pos, slots, cos, sin, k1, v1, **kw)
        k2, v2 = kc.clone(), vc.clone()
        out = rope_attention(qkv, pos, slots, cos, sin, k2, v2, scale=HEAD_DIM ** -0.5,
                             num_splits=splits, **meta, **kw)
        torch.cuda.synchronize()
        print(f"== heads {heads}/{kvh} planes {planes} bias {bias} q {q} splits {splits}")
        for name, a, b in (("k", k1, k2), ("v", v1, v2)):
            nd = (a != b)
            idx = nd.nonzero()
            print(f" {name}: {int(nd.sum())} differing of {a.numel()}; max |diff| "
                  f"{(a.float() - b.float()).abs().max().item():.4g}")
            if len(idx):
                ent = sorted({(int(i[0]) * 16 + int(i[1]), int(i[2])) for i in idx})
                print("   (slot, head) differing:", ent[:12], " new slots:", slots.tolist())
                s, h = ent[0]
                blk, off = divmod(s, 16)
                print("   ref  ", a[blk, off, h, :6].float().tolist(), a[blk, off, h, 64:70].float().tolist())
                print("   fused", b[blk, off, h, :6].float().tolist(), b[blk, off, h, 64:70].float().tolist())
                print("   orig ", kc[blk, off, h, :6].float().tolist() if name == "k" else vc[blk, off, h, :6].float().tolist())
        tree = {} if q == 1 else dict(query_start=meta["query_start"], tree_mask=meta["tree_mask"], max_query_len=q)
        ref = paged_attention(qr, k1, v1, meta["block_tables"], meta["context_lens"],
                              scale=HEAD_DIM ** -0.5, num_splits=splits, **tree)
        print(" out equal:", torch.equal(out, ref), (out.float() - ref.float()).abs().max().item())
