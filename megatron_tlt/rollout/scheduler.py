"""Continuous batching: which sequences run each step, and preemption by recompute.

A `Sequence` is one request in flight. Its tokens are `token_ids` (prompt + output);
`num_computed` of them have their KV committed in the cache. Every scheduled sequence
runs its *pending* tokens `token_ids[num_computed:]` in one varlen forward: the whole
prompt when it is first admitted, one token per decode step, prompt + output after a
preemption. The logits of its last pending token give its next token — so a resumed
sequence samples exactly the token its next decode would have sampled, and
recomputation draws no randomness.

Policy, each step:
1. Every running sequence (oldest first) gets room for its pending tokens. When the pool
   is short, the most recently admitted running sequence is preempted: its blocks are
   freed, `num_computed` is reset to 0 and it goes to the front of the waiting queue.
2. Unless something was preempted this step, waiting sequences are admitted in FIFO
   order while a slot (`max_num_seqs`), their blocks and the step's token budget allow.
   Admission never skips the head of the queue (no starvation of long prompts).

Progress is guaranteed because the engine rejects a request that could not fit in the
whole pool on its own (prompt + max_new_tokens).
"""

from __future__ import annotations

import collections
import dataclasses
import enum

import torch

from megatron_tlt.rollout.kv_cache import PagedKVCache
from megatron_tlt.rollout.request import Request
from megatron_tlt.rollout.sampling import NoiseStream, StopChecker


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False, kw_only=True)
class Sequence:
    seq_id: int
    request: Request
    index: int
    """Position in the `generate` batch (results come back in request order)."""
    token_ids: list[int]
    prompt_len: int
    rng: NoiseStream
    """The request's randomness (sampling.py); kept across preemption."""
    stop: StopChecker
    policy_version: int
    num_computed: int = 0
    status: SeqStatus = SeqStatus.WAITING
    admit_order: int = -1
    logprobs: list[float] = dataclasses.field(default_factory=list)
    processed_logprobs: list[float] = dataclasses.field(default_factory=list)
    hidden: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """Hidden-state chunks for positions 0..num_computed-1, in order (cleared on preemption)."""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    pending_verify: int = 0
    """Number of uncommitted KV entries written by the last verify_forward."""
    spec_stats: dict = dataclasses.field(default_factory=dict)
    """Speculative-decoding counters (megatron_tlt.spec.stats); empty while SD is off."""

    @property
    def output_ids(self) -> list[int]:
        """A copy of the output tokens (use num_output for the count)."""
        return self.token_ids[self.prompt_len:]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_pending(self) -> int:
        return len(self.token_ids) - self.num_computed


@dataclasses.dataclass
class ScheduledStep:
    seqs: list[Sequence]
    """Sequences to run this step, each with all its pending tokens."""
    preempted: list[Sequence]
    num_tokens: int


class Scheduler:
    def __init__(self, cache: PagedKVCache, *, max_num_seqs: int, max_num_batched_tokens: int):
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # admission order, oldest first
        self._admit_counter = 0
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        seq.status = SeqStatus.FINISHED
        self.running.remove(seq)
        self.cache.free(seq.seq_id)

    def abort_all(self) -> None:
        """Free every sequence's blocks (after an exception)."""
        for seq in list(self.running) + list(self.waiting):
            self.cache.free(seq.seq_id)
        self.running.clear()
        self.waiting.clear()

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.free(seq.seq_id)
        seq.num_computed = 0
        seq.hidden.clear()
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> ScheduledStep:
        preempted: list[Sequence] = []
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            while not self.cache.ensure(seq.seq_id, len(seq.token_ids)):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
        num_tokens = sum(s.num_pending for s in self.running)
        if not preempted:
            while self.waiting and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                n = seq.num_pending
                if self.running and num_tokens + n > self.max_num_batched_tokens:
                    break
                if not self.cache.ensure(seq.seq_id, len(seq.token_ids)):
                    break
                self.waiting.popleft()
                seq.status = SeqStatus.RUNNING
                seq.admit_order = self._admit_counter
                self._admit_counter += 1
                self.running.append(seq)
                num_tokens += n
        return ScheduledStep(seqs=list(self.running), preempted=preempted, num_tokens=num_tokens)
