"""`megatron-tlt sft`: supervised fine-tuning of the Megatron-Core policy on
(prompt, solution) pairs — the warm-up that gives RL a policy that is right often
enough to learn from.

Data: the built-in synthetic tasks (`data.tasks`; validation on their held-out test
split) or a JSONL/Parquet file with prompt and solution fields (`data.path`;
validation on `data.val_path` or the file's last `data.num_val` records). Samples are
tokenized as the rollout engine sees them (`encode_prompt(prompt)`, then the solution
and eos) and packed into rows of `model.seq_length` with a block-diagonal causal mask
(`data/packing.py`); the loss counts solution tokens only.

One optimizer step = `train.global_batch_size` packed rows (not samples: a row holds
as many samples as fit), split over data-parallel ranks and into micro-batches of
`train.micro_batch_size` rows; the loss is the mean over every solution token of the
global batch (not a mean of per-micro-batch means), so gradient accumulation and DP do
not reweight tokens. The data position (samples consumed) is part of every
checkpoint; the sample stream is a seeded permutation per epoch of a fixed pool, so a
resumed run sees exactly the rows an uninterrupted one would (per-step losses are
bit-identical in fp32 on a CPU: tests/integration/test_sft_resume.py).

The model: `model.mcore_ckpt` (loaded), `model.hf_path` (converted once into
`<out_dir>/init_mcore`), or random initialisation from `model.arch`. At the end the
final model is also written in HF format to `<out_dir>/hf` with the tokenizer files
(what `megatron-tlt eval` and the rollout engine load).

Packing needs an attention that honours an arbitrary mask: the Megatron-Core local
layer spec does; the TransformerEngine spec runs causal kernels that ignore the mask,
so `sft.pack=true` with TE is refused up front (use `model.use_te=false`, or
`sft.pack=false` for one sample per row).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import subprocess
import sys
import time
from typing import Optional

import torch

from megatron_tlt.config import Config
from megatron_tlt.convert import is_conversion_of
from megatron_tlt.data.packing import TokenizedSample, fits, pack, pack_all, tokenize_sample
from megatron_tlt.errors import ConfigError, TLTError
from megatron_tlt.models.optim import lr_for_step

log = logging.getLogger(__name__)

TINY_DEFAULT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "tiny_default")
"""The shipped tiny default policy (HF format), trained by examples/sft_tiny.yaml."""


# ---- data ------------------------------------------------------------------------------

class SampleStream:
    """An endless, seeded stream over a fixed pool: epoch e visits the pool in its own
    permutation (seeded by (seed, e)), so sample i of the stream depends only on i."""

    def __init__(self, pool: list[TokenizedSample], seed: int):
        if not pool:
            raise TLTError("no training samples left (all longer than model.seq_length? "
                           "raise it or set data.overlong=truncate)")
        self.pool, self.seed = pool, seed
        self._epoch, self._order = -1, []

    def __call__(self, i: int) -> TokenizedSample:
        epoch, j = divmod(i, len(self.pool))
        if epoch != self._epoch:
            self._order = list(range(len(self.pool)))
            random.Random(f"megatron_tlt/sft/{self.seed}/{epoch}").shuffle(self._order)
            self._epoch = epoch
        return self.pool[self._order[j]]


@dataclasses.dataclass
class SFTData:
    train: SampleStream
    val: list[TokenizedSample]
    pool_size: int
    dropped: int
    mean_tokens: float
    signature: dict


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _tokenizer_source(cfg: Config) -> str:
    """What `load_tokenizer` gets: data.tokenizer, else the model's own, else 'tiny'."""
    if cfg.data.tokenizer is not None:
        return cfg.data.tokenizer
    for d in (cfg.model.mcore_ckpt, cfg.model.hf_path):
        if d and any(os.path.isfile(os.path.join(d, f)) for f in _TOKENIZER_FILES):
            return d
    return "tiny"


