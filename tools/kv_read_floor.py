"""A floor for the decode attention's KV reads: the same grid (sequence, KV head), the same
paged key-tile loop, only a sum of the K and V tiles (no dot, no softmax).

    python tools/kv_read_floor.py SHAPE BATCH      (e.g. 7b 32; run on a GPU)

28 per-layer caches of bench rollout's 212-key contexts in scattered 16-key blocks, one
launch per layer in a CUDA graph (tools/attention_sweep.py's case and timer); prints us
per call and GB/s of KV for key tiles of 32 / 64 / 128, 4 / 8 warps, 1-3 pipelining
stages, and AHEAD 0: as the attention kernel (block-table entries then K/V per tile); 1:
the next tile's block-table entries loaded one iteration ahead; 2: the next tile's K/V
too (register double buffer). A benchmark: asserts nothing; `same` checks each variant's
sums against the first. Session 33 (H100): 8.4-11.2 us at the 7B shape, batch 32, against
16-19 us for the attention itself (benchmarks/results/gpu_2026-12-06_session33)."""
import os, sys, torch, triton, triton.language as tl
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # attention_sweep, from any cwd
from attention_sweep import case, time_graph
from megatron_tlt.bench import SHAPES
from megatron_tlt.models.arch import ModelArch


@triton.jit
def _pages(bt_ptr, b, stride_btb, n0, ctx, BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    n = n0 + tl.arange(0, BLOCK_N)
    return tl.load(bt_ptr + b * stride_btb + n // PAGE, mask=n < ctx, other=0).to(tl.int64)


@triton.jit
def _kv(k_ptr, v_ptr, page, n0, ctx, kvh, d, stride_kb, stride_ks, stride_kh,
        BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    n = n0 + tl.arange(0, BLOCK_N)
    ok = n < ctx
    off = (page * stride_kb + (n % PAGE) * stride_ks + kvh * stride_kh)[:, None] + d[None, :]
    return tl.load(k_ptr + off, mask=ok[:, None], other=0.0), tl.load(v_ptr + off, mask=ok[:, None], other=0.0)


@triton.jit
def _read_kernel(k_ptr, v_ptr, bt_ptr, ctx_ptr, out_ptr, stride_kb, stride_ks, stride_kh,
                 stride_btb, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr,
                 AHEAD: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    ctx = tl.load(ctx_ptr + b)
    d = tl.arange(0, D)
    acc = tl.zeros([BLOCK_N, D], tl.float32)
    if AHEAD == 0:
        for n0 in range(0, ctx, BLOCK_N):
            page = _pages(bt_ptr, b, stride_btb, n0, ctx, BLOCK_N, PAGE)
            k, v = _kv(k_ptr, v_ptr, page, n0, ctx, kvh, d, stride_kb, stride_ks, stride_kh, BLOCK_N, PAGE)
            acc += k.to(tl.float32) + v.to(tl.float32)
    elif AHEAD == 1:
        page = _pages(bt_ptr, b, stride_btb, 0, ctx, BLOCK_N, PAGE)
        for n0 in range(0, ctx, BLOCK_N):
            k, v = _kv(k_ptr, v_ptr, page, n0, ctx, kvh, d, stride_kb, stride_ks, stride_kh, BLOCK_N, PAGE)
            page = _pages(bt_ptr, b, stride_btb, n0 + BLOCK_N, ctx, BLOCK_N, PAGE)
            acc += k.to(tl.float32) + v.to(tl.float32)
    else:
        page = _pages(bt_ptr, b, stride_btb, 0, ctx, BLOCK_N, PAGE)
        k, v = _kv(k_ptr, v_ptr, page, 0, ctx, kvh, d, stride_kb, stride_ks, stride_kh, BLOCK_N, PAGE)
        page = _pages(bt_ptr, b, stride_btb, BLOCK_N, ctx, BLOCK_N, PAGE)
        for n0 in range(0, ctx, BLOCK_N):
            k2, v2 = _kv(k_ptr, v_ptr, page, n0 + BLOCK_N, ctx, kvh, d, stride_kb, stride_ks,
                         stride_kh, BLOCK_N, PAGE)
            page = _pages(bt_ptr, b, stride_btb, n0 + 2 * BLOCK_N, ctx, BLOCK_N, PAGE)
            acc += k.to(tl.float32) + v.to(tl.float32)
            k, v = k2, v2
    tl.store(out_ptr + (b * tl.num_programs(1) + kvh) * D + d, tl.sum(acc, 0))


def main():
    shape, batch = sys.argv[1], int(sys.argv[2])
    dev = torch.device("cuda")
    arch = ModelArch(**SHAPES[shape])
    qkv, pos, slots, cos, sin, bias, caches, meta = case(arch, batch, 212, 28, 16, 1, dev)
    kvh, hd = arch.num_kv_heads, arch.head_dim
    out = torch.empty(batch, kvh, hd, device=dev)
    kv_bytes = 2 * batch * 212 * kvh * hd * 2
    ref = None
    for ahead in (0, 1, 2):
        for bn in (32, 64, 128):
            for w in (4, 8):
                for st in (1, 2, 3):
                    if ahead and st > 1 and bn != 64:
                        continue
                    def run():
                        for k, v in caches:
                            _read_kernel[(batch, kvh)](k, v, meta["block_tables"], meta["context_lens"],
                                                       out, k.stride(0), k.stride(1), k.stride(2),
                                                       meta["block_tables"].stride(0), BLOCK_N=bn,
                                                       PAGE=16, D=hd, AHEAD=ahead, num_warps=w,
                                                       num_stages=st)
                    run()
                    torch.cuda.synchronize()
                    if ref is None:
                        ref = out.clone()
                    ok = torch.allclose(out, ref, rtol=1e-4, atol=1e-3)
                    us = time_graph(run, 15) / len(caches)
                    print(f"read-only {shape} B={batch} ahead={ahead} block_n={bn} warps={w} stages={st}: "
                          f"{us:6.2f} us/call {kv_bytes / us / 1e3:7.1f} GB/s same={ok}", flush=True)


if __name__ == "__main__":
    main()
