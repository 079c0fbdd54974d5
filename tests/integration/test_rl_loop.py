"""The RL loop end to end on CPU (fp32) with random tiny models and the test rewards of
`megatron_tlt.testing.rewards`.

- resume: N steps straight == (kill -9 during step k+1, after the checkpoint at step k)
  + resume to N: bit-identical per-step metrics (times excluded), and the prompt ledger
  shows no prompt processed twice or skipped;
- bad input, each one `error:` line and exit status 2: a dataset path that does not
  exist; a reward function that raises (the step leaves no metrics line, ledger entry
  or checkpoint, and `resume=auto` then finishes the run exactly as if nothing had
  happened); a checkpoint of another model shape;
- speculative rollouts: greedy spec=eagle, spec=ngram and spec=off give identical
  per-step rewards and losses; at temperature 1 their rewards are statistically
  indistinguishable, and a sampler at the wrong temperature is told apart.

Environment: TLT_RL_TEST_STEPS (resume runs), TLT_RL_TEST_GREEDY_STEPS (3; the issue's
full check is 10), TLT_RL_TEST_STAT_STEPS (2).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import scipy.stats
import torch

from megatron_tlt.checkpoint import Checkpointer
from megatron_tlt.models.optim import lr_at
from megatron_tlt.testing.rewards import RAISE_ON_ANSWER_ENV
from megatron_tlt.testing.tiny_models import make_tiny_hf

REPO = Path(__file__).resolve().parents[2]
STEPS = int(os.environ.get("TLT_RL_TEST_STEPS", "4"))
KILL_AT = int(os.environ.get("TLT_RL_TEST_KILL_AT", "3"))
SAVE_EVERY = int(os.environ.get("TLT_RL_TEST_SAVE_EVERY", "2"))
GREEDY_STEPS = int(os.environ.get("TLT_RL_TEST_GREEDY_STEPS", "3"))
STAT_STEPS = int(os.environ.get("TLT_RL_TEST_STAT_STEPS", "2"))
TIME_KEYS = ("time", "t_", "tokens_per_s", "gb_per_s")
SPEC_KEYS = ("acceptance_rate", "acceptance_length", "drafted", "accepted", "fallbacks")
SPEC_PREFIXES = ("accept_len_b", "rollout_steps")
"""Metrics that differ between spec modes by design: acceptance per batch bucket, and the
engine's step counts (a speculative step emits several tokens)."""
NUM_PROMPTS = 40
LR_ARGS = ("optim.lr=1e-3", "optim.min_lr=1e-4", "optim.lr_warmup_steps=2", "optim.lr_schedule=cosine")
"""Every run's learning-rate schedule (the resume test checks the logged lr follows it)."""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl")
    hf = make_tiny_hf(str(root / "hf"), "llama", vocab_size=100, max_position_embeddings=256, seed=3)
    prompts = root / "prompts.jsonl"
    with open(prompts, "w") as f:
        for i in range(NUM_PROMPTS):
            f.write(json.dumps({"prompt": f"count {i}: " + " ".join(str(i + k) for k in range(3)),
                                "answer": f"a{i}"}) + "\n")
    return root, hf, prompts


def _convert(hf: str, out: Path) -> Path:
    """A Megatron-Core checkpoint of `hf` (runs given model.mcore_ckpt skip the conversion)."""
    subprocess.run([sys.executable, "-m", "megatron_tlt", "convert", "hf-to-mcore", "--hf", hf, "--out", str(out)],
                   cwd=str(REPO), env=_env(), check=True, capture_output=True)
    return out


def _drafter(hf: str, out: Path) -> Path:
    """A randomly initialised EAGLE drafter directory for the model at `hf`: losslessness
    must hold whatever the drafter proposes. Its weights are small (std 0.02) so that it
    mostly passes the target's feature on and some drafts are accepted (at std 0.1 none
    are), exercising the accept path as well as the reject path."""
    from megatron_tlt.models.arch import ModelArch
    from megatron_tlt.spec.eagle import DrafterConfig, EagleDrafter
    from megatron_tlt.spec.export import save_drafter

    arch = ModelArch.from_hf_dir(hf)
    shared = torch.zeros(arch.vocab_size, arch.hidden_size)  # the target's; not stored
    drafter = EagleDrafter(DrafterConfig(arch=arch), shared, shared)
    drafter.reset_parameters(seed=0, std=0.02)
    save_drafter(drafter, str(out))
    return out


@pytest.fixture(scope="module")
def spec_setup(setup):
    root, hf, _ = setup
    return _convert(hf, root / "mcore"), _drafter(hf, root / "drafter")


