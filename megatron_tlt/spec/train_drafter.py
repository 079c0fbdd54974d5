"""Offline EAGLE drafter training on the target's own responses.

    python -m megatron_tlt.spec.train_drafter --target DIR (--data prompts.jsonl | --tasks arith,sort) --out DIR

1. Data: the target generates responses with the rollout engine, returning its hidden
   states after the final norm (Request.return_hidden_states="final" — the feature EAGLE
   consumes; see eagle.py) for every position: `collect_samples`.
2. Samples -> pairs (x[t+1], h[t]) at position t + 1, target feature h[t+1] and target
   logits lm_head(h[t+1]) (recomputed from the feature, so not stored: exactly the
   target's logits for a float32 target, up to the engine's rounding for one that
   generated in bfloat16, the rollout's dtype and `--dtype`'s default on a GPU); packed
   into fixed-budget packs with segment ids, so attention never crosses samples
   (`pack_samples`).
3. Loss = smooth-L1(f, h[t+1]) + ce_weight x cross-entropy(drafter logits, softmax of the
   target's logits over the draft vocabulary) — soft labels, the target's distribution,
   not its sampled token (`drafter_loss`). AdamW over drafter-owned parameters only.
4. Save: drafter directory in the HF-EAGLE-like layout (export.py); `DrafterTrainer.
   save_checkpoint` adds the optimizer for resuming (and for `export-drafter --ckpt`).

The functions are the API the online trainer (adaptive/) reuses: it feeds
`TrainSample`s streamed from rollouts into `pack_samples` and `DrafterTrainer.step`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import time
import types

import torch
import torch.nn.functional as F

from megatron_tlt.errors import TLTError
from megatron_tlt.spec.eagle import DrafterConfig, EagleDrafter, count_frequent_tokens


@dataclasses.dataclass
class TrainSample:
    tokens: torch.Tensor  # [L] int64, prompt + response
    features: torch.Tensor  # [L - 1, feature_dim]: target feature at positions 0..L-2
    loss_start: int = 0
    """First pair index t that counts in the loss (pair t predicts token t + 2)."""
    final: torch.Tensor | None = None
    """[L - 1, hidden] final-norm hidden states when `features` are fused layers (EAGLE-3);
    None: `features` are the final hidden states themselves."""

    @property
    def num_pairs(self) -> int:
        return max(0, self.tokens.numel() - 2)

    @classmethod
    def from_result(cls, prompt_ids: list[int], result, *, response_only: bool = False) -> "TrainSample":
        tokens = torch.tensor(list(prompt_ids) + list(result.token_ids), dtype=torch.int64)
        if result.hidden_states is None or result.hidden_states.shape[0] != tokens.numel() - 1:
            raise ValueError("result has no hidden states for every position (return_hidden_states)")
        start = max(0, len(prompt_ids) - 2) if response_only else 0
        return cls(tokens=tokens, features=result.hidden_states, loss_start=start)


@dataclasses.dataclass
class Pack:
    """Packed pairs of several samples (or chunks of one), T pairs in all."""
    tokens: torch.Tensor  # [T] int64: x[t+1]
    features: torch.Tensor  # [T, feature_dim]: h[t]
    positions: torch.Tensor  # [T] int64: t + 1
    segment_ids: torch.Tensor  # [T] int64
    target_features: torch.Tensor  # [T, hidden]: h[t+1] (final feature)
    loss_mask: torch.Tensor  # [T] bool

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()


def sample_pairs(s: TrainSample) -> dict[str, torch.Tensor]:
    n = s.num_pairs
    t = torch.arange(n)
    final = s.features if s.final is None else s.final
    return {"tokens": s.tokens[1:n + 1], "features": s.features[:n], "positions": t + 1,
            "target_features": final[1:n + 1], "loss_mask": t >= s.loss_start}


def pack_samples(samples: list[TrainSample], max_tokens: int) -> list[Pack]:
    """Greedy first-fit in order; a sample longer than max_tokens is split into chunks
    (positions continue; attention stays within each chunk)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    chunks = []
    for s in samples:
        p = sample_pairs(s)
        n = p["tokens"].numel()
        for lo in range(0, n, max_tokens):
            chunks.append({k: v[lo:lo + max_tokens] for k, v in p.items()})
    packs, cur, size = [], [], 0
    for c in chunks:
        n = c["tokens"].numel()
        if cur and size + n > max_tokens:
            packs.append(_make_pack(cur))
            cur, size = [], 0
        cur.append(c)
        size += n
    if cur:
        packs.append(_make_pack(cur))
    return packs


