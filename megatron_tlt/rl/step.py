"""The pieces of one RL step between the rollout engine and the Megatron actor.

Plain data in, plain data out, so each piece is testable alone:
- `RolloutBatch`: what rollouts produced (tokens, the engine's log-probs, rewards);
- `make_microbatches`: pack it into fixed-shape Megatron micro-batches;
- `actor_logprobs`: the actor's per-token log-probs (old/reference log-probs);
- `policy_update`: PPO-family loss over the micro-batches and one optimizer step.

Alignment: a row is prompt + response; `tokens = row[:-1]`, `labels = row[1:]`, and
`loss_mask` is 1 where the label is a response token, so position t scores response
token t+1 under the context up to t.

Which distribution: the actor's log-probs are of log_softmax(logits / T) with T the
rollout temperature (`temperature`; 0, greedy, counts as 1), the distribution the engine
samples from and reports its `logprobs` of (rollout/sampling.py), so the PPO ratio is
on-policy at any temperature (verl divides the logits by T the same way). Top-k / top-p
truncation is not reproduced here: the RL loop refuses it (`rl.loop.check_sampling`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megatron_tlt.models import mcore
from megatron_tlt.models.actor import Actor, MicroBatch, token_logprobs
from megatron_tlt.rollout.host import to_device
from megatron_tlt.rl.losses import PPOLossConfig, ppo_loss


@dataclasses.dataclass
class RolloutBatch:
    prompt_ids: list[str]
    sample_indices: list[int]
    prompt_tokens: list[list[int]]
    response_tokens: list[list[int]]
    rollout_logprobs: list[list[float]]
    """The engine's log-probs of each response token: log_softmax(logits / T), the distribution
    `actor_logprobs(..., temperature=T)` recomputes."""
    rewards: torch.Tensor  # [n] float
    advantages: Optional[torch.Tensor] = None  # [n] float

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def select(self, idx: list[int]) -> "RolloutBatch":
        pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
        return RolloutBatch(pick(self.prompt_ids), pick(self.sample_indices), pick(self.prompt_tokens),
                            pick(self.response_tokens), pick(self.rollout_logprobs), self.rewards[idx],
                            None if self.advantages is None else self.advantages[idx])

    @classmethod
    def make_dummy(cls, n: int = 4, vocab: int = 50, seed: int = 0) -> "RolloutBatch":
        g = torch.Generator().manual_seed(seed)
        pl = torch.randint(2, 6, (n,), generator=g).tolist()
        rl = torch.randint(1, 7, (n,), generator=g).tolist()
        return cls([f"p{i // 2}" for i in range(n)], [i % 2 for i in range(n)],
                   [torch.randint(0, vocab, (k,), generator=g).tolist() for k in pl],
                   [torch.randint(0, vocab, (k,), generator=g).tolist() for k in rl],
                   [[-1.0] * k for k in rl], torch.rand(n, generator=g), torch.randn(n, generator=g))


def make_microbatches(batch: RolloutBatch, *, seq_length: int, micro_batch_size: int,
                      pad_id: int = 0) -> list[MicroBatch]:
    """Fixed [micro_batch_size, seq_length] micro-batches (rows padded with `pad_id`,
    padded rows added to fill the last micro-batch carry an all-zero loss mask).
    extra: "advantages" [b], "rollout_logp" [b, s], "row" [b] (index into batch, -1 pad)."""
    n = len(batch)
    if n == 0:
        raise ValueError("empty rollout batch")
    rows = []
    for i in range(n):
        full = batch.prompt_tokens[i] + batch.response_tokens[i]
        if len(full) - 1 > seq_length:
            raise ValueError(f"sample {batch.prompt_ids[i]}/{batch.sample_indices[i]}: prompt + response "
                             f"({len(full)} tokens) exceeds seq_length + 1 ({seq_length + 1})")
        rows.append(full)
    num_mb = -(-n // micro_batch_size)
    out = []
    for m in range(num_mb):
        idx = list(range(m * micro_batch_size, min(n, (m + 1) * micro_batch_size)))
        b = micro_batch_size
        tokens = torch.full((b, seq_length), pad_id, dtype=torch.long)
        labels = torch.full((b, seq_length), pad_id, dtype=torch.long)
        mask = torch.zeros(b, seq_length)
        rlogp = torch.zeros(b, seq_length)
        adv = torch.zeros(b)
        row_ids = torch.full((b,), -1, dtype=torch.long)
        for j, i in enumerate(idx):
            full = rows[i]
            L = len(full) - 1
            tokens[j, :L] = torch.tensor(full[:-1])
            labels[j, :L] = torch.tensor(full[1:])
            p = len(batch.prompt_tokens[i])
            r = len(batch.response_tokens[i])
            mask[j, p - 1:p - 1 + r] = 1.0
            if batch.rollout_logprobs[i]:
                rlogp[j, p - 1:p - 1 + r] = torch.tensor(batch.rollout_logprobs[i][:r])
            if batch.advantages is not None:
                adv[j] = batch.advantages[i]
            row_ids[j] = i
        out.append(MicroBatch(tokens=tokens, position_ids=mcore.causal_position_ids(b, seq_length),
                              labels=labels, loss_mask=mask,
                              extra={"advantages": adv, "rollout_logp": rlogp, "row": row_ids}))
    return out


@torch.no_grad()
def actor_logprobs(actor: Actor, mbs: list[MicroBatch], *,
                   temperature: float = 1.0) -> Optional[list[torch.Tensor]]:
    """Per-token log-probs [b, s] of each micro-batch under log_softmax(logits / temperature)
    (last pipeline stage; None elsewhere)."""
    from megatron.core import parallel_state as ps

    arch = actor.arch

    def loss_fn(logits, mb):
        lp = token_logprobs(logits, mb.labels.to(logits.device), arch, temperature)
        # kept on the device until the schedule is done: a copy to the host here would wait
        # for this micro-batch, and the next one's kernels could not be queued ahead
        return lp.sum() * 0, {"logp": lp.detach().float()}

    out = actor.forward_backward(mbs, loss_fn, forward_only=True)
    if not ps.is_pipeline_last_stage():
        return None
    return [o["logp"].cpu() for o in out]


def policy_update(actor: Actor, optimizer, mbs: list[MicroBatch], old_logps: Optional[list[torch.Tensor]],
                  cfg: PPOLossConfig, *, ref_logps: Optional[list[torch.Tensor]] = None,
                  global_tokens: Optional[float] = None, global_seqs: Optional[float] = None,
                  temperature: float = 1.0) -> dict:
    """One optimizer step of the PPO-family loss over `mbs`. `old_logps`/`ref_logps` are
    needed on the last pipeline stage only (computed at the same `temperature`).
    `global_tokens`/`global_seqs`: the counts over the whole step (all micro-batches and
    DP ranks) the loss is normalised by; counted here from the micro-batches' loss masks
    (tokens, rows with any) and all-reduced over DP when not given, so that the loss never
    depends on how the step is split into micro-batches. `temperature`: the rollout's (see
    the module docstring)."""
    from megatron.core import parallel_state as ps

    arch = actor.arch
    num_mb = len(mbs)
    dp = ps.get_data_parallel_world_size()
    norm = global_tokens if cfg.aggregation == "token" else global_seqs
    if norm is None:
        if cfg.aggregation == "token":
            count = sum(float(mb.loss_mask.sum()) for mb in mbs)
        else:
            count = sum(float((mb.loss_mask.sum(dim=1) > 0).sum()) for mb in mbs)
        t = torch.tensor([count], dtype=torch.float64, device=actor.device)
        if dp > 1:
            torch.distributed.all_reduce(t, group=ps.get_data_parallel_group())
        norm = max(float(t), 1.0)

    def loss_fn(logits, mb):
        k = mb.extra["index"]
        lp = token_logprobs(logits, mb.labels.to(logits.device), arch, temperature)
        dev = lp.device
        mask = mb.loss_mask.to(dev)
        # host tensors through pinned memory, not blocking (a pageable copy would wait for
        # this micro-batch's forward before the host could queue the loss: rollout/host.py)
        old = to_device(old_logps[k], dev)
        ref = to_device(ref_logps[k], dev) if ref_logps is not None else None
        loss, metrics = ppo_loss(lp, old, to_device(mb.extra["advantages"], dev), mask, cfg, ref_logp=ref,
                                 normalizer=norm)
        # Megatron divides each micro-batch loss by num_microbatches and DDP averages over
        # DP; undo both so the summed gradient is that of the global mean.
        scaled = loss * (num_mb * dp)
        # Mean negative log-prob of the sampled tokens: an unbiased estimate of the policy's
        # entropy on on-policy samples (the exact one needs a vocab-parallel reduction).
        metrics["entropy_est"] = (-(lp * mask).sum() / mask.sum().clamp(min=1)).detach()
        metrics[_TOKENS] = mask.sum().detach()
        return scaled, metrics

    for k, mb in enumerate(mbs):
        mb.extra["index"] = k
    optimizer.zero_grad()
    outs = actor.forward_backward(mbs, loss_fn)
    stats = optimizer.step()
    metrics = {"grad_norm": stats["grad_norm"], "update_skipped": stats["skipped"]}
    if outs:  # the last pipeline stage; its DP group reduces together
        metrics.update(_step_metrics(outs, dp=dp, device=actor.device))
    return metrics


_TOKENS = "_tokens"


def _step_metrics(outs: list[dict], *, dp: int, device) -> dict:
    """The step's loss metrics from each micro-batch's (this rank's): `pg_loss` is the loss
    the gradient is of (micro-batch losses normalised by the step's global count, summed
    over micro-batches and DP ranks), the others token-weighted means over every loss
    token of the step (padding micro-batches, all masked, weigh nothing). A plain mean over
    micro-batches divided the global loss by their number and pulled ratio_mean below 1
    with padding."""
    from megatron.core import parallel_state as ps

    def column(key: str) -> torch.Tensor:  # [micro-batches] float64, on the device
        return torch.stack([torch.as_tensor(o[key], device=device).to(torch.float64) for o in outs])

    tokens = column(_TOKENS)
    keys = [k for k in outs[0] if k != _TOKENS]
    sums = []
    for key in keys:
        vals = column(key)
        if key == "pg_loss":
            sums.append(vals.sum())
        else:
            sums.append((vals * tokens).sum())
    t = torch.stack(sums + [tokens.sum()])
    if dp > 1:
        torch.distributed.all_reduce(t, group=ps.get_data_parallel_group())
    *sums, total = t.tolist()  # one device-to-host copy
    total = max(total, 1.0)
    return {key: v if key == "pg_loss" else v / total for key, v in zip(keys, sums)}
