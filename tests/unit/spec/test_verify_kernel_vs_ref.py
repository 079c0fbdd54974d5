"""The compiled CPU ops equal the PyTorch reference exactly (torch.equal on every output).

Grid: batch {1, 7, 64} x drafts per step (tree depth) {1, 2, 4, 8} x tree top-k {1, 2, 4}
x vocab {100, 8193, 151936}. Every combination at vocab 100; at the large vocabularies a
subset that still covers every value of each axis (and 64 x 151936) within the CPU time
budget. Each case runs greedy, one-hot rejection and general-q rejection.
tests/gpu/test_verify_cuda.py runs the same grid against the CUDA kernels.
"""

from __future__ import annotations

import pytest
import torch

from megatron_tlt.spec import _ops
from megatron_tlt.spec.verify import VerifyInputs, VerifyOutput, verify_inputs
from megatron_tlt.spec.verify_ref import max_tree_depth

SMALL = [(b, d, k, 100) for b in (1, 7, 64) for d in (1, 2, 4, 8) for k in (1, 2, 4)]
LARGE = [  # (batch, depth, topk, vocab)
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


@pytest.fixture(scope="module", autouse=True)
def _ops_loaded():
    _ops.require()


def check_output_invariants(x: VerifyInputs, out: VerifyOutput) -> None:
    """Structural facts every correct verifier output satisfies."""
    batch, _, vocab = x.target_probs.shape
    width = out.accept_index.shape[1]
    col = torch.arange(width)
    n = out.accept_length.unsqueeze(1)
    assert bool((out.accept_length >= 0).all()) and bool((out.accept_length < width).all())
    emitted = out.output_tokens.masked_select(col <= n)
    assert bool(((emitted >= 0) & (emitted < vocab)).all()), "an emitted token is outside [0, vocab)"
    assert bool((out.output_tokens.masked_select(col > n) == -1).all())
    assert bool((out.accept_index.masked_select(col > n) == -1).all())
    assert bool((out.accept_index[:, 0] == 0).all())
    path = out.accept_index.clamp(min=0)
    # Accepted nodes form a root path, and their tokens are the emitted ones.
    parent_ok = x.parents.gather(1, path[:, 1:]) == path[:, :-1]
    assert bool(parent_ok.masked_select(col[1:] <= n).all())
    tokens_ok = x.draft_tokens.gather(1, path[:, 1:]) == out.output_tokens[:, :-1]
    assert bool(tokens_ok.masked_select(col[1:] <= n).all())


def assert_same(a: VerifyOutput, b: VerifyOutput, label: str) -> None:
    for name in ("accept_index", "accept_length", "output_tokens"):
        x, y = getattr(a, name), getattr(b, name)
        rows = (x != y).reshape(x.shape[0], -1).any(1).nonzero().flatten().tolist()
        assert torch.equal(x, y), f"{label}: {name} differs in rows {rows}"


@pytest.mark.parametrize("batch,depth,topk,vocab", GRID, ids=[f"B{b}-D{d}-k{k}-V{v}" for b, d, k, v in GRID])
def test_cpu_kernel_equals_reference(batch, depth, topk, vocab):
    seed = batch * 1000 + depth * 100 + topk * 10 + vocab % 7
    accepted = 0
    for general_q in (False, True):
        x = VerifyInputs.make_dummy(batch, depth, topk, vocab, general_q=general_q, seed=seed)
        modes = [("greedy", True), ("rejection", False)] if not general_q else [("rejection-q", False)]
        for mode, greedy in modes:
            label = f"B{batch} D{depth} k{topk} V{vocab} {mode}"
            kernel = verify_inputs(x, greedy=greedy, impl="kernel")
            ref = verify_inputs(x, greedy=greedy, impl="reference")
            assert_same(kernel, ref, label)
            check_output_invariants(x, kernel)
            accepted += int(kernel.accept_length.sum())
            if depth > 1:  # a depth limit below the tree's depth truncates identically
                limit = max(0, max_tree_depth(x.parents, x.draft_tokens, vocab) - 1)
                kernel = verify_inputs(x, greedy=greedy, impl="kernel", max_depth=limit)
                ref = verify_inputs(x, greedy=greedy, impl="reference", max_depth=limit)
                assert_same(kernel, ref, label + f" max_depth={limit}")
        del x
    if batch > 1:
        assert accepted > 0, "the generated trees should get some drafts accepted"


def quantized_probs(shape, gen: torch.Generator) -> torch.Tensor:
    """Rows of multiples of 1/8 summing to 1, with zeros and ties."""
    counts = torch.zeros(shape)
    counts.scatter_add_(-1, torch.randint(shape[-1], (*shape[:-1], 8), generator=gen), torch.ones(*shape[:-1], 8))
    return counts / 8


@pytest.mark.parametrize("general_q", [False, True])
def test_cpu_kernel_equals_reference_on_exact_ties(general_q):
    """Quantised probabilities, coins and noise make acceptance tests and the race hit
    exact ties, zeros and duplicates: where a sloppy kernel would drift from the spec."""
    gen = torch.Generator().manual_seed(11)
    x = VerifyInputs.make_dummy(4000, 3, 2, 4, general_q=general_q, seed=11)
    x.target_probs = quantized_probs(x.target_probs.shape, gen)
    if general_q:
        x.draft_probs = quantized_probs(x.draft_probs.shape, gen)
    x.coins = torch.randint(8, x.coins.shape, generator=gen).float() / 8
    x.exp_noise = torch.randint(1, 4, x.exp_noise.shape, generator=gen).float() / 2
    for greedy in (True, False):
        kernel = verify_inputs(x, greedy=greedy, impl="kernel")
        ref = verify_inputs(x, greedy=greedy, impl="reference")
        assert_same(kernel, ref, f"ties greedy={greedy} general_q={general_q}")
        check_output_invariants(x, kernel)