def _env(extra: dict | None = None) -> dict:
    e = {k: v for k, v in os.environ.items()
         if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    e.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    e.update(extra or {})
    return e


def _train(out, hf, prompts, *extra, env=None, check=True):
    args = [sys.executable, "-m", "megatron_tlt", "train", "--config", str(REPO / "examples" / "tiny_cpu.yaml"),
            f"model.hf_path={hf}", f"data.path={prompts}", "data.tokenizer=tiny",
            "rl.reward=megatron_tlt.testing.rewards:digit_fraction", "model.seq_length=64",
            "rollout.max_new_tokens=12", "rollout.n_samples=4", "train.global_batch_size=8",
            "train.micro_batch_size=4", f"train.steps={STEPS}", f"train.save_interval={SAVE_EVERY}",
            "rl.num_kv_blocks=256", *LR_ARGS, f"train.out_dir={out}", *extra]
    log = _log(out)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    # Output to a file, not a pipe, and the run in its own session: a run killed with
    # SIGKILL leaves helper processes (dist-checkpoint's writer manager) that would hold
    # a pipe open; they are killed with the session.
    with open(log, "w") as f:
        proc = subprocess.Popen(args, cwd=str(REPO), env=_env(env), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=900)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if check and rc != 0:
        pytest.fail(f"train exited {rc}\n{log.read_text()[-4000:]}", pytrace=False)
    return rc


def _log(out) -> Path:
    return Path(str(out) + ".log")


def _error_line(out, rc: int) -> str:
    """The run's one `error: ...` line, its last; the run must have exited 2 without a traceback."""
    text = _log(out).read_text()
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert rc == 2 and len(errors) == 1 and "Traceback" not in text, f"exit {rc}\n{text[-4000:]}"
    assert text.splitlines()[-1] == errors[0], f"the error must be the last line\n{text[-4000:]}"
    return errors[0]


def _metrics(out, keep_spec: bool = False):
    rows = [json.loads(line) for line in open(Path(out) / "metrics.jsonl")]
    return [{k: v for k, v in r.items() if not any(k.startswith(t) or k.endswith(t) for t in TIME_KEYS)
             and (keep_spec or (k not in SPEC_KEYS and not k.startswith(SPEC_PREFIXES)))} for r in rows]


def _ledger(out):
    return [json.loads(line) for line in open(Path(out) / "ledger.jsonl")]


@pytest.fixture(scope="module")
def straight(setup, tmp_path_factory):
    """STEPS steps without interruption: the reference for the resume tests."""
    root, hf, prompts = setup
    out = tmp_path_factory.mktemp("straight") / "run"
    _train(out, hf, prompts)
    return out


def test_resume_after_kill_is_bit_identical(setup, straight, tmp_path):
    root, hf, prompts = setup
    killed = tmp_path / "killed"
    rc = _train(killed, hf, prompts, env={"MEGATRON_TLT_FAULT_KILL_AT_STEP": str(KILL_AT)}, check=False)
    assert rc == -signal.SIGKILL, f"the fault injection must kill the first run (exit {rc})"
    assert len(_metrics(killed)) == KILL_AT - 1
    _train(killed, hf, prompts)  # resume=auto from the last complete checkpoint
    a, b = _metrics(straight), _metrics(killed)
    assert [r["step"] for r in a] == list(range(1, STEPS + 1))
    assert a == b  # every metric of every step, exactly (floats compared bit for bit)
    assert any(abs(r.get("pg_loss", 0.0)) > 0 for r in a), "the test reward must produce a real policy gradient"
    # The RL loop follows optim.* like SFT: warm-up, then cosine to min_lr (resumed too).
    want = [lr_at(s, total_steps=STEPS, lr=1e-3, min_lr=1e-4, warmup_steps=2, schedule="cosine") for s in range(STEPS)]
    assert [r["lr"] for r in a] == want
    la, lb = _ledger(straight), _ledger(killed)
    assert la == lb
    ids = [pid for row in la for pid in row["prompt_ids"]]
    assert len(ids) == len(set(ids)), "a prompt was processed twice"
    # and none skipped: the steps walk the epoch's seeded permutation (train.seed 1234 of
    # tiny_cpu.yaml) position by position. A loop advancing one prompt too far each step
    # passed every test before this (duplicates and straight == resumed only).
    expected = []
    for k in range(len(ids)):
        epoch, off = divmod(k, NUM_PROMPTS)
        order = torch.randperm(NUM_PROMPTS, generator=torch.Generator().manual_seed(1234 * 1000 + epoch))
        expected.append(f"prompts-{int(order[off]) + 1}")
    assert len(ids) == 2 * STEPS and ids == expected, (ids, expected)


def test_resume_replays_ngram_rollouts_at_temperature_one(setup, tmp_path):
    """spec=ngram at temperature 1 on two prompts, three a step (every step repeats them, so the drafter's
    per-prompt store drafts from earlier steps' responses): the drafts decide which coins
    test which tokens, so a run resumed without the store samples other tokens. The store
    is checkpointed per rank: the resumed run's metrics equal the uninterrupted run's.
    Negative control, run by hand at the previous commit (no store in the checkpoint):
    steps 3 and 4 differed (drafted 203 vs 65 tokens at step 3; rewards, losses)."""
    root, hf, _ = setup
    prompts = tmp_path / "two.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"count {i}: " + " ".join(str(i + k) for k in range(3)),
                                           "answer": f"a{i}"}) + "\n" for i in range(2)))
    extra = ("rollout.spec=ngram", "rollout.temperature=1.0", "train.global_batch_size=12",
             "rl.reward=megatron_tlt.testing.rewards:distinct_fraction")
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    _train(straight, hf, prompts, *extra)
    rc = _train(killed, hf, prompts, *extra, env={"MEGATRON_TLT_FAULT_KILL_AT_STEP": str(KILL_AT)}, check=False)
    assert rc == -signal.SIGKILL, f"the fault injection must kill the first run (exit {rc})"
    _train(killed, hf, prompts, *extra)
    a, b = _metrics(straight, keep_spec=True), _metrics(killed, keep_spec=True)
    assert [r["step"] for r in a] == list(range(1, STEPS + 1))
    assert all(r["drafted"] > 0 for r in a[KILL_AT - 1:]), a
    assert a == b
    # 3 prompts a step from 2: the ledger lists a prompt repeated within a step twice (a
    # sorted set of ids hid the repeat)
    la = _ledger(straight)
    assert la == _ledger(killed) and all(len(r["prompt_ids"]) == 3 for r in la), la
    assert all(len(set(r["prompt_ids"])) == 2 for r in la), la


