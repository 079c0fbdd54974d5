"""tools/drafter_acceptance.py: the closed forms of one draft level's acceptance by
proposal rule, checked at their edges and against the reference verifier by simulation;
and the tool end to end on a drafter trained for a few steps."""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import torch

from megatron_tlt.spec.verify_ref import verify_tree_rejection_ref

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "drafter_acceptance.py"
_spec = importlib.util.spec_from_file_location("drafter_acceptance", TOOL)
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)


def _rows(v: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(n, v, generator=g) * 1.5, -1)


def test_edges():
    p = _rows(16, 5, 0)
    same = tool.level_acceptance(p, p)
    for key in ("chain", "iid_2", "iid_4"):
        assert torch.allclose(same[key], torch.ones(5, dtype=torch.float64))
    top2 = p.double().sort(-1, descending=True).values[:, :2].sum(-1)
    assert torch.allclose(same["top_2"], top2)
    a = torch.zeros(1, 4)
    a[0, :2] = 0.5
    b = torch.zeros(1, 4)
    b[0, 2:] = 0.5
    apart = tool.level_acceptance(a, b)  # q's two tokens: p has none of them
    assert all(float(apart[k]) == 0.0 for k in ("chain", "iid_2", "iid_4", "top_1", "top_2"))
    assert float(apart["top_3"]) == 0.5  # a third proposal reaches p's support


def test_iid_siblings_match_the_reference_verifier():
    """Two siblings drawn i.i.d. from q, verified by verify_tree_rejection_ref with q as
    both rows' draft distribution: the fraction of 200,000 trials that emit a draft token
    equals iid_2 within 4 binomial standard deviations (seeded); the one-sibling form
    (chain) is more than 4 deviations off (the comparison can fail)."""
    v, n = 8, 200_000
    p, q = _rows(v, 1, 1), _rows(v, 1, 2)
    form = tool.level_acceptance(p, q)
    g = torch.Generator().manual_seed(3)
    draws = torch.multinomial(q.expand(n, v), 2, replacement=True, generator=g)
    parents = torch.tensor([[-1, 0, 0]]).expand(n, 3)
    tokens = torch.cat([torch.zeros(n, 1, dtype=torch.int64), draws], 1)
    target = p.expand(n, 3, v).contiguous()
    draft = q.expand(n, 3, v).contiguous()
    coins = torch.rand(n, 3, generator=g)
    noise = torch.empty(n, v).exponential_(generator=g)
    _, length, _ = verify_tree_rejection_ref(parents, tokens, target, draft, coins, noise, max_depth=1)
    rate = float((length >= 1).double().mean())
    expect = float(form["iid_2"][0])
    sd = math.sqrt(expect * (1 - expect) / n)
    assert abs(rate - expect) < 4 * sd, (rate, expect, sd)
    assert abs(rate - float(form["chain"][0])) > 4 * sd
    assert float(form["iid_2"][0]) > float(form["chain"][0])


def test_tool_end_to_end(tmp_path):
    """The shipped tiny drafter on 6 fresh responses of the tiny default: every rule
    reported, ordered as the forms must be (more siblings or more proposals, more
    acceptance), and a trained drafter's first level accepted more often than not."""
    target = str(REPO / "megatron_tlt" / "assets" / "tiny_default")
    report_path = tmp_path / "acc.json"
    r = subprocess.run([sys.executable, str(TOOL), "--target", target, "--drafter",
                        str(REPO / "megatron_tlt" / "assets" / "tiny_drafter"), "--tasks", "sort",
                        "--num-prompts", "6", "--max-new-tokens", "48", "--json", str(report_path)],
                       capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr
    rep = json.loads(report_path.read_text())
    assert rep["positions"] > 50
    assert rep["chain"] <= rep["iid_2"] <= rep["iid_3"] <= rep["iid_4"] <= 1
    assert rep["top_1"] <= rep["top_2"] <= rep["top_4"] <= 1
    assert rep["chain"] > 0.5


def test_bad_arguments_are_refused_before_loading(capsys):
    """A NaN --temperature passed the `<= 0` check and was written as NaN (invalid JSON);
    --num-prompts 0 was a `max() arg is an empty sequence` traceback."""
    import pytest

    for bad in (["--temperature", "nan"], ["--temperature", "0"], ["--num-prompts", "0"]):
        with pytest.raises(SystemExit, match="drafter_acceptance: "):
            tool.main(["--target", "no/such/target", "--drafter", "no/such/drafter",
                       "--tasks", "arith", *bad])