def _make_pack(chunks) -> Pack:
    seg = torch.cat([torch.full((c["tokens"].numel(),), i, dtype=torch.int64) for i, c in enumerate(chunks)])
    return Pack(**{k: torch.cat([c[k] for c in chunks]) for k in chunks[0]}, segment_ids=seg)


def drafter_loss(drafter: EagleDrafter, pack: Pack, *, ce_weight: float = 0.1,
                 feature_noise: float = 0.0, generator: torch.Generator | None = None,
                 unroll: int = 1):
    """(loss, metrics dict). feature_noise: uniform noise on input features (EAGLE-1's
    augmentation against its own feature errors at drafting time). unroll: also train the
    chain's deeper levels on the drafter's own features (EagleDrafter.forward_unrolled;
    1 = the target's features only): the loss is the mean over steps of each step's loss
    on the pairs that have a target; "loss", "feature_loss", "ce" and "top1" are step 1's
    (comparable across settings), "loss_all" the trained mean, "loss_<s>" / "top1_<s>"
    step s's. top1: the share of pairs whose drafted token is the target's argmax over its
    whole vocabulary (what greedy verification accepts)."""
    p = next(drafter.parameters())
    feats = pack.features.to(p.device, p.dtype)
    if feature_noise > 0:
        feats = feats + (torch.rand(feats.shape, generator=generator) * 2 - 1).to(feats) * feature_noise
    steps = drafter.forward_unrolled(pack.tokens.to(p.device), feats, pack.positions.to(p.device),
                                     pack.segment_ids.to(p.device), unroll)
    mask0 = pack.loss_mask.to(p.device)
    tgt0 = pack.target_features.to(p.device, p.dtype)
    d2t = drafter.draft_to_target
    with torch.no_grad():
        logits0 = F.linear(tgt0, drafter.head_weight().to(tgt0.dtype)).float()
        # top1 is greedy verification's test: the drafted token (in target ids) against
        # the target's argmax over its whole vocabulary, which a reduced draft vocabulary
        # may not hold (its argmax over the draft rows would count those as hits)
        if d2t is None:
            best0 = logits0.argmax(-1)
        else:
            d2t = d2t.to(p.device)
            head = drafter.target_lm_head.detach().to(tgt0.dtype)
            best0 = torch.cat([F.linear(c, head).argmax(-1) for c in tgt0.split(1024)])
    t = tgt0.shape[0]
    idx = torch.arange(t, device=p.device)
    metrics, losses = {}, []
    for s, (f, logits, valid) in enumerate(steps):
        ahead = torch.clamp(idx + s, max=t - 1)  # step s + 1 of row i predicts pair i + s's target
        mask = mask0[ahead] & valid
        tgt, target_logits = tgt0[ahead], logits0[ahead]
        soft = torch.softmax(target_logits, dim=-1)
        n = mask.sum().clamp(min=1)
        feat_loss = (F.smooth_l1_loss(f.float(), tgt.float(), reduction="none").mean(-1) * mask).sum() / n
        ce = (-(soft * torch.log_softmax(logits, dim=-1)).sum(-1) * mask).sum() / n
        losses.append(feat_loss + ce_weight * ce)
        with torch.no_grad():
            drafted = logits.argmax(-1) if d2t is None else d2t[logits.argmax(-1)]
            acc = ((drafted == best0[ahead]) & mask).sum() / n
        if s == 0:
            metrics.update(loss=float(losses[0].detach()), feature_loss=float(feat_loss.detach()),
                           ce=float(ce.detach()), top1=float(acc), tokens=int(mask.sum()))
        else:
            metrics[f"top1_{s + 1}"] = float(acc)
            metrics[f"loss_{s + 1}"] = float(losses[-1].detach())
    loss = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
    metrics["loss_all"] = float(loss.detach())
    return loss, metrics


