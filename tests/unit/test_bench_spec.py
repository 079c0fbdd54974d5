"""`megatron-tlt bench spec` end to end on CPU with the tiny default and a random EAGLE
drafter: the code path runs and the JSON holds what the GPU run reports (no assertion on
time: benchmarks are not tests)."""

import json

import torch

from megatron_tlt.cli import main

TINY = "megatron_tlt/assets/tiny_default"


def _drafter(out):
    from megatron_tlt.models.arch import ModelArch
    from megatron_tlt.spec.eagle import DrafterConfig, EagleDrafter
    from megatron_tlt.spec.export import save_drafter

    arch = ModelArch.from_hf_dir(TINY)
    shared = torch.zeros(arch.vocab_size, arch.hidden_size)
    drafter = EagleDrafter(DrafterConfig(arch=arch), shared, shared)
    drafter.reset_parameters(seed=0, std=0.02)
    save_drafter(drafter, str(out))
    return str(out)


def test_bench_spec_cpu(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MEGATRON_TLT_LINEAR_PLANS", raising=False)
    path = tmp_path / "spec.json"
    rc = main(["bench", "spec", "--json", str(path), "--model", TINY, "--drafter", _drafter(tmp_path / "d"),
               "--drafters", "eagle,ngram,eagle-readback,eagle-ahead,eagle-noahead", "--batch-sizes", "1,3", "--max-new-tokens", "12",
               "--tasks", "sort", "--device", "cpu", "--min-sequences", "0", "--spec-depth", "3",
               "--profile-batch-sizes", "3"])
    assert rc == 0
    report = json.loads(path.read_text())
    assert report["command"].startswith("megatron-tlt bench spec --json ")
    assert report["git_revision"] and report["engine"]["attention_backend"] == "torch"
    assert report["engine"]["dtype"] == "float32"  # auto on the CPU
    # the CPU engine leaves torch's threads alone; no plan file named
    assert report["engine"]["host_threads"] == torch.get_num_threads()
    assert report["engine"]["linear_plans"] is None
    assert report["complete"] is True
    rows = {(r["batch"], r["mode"]): r for r in report["results"]}
    assert sorted(rows) == [(b, m) for b in (1, 3) for m in ("eagle", "eagle-ahead", "eagle-noahead", "eagle-readback",
                                                           "ngram", "off")]
    for (b, mode), r in rows.items():
        assert r["tokens_per_s"] > 0 and 0 < r["mean_len"] <= 12
        run = r["repeats"][0]
        # Engine steps: at least the longest response's tokens / (depth + 1), at most its length + 1.
        assert -(-run["max_len"] // 4) <= run["steps"] <= run["max_len"] + 1
        # the prefill step and the median of the rest, from the engine's step log
        assert run["first_step_ms"] > 0 and run["median_step_ms"] > 0
        assert r["first_step_ms"] == run["first_step_ms"]  # one repeat: its median
        assert len(run["first_steps_ms"]) == run["generate_calls"] and run["gc_full_collections"] >= 0
        assert run["events"] == {}  # CPU: no graphs, no planner
        assert ("profile" in r) == (b == 3)
        if b == 3:
            assert "function calls" in r["profile"]["cprofile"] and r["profile"]["steps"] > 0
        if mode == "off":
            assert "speedup" not in r
        else:
            assert r["speedup"] > 0 and r["acceptance_length"] >= 1.0
            assert r["repeats"][0]["num_drafts"] > 0  # SD ran
            # CPU drafts eagerly (no static chain buffers): no step verifies device drafts
            assert r["repeats"][0]["deferred_steps"] == 0
            assert r["repeats"][0]["ahead_steps"] == r["repeats"][0]["adopted_steps"] == 0  # needs deferred steps
            bd = r["breakdown"]  # the phase-timed run: the SD phases were timed
            assert bd["steps"] > 0 and bd["ms_per_step"]["draft"] > 0
            assert bd["ms_per_step"]["verify_forward"] > 0 and bd["ms_per_step"]["verify"] > 0
    assert "speedup" in capsys.readouterr().out


def test_bench_spec_fixed_length(tmp_path):
    """--min-new-tokens = --max-new-tokens, or --ignore-eos: every mode's responses have
    exactly that length (the tiny default stops early without either: control)."""
    lens = {}
    for flag in ([], ["--min-new-tokens", "24"]):
        path = tmp_path / f"spec{len(flag)}.json"
        assert main(["bench", "spec", "--json", str(path), "--model", TINY, "--drafters", "ngram",
                     "--batch-sizes", "4", "--max-new-tokens", "24", "--tasks", "sort",
                     "--device", "cpu", "--breakdown-tokens", "0", "--min-sequences", "0"] + flag) == 0
        report = json.loads(path.read_text())
        assert report["settings"]["min_new_tokens"] == (24 if flag else 0)
        lens[bool(flag)] = {r["mode"]: r["repeats"][0]["max_len"] for r in report["results"]} | \
            {r["mode"] + "_mean": r["mean_len"] for r in report["results"]}
    assert lens[True] == {"off": 24, "ngram": 24, "off_mean": 24.0, "ngram_mean": 24.0}
    path = tmp_path / "spec_ignore_eos.json"  # --ignore-eos: the same fixed length, no ban
    assert main(["bench", "spec", "--json", str(path), "--model", TINY, "--drafters", "ngram",
                 "--batch-sizes", "4", "--max-new-tokens", "24", "--tasks", "sort",
                 "--device", "cpu", "--breakdown-tokens", "0", "--ignore-eos", "--min-sequences", "0"]) == 0
    report = json.loads(path.read_text())
    assert report["settings"]["ignore_eos"] is True
    assert {r["mode"]: (r["repeats"][0]["max_len"], r["mean_len"]) for r in report["results"]} == \
        {"off": (24, 24.0), "ngram": (24, 24.0)}
    free = json.loads((tmp_path / "spec0.json").read_text())["results"]
    off_mean = next(r["mean_len"] for r in free if r["mode"] == "off")
    for r in free:
        if r["mode"] != "off":
            assert r["length_mismatch"] == (abs(r["mean_len"] / off_mean - 1) > 0.25)
    fixed = json.loads((tmp_path / "spec2.json").read_text())
    assert [r["length_mismatch"] for r in fixed["results"] if r["mode"] != "off"] == [False]
    assert lens[False]["off_mean"] < 24  # the sort answers end before 24 tokens


def test_bench_spec_prompt_sets(tmp_path):
    """--prompt-sets 3 at batch 2: a timed run generates 3 disjoint batches one after the
    other and reports their totals (6 responses of a fixed 10 tokens); one set generates one
    batch (control); --continuous generates the 6 in one call, 2 at a time; --min-sequences 5
    makes one set three."""
    runs = {}
    for n, flag in ((1, []), (3, []), ("3c", ["--continuous"])):
        path = tmp_path / f"sets{n}.json"
        assert main(["bench", "spec", "--json", str(path), "--model", TINY, "--drafters", "ngram",
                     "--batch-sizes", "2", "--max-new-tokens", "10", "--min-new-tokens", "10",
                     "--tasks", "sort", "--device", "cpu", "--min-sequences", "0", "--breakdown-tokens", "0",
                     "--prompt-sets", str(n)[0]] + flag) == 0
        report = json.loads(path.read_text())
        assert report["settings"]["prompt_sets"] == int(str(n)[0])
        assert report["settings"]["continuous"] == bool(flag)
        runs[n] = {r["mode"]: r["repeats"][0] for r in report["results"]}
    for mode in ("off", "ngram"):
        assert runs[1][mode]["tokens"] == 2 * 10 and runs[3][mode]["tokens"] == 6 * 10
        assert runs[3][mode]["mean_len"] == 10.0
        assert runs[3][mode]["steps"] > runs[1][mode]["steps"]
        # --continuous: the same 6 responses from one call, never more than 2 running
        assert runs["3c"][mode]["tokens"] == 6 * 10 and runs["3c"][mode]["max_running"] == 2
        assert runs[3][mode]["max_running"] == 2
        assert (runs["3c"][mode]["generate_calls"], runs[3][mode]["generate_calls"]) == (1, 3)
        assert runs[3][mode]["capture_s"] == 0.0  # CPU: no graphs
    assert runs[3]["ngram"]["num_drafts"] > runs[1]["ngram"]["num_drafts"]
    # --min-sequences 5 at batch 2 with one --prompt-sets: ceil(5 / 2) = 3 sets, as --prompt-sets 3
    path = tmp_path / "min5.json"
    assert main(["bench", "spec", "--json", str(path), "--model", TINY, "--drafters", "ngram",
                 "--batch-sizes", "2", "--max-new-tokens", "10", "--min-new-tokens", "10",
                 "--tasks", "sort", "--device", "cpu", "--breakdown-tokens", "0",
                 "--min-sequences", "5"]) == 0
    for r in json.loads(path.read_text())["results"]:
        assert r["repeats"][0]["tokens"] == 6 * 10 and r["repeats"][0]["generate_calls"] == 3


def test_bench_spec_bad_input(capsys):
    assert main(["bench", "spec", "--model", TINY, "--drafters", "eagle", "--device", "cpu"]) == 2
    assert "--drafters eagle needs --drafter DIR" in capsys.readouterr().err
    assert main(["bench", "spec", "--model", TINY, "--drafters", "medusa", "--device", "cpu"]) == 2
    assert main(["bench", "spec", "--model", TINY, "--drafters", "ngram", "--device", "cpu",
                 "--max-new-tokens", "8", "--min-new-tokens", "9"]) == 2
    assert main(["bench", "spec", "--model", TINY, "--drafters", "ngram", "--device", "cpu",
                 "--prompt-sets", "0"]) == 2
    assert "--drafters takes eagle, ngram, eagle-readback, eagle-ahead, eagle-noahead, eagle-vahead, eagle-torchprobs, eagle-onehot and/or eagle-torchlayer" in capsys.readouterr().err
    assert main(["bench", "spec", "--model", TINY, "--drafters", "ngram", "--device", "cpu",
                 "--min-sequences", "-1"]) == 2
    assert "--min-sequences must be >= 0" in capsys.readouterr().err
    # profiling happens inside the --batch-sizes loop: other sizes were dropped silently
    assert main(["bench", "spec", "--model", TINY, "--drafters", "ngram", "--device", "cpu",
                 "--batch-sizes", "1", "--profile-batch-sizes", "2,1"]) == 2
    assert "--profile-batch-sizes [2] are not among --batch-sizes [1]" in capsys.readouterr().err


def test_bench_spec_checks_json_and_device_before_loading(tmp_path, capsys):
    """--json naming a directory was an IsADirectoryError traceback after the warm-up and
    the first batch size's runs; --device auto was refused by a message listing auto;
    --device cuda without CUDA was an AssertionError traceback."""
    args = ["bench", "spec", "--model", TINY, "--drafters", "ngram", "--batch-sizes", "1",
            "--max-new-tokens", "4", "--min-sequences", "0", "--breakdown-tokens", "0"]
    assert main(args + ["--device", "cpu", "--json", str(tmp_path)]) == 2
    out = capsys.readouterr()
    assert out.err.strip() == f"error: --json {tmp_path} is a directory, not a file" and "B=" not in out.out
    if torch.cuda.is_available():
        return  # auto would be the GPU, and cuda valid: the rest is the CPU machine's
    path = tmp_path / "auto.json"
    assert main(args + ["--device", "auto", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["complete"] is True
    assert main(args + ["--device", "cuda"]) == 2
    assert "--device 'cuda': CUDA is not available on this machine" in capsys.readouterr().err


def test_bench_spec_depth_modes_and_schedule(tmp_path, capsys):
    """--drafters NAME@D runs that mode at depth D beside the others in one run, NAME@B:D/...
    with its own depth schedule; --spec-depth BATCH:DEPTH,... sets the other modes' depth
    by running batch size."""
    path = tmp_path / "spec.json"
    assert main(["bench", "spec", "--json", str(path), "--model", TINY, "--drafter", _drafter(tmp_path / "d"),
                 "--drafters", "eagle,eagle@1,ngram@2,ngram@1:1/3:2,eagle@1:2x2/3:2", "--batch-sizes", "1,3",
                 "--max-new-tokens", "12",
                 "--tasks", "sort", "--device", "cpu", "--min-sequences", "0", "--spec-depth", "1:3,3:2", "--ignore-eos",
                 "--breakdown-tokens", "0"]) == 0
    rows = {(r["batch"], r["mode"]): r for r in json.loads(path.read_text())["results"]}
    assert sorted(rows) == [(b, m) for b in (1, 3) for m in ("eagle", "eagle@1", "eagle@1:2x2/3:2", "ngram@1:1/3:2",
                                                             "ngram@2", "off")]
    # eagle@1:2x2/3:2: top-2 trees of depth 2 (up to 4 draft nodes) while one sequence runs
    # (on the CPU the per-sequence tree path drafts them), depth-2 chains at 3
    tree = {b: rows[(b, "eagle@1:2x2/3:2")]["repeats"][0] for b in (1, 3)}
    assert 2 * tree[1]["num_drafts"] < tree[1]["drafted"] <= 4 * tree[1]["num_drafts"]
    assert tree[1]["eager_draft_steps"] == tree[1]["num_drafts"] and tree[1]["tree_steps"] == 0
    assert tree[3]["drafted"] <= 2 * tree[3]["num_drafts"]
    for b in (1, 3):
        one = rows[(b, "eagle@1")]["repeats"][0]
        assert one["num_drafts"] > 0 and one["drafted"] == one["num_drafts"]  # depth 1
        two = rows[(b, "ngram@2")]["repeats"][0]
        assert two["drafted"] <= 2 * two["num_drafts"]
    sched = {b: rows[(b, "ngram@1:1/3:2")]["repeats"][0] for b in (1, 3)}
    assert sched[1]["drafted"] <= sched[1]["num_drafts"]  # one running: depth 1
    assert sched[3]["drafted"] > sched[3]["num_drafts"]  # three running: depth 2
    deep = rows[(1, "eagle")]["repeats"][0]  # one sequence: depth 3
    assert deep["drafted"] > 2 * deep["num_drafts"]
    capsys.readouterr()
    for bad in ("eagle@0", "eagle@x", "eagle,eagle", "medusa", "eagle@3:1/2:2", "eagle@1:0", "eagle@1:2,3:4",
                "eagle@2x0", "eagle@1:2x/3:2"):
        assert main(["bench", "spec", "--model", TINY, "--drafter", "d", "--drafters", bad]) == 2
        assert "--drafters takes" in capsys.readouterr().err, bad
    assert main(["bench", "spec", "--model", TINY, "--drafters", "ngram", "--spec-depth", "3:1,2:2"]) == 2
    assert "batch bounds must increase" in capsys.readouterr().err
    assert main(["bench", "spec", "--model", TINY, "--drafters", "ngram", "--spec-depth", "4x0"]) == 2
    assert "spec topk must be" in capsys.readouterr().err


def test_bench_spec_modes_share_noise_streams(tmp_path):
    """Every mode of one batch size draws from the same per-request noise streams, so two
    modes that run the same step (here ngram and ngram@3 with --spec-depth 3; on the GPU
    e.g. eagle and eagle-vahead) emit the same tokens and the same acceptance; a third
    at another depth (ngram@2) differs. With a stream per mode (the tags before session
    16) the first two differed as well: sampled at T=2.0 on the tiny default, 3 prompt
    sets, they drew 176 against 162 drafts."""
    path = tmp_path / "spec.json"
    assert main(["bench", "spec", "--json", str(path), "--model", TINY, "--drafters", "ngram,ngram@3,ngram@2",
                 "--batch-sizes", "2", "--max-new-tokens", "24", "--temperature", "2.0", "--tasks", "sort",
                 "--device", "cpu", "--min-sequences", "0", "--prompt-sets", "3", "--spec-depth", "3",
                 "--breakdown-tokens", "0"]) == 0
    rows = {r["mode"]: r["repeats"][0] for r in json.loads(path.read_text())["results"]}
    key = {m: (rows[m]["tokens"], rows[m]["drafted"], rows[m]["num_drafts"], rows[m]["acceptance_length"])
           for m in ("ngram", "ngram@3", "ngram@2")}
    assert key["ngram"] == key["ngram@3"], key
    assert key["ngram@2"] != key["ngram"], key
    assert rows["ngram"]["num_drafts"] > 0


def test_bench_spec_reports_the_tail(tmp_path):
    """Each run reports its tail (steps after a call's first sequence finished, and their
    wall) and the spread of the sequences' own acceptance lengths; sequences of unequal
    lengths (EOS on) make a tail, equal ones (--ignore-eos, plain decoding) none."""
    path = tmp_path / "spec.json"
    assert main(["bench", "spec", "--json", str(path), "--model", TINY, "--drafters", "ngram",
                 "--batch-sizes", "4", "--max-new-tokens", "16", "--temperature", "0.9", "--tasks", "sort",
                 "--device", "cpu", "--min-sequences", "0", "--breakdown-tokens", "0", "--ignore-eos"]) == 0
    rows = {r["mode"]: r for r in json.loads(path.read_text())["results"]}
    off, ng = rows["off"]["repeats"][0], rows["ngram"]["repeats"][0]
    assert off["tail_steps"] == 0 and off["tail_wall_s"] == 0.0 and rows["off"]["tail_wall_share"] == 0.0
    assert "sequence_acceptance_length" not in off
    assert 0 <= ng["tail_steps"] < ng["steps"] and 0.0 <= rows["ngram"]["tail_wall_share"] < 1.0
    spread = ng["sequence_acceptance_length"]
    assert spread is not None and 1.0 <= spread["min"] <= spread["median"] <= spread["max"]
    # with EOS on, plain decoding's sequences end at different steps: a tail
    assert main(["bench", "spec", "--json", str(path), "--model", TINY, "--drafters", "ngram",
                 "--batch-sizes", "4", "--max-new-tokens", "48", "--temperature", "1.5", "--tasks", "sort",
                 "--device", "cpu", "--min-sequences", "0", "--breakdown-tokens", "0"]) == 0
    off = {r["mode"]: r for r in json.loads(path.read_text())["results"]}["off"]["repeats"][0]
    assert off["tail_steps"] > 0 and 0 < off["tail_wall_s"] < off["wall_s"]


def test_bench_spec_one_hot_and_torch_layer_modes(tmp_path):
    """eagle-onehot and eagle-torchlayer run beside eagle in one run and draft (argmax
    chains with one-hot verification; the drafter's torch ops, which on the CPU are what
    eagle runs too; tests/unit/spec/test_eagle_graph.py and test_drafter_kernels_interp.py
    check the paths themselves)."""
    path = tmp_path / "spec.json"
    assert main(["bench", "spec", "--json", str(path), "--model", TINY, "--drafter", _drafter(tmp_path / "d"),
                 "--drafters", "eagle,eagle-onehot,eagle-torchlayer", "--batch-sizes", "2", "--max-new-tokens", "12",
                 "--tasks", "sort", "--device", "cpu", "--min-sequences", "0", "--spec-depth", "2",
                 "--ignore-eos", "--breakdown-tokens", "0", "--temperature", "0.9"]) == 0
    rows = {r["mode"]: r["repeats"][0] for r in json.loads(path.read_text())["results"]}
    assert rows["eagle-onehot"]["num_drafts"] > 0 and rows["eagle"]["num_drafts"] > 0
    assert rows["eagle-onehot"]["tokens"] == rows["eagle"]["tokens"]  # --ignore-eos: equal lengths
    assert rows["eagle-torchlayer"]["num_drafts"] > 0
    assert rows["eagle-torchlayer"]["acceptance_length"] == rows["eagle"]["acceptance_length"]


def test_bench_spec_greedy_rows_check_the_tokens_against_plain(tmp_path, capsys, monkeypatch):
    """--temperature 0: each SD row reports the share of requests whose tokens equal plain
    decoding's (lossless: 1.0); a changed token in an SD run must show (negative control,
    the comparison itself) with a printed warning. Nothing of the tokens lands in the JSON."""
    from megatron_tlt import bench_spec

    args = ["bench", "spec", "--json", str(tmp_path / "spec.json"), "--model", TINY, "--drafters", "ngram",
            "--batch-sizes", "2", "--max-new-tokens", "12", "--temperature", "0", "--tasks", "sort",
            "--device", "cpu", "--min-sequences", "0", "--breakdown-tokens", "0", "--repeats", "2"]
    assert main(args) == 0
    report = json.loads((tmp_path / "spec.json").read_text())
    rows = {r["mode"]: r for r in report["results"]}
    assert rows["ngram"]["tokens_equal_plain"] == 1.0 and "tokens_equal_plain" not in rows["off"]
    assert '"_tokens"' not in json.dumps(report)
    real = bench_spec._run

    def lossy(engine, decoder, *a, **k):
        row = real(engine, decoder, *a, **k)
        if decoder is not None:
            row["_tokens"][0] = row["_tokens"][0][:-1] + [row["_tokens"][0][-1] + 1]
        return row

    monkeypatch.setattr(bench_spec, "_run", lossy)
    capsys.readouterr()
    assert main(args) == 0
    rows = {r["mode"]: r for r in json.loads((tmp_path / "spec.json").read_text())["results"]}
    assert rows["ngram"]["tokens_equal_plain"] == 0.5  # the first of 2 requests changed in each repeat
    assert "WARNING greedy tokens differ from plain decoding" in capsys.readouterr().out


def test_bench_spec_without_verifications_reports_no_acceptance(tmp_path, capsys):
    """One new token: nothing is verified. The row's acceptance length is null and printed
    n/a (it averaged a missing value as 0.0, below the 1.0 every verification gives)."""
    out = tmp_path / "b.json"
    assert main(["bench", "spec", "--model", TINY, "--drafters", "ngram", "--batch-sizes", "1",
                 "--max-new-tokens", "1", "--min-sequences", "1", "--breakdown-tokens", "1",
                 "--device", "cpu", "--json", str(out)]) == 0
    (row,) = [r for r in json.loads(out.read_text())["results"] if r["mode"] == "ngram"]
    assert row["acceptance_length"] is None and row["acceptance_rate"] is None
    assert "acceptance length n/a" in capsys.readouterr().out
