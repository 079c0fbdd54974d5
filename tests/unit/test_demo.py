import json

from megatron_tlt import cli


def test_demo_runs_end_to_end(tmp_path):
    """The Quick start's main job: conversion, actor forward equal to HF, rollouts."""
    out = tmp_path / "demo"
    assert cli.main(["demo", "--out-dir", str(out), "--n", "2"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["actor_vs_hf_max_abs_diff"] < 1e-4
    assert (out / "mcore" / "tlt_model.json").exists()
