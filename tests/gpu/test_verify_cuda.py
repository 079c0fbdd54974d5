"""CUDA verify kernels == the CPU reference, exactly; and they capture in CUDA graphs.

Runs only with CUDA (tests/conftest.py skips tests/gpu/ otherwise). The grid is the one
of tests/unit/spec/test_verify_kernel_vs_ref.py. A CUDA machine whose extension lacks the
CUDA kernels fails here (it does not skip): that is a build problem to fix.
"""

from __future__ import annotations

import pytest
import torch

from megatron_tlt.spec import _ops
from megatron_tlt.spec.verify import VerifyInputs, VerifyOutput, verify_inputs
from megatron_tlt.spec.verify_ref import max_tree_depth

SMALL = [(b, d, k, 100) for b in (1, 7, 64) for d in (1, 2, 4, 8) for k in (1, 2, 4)]
LARGE = [  # (batch, depth, topk, vocab), as in the CPU test
    (1, 8, 4, 8193),
    (7, 4, 2, 8193),
    (64, 2, 4, 8193),
    (64, 8, 1, 8193),
    (7, 1, 1, 8193),
    (1, 8, 4, 151936),
    (7, 4, 2, 151936),
    (64, 1, 4, 151936),
    (64, 2, 1, 151936),
]
GRID = SMALL + LARGE
FIELDS = ("accept_index", "accept_length", "output_tokens")


@pytest.fixture(scope="module", autouse=True)
def _cuda_ops():
    _ops.require()
    assert _ops.has_kernel("cuda"), (
        f"megatron_tlt ops were loaded from {_ops.source()} without CUDA kernels: rebuild with a CUDA "
        "torch and nvcc (pip install --no-build-isolation -e . ; or clear the JIT cache)"
    )


def assert_same(cuda_out: VerifyOutput, cpu_out: VerifyOutput, label: str) -> None:
    for name in FIELDS:
        got, want = getattr(cuda_out, name).cpu(), getattr(cpu_out, name)
        assert torch.equal(got, want), f"{label}: {name} differs from the CPU reference in rows " + str(
            (got != want).reshape(got.shape[0], -1).any(1).nonzero().flatten().tolist()
        )


@pytest.mark.parametrize("batch,depth,topk,vocab", GRID, ids=[f"B{b}-D{d}-k{k}-V{v}" for b, d, k, v in GRID])
@pytest.mark.parametrize("split", ["1", "0"], ids=["split", "one-block"])
def test_cuda_kernel_equals_reference(batch, depth, topk, vocab, split, monkeypatch):
    """Both rejection paths: the split path (chains raced over many blocks per row; rows
    that meet a branching node fall back to the one-block walk) and one block per row
    (MEGATRON_TLT_VERIFY_SPLIT=0)."""
    monkeypatch.setenv("MEGATRON_TLT_VERIFY_SPLIT", split)
    seed = batch * 1000 + depth * 100 + topk * 10 + vocab % 7
    for general_q in (False, True):
        x = VerifyInputs.make_dummy(batch, depth, topk, vocab, general_q=general_q, seed=seed)
        xc = x.to("cuda")
        modes = [("greedy", True), ("rejection", False)] if not general_q else [("rejection-q", False)]
        for mode, greedy in modes:
            label = f"B{batch} D{depth} k{topk} V{vocab} {mode} split={split}"
            ref = verify_inputs(x, greedy=greedy, impl="reference")
            assert_same(verify_inputs(xc, greedy=greedy, impl="kernel"), ref, label)
            assert_same(verify_inputs(x, greedy=greedy, impl="kernel"), ref, label + " (CPU kernel)")
            if depth > 1:
                limit = max(0, max_tree_depth(x.parents, x.draft_tokens, vocab) - 1)
                ref = verify_inputs(x, greedy=greedy, impl="reference", max_depth=limit)
                got = verify_inputs(xc, greedy=greedy, impl="kernel", max_depth=limit)
                assert_same(got, ref, label + f" max_depth={limit}")


