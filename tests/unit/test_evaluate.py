"""`megatron-tlt eval --ckpt`: a Megatron-Core checkpoint (model directory, training
checkpoint step_<N>, or a run's out_dir) is evaluated exactly as its HF export is."""

from __future__ import annotations

import json
import shutil

import pytest

from megatron_tlt.errors import TLTError
from megatron_tlt.evaluate import evaluate, evaluate_checkpoint, resolve_mcore_checkpoint
from megatron_tlt.sft import TINY_DEFAULT_DIR


def _fake_training_checkpoint(mc_dir, out_dir, step):
    """The layout Checkpointer.save writes (model/, trainer_state.json, manifest.json last,
    then `latest`), with the optimizer/RNG files left out: eval reads only the model."""
    d = out_dir / "checkpoints" / f"step_{step}"
    shutil.copytree(mc_dir, d / "model")
    (d / "trainer_state.json").write_text(json.dumps({"step": step, "data_position": 0}))
    (d / "manifest.json").write_text(json.dumps({
        "format": "megatron_tlt.train_ckpt/1", "step": step, "world_size": 1, "tp": 1, "pp": 1,
        "files": ["model", "trainer_state.json"]}))
    (out_dir / "checkpoints" / "latest").write_text(f"{step}\n")
    return d


@pytest.fixture(scope="module")
def tiny_mcore(tmp_path_factory):
    from megatron_tlt.convert import hf_to_mcore

    mc = tmp_path_factory.mktemp("mc") / "model"
    hf_to_mcore(TINY_DEFAULT_DIR, str(mc), progress=False)
    return mc


def test_resolves_every_form_of_checkpoint(tiny_mcore, tmp_path):
    run = tmp_path / "run"
    step7 = _fake_training_checkpoint(tiny_mcore, run, 7)
    # A newer save cut short by a crash: never picked, `latest` still names step 7.
    shutil.copytree(step7, run / "checkpoints" / "step_9.partial")
    assert resolve_mcore_checkpoint(str(tiny_mcore)) == (str(tiny_mcore), None)
    for path in (step7, run, run / "checkpoints"):
        assert resolve_mcore_checkpoint(str(path)) == (str(step7 / "model"), 7), path
    with pytest.raises(TLTError, match="partial"):
        resolve_mcore_checkpoint(str(run / "checkpoints" / "step_9.partial"))
    (step7 / "manifest.json").unlink()
    with pytest.raises(TLTError, match="manifest.json"):
        resolve_mcore_checkpoint(str(step7))
    with pytest.raises(TLTError, match="no complete checkpoint|not a complete"):
        resolve_mcore_checkpoint(str(run))
    with pytest.raises(TLTError, match="no such directory"):
        resolve_mcore_checkpoint(str(tmp_path / "missing"))


def test_checkpoint_gives_the_same_responses_as_its_hf_source(tiny_mcore, tmp_path):
    run = tmp_path / "run"
    _fake_training_checkpoint(tiny_mcore, run, 3)
    kw = dict(tasks=["sort"], n=6, seed=2, max_new_tokens=48, keep_responses=True)
    a = evaluate(TINY_DEFAULT_DIR, **kw)
    b = evaluate_checkpoint(str(run), **kw)
    assert b["step"] == 3 and b["model"] == str(run / "checkpoints" / "step_3" / "model")
    assert [r["response"] for r in b["responses"]] == [r["response"] for r in a["responses"]]
    assert b["overall"] == a["overall"]


def test_a_different_checkpoint_gives_different_responses(tiny_mcore, tmp_path):
    """Negative control: eval --ckpt really reads the checkpoint's weights."""
    import torch
    from safetensors.torch import load_file, save_file

    from megatron_tlt.convert import hf_to_mcore

    hf = tmp_path / "hf"
    shutil.copytree(TINY_DEFAULT_DIR, hf)
    w = load_file(str(hf / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    w = {k: torch.randn(v.shape, generator=gen) * 0.02 if k.endswith("mlp.down_proj.weight") else v
         for k, v in w.items()}
    save_file(w, str(hf / "model.safetensors"), metadata={"format": "pt"})
    hf_to_mcore(str(hf), str(tmp_path / "mc"), progress=False)
    kw = dict(tasks=["sort"], n=6, seed=2, max_new_tokens=48, keep_responses=True)
    a = evaluate(TINY_DEFAULT_DIR, **kw)
    b = evaluate_checkpoint(str(tmp_path / "mc"), **kw)
    assert b["step"] is None
    assert [r["response"] for r in b["responses"]] != [r["response"] for r in a["responses"]]


def test_eval_cli_takes_ckpt_or_model_not_both(tiny_mcore, capsys, tmp_path):
    from megatron_tlt import cli

    with pytest.raises(SystemExit):
        cli.main(["eval", "--model", TINY_DEFAULT_DIR, "--ckpt", str(tiny_mcore)])
    assert "not allowed with" in capsys.readouterr().err
    assert cli.main(["eval", "--ckpt", str(tiny_mcore), "--tasks", "sort", "--n", "2",
                     "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("exact-answer rate: ")
    # --json naming a directory: one line, exit 2, before the evaluation (it was an
    # IsADirectoryError traceback after it)
    assert cli.main(["eval", "--ckpt", str(tiny_mcore), "--tasks", "sort", "--n", "2",
                     "--json", str(tiny_mcore)]) == 2
    out = capsys.readouterr()
    assert out.err.strip() == f"error: --json {tiny_mcore} is a directory, not a file" and out.out == ""
    # under a path that is a file: a FileExistsError traceback after the whole evaluation
    # (its report printed, not saved, exit 1)
    (tmp_path / "a_file").write_text("x")
    under_file = str(tmp_path / "a_file" / "report.json")
    assert cli.main(["eval", "--ckpt", str(tiny_mcore), "--tasks", "sort", "--n", "2",
                     "--json", under_file]) == 2
    out = capsys.readouterr()
    assert out.err.strip() == (f"error: --json {under_file}: {tmp_path / 'a_file'} is a "
                               f"file, not a directory") and out.out == ""


def test_sampled_eval_replays_and_counts_pass_at_k():
    kw = dict(tasks=["sort"], n=4, seed=1, max_new_tokens=40, keep_responses=True, temperature=1.0, samples=3)
    a, b = evaluate(TINY_DEFAULT_DIR, **kw), evaluate(TINY_DEFAULT_DIR, **kw)
    assert [r["response"] for r in a["responses"]] == [r["response"] for r in b["responses"]]  # seeded
    assert a["overall"]["n"] == 12 and [r["sample_index"] for r in a["responses"]] == [0, 1, 2] * 4
    # Negative control: the K samples of a prompt are not K copies of one response.
    by_prompt = {}
    for r in a["responses"]:
        by_prompt.setdefault(r["prompt_id"], []).append(r)
    assert any(len({r["response"] for r in rs}) > 1 for rs in by_prompt.values())
    solved = sum(any(r["correct"] for r in rs) for rs in by_prompt.values())
    assert a["pass_at_k"]["overall"] == {"n": 4, "solved": solved, "rate": solved / 4}
    with pytest.raises(TLTError, match="needs --temperature"):
        evaluate(TINY_DEFAULT_DIR, ["sort"], n=1, samples=2)
