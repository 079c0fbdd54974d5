import sys
import torch
sys.path.insert(0, "tests/gpu")
from test_engine_gpu import _rope_case, HEAD_DIM  # noqa
from megatron_tlt.rollout.gpu_model import rope_attention, qkv_rope_write_kv

torch.set_printoptions(precision=5, linewidth=200)
heads, kvh = 12, 2
qkv, pos, slots, cos, sin, kc, vc, meta, kw = _rope_case(
    [5, 17], heads=heads, kvh=kvh, page=16, dtype=torch.bfloat16, planes=1, bias=False,
    qk_norm=False, seed=1, q=1)
k1, v1 = kc.clone(), vc.clone()
qkv_rope_write_kv(qkv, pos, slots, cos, sin, k1, v1, **kw)
k2, v2 = kc.clone(), vc.clone()
rope_attention(qkv, pos, slots, cos, sin, k2, v2, scale=HEAD_DIM ** -0.5, num_splits=1, **meta, **kw)
D, H = HEAD_DIM, HEAD_DIM // 2
x = qkv[0].view(2, heads + 2 * kvh, D)[:, heads:heads + kvh].float()  # [T, KVH, D] bf16 values
c = cos[pos.long(), :H].to(torch.bfloat16).float()[:, None, :]
s = sin[pos.long(), :H].to(torch.bfloat16).float()[:, None, :]
bf = lambda t: t.to(torch.bfloat16).float()  # noqa
x1, x2 = x[..., :H], x[..., H:]
o1 = bf(bf(x1 * c) - bf(x2 * s))
o2 = bf(bf(x2 * c) + bf(x1 * s))
ref = torch.cat([o1, o2], -1)
fma1 = bf(torch.addcmul(-bf(x2 * s), x1, c))  # x1*c - b1 with the product not rounded
fma2 = bf(torch.addcmul(bf(x1 * s), x2, c))
fma = torch.cat([fma1, fma2], -1)
for t, sl in enumerate(slots.tolist()):
    blk, off = divmod(sl, 16)
    for name, k in (("separate", k1), ("fused", k2)):
        got = k[blk, off].float()
        print(t, name, "== torch ref:", int((got != ref[t]).sum()), "diff elems; == fma-variant:",
              int((got != fma[t]).sum()))
    # the other FMA form: a - x2*s unrounded
    alt1 = bf(torch.addcmul(bf(x1 * c)[t], -x2[t], s[t]))
    alt2 = bf(torch.addcmul(bf(x2 * c)[t], x1[t], s[t]))
    alt = torch.cat([alt1, alt2], -1)
    for name, k in (("separate", k1), ("fused", k2)):
        print(t, name, "== alt-fma:", int((k[blk, off].float() != alt).sum()))