# ---- bad input -----------------------------------------------------------------------


def test_missing_dataset_is_one_line_error(setup, tmp_path):
    root, hf, _ = setup
    missing = tmp_path / "no_such_prompts.jsonl"
    out = tmp_path / "run"
    line = _error_line(out, _train(out, hf, missing, check=False))
    assert line == f"error: data.path {str(missing)!r} not found"
    assert not (out / "init_mcore").exists() and not (out / "checkpoints").exists(), "work started"


def test_reward_error_names_the_prompt_and_writes_nothing_for_the_step(setup, straight, tmp_path):
    root, hf, prompts = setup
    fail_at = SAVE_EVERY + 1
    assert fail_at <= STEPS
    pid = _ledger(straight)[fail_at - 1]["prompt_ids"][-1]
    line_no = int(pid.rsplit("-", 1)[1])  # a data file's prompt ids are "{file stem}-{line}"
    answer = json.loads(prompts.read_text().splitlines()[line_no - 1])["answer"]
    reward = "rl.reward=megatron_tlt.testing.rewards:digit_fraction_or_raise"
    out = tmp_path / "run"
    rc = _train(out, hf, prompts, reward, env={RAISE_ON_ANSWER_ENV: answer}, check=False)
    line = _error_line(out, rc)
    assert f"failed on prompt {pid}: ValueError(\"test reward refuses answer '{answer}'\")" in line, line
    # Nothing of the failed step: no metrics line, ledger entry or checkpoint.
    assert [r["step"] for r in _metrics(out)] == list(range(1, fail_at))
    assert [r["step"] for r in _ledger(out)] == list(range(1, fail_at))
    ck = Checkpointer(str(out))
    assert ck.complete_steps() == [SAVE_EVERY] and ck.latest_step() == SAVE_EVERY
    assert sorted(os.listdir(ck.root)) == ["latest", f"step_{SAVE_EVERY}"]
    _train(out, hf, prompts, reward)  # the verifier fixed: resume=auto finishes the run
    assert _metrics(out) == _metrics(straight)
    assert _ledger(out) == _ledger(straight)


