"""Plain-data request and result records of the rollout engine."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron_tlt.errors import TLTError
from megatron_tlt.rollout.sampling import SamplingParams

HIDDEN_KINDS = ("final", "pre_norm")


@dataclasses.dataclass(kw_only=True)
class Request:
    prompt_id: Any
    """Any value with a stable str() (int or str); part of the per-request seed."""
    sample_index: int = 0
    """Which of the G samples of this prompt; part of the per-request seed."""
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    return_hidden_states: str | None = None
    """None, "final" (after the final norm) or "pre_norm" (before it); see Result.hidden_states."""


@dataclasses.dataclass(kw_only=True)
class Result:
    prompt_id: Any
    sample_index: int
    token_ids: list[int]
    """Generated tokens only (prompt excluded); a stop token / the token completing a stop
    string is included."""
    logprobs: list[float] | None
    """log_softmax(logits / T) of each sampled token, before top-k/top-p (sampling.py)."""
    finish_reason: str
    """"stop" (stop token or string), "length" (max_new_tokens / max_model_len) or "error"."""
    policy_version: int
    error: str | None = None
    """Why the request was rejected (finish_reason "error"); None otherwise."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the request."""
    processed_logprobs: list[float] | None = None
    """Log-probability under the distribution actually sampled from (after top-k/top-p)."""
    hidden_states: torch.Tensor | None = None
    """[prompt_len + len(token_ids) - 1, hidden]: row t is the target's hidden state at
    position t, i.e. the one that produced the logits for token t + 1 (the last token is
    never fed, so it has no row). Only when the request asked for it."""
    num_preemptions: int = 0
    spec_stats: dict = dataclasses.field(default_factory=dict)
    """Speculative-decoding counters (megatron_tlt.spec.stats): method, num_drafts,
    drafted, accepted, acceptance_rate, acceptance_length, plain_steps, fallbacks.
    Empty when the engine has no spec decoder."""

    @classmethod
    def rejected(cls, request: Request, message: str, policy_version: int) -> "Result":
        return cls(prompt_id=getattr(request, "prompt_id", None),
                   sample_index=getattr(request, "sample_index", None), token_ids=[],
                   logprobs=None, finish_reason="error", policy_version=policy_version,
                   error=message)


MAX_SAMPLES = 1 << 16
"""Samples of one prompt a single request line may ask for (a larger n exhausted the host's
memory building the requests)."""


def expand_requests(prompt_id: Any, prompt_token_ids: list[int], sampling_params: SamplingParams,
                    n: int, **kwargs) -> list[Request]:
    """The n samples of one prompt (sample_index 0..n-1), n at most MAX_SAMPLES."""
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_SAMPLES:
        raise TLTError(f"prompt {prompt_id!r}: number of samples n must be an integer in "
                       f"[1, {MAX_SAMPLES}], got {n!r}")
    return [Request(prompt_id=prompt_id, sample_index=i, prompt_token_ids=list(prompt_token_ids),
                    sampling_params=sampling_params, **kwargs) for i in range(n)]