LR_SCHEDULES = ("constant", "cosine")


def lr_at(step: int, lr: float, schedule: str = "constant", total_steps: int | None = None,
          warmup_steps: int = 0, min_ratio: float = 0.1) -> float:
    """The learning rate of optimizer step `step` (0-based): a linear warm-up over
    `warmup_steps`, then `lr` (constant) or a cosine from `lr` down to `min_ratio * lr` at
    `total_steps` (and there after). A function of the step alone, so a resumed run
    follows the uninterrupted run's rates."""
    if schedule not in LR_SCHEDULES:
        raise TLTError(f"lr schedule must be one of {', '.join(LR_SCHEDULES)}, got {schedule!r}")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    if not total_steps:
        raise TLTError("the cosine lr schedule needs the run's total steps")
    span = max(1, total_steps - warmup_steps)
    t = min(1.0, (step - warmup_steps) / span)
    return lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * t)))


class DrafterTrainer:
    """AdamW over the drafter's own parameters (never the target's); the learning rate per
    step from `lr_at` (constant unless `lr_schedule` says otherwise: the online trainer
    runs without an end, the offline one may decay)."""

    def __init__(self, drafter: EagleDrafter, *, lr: float = 1e-3, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.95), clip_grad: float = 1.0,
                 ce_weight: float = 0.1, feature_noise: float = 0.0, seed: int = 0,
                 unroll: int = 1, lr_schedule: str = "constant", total_steps: int | None = None,
                 warmup_steps: int = 0):
        if unroll < 1:
            raise TLTError(f"unroll must be >= 1, got {unroll}")
        if warmup_steps < 0:
            raise TLTError(f"warmup steps must be >= 0, got {warmup_steps}")
        lr_at(0, lr, lr_schedule, total_steps, warmup_steps)  # the settings' errors, now
        self.drafter = drafter
        self.unroll = unroll
        self.lr = lr
        self.lr_schedule = lr_schedule
        self.total_steps = total_steps
        self.warmup_steps = warmup_steps
        self.opt = torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=weight_decay, betas=betas)
        self.clip_grad = clip_grad
        self.ce_weight = ce_weight
        self.feature_noise = feature_noise
        self.generator = torch.Generator().manual_seed(seed)
        self.step_count = 0

    def step(self, pack: Pack) -> dict:
        self.drafter.train()
        rate = lr_at(self.step_count, self.lr, self.lr_schedule, self.total_steps, self.warmup_steps)
        for group in self.opt.param_groups:
            group["lr"] = rate
        self.opt.zero_grad(set_to_none=True)
        loss, metrics = drafter_loss(self.drafter, pack, ce_weight=self.ce_weight,
                                     feature_noise=self.feature_noise, generator=self.generator,
                                     unroll=self.unroll)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"drafter loss is {float(loss)} at step {self.step_count}")
        loss.backward()
        if self.clip_grad > 0:
            metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.clip_grad))
        self.opt.step()
        self.step_count += 1
        metrics["lr"] = rate
        return metrics

    @torch.no_grad()
    def evaluate(self, packs: list[Pack]) -> dict:
        self.drafter.eval()
        tot: dict[str, float] = {}
        n = 0
        for pk in packs:
            _, m = drafter_loss(self.drafter, pk, ce_weight=self.ce_weight, unroll=self.unroll)
            w = m["tokens"]
            deeper = [f"{m}_{s}" for s in range(2, self.unroll + 1) for m in ("loss", "top1")]
            for k in ["loss", "feature_loss", "ce", "top1"] + deeper:
                tot[k] = tot.get(k, 0.0) + m[k] * w
            n += w
        return {k: v / max(n, 1) for k, v in tot.items()}

    def save_checkpoint(self, path: str) -> None:
        from megatron_tlt.spec.export import save_drafter
        save_drafter(self.drafter, path)
        tmp = os.path.join(path, ".optimizer.pt.tmp")
        torch.save(self.opt.state_dict(), tmp)
        os.replace(tmp, os.path.join(path, "optimizer.pt"))
        with open(os.path.join(path, "trainer_state.json"), "w") as f:
            json.dump({"step": self.step_count}, f)

    def load_optimizer(self, path: str) -> None:
        self.opt.load_state_dict(torch.load(os.path.join(path, "optimizer.pt"), weights_only=True))
        with open(os.path.join(path, "trainer_state.json")) as f:
            self.step_count = int(json.load(f)["step"])


