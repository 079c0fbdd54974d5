"""Statistical proof that verification is lossless, with negative controls.

Every positive test draws 10^6 outputs and requires all three of: no output on a token
of target probability 0; chi-square goodness of fit p > 1e-4; total variation to the
exact target distribution below a bound. Fixed seeds make each run identical; the
assertion messages state how unlikely a false failure is for a correct sampler, and the
power of the chi-square test against deviations at the TV bound (computed with the
noncentral chi-square: n * chi2-distance >= n * (2 TV)^2 by Cauchy-Schwarz).

Negative controls run the same check on deliberately broken pipelines and require it to
reject: no residual renormalisation (the reference with its residual update disabled),
acceptance ratios computed from the unprocessed draft distribution when the draft was
sampled after top-k, and a draft sampled at another temperature than the one its
reported probabilities were computed with. Each control is paired with the correct
pipeline on the same distributions, which must pass, so the failure is the bug's.
"""

from __future__ import annotations

import math
import zlib

import pytest
import scipy.stats
import torch

from megatron_tlt.spec import _ops, verify_ref
from megatron_tlt.spec.sampling_ref import process_logits
from megatron_tlt.spec.verify import chain_parents, verify_tree_greedy, verify_tree_rejection

N = 1_000_000
P_MIN = 1e-4
VOCAB = 16


@pytest.fixture(scope="module", autouse=True)
def _ops_loaded():
    _ops.require()


# ---- the statistical check ------------------------------------------------------------