def test_checkpoint_of_another_model_shape_is_refused(setup, straight, tmp_path):
    root, hf, prompts = setup
    wider = make_tiny_hf(str(tmp_path / "hf_wide"), "llama", vocab_size=100, hidden_size=96,
                         max_position_embeddings=256, seed=5)
    out = tmp_path / "run"
    shutil.copytree(straight, out)  # its checkpoints and its cached conversion of `hf`
    before = (out / "metrics.jsonl").read_text()
    rc = _train(out, wider, prompts, f"train.steps={STEPS + 1}", check=False)
    line = _error_line(out, rc)
    assert line.startswith("error: train.resume=auto: ") and line.endswith(
        "checkpoint has hidden_size=64 but the model has hidden_size=96"), line
    assert (out / "metrics.jsonl").read_text() == before
    assert Checkpointer(str(out)).complete_steps() == Checkpointer(str(straight)).complete_steps()


# ---- speculative rollouts ------------------------------------------------------------


def _spec_args(spec: str, drafter: Path) -> list[str]:
    return [f"rollout.spec={spec}"] + ([f"rollout.drafter={drafter}"] if spec == "eagle" else [])


def _assert_speculated(rows: list[dict], spec: str) -> None:
    """SD must have run, or equal metrics would prove nothing."""
    drafted = [r.get("drafted", 0) for r in rows]
    assert all(d > 0 for d in drafted), f"spec={spec} drafted {drafted} tokens per step"
    assert sum(r.get("accepted", 0) for r in rows) > 0, f"spec={spec} never accepted a draft token"


def test_greedy_spec_eagle_and_ngram_equal_off(setup, spec_setup, tmp_path):
    """Greedy, same seeds: every non-timing metric of every step (rewards, losses, grad
    norms, lengths, the actor's entropy estimate and its gap to the engine's log-probs,
    which depend on every token) is identical with spec=eagle (a random drafter),
    spec=ngram and off. A greedy group's samples are equal, so GRPO advantages, losses
    and gradients are 0 and the policy does not move: each step checks a new batch of
    prompts under the same weights."""
    root, hf, prompts = setup
    mcore, drafter = spec_setup
    runs = {}
    for spec in ("off", "ngram", "eagle"):
        out = tmp_path / spec
        _train(out, hf, prompts, f"model.mcore_ckpt={mcore}", *_spec_args(spec, drafter), "rollout.temperature=0",
               "rl.reward=megatron_tlt.testing.rewards:distinct_fraction", f"train.steps={GREEDY_STEPS}",
               "train.save_interval=0")
        runs[spec] = _metrics(out, keep_spec=True)
    assert [r["step"] for r in runs["off"]] == list(range(1, GREEDY_STEPS + 1))
    assert all(r["reward_mean"] > 0 for r in runs["off"]), "the rewards compared must not all be 0"
    for spec in ("ngram", "eagle"):
        _assert_speculated(runs[spec], spec)
        assert _metrics(tmp_path / spec) == _metrics(tmp_path / "off"), f"greedy spec={spec} differs from off"
    # A run started from a Megatron checkpoint (no HF directory) still saves its tokenizer
    # beside the model, so `eval --ckpt RUN_DIR` can read it.
    final = Checkpointer(str(tmp_path / "off")).resolve("auto")
    assert (Path(final) / "model" / "tokenizer.json").is_file(), sorted(os.listdir(Path(final) / "model"))


# Temperature 1. Statistic: Pearson's chi-square on the 2x2 table (run, reward 0/1) of
# the rewards pooled over all steps (no continuity correction). The policy is held fixed
# (lr 1e-9: weights move by ~1e-9 a step), so with a correct sampler both runs draw each
# reward from the same distribution; with real updates a run's curve drifts by more than
# the binomial noise (measured: step means 0.069-0.134 at n=320) and pooling would need
# replicate runs. Every step is one epoch, so both runs see each prompt equally often;
# prompts differ in their reward rate, so pooled counts vary less than binomially
# (measured per-step sd 3-8 against 8.7) and the test is conservative. Runs use different
# seeds: SD consumes the random stream differently, so per-token equality is not expected
# at temperature 1. The model's LM head is scaled by 8 (entropy ~2.4 nats) so that the
# reward, `many_distinct_chars` (rate ~0.6 at T=1), follows the sampling temperature.
STAT_PROMPTS_PER_STEP = NUM_PROMPTS  # each step is one epoch: every run sees the same prompts
STAT_SAMPLES = 8
STAT_P_MIN = 1e-3


@pytest.fixture(scope="module")
def peaked(setup):
    from safetensors.torch import load_file, save_file

    root, _, _ = setup
    hf = make_tiny_hf(str(root / "hf_peaked"), "llama", vocab_size=100, max_position_embeddings=256, seed=3)
    tensors = load_file(os.path.join(hf, "model.safetensors"))
    tensors["lm_head.weight"] *= 8
    save_file(tensors, os.path.join(hf, "model.safetensors"), metadata={"format": "pt"})
    return hf, _convert(hf, root / "mcore_peaked"), _drafter(hf, root / "drafter_peaked")