def train(trainer: DrafterTrainer, packs: list[Pack], steps: int, *, seed: int = 0,
          progress: bool = True, on_step=None) -> list[dict]:
    """`steps` more optimizer steps, one pack each, cycling through a seeded shuffle. The
    shuffle continues after the trainer's `step_count` steps already taken (a resumed
    trainer sees the packs an uninterrupted run would have). on_step(trainer): called
    after every step (periodic checkpoints)."""
    from tqdm import tqdm
    if not packs:
        raise TLTError("no training data: every sample is shorter than 3 tokens")
    g = torch.Generator().manual_seed(seed)
    order: list[int] = []
    for _ in range(trainer.step_count):  # replay the draws of the steps already taken
        if not order:
            order = torch.randperm(len(packs), generator=g).tolist()
        order.pop()
    history = []
    done = trainer.step_count
    bar = tqdm(range(done, done + steps), desc="train-drafter", unit="step", initial=done,
               total=done + steps, disable=not progress, dynamic_ncols=True)
    for _ in bar:
        if not order:
            order = torch.randperm(len(packs), generator=g).tolist()
        m = trainer.step(packs[order.pop()])
        history.append(m)
        bar.set_postfix(loss=f"{m['loss']:.4f}", top1=f"{m['top1']:.3f}", refresh=False)
        if on_step is not None:
            on_step(trainer)
    return history


