"""Losslessness end to end: at temperature 1, tokens emitted by speculative steps have the
target's distribution (chi-square against the exact distribution of a tiny-vocabulary
model), for a sampled EAGLE chain (draft_probs) and a top-k tree (one-hot); a drafter
whose reported draft_probs differ from what it sampled from must fail the same test."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from spec_testutil import make_hf_model, one_thread, random_eagle, run  # noqa: E402,F401

from megatron_tlt.rollout import Request, SamplingParams  # noqa: E402
from megatron_tlt.spec.decode import Drafter  # noqa: E402
from megatron_tlt.spec.eagle import EagleProposer  # noqa: E402
from megatron_tlt.spec.tree import Strategy  # noqa: E402

VOCAB = 6
PROMPT = [1, 4, 2]
N = 2500
P_MIN = 1e-3  # a correct sampler fails with probability 1e-3 per test (over seeds)


@pytest.fixture(scope="module")
def tiny_vocab_model(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("spec_stats"))
    model = make_hf_model("llama", d, vocab_size=VOCAB, seed=5, tie=False)
    return d, model


def exact_joint(model) -> torch.Tensor:
    """P(x1 = a, x2 = b) [V, V] of output tokens 1 and 2 (x0 marginalised), T = 1."""
    v = VOCAB
    seqs = torch.tensor([PROMPT + [x0, x1] for x0 in range(v) for x1 in range(v)])
    with torch.no_grad():
        probs = torch.softmax(model(seqs).logits.double(), -1)
    p0 = probs[0, len(PROMPT) - 1]  # [v]
    p1 = probs.view(v, v, -1, v)[:, 0, len(PROMPT)]  # p(x1 | x0): [x0, v]
    p2 = probs.view(v, v, -1, v)[:, :, len(PROMPT) + 1]  # p(x2 | x0, x1): [x0, x1, v]
    return torch.einsum("a,ab,abc->bc", p0, p1, p2)


def sample_joint(model_dir, drafter, strategy) -> tuple[torch.Tensor, dict]:
    params = SamplingParams(temperature=1.0, max_new_tokens=4, seed=11)
    reqs = [Request(prompt_id="p", sample_index=i, prompt_token_ids=PROMPT, sampling_params=params)
            for i in range(N)]
    res, engine = run(model_dir, reqs, drafter, strategy, max_num_seqs=512, num_blocks=1100)
    counts = torch.zeros(VOCAB, VOCAB)
    for r in res:
        counts[r.token_ids[1], r.token_ids[2]] += 1
    return counts, engine.spec_decoder.metrics.summary()["total"]


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    from scipy.stats import chisquare
    expected = probs.flatten() * counts.sum()
    obs = counts.flatten()
    small = expected < 5  # pool rare cells so the chi-square approximation holds
    e = torch.cat([expected[~small], expected[small].sum()[None]]) if small.any() else expected
    o = torch.cat([obs[~small], obs[small].sum()[None]]) if small.any() else obs
    return float(chisquare(o.numpy(), e.numpy()).pvalue)


class _MisreportedProbs(Drafter):
    """Negative control: proposes like the inner drafter but reports q^3 (renormalised)
    as the draft distribution — what a drafter processing its logits differently from
    how it sampled would do."""

    def __init__(self, inner):
        self.inner, self.name, self.feature = inner, "broken", inner.feature

    def observe(self, seq, start, hidden):
        self.inner.observe(seq, start, hidden)

    def release(self, seq):
        self.inner.release(seq)

    def propose(self, seqs, strategy, caps, running):
        trees = self.inner.propose(seqs, strategy, caps, running)
        for t in trees:
            if t.draft_probs is not None:
                q = t.draft_probs ** 3
                t.draft_probs = q / q.sum(-1, keepdim=True).clamp(min=1e-30)
        return trees


@pytest.mark.slow
def test_spec_sampling_matches_target_distribution(tiny_vocab_model):
    model_dir, model = tiny_vocab_model
    exact = exact_joint(model).float()
    chain, tree = Strategy(depth=2), Strategy(depth=2, topk=2)
    for strategy in (chain, tree):
        counts, total = sample_joint(model_dir, lambda e: EagleProposer(random_eagle(e, seed=3)), strategy)
        assert 0.05 < total["acceptance_rate"] < 0.95, total  # drafts both kept and rejected
        p = chi_square_p(counts, exact)
        tv = 0.5 * float((counts / N - exact).abs().sum())
        assert p > P_MIN, (f"{strategy}: emitted tokens do not follow the target distribution "
                           f"(chi-square p = {p:.2e}, TV = {tv:.3f}); a correct sampler fails "
                           f"this with probability {P_MIN}")
    counts, _ = sample_joint(model_dir, lambda e: _MisreportedProbs(EagleProposer(random_eagle(e, seed=3))),
                             chain)
    p = chi_square_p(counts, exact)
    assert p < P_MIN, f"negative control passed (p = {p:.2e}): the test cannot see a biased sampler"