def goodness_of_fit(tokens: torch.Tensor, expected: torch.Tensor):
    """(chi-square p-value, degrees of freedom, TV, samples on zero-probability cells)."""
    n = tokens.numel()
    counts = torch.bincount(tokens, minlength=expected.numel()).double()
    p = expected.double() / expected.sum()
    impossible = int(counts[p == 0].sum())
    tv = 0.5 * float((counts / n - p).abs().sum())
    e = p * n
    big, small = e >= 5, (e < 5) & (p > 0)  # pool sparse cells
    obs = torch.cat([counts[big], counts[small].sum().view(1)])
    exp = torch.cat([e[big], e[small].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    exp = exp * (obs.sum() / exp.sum())  # zero-probability cells are judged by `impossible`
    pvalue = float(scipy.stats.chisquare(obs.numpy(), exp.numpy()).pvalue)
    return pvalue, int(keep.sum()) - 1, tv, impossible


def false_failure_bound(expected: torch.Tensor, n: int, tv_max: float) -> float:
    """P(test fails | sampler exact) <= P_MIN + McDiarmid bound on TV exceeding tv_max
    (one sample moves TV by <= 1/n; E[TV] <= sum sqrt(p (1 - p) / n) / 2)."""
    p = expected.double() / expected.sum()
    mean_bound = 0.5 * float((p * (1 - p) / n).sqrt().sum())
    slack = max(tv_max - mean_bound, 0.0)
    return P_MIN + math.exp(-2 * n * slack**2)


def chi2_power(df: int, n: int, tv: float) -> float:
    return float(scipy.stats.ncx2.sf(scipy.stats.chi2.isf(P_MIN, df), df, n * (2 * tv) ** 2))


def assert_lossless(tokens: torch.Tensor, expected: torch.Tensor, tv_max: float, what: str) -> None:
    n = tokens.numel()
    pvalue, df, tv, impossible = goodness_of_fit(tokens, expected)
    assert impossible == 0 and pvalue > P_MIN and tv < tv_max, (
        f"{what}: {impossible} samples on zero-probability tokens, chi-square p={pvalue:.3g} "
        f"(df={df}, must be > {P_MIN:g}), TV={tv:.4f} (must be < {tv_max}) over {n} samples. "
        f"An exact sampler fails this check with probability <= "
        f"{false_failure_bound(expected, n, tv_max):.2g}; the chi-square detects a deviation of "
        f"TV >= {tv_max} with power >= {chi2_power(df, n, tv_max):.4f}."
    )


def assert_detected(tokens: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    pvalue, df, tv, impossible = goodness_of_fit(tokens, expected)
    assert impossible > 0 or pvalue < P_MIN, (
        f"negative control {what!r} passed the losslessness check (chi-square p={pvalue:.3g}, "
        f"df={df}, TV={tv:.4f}): the test cannot tell this bug from a correct sampler"
    )


def tv_distance(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p.double() - q.double()).abs().sum())


def one_step_output(p: torch.Tensor, drawn_from: torch.Tensor, claimed: torch.Tensor, residual: bool = True):
    """Exact output distribution of one draft drawn from `drawn_from`, verified with
    claimed proposal `claimed` (residual=False: resample from p on rejection)."""
    p, s, q = p.double(), drawn_from.double(), claimed.double()
    ratio = torch.where(q > 0, (p / q).clamp(max=1.0), (p > 0).double())
    accepted = s * ratio
    leftover = (p - q).clamp(min=0) if residual else p
    return accepted + (1 - accepted.sum()) * leftover / leftover.sum()


# ---- single step (vocab 16, 10^6 draws per case) -----------------------------------


def random_dist(gen: torch.Generator, scale: float = 1.5, zeros: int = 0) -> torch.Tensor:
    probs = torch.softmax(torch.randn(VOCAB, generator=gen) * scale, -1)
    probs[torch.randperm(VOCAB, generator=gen)[:zeros]] = 0
    return probs / probs.sum()


def first_tokens(
    p: torch.Tensor,  # [V] target (processed)
    drawn_from: torch.Tensor | None,  # [V] what drafts are sampled from (None: `fixed` tokens)
    claimed: torch.Tensor | None,  # [V] draft_probs given to the verifier; None = one-hot
    *,
    siblings: int = 1,
    fixed: list[int] | None = None,
    seed: int = 0,
    impl: str | None = None,
    n: int = N,
) -> torch.Tensor:
    """First emitted token of n independent verification steps on a depth-1 tree with
    `siblings` children of the root."""
    gen = torch.Generator().manual_seed(seed)
    nodes = 1 + siblings
    parents = torch.tensor([-1] + [0] * siblings).expand(n, -1).contiguous()
    if fixed is not None:
        tokens = torch.tensor([0] + fixed).expand(n, -1).contiguous()
    else:
        drafts = torch.multinomial(drawn_from, n * siblings, replacement=True, generator=gen)
        tokens = torch.cat([torch.zeros(n, 1, dtype=torch.int64), drafts.view(n, siblings)], 1)
    target = p.float().expand(n, nodes, -1).contiguous()
    draft = None if claimed is None else claimed.float().expand(n, nodes, -1).contiguous()
    coins = torch.rand(n, nodes, generator=gen)
    noise = torch.empty(n, VOCAB).exponential_(generator=gen)
    out = verify_tree_rejection(parents, tokens, target, draft, coins, noise, max_depth=1, impl=impl)
    return out.output_tokens[:, 0]


def single_step_cases():
    gen = torch.Generator().manual_seed(1234)
    p, q = random_dist(gen, zeros=2), random_dist(gen, zeros=1)
    low, high = torch.zeros(VOCAB), torch.zeros(VOCAB)
    low[:8], high[8:] = random_dist(gen)[:8], random_dist(gen)[8:]
    target_logits, draft_logits = torch.randn(VOCAB, generator=gen) * 2, torch.randn(VOCAB, generator=gen) * 2
    processing = dict(temperature=0.8, top_k=8, top_p=0.9)
    pp, qp = process_logits(target_logits, **processing), process_logits(draft_logits, **processing)
    top3 = q.argsort(descending=True, stable=True)[:3].tolist()
    return {
        "random q": (p, dict(drawn_from=q, claimed=q)),
        "random q (reference)": (p, dict(drawn_from=q, claimed=q, impl="reference")),
        "q equal to p": (p, dict(drawn_from=p, claimed=p)),
        "disjoint supports": (low / low.sum(), dict(drawn_from=high / high.sum(), claimed=high / high.sum())),
        "one-hot draft": (p, dict(drawn_from=None, claimed=None, fixed=[top3[0]])),
        "one-hot top-3 siblings": (p, dict(drawn_from=None, claimed=None, fixed=top3, siblings=3)),
        "3 sampled siblings": (p, dict(drawn_from=q, claimed=q, siblings=3)),
        "temperature+top-k+top-p on both": (pp, dict(drawn_from=qp, claimed=qp)),
    }


CASES = single_step_cases()


@pytest.mark.parametrize("name", list(CASES))
def test_single_step_output_is_the_target(name):
    p, kwargs = CASES[name]
    tokens = first_tokens(p, seed=zlib.crc32(name.encode()) % 1000, **kwargs)
    assert_lossless(tokens, p, 0.005, f"single step, {name}")


def test_negative_control_without_residual(monkeypatch):
    """On rejection, sample from the target p instead of the residual max(p - q, 0)."""
    p, kwargs = CASES["random q"]
    q = kwargs["claimed"]
    assert tv_distance(one_step_output(p, q, q, residual=False), p) > 0.05  # a large effect to detect
    monkeypatch.setattr(verify_ref, "reject_general", lambda r, m, q: (r, m))
    monkeypatch.setattr(verify_ref, "reject_one_hot", lambda r, m, x: (r, m))
    assert_detected(first_tokens(p, q, q, seed=7, impl="reference"), p, "no residual, sampled draft")
    top3 = q.argsort(descending=True)[:3].tolist()
    assert_detected(
        first_tokens(p, None, None, fixed=top3, siblings=3, seed=8, impl="reference"),
        p,
        "no residual, one-hot siblings",
    )


def _mismatch_case(seed: int, target_kw: dict, sampled_kw: dict, claimed_kw: dict):
    gen = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(VOCAB, generator=gen)
    draft_logits = target_logits + 0.5 * torch.randn(VOCAB, generator=gen)  # a drafter close to the target
    p = process_logits(target_logits, **target_kw)
    return p, process_logits(draft_logits, **sampled_kw), process_logits(draft_logits, **claimed_kw)


@pytest.mark.parametrize(
    "what, target_kw, sampled_kw, claimed_kw",
    [
        ("draft sampled after top-k 4, ratio from the unprocessed draft", dict(top_k=4), dict(top_k=4), dict()),
        (
            "draft sampled at temperature 0.5, probabilities reported at the target's 1.0",
            dict(temperature=1.0),
            dict(temperature=0.5),
            dict(temperature=1.0),
        ),
    ],
)
def test_negative_control_mismatched_draft_processing(what, target_kw, sampled_kw, claimed_kw):
    p, s, wrong = _mismatch_case(99, target_kw, sampled_kw, claimed_kw)
    assert tv_distance(one_step_output(p, s, wrong), p) > 0.05  # the bug has a large effect here
    assert_lossless(first_tokens(p, s, s, seed=21), p, 0.005, f"control for {what!r}: correct q")
    assert_detected(first_tokens(p, s, wrong, seed=22), p, what)


# ---- joint losslessness over 3-token continuations (Markov models, vocab 6) -----------

MV = 6
LENGTH = 3
TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]  # full binary tree, depth 3


def markov_tables(seed: int, processed: bool):
    gen = torch.Generator().manual_seed(seed)
    target_logits, draft_logits = torch.randn(MV, MV, generator=gen) * 1.5, torch.randn(MV, MV, generator=gen) * 1.5
    if processed:
        kw = dict(temperature=0.8, top_k=5, top_p=0.95)
        return process_logits(target_logits, **kw), process_logits(draft_logits, **kw)
    target = torch.softmax(target_logits, -1)
    target[torch.rand(MV, MV, generator=gen) < 0.15] = 0  # some impossible transitions
    target[:, 0] += 1e-3  # every row keeps some mass
    return target / target.sum(-1, keepdim=True), torch.softmax(draft_logits, -1)


def draft_step(strategy: str, target, draft, last, gen, impl):
    """One speculative step for every sequence in `last` [m]: (emitted tokens [m, D+1], count [m])."""
    m = last.numel()
    if strategy == "chain":
        parents = chain_parents(m, LENGTH)
        tokens = [last]
        for _ in range(LENGTH):
            tokens.append(torch.multinomial(draft[tokens[-1]], 1, generator=gen).squeeze(1))
        tokens = torch.stack(tokens, 1)
    else:
        parents = torch.tensor(TREE_PARENTS).expand(m, -1).contiguous()
        tokens = torch.zeros(m, len(TREE_PARENTS), dtype=torch.int64)
        tokens[:, 0] = last
        for parent in range(7):
            q = draft[tokens[:, parent]]
            if strategy == "tree top-2 one-hot":
                kids = q.argsort(dim=-1, descending=True, stable=True)[:, :2]
            else:  # "tree sampled siblings": two i.i.d. draws from the parent's q
                kids = torch.multinomial(q, 2, replacement=True, generator=gen)
            tokens[:, 2 * parent + 1 : 2 * parent + 3] = kids
    nodes = tokens.shape[1]
    target_probs = target[tokens]
    draft_probs = None
    if strategy != "tree top-2 one-hot":
        draft_probs = draft[tokens.gather(1, parents.clamp(min=0))]
    coins = torch.rand(m, nodes, generator=gen)
    noise = torch.empty(m, MV).exponential_(generator=gen)
    out = verify_tree_rejection(parents, tokens, target_probs, draft_probs, coins, noise, max_depth=LENGTH, impl=impl)
    return out.output_tokens, out.accept_length + 1


def continuations(strategy: str, target, draft, *, seed: int, n: int = N, impl=None, chunk: int = 250_000):
    """First LENGTH tokens after token 0, generated speculatively: [n] cell ids a*36+b*6+c."""
    gen = torch.Generator().manual_seed(seed)
    cells = []
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        seqs = torch.full((m, LENGTH), -1, dtype=torch.int64)
        filled = torch.zeros(m, dtype=torch.int64)
        last = torch.zeros(m, dtype=torch.int64)
        while bool((filled < LENGTH).any()):
            rows = (filled < LENGTH).nonzero().squeeze(1)
            emitted, count = draft_step(strategy, target, draft, last[rows], gen, impl)
            for k in range(emitted.shape[1]):
                pos = filled[rows] + k
                ok = (k < count) & (pos < LENGTH)
                seqs[rows[ok], pos[ok]] = emitted[ok, k]
            last[rows] = emitted.gather(1, (count - 1).unsqueeze(1)).squeeze(1)
            filled[rows] += count
        cells.append(seqs[:, 0] * MV * MV + seqs[:, 1] * MV + seqs[:, 2])
    return torch.cat(cells)


def exact_joint(target: torch.Tensor) -> torch.Tensor:
    first = target[0]
    return (first[:, None, None] * target[:, :, None] * target[None, :, :]).reshape(-1)


@pytest.mark.parametrize(
    "strategy, processed",
    [("chain", False), ("chain", True), ("tree top-2 one-hot", False), ("tree sampled siblings", False)],
)
def test_joint_three_token_continuations_follow_the_target(strategy, processed):
    target, draft = markov_tables(5, processed)
    tokens = continuations(strategy, target, draft, seed=6)
    what = f"3-token joint, {strategy}{' (temperature+top-k+top-p)' if processed else ''}"
    assert_lossless(tokens, exact_joint(target), 0.01, what)


def test_joint_negative_control_without_residual(monkeypatch):
    target, draft = markov_tables(5, False)
    monkeypatch.setattr(verify_ref, "reject_general", lambda r, m, q: (r, m))
    tokens = continuations("chain", target, draft, seed=6, impl="reference")
    assert_detected(tokens, exact_joint(target), "3-token joint, chain, no residual")


# ---- acceptance ---------------------------------------------------------------------


@pytest.mark.parametrize("one_hot", [False, True])
def test_acceptance_per_position_is_one_minus_tv(one_hot):
    """P(draft i accepted | drafts < i accepted) = sum_x min(p_i, q_i) = 1 - TV(p_i, q_i)
    for a draft sampled from q_i; p_i(x_i) for a fixed (one-hot) draft x_i."""
    n, depth = 200_000, 4
    gen = torch.Generator().manual_seed(17)
    p = torch.stack([random_dist(gen, scale=1.0) for _ in range(depth + 1)])  # p[i]: after node i
    q = torch.stack([random_dist(gen, scale=1.0) for _ in range(depth + 1)])  # q[i]: node i's draft
    parents = chain_parents(n, depth)
    if one_hot:
        fixed = [0] + [int(torch.randint(VOCAB, (), generator=gen)) for _ in range(depth)]
        tokens = torch.tensor(fixed).expand(n, -1).contiguous()
        expected = [float(p[i - 1, fixed[i]]) for i in range(1, depth + 1)]
        draft = None
    else:
        draws = [torch.multinomial(q[i], n, replacement=True, generator=gen) for i in range(depth + 1)]
        tokens = torch.stack(draws, 1)
        expected = [1 - tv_distance(p[i - 1], q[i]) for i in range(1, depth + 1)]
        draft = q.expand(n, -1, -1).contiguous()
    out = verify_tree_rejection(
        parents, tokens, p.expand(n, -1, -1).contiguous(), draft,
        torch.rand(n, depth + 1, generator=gen), torch.empty(n, VOCAB).exponential_(generator=gen),
    )
    for i, a in enumerate(expected, start=1):
        reached = int((out.accept_length >= i - 1).sum())
        rate = int((out.accept_length >= i).sum()) / reached
        sd = math.sqrt(a * (1 - a) / reached)
        assert abs(rate - a) <= 4 * sd, (
            f"position {i}: acceptance {rate:.4f} vs 1 - TV = {a:.4f} (4 sd = {4 * sd:.4f}, n = {reached})"
        )


def test_greedy_drafter_identical_to_target_is_always_accepted():
    gen = torch.Generator().manual_seed(3)
    batch, vocab = 64, 1000
    target = torch.softmax(torch.randn(batch, len(TREE_PARENTS), vocab, generator=gen) * 3, -1)
    parents = torch.tensor(TREE_PARENTS).expand(batch, -1).contiguous()
    tokens = torch.randint(vocab, (batch, len(TREE_PARENTS)), generator=gen)
    for node in range(1, len(TREE_PARENTS), 2):  # first child of each node: the target's argmax
        tokens[:, node] = target[:, TREE_PARENTS[node]].argmax(-1)
    out = verify_tree_greedy(parents, tokens, target)
    assert out.accept_length.tolist() == [3] * batch
    assert out.accept_index[:, 1:].tolist() == [[1, 3, 7]] * batch
    chain = verify_tree_greedy(chain_parents(batch, 3), tokens[:, [0, 1, 3, 7]], target[:, [0, 1, 3, 7]])
    assert chain.accept_length.tolist() == [3] * batch
