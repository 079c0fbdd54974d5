"""`megatron-tlt bench rollout` end to end on CPU with the tiny shape: the code path runs and
the JSON holds what the GPU run reports. No assertion on time (benchmarks are not tests)."""

import json
import os

import pytest
import torch

if not torch.cuda.is_available():  # the triton-backend case runs the kernels interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

from megatron_tlt.cli import EXIT_INTERRUPTED, main  # noqa: E402

TINY = ["--shapes", "tiny", "--steps", "2", "--repeats", "1", "--warmup", "1",
        "--prompt-len", "8", "--device", "cpu"]


def _run(tmp_path, *extra) -> dict:
    path = tmp_path / "bench.json"
    assert main(["bench", "rollout", "--json", str(path), *TINY, *extra]) == 0
    return json.loads(path.read_text())


def test_bench_rollout_cpu_torch_backend_with_hf_baseline(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MEGATRON_TLT_TEST_RECORDED", "7")
    monkeypatch.setenv("MEGATRON_TLT_GIT_REV", "0" * 40)
    report = _run(tmp_path, "--batch-sizes", "1,2", "--hf-batch-sizes", "2", "--hf-modes", "eager",
                  "--compare-pdl", "--compare-fused-rope", "--compare-merge", "--compare-split-min",
                  "--compare-preload", "64", "--compare-attr", "env:MEGATRON_TLT_TEST_KNOB=8")
    for key in ("command", "git_revision", "torch", "triton", "device", "bandwidth", "results", "hf"):
        assert key in report
    assert report["errors"] == []
    # --compare-pdl is recorded; without CUDA graphs (CPU) there is nothing to compare
    assert report["settings"]["compare_pdl"] is True
    assert all("decode_ms_pdl" not in r and r["of_roofline_pdl"] is None for r in report["results"])
    assert report["settings"]["compare_fused_rope"] is True and report["settings"]["compare_merge"] is True
    assert report["settings"]["compare_split_min"] is True
    assert report["settings"]["compare_preload_kb"] == 64
    assert report["settings"]["compare_attr"] == ["env:MEGATRON_TLT_TEST_KNOB=8"]
    # the run's MEGATRON_TLT_* settings (not the compared side's knob, not the revision)
    env = report["settings"]["environment"]
    assert env["MEGATRON_TLT_TEST_RECORDED"] == "7"
    assert "MEGATRON_TLT_TEST_KNOB" not in env and "MEGATRON_TLT_GIT_REV" not in env
    assert report["git_revision"] == "0" * 40
    assert all("decode_ms_attr0" not in r for r in report["results"])  # no graphs on CPU
    assert all("decode_ms_split_min" not in r for r in report["results"])
    assert all(r["of_roofline_fused_rope"] is None and r["of_roofline_merge_in_kernel"] is None
               for r in report["results"])
    assert report["command"].startswith("megatron-tlt bench rollout --json ")
    assert "--shapes tiny" in report["command"]
    assert report["bandwidth"]["roofline_GBps"] >= report["bandwidth"]["copy_rw_GBps"] > 0
    rows = {r["batch"]: r for r in report["results"]}
    assert sorted(rows) == [1, 2]
    for b, r in rows.items():
        assert r["decode_ms"] > 0 and r["roofline_ms"] > 0 and r["bytes"] > r["kv_bytes"] > 0
        assert r["of_roofline"] == pytest.approx(r["roofline_ms"] / r["decode_ms"])
    assert rows[2]["kv_bytes"] == 2 * rows[1]["kv_bytes"]
    hf = report["hf"][0]
    assert "error" not in hf, hf
    # (a differenced wall time: no sign check, CI machines are noisy and this is no benchmark)
    assert hf["batch"] == 2 and hf["mode"] == "eager" and hf["hf_ms_per_step"] is not None
    assert rows[2]["hf_ms_by_mode"] == {"eager": hf["hf_ms_per_step"]}
    # fp32 on CPU: HF generate and the engine agree on every token (same weights, prompts).
    assert hf["mean_tokens_agreeing_with_engine"] == 2 + 2
    assert "hf_over_engine" in rows[2]  # None when the noisy differenced time came out <= 0
    out = capsys.readouterr().out
    assert "of_roof" in out and "hf/engine" in out


def test_bench_rollout_cpu_triton_backend_device_loop(tmp_path):
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton interpreter is set up only on CPU-only machines")
    report = _run(tmp_path, "--batch-sizes", "3", "--no-hf", "--backend", "triton")
    assert report["attention_backend"] == "triton" and report["cuda_graphs"] is False
    assert report["errors"] == []
    (row,) = report["results"]
    assert row["batch"] == 3 and row["decode_ms"] > 0 and row["engine_ms_per_step"] != 0


def test_device_loop_fused_advance_walks_the_same_inputs(monkeypatch):
    """bench.FUSED_ADVANCE (the loop's argmax and input update in one kernel) leaves the
    runner's input buffer exactly where the torch ops do after the same steps (tokens,
    positions, slots, context lengths, torch.equal); the Triton interpreter, no graphs."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton interpreter is set up only on CPU-only machines")
    from megatron_tlt import bench
    from megatron_tlt.models.arch import ModelArch
    from megatron_tlt.rollout import EngineWeights, RolloutEngine

    arch = ModelArch(**bench.SHAPES["tiny"])
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, arch.vocab_size, (3, 5), generator=g).tolist()
    metas = []
    for fused in (False, True):
        monkeypatch.setattr(bench, "FUSED_ADVANCE", fused)
        eng = RolloutEngine(arch, EngineWeights.make_dummy(arch, seed=1), max_num_seqs=4, num_blocks=32,
                            block_size=4, max_model_len=40, attention_backend="triton")
        assert bench.time_device_decode(eng, prompts, steps=3, repeats=2, warmup=1) > 0
        metas.append(eng.decode_runner._meta.clone())
    assert torch.equal(metas[0], metas[1])
    assert int(metas[0][0, 1]) == 5 + 1 + 3 * 2  # the position after 5 prompt tokens, 1 + 6 steps


def test_variant_table_sets_the_ab_timings_side_by_side():
    from megatron_tlt.bench import variant_table
    assert variant_table([{"shape": "1.5b", "batch": 1, "decode_ms": 1.5}]) == []
    rows = [{"shape": "1.5b", "batch": 1, "decode_ms": 1.5, "decode_ms_fused_rope": 1.2,
             "decode_ms_merge_in_kernel": None},
            {"shape": "1.5b", "batch": 8, "decode_ms": 1.6, "decode_ms_merge_in_kernel": 2.0}]
    head, one, eight = variant_table(rows)
    assert head.split() == ["shape", "B", "decode_ms", "fused_rope_ms", "merge_in_kernel_ms"]
    assert one.split() == ["1.5b", "1", "1.500", "1.200", "(1.250x)", "-", "(-x)"]
    assert eight.split() == ["1.5b", "8", "1.600", "-", "(-x)", "2.000", "(0.800x)"]


def test_compare_attr_parses_and_titles_its_column():
    from megatron_tlt.bench import parse_attr, parse_attrs, variant_table
    from megatron_tlt.rollout import pdl  # imports without triton (CI has none)
    mod, name, val = parse_attr("megatron_tlt.rollout.pdl:_preload=8")
    assert mod is pdl and name == "_preload" and val == 8
    assert parse_attr("megatron_tlt.rollout.pdl:_preload=None")[2] is None
    env, name, val = parse_attr("env:MEGATRON_TLT_TEST_KNOB=32")
    assert (name, val) == ("MEGATRON_TLT_TEST_KNOB", "32")
    setattr(env, name, val)
    try:
        assert os.environ["MEGATRON_TLT_TEST_KNOB"] == "32" and getattr(env, name) == "32"
    finally:
        setattr(env, name, None)
    assert "MEGATRON_TLT_TEST_KNOB" not in os.environ and getattr(env, name) is None
    both = parse_attrs("megatron_tlt.rollout.pdl:_preload=2; megatron_tlt.rollout.pdl:_active=True")
    assert [(n, v) for _, n, v in both] == [("_preload", 2), ("_active", True)]
    rows = [{"shape": "1.5b", "batch": 1, "decode_ms": 1.5, "decode_ms_attr0": 1.0,
             "attr0": "megatron_tlt.rollout.gpu_model:NORM_WARPS=8", "decode_ms_attr1": 3.0,
             "attr1": "megatron_tlt.rollout.triton_attention:COMBINE_WARPS=2;"
                      "megatron_tlt.rollout.triton_attention:_MIN_TILES=4"}]
    head, one = variant_table(rows)
    assert head.split() == ["shape", "B", "decode_ms", "NORM_WARPS=8",
                            "COMBINE_WARPS=2;_MIN_TILES=4"[:24]]
    assert one.split() == ["1.5b", "1", "1.500", "1.000", "(1.500x)", "3.000", "(0.500x)"]


@pytest.mark.parametrize("spec,msg", [
    ("megatron_tlt.rollout.pdl:_preload", "expected MODULE:NAME=VALUE"),
    ("megatron_tlt.rollout.pdl:NO_SUCH=1", "has no attribute NO_SUCH"),
    ("megatron_tlt.no_such_module:X=1", "cannot import"),
    ("megatron_tlt.rollout.pdl:_preload=eight", "is not a Python literal"),
    ("megatron_tlt.rollout.pdl:_preload=8;megatron_tlt.rollout.pdl:X=1", "has no attribute X"),
])
def test_compare_attr_bad_spec_fails_before_timing(spec, msg, capsys):
    assert main(["bench", "rollout", "--device", "cpu", "--compare-attr", spec]) == 2
    assert msg in capsys.readouterr().err


def test_bench_bad_input(tmp_path, capsys):
    assert main(["bench", "rollout", "--shapes", "huge", "--device", "cpu"]) == 2
    assert "unknown shape 'huge'" in capsys.readouterr().err
    assert main(["bench", "rollout", "--hf-modes", "jit", "--device", "cpu"]) == 2
    assert "--hf-modes takes compiled and/or eager" in capsys.readouterr().err
    assert main(["bench", "e2e"]) == 2
    assert "not implemented" in capsys.readouterr().err


def test_bench_rollout_keeps_the_shapes_done_when_a_later_one_dies(tmp_path, monkeypatch):
    """A run cut short (a time limit, a crash the shape loop cannot catch) leaves the JSON of
    the shapes already timed, marked incomplete; a run that ends says complete."""
    from megatron_tlt import bench
    real, calls = bench.run_shape, []

    def run_shape(name, *a, **k):
        calls.append(name)
        if len(calls) == 2:
            raise KeyboardInterrupt  # not an Exception: the shape loop does not catch it
        return real(name, *a, **k)

    monkeypatch.setattr(bench, "run_shape", run_shape)
    path = tmp_path / "bench.json"
    args = ["bench", "rollout", "--json", str(path), *TINY, "--batch-sizes", "1", "--no-hf"]
    args[args.index("tiny")] = "tiny,tiny"
    assert main(args) == EXIT_INTERRUPTED
    report = json.loads(path.read_text())
    assert report["complete"] is False and report["errors"] == []
    assert [(r["shape"], r["batch"]) for r in report["results"]] == [("tiny", 1)]
    assert report["results"][0]["of_roofline"] is not None
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]  # no temporary file left
    monkeypatch.setattr(bench, "run_shape", real)
    assert main(args) == 0
    report = json.loads(path.read_text())
    assert report["complete"] is True and len(report["results"]) == 2


def test_time_generate_warms_each_length_up_untimed(monkeypatch):
    """The first call of each length (torch.compile, graph capture) is untimed: with one
    repeat it was the measurement (HF's compiled mode took 80-91 s there on the H200). A
    virtual clock: each call costs n ms, and its first call of a length a cold cost that
    differs by length; the per-step figure must be exactly 1 ms."""
    from megatron_tlt import bench

    now, calls = [0.0], []
    cold = {8: 0.5, 40: 2.0}  # seconds

    def fn(n):
        calls.append(n)
        now[0] += n * 1e-3 + (cold.pop(n) if n in cold else 0.0)
        return n

    monkeypatch.setattr(bench.time, "perf_counter", lambda: now[0])
    ms, last = bench.time_generate(fn, 8, 40, 1, bench._Clock(torch.device("cpu")))
    assert calls[:2] == [8, 40] and len(calls) == 4 and last == 40
    assert ms == pytest.approx(1.0)
