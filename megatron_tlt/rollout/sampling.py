"""Sampling: parameters, per-request randomness, the sampler and stop conditions.

Definitions (used by every caller, the trainer included):

- Processing order: logits -> / temperature -> min_new_tokens ban (stop ids to -inf)
  -> top-k (ties at the boundary keep the lowest ids) -> top-p over the top-k-renormalised
  distribution (keep the smallest prefix of the sorted distribution whose mass reaches
  top_p; the most likely token is always kept) -> sample.
- Sampling is the *exponential race*: token = argmax_i p_i / E_i with E_i ~ Exp(1), one
  [vocab] draw per sampled token from the request's own noise stream. This equals a draw
  from p, needs no host sync, and takes its noise as a tensor, so a kernel can consume
  the same noise. Temperature 0 is greedy: argmax of the (banned) logits, ties -> lowest
  id; it consumes no randomness.
- `logprobs` (the default reported per-token logprob) is log_softmax(logits / T)[token]:
  the temperature-scaled distribution BEFORE the min_new_tokens ban, top-k and top-p —
  what the trainer recomputes from the policy. For T = 0 it is log_softmax(logits)
  (T = 1). `processed_logprobs` is the log-probability under the distribution actually
  sampled from (after ban/top-k/top-p; 0.0 for greedy). On a GPU, rows without top-k,
  top-p or a ban are sampled by the fused kernels (`sample_streams`, triton_sample.py):
  the same definitions, with their own float32 summation order for the softmax's sum
  (logprobs within a few ulps of torch's; a sampled token can differ only where two
  race scores are that close).
- Per-request noise streams (`NoiseStream`): a key from (seed, prompt id, sample index)
  through BLAKE2b and a draw counter; draw d is SplitMix64 of (key, d, index), computed
  on the device that needs it. The same seed gives the same noise whatever else is in
  the batch, across processes and devices (same bits; the float32 Exp(1) values may
  differ in the last bit between CPU and GPU `log`). A preempted request keeps its
  stream; recompute draws nothing. (Until 2026-12 this was one CPU torch.Generator per
  request: 151,936 CPU draws per request per token stalled a 256-sample GPU rollout.)
- Stop: a stop token (eos ids of the engine plus `stop_token_ids`) or a stop string ends a
  request only once `min_new_tokens` tokens exist; the stop token / the token completing
  the stop string is kept in the output. Stop strings are matched on the decoded tail of
  the output (prompt excluded) and must end inside the newest token's text.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import math
import os
from typing import Callable, Sequence

import torch

from megatron_tlt.errors import TLTError


MIN_TEMPERATURE = 1e-5
"""The smallest temperature above 0 that SamplingParams.check accepts: logits / T must stay
finite in float32 (at 1e-38 the largest logit overflowed to inf, log_softmax gave NaN and
argmax picked token 0). Below it use 0 (greedy); a tiny T is rejected, not silently taken
as greedy, as the two differ where logits tie."""


@dataclasses.dataclass(kw_only=True)
class SamplingParams:
    """Per-request sampling settings. Checked by `check()` when the engine admits the
    request (not on construction), so one bad request is rejected alone."""

    temperature: float = 1.0
    """0 = greedy; else at least MIN_TEMPERATURE."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 disables."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1 disables."""
    max_new_tokens: int = 16
    min_new_tokens: int = 0
    """Stop tokens are banned and stop strings ignored until this many tokens exist."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra stop tokens, on top of the engine's eos ids."""
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None
    """None: the engine's seed."""
    logprobs: bool = True

    def check(self, vocab_size: int) -> None:
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not _finite(t) or t < 0:
            raise TLTError(f"temperature must be a finite number >= 0, got {t!r}")
        if 0 < t < MIN_TEMPERATURE:
            raise TLTError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {t!r}")
        if not _is_int(self.top_k) or not -1 <= self.top_k < 2 ** 63:
            raise TLTError(f"top_k must be an integer >= -1 (0 or -1 disables), got {self.top_k!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not (0 < p <= 1):
            raise TLTError(f"top_p must be in (0, 1], got {p!r}")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise TLTError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not _is_int(self.min_new_tokens) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise TLTError(f"min_new_tokens must be an integer in [0, max_new_tokens="
                           f"{self.max_new_tokens}], got {self.min_new_tokens!r}")
        for name in ("stop_token_ids", "stop_strings"):
            if not isinstance(getattr(self, name), (tuple, list)):
                raise TLTError(f"{name} must be a tuple or list, got {getattr(self, name)!r}")
        for tok in self.stop_token_ids:
            if not _is_int(tok) or not 0 <= tok < vocab_size:
                raise TLTError(f"stop token id {tok!r} is outside the vocabulary [0, {vocab_size})")
        for s in self.stop_strings:
            if not isinstance(s, str) or not s:
                raise TLTError(f"stop strings must be non-empty strings, got {s!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise TLTError(f"seed must be an integer, got {self.seed!r}")


def _finite(x: int | float) -> bool:
    """math.isfinite that answers False for an int too large for a float (it raised)."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def request_seed(seed: int, prompt_id, sample_index: int) -> int:
    """Stable 63-bit seed for one request from (seed, prompt id, sample index)."""
    key = f"{seed}\x1f{prompt_id}\x1f{sample_index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & ((1 << 63) - 1)


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _srl(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (multiplication wraps modulo 2^64)."""
    z = (z ^ _srl(z, 30)) * _MIX1
    z = (z ^ _srl(z, 27)) * _MIX2
    return z ^ _srl(z, 31)


def noise_bits(keys: torch.Tensor,  # [B] int64: per-request stream keys
               draws: torch.Tensor,  # [B] int64: the draw number within each stream
               n: int, device: torch.device | str) -> torch.Tensor:  # [B, n] int64
    """64 random bits per (request, draw, index): SplitMix64 of the stream position, a pure
    function of its inputs, computed where `device` is (same bits on CPU and GPU)."""
    keys = keys.to(device=device, dtype=torch.int64)
    draws = draws.to(device=device, dtype=torch.int64)
    row = _mix64(keys + (draws + 1) * _GOLDEN)  # [B]
    idx = torch.arange(1, n + 1, device=device, dtype=torch.int64) * _GOLDEN
    return _mix64(row[:, None] + idx[None, :])


@functools.cache
def has_triton() -> bool:
    """Whether triton is installed (looked up once; importing it is left to the caller)."""
    return importlib.util.find_spec("triton") is not None


def _fused_noise() -> bool:
    return os.environ.get("MEGATRON_TLT_FUSED_NOISE", "1") != "0" and has_triton()


def exponential_noise(keys: torch.Tensor, draws: torch.Tensor, n: int,
                      device: torch.device | str) -> torch.Tensor:  # [B, n] float32
    """Exp(1) noise: -log(U) with U = (53 random bits + 1/2) / 2^53 in (0, 1), in float64,
    rounded to float32 and clamped away from 0 (so p / E is never 0/0). On a CUDA device
    one fused Triton kernel computes the same numbers (rollout/triton_noise.py; off with
    MEGATRON_TLT_FUSED_NOISE=0)."""
    device = torch.device(device)
    if device.type == "cuda" and _fused_noise():
        from megatron_tlt.rollout.triton_noise import exponential_noise_fused
        return exponential_noise_fused(keys.to(device=device, dtype=torch.int64),
                                       draws.to(device=device, dtype=torch.int64), n)
    u = (_srl(noise_bits(keys, draws, n, device), 11).double() + 0.5) * 2.0 ** -53
    return (-torch.log(u)).float().clamp_min_(torch.finfo(torch.float32).tiny)


def uniform_noise(keys: torch.Tensor, draws: torch.Tensor, n: int,
                  device: torch.device | str) -> torch.Tensor:  # [B, n] float32
    """U(0, 1) noise with 24 random bits: (bits + 1/2) / 2^24, exact in float32."""
    return (_srl(noise_bits(keys, draws, n, device), 40).float() + 0.5) * 2.0 ** -24


class NoiseStream:
    """A request's randomness: a key and a count of draws taken. Draw d of the stream is
    a pure function of (key, d) (`noise_bits`), so the same seed gives the same noise
    whatever else is in the batch, on any device, and a batch of requests draws in one
    vectorised call on the GPU (`RolloutEngine.sample_and_append`) instead of one CPU
    generator call per request and token."""

    def __init__(self, key: int):
        self.key = int(key)
        self.draws = 0

    def take(self) -> int:
        """Reserve the next draw number (callers drawing in a batch use this)."""
        d = self.draws
        self.draws += 1
        return d

    def _args(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([self.key]), torch.tensor([self.take()])

    def exponential(self, n: int, device: torch.device | str = "cpu") -> torch.Tensor:  # [n]
        return exponential_noise(*self._args(), n, device)[0]


def make_noise_stream(seed: int, prompt_id, sample_index: int) -> NoiseStream:
    return NoiseStream(request_seed(seed, prompt_id, sample_index))


@dataclasses.dataclass
class SampleOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32, log_softmax(logits / T) before ban/top-k/top-p
    processed_logprobs: torch.Tensor  # [B] float32, under the distribution sampled from


def top_k_top_p_keep(scaled: torch.Tensor,  # [..., vocab] float32: logits / T (ban applied)
                     top_k: torch.Tensor,  # [...] int64, <= 0 disables
                     top_p: torch.Tensor,  # [...] float32, >= 1 disables
                     ) -> torch.Tensor:  # [..., vocab] bool: the tokens that may be sampled
    """The tokens top-k then top-p keep, by rank in the stable descending order of
    `scaled` (equal values: lowest id first): the k first, then of those the ones whose
    mass before them (float32 cumulative sum of the top-k-renormalised distribution) is
    below top_p. Exactly min(k, vocab) tokens pass top-k whatever ties there are at the
    boundary. The one rule for the sampler (`sample`) and for speculative decoding's
    target and draft distributions (spec.sampling_ref.process_logits): bf16 logits tie
    often at a top-k or top-p boundary, so a rule that kept ties would sample another
    distribution there."""
    vocab = scaled.shape[-1]
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=scaled.device)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    keep = rank < k.unsqueeze(-1)
    probs_sorted = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    mass_before = torch.cumsum(probs_sorted, dim=-1) - probs_sorted
    keep &= (mass_before < top_p.unsqueeze(-1)) | (top_p.unsqueeze(-1) >= 1) | (rank == 0)
    return torch.zeros_like(keep).scatter_(-1, order, keep)


def sample(logits: torch.Tensor,  # [B, vocab] float32
           temperature: torch.Tensor,  # [B] float32, 0 = greedy
           top_k: torch.Tensor | None,  # [B] int64, <= 0 disables
           top_p: torch.Tensor | None,  # [B] float32, >= 1 disables
           exp_noise: torch.Tensor,  # [B, vocab] float32 Exp(1) noise (ignored for greedy rows)
           banned: torch.Tensor | None = None,  # [B, vocab] bool, True = may not be sampled
           ) -> SampleOutput:
    """Reference sampler (the spec for a fused GPU sampling kernel).

    top_k = top_p = None: no row filters, known on the host, so the one host sync (does any
    row filter?) is skipped; the other ops are the same (the decode runner's CUDA graph,
    cuda_graphs.py, samples this way)."""
    b, vocab = logits.shape
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits.float() / t[:, None]
    logprobs_all = torch.log_softmax(scaled, dim=-1)
    proc = scaled if banned is None else scaled.masked_fill(banned, float("-inf"))
    if (top_k is None) != (top_p is None):
        raise ValueError("sample: top_k and top_p must both be tensors or both be None")
    needs_filter = (top_k is not None
                    and bool(((top_k > 0) & (top_k < vocab)).any() | (top_p < 1).any()))
    if needs_filter:
        proc = proc.masked_fill(~top_k_top_p_keep(proc, top_k, top_p), float("-inf"))
    # Without a ban or a filter proc is scaled itself: its log_softmax is logprobs_all (the
    # same op on the same tensor, the same bits), not a second pass over [B, vocab].
    proc_logprobs = logprobs_all if proc is scaled else torch.log_softmax(proc, dim=-1)
    greedy_tok = torch.argmax(proc, dim=-1)
    race_tok = torch.argmax(proc_logprobs.exp() / exp_noise, dim=-1)
    tokens = torch.where(greedy, greedy_tok, race_tok)
    lp = logprobs_all.gather(1, tokens[:, None])[:, 0]
    plp = torch.where(greedy, torch.zeros_like(lp), proc_logprobs.gather(1, tokens[:, None])[:, 0])
    return SampleOutput(token_ids=tokens, logprobs=lp, processed_logprobs=plp)


def fused_sample_on(device: torch.device) -> bool:
    """Whether `sample_streams` takes the fused Triton sampler on `device`:
    MEGATRON_TLT_FUSED_SAMPLE unset -> on a CUDA device with triton; 0 -> never; 1 -> also on
    CPU when the kernels run under Triton's interpreter (TRITON_INTERPRET=1: tests)."""
    flag = os.environ.get("MEGATRON_TLT_FUSED_SAMPLE", "")
    if flag == "0" or not has_triton():
        return False
    if device.type == "cuda":
        return True
    return flag == "1" and os.environ.get("TRITON_INTERPRET") == "1"


def sample_streams(logits: torch.Tensor,  # [B, vocab] float32
                   temperature: torch.Tensor,  # [B] float32, 0 = greedy
                   keys: torch.Tensor,  # [B] int64: each row's noise stream (unread for greedy rows)
                   draws: torch.Tensor,  # [B] int64: the draw each sampled row takes
                   *, top_k: torch.Tensor | None = None,  # [B] int64, <= 0 disables
                   top_p: torch.Tensor | None = None,  # [B] float32, >= 1 disables
                   banned: torch.Tensor | None = None,  # [B, vocab] bool
                   ) -> SampleOutput:
    """`sample` with each sampled row's Exp(1) noise drawn from its stream: what every
    engine path calls. On a CUDA device with Triton the rows with no top-k, top-p or ban
    go through the fused sampler (rollout/triton_sample.py: noise drawn in place, three
    launches, its own softmax roundings) and the others, if any, through `sample`; a row's
    result depends only on the row either way. Elsewhere (CPU: the reference),
    or with MEGATRON_TLT_FUSED_SAMPLE=0, `sample` on every row (`fused_sample_on`).

    Without top_k / top_p / banned there is no host sync (capturable)."""
    if (top_k is None) != (top_p is None):
        raise ValueError("sample_streams: top_k and top_p must both be tensors or both be None")
    b, vocab = logits.shape
    dev = logits.device
    unfiltered = top_k is None and banned is None
    if fused_sample_on(dev):
        from megatron_tlt.rollout.triton_sample import sample_fused
        x = logits if logits.dtype == torch.float32 and logits.stride(-1) == 1 else \
            logits.float().contiguous()
        tok, lp, plp = sample_fused(x, temperature.float(), keys.long(), draws.long())
        fused = SampleOutput(token_ids=tok, logprobs=lp, processed_logprobs=plp)
        if unfiltered:
            return fused
        filt = torch.zeros(b, dtype=torch.bool, device=dev)
        if top_k is not None:
            filt |= ((top_k > 0) & (top_k < vocab)) | (top_p < 1)
        if banned is not None:
            filt |= banned.any(dim=-1)
        if not bool(filt.any()):
            return fused
        ref = sample(logits, temperature, top_k, top_p,
                     exponential_noise(keys, draws, vocab, dev), banned)
        return SampleOutput(*(torch.where(filt, r, f) for r, f in
                              ((ref.token_ids, fused.token_ids), (ref.logprobs, fused.logprobs),
                               (ref.processed_logprobs, fused.processed_logprobs))))
    if unfiltered and dev.type == "cuda":  # capturable: noise for every row (greedy rows' unread)
        noise = exponential_noise(keys, draws, vocab, dev)
    else:  # noise for the sampled rows only (on a GPU one host sync: the generic path)
        noise = torch.ones(b, vocab, dtype=torch.float32, device=dev)
        rows = (temperature > 0).nonzero()[:, 0]
        if rows.numel():
            noise[rows] = exponential_noise(keys[rows], draws[rows], vocab, dev)
    return sample(logits, temperature, top_k, top_p, noise, banned)


class StopChecker:
    """Decides after each new token whether a request is finished."""

    def __init__(self, params: SamplingParams, eos_token_ids: Sequence[int],
                 detokenize: Callable[[list[int]], str] | None):
        self.params = params
        self.stop_ids = frozenset(eos_token_ids) | frozenset(params.stop_token_ids)
        self.detokenize = detokenize
        self.max_stop_len = max((len(s) for s in params.stop_strings), default=0)

    def banned_ids(self, num_output: int) -> frozenset[int]:
        """Token ids that may not be sampled as output token number `num_output` (0-based)."""
        return self.stop_ids if num_output < self.params.min_new_tokens else frozenset()

    def check(self, token_ids: list[int], prompt_len: int,
              max_len_reached: bool) -> tuple[str, int | str | None] | tuple[None, None]:
        """(finish_reason, stop_reason) once finished — ('stop', token id | string) or
        ('length', None) — else (None, None). `token_ids` (prompt, then output) includes the
        newest token; only its tail is read (this runs for every generated token, so it
        must not copy the whole output)."""
        n = len(token_ids) - prompt_len
        if n >= self.params.min_new_tokens:
            if token_ids[-1] in self.stop_ids:
                return "stop", token_ids[-1]
            if self.params.stop_strings:  # no tail slice per token without stop strings
                hit = self._stop_string(token_ids, prompt_len)
                if hit is not None:
                    return "stop", hit
        if n >= self.params.max_new_tokens or max_len_reached:
            return "length", None
        return None, None

    def _stop_string(self, token_ids: list[int], prompt_len: int) -> str | None:
        """The stop string the newest token completes, if any. Decodes a tail of the output
        of max_stop_len + 8 tokens, doubled while the text before the newest token is too
        short to hold the start of the longest stop string (tokens of one byte of a
        multi-byte character, or special tokens that decode to nothing) and output is left."""
        start_max = len(token_ids) - 1
        k = self.max_stop_len + 8
        while True:
            start = max(prompt_len, len(token_ids) - k)
            text = self.detokenize(token_ids[start:])
            prev = self.detokenize(token_ids[start:start_max]) if start < start_max else ""
            fresh = len(os.path.commonprefix([prev, text]))  # text[fresh:] came with the newest token
            for s in self.params.stop_strings:
                if s in text[max(0, fresh - len(s) + 1):]:
                    return s
            # slack of 4 characters: a character cut at the tail's start may decode to
            # replacement characters that are not the output's text
            if start == prompt_len or len(prev) >= self.max_stop_len - 1 + 4:
                return None
            k *= 2
