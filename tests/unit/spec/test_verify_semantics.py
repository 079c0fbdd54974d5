"""Verification semantics on hand-made trees (kernel and reference), validation errors,
the dispatch/fallback policy and torch.library integration (opcheck, torch.compile)."""

from __future__ import annotations

import logging

import pytest
import torch

from megatron_tlt.spec import _ops, verify_ref
from megatron_tlt.spec.verify import (
    VerifyInputs,
    VerifyOutput,
    acceptance_stats,
    chain_parents,
    count_drafted,
    verify_inputs,
    verify_tree_greedy,
    verify_tree_rejection,
)

IMPLS = ["kernel", "reference"]


@pytest.fixture(scope="module", autouse=True)
def _ops_loaded():
    _ops.require()


def one_hot_rows(*tokens: int, vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()


def rows(*dists) -> torch.Tensor:  # [1, N, V]
    return torch.tensor(dists, dtype=torch.float32).unsqueeze(0)


def ints(*xs) -> torch.Tensor:  # [1, N]
    return torch.tensor([xs], dtype=torch.int64)


def as_lists(out: VerifyOutput):
    return out.accept_index[0].tolist(), int(out.accept_length[0]), out.output_tokens[0].tolist()


# ---- greedy ----------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_greedy_chain_accepts_matching_prefix_then_bonus(impl):
    target = one_hot_rows(2, 1, 0, 3, vocab=4).unsqueeze(0)  # argmax per node: 2, 1, 0, 3
    out = verify_tree_greedy(chain_parents(1, 3), ints(9, 2, 1, 3), target, impl=impl)
    assert as_lists(out) == ([0, 1, 2, -1], 2, [2, 1, 0, -1])


@pytest.mark.parametrize("impl", IMPLS)
def test_greedy_tree_takes_first_matching_sibling(impl):
    # root -> 1 (tok 0), 2 (tok 3), 3 (tok 3); 2 -> 4 (tok 1); 3 -> 5 (tok 1)
    parents = ints(-1, 0, 0, 0, 2, 3)
    tokens = ints(0, 0, 3, 3, 1, 1)
    target = rows(
        [0.1, 0.2, 0.3, 0.4],  # root: argmax 3 -> node 2 (not 3)
        [1, 0, 0, 0],
        [0, 1, 0, 0],  # node 2: argmax 1 -> node 4
        [0.25, 0.25, 0.25, 0.25],
        [0.1, 0.1, 0.7, 0.1],  # node 4 (leaf): bonus 2
        [0, 0, 0, 1],
    )
    out = verify_tree_greedy(parents, tokens, target, impl=impl)
    assert as_lists(out) == ([0, 2, 4], 2, [3, 1, 2])


@pytest.mark.parametrize("impl", IMPLS)
def test_greedy_ties_go_to_lowest_id_and_nan_never_wins(impl):
    parents, tokens = chain_parents(1, 1), ints(0, 2)
    target = rows([0.4, float("nan"), 0.4, 0.2], [0, 0, 0, 1])  # argmax 0, not 2 or NaN
    assert as_lists(verify_tree_greedy(parents, tokens, target, impl=impl)) == ([0, -1], 0, [0, -1])


@pytest.mark.parametrize("impl", IMPLS)
def test_max_depth_truncates_the_tree(impl):
    target = one_hot_rows(1, 2, 3, 0, vocab=4).unsqueeze(0)
    parents, tokens = chain_parents(1, 3), ints(0, 1, 2, 3)
    out = verify_tree_greedy(parents, tokens, target, max_depth=1, impl=impl)
    assert as_lists(out) == ([0, 1], 1, [1, 2])  # bonus = argmax at node 1
    coins, noise = torch.zeros(1, 4), torch.ones(1, 4)
    out = verify_tree_rejection(parents, tokens, target, None, coins, noise, max_depth=1, impl=impl)
    assert as_lists(out) == ([0, 1], 1, [1, 2])


@pytest.mark.parametrize("impl", IMPLS)
def test_padding_nodes_are_skipped(impl):
    # node 2 is padding (parent -1, junk token); node 3 hangs off node 1.
    parents, tokens = ints(-1, 0, -1, 1), ints(0, 1, 999, 2)
    target = one_hot_rows(1, 2, 0, 3, vocab=4).unsqueeze(0)
    out = verify_tree_greedy(parents, tokens, target, impl=impl)
    assert as_lists(out) == ([0, 1, 3], 2, [1, 2, 3])


@pytest.mark.parametrize("impl", IMPLS)
def test_out_of_range_parent_is_padding_without_validation(impl):
    # validate=False: a parent index past the tree is padding for the kernels; the
    # reference's depth pass raised an IndexError on it (the kernel path too: it computes
    # the depth first)
    parents, tokens = ints(-1, 0, 7, 1), ints(0, 1, 2, 2)
    target = one_hot_rows(1, 2, 0, 3, vocab=4).unsqueeze(0)
    out = verify_tree_greedy(parents, tokens, target, impl=impl, validate=False)
    assert as_lists(out) == ([0, 1, 3], 2, [1, 2, 3])


@pytest.mark.parametrize("impl", IMPLS)
def test_non_contiguous_out_is_refused_by_both_paths(impl):
    # the kernels need contiguous buffers; the reference accepted this one, so "auto"
    # changed what a call does, not only its speed
    parents, tokens = ints(-1, 0, 1), ints(0, 1, 2)
    target = one_hot_rows(1, 2, 3, vocab=4).unsqueeze(0)
    out = VerifyOutput(accept_index=torch.empty(1, 10, dtype=torch.int64)[:, 0:6:2],
                       accept_length=torch.empty(1, dtype=torch.int64),
                       output_tokens=torch.empty(1, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="out.accept_index must be contiguous"):
        verify_tree_greedy(parents, tokens, target, out=out, impl=impl, max_depth=2)


# ---- rejection sampling ----------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "coin2, expected",
    [
        (0.5, ([0, 2], 1, [1, 3])),  # 0.5 * 0.5 < 0.3: node 2 accepted, bonus from its target
        (0.7, ([0, -1], 0, [2, -1])),  # 0.7 * 0.5 >= 0.3: rejected, recovered token 2
    ],
)
def test_one_hot_siblings_use_the_residual(impl, coin2, expected):
    parents, tokens = ints(-1, 0, 0), ints(0, 0, 1)
    target = rows([0.5, 0.3, 0.2, 0.0], [0.25] * 4, [0, 0, 0, 1])
    coins = torch.tensor([[0.0, 0.6, coin2]])  # node 1: 0.6 >= 0.5 -> rejected, mass 0.5
    noise = torch.tensor([[1e-6, 1e-6, 1.0, 1.0]])  # would pick 0 or 1 if they were not excluded
    out = verify_tree_rejection(parents, tokens, target, None, coins, noise, impl=impl)
    assert as_lists(out) == expected


@pytest.mark.parametrize("impl", IMPLS)
def test_general_q_disjoint_support_always_rejects(impl):
    parents, tokens = chain_parents(1, 1), ints(0, 2)
    target = rows([0.5, 0.5, 0, 0], [0.25] * 4)
    draft = rows([0.25] * 4, [0, 0, 0.5, 0.5])
    noise = torch.tensor([[1.0, 0.5, 1e-6, 1e-6]])  # race scores 0.5, 1.0 -> token 1
    out = verify_tree_rejection(parents, tokens, target, draft, torch.zeros(1, 2), noise, impl=impl)
    assert as_lists(out) == ([0, -1], 0, [1, -1])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("general", [False, True])
def test_degenerate_residual_falls_back_to_the_target(impl, general):
    # coin 1.0 (outside [0, 1)) rejects a draft the target is sure of: empty residual.
    parents, tokens = chain_parents(1, 1), ints(0, 2)
    target = rows([0, 0, 1, 0], [0.25] * 4)
    draft = rows([0.25] * 4, [0, 0, 1, 0]) if general else None
    out = verify_tree_rejection(parents, tokens, target, draft, torch.ones(1, 2), torch.ones(1, 4), impl=impl)
    assert as_lists(out) == ([0, -1], 0, [2, -1])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("general", [False, True])
def test_degenerate_residual_below_the_root_falls_back_to_that_nodes_target(impl, general):
    """The same empty residual one level down: the first draft (2) is accepted, the second
    (1) rejected by coin 1.0 though the target at node 1 is sure of it; the token comes from
    node 1's target row (1), not the root's (2). A reference racing the root's row passed
    every other test (session 44's mutation audit)."""
    parents, tokens = chain_parents(1, 2), ints(0, 2, 1)
    target = rows([0, 0, 1, 0], [0, 1, 0, 0], [0.25] * 4)
    draft = rows([0.25] * 4, [0, 0, 1, 0], [0, 1, 0, 0]) if general else None
    coins = torch.tensor([[1.0, 0.5, 1.0]])  # per node: node 1 accepted, node 2 rejected
    out = verify_tree_rejection(parents, tokens, target, draft, coins, torch.ones(1, 4), impl=impl)
    assert as_lists(out) == ([0, 1, -1], 1, [2, 1, -1])


@pytest.mark.parametrize("impl", IMPLS)
def test_identical_drafter_is_always_accepted(impl):
    inputs = VerifyInputs.make_dummy(batch=16, depth=4, topk=1, vocab=64, general_q=True, padding=False, seed=3)
    parent_rows = inputs.parents.clamp(min=0).unsqueeze(-1).expand_as(inputs.target_probs)
    inputs.draft_probs = inputs.target_probs.gather(1, parent_rows)  # q = the target at the parent
    depth = verify_ref.tree_depths(inputs.parents, inputs.draft_tokens, 64).max(1).values
    out = verify_inputs(inputs, impl=impl)
    assert torch.equal(out.accept_length, depth)


def test_acceptance_stats_definitions():
    stats = acceptance_stats(torch.tensor([2, 0, 4, 2]), 4)
    assert stats["acceptance_rate"] == 8 / 16
    assert stats["acceptance_length"] == 1 + 8 / 4
    parents, tokens = ints(-1, 0, -1, 1), ints(0, 1, 999, 2)
    assert count_drafted(parents, tokens, 4).tolist() == [2]


# ---- validation --------------------------------------------------------------------------


def small_inputs():
    return VerifyInputs.make_dummy(batch=2, depth=2, topk=2, vocab=8, padding=False, seed=1)


def test_wrapper_rejects_malformed_trees():
    x = small_inputs()
    bad = x.parents.clone()
    bad[1, 2] = 2
    with pytest.raises(ValueError, match=r"parents\[1, 2\] = 2"):
        verify_tree_rejection(bad, x.draft_tokens, x.target_probs, x.draft_probs, x.coins, x.exp_noise)
    bad = x.parents.clone()
    bad[0, 0] = 0
    with pytest.raises(ValueError, match=r"parents\[0, 0\] must be -1"):
        verify_tree_greedy(bad, x.draft_tokens, x.target_probs)
    tokens = x.draft_tokens.clone()
    tokens[0, 1] = 8
    with pytest.raises(ValueError, match=r"draft_tokens\[0, 1\] = 8 is outside the vocabulary"):
        verify_tree_greedy(x.parents, tokens, x.target_probs)


def test_wrapper_rejects_bad_dtypes_and_shapes():
    x = small_inputs()
    with pytest.raises(ValueError, match="parents must be torch.int64"):
        verify_tree_greedy(x.parents.int(), x.draft_tokens, x.target_probs)
    with pytest.raises(ValueError, match=r"exp_noise must have shape \(2, 8\)"):
        verify_tree_rejection(x.parents, x.draft_tokens, x.target_probs, None, x.coins, x.exp_noise[:, :4])
    with pytest.raises(ValueError, match="target_probs must be torch.float32"):
        verify_tree_greedy(x.parents, x.draft_tokens, x.target_probs.double())
    with pytest.raises(ValueError, match="out.accept_index must have shape"):
        verify_tree_greedy(x.parents, x.draft_tokens, x.target_probs, max_depth=2, out=VerifyOutput.empty(2, 3))


def test_op_checks_arguments_on_the_host():
    x = small_inputs()
    out = VerifyOutput.empty(2, 2)
    op = torch.ops.megatron_tlt.verify_tree_rejection
    args = [x.parents, x.draft_tokens, x.target_probs, x.draft_probs, x.coins, x.exp_noise,
            out.accept_index, out.accept_length, out.output_tokens]
    bad = list(args)
    bad[0] = x.parents.int()
    message = r"verify_tree_rejection: parents \[batch, num_nodes\] must be Long, got Int"
    with pytest.raises(RuntimeError, match=message):
        op(*bad)
    bad = list(args)
    bad[4] = x.coins[:, :2].contiguous()
    with pytest.raises(RuntimeError, match=r"coins.size\(1\) must equal num_nodes"):
        op(*bad)
    bad = list(args)
    bad[3] = x.draft_probs.transpose(0, 1)
    with pytest.raises(RuntimeError, match="draft_probs"):
        op(*bad)
    bad = list(args)
    bad[8] = torch.empty(2, 5, dtype=torch.int64)
    with pytest.raises(RuntimeError, match=r"output_tokens.size\(1\) must equal accept_index.size\(1\)"):
        op(*bad)


# ---- dispatch policy ---------------------------------------------------------------------


def test_kernel_unavailable_falls_back_or_raises(monkeypatch, caplog):
    from megatron_tlt.spec import verify

    x = small_inputs()
    expected = verify_inputs(x, impl="kernel")
    monkeypatch.setattr(_ops, "has_kernel", lambda device_type: False)
    monkeypatch.setattr(_ops, "unavailable_reason", lambda: "no compiler (test)")
    monkeypatch.setattr(verify, "_warned", set())
    with pytest.raises(RuntimeError, match=r"no compiled cpu kernel: no compiler \(test\)"):
        verify_inputs(x, impl="kernel")
    with caplog.at_level(logging.WARNING):
        got = verify_inputs(x)
    assert "using the PyTorch reference" in caplog.text
    assert torch.equal(got.output_tokens, expected.output_tokens)
    with pytest.raises(ValueError, match="impl must be one of"):
        verify_inputs(x, impl="fast")


def test_jit_build_without_a_compiler_says_so(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    monkeypatch.delenv("MEGATRON_TLT_NO_JIT", raising=False)
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler .*no-such-compiler-xyz"):
        _ops._jit_build()
    assert _ops.has_kernel("cpu") and _ops.source() is not None


# ---- torch.library integration ---------------------------------------------------------


def _op_args(x: VerifyInputs, greedy: bool):
    depth = verify_ref.max_tree_depth(x.parents, x.draft_tokens, x.target_probs.shape[-1])
    out = VerifyOutput.empty(x.parents.shape[0], depth)
    outs = [out.accept_index, out.accept_length, out.output_tokens]
    if greedy:
        return [x.parents, x.draft_tokens, x.target_probs, *outs]
    return [x.parents, x.draft_tokens, x.target_probs, x.draft_probs, x.coins, x.exp_noise, *outs]


@pytest.mark.parametrize("greedy", [True, False])
def test_opcheck(greedy):
    x = small_inputs()
    op = torch.ops.megatron_tlt.verify_tree_greedy if greedy else torch.ops.megatron_tlt.verify_tree_rejection
    torch.library.opcheck(op.default, _op_args(x, greedy))


def test_ops_trace_under_torch_compile():
    x = VerifyInputs.make_dummy(batch=3, depth=3, topk=2, vocab=16, seed=5)

    def step(parents, tokens, target, draft, coins, noise, ai, al, ot):
        torch.ops.megatron_tlt.verify_tree_rejection(parents, tokens, target, draft, coins, noise, ai, al, ot)
        return al + 1, ot

    eager_args = _op_args(x, greedy=False)
    compiled_args = _op_args(x, greedy=False)
    expected = step(*eager_args)
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(*compiled_args)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert torch.equal(compiled_args[6], eager_args[6])  # in-place outputs written
