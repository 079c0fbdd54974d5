"""Kernel plans kept for "same seed -> same tokens" (rollout/linear_plans.py): the plan
file round-trips, keeps what is already in it, refuses another GPU's file; planners that
share a file (or the process's shared planner) make one choice where planners timing on
their own may not. The timing itself runs in tests/gpu (test_engine_gpu.py)."""

import json

import pytest
import torch

from megatron_tlt.errors import ConfigError
from megatron_tlt.rollout.linear_plans import CUBLAS, PLANS_ENV, LinearConfig, PlanCache, PlanFile, plan_file_from_env

DOT = LinearConfig("dot", block_m=16, block_n=32, block_k=128, splits=4, num_warps=4, num_stages=4)
FMA = LinearConfig("fma", block_m=1, block_n=8, block_k=512, splits=2, num_warps=4, num_stages=3)


def _plans():
    return ({(1, 1536, 8960, torch.bfloat16, True): (DOT, 7.5),
             (4, 256, 1536, torch.float32, False): (CUBLAS, 3.25)},
            {("norm", 1, 1536, 1536, 2, torch.bfloat16): (FMA, 4.0, 5.0),
             ("silu", 1, 1536, 8960, 1, torch.bfloat16): (None, 6.0, 5.5)})


def test_plan_file_round_trip(tmp_path):
    f = PlanFile(str(tmp_path / "sub" / "plans.json"), "NVIDIA H200")
    assert f.read() == ({}, {})  # not written yet
    plans, fused = _plans()
    f.write(plans, fused)
    assert f.read() == (plans, fused)
    raw = json.loads((tmp_path / "sub" / "plans.json").read_text())
    assert raw["device"] == "NVIDIA H200" and len(raw["plans"]) == 2 and len(raw["fused"]) == 2
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["plans.json"]  # no temporary left


def test_plan_file_keeps_entries_already_written(tmp_path):
    path = str(tmp_path / "plans.json")
    plans, fused = _plans()
    PlanFile(path, "gpu").write(plans, fused)
    key = next(iter(plans))
    other = {key: (CUBLAS, 1.0), (2, 8, 8, torch.float16, True): (FMA, 2.0)}
    PlanFile(path, "gpu").write(other, {})  # a second writer: its new key lands, not its `key`
    got, got_fused = PlanFile(path, "gpu").read()
    assert got[key] == plans[key] and got[(2, 8, 8, torch.float16, True)] == (FMA, 2.0)
    assert len(got) == 3 and got_fused == fused


def test_plan_file_refuses_another_gpu_and_malformed_files(tmp_path):
    path = tmp_path / "plans.json"
    PlanFile(str(path), "NVIDIA H100").write(*_plans())
    with pytest.raises(ConfigError, match="H100.*this GPU is 'NVIDIA H200'"):
        PlanFile(str(path), "NVIDIA H200").read()
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        PlanFile(str(path), "x").read()
    path.write_text(json.dumps({"format": 1, "device": "x", "plans": [{"key": [1], "config": {"kind": "tpu"}, "us": 1}]}))
    with pytest.raises(ConfigError, match="malformed"):
        PlanFile(str(path), "x").read()
    path.write_text(json.dumps([1, 2]))
    with pytest.raises(ConfigError, match="not a linear plan file"):
        PlanFile(str(path), "x").read()


class _Noisy(PlanCache):
    """A planner whose 'timing' picks a different config on every call, like two candidates
    whose timings lie within noise of each other."""

    picks = [DOT, FMA, CUBLAS]

    def __init__(self, plan_file=None, start=0):
        super().__init__(plan_file)
        self.calls = start

    def choose(self, key):
        def tune():
            self.calls += 1
            return (self.picks[self.calls % len(self.picks)], 1.0)
        return self._choose(self.plans, key, tune)[0]


KEY = (1, 1536, 1536, torch.bfloat16, True)


def test_planners_timing_alone_may_disagree():
    # Control: two planners timing on their own choose differently (the failure mode).
    assert _Noisy(start=0).choose(KEY) != _Noisy(start=1).choose(KEY)


def test_planners_sharing_a_file_choose_the_same(tmp_path):
    path = str(tmp_path / "plans.json")
    a = _Noisy(PlanFile(path, "gpu"), start=0)
    first = a.choose(KEY)
    assert a.num_tuned == 1 and a.choose(KEY) == first and a.num_tuned == 1  # cached
    b = _Noisy(PlanFile(path, "gpu"), start=1)  # a later run: reads the file, times nothing
    assert b.choose(KEY) == first and b.num_tuned == 0
    # A planner that started before the file had the key re-reads it instead of timing.
    c = _Noisy(PlanFile(str(tmp_path / "late.json"), "gpu"), start=1)
    c.plan_file = PlanFile(path, "gpu")
    assert c.choose(KEY) == first and c.num_tuned == 0
    other = (2,) + KEY[1:]
    assert c.choose(other) is not None and c.num_tuned == 1
    assert set(PlanFile(path, "gpu").read()[0]) == {KEY, other}


def test_shared_planner_is_one_per_device_and_reads_the_env(monkeypatch, tmp_path):
    monkeypatch.setattr(PlanCache, "_shared", {})
    a, b = _Noisy.shared("cpu"), _Noisy.shared(torch.device("cpu"))
    assert a is b and a.plan_file is None  # no file on a CPU device, env or not
    assert PlanCache.shared("cpu") is not a  # one per planner class
    monkeypatch.setenv(PLANS_ENV, str(tmp_path / "p.json"))
    assert plan_file_from_env(torch.device("cpu")) is None
    if torch.cuda.is_available():
        assert plan_file_from_env(torch.device("cuda")).path == str(tmp_path / "p.json")