def _reward_counts(rows: list[dict]) -> tuple[int, int]:
    """(rewards 1, rewards 0) pooled over steps; reward_mean * n is an integer for 0/1 rewards."""
    n = STAT_PROMPTS_PER_STEP * STAT_SAMPLES
    ones = sum(round(r["reward_mean"] * n) for r in rows)
    return ones, n * len(rows) - ones


def _chi2_p(a: tuple[int, int], b: tuple[int, int]) -> float:
    return float(scipy.stats.chi2_contingency([a, b], correction=False).pvalue)


def test_temperature_one_spec_rewards_match_off(setup, peaked, tmp_path):
    """Statistic above; n = STAT_STEPS x 320 rewards per run (640 in CI). Pass: p > 1e-3
    for eagle vs off and for ngram vs off, so correct samplers fail this test with
    probability <= 2e-3. Power (rates near 0.6, n = 640 a side): a difference of 0.09 in
    the reward rate is caught half the time, 0.15 with probability 0.99. Negative control:
    off at temperature 0.7 (one step, n = 320; rate ~0.32 vs ~0.61) must give p < 1e-3;
    its expected z is ~9, so it is missed with probability < 1e-8.
    Measured with the CI defaults (counter-based noise streams, 2026-12-02): reward
    counts (1, 0) off (381, 259), ngram (396, 244), eagle (390, 250), T=0.7 control
    (107, 213); p = 0.39 (ngram), 0.61 (eagle), 2.5e-14 (control). With the earlier
    per-request torch.Generator noise and TLT_RL_TEST_STAT_STEPS=6 (n = 1920): p = 1.0
    (ngram), 0.79 (eagle), 1.4e-23 (control)."""
    root, _, prompts = setup
    hf, mcore, drafter = peaked
    common = [f"model.mcore_ckpt={mcore}", "rl.reward=megatron_tlt.testing.rewards:many_distinct_chars",
              f"rollout.n_samples={STAT_SAMPLES}", f"train.global_batch_size={STAT_PROMPTS_PER_STEP * STAT_SAMPLES}",
              "train.micro_batch_size=32", "rl.num_kv_blocks=1024", "optim.lr=1e-9", "optim.min_lr=0",
              f"train.steps={STAT_STEPS}", "train.save_interval=0",
              "rollout.spec_threshold=null"]  # SD at every batch size (the default: <= 32 running)
    runs = {"off": ["rollout.spec=off", "train.seed=11"],
            "ngram": _spec_args("ngram", drafter) + ["train.seed=12"],
            "eagle": _spec_args("eagle", drafter) + ["train.seed=13"],
            "off_t0.7": ["rollout.spec=off", "rollout.temperature=0.7", "train.seed=14", "train.steps=1"]}
    rows, counts = {}, {}
    for name, args in runs.items():
        out = tmp_path / name
        _train(out, hf, prompts, *common, "rollout.temperature=1", *args)
        rows[name] = _metrics(out, keep_spec=True)
        counts[name] = _reward_counts(rows[name])
    for name in ("ngram", "eagle"):
        _assert_speculated(rows[name], name)
        # Independent samples, not a replay of off's tokens (the entropy estimate sums them all).
        assert [r["entropy_est"] for r in rows[name]] != [r["entropy_est"] for r in rows["off"]]
    p = {name: _chi2_p(counts[name], counts["off"]) for name in ("ngram", "eagle", "off_t0.7")}
    print(f"\nreward counts (1, 0): {counts}; chi-square p vs off: {p}")
    for name in ("ngram", "eagle"):
        assert p[name] > STAT_P_MIN, (f"spec={name} rewards differ from spec=off: {counts[name]} vs {counts['off']}, "
                                     f"p={p[name]:.2e}; a correct sampler gets p <= {STAT_P_MIN} with probability "
                                     f"{STAT_P_MIN}")
    assert p["off_t0.7"] < STAT_P_MIN, (f"negative control: temperature 0.7 vs 1 not told apart ({counts}, "
                                        f"p={p['off_t0.7']:.2e}); the test has no power")
    # The actor's log-probs are of the tempered distribution the engine samples from: the
    # logged gap is summation-order noise at T=0.7 too, not the tempering the actor used to
    # leave out (tests/unit/rl/test_step.py shows the size of that).
    gaps = {name: max(r["train_infer_logp_gap"] for r in rows[name]) for name in rows}
    assert all(g < 1e-4 for g in gaps.values()), f"train-inference log-prob gap per token: {gaps}"