def _load_pairs(path: str, cfg: Config) -> list[tuple[str, str]]:
    from megatron_tlt.data.datasets import load_prompt_dataset

    # The solution is read through the answer slot: the same validation, renamed in messages.
    try:
        samples = load_prompt_dataset(path, prompt_field=cfg.data.prompt_field,
                                      answer_field=cfg.data.solution_field)
    except TLTError as e:
        raise TLTError(str(e).replace("answer field", "solution field").replace("(answer)", "(solution)")) from None
    return [(s.prompt, s.answer) for s in samples]


def build_data(cfg: Config, tokenizer) -> SFTData:
    d, seq = cfg.data, cfg.model.seq_length
    if d.path is None:
        from megatron_tlt.data.tasks import make_dataset

        train_pairs = [(s.prompt, s.solution) for s in make_dataset(d.tasks, d.num_train, cfg.train.seed, "train")]
        val_pairs = [(s.prompt, s.solution) for s in make_dataset(d.tasks, d.num_val, cfg.train.seed, "test")]
    else:
        pairs = _load_pairs(d.path, cfg)
        if d.val_path is not None:
            train_pairs, val_pairs = pairs, _load_pairs(d.val_path, cfg)
        else:
            if len(pairs) <= d.num_val:
                raise ConfigError(f"data.path {d.path} has {len(pairs)} records, not more than "
                                  f"data.num_val ({d.num_val}) held out for validation")
            train_pairs, val_pairs = pairs[:-d.num_val], pairs[-d.num_val:]
    train = [tokenize_sample(tokenizer, p, s) for p, s in train_pairs]
    val = [tokenize_sample(tokenizer, p, s) for p, s in val_pairs]
    dropped = 0
    if d.overlong == "drop":
        kept = [x for x in train if fits(x, seq)]
        dropped = len(train) - len(kept)
        train = kept
        val = [x for x in val if fits(x, seq)]
    if not val:
        raise TLTError("no validation samples fit model.seq_length; raise it or set data.overlong=truncate")
    mean = sum(len(x) for x in train) / max(1, len(train))
    signature = {"tasks": list(d.tasks), "path": d.path, "val_path": d.val_path, "num_train": d.num_train,
                 "seq_length": seq, "overlong": d.overlong, "pack": cfg.sft.pack,
                 "tokenizer": tokenizer.name_or_path, "seed": cfg.train.seed}
    return SFTData(SampleStream(train, cfg.train.seed), val, len(train), dropped, mean, signature)


# ---- model -----------------------------------------------------------------------------

def arch_from_config(cfg: Config):
    from megatron_tlt.models.arch import ModelArch

    a = cfg.model.arch
    return ModelArch(family=a.family, vocab_size=a.vocab_size, hidden_size=a.hidden_size,
                     intermediate_size=a.intermediate_size, num_layers=a.num_layers, num_heads=a.num_heads,
                     num_kv_heads=a.num_kv_heads, head_dim=a.head_dim or a.hidden_size // a.num_heads,
                     rms_norm_eps=a.rms_norm_eps, rope_theta=a.rope_theta,
                     max_position_embeddings=a.max_position_embeddings,
                     tie_word_embeddings=a.tie_word_embeddings, qkv_bias=a.family == "qwen2",
                     qk_norm=a.family == "qwen3", torch_dtype=cfg.model.dtype)


def _init_source(cfg: Config, resuming: bool) -> tuple[object, Optional[str], Optional[str]]:
    """(arch, mcore dir to load or None, HF dir to convert first or None)."""
    from megatron_tlt.models import mcore_ckpt
    from megatron_tlt.models.arch import ModelArch

    m = cfg.model
    if m.mcore_ckpt is not None:
        return mcore_ckpt.read_meta(m.mcore_ckpt)["arch"], m.mcore_ckpt, None
    if m.hf_path is not None:
        arch = ModelArch.from_hf_dir(m.hf_path)
        dst = os.path.join(cfg.train.out_dir, "init_mcore")
        return arch, (None if resuming else dst), (None if resuming else m.hf_path)
    return arch_from_config(cfg), None, None


