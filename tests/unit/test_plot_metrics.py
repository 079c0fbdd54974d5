import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
TOOL = Path(__file__).resolve().parents[2] / "tools" / "plot_metrics.py"


def test_plots_written(tmp_path):
    m = tmp_path / "metrics.jsonl"
    m.write_text("".join(json.dumps({"step": s, "reward_mean": s / 10, "len_p50": 10 + s, "t_rollout": 1.0,
                                     "t_update": 0.5}) + "\n" for s in range(1, 6)) + "{cut sho")
    p = subprocess.run([sys.executable, str(TOOL), str(m), "--out", str(tmp_path / "plots")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    names = sorted(x.name for x in (tmp_path / "plots").iterdir())
    assert names == ["lengths.png", "phase_times.png", "reward.png"]  # no acceptance/loss metrics logged
    assert "skipping a line" in p.stderr


def test_bucket_panels(tmp_path):
    """Per-bucket metrics (t_rollout_b*, accept_len_b*) are found by prefix, whichever
    buckets a run logged."""
    sys.path.insert(0, str(TOOL.parent))
    try:
        import plot_metrics
    finally:
        sys.path.pop(0)
    rows = [{"step": 1, "t_rollout": 2.0, "t_rollout_tail": 1.5, "t_rollout_b33_up": 0.5, "t_rollout_b1": 1.5},
            {"step": 2, "t_rollout": 2.0, "t_rollout_tail": 1.0, "t_rollout_b17_32": 1.0, "accept_len_b1": 2.5}]
    names = sorted(Path(p).name for p in plot_metrics.plot(rows, str(tmp_path)))
    assert names == ["acceptance.png", "phase_times.png", "rollout_time.png"]


def test_missing_file(tmp_path):
    p = subprocess.run([sys.executable, str(TOOL), str(tmp_path / "nope.jsonl")], capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.startswith("error: metrics file not found")
