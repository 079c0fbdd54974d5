"""GRPO advantages and DAPO-style group filtering.

A group is the G samples of one prompt. GRPO's advantage of sample i is its reward
minus the group mean, divided by the group's standard deviation (`std_normalize=True`,
as in DeepSeekMath) or not (Dr.GRPO, which argues the division biases towards
low-variance groups). Every token of a response gets its sample's advantage.
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor,  # [num_groups, G] float
                     std_normalize: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Per-sample advantages [num_groups, G]. The std is the unbiased sample std (G-1)."""
    if rewards.ndim != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [num_groups, G>=2], got {tuple(rewards.shape)}")
    r = rewards.double()
    adv = r - r.mean(dim=1, keepdim=True)
    if std_normalize:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv.to(rewards.dtype)


def informative_groups(rewards: torch.Tensor) -> torch.Tensor:  # [num_groups, G] -> [num_groups] bool
    """DAPO dynamic sampling: a group whose rewards are all equal has zero advantage
    everywhere and contributes no gradient; keep only groups with some spread."""
    return (rewards.max(dim=1).values - rewards.min(dim=1).values) > 0
