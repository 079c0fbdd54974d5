"""The actor's optimizer behind one interface: ours on CPU, Megatron's on GPU.

Megatron-Core's distributed optimizer refuses CPU tensors, and its DDP needs
`clip_grad=0` on a CPU, so:

- `LocalAdamW` (CPU, or GPU when asked): plain `torch.optim.AdamW` over this rank's
  parameters, with the collectives a Megatron step performs done by hand: sum the
  gradients of TP-replicated weights that each TP rank sees only part of (QK-norm
  weights: each rank normalises only its own heads; norms under sequence
  parallelism), average gradients over the data-parallel group, sum the tied embedding/output
  gradients over the embedding group (PP>1), and compute the global gradient norm
  over the model-parallel group counting each TP shard once (duplicated norm weights
  on one TP rank only; the pipeline copy of a tied embedding once).
- `MegatronAdamW` (GPU): Megatron's DDP + distributed optimizer (ZeRO-1 sharding of
  the fp32 master weights and Adam state over data parallel). Megatron's own
  `state_dict()` leaves that sharded state out (it saves it separately); ours holds it,
  this rank's shard only, so the Checkpointer's per-rank files resume exactly.

Both: AdamW (decoupled weight decay), no weight decay on 1-D parameters (norms,
biases), as Megatron does. tests/gpu/test_optim_gpu.py shows they give the same
update on a tiny model.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.distributed as dist

from megatron_tlt.errors import CheckpointError, ConfigError


@dataclasses.dataclass(kw_only=True)
class OptimSettings:
    lr: float = 1e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables."""


def lr_at(step: int, *, total_steps: int, lr: float, min_lr: float, warmup_steps: int,
          schedule: str) -> float:
    """Learning rate of update `step` (0-based): linear warm-up over `warmup_steps`
    updates (the first one at lr / warmup_steps), then cosine/linear decay to `min_lr`
    at the last update, or constant."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    span = max(1, total_steps - 1 - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if schedule == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return lr - (lr - min_lr) * progress
    raise ValueError(f"unknown lr schedule {schedule!r}")


def lr_for_step(cfg, step: int) -> float:
    """The learning rate of update `step` (0-based) of a run configured by `cfg` (a
    config.Config): its optim.lr / min_lr / lr_warmup_steps / lr_schedule over
    train.steps updates. SFT and the RL loop both set it before every optimizer step."""
    o = cfg.optim
    return lr_at(step, total_steps=cfg.train.steps, lr=o.lr, min_lr=o.min_lr, warmup_steps=o.lr_warmup_steps,
                 schedule=o.lr_schedule)


def _param_groups(params, weight_decay: float):
    decay, no_decay = [], []
    for p in params:
        if not p.requires_grad:
            continue
        (no_decay if p.ndim == 1 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class ActorOptimizer:
    """Interface: the RL loop and SFT call only these."""

    def zero_grad(self) -> None:
        raise NotImplementedError

    def step(self) -> dict:
        """Apply one update from the accumulated gradients. Returns {"grad_norm", "skipped"}."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError

    def set_lr(self, lr: float) -> None:
        raise NotImplementedError