# ---- distributed helpers ---------------------------------------------------------------

def _reduce_sum(values: list[float], contribute: bool) -> list[float]:
    """Sum over all ranks of `values` from the ranks that `contribute` (others add 0)."""
    import torch.distributed as dist

    t = torch.tensor(values if contribute else [0.0] * len(values), dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        if torch.cuda.is_available() and dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t)
    return t.cpu().tolist()


def _is_loss_writer() -> bool:
    """One rank per data-parallel replica reports loss sums: last stage, TP rank 0."""
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0


# ---- the run ---------------------------------------------------------------------------

class _Trainer:
    def __init__(self, cfg: Config, actor, optimizer, data: SFTData, pad_id: int):
        from megatron.core import parallel_state as ps

        self.cfg, self.actor, self.opt, self.data, self.pad_id = cfg, actor, optimizer, data, pad_id
        self.dp = ps.get_data_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()
        self.seq = cfg.model.seq_length
        self.mbs = cfg.train.micro_batch_size
        self.val_rows = pack_all(data.val, self.seq, pad_id, overlong=cfg.data.overlong,
                                 one_per_row=not cfg.sft.pack, rows_multiple_of=self.mbs * self.dp)

    def _my_rows(self, rows):
        per = rows.num_rows // self.dp
        return rows.slice(self.dp_rank * per, (self.dp_rank + 1) * per)

    def _run(self, rows, forward_only: bool) -> tuple[float, float]:
        """(sum of solution-token NLL, solution tokens) of `rows` over all DP ranks."""
        from megatron_tlt.models.actor import token_logprobs

        arch = self.actor.arch
        total_tokens = max(1.0, float(rows.loss_mask.sum()))
        mine = self._my_rows(rows).microbatches(self.mbs, with_mask=self.cfg.sft.pack)
        # Megatron divides each micro-batch loss by their number and the optimizer averages
        # gradients over DP; this scale undoes both, leaving the global per-token mean.
        scale = len(mine) * self.dp / total_tokens

        def loss_fn(logits, mb):
            nll = -(token_logprobs(logits, mb.labels, arch) * mb.loss_mask).sum()
            return nll * scale, {"nll": nll.detach(), "tokens": mb.loss_mask.sum().detach()}

        out = self.actor.forward_backward(mine, loss_fn, forward_only=forward_only)
        nll = sum(float(o["nll"]) for o in out)
        tokens = sum(float(o["tokens"]) for o in out)
        return tuple(_reduce_sum([nll, tokens], _is_loss_writer()))

    def train_step(self, step: int, consumed: int) -> tuple[dict, int]:
        c = self.cfg
        t0 = time.perf_counter()
        lr = lr_for_step(c, step)
        self.opt.set_lr(lr)
        rows, nxt = pack(self.data.train, consumed, c.train.global_batch_size, self.seq, self.pad_id,
                         overlong=c.data.overlong, one_per_row=not c.sft.pack)
        self.opt.zero_grad()
        nll, tokens = self._run(rows, forward_only=False)
        res = self.opt.step()
        dt = time.perf_counter() - t0
        m = {"loss": nll / max(tokens, 1.0), "lr": lr, "grad_norm": res["grad_norm"],
             "skipped": bool(res["skipped"]), "samples": rows.num_samples, "tokens": rows.num_tokens,
             "loss_tokens": int(tokens), "tokens_per_s": rows.num_tokens / dt, "step_time_s": dt}
        if torch.cuda.is_available():
            # the allocator's peak and its cumulative retries (a retry frees cached blocks and
            # synchronises: many of them mean fragmentation is costing step time)
            m["max_mem_gb"] = torch.cuda.max_memory_allocated() / 2 ** 30
            m["alloc_retries"] = int(torch.cuda.memory_stats().get("num_alloc_retries", 0))
        return m, nxt

    def val_loss(self) -> float:
        nll, tokens = self._run(self.val_rows, forward_only=True)
        return nll / max(tokens, 1.0)


