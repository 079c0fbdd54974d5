"""One decode-attention call per layer of 4 (bench rollout's 212-key contexts, the default
split count for a 312-key engine maximum) for a profiler to pick out:

    ncu --clock-control none --kernel-name regex:rope_attention --launch-skip 2 --launch-count 1 \
        --set full -o REPORT python tools/ncu_attention_case.py SHAPE BATCH PLANES

(session 33: 7b 32 2 and 1.5b 1 1 on an H100, benchmarks/results/gpu_2026-12-06_session33).
"""
import os, sys, torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # attention_sweep, from any cwd
from attention_sweep import case
from megatron_tlt.bench import SHAPES
from megatron_tlt.models.arch import ModelArch
from megatron_tlt.rollout import gpu_model, triton_attention
shape, batch, planes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dev = torch.device("cuda")
arch = ModelArch(**SHAPES[shape])
qkv, pos, slots, cos, sin, bias, caches, meta = case(arch, batch, 212, 4, 16, planes, dev)
group = arch.num_heads // arch.num_kv_heads
splits = triton_attention.splits_for(caches[0][0], batch, 312, group)
print("splits", splits, flush=True)
kw = dict(num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
          scale=arch.head_dim ** -0.5, bias=bias)
for k, v in caches:
    gpu_model.rope_attention(qkv, pos, slots, cos, sin, k, v, num_splits=splits, **meta, **kw)
torch.cuda.synchronize()
