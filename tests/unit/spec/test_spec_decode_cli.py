"""`megatron-tlt generate --spec eagle|ngram`: same tokens as --spec off (greedy), spec
stats per line, a bucketed summary, clear errors for bad flags."""

import argparse
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from spec_testutil import make_engine, one_thread, prompts, random_eagle, spec_models  # noqa: E402,F401

from megatron_tlt.errors import CheckpointError, TLTError  # noqa: E402
from megatron_tlt.rollout.cli import add_generate_args, main  # noqa: E402
from megatron_tlt.spec.export import save_drafter  # noqa: E402


def _args(model, prompts_path, out, *extra):
    parser = add_generate_args(argparse.ArgumentParser())
    return parser.parse_args(["--model", model, "--prompts", str(prompts_path), "--out", str(out),
                              "--max-new-tokens", "12", "--block-size", "4", "--temperature", "0",
                              *extra])


@pytest.fixture(scope="module")
def setup(spec_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spec_cli")
    model = spec_models["qwen3"]
    drafter = str(tmp / "drafter")
    save_drafter(random_eagle(make_engine(model), seed=2, draft_vocab=100), drafter)
    p = tmp / "p.jsonl"
    p.write_text("".join(json.dumps({"prompt_id": f"q{i}", "prompt_token_ids": ids, "n": 2}) + "\n"
                         for i, ids in enumerate(prompts(257, [4, 9, 6], seed=5))))
    return model, drafter, p, tmp


def _lines(path):
    return [json.loads(l) for l in open(path).read().splitlines()]


def test_spec_generate_matches_off(setup, capsys):
    model, drafter, p, tmp = setup
    assert main(_args(model, p, tmp / "off.jsonl")) == 0
    off = _lines(tmp / "off.jsonl")
    runs = {
        "eagle-chain": ["--spec", "eagle", "--drafter", drafter, "--spec-depth", "3"],
        "eagle-tree": ["--spec", "eagle", "--drafter", drafter, "--spec-depth", "3", "--spec-topk", "2",
                       "--spec-num-verify", "6", "--spec-threshold", "4"],
        "ngram": ["--spec", "ngram", "--spec-depth", "4", "--spec-ngram", "2",
                  "--num-blocks", "12", "--max-num-seqs", "6"],
        # depth by running batch size: 4 for one sequence, 2 up to 4, else 1 (5 run first,
        # then the sixth alone)
        "eagle-schedule": ["--spec", "eagle", "--drafter", drafter, "--spec-depth", "1:4,4:2,6:1",
                           "--max-num-seqs", "5"],
    }
    for name, flags in runs.items():
        out = tmp / f"{name}.jsonl"
        summary = tmp / f"{name}.summary.json"
        assert main(_args(model, p, out, *flags, "--spec-summary", str(summary))) == 0
        lines = _lines(out)
        assert [l["token_ids"] for l in lines] == [l["token_ids"] for l in off], name
        assert [l["logprobs"] for l in lines] == [l["logprobs"] for l in off], name
        for l in lines:
            s = l["spec"]
            assert s["method"] == ("ngram" if name == "ngram" else "eagle")
            assert {"drafted", "accepted", "num_drafts", "acceptance_rate", "acceptance_length",
                    "fallbacks", "plain_steps"} <= set(s)
            if s["num_drafts"]:
                assert s["acceptance_length"] == pytest.approx(1 + s["accepted"] / s["num_drafts"])
        sm = json.loads(summary.read_text())
        assert set(sm["by_batch_size"]) <= {"1", "2-4", "5-8", "9-16", "17-32", "33+"}
        assert sm["total"]["num_drafts"] == sum(l["spec"]["num_drafts"] for l in lines)
        if name == "eagle-tree":  # 6 sequences > threshold 4: off until the tail
            assert sm["by_batch_size"]["5-8"]["num_drafts"] == 0
        if name == "eagle-schedule":  # drafts per verification within each bucket's depth
            by = sm["by_batch_size"]
            assert set(by) == {"5-8", "1"}
            assert by["5-8"]["num_drafts"] > 0 and by["5-8"]["drafted"] == by["5-8"]["num_drafts"]  # depth 1
            assert by["1"]["num_drafts"] > 0
            assert 2 * by["1"]["num_drafts"] < by["1"]["drafted"] <= 4 * by["1"]["num_drafts"]  # depth 4
        assert "acceptance rate" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--spec", "adaptive"], "--spec adaptive is not available yet"),
    (["--spec", "ngram", "--drafter", "/x"], "--drafter is not used by --spec ngram"),
    (["--spec", "ngram", "--spec-topk", "0"], "--spec flags: spec topk must be"),
    (["--spec", "ngram", "--spec-depth", "4:2,2:3"], "batch bounds must increase"),
    (["--spec", "ngram", "--spec-depth", "two"], "expected an integer or BATCH:DEPTH"),
    (["--spec", "ngram", "--spec-depth", "1:0"], "must be >= 1"),
    (["--spec", "ngram", "--spec-num-verify", "1"], "num_verify_tokens must be an integer >= 2"),
    (["--spec", "ngram", "--spec-threshold", "-1"], "--spec-threshold must be >= 0"),
])
def test_bad_spec_flags(setup, flags, message):
    model, _, p, tmp = setup
    with pytest.raises(TLTError, match=message):
        main(_args(model, p, tmp / "x.jsonl", *flags))
    assert not (tmp / "x.jsonl").exists()


def test_drafter_for_another_target_is_refused(setup, spec_models):
    _, drafter, p, tmp = setup
    with pytest.raises(CheckpointError, match="family='qwen3', but the target has 'llama'"):
        main(_args(spec_models["llama"], p, tmp / "y.jsonl", "--spec", "eagle", "--drafter", drafter))