class LocalAdamW(ActorOptimizer):
    """AdamW over this rank's parameters (module docstring). Parameters in bfloat16 are
    stepped through float32 master copies, as Megatron's mixed-precision optimizer does:
    AdamW on the bf16 weights themselves would round away every update smaller than half
    a weight's bf16 spacing (10 steps at lr 1e-5 moved a tiny model's weights 0.18x as far
    as a float32 actor's; tests/unit/models/test_local_adamw.py). The masters are
    copied back into the model after each step, saved with the state and refreshed from
    the model by `reload_model_params` (the Checkpointer calls it after loading weights).
    float16 needs loss scaling, which only MegatronAdamW does: refused here."""

    MASTERS_KEY = "fp32_masters"

    def __init__(self, model: torch.nn.Module, s: OptimSettings):
        self.model = model
        self.settings = s
        self.params = [p for p in model.parameters() if p.requires_grad]
        if any(p.dtype == torch.float16 for p in self.params):
            raise ConfigError(
                "model.dtype=float16: training in float16 needs loss scaling, which only the GPU's "
                "Megatron optimizer does; use bfloat16 (same memory, no loss scaling) or float32")
        seq_par = getattr(getattr(model, "config", None), "sequence_parallel", False)
        self.tp_partial = [p for n, p in model.named_parameters() if p.requires_grad and (
            "q_layernorm" in n or "k_layernorm" in n or (seq_par and getattr(p, "sequence_parallel", False)))]
        self.masters: list[torch.Tensor] | None = None
        stepped = self.params
        if any(p.dtype != torch.float32 for p in self.params):
            self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
            stepped = self.masters
        self.opt = torch.optim.AdamW(_param_groups(stepped, s.weight_decay), lr=s.lr,
                                     betas=(s.adam_beta1, s.adam_beta2), eps=s.adam_eps,
                                     foreach=False)

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Masters := the model's weights (after weights were loaded into the model)."""
        if self.masters is not None:
            for m, p in zip(self.masters, self.params):
                m.copy_(p)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def _sync_grads(self) -> None:
        from megatron.core import parallel_state as ps

        for p in self.params:  # a parameter that got no gradient contributes zeros
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if ps.get_tensor_model_parallel_world_size() > 1:
            for p in self.tp_partial:
                dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
        dp = ps.get_data_parallel_world_size()
        if dp > 1:
            group = ps.get_data_parallel_group()
            for p in self.params:
                dist.all_reduce(p.grad, group=group)
                p.grad.div_(dp)
        if ps.get_pipeline_model_parallel_world_size() > 1 and getattr(self.model, "share_embeddings_and_output_weights", False):
            if ps.is_rank_in_embedding_group():
                w = self.model.shared_embedding_or_output_weight()
                dist.all_reduce(w.grad, group=ps.get_embedding_group())

    def grad_norm(self) -> float:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        sq = torch.zeros((), dtype=torch.float64, device=self.params[0].device)
        for p in self.params:
            if getattr(p, "shared", False) and not ps.is_pipeline_first_stage():
                continue  # the last stage's copy of a tied embedding: counted on the first stage
            if not param_is_not_tensor_parallel_duplicate(p):
                continue
            sq += p.grad.double().pow(2).sum()
        if dist.is_initialized():
            dist.all_reduce(sq, group=ps.get_model_parallel_group())
        return math.sqrt(sq.item())

    def step(self) -> dict:
        self._sync_grads()
        norm = self.grad_norm()
        if not math.isfinite(norm):
            self.zero_grad()
            return {"grad_norm": norm, "skipped": True}
        clip = self.settings.clip_grad
        coef = clip / (norm + 1e-6) if clip > 0 and norm > clip else None
        if self.masters is None:
            if coef is not None:
                for p in self.params:
                    p.grad.mul_(coef)
            self.opt.step()
        else:  # the gradients in float32 (clipped there), the step on the masters
            for m, p in zip(self.masters, self.params):
                m.grad = p.grad.float() if coef is None else p.grad.float().mul_(coef)
            self.opt.step()
            with torch.no_grad():
                for m, p in zip(self.masters, self.params):
                    p.copy_(m)
                    m.grad = None
        return {"grad_norm": norm, "skipped": False}

    def state_dict(self) -> dict:
        state = self.opt.state_dict()
        if self.masters is not None:
            state = {**state, self.MASTERS_KEY: [m.detach().clone() for m in self.masters]}
        return state

    def load_state_dict(self, state: dict) -> None:
        masters = state.get(self.MASTERS_KEY)
        self.opt.load_state_dict({k: v for k, v in state.items() if k != self.MASTERS_KEY})
        if self.masters is None:
            return
        if masters is None:  # a state saved before the masters existed: the model's weights
            self.reload_model_params()
            return
        if len(masters) != len(self.masters):
            raise CheckpointError(f"optimizer state holds {len(masters)} master weights, this model "
                                  f"has {len(self.masters)} parameters")
        with torch.no_grad():
            for i, (m, saved) in enumerate(zip(self.masters, masters)):
                if saved.shape != m.shape:
                    raise CheckpointError(f"optimizer master weight {i}: shape {tuple(saved.shape)}, "
                                          f"the model's parameter is {tuple(m.shape)}")
                m.copy_(saved)

    def set_lr(self, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr


MEGATRON_STATE_FORMAT = "megatron_tlt.megatron_adamw/1"


class MegatronAdamW(ActorOptimizer):
    """Megatron DDP + distributed optimizer (GPU only). Wraps `actor.model` in DDP.

    `state_dict()` is this rank's whole optimizer state, on the CPU and readable by
    `torch.load(weights_only=True)`: per distributed optimizer, Megatron's `state_dict()`
    (param-group hyperparameters, step, grad scaler) plus the parameter state that
    Megatron keeps out of it: this data-parallel rank's shard of the fp32 master
    weights, exp_avg, exp_avg_sq (and torch AdamW's per-parameter step), in Megatron's
    "dp_reshardable" (bucket-space) layout. Per-rank shards, no gather: no collective
    at save or load, no full copy on DP rank 0; the price is that a checkpoint loads
    only at the same DP layout (the Checkpointer already requires the same world/TP/PP,
    and Megatron checks the bucket sizes). Load after the model weights and
    `opt.reload_model_params()`, as the Checkpointer does.
    """

    def __init__(self, actor, s: OptimSettings):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        if not torch.cuda.is_available():
            raise RuntimeError("MegatronAdamW needs CUDA; use LocalAdamW on CPU")
        cfg = actor.config
        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                use_distributed_optimizer=True)
        actor.model = DistributedDataParallel(config=cfg, ddp_config=ddp_cfg, module=actor.model)
        cfg.finalize_model_grads_func = finalize_model_grads
        cfg.no_sync_func = actor.model.no_sync
        ocfg = OptimizerConfig(optimizer="adam", lr=s.lr, weight_decay=s.weight_decay,
                               adam_beta1=s.adam_beta1, adam_beta2=s.adam_beta2, adam_eps=s.adam_eps,
                               clip_grad=s.clip_grad, bf16=cfg.bf16, fp16=cfg.fp16,
                               params_dtype=cfg.params_dtype, use_distributed_optimizer=True)
        self.actor = actor
        self.settings = s
        self.opt = get_megatron_optimizer(ocfg, [actor.model])
        if cfg.fp16:
            # The loss is scaled up by the grad scaler's loss scale in backward (Megatron's
            # schedules call grad_scale_func; its own training loop sets it so), and step()
            # unscales the gradients; without it they reached Adam 2**32 times too small.
            cfg.grad_scale_func = self.opt.scale_loss
        # Megatron leaves per-group weight decay and lr to its OptimizerParamScheduler
        # (wd_mult = 0 for 1-D params); without it every group would decay. Set them here.
        self.set_lr(s.lr)

    def zero_grad(self) -> None:
        self.actor.model.zero_grad_buffer()
        self.opt.zero_grad()

    def step(self) -> dict:
        ok, norm, _ = self.opt.step()
        return {"grad_norm": float(norm) if norm is not None else float("nan"), "skipped": not ok}

    def _dist_opts(self) -> list:
        """The DistributedOptimizers behind `self.opt`: megatron-core 0.16 returns a
        ChainedOptimizer (one for a dense model; MoE would add one for the experts)."""
        return list(getattr(self.opt, "chained_optimizers", [self.opt]))

    def state_dict(self) -> dict:
        parts = []
        for o in self._dist_opts():
            if getattr(o, "is_stub_optimizer", False):  # no trainable parameters on this rank
                parts.append(None)
                continue
            part = {"dp_rank": o.data_parallel_group.rank(), "dp_size": o.data_parallel_group.size()}
            if not o.optimizer.state:
                # Never stepped: no moments yet, and Megatron's state_dict() asserts on the
                # empty state (torch AdamW). Keep the hyperparameters only.
                part["megatron"] = None
                part["param_groups"] = [{k: v for k, v in g.items() if k != "params"}
                                        for g in o.optimizer.param_groups]
            else:
                sd = _to_cpu(o.state_dict())
                sd["param_state"] = _param_state_cpu(o)
                sd["param_state_sharding_type"] = "dp_reshardable"
                part["megatron"] = sd
            parts.append(part)
        return {"format": MEGATRON_STATE_FORMAT, "optimizers": parts}

    def load_state_dict(self, state: dict) -> None:
        fmt = state.get("format") if isinstance(state, dict) else None
        if fmt != MEGATRON_STATE_FORMAT:
            raise CheckpointError(
                f"optimizer state format is {fmt!r}, expected {MEGATRON_STATE_FORMAT!r} (a state written "
                f"by Megatron's plain state_dict() lacks the Adam moments and fp32 master weights)")
        opts, parts = self._dist_opts(), state["optimizers"]
        if len(parts) != len(opts):
            raise CheckpointError(f"optimizer state holds {len(parts)} distributed optimizers, this "
                                  f"model has {len(opts)}")
        for o, part in zip(opts, parts):
            if part is None or getattr(o, "is_stub_optimizer", False):
                continue
            here = (o.data_parallel_group.rank(), o.data_parallel_group.size())
            if (part["dp_rank"], part["dp_size"]) != here:
                raise CheckpointError(
                    f"optimizer state of data-parallel rank {part['dp_rank']} of {part['dp_size']} "
                    f"cannot load on rank {here[0]} of {here[1]} (the shards are per rank)")
            if part["megatron"] is None:
                for g, saved in zip(o.optimizer.param_groups, part["param_groups"]):
                    g.update(saved)
                continue
            # Megatron restores the param groups and step, allocates the state and copies
            # each shard in (distrib_optimizer.py: load_state_dict -> "dp_reshardable" ->
            # load_parameter_state_from_dp_reshardable). That loader is not under no_grad, and
            # the master "param" of an fp32 parameter is a view of it (requires_grad): the
            # in-place copy fails without no_grad.
            with torch.no_grad():
                o.load_state_dict(part["megatron"])
            # ...giving every parameter one shared `step` tensor (torch AdamW, no TE/apex);
            # AdamW adds 1 to each parameter's step, so a shared one would advance once per
            # parameter and change the bias correction.
            for s in o.optimizer.state.values():
                if torch.is_tensor(s.get("step")):
                    s["step"] = s["step"].clone()

    def reload_model_params(self) -> None:
        """Megatron's fp32 master weights := the model's (after weights were loaded)."""
        self.opt.reload_model_params()

    def set_lr(self, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr * g.get("lr_mult", 1.0)
            g["weight_decay"] = self.settings.weight_decay * g.get("wd_mult", 1.0)


def _to_cpu(x):
    """A copy of a nested state with every tensor on the CPU (its own, compact storage)."""
    if torch.is_tensor(x):
        return x.detach().to("cpu", copy=True)
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    return x


def _param_state_cpu(o) -> dict:
    """This DP rank's shard of the master weights and Adam state of DistributedOptimizer `o`:
    {"per_bucket_numel", "per_bucket_numel_unpadded", gbuf_idx: {(param_dtype, grad_dtype):
    [bucket: [per parameter {"param", "exp_avg", "exp_avg_sq"[, "step"], "gbuf_local_start",
    "gbuf_local_end", "padding"}]]}}, as load_parameter_state_from_dp_reshardable reads it."""
    state = _to_cpu(o.get_parameter_state_dp_reshardable())
    for key, per_dtype in state.items():
        if not isinstance(key, int):
            continue
        for buckets in per_dtype.values():
            for bucket in buckets:
                for entry in bucket:
                    entry["padding"] = False  # the loader skips padding entries; this layout has none
    return state


def build_optimizer(actor, s: OptimSettings, kind: Optional[str] = None) -> ActorOptimizer:
    """kind: 'local' | 'megatron' | None (megatron on GPU, local on CPU)."""
    if kind is None:
        kind = "megatron" if torch.cuda.is_available() else "local"
    if kind == "megatron":
        return MegatronAdamW(actor, s)
    if kind == "local":
        return LocalAdamW(actor.model, s)
    raise ValueError(f"optimizer kind must be 'local' or 'megatron', got {kind!r}")