def _export_hf(model_dir: str, out_dir: str, tokenizer) -> None:
    """Final HF model (+ tokenizer files, generation_config.json) into out_dir; rank 0.
    In-process for a world of one; otherwise a fresh single-process converter (the
    converter initialises its own one-rank Megatron state)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        from megatron_tlt.models.mcore import single_process_env

        # Not a member of this job's world: a world of one (single_process_env).
        env = single_process_env()
        subprocess.run([sys.executable, "-m", "megatron_tlt", "convert", "mcore-to-hf", "--mcore", model_dir,
                        "--out", out_dir], check=True, env=env)
    else:
        from megatron_tlt.convert import mcore_to_hf

        mcore_to_hf(model_dir, out_dir, progress=False)
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    with open(os.path.join(out_dir, "config.json")) as f:
        hf_cfg = json.load(f)
    hf_cfg.update(ids)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(dict(ids, do_sample=False), f, indent=2)


def main(cfg: Config) -> int:
    import torch.distributed as dist
    from tqdm import tqdm

    from megatron_tlt.checkpoint import Checkpointer
    from megatron_tlt.data.tokenizer import load_tokenizer, tokenizer_dir
    from megatron_tlt.metrics import MetricsWriter
    from megatron_tlt.models import mcore
    from megatron_tlt.models.actor import Actor
    from megatron_tlt.models.optim import OptimSettings, build_optimizer

    c = cfg
    # ---- every check that can fail on input, before any work -----------------------------
    world = int(os.environ.get("WORLD_SIZE", "1"))
    p = c.parallel
    if world != p.tp * p.pp * p.dp:
        raise ConfigError(f"parallel.tp ({p.tp}) x parallel.pp ({p.pp}) x parallel.dp ({p.dp}) must equal "
                          f"the world size ({world})")
    ckpt = Checkpointer(c.train.out_dir, keep_last=c.train.keep_last)
    resume_path = ckpt.resolve(c.train.resume)
    tok_source = _tokenizer_source(c)
    tokenizer = load_tokenizer(tok_source)
    arch, load_dir, convert_from = _init_source(c, resuming=resume_path is not None)
    if tokenizer.vocab_size > arch.vocab_size:
        raise ConfigError(f"tokenizer {tokenizer.name_or_path!r} has {tokenizer.vocab_size} tokens, more than the "
                          f"model's vocab_size ({arch.vocab_size})")
    if c.model.seq_length > arch.max_position_embeddings:
        raise ConfigError(f"model.seq_length ({c.model.seq_length}) exceeds the model's max_position_embeddings "
                          f"({arch.max_position_embeddings})")
    arch.check_parallel(p.tp, p.pp)
    use_te = c.model.use_te
    if use_te is None:
        use_te = torch.cuda.is_available() and mcore.have_te()
    if use_te and c.sft.pack:
        raise ConfigError("sft.pack=true needs an attention that honours the block-diagonal mask; the "
                          "TransformerEngine layer spec ignores it: set model.use_te=false (or sft.pack=false)")

    data = build_data(c, tokenizer)  # no process group needed; its errors before the conversion

    created_dist = not dist.is_initialized()
    if convert_from is not None and not is_conversion_of(load_dir, convert_from):
        from megatron_tlt.convert import hf_to_mcore

        hf_to_mcore(convert_from, load_dir, p.tp, p.pp, progress=int(os.environ.get("RANK", "0")) == 0)
    mcore.init_parallel(p.tp, p.pp, seed=c.train.seed)
    rank0 = dist.get_rank() == 0
    try:
        actor = Actor(arch, tp=p.tp, pp=p.pp, dtype=c.model.dtype, use_te=use_te, init_seed=c.train.seed)
        if load_dir is not None and resume_path is None:
            actor.load(load_dir)
        optimizer = build_optimizer(actor, OptimSettings(
            lr=c.optim.lr, weight_decay=c.optim.weight_decay, adam_beta1=c.optim.adam_beta1,
            adam_beta2=c.optim.adam_beta2, adam_eps=c.optim.eps, clip_grad=c.optim.clip_grad))
        step, consumed, tokens_seen = 0, 0, 0
        if resume_path is not None:
            state = ckpt.load(resume_path, actor, optimizer)
            step, consumed, tokens_seen = state["step"], state["consumed_samples"], state.get("tokens_seen", 0)
            if state.get("data") != data.signature:
                log.warning("resuming with different data settings than the checkpoint was written with "
                            "(%s vs %s): the sample stream differs", data.signature, state.get("data"))
        if rank0:
            log.info("model: %s, %.2fM parameters, %s, init: %s", arch.family, arch.num_params() / 1e6,
                     c.model.dtype, resume_path or load_dir or convert_from or f"random (seed {c.train.seed})")
        trainer = _Trainer(c, actor, optimizer, data, tokenizer.pad_id)
        if rank0:
            log.info("data: %d training samples (%d longer than %d tokens dropped), %.1f tokens each on "
                     "average; %d validation samples in %d rows", data.pool_size, data.dropped,
                     c.model.seq_length + 1, data.mean_tokens, len(data.val), trainer.val_rows.num_rows)
        metrics = MetricsWriter(c.train.out_dir, tensorboard=c.logging.tensorboard,
                                resume_step=step if resume_path is not None else None)
        total = c.train.steps
        bar = tqdm(total=total, initial=step, desc="sft", unit="step", dynamic_ncols=True,
                   disable=not (rank0 and c.sft.progress), mininterval=1.0 if sys.stderr.isatty() else 30.0)

        def save(at: int) -> str:
            return ckpt.save(at, actor, optimizer, {"consumed_samples": consumed, "tokens_seen": tokens_seen,
                                                    "data": data.signature}, tokenizer_from=tokenizer_dir(tok_source))

        try:
            if step == 0 and c.sft.eval_interval:
                metrics.log(0, {"val_loss": trainer.val_loss()})
            last_saved = step if resume_path is not None else None
            while step < total:
                m, consumed = trainer.train_step(step, consumed)
                step += 1
                tokens_seen += m["tokens"]
                m["consumed_samples"], m["tokens_seen"] = consumed, tokens_seen
                if step == total or (c.sft.eval_interval and step % c.sft.eval_interval == 0):
                    m["val_loss"] = trainer.val_loss()
                if step % c.logging.log_interval == 0 or step == total or "val_loss" in m:
                    metrics.log(step, m)
                bar.update(1)
                bar.set_postfix(loss=f"{m['loss']:.4f}", lr=f"{m['lr']:.2e}",
                                tok_s=f"{m['tokens_per_s']:.0f}", refresh=False)
                stop = bool(c.sft.exit_at_step) and step >= c.sft.exit_at_step
                if step == total or stop or (c.train.save_interval and step % c.train.save_interval == 0):
                    save(step)
                    last_saved = step
                if stop and step < total:
                    if rank0:
                        log.info("sft.exit_at_step=%d reached; resume with train.resume=auto", step)
                    return 0
            if last_saved != step:
                save(step)
        finally:
            bar.close()
            metrics.close()
        if c.sft.export_hf:
            hf_dir = os.path.join(os.path.abspath(c.train.out_dir), "hf")
            if rank0:
                _export_hf(os.path.join(ckpt.step_dir(step), "model"), hf_dir, tokenizer)
                log.info("final model (HF format) written to %s", hf_dir)
            if dist.is_initialized():
                dist.barrier()
        return 0
    finally:
        if created_dist:
            mcore.destroy_parallel()