class ResumeState:
    """OUT/.train_state: what a crashed or cut `train_drafter` run resumes from, so that
    nothing done is done again: args.json (the run's settings: a run with other settings
    refuses it), samples.pt (the target's responses and features, the generation half of
    the work), before.json (the untrained drafter's evaluation), ckpt/ (the latest periodic
    checkpoint: drafter, optimizer, step, feature-noise generator; replaced by writing
    ckpt.tmp, renaming ckpt to ckpt.old, then ckpt.tmp to ckpt, so one complete checkpoint
    exists at every moment). Removed when the run finishes. A resumed run equals an
    uninterrupted one (the data order continues where it stopped, `train`)."""

    DIR = ".train_state"

    def __init__(self, out: str, settings: dict):
        self.dir = os.path.join(out, self.DIR)
        self.settings = settings

    def _path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def _write_json(self, name: str, obj) -> None:
        tmp = self._path(f".{name}.tmp")
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1)
        os.replace(tmp, self._path(name))

    def open(self, resume: bool = True) -> bool:
        """Start this run's state; True when an unfinished run with the same settings left
        some to resume from (resume=False discards it)."""
        if os.path.exists(self._path("args.json")):
            if not resume:
                shutil.rmtree(self.dir)
            else:
                with open(self._path("args.json")) as f:
                    saved = json.load(f)
                if saved != self.settings:
                    diff = ", ".join(f"{k}: {saved.get(k)!r} there, {self.settings.get(k)!r} now"
                                     for k in sorted(set(saved) | set(self.settings))
                                     if saved.get(k) != self.settings.get(k))
                    raise TLTError(f"{os.path.dirname(self.dir)} holds an unfinished drafter "
                                   f"training with other settings ({diff}); pass --no-resume "
                                   "to discard it, or choose another --out")
                return True
        os.makedirs(self.dir, exist_ok=True)
        self._write_json("args.json", self.settings)
        return False

    def save_samples(self, samples: list[TrainSample]) -> None:
        tmp = self._path(".samples.pt.tmp")
        # (not dataclasses.asdict: it deep-copies every tensor)
        torch.save([{f.name: getattr(s, f.name) for f in dataclasses.fields(s)} for s in samples], tmp)
        os.replace(tmp, self._path("samples.pt"))

    def load_samples(self) -> list[TrainSample] | None:
        if not os.path.exists(self._path("samples.pt")):
            return None
        return [TrainSample(**d) for d in torch.load(self._path("samples.pt"), weights_only=True)]

    def save_before(self, metrics: dict) -> None:
        self._write_json("before.json", metrics)

    def load_before(self) -> dict | None:
        if not os.path.exists(self._path("before.json")):
            return None
        with open(self._path("before.json")) as f:
            return json.load(f)

    def save(self, trainer: DrafterTrainer) -> None:
        """The trainer's progress as the latest checkpoint."""
        tmp, cur, old = self._path("ckpt.tmp"), self._path("ckpt"), self._path("ckpt.old")
        shutil.rmtree(tmp, ignore_errors=True)
        trainer.save_checkpoint(tmp)
        with open(os.path.join(tmp, "schedule.json"), "w") as f:  # --steps / --epochs resolved
            json.dump({"lr_schedule": trainer.lr_schedule, "total_steps": trainer.total_steps}, f)
        torch.save(trainer.generator.get_state(), os.path.join(tmp, "generator.pt"))
        if os.path.exists(cur):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(cur, old)
        os.replace(tmp, cur)
        shutil.rmtree(old, ignore_errors=True)

    def load(self, trainer: DrafterTrainer) -> bool:
        """The latest complete checkpoint into `trainer` (False: none yet)."""
        from megatron_tlt.spec.export import WEIGHTS_FILE
        from safetensors.torch import load_file
        for name in ("ckpt", "ckpt.old"):
            path = self._path(name)
            if not os.path.exists(os.path.join(path, "generator.pt")):
                continue
            sched = os.path.join(path, "schedule.json")
            if trainer.lr_schedule != "constant" and os.path.exists(sched):
                with open(sched) as f:
                    total = json.load(f)["total_steps"]
                if total != trainer.total_steps:  # the steps before the cut followed another curve
                    raise TLTError(f"{self.dir}: the run being resumed decays its learning rate "
                                   f"({trainer.lr_schedule}) over {total} steps; --steps / --epochs "
                                   f"now give {trainer.total_steps}: give the same, or --no-resume")
            tensors = load_file(os.path.join(path, WEIGHTS_FILE))
            for k in ("d2t", "t2d"):
                tensors.pop(k, None)  # the vocabulary map: rebuilt from the same samples
            trainer.drafter.load_state_dict(tensors)
            trainer.load_optimizer(path)
            trainer.generator.set_state(torch.load(os.path.join(path, "generator.pt"), weights_only=True))
            return True
        return False

    def finish(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


# ---- data from the target ----------------------------------------------------------------


def collect_samples(engine, prompts: list[tuple[object, list[int]]], *, n: int = 1,
                    max_new_tokens: int = 128, temperature: float = 0.0, seed: int = 0,
                    response_only: bool = False, progress: bool = True) -> list[TrainSample]:
    """The target's own responses with its final hidden states. prompts: (id, token ids)."""
    from tqdm import tqdm
    from megatron_tlt.rollout.request import expand_requests
    from megatron_tlt.rollout.sampling import SamplingParams
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
    reqs, prompt_of = [], []
    for pid, ids in prompts:
        for r in expand_requests(pid, ids, params, n, return_hidden_states="final"):
            reqs.append(r)
            prompt_of.append(ids)
    bar = tqdm(total=len(reqs), desc="generate", unit="req", disable=not progress, dynamic_ncols=True)

    def on_progress(p):
        bar.n = p.num_done
        bar.refresh()
    try:
        results = engine.generate(reqs, progress=on_progress)
    finally:
        bar.close()
    out = []
    for ids, r in zip(prompt_of, results):
        if r.error is not None:
            raise TLTError(f"target generation failed: {r.error}")
        out.append(TrainSample.from_result(ids, r, response_only=response_only))
    return out


def target_samples(target_dir: str, arch, weights, prompts: list[tuple[object, list[int]]], *,
                   n: int = 1, max_new_tokens: int = 128, temperature: float = 0.0, seed: int = 0,
                   response_only: bool = False, max_num_seqs: int = 64,
                   progress: bool = True) -> list[TrainSample]:
    """collect_samples on a rollout engine built for these prompts (the job's fast path on
    the weights' device, the checkpoint's stop ids); the engine is freed afterwards."""
    from megatron_tlt.rollout.cli import _eos_ids
    from megatron_tlt.rollout.engine import RolloutEngine, fast_path_options
    device = weights.device
    longest = max(len(ids) for _, ids in prompts) + max_new_tokens
    max_len = min(arch.max_position_embeddings, longest)
    bs = 16
    engine = RolloutEngine(arch, weights, max_num_seqs=max_num_seqs, block_size=bs,
                           num_blocks=max(1, max_num_seqs * -(-longest // bs)),
                           dtype=weights.dtype, device=device, max_model_len=max_len,
                           eos_token_ids=_eos_ids(target_dir, None), seed=seed,
                           **fast_path_options(device))
    try:
        return collect_samples(engine, prompts, n=n, max_new_tokens=max_new_tokens,
                               temperature=temperature, seed=seed, response_only=response_only,
                               progress=progress)
    finally:
        del engine  # its KV pool and graphs: the drafter's training needs only the head


def float32_head(weights):
    """The target's embedding and LM head in float32 (the same tensors when they already
    are; one copy when tied), for a drafter trained in float32 over a lower-precision
    target: an object with build_drafter's `embed`, `lm_head`, `device` and `dtype`."""
    if weights.dtype == torch.float32:
        return weights
    embed = weights.embed.float()
    lm_head = embed if weights.lm_head is weights.embed else weights.lm_head.float()
    return types.SimpleNamespace(embed=embed, lm_head=lm_head, device=weights.device, dtype=torch.float32)


def build_drafter(target_arch, target_weights, samples: list[TrainSample] | None = None, *,
                  draft_vocab_size: int | None = None, seed: int = 0) -> EagleDrafter:
    """A fresh drafter over the target's embedding/LM head; a reduced vocabulary is the
    draft_vocab_size most frequent tokens of the samples."""
    ids = None
    if draft_vocab_size is not None and draft_vocab_size < target_arch.vocab_size:
        if not samples:
            raise TLTError("a reduced draft vocabulary needs training samples to count tokens")
        ids = count_frequent_tokens([s.tokens for s in samples], target_arch.vocab_size, draft_vocab_size)
    else:
        draft_vocab_size = None
    cfg = DrafterConfig(arch=target_arch, draft_vocab_size=draft_vocab_size)
    d = EagleDrafter(cfg, target_weights.embed, target_weights.lm_head, ids)
    d.reset_parameters(seed)
    return d.to(device=target_weights.device, dtype=target_weights.dtype)


def prompt_token_ids(*, path: str | None, tasks: str | None, n: int, seed: int, tokenizer,
                     model_dir: str, flag: str = "--data") -> list[tuple[object, list[int]]]:
    """(prompt id, token ids) from a prompts JSONL at `path` (text or prompt_token_ids;
    every line) or, without one, `n` prompts of the built-in synthetic `tasks`
    (comma separated). `flag` names the path option in errors."""
    from megatron_tlt.rollout.cli import read_prompts
    out = []
    if path:
        for _, rec in read_prompts(path):
            ids = rec.get("prompt_token_ids")
            if ids is None:
                if tokenizer is None:
                    raise TLTError(f"{flag} {path} has text prompts but {model_dir} has no tokenizer")
                ids = tokenizer.encode_prompt(rec["prompt"])
            out.append((rec["prompt_id"], list(ids)))
    else:
        from megatron_tlt.data.tasks import make_dataset
        if tokenizer is None:
            raise TLTError(f"--tasks needs a tokenizer in {model_dir}")
        names = [t.strip() for t in tasks.split(",") if t.strip()]
        for s in make_dataset(names, n, seed):
            out.append((s.prompt_id, tokenizer.encode_prompt(s.prompt)))
    return out


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="python -m megatron_tlt.spec.train_drafter",
                                          description="Train an EAGLE drafter on the target's own responses.")
    p.add_argument("--target", required=True, help="HF target model directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="prompts JSONL (prompt text or prompt_token_ids, optional prompt_id)")
    src.add_argument("--tasks", help="built-in synthetic tasks, comma separated (e.g. arith,sort)")
    p.add_argument("--num-prompts", type=int, default=256, help="prompts drawn with --tasks")
    p.add_argument("--out", required=True, help="output drafter directory (HF-EAGLE-like layout)")
    p.add_argument("--n", type=int, default=1, help="responses per prompt")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="of the target's responses")
    p.add_argument("--draft-vocab", type=int, default=None, help="reduced draft vocabulary size")
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps (one pack each); default: --epochs passes over the packs")
    p.add_argument("--epochs", type=float, default=None,
                   help="passes over the packed responses when --steps is not given (default "
                        f"{DEFAULT_EPOCHS:g}: the H200 drafter of session 23 took 960 steps over 51 "
                        "packs, top-1 0.855, 2.8x at batch 1; 240 steps reached 0.71)")
    p.add_argument("--batch-tokens", type=int, default=2048, help="pairs per pack")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="constant",
                   help="constant, or cosine from --lr down to a tenth of it at the last step")
    p.add_argument("--warmup-steps", type=int, default=0, help="linear learning-rate warm-up")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--ce-weight", type=float, default=0.1)
    p.add_argument("--feature-noise", type=float, default=0.0)
    p.add_argument("--unroll", type=int, default=1,
                   help="train the chain's first N levels, levels >= 2 on the drafter's own "
                        "features (a training-time test, as EAGLE-3 trains); 1: the target's only")
    p.add_argument("--response-only", action="store_true", help="loss on response positions only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto",
                   help="the target's dtype while it generates the training data: auto (the "
                        "rollout engine's: the checkpoint's dtype or bfloat16 on a GPU, float32 on "
                        "a CPU), float32, bfloat16 or float16; the drafter trains in float32 either way")
    p.add_argument("--save-every", type=int, default=50,
                   help="steps between resumable checkpoints in OUT/.train_state (0: none; the "
                        "target's responses are kept there as soon as they are generated)")
    p.add_argument("--no-resume", action="store_true",
                   help="discard an unfinished run's state in --out instead of resuming it")
    p.add_argument("--no-progress", action="store_true")
    return p


DEFAULT_EPOCHS = 20.0


def total_steps(num_packs: int, epochs: float | None) -> int:
    """Optimizer steps for `epochs` passes (DEFAULT_EPOCHS when None) over `num_packs` packs:
    at least one step, rounded up."""
    return max(1, math.ceil((DEFAULT_EPOCHS if epochs is None else epochs) * num_packs))


# Options that do not change what a run computes (a resumed run may change them; steps /
# epochs only with the constant schedule: ResumeState.load refuses another decay length).
_RUN_ONLY = ("out", "no_progress", "no_resume", "save_every", "steps", "epochs")


def run_settings(args: argparse.Namespace) -> dict:
    """The options a resumed run must share with the run it resumes (paths absolute)."""
    out = {k: v for k, v in sorted(vars(args).items()) if k not in _RUN_ONLY}
    for k in ("target", "data"):
        if out.get(k):
            out[k] = os.path.abspath(out[k])
    return out


def main(args: argparse.Namespace | list[str] | None = None) -> int:
    if not isinstance(args, argparse.Namespace):
        args = build_parser().parse_args(args)
    from megatron_tlt.data.tokenizer import load_tokenizer
    from megatron_tlt.models.arch import ModelArch
    from megatron_tlt.rollout.weights import engine_dtype, load_hf

    # every check that can fail on the flags, before the target generates (minutes, and a
    # run's settings are fixed from then on: a fix would refuse to resume its samples)
    for name in ("n", "max_new_tokens", "steps", "batch_tokens", "num_prompts", "unroll",
                 "max_num_seqs", "draft_vocab"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise TLTError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.steps is not None and args.epochs is not None:
        raise TLTError("give --steps or --epochs, not both")
    if args.epochs is not None and not (args.epochs > 0 and math.isfinite(args.epochs)):
        raise TLTError(f"--epochs must be > 0, got {args.epochs}")
    if args.save_every < 0:
        raise TLTError(f"--save-every must be >= 0, got {args.save_every}")
    if args.warmup_steps < 0:
        raise TLTError(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    lr_at(0, args.lr, args.lr_schedule, args.steps or 1, args.warmup_steps)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    # The target generates in the rollout's dtype, so the drafter learns from the features
    # it will be served at rollout (and the generation runs at bf16 speed on a GPU).
    dtype = engine_dtype(ModelArch.from_hf_dir(args.target), device, args.dtype)
    arch, weights = load_hf(args.target, dtype=dtype, device=device)
    try:
        tokenizer = load_tokenizer(args.target)
    except TLTError:
        tokenizer = None
    prompts = prompt_token_ids(path=args.data, tasks=args.tasks, n=args.num_prompts, seed=args.seed,
                               tokenizer=tokenizer, model_dir=args.target)
    state = ResumeState(args.out, run_settings(args))
    resuming = state.open(resume=not args.no_resume)
    progress = not args.no_progress
    samples = state.load_samples() if resuming else None
    if samples is None:
        t_gen = time.perf_counter()
        samples = target_samples(args.target, arch, weights, prompts, n=args.n,
                                 max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                 seed=args.seed, response_only=args.response_only,
                                 max_num_seqs=args.max_num_seqs, progress=progress)
        state.save_samples(samples)
        generate_s = time.perf_counter() - t_gen
    else:
        generate_s = None  # read back: generated by the run this one resumes
        print(f"resuming the unfinished run in {args.out}: {len(samples)} target responses "
              "read back (not generated again)", file=sys.stderr)
    drafter = build_drafter(arch, float32_head(weights), samples, draft_vocab_size=args.draft_vocab,
                            seed=args.seed)
    packs = pack_samples(samples, args.batch_tokens)
    steps = args.steps if args.steps is not None else total_steps(len(packs), args.epochs)
    trainer = DrafterTrainer(drafter, lr=args.lr, weight_decay=args.weight_decay,
                             ce_weight=args.ce_weight, feature_noise=args.feature_noise, seed=args.seed,
                             unroll=args.unroll, lr_schedule=args.lr_schedule, total_steps=steps,
                             warmup_steps=args.warmup_steps)
    resumed_at = None
    if resuming and state.load(trainer):
        resumed_at = trainer.step_count
        print(f"resuming at step {resumed_at} of {steps}", file=sys.stderr)
    before = state.load_before()
    if before is None:
        before = trainer.evaluate(packs)  # the untrained drafter (no checkpoint precedes it)
        state.save_before(before)

    def checkpoint(t: DrafterTrainer) -> None:
        if args.save_every and t.step_count % args.save_every == 0 and t.step_count < steps:
            state.save(t)
    t_train = time.perf_counter()
    train(trainer, packs, max(0, steps - trainer.step_count), seed=args.seed,
          progress=progress, on_step=checkpoint)
    train_s = time.perf_counter() - t_train
    after = trainer.evaluate(packs)
    trainer.save_checkpoint(args.out)
    summary = {"samples": len(samples), "pairs": sum(pk.num_tokens for pk in packs),
               "packs": len(packs), "steps": trainer.step_count, "unroll": args.unroll,
               "resumed_at_step": resumed_at, "generate_s": generate_s, "train_s": train_s,
               "before": before, "after": after}
    with open(os.path.join(args.out, "train_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    state.finish()
    deeper = "".join(f", level-{s} top-1 {before[f'top1_{s}']:.3f} -> {after[f'top1_{s}']:.3f}"
                     for s in range(2, args.unroll + 1))
    print(f"drafter saved to {args.out}: loss {before['loss']:.4f} -> {after['loss']:.4f}, "
          f"top-1 {before['top1']:.3f} -> {after['top1']:.3f}{deeper}; {len(packs)} packs, "
          f"{trainer.step_count} steps in {train_s:.0f} s", file=sys.stderr)
    return 0 if math.isfinite(after["loss"]) else 1


if __name__ == "__main__":
    from megatron_tlt.errors import TLTError as _E
    try:
        sys.exit(main(sys.argv[1:]))
    except _E as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
