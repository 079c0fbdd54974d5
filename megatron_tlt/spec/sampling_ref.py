"""Logit processing: temperature, top-k, top-p -> the distribution tokens are drawn from.

One function, `process_logits`, turns logits into probabilities for the target *and* the
drafter. Speculative decoding is lossless only if the verifier's target_probs and
draft_probs are exactly the distributions the tokens are (or would be) drawn from, so
both models must go through the same processing with the same parameters; any
difference is a bug the losslessness tests are built to catch.

Order: logits / temperature -> top-k (on logits) -> softmax -> top-p -> renormalise.

Ties are resolved by value, never by position, so the kept set does not depend on how a
sort orders equal values:
- top-k keeps every token whose logit is >= the k-th largest logit: ties at the boundary
  are all kept (more than k tokens may survive).
- top-p keeps every token v whose probability is >= the cutoff c, where c is the
  smallest probability such that the tokens with probability >= c carry at least top_p
  of the mass (the shortest prefix of the descending order reaching top_p, then every
  token tied with its last element). The most likely token is always kept.
- temperature 0 means greedy: a one-hot distribution on the argmax (ties -> lowest id,
  NaN never wins); top-k/top-p do not matter then.

Parameters are Python numbers or tensors broadcastable to logits.shape[:-1] (one value
per row). top_k <= 0 or >= vocab and top_p >= 1 disable those filters.
"""

from __future__ import annotations

import torch

from megatron_tlt.spec.verify_ref import greedy_argmax, race

Param = float | int | torch.Tensor


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _check(name: str, value: Param, ok, what: str) -> None:
    if isinstance(value, torch.Tensor):
        if _capturing():  # checking tensor values would sync
            return
        bad = ~ok(value)
        if bool(bad.any()):
            raise ValueError(f"{name} must be {what}, got {value[bad].flatten()[0].item()}")
    elif not ok(torch.tensor(value, dtype=torch.float64)):
        raise ValueError(f"{name} must be {what}, got {value!r}")


def _per_row(value: Param, shape: torch.Size, dtype: torch.dtype, device) -> torch.Tensor:
    # A plain number is filled on the device (a kernel), never copied from the host: a
    # host-to-device copy is not allowed while a CUDA graph is being captured. Same
    # values: fill_ and as_tensor round the number to `dtype` alike.
    if isinstance(value, torch.Tensor):
        return value.to(dtype=dtype, device=device).expand(shape)
    return torch.full(shape, value, dtype=dtype, device=device)


def process_logits(
    logits: torch.Tensor,  # [..., vocab]
    temperature: Param = 1.0,
    top_k: Param = 0,
    top_p: Param = 1.0,
) -> torch.Tensor:
    """Processed probabilities [..., vocab] float32 (rows sum to 1)."""
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have shape [..., vocab] with vocab >= 1, got {tuple(logits.shape)}")
    _check("temperature", temperature, lambda t: t >= 0, ">= 0")
    _check("top_k", top_k, lambda k: k >= 0, ">= 0")
    _check("top_p", top_p, lambda p: (p > 0) & (p <= 1), "in (0, 1]")
    vocab = logits.shape[-1]
    rows, device = logits.shape[:-1], logits.device
    temp = _per_row(temperature, rows, torch.float32, device)
    k = _per_row(top_k, rows, torch.int64, device)
    p = _per_row(top_p, rows, torch.float32, device)

    greedy = temp == 0
    scaled = logits.float() / torch.where(greedy, 1.0, temp).unsqueeze(-1)

    # top-k on logits, ties at the boundary kept. Skipped (the sort is the cost on a
    # 152k vocabulary) when top_k is a plain number that disables it: k = vocab keeps all.
    if isinstance(top_k, torch.Tensor) or 0 < top_k < vocab:
        k = torch.where((k <= 0) | (k >= vocab), vocab, k)
        sorted_logits = scaled.sort(-1, descending=True).values
        kth = sorted_logits.gather(-1, (k - 1).unsqueeze(-1))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)

    # top-p by value: cutoff = the probability at which the descending cumsum reaches p.
    # Skipped when top_p is a plain number >= 1 (keeps all); the renormalisation is not,
    # so both routes give the same numbers.
    if isinstance(top_p, torch.Tensor) or top_p < 1:
        sorted_probs = probs.sort(-1, descending=True).values
        cumulative = sorted_probs.double().cumsum(-1)
        position = (cumulative < p.double().unsqueeze(-1)).sum(-1, keepdim=True).clamp(max=vocab - 1)
        cutoff = sorted_probs.gather(-1, position)
        keep = (probs >= cutoff) | (p >= 1).unsqueeze(-1)
        probs = torch.where(keep, probs, 0.0)
    probs = probs / probs.sum(-1, keepdim=True)

    if not isinstance(temperature, torch.Tensor) and temperature > 0:
        return probs
    one_hot = torch.nn.functional.one_hot(greedy_argmax(logits.float()), vocab).float()
    return torch.where(greedy.unsqueeze(-1), one_hot, probs)


def sample(probs: torch.Tensor, exp_noise: torch.Tensor) -> torch.Tensor:
    """Draw one token per row from probs [..., vocab] with the exponential race (the
    kernels' rule: argmax p / E, ties -> lowest id) given noise Exp(1) of the same shape.
    Rows without positive mass give token 0."""
    token, found = race(probs, exp_noise)
    return torch.where(found, token, 0)
