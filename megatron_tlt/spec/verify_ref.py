"""PyTorch reference of speculative-decoding verification: the spec of the csrc/ kernels.

The CPU (csrc/verify_cpu.cpp) and CUDA (csrc/verify_cuda.cu) kernels must produce
exactly (torch.equal) the integer outputs of these functions for every input; the tests
in tests/unit/spec/ and tests/gpu/test_verify_cuda.py check it. Vectorised over the
batch (a loop over tree steps, each on all unfinished sequences) so it also serves as the
fallback on machines without the compiled ops, and for 10^6-sample statistical tests.

Terms (vLLM's definitions; used the same way everywhere in megatron_tlt):
- draft token: a token proposed by the drafter, one per non-root tree node.
- accepted token: a draft token the verifier keeps; it is emitted.
- rejected token: a draft token the verifier tested and refused.
- recovered token: the token emitted at the node where the walk stops after at least
  one of its children was rejected; drawn from the residual distribution.
- bonus token: the token emitted where the walk stops with no child to test (a leaf,
  the depth limit, or a node whose children were all padding); drawn from the target.
- acceptance rate = accepted / drafted (draft tokens accepted over draft tokens proposed).
- acceptance length = 1 + accepted / num_drafts (num_drafts: verification steps), i.e. the
  mean number of tokens emitted per step.

Draft tree of sequence b, N nodes (batched, so trees of different sizes pad to one N):
- node 0 is the root: the last committed token, not a draft; parents[b, 0] = -1.
- node i > 0 is a draft node iff 0 <= parents[b, i] < i and 0 <= draft_tokens[b, i] < V;
  any other node is padding (e.g. parents = -1) and is ignored, as is everything below it.
  A chain is parents[i] = i - 1. Children of a node are visited in increasing node index.
- target_probs[b, i]: the target's processed distribution (temperature, top-k, top-p
  applied; megatron_tlt/spec/sampling_ref.py) of the token after node i.
- draft_probs[b, i]: the distribution node i's token was drawn from, processed by the same
  function; None means deterministic proposals (EAGLE-2 top-k trees, n-gram drafts): every
  node's proposal is the one-hot distribution on its token.
- max_depth D: nodes deeper than D are ignored (the output has D + 1 columns). By default D
  is the depth of the deepest draft node.

Greedy verification: at node cur (starting at the root), a = argmax target_probs[b, cur]
(NaN never wins, ties to the lowest token id); move to the first child whose token is a;
stop when there is none and emit a as the bonus token.

Lossless verification (recursive rejection sampling, sibling by sibling): at node cur the
residual is p = target_probs[b, cur]. For each child c in order, with token x = draft_tokens
[b, c] and proposal q (draft_probs[b, c] or one-hot(x)): accept iff coins[b, c] < p(x) / q(x),
then move to c and restart with p = target_probs[b, c]; otherwise p <- normalise(max(p - q, 0))
and try the next child. When no child is accepted, emit one token drawn from p by the
exponential race argmax_v p(v) / exp_noise[b, v]. The emitted tokens have exactly the
target's distribution provided the noise is independent of the drafts and:
- draft_probs=None: always, however the draft tokens were chosen (top-k, n-gram, even
  sampled without replacement): each test only removes the tested token from p;
- draft_probs given: each draft was drawn from its own draft_probs row independently of
  its siblings (e.g. siblings i.i.d. from the parent's q). Siblings drawn without
  replacement violate this; verify such trees with draft_probs=None.

Arithmetic (how the three implementations agree bit for bit; csrc/verify_common.h):
- The residual is kept unnormalised as r (float32) with its mass m (float64, m = 1 at a
  node's start: target rows are assumed to sum to 1), so "u < p(x) / q(x)" is tested as
  u * q(x) * m < r(x) in float64 without division.
- One-hot proposals: rejecting x sets r(x) = 0 and m -= r(x) (exact subtraction, no sum).
- General q: r <- float32(max(r - m * q, 0)) computed in float64, and m <- sum(r) computed
  exactly in fixed point (each entry truncated to a multiple of 2^-58, int64 sum), so the
  reduction order cannot matter.
- The race score is p(v) / E(v) in float32 for p(v) > 0 (else -1; a NaN or negative score
  is -1 too); the winner is the largest score, ties to the lowest token id.
- Degenerate residual (no entry > 0, possible only through float rounding or invalid
  input): the emitted token is the race over the node's unmodified target row; if that row
  has no positive entry either, token 0.
"""

from __future__ import annotations

import torch

FIXED_SCALE = 2.0**58  # fixed-point scale of residual masses (csrc kFixedScale)