def quantized_probs(shape, gen: torch.Generator) -> torch.Tensor:
    counts = torch.zeros(shape)
    counts.scatter_add_(-1, torch.randint(shape[-1], (*shape[:-1], 8), generator=gen), torch.ones(*shape[:-1], 8))
    return counts / 8


@pytest.mark.parametrize("topk", [1, 2])  # chains take the split path, trees fall back
@pytest.mark.parametrize("general_q", [False, True])
@pytest.mark.parametrize("vocab", [4, 1000, 5000])
def test_cuda_kernel_equals_reference_on_exact_ties(general_q, vocab, topk):
    """Quantized probabilities: exact ties in the races and all-zero residuals (q == p at a
    rejected node: the fallback race over the target row) happen often."""
    gen = torch.Generator().manual_seed(11)
    x = VerifyInputs.make_dummy(4000 if vocab <= 1000 else 500, 3, topk, vocab, general_q=general_q, seed=11)
    x.target_probs = quantized_probs(x.target_probs.shape, gen)
    if general_q:
        x.draft_probs = quantized_probs(x.draft_probs.shape, gen)
    x.coins = torch.randint(8, x.coins.shape, generator=gen).float() / 8
    x.exp_noise = torch.randint(1, 4, x.exp_noise.shape, generator=gen).float() / 2
    for greedy in (True, False):
        ref = verify_inputs(x, greedy=greedy, impl="reference")
        assert_same(verify_inputs(x.to("cuda"), greedy=greedy, impl="kernel"), ref, f"ties V{vocab} greedy={greedy}")


def test_cuda_kernel_is_deterministic():
    x = VerifyInputs.make_dummy(64, 4, 4, 151936, general_q=True, seed=2).to("cuda")
    first = verify_inputs(x, impl="kernel")
    for _ in range(3):
        again = verify_inputs(x, impl="kernel")
        assert all(torch.equal(getattr(first, f), getattr(again, f)) for f in FIELDS)


@pytest.mark.parametrize("mode", ["greedy", "one-hot", "general-q"])
def test_cuda_graph_capture_and_replay(mode):
    greedy, general_q = mode == "greedy", mode == "general-q"
    x = VerifyInputs.make_dummy(7, 4, 2, 8193, general_q=general_q, padding=True, seed=4).to("cuda")
    depth = max_tree_depth(x.parents, x.draft_tokens, 8193)
    out = VerifyOutput.empty(7, depth, "cuda")

    def step():
        verify_inputs(x, greedy=greedy, max_depth=depth, out=out, impl="kernel")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    gen = torch.Generator().manual_seed(5)
    for _ in range(3):  # new noise and target probabilities into the captured input buffers
        x.coins.copy_(torch.rand(x.coins.shape, generator=gen))
        x.exp_noise.copy_(torch.empty(x.exp_noise.shape).exponential_(generator=gen))
        x.target_probs.copy_(torch.softmax(torch.randn(x.target_probs.shape, generator=gen) * 4, -1))
        for name in FIELDS:
            getattr(out, name).fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        ref = verify_inputs(x.to("cpu"), greedy=greedy, max_depth=depth, impl="reference")
        assert_same(out, ref, f"graph replay ({mode})")
        eager = verify_inputs(x, greedy=greedy, max_depth=depth, impl="kernel")
        assert_same(eager, ref, f"eager after replay ({mode})")


def test_cuda_op_rejects_mixed_devices():
    x = VerifyInputs.make_dummy(2, 2, 2, 16, seed=1)
    out = VerifyOutput.empty(2, 2, "cuda")
    with pytest.raises(RuntimeError, match="parents .* is on cpu but target_probs is on cuda"):
        torch.ops.megatron_tlt.verify_tree_rejection(
            x.parents, x.draft_tokens.cuda(), x.target_probs.cuda(), x.draft_probs.cuda(), x.coins.cuda(),
            x.exp_noise.cuda(), out.accept_index, out.accept_length, out.output_tokens,
        )
