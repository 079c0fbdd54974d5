"""`megatron-tlt train`: the GRPO loop on the Megatron-Core actor with native rollouts.

One step, on every rank (SPMD):
  prompts (this DP rank's share)  -> rollout on the model-parallel group's first rank,
  broadcast to its TP/PP peers    -> rewards -> group advantages (+ DAPO filter)
  -> actor log-probs (old; and reference when KL is on) -> PPO-clip update at the
     scheduled learning rate (optim.*, the schedule SFT uses: models/optim.py lr_for_step)
  -> weights synced into the engine in place (policy version + 1) -> metrics, checkpoint.

Randomness is an input: request r of a step is sampled with the seed
hash(run seed, step, prompt id, sample index), so a resumed run replays the same tokens.
Data order: an epoch is a seeded permutation of the prompt set; the data position
(prompts consumed) is part of the checkpoint, and each step's prompt ids are appended to
`ledger.jsonl` (rank 0), so a crash never processes a prompt twice or skips one.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import os
import time
from typing import Optional

import torch
import torch.distributed as dist
from tqdm import tqdm

from megatron_tlt.convert import is_conversion_of
from megatron_tlt.data.tasks import length_stats
from megatron_tlt.errors import CheckpointError, ConfigError, TLTError
from megatron_tlt.spec.stats import bucket_of

log = logging.getLogger(__name__)


def request_seed(run_seed: int, step: int, prompt_id: str, sample_index: int) -> int:
    h = hashlib.sha256(f"{run_seed}/{step}/{prompt_id}/{sample_index}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def _percentiles(xs: list[int]) -> dict:
    """The step's response-length figures: data.tasks.length_stats (nearest rank), as ints."""
    if not xs:
        return {}
    st = length_stats(xs)
    return {"len_p50": int(st["median"]), "len_p90": int(st["p90"]), "len_p99": int(st["p99"]),
            "len_max": int(st["max"]), "len_mean": st["mean"]}


