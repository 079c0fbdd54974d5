"""Offline conversion in one process: bit-exact round trips, sharded input, dtypes, and
bad input reported as one line with exit status 2 through the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_tlt import cli
from megatron_tlt.convert import hf_to_mcore, mcore_to_hf
from megatron_tlt.errors import CheckpointError
from megatron_tlt.testing.tiny_models import hf_tensors, make_tiny_hf



@pytest.mark.parametrize("family,dtype,shard", [("llama", torch.float32, False), ("qwen2", torch.bfloat16, True),
                                                ("qwen3", torch.float32, True)])
def test_roundtrip_one_process(tmp_path, family, dtype, shard):
    hf = tmp_path / "hf"
    make_tiny_hf(str(hf), family, dtype=dtype, tie_word_embeddings=(family == "qwen3"))
    if shard:  # re-save as a sharded checkpoint with an index
        from transformers import AutoModelForCausalLM

        m = AutoModelForCausalLM.from_pretrained(str(hf), dtype=dtype)
        sharded = tmp_path / "hf_sharded"
        m.save_pretrained(str(sharded), safe_serialization=True, max_shard_size="40KB")
        assert (sharded / "model.safetensors.index.json").exists()
        src = sharded
    else:
        src = hf
    (src / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    hf_to_mcore(str(src), str(tmp_path / "mc"), tp=2, pp=2, progress=False)
    meta = json.loads((tmp_path / "mc" / "tlt_model.json").read_text())
    assert meta["dtype"] == {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    assert not (tmp_path / "mc.partial").exists()
    mcore_to_hf(str(tmp_path / "mc"), str(tmp_path / "back"), progress=False, shard_bytes=50_000)
    a, b = hf_tensors(hf), hf_tensors(tmp_path / "back")
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert (tmp_path / "back" / "tokenizer_config.json").exists()
    if shard:
        assert (tmp_path / "back" / "model.safetensors.index.json").exists()


# ---- bad input: one line on stderr, exit 2, no traceback ---------------------------

def _run_cli(argv, capsys):
    code = cli.main(argv)
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.fixture
def tiny_hf(tmp_path):
    return make_tiny_hf(str(tmp_path / "hf"), "llama")


def _one_line_error(code, err, *needles):
    assert code == 2
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_missing_checkpoint(tmp_path, capsys):
    code, err = _run_cli(["convert", "hf-to-mcore", "--hf", str(tmp_path / "missing"), "--out", str(tmp_path / "o")], capsys)
    _one_line_error(code, err, "not found", "missing")
    code, err = _run_cli(["convert", "mcore-to-hf", "--mcore", str(tmp_path / "missing"), "--out", str(tmp_path / "o")], capsys)
    _one_line_error(code, err, "not found")


def test_corrupt_checkpoint(tiny_hf, tmp_path, capsys):
    Path(tiny_hf, "model.safetensors").write_bytes(b"\x00garbage" * 10)
    code, err = _run_cli(["convert", "hf-to-mcore", "--hf", tiny_hf, "--out", str(tmp_path / "o")], capsys)
    _one_line_error(code, err, "corrupt safetensors")
    # a Megatron directory without its metadata (e.g. a partial write) is refused too
    partial = tmp_path / "partial_mc"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"x")
    code, err = _run_cli(["convert", "mcore-to-hf", "--mcore", str(partial), "--out", str(tmp_path / "o2")], capsys)
    _one_line_error(code, err, "tlt_model.json missing", "partial")


def test_unsupported_architecture(tiny_hf, tmp_path, capsys):
    cfg = json.loads(Path(tiny_hf, "config.json").read_text())
    cfg["model_type"] = "gpt2"
    Path(tiny_hf, "config.json").write_text(json.dumps(cfg))
    code, err = _run_cli(["convert", "hf-to-mcore", "--hf", tiny_hf, "--out", str(tmp_path / "o")], capsys)
    _one_line_error(code, err, "unsupported architecture", "gpt2")


def test_attention_bias_llama_refused_naming_it(tiny_hf, tmp_path, capsys):
    # HF's llama attention_bias biases o_proj too, which the actor cannot hold: one line
    # naming attention_bias, before any work (it said "unexpected tensors" at best).
    cfg = json.loads(Path(tiny_hf, "config.json").read_text())
    cfg["attention_bias"] = True
    Path(tiny_hf, "config.json").write_text(json.dumps(cfg))
    code, err = _run_cli(["convert", "hf-to-mcore", "--hf", tiny_hf, "--out", str(tmp_path / "o")], capsys)
    _one_line_error(code, err, "attention_bias=true", "o_proj")
    assert not (tmp_path / "o").exists()


def test_tp_not_dividing_heads(tiny_hf, tmp_path, capsys):
    code, err = _run_cli(["convert", "hf-to-mcore", "--hf", tiny_hf, "--out", str(tmp_path / "o"), "--tp", "3"], capsys)
    _one_line_error(code, err, "num_attention_heads (4)", "tensor_model_parallel_size (3)")
    assert not (tmp_path / "o").exists()


def test_mismatched_shapes(tiny_hf, tmp_path, capsys):
    t = load_file(os.path.join(tiny_hf, "model.safetensors"))
    t["model.layers.1.mlp.up_proj.weight"] = t["model.layers.1.mlp.up_proj.weight"][:50].contiguous()
    save_file(t, os.path.join(tiny_hf, "model.safetensors"), metadata={"format": "pt"})
    code, err = _run_cli(["convert", "hf-to-mcore", "--hf", tiny_hf, "--out", str(tmp_path / "o")], capsys)
    _one_line_error(code, err, "model.layers.1.mlp.up_proj.weight", "(50, 64)", "(96, 64)")
    assert not (tmp_path / "o").exists()


def test_output_dir_that_would_lose_data_is_refused(tiny_hf, tmp_path, capsys):
    """--out replaced any existing directory: a folder of other files, or the source
    itself, was deleted (exit 0). Refused now, before work; a previous conversion's output
    (a model directory) is still replaced."""
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    code, err = _run_cli(["convert", "hf-to-mcore", "--hf", tiny_hf, "--out", str(precious)], capsys)
    _one_line_error(code, err, "non-empty directory that holds no model")
    assert (precious / "notes.txt").read_text() == "keep me"
    code, err = _run_cli(["convert", "hf-to-mcore", "--hf", tiny_hf, "--out", tiny_hf], capsys)
    _one_line_error(code, err, "is, contains or lies inside the source")
    afile = tmp_path / "afile"
    afile.write_text("x")
    code, err = _run_cli(["convert", "hf-to-mcore", "--hf", tiny_hf, "--out", str(afile)], capsys)
    _one_line_error(code, err, "exists and is not a directory")
    mc = str(tmp_path / "mc")
    hf_to_mcore(tiny_hf, mc, progress=False)
    hf_to_mcore(tiny_hf, mc, progress=False)  # control: its own earlier output is replaced
    code, err = _run_cli(["convert", "mcore-to-hf", "--mcore", mc, "--out", mc], capsys)
    _one_line_error(code, err, "is, contains or lies inside the source")
    assert os.path.isfile(os.path.join(mc, "tlt_model.json"))


def test_missing_tensor(tiny_hf, tmp_path):
    t = load_file(os.path.join(tiny_hf, "model.safetensors"))
    del t["model.norm.weight"]
    save_file(t, os.path.join(tiny_hf, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.norm.weight is missing"):
        hf_to_mcore(tiny_hf, str(tmp_path / "o"), progress=False)


def test_checkpoint_of_other_shape_refused(tmp_path):
    """Loading a checkpoint into a model of a different shape names the field."""
    from megatron_tlt.models import mcore
    from megatron_tlt.models.actor import Actor
    from megatron_tlt.models.arch import ModelArch

    small = make_tiny_hf(str(tmp_path / "a"), "llama", num_layers=2)
    hf_to_mcore(small, str(tmp_path / "mc"), progress=False)
    mcore.init_parallel(1, 1)
    arch = ModelArch.from_hf_dir(make_tiny_hf(str(tmp_path / "b"), "llama", num_layers=4))
    with pytest.raises(CheckpointError, match="num_layers=2 but the model has num_layers=4"):
        Actor(arch).load(str(tmp_path / "mc"))


def test_cli_subprocess_has_no_traceback(tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    p = subprocess.run([sys.executable, "-m", "megatron_tlt", "convert", "hf-to-mcore", "--hf", str(tmp_path / "nope"),
                        "--out", str(tmp_path / "o")], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert p.stderr.startswith("error: model directory not found")


def test_mcore_to_hf_keeps_the_source_config_and_counts_the_written_bytes(tmp_path):
    """HF -> mcore -> HF keeps config.json's fields the architecture does not define (the
    token ids: without them and a generation_config.json transformers has no EOS), and a
    sharded index's total_size is the bytes written (vocab 250: Megatron pads it to 256,
    which the old total counted: 3072 bytes too many)."""
    from safetensors import safe_open

    hf = make_tiny_hf(str(tmp_path / "hf"), "llama", vocab_size=250)
    os.remove(os.path.join(hf, "generation_config.json"))
    cfg = json.loads(Path(hf, "config.json").read_text())
    cfg.update(bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.0123)
    Path(hf, "config.json").write_text(json.dumps(cfg))
    hf_to_mcore(hf, str(tmp_path / "mc"), progress=False)
    back = tmp_path / "back"
    mcore_to_hf(str(tmp_path / "mc"), str(back), progress=False, shard_bytes=50_000)
    got = json.loads((back / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "vocab_size"):
        assert got[key] == cfg[key], key
    assert not (back / "hf_config.json").exists()
    idx = json.loads((back / "model.safetensors.index.json").read_text())
    written = 0
    for f in sorted(set(idx["weight_map"].values())):
        with safe_open(str(back / f), "pt") as h:
            written += sum(h.get_tensor(k).numel() * h.get_tensor(k).element_size() for k in h.keys())
    assert idx["metadata"]["total_size"] == written
    # a source config of another model (a tokenizer taken from elsewhere) lends nothing
    other = dict(cfg, hidden_size=cfg["hidden_size"] * 2, eos_token_id=99)
    (tmp_path / "mc" / "hf_config.json").write_text(json.dumps(other))
    mcore_to_hf(str(tmp_path / "mc"), str(tmp_path / "back2"), progress=False)
    got = json.loads((tmp_path / "back2" / "config.json").read_text())
    assert got["hidden_size"] == cfg["hidden_size"] and "eos_token_id" not in got


@pytest.mark.parametrize("index", [{"weight_map": ["model.safetensors"]}, ["weight_map"],
                                   {"weight_map": {"a": 3}}])
def test_malformed_safetensors_index_is_one_line(tiny_hf, tmp_path, capsys, index):
    Path(tiny_hf, "model.safetensors.index.json").write_text(json.dumps(index))
    code, err = _run_cli(["convert", "hf-to-mcore", "--hf", tiny_hf, "--out", str(tmp_path / "o")], capsys)
    _one_line_error(code, err, "corrupt safetensors index")


def test_training_checkpoint_given_as_a_model_names_its_model_dir(tmp_path, capsys):
    """`--mcore <out>/checkpoints/step_N` (a training checkpoint, model in its model/) is
    pointed at that directory, not called a partial write."""
    from megatron_tlt.models.arch import ModelArch
    from megatron_tlt.models.mcore_ckpt import write_meta

    step = tmp_path / "step_3"
    (step / "model").mkdir(parents=True)
    (step / "manifest.json").write_text("{}")
    arch = ModelArch(family="llama", vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128)
    write_meta(str(step / "model"), arch, "float32", 1, 1)
    code, err = _run_cli(["convert", "mcore-to-hf", "--mcore", str(step), "--out", str(tmp_path / "o")], capsys)
    _one_line_error(code, err, "is a training checkpoint", str(step / "model"))
    assert "partial" not in err
