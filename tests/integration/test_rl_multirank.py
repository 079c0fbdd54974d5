"""`megatron-tlt train` under torchrun (gloo, CPU, 2 ranks): the job starts from an HF
checkpoint and runs at TP=2, and a failure on one rank fails every rank promptly.

- TP=2 from the tiny default's HF checkpoint: rank 0 converts it in a child process,
  which must not join (or wait for) torchrun's world; before the fix the child waited
  on the elastic agent's store forever and the job never logged a step.
- A reward function that raises on one rank only (DP=2: rank 1 scores its own prompts;
  TP=2: rank 0 scores for the group and rank 1 waits for its broadcast): every rank exits
  with the error (the failing one with its own message, the others naming the failing
  rank and its message), nothing of the step is written. Negative control, run by hand
  (no cross-rank agreement in RLRun._first_error): the other rank printed nothing and was
  only torn down by torchrun's agent (a launcher that does not tear down leaves it
  waiting in the next collective); this test then fails on the missing "failed on rank".
"""

from __future__ import annotations

import os

import pytest

from megatron_tlt.testing.rewards import RAISE_ON_RANK_ENV

CLI = os.path.join(os.path.dirname(__file__), "..", "..", "megatron_tlt", "__main__.py")
BASE = ["train", "--config", "examples/tiny_cpu.yaml", "train.save_interval=0", "rollout.max_new_tokens=24",
        "train.global_batch_size=8", "train.micro_batch_size=4", "rollout.n_samples=4"]


def _metrics(out):
    path = out / "metrics.jsonl"
    return path.read_text().splitlines() if path.exists() else []


def test_train_tp2_from_hf_checkpoint(run_torchrun, tmp_path):
    out = tmp_path / "run"
    run_torchrun(CLI, 2, BASE + ["parallel.tp=2", "train.steps=2", f"train.out_dir={out}"], timeout=400)
    assert len(_metrics(out)) == 2
    assert (out / "checkpoints" / "latest").exists()


@pytest.mark.parametrize("tp,failing_rank", [(1, 1), (2, 0)])
def test_reward_error_on_one_rank_fails_every_rank(run_torchrun, tmp_path, tp, failing_rank):
    out = tmp_path / "run"
    res = run_torchrun(CLI, 2, BASE + [f"parallel.tp={tp}", f"parallel.dp={2 // tp}", "train.steps=2", f"train.out_dir={out}",
                                       "rl.reward=megatron_tlt.testing.rewards:digit_fraction_or_raise_on_rank"],
                       timeout=400, env={RAISE_ON_RANK_ENV: str(failing_rank)}, check=False)
    assert res.returncode != 0
    # Both ranks print to the same stderr: their lines may interleave, so match substrings.
    err = res.stderr
    refuses = f"ValueError('test reward refuses to score on rank {failing_rank}')"
    own = "error: reward function megatron_tlt.testing.rewards.digit_fraction_or_raise_on_rank failed on prompt "
    theirs = f"error: step 1 failed on rank {failing_rank}: reward function "
    assert err.count(own) == 1 and err.count(theirs) == 1 and err.count(refuses) == 2, err[-3000:]
    assert _metrics(out) == [] and not (out / "checkpoints" / "latest").exists()


def test_ledger_lists_every_dp_ranks_prompts(run_torchrun, tmp_path):
    """DP=2, 2 prompts a step (8 samples / 4 a prompt): rank 0 writes the ledger and the
    metrics, and both must cover both ranks' prompts (they covered only rank 0's share:
    one prompt and 4 samples a step)."""
    import json

    out = tmp_path / "run"
    run_torchrun(CLI, 2, BASE + ["parallel.dp=2", "train.steps=2", f"train.out_dir={out}"], timeout=400)
    ledger = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    assert [e["step"] for e in ledger] == [1, 2]
    assert [len(e["prompt_ids"]) for e in ledger] == [2, 2], ledger
    assert not set(ledger[0]["prompt_ids"]) & set(ledger[1]["prompt_ids"])  # one epoch: no repeats
    metrics = [json.loads(line) for line in _metrics(out)]
    assert [r["groups"] for r in metrics] == [2, 2], metrics


def test_pp2_logs_the_loss_metrics(run_torchrun, tmp_path):
    """PP=2: the loss figures exist on the last pipeline stage only and the metrics are
    written by global rank 0, a first-stage rank: pg_loss, clip_frac, ... were never logged
    (the progress bar showed loss=0.000)."""
    import json

    out = tmp_path / "run"
    run_torchrun(CLI, 2, BASE + ["parallel.pp=2", "train.steps=1", f"train.out_dir={out}"], timeout=400)
    (row,) = [json.loads(line) for line in _metrics(out)]
    for key in ("pg_loss", "clip_frac", "ratio_mean", "approx_kl_old", "train_infer_logp_gap", "grad_norm"):
        assert key in row, (key, sorted(row))


def test_dp2_step_metrics_equal_dp1(run_torchrun, tmp_path):
    """One step at DP=2 (gloo) and in one process: every figure of the step, speculative
    decoding's drafted / accepted / acceptance included, is the same (bit for bit on CPU),
    except those of one rank's engine by design (timings, engine step counts, the tail
    batch, accept_len_b<bucket>: each rank runs half the batch). Before, the SD counts were
    rank 0's own (120 of 278 drafted tokens here)."""
    import json
    import subprocess
    import sys

    dp1, dp2 = tmp_path / "dp1", tmp_path / "dp2"
    run_torchrun(CLI, 2, BASE + ["parallel.dp=2", "train.steps=1", f"train.out_dir={dp2}"], timeout=400)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    subprocess.run([sys.executable, CLI] + BASE + ["train.steps=1", f"train.out_dir={dp1}"], check=True,
                   env=dict(env, OMP_NUM_THREADS="1"), capture_output=True, timeout=400)
    (a,), (b,) = ([json.loads(line) for line in _metrics(d)] for d in (dp1, dp2))
    local = ("t_", "time", "rollout_steps", "rollout_tokens_per_s", "tail_batch", "accept_len_b",
             "weight_sync_gb_per_s")
    same = {k for k in set(a) | set(b) if not k.startswith(local)}
    assert a["drafted"] > 0 and {"pg_loss", "reward_mean", "train_infer_logp_gap", "acceptance_length"} <= same
    assert {k: a.get(k) for k in same} == {k: b.get(k) for k in same}
