"""tools/linear_sweep.py without a GPU: its wider config set is new to the planner and
valid for the kernel (a sample of it computes x @ W.T under Triton's interpreter, float32),
and its correctness gate keeps a config whose output disagrees with F.linear out of the
timings (negative control: a wrong reference). Skipped without triton (CI)."""

import sys
from pathlib import Path

import pytest
import torch

from rollout_testutil import triton_interpreter  # noqa: E402

pytestmark = triton_interpreter()

import torch.nn.functional as F  # noqa: E402

from megatron_tlt.rollout import triton_linear as tlin  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))
import linear_sweep as ls  # noqa: E402


@pytest.mark.parametrize("m,n,k", [(1, 2048, 1536), (1, 1536, 8960), (32, 3584, 3584), (8, 4608, 3584)])
def test_wider_configs_are_new_and_split_k_fits(m, n, k):
    wide = ls.wider_configs(m, n, k)
    known = {str(c) for c in tlin.candidate_configs(m, n, k)}
    names = [str(c) for c in wide]
    assert wide and len(set(names)) == len(names) and not set(names) & known
    assert any(c.num_warps == 8 for c in wide) and any(c.block_k == 256 for c in wide)
    assert all(c.splits == 1 or k // c.splits >= c.block_k for c in wide)
    assert all(c.block_m >= 16 and c.block_m >= m for c in wide if c.kind == "dot")
    assert any(c.kind == "fma" for c in wide) == (m == 1)


def test_a_sample_of_them_computes_the_product():
    g = torch.Generator().manual_seed(0)
    for m, n, k in ((1, 24, 2304), (5, 40, 1024)):
        x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
        wide = ls.wider_configs(m, n, k)
        picks = {(c.kind, c.block_k, c.num_warps, c.num_stages): c for c in wide}  # one per kind of change
        assert len(picks) >= (5 if m == 1 else 3), sorted(picks)
        for cfg in picks.values():
            got = tlin.linear_partials(x, w, cfg).sum(0)
            torch.testing.assert_close(got, x @ w.T, atol=2e-4, rtol=1e-5, msg=str(cfg))


def test_a_config_that_disagrees_with_the_reference_is_left_out(monkeypatch):
    monkeypatch.setattr(tlin, "_time_us", lambda call, n: 1.0)  # timing needs a GPU
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(1, 512, generator=g), torch.randn(16, 512, generator=g)
    cfgs = [c for c in ls.wider_configs(1, 16, 512) if c.kind == "fma"][:2]
    ref = F.linear(x, w)
    good = ls.time_configs(cfgs, x, [w], ref, 4)
    assert all(r["us"] == 1.0 and r["max_abs_diff"] < 1e-3 for r in good.values()), good
    assert ls.best(good)[1] == 1.0
    bad = ls.time_configs(cfgs, x, [w], -ref, 4)  # negative control
    assert all(r["us"] is None for r in bad.values()) and ls.best(bad) == (None, float("inf"))
