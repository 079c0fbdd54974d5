"""Logit processing: temperature, top-k, top-p -> the distribution tokens are drawn from.

One function, `process_logits`, turns logits into probabilities for the target *and* the
drafter. Speculative decoding is lossless only if the verifier's target_probs and
draft_probs are exactly the distributions the tokens are (or would be) drawn from, so
both models must go through the same processing with the same parameters; any
difference is a bug the losslessness tests are built to catch.

Order: logits / temperature -> top-k (on logits) -> softmax -> top-p -> renormalise.

top-k and top-p are the engine sampler's (rollout.sampling.top_k_top_p_keep, one function
for both), so speculative decoding verifies against the distribution plain decoding
samples from:
- ties are resolved by position: in the stable descending order of logits / T (equal
  values: lowest id first), top-k keeps exactly the k first tokens;
- top-p keeps, of those, the tokens whose mass before them (float32 cumulative sum of the
  top-k-renormalised distribution) is below top_p: the shortest prefix of that order
  reaching top_p. The most likely token is always kept.
  (Until session 41 both kept every token tied with the boundary, by value: bf16 logits
  tie there often, and the verified distribution then was not the sampler's.)
- temperature 0 means greedy: a one-hot distribution on the argmax (ties -> lowest id,
  NaN never wins); top-k/top-p do not matter then.

Parameters are Python numbers or tensors broadcastable to logits.shape[:-1] (one value
per row). top_k <= 0 or >= vocab and top_p >= 1 disable those filters.
"""

from __future__ import annotations

import torch

from megatron_tlt.rollout.sampling import top_k_top_p_keep
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

    # top-k then top-p: the sampler's own rule (rollout.sampling.top_k_top_p_keep). Skipped
    # (the sort is the cost on a 152k vocabulary) when both are plain numbers that disable
    # them; the renormalisation is not, so both routes give the same numbers.
    if (isinstance(top_k, torch.Tensor) or 0 < top_k < vocab
            or isinstance(top_p, torch.Tensor) or top_p < 1):
        scaled = scaled.masked_fill(~top_k_top_p_keep(scaled, k, p), float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
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
