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


def test_missing_file(tmp_path):
    p = subprocess.run([sys.executable, str(TOOL), str(tmp_path / "nope.jsonl")], capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.startswith("error: metrics file not found")
