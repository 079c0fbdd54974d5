"""The JSONL metrics writer: one flushed line per step, JSON-safe values, rank-0 only,
resume truncation, optional TensorBoard."""

from __future__ import annotations

import importlib.util
import json
import math
import os

import torch

from megatron_tlt.metrics import MetricsWriter, read_metrics


def test_lines_are_flushed_and_json_safe(tmp_path):
    w = MetricsWriter(str(tmp_path), enabled=True)
    w.log(1, {"loss": torch.tensor(2.5), "grad_norm": math.nan, "skipped": False, "name": "a"})
    # flushed: readable before close
    recs = read_metrics(os.path.join(str(tmp_path), "metrics.jsonl"))
    assert recs[0]["step"] == 1 and recs[0]["loss"] == 2.5 and recs[0]["grad_norm"] is None
    assert recs[0]["skipped"] is False and recs[0]["name"] == "a" and isinstance(recs[0]["time"], float)
    w.log(2, {"loss": 1.0})
    w.close()
    assert [r["step"] for r in read_metrics(w.path)] == [1, 2]


def test_resume_drops_lines_after_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": s}) + "\n" for s in range(1, 6)) + '{"step": 6, "lo')
    with MetricsWriter(str(tmp_path), enabled=True, resume_step=3) as w:
        w.log(4, {"loss": 40})
    assert [(r["step"], r["loss"]) for r in read_metrics(str(path))] == [(1, 1), (2, 2), (3, 3), (4, 40)]
    # a fresh run moves an old file out of the way instead of appending to it
    with MetricsWriter(str(tmp_path), enabled=True) as w:
        w.log(1, {"loss": 9})
    assert [r["loss"] for r in read_metrics(str(path))] == [9]
    assert (tmp_path / "metrics.jsonl.old").exists()


def test_other_ranks_write_nothing(tmp_path):
    w = MetricsWriter(str(tmp_path / "r1"), enabled=False, tensorboard=True)
    w.log(1, {"loss": 1.0})
    w.close()
    assert not (tmp_path / "r1").exists()


def test_tensorboard_is_optional(tmp_path, caplog):
    have_tb = importlib.util.find_spec("tensorboard") is not None
    with MetricsWriter(str(tmp_path), enabled=True, tensorboard=True) as w:
        w.log(1, {"loss": 1.0, "text": "x"})
    assert read_metrics(w.path)[0]["loss"] == 1.0
    if have_tb:
        assert any(n.startswith("events.") for n in os.listdir(tmp_path / "tensorboard"))
    else:
        assert "TensorBoard is unavailable" in caplog.text