def tree_valid_nodes(parents: torch.Tensor, draft_tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft nodes (not root, not padding) as a bool mask [batch, num_nodes]."""
    num_nodes = parents.shape[1]
    node = torch.arange(num_nodes, device=parents.device)
    return (
        (node > 0)
        & (parents >= 0)
        & (parents < node)
        & (draft_tokens >= 0)
        & (draft_tokens < vocab)
    )


def tree_depths(parents: torch.Tensor, draft_tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """Depth of every node [batch, num_nodes] int64: 0 for the root, -1 for padding and
    for nodes that cannot be reached (below padding)."""
    valid = tree_valid_nodes(parents, draft_tokens, vocab)
    depth = torch.full_like(parents, -1)
    depth[:, 0] = 0
    for i in range(1, parents.shape[1]):
        # clamped both ways: an out-of-range parent is padding (`valid` is False there)
        parent_depth = depth.gather(1, parents[:, i : i + 1].clamp(0, parents.shape[1] - 1)).squeeze(1)
        depth[:, i] = torch.where(valid[:, i] & (parent_depth >= 0), parent_depth + 1, -1)
    return depth


def max_tree_depth(parents: torch.Tensor, draft_tokens: torch.Tensor, vocab: int) -> int:
    """Depth of the deepest draft node over the batch (0 if there is none). Syncs."""
    if parents.numel() == 0:
        return 0
    return int(tree_depths(parents, draft_tokens, vocab).max().clamp(min=0))


# ---- scalar rules (twins of csrc/verify_common.h) --------------------------------------


def greedy_argmax(values: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim; NaN never wins; ties -> lowest index. [..., V] -> [...]"""
    return torch.where(torch.isnan(values), float("-inf"), values).argmax(-1)


def race_scores(probs: torch.Tensor, exp_noise: torch.Tensor) -> torch.Tensor:
    """Exponential-race scores: p / E where p > 0 (and the quotient is >= 0), else -1."""
    score = probs / exp_noise
    return torch.where((probs > 0) & (score >= 0), score, -1.0)


def race(probs: torch.Tensor, exp_noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exponential race over the last dim: (token, found). found is False where no entry
    of probs is positive (the token is then meaningless). probs need not be normalised."""
    score = race_scores(probs, exp_noise)
    token = score.argmax(-1)
    found = score.gather(-1, token.unsqueeze(-1)).squeeze(-1) >= 0
    return token, found


def fixed_mass(residual: torch.Tensor) -> torch.Tensor:
    """Exact mass of a residual [..., V] (entries >= 0): float64 [...]."""
    fixed = (residual.clamp(max=1.0).double() * FIXED_SCALE).to(torch.int64)
    return fixed.sum(-1).double() * (1.0 / FIXED_SCALE)


def accept_one_hot(u: torch.Tensor, mass: torch.Tensor, rx: torch.Tensor) -> torch.Tensor:
    """u < r(x) / m."""
    return u.double() * mass < rx.double()


def accept_general(
    u: torch.Tensor, qx: torch.Tensor, mass: torch.Tensor, rx: torch.Tensor
) -> torch.Tensor:
    """u < (r(x) / m) / q(x)."""
    return (u.double() * qx.double()) * mass < rx.double()


def reject_one_hot(
    residual: torch.Tensor, mass: torch.Tensor, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual after rejecting a one-hot proposal of x: r(x) = 0, m -= r(x).
    residual [R, V] float32, mass [R] float64, x [R] int64."""
    rx = residual.gather(1, x.unsqueeze(1)).squeeze(1)
    residual = residual.scatter(1, x.unsqueeze(1), 0.0)
    return residual, mass - rx.double()


def reject_general(
    residual: torch.Tensor, mass: torch.Tensor, q: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual after rejecting a draft drawn from q: max(r - m q, 0), exact new mass.
    residual [R, V] float32, mass [R] float64, q [R, V] float32."""
    t = residual.double() - mass.unsqueeze(1) * q.double()
    residual = torch.where(t > 0, t, 0.0).float()
    return residual, fixed_mass(residual)


# ---- verification ----------------------------------------------------------------------


def _empty_outputs(batch: int, max_depth: int, device: torch.device):
    accept_index = torch.full((batch, max_depth + 1), -1, dtype=torch.int64, device=device)
    accept_index[:, 0] = 0
    output_tokens = torch.full((batch, max_depth + 1), -1, dtype=torch.int64, device=device)
    return accept_index, output_tokens


def verify_tree_greedy_ref(
    parents: torch.Tensor,  # [batch, num_nodes] int64
    draft_tokens: torch.Tensor,  # [batch, num_nodes] int64
    target_probs: torch.Tensor,  # [batch, num_nodes, vocab] float32 (logits work too)
    max_depth: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy verification. Returns (accept_index [B, D+1], accept_length [B],
    output_tokens [B, D+1]), int64, -1 padded."""
    batch, num_nodes, vocab = target_probs.shape
    device = target_probs.device
    if max_depth is None:
        max_depth = max_tree_depth(parents, draft_tokens, vocab)
    valid = tree_valid_nodes(parents, draft_tokens, vocab)
    node = torch.arange(num_nodes, device=device)
    accept_index, output_tokens = _empty_outputs(batch, max_depth, device)
    cur = torch.zeros(batch, dtype=torch.int64, device=device)
    depth = torch.zeros(batch, dtype=torch.int64, device=device)
    rows = torch.arange(batch, device=device)  # unfinished sequences
    while rows.numel() > 0:
        c_cur = cur[rows]
        best = greedy_argmax(target_probs[rows, c_cur])
        match = (
            valid[rows]
            & (parents[rows] == c_cur.unsqueeze(1))
            & (draft_tokens[rows] == best.unsqueeze(1))
            & (depth[rows] < max_depth).unsqueeze(1)
        )
        has = match.any(1)
        fin = rows[~has]
        output_tokens[fin, depth[fin]] = best[~has]  # bonus token
        rows, best, child = rows[has], best[has], node[match[has].int().argmax(1)]
        output_tokens[rows, depth[rows]] = best
        depth[rows] += 1
        accept_index[rows, depth[rows]] = child
        cur[rows] = child
    return accept_index, depth, output_tokens


def verify_tree_rejection_ref(
    parents: torch.Tensor,  # [batch, num_nodes] int64
    draft_tokens: torch.Tensor,  # [batch, num_nodes] int64
    target_probs: torch.Tensor,  # [batch, num_nodes, vocab] float32
    draft_probs: torch.Tensor | None,  # [batch, num_nodes, vocab] float32, None = one-hot
    coins: torch.Tensor,  # [batch, num_nodes] float32 U[0, 1)
    exp_noise: torch.Tensor,  # [batch, vocab] float32 Exp(1)
    max_depth: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless tree verification by recursive rejection sampling. Returns
    (accept_index [B, D+1], accept_length [B], output_tokens [B, D+1]), int64, -1 padded."""
    batch, num_nodes, vocab = target_probs.shape
    device = target_probs.device
    if max_depth is None:
        max_depth = max_tree_depth(parents, draft_tokens, vocab)
    one_hot = draft_probs is None
    valid = tree_valid_nodes(parents, draft_tokens, vocab)
    node = torch.arange(num_nodes, device=device)
    accept_index, output_tokens = _empty_outputs(batch, max_depth, device)
    cur = torch.zeros(batch, dtype=torch.int64, device=device)
    depth = torch.zeros(batch, dtype=torch.int64, device=device)
    last = torch.zeros(batch, dtype=torch.int64, device=device)  # last child tested at cur
    residual = target_probs[:, 0].clone()  # [batch, vocab] unnormalised
    mass = torch.ones(batch, dtype=torch.float64, device=device)
    rows = torch.arange(batch, device=device)  # unfinished sequences
    # Every iteration, each unfinished sequence tests its next child or stops: <= N rounds.
    while rows.numel() > 0:
        c_cur = cur[rows]
        untested = (
            valid[rows]
            & (parents[rows] == c_cur.unsqueeze(1))
            & (node > last[rows].unsqueeze(1))
            & (depth[rows] < max_depth).unsqueeze(1)
        )
        has = untested.any(1)

        # Stop: recovered token (something was rejected here) or bonus token.
        fin = rows[~has]
        if fin.numel() > 0:
            token, found = race(residual[fin], exp_noise[fin])
            fallback, fallback_found = race(target_probs[fin, cur[fin]], exp_noise[fin])
            token = torch.where(found, token, torch.where(fallback_found, fallback, 0))
            output_tokens[fin, depth[fin]] = token

        # Test the next child of the others.
        rows = rows[has]
        child = node[untested[has].int().argmax(1)]
        x = draft_tokens[rows, child]
        u = coins[rows, child]
        rx = residual[rows, x]
        if one_hot:
            accepted = accept_one_hot(u, mass[rows], rx)
        else:
            accepted = accept_general(u, draft_probs[rows, child, x], mass[rows], rx)
        last[rows] = child

        acc, acc_child = rows[accepted], child[accepted]
        output_tokens[acc, depth[acc]] = x[accepted]
        depth[acc] += 1
        accept_index[acc, depth[acc]] = acc_child
        cur[acc] = acc_child
        residual[acc] = target_probs[acc, acc_child]
        mass[acc] = 1.0

        rej, rej_child = rows[~accepted], child[~accepted]
        if one_hot:
            residual[rej], mass[rej] = reject_one_hot(residual[rej], mass[rej], x[~accepted])
        else:
            residual[rej], mass[rej] = reject_general(
                residual[rej], mass[rej], draft_probs[rej, rej_child]
            )
    return accept_index, depth, output_tokens
