"""SFT: learning-rate schedule, sample stream, config, up-front errors, and a tiny run
whose validation loss falls at every evaluation and whose HF export the rollout
engine loads (`megatron-tlt eval` on it)."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest

from megatron_tlt.config import config_from_dict, load_config
from megatron_tlt.data.packing import TokenizedSample
from megatron_tlt.errors import CheckpointError, ConfigError, TLTError
from megatron_tlt.sft import SampleStream

REPO_ROOT = Path(__file__).resolve().parents[2]

TINY = {
    "model": {"seq_length": 128, "arch": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2,
                                          "num_heads": 4, "num_kv_heads": 2, "max_position_embeddings": 256}},
    "optim": {"lr": 1.0e-2, "min_lr": 1.0e-3, "lr_warmup_steps": 2, "weight_decay": 0.0},
    "rollout": {"max_new_tokens": 32},
    "train": {"steps": 16, "global_batch_size": 8, "micro_batch_size": 4, "seed": 3, "save_interval": 0,
              "keep_last": 1, "resume": "none"},
    "data": {"num_train": 300, "num_val": 32},
    "sft": {"eval_interval": 4, "progress": False},
}


def tiny_cfg(out_dir, **sections):
    d = copy.deepcopy(TINY)
    d["train"]["out_dir"] = str(out_dir)
    for name, values in sections.items():
        d.setdefault(name, {}).update(values)
    return config_from_dict(d)


@pytest.fixture(scope="module")
def parallel():
    from megatron_tlt.models import mcore

    mcore.init_parallel(1, 1, seed=1)


# ---- pure parts ---------------------------------------------------------------------

def test_sample_stream_is_a_seeded_permutation_per_epoch():
    pool = [TokenizedSample((i, i), 1) for i in range(50)]
    a, b = SampleStream(pool, seed=1), SampleStream(pool, seed=1)
    first = [a(i).ids[0] for i in range(50)]
    second = [a(i).ids[0] for i in range(50, 100)]
    assert sorted(first) == sorted(second) == list(range(50)) and first != second
    assert [b(i).ids[0] for i in range(99, -1, -1)] == (first + second)[::-1]  # random access
    assert [SampleStream(pool, seed=2)(i).ids[0] for i in range(50)] != first


def test_example_configs_parse():
    tiny = load_config(str(REPO_ROOT / "examples" / "sft_tiny.yaml"))
    assert tiny.model.arch.vocab_size == 100 and tiny.sft.pack
    bench = load_config(str(REPO_ROOT / "examples" / "sft_bench_1p5b.yaml"))
    a = bench.model.arch
    assert (a.hidden_size, a.num_layers, a.num_heads, a.num_kv_heads, a.intermediate_size, a.vocab_size) == \
        (1536, 28, 12, 2, 8960, 151936)
    assert a.tie_word_embeddings and a.rope_theta == 1e6 and bench.model.dtype == "bfloat16"


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"model.arch.num_heads \(6\) must be a multiple of model.arch.num_kv_heads \(4\)"):
        load_config(None, ["model.arch.num_heads=6", "model.arch.num_kv_heads=4"])
    with pytest.raises(ConfigError, match="data.tasks must name at least one task"):
        load_config(None, ["data.tasks=[]"])
    with pytest.raises(ConfigError, match="unknown config key 'sft.eval_intervall'"):
        load_config(None, ["sft.eval_intervall=3"])
    with pytest.raises(ConfigError, match="unknown task 'arithm'"):
        from megatron_tlt.data.tasks import make_dataset

        make_dataset(["arithm"], 1, 0)


@pytest.mark.parametrize("sections, error, match", [
    ({"model": {"arch": {**TINY["model"]["arch"], "vocab_size": 50}}}, ConfigError,
     r"tokenizer 'tiny' has 100 tokens, more than the model's vocab_size \(50\)"),
    ({"model": {"seq_length": 512}}, ConfigError,
     r"model.seq_length \(512\) exceeds the model's max_position_embeddings \(256\)"),
    ({"model": {"use_te": True}}, ConfigError, "sft.pack=true needs an attention that honours"),
    ({"parallel": {"dp": 2}, "train": {"global_batch_size": 8, "micro_batch_size": 2}}, ConfigError,
     r"must equal the world size \(1\)"),
    ({"train": {"resume": "/nonexistent/step_3"}}, CheckpointError, "does not exist"),
    ({"data": {"path": "/nonexistent/data.jsonl"}}, TLTError, "no such file"),
])
def test_bad_input_fails_before_work(parallel, tmp_path, sections, error, match):
    from megatron_tlt import sft

    cfg = tiny_cfg(tmp_path / "run", **{k: {**TINY.get(k, {}), **v} for k, v in sections.items()})
    with pytest.raises(error, match=match):
        sft.main(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists()


# ---- a tiny run -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_run(parallel, tmp_path_factory):
    from megatron_tlt import sft
    from megatron_tlt.metrics import read_metrics

    out = tmp_path_factory.mktemp("sft") / "run"
    assert sft.main(tiny_cfg(out)) == 0
    return out, read_metrics(str(out / "metrics.jsonl"))


def test_val_loss_decreases_at_every_evaluation(tiny_run):
    out, recs = tiny_run
    val = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
    assert [s for s, _ in val] == [0, 4, 8, 12, 16]
    losses = [v for _, v in val]
    assert all(b < a for a, b in zip(losses, losses[1:])), f"validation loss not falling: {val}"
    assert losses[-1] < losses[0] - 1.0  # it learned something, not just noise
    train = [r for r in recs if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, 17))
    assert all(r["loss_tokens"] > 0 and r["tokens"] <= 8 * 128 for r in train)
    assert train[-1]["consumed_samples"] == sum(r["samples"] for r in train)


def test_final_model_is_exported_for_the_rollout_engine(tiny_run):
    from megatron_tlt.evaluate import evaluate, format_report

    out, _ = tiny_run
    hf = out / "hf"
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(os.listdir(hf))
    cfg = json.load(open(hf / "config.json"))
    assert cfg["eos_token_id"] == 2 and cfg["vocab_size"] == 100
    assert (out / "checkpoints" / "latest").read_text().strip() == "16"
    report = evaluate(str(hf), ["arith", "sort"], n=4, seed=0, max_new_tokens=8, keep_responses=True)
    assert report["overall"]["n"] == 4 and set(report["per_task"]) == {"arith", "sort"}
    assert report["overall"]["mean_response_tokens"] <= 8
    assert sum(g["n"] for g in report["by_reference_length"].values()) == 4
    assert len(report["responses"]) == 4 and "exact-answer rate" in format_report(report)


def test_evaluate_scores_reference_solutions_as_right(tiny_run, monkeypatch):
    """The scoring path, checked with a stub engine that answers with the reference
    solution (all right) or garbage (all wrong)."""
    from megatron_tlt import rollout
    from megatron_tlt.data.tasks import make_dataset
    from megatron_tlt.data.tokenizer import load_tokenizer
    from megatron_tlt.evaluate import evaluate
    from megatron_tlt.rollout.request import Result

    out, _ = tiny_run
    tok = load_tokenizer("tiny")
    refs = {s.prompt_id: s.solution for s in make_dataset(["arith", "sort"], 6, 0, "test")}

    def stub(answer_with):
        class Engine(rollout.RolloutEngine):
            def generate(self, requests, progress=None):
                return [Result(prompt_id=r.prompt_id, sample_index=0, policy_version=0, logprobs=None,
                               finish_reason="stop", token_ids=tok.encode(answer_with(refs[r.prompt_id])) + [tok.eos_id])
                        for r in requests]
        return Engine

    monkeypatch.setattr(rollout, "RolloutEngine", stub(lambda ref: ref))
    assert evaluate(str(out / "hf"), ["arith", "sort"], n=6)["overall"]["rate"] == 1.0
    monkeypatch.setattr(rollout, "RolloutEngine", stub(lambda ref: ref + "\n#### nope"))
    assert evaluate(str(out / "hf"), ["arith", "sort"], n=6)["overall"]["rate"] == 0.0


def test_sft_on_a_jsonl_dataset(parallel, tmp_path):
    from megatron_tlt import sft
    from megatron_tlt.data.tasks import make_dataset
    from megatron_tlt.metrics import read_metrics

    path = tmp_path / "data.jsonl"
    with open(path, "w") as f:
        for s in make_dataset(["sort"], 40, 0):
            f.write(json.dumps({"question": s.prompt, "meta": {"trace": s.solution}}) + "\n")
    cfg = tiny_cfg(tmp_path / "run", train={**TINY["train"], "steps": 2},
                   data={"path": str(path), "prompt_field": "question", "solution_field": "meta.trace",
                         "num_val": 8}, sft={"eval_interval": 0, "export_hf": False, "progress": False})
    assert sft.main(cfg) == 0
    recs = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    assert [r["step"] for r in recs] == [1, 2] and "val_loss" in recs[-1]
    bad = tiny_cfg(tmp_path / "bad", data={"path": str(path), "prompt_field": "question"})
    with pytest.raises(TLTError, match=r"line 1: missing solution field 'solution' \(fields present: meta, question\)"):
        sft.main(bad)


def test_sft_from_an_hf_model_and_from_a_megatron_checkpoint(parallel, tmp_path):
    """model.hf_path is converted once into <out_dir>/init_mcore and loaded (not random);
    model.mcore_ckpt loads directly."""
    import torch
    from safetensors.torch import load_file

    from megatron_tlt import sft
    from megatron_tlt.testing.tiny_models import make_tiny_hf

    hf = make_tiny_hf(str(tmp_path / "hf_in"), "qwen2", vocab_size=128, max_position_embeddings=256)
    short = {"train": {**TINY["train"], "steps": 1, "global_batch_size": 4},
             "sft": {"eval_interval": 0, "progress": False}}
    out = tmp_path / "from_hf"
    # a data error comes before the conversion (it came after it: minutes at 7B)
    bad = tmp_path / "bad_data"
    with pytest.raises(TLTError, match="no such file"):
        sft.main(tiny_cfg(bad, model={"hf_path": hf, "seq_length": 128},
                          data={**TINY.get("data", {}), "path": "/nonexistent/data.jsonl"}, **short))
    assert not (bad / "init_mcore").exists()
    assert sft.main(tiny_cfg(out, model={"hf_path": hf, "seq_length": 128}, **short)) == 0
    assert (out / "init_mcore" / "tlt_model.json").exists()
    before = load_file(str(tmp_path / "hf_in" / "model.safetensors"))
    after = load_file(str(out / "hf" / "model.safetensors"))
    w = "model.layers.0.self_attn.q_proj.bias"
    # one small step moved the loaded weights a little: loaded, not re-initialised
    assert not torch.equal(before[w], after[w]) and torch.allclose(before[w], after[w], atol=0.05)

    out2 = tmp_path / "from_mcore"
    assert sft.main(tiny_cfg(out2, model={"mcore_ckpt": str(out / "init_mcore"), "seq_length": 128},
                             **short)) == 0
    assert torch.allclose(load_file(str(out2 / "hf" / "model.safetensors"))[w], before[w], atol=0.05)
