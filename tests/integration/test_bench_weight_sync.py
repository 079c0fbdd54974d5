"""tools/bench_weight_sync.py on CPU (tiny shape, float32): one process, and TP=2 under
torchrun (gloo). The figures are not asserted (a benchmark); the sync check is: the
engine's logits differ from the actor's before the sync and equal them after."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_weight_sync.py"


def _check(path, tp):
    r = json.loads(Path(path).read_text())
    assert r["tp"] == tp and r["world"] == tp and r["dtype"] == "float32" and r["git_revision"]
    assert r["command"].endswith(f"--json {path}")
    assert r["logits_max_abs_diff_before"] > 1e-2, "negative control: random engine weights must disagree"
    assert r["logits_max_abs_diff_after"] < 1e-5
    assert r["data_ptrs_unchanged"] and r["bytes"] > 0 and len(r["seconds"]) == 2
    return r


def test_bench_weight_sync_one_process(tmp_path):
    out = tmp_path / "sync.json"
    p = subprocess.run([sys.executable, str(TOOL), "--shape", "tiny", "--repeats", "2", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-2000:]
    r = _check(out, 1)
    assert r["policy_version"] == 3  # warm-up sync (1), then 2 and 3


@pytest.mark.parametrize("tp", [2])
def test_bench_weight_sync_tp2(tmp_path, run_torchrun, tp):
    out = tmp_path / "sync.json"
    run_torchrun(TOOL, tp, ["--shape", "tiny", "--tp", str(tp), "--repeats", "2", "--json", str(out)], timeout=300)
    _check(out, tp)


def test_repeats_must_be_positive():
    """--repeats 0 was an IndexError (runs[0] of no runs) on every rank after the setup."""
    p = subprocess.run([sys.executable, str(TOOL), "--shape", "tiny", "--repeats", "0"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--repeats must be >= 1, got 0" in p.stderr, p.stderr[-2000:]
