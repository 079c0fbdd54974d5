"""Speculative-decoding verification: the public entry points.

`verify_tree_greedy` and `verify_tree_rejection` run the compiled ops
(torch.ops.megatron_tlt.*, csrc/) and fall back to the PyTorch reference
(verify_ref.py, the spec: terms, tree layout and exact semantics are defined there).

Dispatch policy (`impl`, default from $MEGATRON_TLT_VERIFY_IMPL, else "auto"):
- "auto": the compiled kernel for the tensors' device if there is one; otherwise the
  reference, with one WARNING per op and device saying why. Both give identical outputs,
  so this changes speed only, never results.
- "kernel": the compiled kernel or a RuntimeError naming the reason.
- "reference": always the reference.

Inputs are validated before any work: dtypes and shapes always (cheap), tree contents
(parent indices, token range) when validate=True, skipped automatically during CUDA-graph
capture (it would sync). Under capture also pass max_depth (computing it syncs) and
preallocated `out` buffers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os

import torch

from megatron_tlt.spec import _ops
from megatron_tlt.spec.verify_ref import (
    max_tree_depth,
    tree_valid_nodes,
    verify_tree_greedy_ref,
    verify_tree_rejection_ref,
)

logger = logging.getLogger(__name__)

IMPLS = ("auto", "kernel", "reference")
_warned: set[tuple[str, str]] = set()


@dataclasses.dataclass
class VerifyOutput:
    """Result of one verification step (int64, -1 padded)."""

    accept_index: torch.Tensor  # [batch, max_depth + 1] node indices of the accepted path, root first
    accept_length: torch.Tensor  # [batch] number of accepted draft tokens
    output_tokens: torch.Tensor  # [batch, max_depth + 1] accepted tokens, then the recovered/bonus token

    @classmethod
    def empty(cls, batch: int, max_depth: int, device: torch.device | str = "cpu") -> "VerifyOutput":
        """Buffers to pass as `out` (e.g. static buffers of a captured CUDA graph)."""
        shape = (batch, max_depth + 1)
        return cls(
            accept_index=torch.empty(shape, dtype=torch.int64, device=device),
            accept_length=torch.empty(batch, dtype=torch.int64, device=device),
            output_tokens=torch.empty(shape, dtype=torch.int64, device=device),
        )

    @property
    def num_emitted(self) -> torch.Tensor:  # [batch]
        return self.accept_length + 1


@dataclasses.dataclass(kw_only=True)
class VerifyInputs:
    """The inputs of one verification step, as plain tensors."""

    parents: torch.Tensor  # [batch, num_nodes] int64, -1 for the root and padding
    draft_tokens: torch.Tensor  # [batch, num_nodes] int64
    target_probs: torch.Tensor  # [batch, num_nodes, vocab] float32
    draft_probs: torch.Tensor | None  # [batch, num_nodes, vocab] float32; None = one-hot
    coins: torch.Tensor  # [batch, num_nodes] float32 U[0, 1)
    exp_noise: torch.Tensor  # [batch, vocab] float32 Exp(1)

    def to(self, device: torch.device | str) -> "VerifyInputs":
        return VerifyInputs(
            **{
                f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                for f in dataclasses.fields(self)
            }
        )

    @classmethod
    def make_dummy(
        cls,
        batch: int = 2,
        depth: int = 3,
        topk: int = 2,
        vocab: int = 32,
        *,
        general_q: bool = True,
        padding: bool = True,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> "VerifyInputs":
        """Random EAGLE-like draft trees with a target that often agrees with the drafter.

        Each sequence gets a tree of depth <= `depth` (some shallower, so trees differ in
        size), expanding up to `topk` nodes per level with `topk` children each; topk=1 is
        a chain. general_q=True: children drawn i.i.d. from the drafter's distribution at
        their parent, draft_probs given; False: the parent's top-k tokens, draft_probs=None
        (with occasional duplicate siblings). padding=True scatters padding nodes.
        """
        gen = torch.Generator().manual_seed(seed)

        def rand_int(n: int) -> int:
            return int(torch.randint(n, (), generator=gen))

        trees = []
        for b in range(batch):
            seq_depth = depth if b % 3 == 0 else 1 + rand_int(max(depth, 1))
            parents, frontier = [-1], [0]
            for _ in range(min(seq_depth, depth)):
                keep = sorted(torch.randperm(len(frontier), generator=gen)[:topk].tolist())
                new = []
                for j in keep:
                    for _ in range(topk):
                        parents.append(frontier[j])
                        new.append(len(parents) - 1)
                frontier = new
            if padding:  # insert padding nodes at random places, renumbering the rest
                for _ in range(rand_int(3)):
                    at = 1 + rand_int(len(parents))
                    parents = parents[:at] + [None] + [p if p is None or p < at else p + 1 for p in parents[at:]]
                parents = [-1 if p is None else p for p in parents]
            trees.append(parents)
        num_nodes = max(len(t) for t in trees)
        par = torch.full((batch, num_nodes), -1, dtype=torch.int64)
        for b, t in enumerate(trees):
            par[b, : len(t)] = torch.tensor(t)
        is_node = tree_valid_nodes(par, torch.zeros_like(par), vocab)
        parent_of = par.clamp(min=0)

        # Target: noisy logits with one boosted token per node (a mass ~1/2 peak), so the
        # drafter's guesses are accepted often but not always.
        logits = torch.randn(batch, num_nodes, vocab, generator=gen) * 2.0
        peak = torch.randint(vocab, (batch, num_nodes, 1), generator=gen)
        boost = math.log(vocab) + 2.0 * torch.randn(batch, num_nodes, 1, generator=gen)
        logits.scatter_add_(2, peak, boost)
        # Drafter at node p: the target's logits plus noise.
        drafter = torch.softmax(logits + 0.7 * torch.randn(logits.shape, generator=gen), dim=-1)
        target = torch.softmax(logits, dim=-1)
        del logits
        proposal = drafter.gather(1, parent_of.unsqueeze(-1).expand(-1, -1, vocab))  # q of node c
        del drafter

        if general_q:
            noise = torch.empty(batch, num_nodes, vocab).exponential_(generator=gen)
            tokens = (proposal / noise).argmax(-1)
            del noise
        else:
            tokens = torch.zeros(batch, num_nodes, dtype=torch.int64)
            top = proposal.topk(min(topk, vocab), dim=-1).indices  # [batch, num_nodes, k]
            for b in range(batch):
                rank: dict[int, int] = {}
                for c in range(1, num_nodes):
                    if is_node[b, c]:
                        p = int(par[b, c])
                        j = rank.get(p, 0)
                        rank[p] = j + 1
                        dup = j > 0 and torch.rand((), generator=gen) < 0.1 and par[b, c - 1] == p
                        tokens[b, c] = tokens[b, c - 1] if dup else top[b, c, j % top.shape[-1]]
        tokens = torch.where(is_node, tokens, torch.randint(-1, vocab, tokens.shape, generator=gen))
        tokens[:, 0] = torch.randint(vocab, (batch,), generator=gen)  # root: last committed token
        return cls(
            parents=par.to(device),
            draft_tokens=tokens.to(device),
            target_probs=target.to(device),
            draft_probs=proposal.to(device) if general_q else None,
            coins=torch.rand(batch, num_nodes, generator=gen).to(device),
            exp_noise=torch.empty(batch, vocab).exponential_(generator=gen).to(device),
        )


# ---- helpers -------------------------------------------------------------------------


def chain_parents(batch: int, num_drafts: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """parents [batch, num_drafts + 1] of a chain: -1, 0, 1, ..., num_drafts - 1."""
    return (torch.arange(num_drafts + 1, device=device) - 1).expand(batch, -1).contiguous()


def count_drafted(parents: torch.Tensor, draft_tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """Number of draft tokens (non-padding, non-root nodes) per sequence [batch]."""
    return tree_valid_nodes(parents, draft_tokens, vocab).sum(1)


def acceptance_stats(accept_length: torch.Tensor, num_drafted: torch.Tensor | int) -> dict[str, float]:
    """Acceptance rate (accepted / drafted) and acceptance length (1 + accepted / steps)
    over the sequences of one or more steps (accept_length [steps*batch])."""
    accepted = float(accept_length.sum())
    steps = accept_length.numel()
    drafted = float(num_drafted.sum()) if isinstance(num_drafted, torch.Tensor) else float(num_drafted) * steps
    return {
        "accepted": accepted,
        "drafted": drafted,
        "steps": float(steps),
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "acceptance_length": 1.0 + accepted / steps if steps else 0.0,
    }


def check_tree(parents: torch.Tensor, draft_tokens: torch.Tensor, vocab: int) -> None:
    """ValueError unless every tree is well formed: parents[b, 0] == -1, and each node
    i > 0 is padding (parent -1) or has 0 <= parent < i and 0 <= token < vocab. Syncs."""
    if parents.numel() == 0:
        return
    node = torch.arange(parents.shape[1], device=parents.device)
    root_bad = parents[:, 0] != -1
    if bool(root_bad.any()):
        b = int(root_bad.nonzero()[0, 0])
        raise ValueError(f"parents[{b}, 0] must be -1 (node 0 is the root), got {int(parents[b, 0])}")
    used = (node > 0) & (parents != -1)
    bad_parent = used & ((parents < 0) | (parents >= node))
    if bool(bad_parent.any()):
        b, i = (int(v) for v in bad_parent.nonzero()[0])
        raise ValueError(
            f"parents[{b}, {i}] = {int(parents[b, i])}: a node's parent must be an earlier node "
            f"(0 <= parent < {i}) or -1 for padding"
        )
    bad_token = used & ((draft_tokens < 0) | (draft_tokens >= vocab))
    if bool(bad_token.any()):
        b, i = (int(v) for v in bad_token.nonzero()[0])
        raise ValueError(f"draft_tokens[{b}, {i}] = {int(draft_tokens[b, i])} is outside the vocabulary [0, {vocab})")


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _check_meta(name: str, t: torch.Tensor | None, dtype: torch.dtype, shape: tuple, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but target_probs is on {device}")


def _prepare(op, parents, draft_tokens, target_probs, draft_probs, coins, exp_noise, max_depth, out, validate):
    if not isinstance(target_probs, torch.Tensor) or target_probs.dim() != 3:
        got = tuple(target_probs.shape) if isinstance(target_probs, torch.Tensor) else type(target_probs).__name__
        raise ValueError(f"target_probs must be a [batch, num_nodes, vocab] tensor, got {got}")
    batch, num_nodes, vocab = target_probs.shape
    if num_nodes < 1 or vocab < 1:
        raise ValueError(
            f"target_probs needs num_nodes >= 1 and vocab >= 1, got shape {tuple(target_probs.shape)}"
        )
    device = target_probs.device
    _check_meta("target_probs", target_probs, torch.float32, (batch, num_nodes, vocab), device)
    _check_meta("parents", parents, torch.int64, (batch, num_nodes), device)
    _check_meta("draft_tokens", draft_tokens, torch.int64, (batch, num_nodes), device)
    if op == "verify_tree_rejection":
        if draft_probs is not None:
            _check_meta("draft_probs", draft_probs, torch.float32, (batch, num_nodes, vocab), device)
        _check_meta("coins", coins, torch.float32, (batch, num_nodes), device)
        _check_meta("exp_noise", exp_noise, torch.float32, (batch, vocab), device)
    capturing = _capturing()
    if validate and not capturing:
        check_tree(parents, draft_tokens, vocab)
    if max_depth is None:
        if capturing:
            raise ValueError("max_depth must be given under CUDA-graph capture (computing it syncs)")
        max_depth = max_tree_depth(parents, draft_tokens, vocab)
    if max_depth < 0:
        raise ValueError(f"max_depth must be >= 0, got {max_depth}")
    if out is None:
        out = VerifyOutput.empty(batch, max_depth, device)
    else:
        shape = (batch, max_depth + 1)
        _check_meta("out.accept_index", out.accept_index, torch.int64, shape, device)
        _check_meta("out.accept_length", out.accept_length, torch.int64, (batch,), device)
        _check_meta("out.output_tokens", out.output_tokens, torch.int64, shape, device)
        for name in ("accept_index", "accept_length", "output_tokens"):
            # the kernels write contiguous buffers; checked here so that the reference path
            # refuses the same buffers ("auto" changes speed only, never what is accepted)
            if not getattr(out, name).is_contiguous():
                raise ValueError(f"out.{name} must be contiguous, got strides {getattr(out, name).stride()}")
    return max_depth, out


def _use_kernel(op: str, device: torch.device, impl: str | None) -> bool:
    impl = impl or os.environ.get("MEGATRON_TLT_VERIFY_IMPL", "auto")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "reference":
        return False
    if _ops.has_kernel(device.type):
        return True
    reason = _ops.unavailable_reason() or f"the extension was built without {device.type} kernels"
    if impl == "kernel":
        raise RuntimeError(f"megatron_tlt::{op} has no compiled {device.type} kernel: {reason}")
    if (op, device.type) not in _warned:
        _warned.add((op, device.type))
        logger.warning(
            "megatron_tlt::%s: no compiled %s kernel (%s); using the PyTorch reference", op, device.type, reason
        )
    return False


@contextlib.contextmanager
def nvtx_range(name: str, device: torch.device):
    """An NVTX range around the block on CUDA (not while torch.compile traces); a no-op elsewhere."""
    if torch.device(device).type == "cuda" and not torch.compiler.is_compiling():
        torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            torch.cuda.nvtx.range_pop()
    else:
        yield


def _fill(out: VerifyOutput, result: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> VerifyOutput:
    out.accept_index.copy_(result[0])
    out.accept_length.copy_(result[1])
    out.output_tokens.copy_(result[2])
    return out


# ---- entry points ----------------------------------------------------------------------


def verify_tree_greedy(
    parents: torch.Tensor,  # [batch, num_nodes] int64
    draft_tokens: torch.Tensor,  # [batch, num_nodes] int64
    target_probs: torch.Tensor,  # [batch, num_nodes, vocab] float32 (probs or logits)
    *,
    max_depth: int | None = None,
    out: VerifyOutput | None = None,
    validate: bool = True,
    impl: str | None = None,
) -> VerifyOutput:
    """Greedy verification of draft trees (verify_ref.py defines it)."""
    op = "verify_tree_greedy"
    max_depth, out = _prepare(op, parents, draft_tokens, target_probs, None, None, None, max_depth, out, validate)
    with nvtx_range("spec/verify/greedy", target_probs.device):
        if _use_kernel(op, target_probs.device, impl):
            torch.ops.megatron_tlt.verify_tree_greedy(
                parents.contiguous(), draft_tokens.contiguous(), target_probs.contiguous(),
                out.accept_index, out.accept_length, out.output_tokens,
            )
            return out
        return _fill(out, verify_tree_greedy_ref(parents, draft_tokens, target_probs, max_depth))


def verify_tree_rejection(
    parents: torch.Tensor,  # [batch, num_nodes] int64
    draft_tokens: torch.Tensor,  # [batch, num_nodes] int64
    target_probs: torch.Tensor,  # [batch, num_nodes, vocab] float32
    draft_probs: torch.Tensor | None,  # [batch, num_nodes, vocab] float32; None = one-hot proposals
    coins: torch.Tensor,  # [batch, num_nodes] float32 U[0, 1)
    exp_noise: torch.Tensor,  # [batch, vocab] float32 Exp(1)
    *,
    max_depth: int | None = None,
    out: VerifyOutput | None = None,
    validate: bool = True,
    impl: str | None = None,
) -> VerifyOutput:
    """Lossless verification of draft trees by recursive rejection sampling
    (verify_ref.py defines it)."""
    op = "verify_tree_rejection"
    max_depth, out = _prepare(
        op, parents, draft_tokens, target_probs, draft_probs, coins, exp_noise, max_depth, out, validate
    )
    with nvtx_range("spec/verify/rejection", target_probs.device):
        if _use_kernel(op, target_probs.device, impl):
            torch.ops.megatron_tlt.verify_tree_rejection(
                parents.contiguous(), draft_tokens.contiguous(), target_probs.contiguous(),
                None if draft_probs is None else draft_probs.contiguous(),
                coins.contiguous(), exp_noise.contiguous(),
                out.accept_index, out.accept_length, out.output_tokens,
            )
            return out
        return _fill(
            out,
            verify_tree_rejection_ref(parents, draft_tokens, target_probs, draft_probs, coins, exp_noise, max_depth),
        )


def verify_inputs(inputs: VerifyInputs, *, greedy: bool = False, **kwargs) -> VerifyOutput:
    """Convenience: verify a VerifyInputs (greedy or rejection sampling)."""
    if greedy:
        return verify_tree_greedy(inputs.parents, inputs.draft_tokens, inputs.target_probs, **kwargs)
    return verify_tree_rejection(
        inputs.parents, inputs.draft_tokens, inputs.target_probs, inputs.draft_probs,
        inputs.coins, inputs.exp_noise, **kwargs,
    )
