"""Resuming SFT from a mid-run checkpoint gives bit-identical per-step losses.

Run A goes straight through 6 steps. Run B stops after step 3 (`sft.exit_at_step`,
saving a checkpoint, as a preempted job would) and is started again with
`train.resume=auto`. Every per-step training loss, every validation loss and the
final weights must be equal exactly (fp32, CPU). Negative control: run C resumes
from B's step-3 checkpoint with the Adam moments replaced by a fresh optimizer's
empty state, and its losses after step 3 must differ — so the comparison can fail
when any state is lost. Each run is the real CLI in a fresh process.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]

CONFIG = """
model:
  seq_length: 96
  arch: {hidden_size: 32, intermediate_size: 64, num_layers: 2, num_heads: 4, num_kv_heads: 2,
         max_position_embeddings: 128}
optim: {lr: 5.0e-3, min_lr: 5.0e-4, lr_warmup_steps: 2, weight_decay: 0.01}
rollout: {max_new_tokens: 32}
train: {steps: 6, global_batch_size: 4, micro_batch_size: 4, seed: 11, save_interval: 0, keep_last: 2,
        resume: auto}
data: {num_train: 30, num_val: 8}
sft: {eval_interval: 2, progress: false}
"""


def sft(config: Path, out: Path, *overrides: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="2")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-m", "megatron_tlt", "sft", "--config", str(config),
                           f"train.out_dir={out}", *overrides], cwd=str(REPO_ROOT), env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]


def losses(out: Path) -> dict:
    from megatron_tlt.metrics import read_metrics

    return {(r["step"], k): r[k] for r in read_metrics(str(out / "metrics.jsonl"))
            for k in ("loss", "val_loss", "grad_norm", "consumed_samples") if k in r}


def weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "hf" / "model.safetensors"))


@pytest.mark.slow
def test_resume_is_bit_identical(tmp_path):
    config = tmp_path / "sft.yaml"
    config.write_text(CONFIG)
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"

    sft(config, a)
    sft(config, b, "sft.exit_at_step=3")
    assert (b / "checkpoints" / "latest").read_text().strip() == "3"
    assert not (b / "hf").exists(), "an interrupted run must not export a final model"
    # the pool of 30 samples wraps within the run: resume must also restore the epoch order
    shutil.copytree(b / "checkpoints", c / "checkpoints")
    shutil.copy(b / "metrics.jsonl", c / "metrics.jsonl")
    sft(config, b)

    la, lb = losses(a), losses(b)
    assert set(la) == set(lb) and len([k for k in la if k[1] == "loss"]) == 6
    mismatched = {k: (la[k], lb[k]) for k in la if la[k] != lb[k]}
    assert not mismatched, f"resumed run differs: {mismatched}"
    wa, wb = weights(a), weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)

    # negative control (in this process, to save a start-up): lose the Adam moments at the
    # resume point
    from megatron_tlt import sft as sft_module
    from megatron_tlt.config import load_config
    from megatron_tlt.models import mcore
    from megatron_tlt.models.actor import Actor
    from megatron_tlt.models.mcore_ckpt import read_meta
    from megatron_tlt.models.optim import OptimSettings, build_optimizer

    ckpt = c / "checkpoints" / "step_3"
    mcore.init_parallel(1, 1)
    fresh = build_optimizer(Actor(read_meta(str(ckpt / "model"))["arch"]), OptimSettings(lr=5e-3))
    torch.save(fresh.state_dict(), ckpt / "optim_rank0.pt")
    assert sft_module.main(load_config(str(config), [f"train.out_dir={c}", "sft.export_hf=false"])) == 0
    lc = losses(c)
    assert all(lc[(s, "loss")] == la[(s, "loss")] for s in (1, 2, 3))  # history kept from B's log
    assert all(lc[(s, "loss")] != la[(s, "loss")] for s in (5, 6)), "lost optimizer state went unnoticed"


TWO_RANK_STEPS = ["train.steps=3", "train.micro_batch_size=2", "sft.eval_interval=3"]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The single-rank reference run of test_two_ranks_match_one."""
    d = tmp_path_factory.mktemp("one_rank")
    config = d / "sft.yaml"
    config.write_text(CONFIG)
    sft(config, d / "run", *TWO_RANK_STEPS, "sft.export_hf=false")
    return losses(d / "run")


@pytest.mark.slow
@pytest.mark.parametrize("layout", [("1", "2"), ("2", "1")], ids=["dp2", "tp2"])
def test_two_ranks_match_one(tmp_path, run_torchrun, one_rank, layout):
    """The loss is the mean over every solution token of the global batch, whatever the
    split: 2 data-parallel ranks (each half the rows) or 2 tensor-parallel ranks give the
    per-step losses of a single rank, up to summation order. The dp2 run also writes the
    final HF model (exported by a single-process converter next to the 2-rank job)."""
    tp, dp = layout
    config = tmp_path / "sft.yaml"
    config.write_text(CONFIG)
    two = tmp_path / "two"
    run_torchrun(REPO_ROOT / "megatron_tlt" / "__main__.py", 2, [
        "sft", "--config", str(config), f"train.out_dir={two}", *TWO_RANK_STEPS, f"parallel.tp={tp}",
        f"parallel.dp={dp}", f"sft.export_hf={'true' if dp == '2' else 'false'}"], timeout=240)
    la, lb = one_rank, losses(two)
    assert set(la) == set(lb) and len(la) >= 7
    for k in la:
        assert la[k] == pytest.approx(lb[k], rel=1e-5, abs=1e-6), k
    if dp == "2":
        assert weights(two)  # the exported HF model loads