def rollout_time_metrics(step_log: list[tuple[int, float]], num_requests: int,
                         spec_by_batch: dict | None = None) -> dict:
    """Where a rollout's time went, from the engine's step log [(running batch, seconds)]:
    t_rollout_tail = seconds of the long tail, the steps that ran at most a quarter of the
    rollout's sequences (`tail_batch`); t_rollout_b<bucket> = seconds per running-batch
    bucket (spec/stats.py's buckets 1, 2-4, 5-8, 9-16, 17-32, 33+, written b1, b2_4, ...,
    b33_up); and with speculative decoding accept_len_b<bucket>, the acceptance length
    per bucket. (The caller adds t_rollout_capture: RolloutEngine.capture_seconds() over
    the rollout.)"""
    tail = max(1, num_requests // 4)
    m = {"tail_batch": tail, "rollout_steps": len(step_log),
         "rollout_steps_tail": sum(1 for b, _ in step_log if b <= tail),
         "t_rollout_tail": sum(t for b, t in step_log if b <= tail)}
    for b, t in step_log:
        key = f"t_rollout_b{_key(bucket_of(b))}"
        m[key] = m.get(key, 0.0) + t
    for name, row in (spec_by_batch or {}).items():
        if row.get("acceptance_length") is not None:
            m[f"accept_len_b{_key(name)}"] = row["acceptance_length"]
    return m


def _spec_step_metrics(parts: list[tuple[dict, dict]]) -> dict:
    """The step's speculative-decoding figures over every DP rank's rollout: `parts` holds
    each rank's (SpecMetrics total, {bucket: (accepted, num_drafts)}); counts are
    summed and the acceptance rate / length (overall and accept_len_b<bucket>) computed
    from the sums (rank 0's own figures were logged for the whole step before). Empty
    without speculative decoding."""
    if not any(total for total, _ in parts):
        return {}
    m = {k: sum(int(total.get(k, 0)) for total, _ in parts) for k in ("drafted", "accepted", "fallbacks")}
    n = sum(int(total.get("num_drafts", 0)) for total, _ in parts)
    m["acceptance_rate"] = m["accepted"] / m["drafted"] if m["drafted"] else None
    m["acceptance_length"] = 1.0 + m["accepted"] / n if n else None
    buckets: dict[str, list[int]] = {}
    for _, rows in parts:
        for name, (acc, num) in rows.items():
            b = buckets.setdefault(name, [0, 0])
            b[0] += acc
            b[1] += num
    for name, (acc, num) in buckets.items():
        if num:
            m[f"accept_len_b{_key(name)}"] = 1.0 + acc / num
    return {k: v for k, v in m.items() if v is not None}


def _key(bucket: str) -> str:
    """A bucket name as a metric-name suffix TensorBoard accepts: 2-4 -> 2_4, 33+ -> 33_up."""
    return bucket.replace("-", "_").replace("+", "_up")


def check_data(cfg) -> None:
    """The data settings that can be checked without a model: before any work starts."""
    path = cfg.data.path
    if path is None:
        return
    if not os.path.isfile(path):
        what = "is a directory, not a file" if os.path.isdir(path) else "not found"
        raise ConfigError(f"data.path {path!r} {what}")
    if cfg.rl.reward is None:
        raise ConfigError(f"data.path ({path!r}) needs rl.reward (a registered reward or 'package.module:function'); "
                          "it is null")


def check_sampling(cfg) -> None:
    """Rollout sampling the update can be exact about. The actor recomputes log-probs of
    log_softmax(logits / T) (rl/step.py), the distribution the engine reports; top-k /
    top-p sample from a truncated, renormalised one, which would make every PPO ratio
    off-policy by the truncated mass. Reproducing the truncation in the actor needs a
    full-vocabulary sort at every training position (across TP ranks for vocab-parallel
    logits) for a setting GRPO recipes leave off, so it is refused instead."""
    ro = cfg.rollout
    if ro.top_k > 0:
        raise ConfigError(f"rollout.top_k ({ro.top_k}) must be 0 for RL training: the actor's log-probs are of "
                          "the full distribution at rollout.temperature, so top-k sampling would make the "
                          "update off-policy; use rollout.temperature to sharpen sampling")
    if ro.top_p < 1.0:
        raise ConfigError(f"rollout.top_p ({ro.top_p}) must be 1.0 for RL training: the actor's log-probs are of "
                          "the full distribution at rollout.temperature, so nucleus sampling would make the "
                          "update off-policy; use rollout.temperature to sharpen sampling")


@dataclasses.dataclass
class _Prompt:
    prompt_id: str
    prompt: str
    answer: str
    task: str
    repeat: int = 0
    """Earlier occurrences of this prompt in the step (one that spans an epoch boundary, or
    asks more prompts than the set holds, can hold a prompt twice): its samples take
    sample indices repeat * n_samples + j, so their request keys and seeds differ."""


class RLRun:
    def __init__(self, cfg):
        from megatron.core import parallel_state as ps

        from megatron_tlt.checkpoint import Checkpointer
        from megatron_tlt.metrics import MetricsWriter
        from megatron_tlt.models import mcore
        from megatron_tlt.models.actor import Actor
        from megatron_tlt.models.optim import OptimSettings, build_optimizer

        check_data(cfg)
        check_sampling(cfg)
        self.cfg = cfg
        par = cfg.parallel
        mcore.init_parallel(par.tp, par.pp, seed=cfg.train.seed)
        world = dist.get_world_size()
        if world != par.tp * par.pp * par.dp:
            raise ConfigError(f"parallel.tp ({par.tp}) x parallel.pp ({par.pp}) x parallel.dp ({par.dp}) "
                              f"must equal the world size ({world})")
        self.rank = dist.get_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp = ps.get_data_parallel_world_size()
        self.out_dir = cfg.train.out_dir
        os.makedirs(self.out_dir, exist_ok=True)

        self.model_dir = self._model_dir()
        self.tokenizer = self._tokenizer()
        self.prompts = self._fit(self._prompts())
        n = cfg.rollout.n_samples
        if cfg.train.global_batch_size % n:
            raise ConfigError(f"train.global_batch_size ({cfg.train.global_batch_size}) must be a multiple of "
                              f"rollout.n_samples ({n})")
        self.prompts_per_step = cfg.train.global_batch_size // n
        if self.prompts_per_step % self.dp:
            raise ConfigError(f"prompts per step ({self.prompts_per_step} = train.global_batch_size / "
                              f"rollout.n_samples) must be a multiple of parallel.dp ({self.dp})")

        declared = None
        if self.model_dir is not None:  # before the conversion (the engine checks it after)
            from megatron_tlt.models.arch import ModelArch
            declared = ModelArch.from_hf_dir(self.model_dir)
            most = declared.max_position_embeddings
            if cfg.model.seq_length > most:
                raise ConfigError(f"model.seq_length ({cfg.model.seq_length}) exceeds the model's "
                                  f"max_position_embeddings ({most}, {self.model_dir})")
        # the speculative-decoding settings and the checkpoint to resume from, also before the
        # conversion and model loads (a typo there cost a whole conversion of the model)
        self._check_spec_settings(declared)
        self.ckpt = Checkpointer(self.out_dir, keep_last=cfg.train.keep_last)
        path = self.ckpt.resolve(cfg.train.resume)
        mc_dir = self._mcore_checkpoint()
        from megatron_tlt.models.mcore_ckpt import read_meta

        meta = read_meta(mc_dir)
        self.arch = meta["arch"]
        dtype = cfg.model.dtype
        self.actor = Actor(self.arch, tp=par.tp, pp=par.pp, dtype=dtype, use_te=cfg.model.use_te)
        self.actor.load(mc_dir)
        o = cfg.optim
        self.optimizer = build_optimizer(self.actor, OptimSettings(
            lr=o.lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2,
            adam_eps=o.eps, clip_grad=o.clip_grad))
        self.ref = None
        if cfg.rl.kl_coef > 0:
            self.ref = Actor(self.arch, tp=par.tp, pp=par.pp, dtype=dtype, use_te=cfg.model.use_te)
            self.ref.load(mc_dir)
            self.ref.model.requires_grad_(False)

        self.engine = self._engine()
        self.step = 0
        self.data_pos = 0
        if path is not None:
            try:
                state = self.ckpt.load(path, self.actor, self.optimizer)
            except CheckpointError as e:
                raise CheckpointError(f"train.resume={cfg.train.resume}: {e}") from None
            self.step, self.data_pos = int(state["step"]), int(state["data_position"])
            self._restore_rank_state(state.get("_rank_state"))
        self.ledger = os.path.join(self.out_dir, "ledger.jsonl")
        if self.rank == 0:
            _truncate_jsonl(self.ledger, self.step)  # steps after the checkpoint are redone
        from megatron_tlt.weights.sync import sync_actor_to_engine

        sync_actor_to_engine(self.actor, self.engine, version=self.step)
        self.metrics = MetricsWriter(self.out_dir, tensorboard=cfg.logging.tensorboard,
                                     resume_step=self.step if path is not None else None)

    def _ngram_drafter(self):
        sd = getattr(self.engine, "spec_decoder", None)
        drafter = getattr(sd, "drafter", None)
        return drafter if getattr(drafter, "name", None) == "ngram" else None

    def _rank_state(self):
        """This rank's state beyond the trainer's that a resumed run needs to replay the
        same tokens: the n-gram drafter's per-prompt store (at temperature > 0 its drafts
        decide which coins test which tokens); None without one."""
        drafter = self._ngram_drafter()
        return None if drafter is None else {"ngram_store": drafter.state_dict()}

    def _restore_rank_state(self, rank_state) -> None:
        drafter = self._ngram_drafter()
        if drafter is not None and isinstance(rank_state, dict) and "ngram_store" in rank_state:
            drafter.load_state_dict(rank_state["ngram_store"])

    # ---- setup helpers -----------------------------------------------------------------
    def _model_dir(self) -> Optional[str]:
        m = self.cfg.model
        if m.hf_path:
            return m.hf_path
        if m.mcore_ckpt:
            return None
        from megatron_tlt.demo import tiny_default_dir

        path = tiny_default_dir()
        if path is None:
            raise ConfigError("model.hf_path and model.mcore_ckpt are null and this build ships no tiny default")
        return path

    def _tokenizer(self):
        from megatron_tlt.data.tokenizer import load_tokenizer, tokenizer_dir

        name = self.cfg.data.tokenizer or self.model_dir or self.cfg.model.mcore_ckpt
        self.tokenizer_dir = tokenizer_dir(name)  # copied next to every saved model
        return load_tokenizer(name)

    def _prompts(self) -> list[_Prompt]:
        from megatron_tlt.data.datasets import load_prompt_dataset
        from megatron_tlt.data.rewards import get_reward
        from megatron_tlt.data.tasks import make_dataset

        d = self.cfg.data
        if d.path:
            samples = load_prompt_dataset(d.path, prompt_field=d.prompt_field, answer_field=d.answer_field,
                                          task=self.cfg.rl.reward)
            return [_Prompt(s.prompt_id, s.prompt, s.answer, s.task or self.cfg.rl.reward) for s in samples]
        samples = make_dataset(list(d.tasks), d.num_train, seed=self.cfg.train.seed, split="train")
        # rl.reward, when set, replaces the tasks' own rewards (it was silently ignored);
        # checked now, so a typo fails before any rollout.
        if self.cfg.rl.reward is not None:
            get_reward(self.cfg.rl.reward)
        return [_Prompt(s.prompt_id, s.prompt, s.answer, self.cfg.rl.reward or s.task) for s in samples]

    def _fit(self, prompts: list[_Prompt]) -> list[_Prompt]:
        """Drop prompts whose tokens + rollout.max_new_tokens exceed model.seq_length."""
        # The engine holds prompt + max_new_tokens <= model.seq_length (its max_model_len).
        budget = self.cfg.model.seq_length - self.cfg.rollout.max_new_tokens
        kept = [p for p in prompts if len(self.tokenizer.encode_prompt(p.prompt)) <= budget]
        if not kept:
            raise ConfigError(f"every prompt is longer than model.seq_length ({self.cfg.model.seq_length}) - "
                              f"rollout.max_new_tokens ({self.cfg.rollout.max_new_tokens}) tokens")
        if len(kept) < len(prompts):
            log.warning("dropped %d of %d prompts longer than %d tokens (model.seq_length - rollout.max_new_tokens)",
                        len(prompts) - len(kept), len(prompts), budget)
        return kept

    def _mcore_checkpoint(self) -> str:
        if self.cfg.model.mcore_ckpt:
            return self.cfg.model.mcore_ckpt
        dst = os.path.join(self.out_dir, "init_mcore")
        if self.rank == 0 and not is_conversion_of(dst, self.model_dir):
            # Conversion builds its own world-of-one model; do it in the rank-0 process
            # before the others read it.
            _convert_in_place(self.model_dir, dst)
        dist.barrier()
        return dst

    def _engine(self):
        from megatron_tlt.models import mcore
        from megatron_tlt.rollout import EngineWeights, RolloutEngine
        from megatron_tlt.rollout.engine import fast_path_options

        dt = mcore.torch_dtype(self.cfg.model.dtype)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        weights = EngineWeights(self.arch, dtype=dt, device=device)
        r = self.cfg.rl
        engine = RolloutEngine(self.arch, weights, max_num_seqs=r.max_num_seqs, num_blocks=r.num_kv_blocks,
                             block_size=16, dtype=dt, device=device,
                             max_model_len=self.cfg.model.seq_length,
                             eos_token_ids=[self.tokenizer.eos_id], detokenize=self.tokenizer.decode,
                             seed=self.cfg.train.seed, **fast_path_options(device))
        engine.spec_decoder = self._spec_decoder(weights)
        return engine

    def _check_spec_settings(self, declared) -> None:
        """rollout.spec's settings from the config alone (and the drafter's config.json
        against `declared`, the HF model's arch, when known): ConfigError / CheckpointError."""
        ro = self.cfg.rollout
        if ro.spec == "off":
            return
        if ro.spec == "adaptive":
            raise ConfigError("rollout.spec=adaptive is not available in this build yet; use off, ngram or eagle")
        from megatron_tlt.spec.decode import depth_policy

        depth_policy(ro.spec_depth, topk=ro.spec_topk, num_verify_tokens=ro.spec_num_verify,
                     threshold=ro.spec_threshold)
        if ro.spec == "eagle":
            if not ro.drafter:
                raise ConfigError("rollout.spec=eagle needs rollout.drafter (a drafter directory written by "
                                  "python -m megatron_tlt.spec.train_drafter)")
            from megatron_tlt.spec.export import check_target, read_drafter_config

            config, _ = read_drafter_config(ro.drafter)
            if declared is not None:
                check_target(config, declared, ro.drafter)

    def _spec_decoder(self, weights):
        ro = self.cfg.rollout
        if ro.spec == "off":
            return None
        from megatron_tlt.spec.decode import SpecDecoder, depth_policy

        policy = depth_policy(ro.spec_depth, topk=ro.spec_topk, num_verify_tokens=ro.spec_num_verify,
                              threshold=ro.spec_threshold)
        if ro.spec == "eagle":  # settings checked by _check_spec_settings
            from megatron_tlt.spec.eagle import EagleProposer
            from megatron_tlt.spec.export import load_drafter

            drafter = EagleProposer(load_drafter(ro.drafter, self.arch, weights.embed, weights.lm_head,
                                                 dtype=weights.dtype, device=weights.device))
        else:
            from megatron_tlt.spec.ngram import NgramDrafter

            drafter = NgramDrafter(max_ngram=4)
        return SpecDecoder(drafter, policy=policy)

    # ---- the step ----------------------------------------------------------------------
    def _epoch_order(self, epoch: int) -> torch.Tensor:
        """The seeded permutation of the prompt set for `epoch` (computed once per epoch)."""
        if getattr(self, "_order", (None,))[0] != epoch:
            gen = torch.Generator().manual_seed(self.cfg.train.seed * 1000 + epoch)
            self._order = (epoch, torch.randperm(len(self.prompts), generator=gen))
        return self._order[1]

    def _step_prompts(self) -> tuple[list[_Prompt], list[_Prompt]]:
        """(this DP rank's prompts for the current step, every rank's: rank 0's share
        first). Epochs are seeded permutations; every rank computes the same list."""
        n = len(self.prompts)
        step, seen = [], collections.Counter()
        for k in range(self.prompts_per_step):
            epoch, off = divmod(self.data_pos + k, n)
            p = self.prompts[int(self._epoch_order(epoch)[off])]
            step.append(dataclasses.replace(p, repeat=seen[p.prompt_id]) if seen[p.prompt_id] else p)
            seen[p.prompt_id] += 1
        share = self.prompts_per_step // self.dp
        return step[self.dp_rank * share:(self.dp_rank + 1) * share], step

    def _rollout(self, prompts: list[_Prompt]):
        """Generate and score on the first rank of the model-parallel group; broadcast to
        the rest. A failure there (a reward function that raises, an engine error) fails
        the step on every rank of the job, not only on that one: the others would wait in
        the next collective (or, under torchrun, be torn down without a word). The failing
        rank re-raises its exception; the others raise TLTError naming it."""
        from megatron.core import parallel_state as ps

        group = ps.get_model_parallel_group()
        src = dist.get_process_group_ranks(group)[0]
        payload: list = [None]
        failure = None
        if self.rank == src:
            try:
                payload = [self._generate_and_score(prompts)]
            except Exception as e:  # every rank learns of it below, then it is re-raised
                failure = e
                payload = [{"error": str(e) if isinstance(e, TLTError) else f"{type(e).__name__}: {e}",
                            "rank": self.rank}]
        if dist.get_world_size(group) > 1:
            dist.broadcast_object_list(payload, src=src, group=group)
        error = self._first_error(payload[0] if "error" in payload[0] else None)
        if failure is not None:
            raise failure
        if error is not None:
            raise TLTError(f"step {self.step + 1} failed on rank {error['rank']}: {error['error']}")
        return payload[0]

    def _first_error(self, error: dict | None) -> dict | None:
        """The lowest failing rank's {"error", "rank"} across the whole job (one all-reduce
        of a flag per step; the messages are gathered only when some rank failed)."""
        if dist.get_world_size() == 1:
            return error
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=self.actor.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag) == 0:
            return None
        errors: list = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        return next(e for e in errors if e is not None)

    def _generate_and_score(self, prompts: list[_Prompt]) -> dict:
        """Rollouts of this rank's prompts and their rewards (the model-parallel group's
        first rank only): the payload `_rollout` broadcasts."""
        from megatron_tlt.data.rewards import compute_rewards
        from megatron_tlt.rollout import Request, SamplingParams

        ro = self.cfg.rollout
        reqs = []
        for p in prompts:
            ptoks = self.tokenizer.encode_prompt(p.prompt)
            for j in range(p.repeat * ro.n_samples, (p.repeat + 1) * ro.n_samples):
                sp = SamplingParams(temperature=ro.temperature, top_k=ro.top_k, top_p=ro.top_p,
                                    max_new_tokens=ro.max_new_tokens,
                                    seed=request_seed(self.cfg.train.seed, self.step, p.prompt_id, j))
                reqs.append(Request(prompt_id=p.prompt_id, sample_index=j, prompt_token_ids=ptoks,
                                    sampling_params=sp))
        t0 = time.perf_counter()
        sd = self.engine.spec_decoder
        if sd is not None:
            sd.metrics.reset()
        c0 = self.engine.capture_seconds()
        results = self.engine.generate(reqs)
        t_roll = time.perf_counter() - t0
        t_capture = self.engine.capture_seconds() - c0
        summary = sd.metrics.summary() if sd is not None else {}
        spec = summary.get("total", {})
        timing = rollout_time_metrics(self.engine.step_log, len(reqs), summary.get("by_batch_size"))
        timing["t_rollout_capture"] = t_capture
        for r in results:
            if r.error:
                raise TLTError(f"rollout of prompt {r.prompt_id} failed: {r.error}")
        texts = [self.tokenizer.decode(r.token_ids, skip_special_tokens=True) for r in results]
        by_id = {p.prompt_id: p for p in prompts}
        t1 = time.perf_counter()
        rewards = []
        for task in sorted({by_id[r.prompt_id].task for r in results}):
            idx = [i for i, r in enumerate(results) if by_id[r.prompt_id].task == task]
            vals = compute_rewards(task, [texts[i] for i in idx], [by_id[results[i].prompt_id].answer for i in idx],
                                   [results[i].prompt_id for i in idx],
                                   truncated=[results[i].finish_reason == "length" for i in idx])
            rewards.extend(zip(idx, vals))
        rewards = [v for _, v in sorted(rewards)]
        t_rew = time.perf_counter() - t1
        return {
            "prompt_ids": [r.prompt_id for r in results], "sample_indices": [r.sample_index for r in results],
            "prompt_tokens": [req.prompt_token_ids for req in reqs],
            "response_tokens": [list(r.token_ids) for r in results],
            "rollout_logprobs": [list(r.logprobs or []) for r in results],
            "rewards": rewards, "t_rollout": t_roll, "t_reward": t_rew,
            "policy_version": self.engine.policy_version, "spec": spec, "timing": timing,
            "spec_buckets": {k: (row["accepted"], row["num_drafts"])
                             for k, row in summary.get("by_batch_size", {}).items()},
        }

    def run_step(self) -> dict:
        from megatron.core import parallel_state as ps

        from megatron_tlt.models.optim import lr_for_step
        from megatron_tlt.rl.advantages import group_advantages, informative_groups
        from megatron_tlt.rl.losses import PPOLossConfig
        from megatron_tlt.rl.step import RolloutBatch, actor_logprobs, make_microbatches, policy_update
        from megatron_tlt.weights.sync import sync_actor_to_engine

        cfg, r = self.cfg, self.cfg.rl
        t_step = time.perf_counter()
        prompts, step_prompts = self._step_prompts()
        ro = self._rollout(prompts)
        if os.environ.get("MEGATRON_TLT_FAULT_KILL_AT_STEP") == str(self.step + 1):
            # Fault injection for the resume tests: die mid-step, after rollouts, like a
            # preempted node would (no cleanup, no checkpoint).
            os.kill(os.getpid(), 9)
        G = cfg.rollout.n_samples
        rewards = torch.tensor(ro["rewards"], dtype=torch.float32).view(-1, G)
        adv = group_advantages(rewards, std_normalize=r.std_normalize)
        keep = informative_groups(rewards) if r.dapo_filter else torch.ones(rewards.shape[0], dtype=torch.bool)
        batch = RolloutBatch(ro["prompt_ids"], ro["sample_indices"], ro["prompt_tokens"], ro["response_tokens"],
                             ro["rollout_logprobs"], rewards.view(-1), adv.view(-1))
        rows = [i for i in range(len(batch)) if bool(keep[i // G])]
        lengths = [len(t) for t in batch.response_tokens]
        # reward and length figures over the whole step: every DP rank's groups (this rank
        # holds its share; the rollout speed stays this rank's own)
        all_rewards, all_keep, all_lengths = rewards, keep, lengths
        spec_parts = [(ro["spec"], ro["spec_buckets"])]
        if self.dp > 1:
            parts = [None] * self.dp
            dist.all_gather_object(parts, (rewards.tolist(), keep.tolist(), lengths, ro["spec"],
                                           ro["spec_buckets"]), group=ps.get_data_parallel_group())
            all_rewards = torch.tensor([r for p in parts for r in p[0]], dtype=torch.float32)
            all_keep = torch.tensor([k for p in parts for k in p[1]], dtype=torch.bool)
            all_lengths = [n for p in parts for n in p[2]]
            spec_parts = [(p[3], p[4]) for p in parts]
        m = {"reward_mean": float(all_rewards.mean()),
             "reward_std": float(all_rewards.std()) if all_rewards.numel() > 1 else 0.0,
             "groups_kept": int(all_keep.sum()), "groups": int(all_keep.numel()), **_percentiles(all_lengths),
             "t_rollout": ro["t_rollout"], **ro["timing"], "t_reward": ro["t_reward"],
             "rollout_tokens_per_s": sum(lengths) / max(ro["t_rollout"], 1e-9),
             "policy_version": ro["policy_version"]}
        m.update(_spec_step_metrics(spec_parts))
        # Every DP rank must run the same number of micro-batches: pad with masked rows.
        n_local = torch.tensor([len(rows)], dtype=torch.long, device=self.actor.device)
        dist.all_reduce(n_local, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
        t0 = time.perf_counter()
        if int(n_local) > 0:
            sub = batch.select(rows) if rows else batch.select([0])
            if not rows:
                sub.advantages = torch.zeros(1)
            mbs = make_microbatches(sub, seq_length=cfg.model.seq_length, micro_batch_size=cfg.train.micro_batch_size,
                                    pad_id=self.tokenizer.pad_id)
            need = -(-int(n_local) // cfg.train.micro_batch_size)
            while len(mbs) < need:  # pad micro-batches of masked rows
                pad = make_microbatches(batch.select([0]), seq_length=cfg.model.seq_length,
                                        micro_batch_size=cfg.train.micro_batch_size, pad_id=self.tokenizer.pad_id)[0]
                pad.loss_mask.zero_()
                mbs.append(pad)
            if not rows:
                for mb in mbs:
                    mb.loss_mask.zero_()
            temp = cfg.rollout.temperature
            old = actor_logprobs(self.actor, mbs, temperature=temp)
            t_lp = time.perf_counter() - t0
            ref = actor_logprobs(self.ref, mbs, temperature=temp) if self.ref is not None else None
            ntok = torch.tensor([float(sum(mb.loss_mask.sum() for mb in mbs))], device=self.actor.device)
            nseq = torch.tensor([float(len(rows))], device=self.actor.device)
            dist.all_reduce(ntok, group=ps.get_data_parallel_group())
            dist.all_reduce(nseq, group=ps.get_data_parallel_group())
            if old is not None:  # the mean over every DP rank's tokens (the sum all-reduced too)
                gap = torch.stack([((o - mb.extra["rollout_logp"]).abs() * mb.loss_mask).sum()
                                   for o, mb in zip(old, mbs)]).sum().reshape(1).to(ntok)
                dist.all_reduce(gap, group=ps.get_data_parallel_group())
                m["train_infer_logp_gap"] = float(gap) / max(float(ntok), 1.0)
            self.engine.sleep()
            t1 = time.perf_counter()
            m["lr"] = lr_for_step(cfg, self.step)
            self.optimizer.set_lr(m["lr"])
            upd = policy_update(self.actor, self.optimizer, mbs, old,
                                PPOLossConfig(clip_eps_low=r.clip_eps_low, clip_eps_high=r.clip_eps_high,
                                              kl_coef=r.kl_coef, aggregation=r.loss_aggregation),
                                ref_logps=ref, global_tokens=max(float(ntok), 1.0), global_seqs=max(float(nseq), 1.0),
                                temperature=temp)
            m["t_update"] = time.perf_counter() - t1
            m["t_logprobs"] = t_lp
            m.update(upd)
            if ps.get_pipeline_model_parallel_world_size() > 1:
                # The loss figures exist on the last pipeline stage only; the metrics are
                # written by global rank 0, a first-stage rank.
                last = ps.is_pipeline_last_stage()
                box = [{k: v for k, v in m.items() if k in upd or k == "train_infer_logp_gap"} if last else None]
                dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                           group=ps.get_pipeline_model_parallel_group())
                for k, v in box[0].items():
                    m.setdefault(k, v)
            self.engine.wake()
        t2 = time.perf_counter()
        stats = sync_actor_to_engine(self.actor, self.engine, version=self.step + 1)
        m["t_weight_sync"] = time.perf_counter() - t2
        m["weight_sync_gb_per_s"] = stats["gb_per_s"]
        self.step += 1
        self.data_pos += self.prompts_per_step
        if self.rank == 0:  # the step's prompts on every DP rank (batch holds this rank's share),
            # in order, a prompt repeated within the step (an epoch boundary) listed twice
            step_ids = [p.prompt_id for p in step_prompts]
            with open(self.ledger, "a") as f:
                f.write(json.dumps({"step": self.step, "prompt_ids": step_ids}) + "\n")
        m["t_step"] = time.perf_counter() - t_step
        return m

    def train(self) -> None:
        cfg = self.cfg
        total = cfg.train.steps
        # The bar is closed before an error propagates, so the CLI's error line comes last.
        with tqdm(total=total, initial=self.step, desc="rl", unit="step", disable=self.rank != 0) as bar:
            while self.step < total:
                m = self.run_step()
                if self.step % cfg.logging.log_interval == 0 or self.step == total:
                    self.metrics.log(self.step, m)
                bar.update(1)
                bar.set_postfix(reward=f"{m['reward_mean']:.3f}", len=m.get("len_p50"),
                                loss=f"{m.get('pg_loss', 0):.3f}")
                if (cfg.train.save_interval and self.step % cfg.train.save_interval == 0) or self.step == total:
                    self.ckpt.save(self.step, self.actor, self.optimizer,
                                   {"data_position": self.data_pos}, tokenizer_from=self.tokenizer_dir,
                                   rank_state=self._rank_state())
        self.metrics.close()
        if self.rank == 0:
            print(f"[train] done: {self.step} steps; metrics {self.metrics.path}; checkpoints {self.ckpt.root}")


def _truncate_jsonl(path: str, step: int) -> None:
    """Keep the lines of `path` with "step" <= step (and drop a line cut short by a crash)."""
    if not os.path.exists(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("step", 0) <= step:
                kept.append(json.dumps(rec) + "\n")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)


def _convert_in_place(hf_dir: str, dst: str) -> None:
    """hf_to_mcore inside an existing process group: conversion needs a world of one, so
    it runs in a child process (rank 0 only)."""
    import subprocess
    import sys

    from megatron_tlt.models.mcore import single_process_env

    # Every launcher variable goes, the elastic agent's TORCHELASTIC_* too: with those
    # the child waited on the agent's store forever (a torchrun `train` at TP=2 on CPU
    # never got past this conversion).
    env = single_process_env()
    p = subprocess.run([sys.executable, "-m", "megatron_tlt", "convert", "hf-to-mcore", "--hf", hf_dir,
                        "--out", dst], env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise TLTError(f"converting {hf_dir} to Megatron-Core failed: {p.stderr.strip().splitlines()[-1:]}")


def main(cfg) -> int:
    run = RLRun(cfg)
    run.train()
    return 0
