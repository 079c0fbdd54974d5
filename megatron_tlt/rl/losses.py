"""PPO-family policy losses on per-token log-probabilities.

Shapes: every tensor is [b, s] over response positions; `mask` is 1 on response tokens.
Terms:
- ratio = exp(logp - old_logp), with old_logp the actor's own recomputed log-probs
  before the update (not the rollout engine's: their difference is logged as the
  train-inference mismatch);
- PPO-clip: -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A) (eps_high > eps_low
  is DAPO's clip-higher);
- KL to a frozen reference, the non-negative k3 estimator exp(ref - logp) - (ref - logp) - 1;
- aggregation "token": sum over all response tokens / number of tokens (DAPO); "sequence":
  mean over each response's tokens, then mean over responses (GRPO's original).

`normalizer` lets the caller divide by a count over the whole global batch (all
micro-batches and data-parallel ranks) rather than this micro-batch: the losses of the
micro-batches then add up to the global mean.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch


@dataclasses.dataclass(kw_only=True)
class PPOLossConfig:
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_coef: float = 0.0
    aggregation: str = "token"  # "token" | "sequence"

    def __post_init__(self):
        if self.aggregation not in ("token", "sequence"):
            raise ValueError(f"aggregation must be 'token' or 'sequence', got {self.aggregation!r}")
        if self.clip_eps_low < 0 or self.clip_eps_high < 0:
            raise ValueError(f"clip epsilons must be >= 0, got {self.clip_eps_low}, {self.clip_eps_high}")


def aggregate(values: torch.Tensor, mask: torch.Tensor, how: str,
              normalizer: Optional[float] = None) -> torch.Tensor:
    mask = mask.to(values.dtype)
    if how == "token":
        denom = normalizer if normalizer is not None else mask.sum().clamp(min=1)
        return (values * mask).sum() / denom
    per_seq = (values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    denom = normalizer if normalizer is not None else max(values.shape[0], 1)
    return per_seq.sum() / denom


def ppo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
             cfg: PPOLossConfig, ref_logp: Optional[torch.Tensor] = None,
             normalizer: Optional[float] = None) -> tuple[torch.Tensor, dict]:
    """Returns (loss, metrics). `advantages` may be [b] (one per response) or [b, s]."""
    if advantages.ndim == 1:
        advantages = advantages.unsqueeze(1).expand_as(logp)
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    m = mask.to(logp.dtype)
    n = m.sum().clamp(min=1)
    metrics = {
        "clip_frac": ((clipped < unclipped).to(logp.dtype) * m).sum().detach() / n,
        "approx_kl_old": ((ratio - 1 - log_ratio) * m).sum().detach() / n,
        "ratio_mean": (ratio * m).sum().detach() / n,
    }
    if cfg.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp")
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1
        per_token = per_token + cfg.kl_coef * kl
        metrics["kl_ref"] = (kl * m).sum().detach() / n
    loss = aggregate(per_token, mask, cfg.aggregation, normalizer)
    metrics["pg_loss"] = loss.detach()
    return loss, metrics
