"""The speculative-decoding step of the rollout engine.

`SpecDecoder.step(engine, seqs)` replaces the engine's plain step
(`forward_pending` + `sample_and_append`) for the sequences the scheduler runs:

1. Policy: `choose(batch_size)` gives a Strategy (depth, topk, num_verify_tokens) or None
   (SD off for this step). The default is a fixed strategy with `threshold`: SD only while
   the running batch is <= threshold. The adaptive engine replaces `choose`.
2. Sequences with more than one pending token (first prefill, re-prefill after a
   preemption) and all sequences of an SD-off step decode plainly — exactly the engine's
   plain step. So do sequences whose drafter failed (non-finite outputs: counted as a
   fallback), that got no draft (n-gram without a match), that have fewer than two tokens
   of budget left, or for which the KV pool has no room for the tree.
3. The others: the drafter proposes a tree per sequence (root = the pending token);
   `verify_forward` runs root + drafts with the tree mask; verification
   (megatron_tlt.spec.verify) accepts a root-to-node path and emits one more token
   (recovered or bonus): greedy verification at temperature 0, recursive rejection
   sampling otherwise (sampled chains pass draft_probs; top-k and n-gram trees are
   one-hot proposals, draft_probs=None). `commit_kv` keeps the accepted path's KV.
4. Emitted tokens are appended one at a time with the engine's stop checks; a stop token
   or string, max_new_tokens or max_model_len truncates the rest.

Lossless and reproducible:
- target_probs rows are the target's logits with the min_new_tokens ban (stop ids ->
  -inf for output positions below min_new_tokens), processed by
  sampling_ref.process_logits with the request's temperature/top-k/top-p — the same
  function the drafter's proposals go through, with the plain sampler's top-k / top-p
  rule (rollout.sampling.top_k_top_p_keep: ties at the boundary keep the lowest ids), so
  the verified distribution is the one plain decoding samples from. Greedy verification
  takes the banned logits themselves, so greedy SD emits exactly the plain decode's tokens.
- logprobs follow the engine's definition (sampling.py): log_softmax(logits / T) at the
  node the emitted token was verified at (T = 1 for greedy); processed_logprobs are
  log target_probs (0.0 for greedy).
- Randomness comes only from the request's noise stream, drawn in a fixed order per step:
  draft sampling noise (sampled chains: one [draft_vocab] Exp(1) draw per level), then
  coins [num_nodes] U[0,1), then exp_noise [vocab] Exp(1). Same seed -> same tokens.
  A fallback step is a plain step (one [vocab] draw); when the drafter failed after
  drawing draft noise, that noise is simply skipped (fresh noise stays independent, so
  the distribution is unchanged; the tokens then differ from a run without SD).

Verification fast path: megatron_tlt.spec.verify_math (`VerifyMath`), taken when it
covers the step; other steps take the general path (`_verify_general`).

Deferred drafts (`_deferred`, up to DEFER_MAX_BATCH sequences, i.e. wherever the fast
path verifies; MEGATRON_TLT_SPEC_DEFER=0 turns them off, =N sets the batch limit): when the drafter can
leave a step's drafts on the device (EAGLE chains on the static-buffer path,
`Drafter.launch`), every chain is drafted to full depth and the fast path covers the step,
the verification is prepared on the host with placeholder trees of the chains' shape
while the drafter runs, and the drafted ids are written into the verify forward's and the
verification's inputs on the device: one host sync per step instead of two, and the
device no longer idles while the host builds the verification. Same numbers as reading
the drafts back: the same kernels on the same inputs, the same noise draws (the streams
move past the D draft draws before the verification draws, as a chain that did not fail
does). A row whose drafter failed (non-finite) is verified as its root alone, nothing of
it is kept, its stream is set back to where the read-back path leaves it and it decodes
plainly after the verification (a fallback, as before).

Draft-ahead (`_ahead_fits`, `_launch_ahead`; on by default since it was timed on the
H200 in session 14, MEGATRON_TLT_SPEC_AHEAD=0 or SpecDecoder(draft_ahead=False) turns it
off): a deferred step whose sequences will all
draft a full-depth chain again at the next step (room for depth + 1 more tokens twice,
the same strategy at this batch size, no plain row) queues the next step's drafting
(`Drafter.launch_ahead`) between its verification math and the host's read of it,
building the drafter's inputs on the device from the verification's outputs (accepted
tokens, bonus, the accepted nodes' hidden states); the host's bookkeeping then overlaps
the drafter instead of preceding it. The next step adopts it (`Drafter.adopt`) only when
it is exactly what `launch` would start then (same sequences, states, draws, setting, no
row failed); otherwise it is dropped and the step launches anew, so tokens, logprobs and
noise draws are those of the steps without it.

Verify-ahead (on by default since session 16 timed it on the trained target,
benchmarks/results/gpu_2026-12-04_session16: 1.37x -> 1.49x at batch 16, the batch-32 step
4.34 -> 4.11 and 4.77 -> 4.27 ms, batch 1 and 4 unchanged; MEGATRON_TLT_SPEC_VERIFY_AHEAD=0
or SpecDecoder(verify_ahead=False) turns it off; GPU engines only, a no-op elsewhere):
with the draft-ahead queued, the next step's
verify forward is queued right after it (engine.verify_chains_ahead ->
DecodeRunner.verify_ahead: the verify graph's inputs built on the device from this step's
verification outputs, the KV tables grown on the host to the worst case first), so the
device runs the next draft and verify while the host reads this step's results and does
its bookkeeping. The accepted nodes' hidden states are gathered before either is queued
(the verify-ahead overwrites the verify forward's outputs). The next step uses it only
with the draft-ahead it followed (adopted: the same sequences, states and draws), else it
is dropped (its KV writes lie past every committed entry); the same inputs in the same
buffers, so the same numbers as launching the forward after the bookkeeping.

Drafter interface (`Drafter`): `feature` names the target hidden states it needs
("final" or None); the decoder passes the rows of every newly committed position through
`observe`, in order, plain steps included, so a drafter can catch up lazily when SD turns
on. `propose` returns one DraftTree per sequence; `release` forgets a sequence (preempted:
it will be re-prefilled and re-observed), `finish` is called when it is done.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Callable

import torch

from megatron_tlt.errors import ConfigError
from megatron_tlt.rollout.sampling import exponential_noise, uniform_noise
from megatron_tlt.spec.sampling_ref import process_logits
from megatron_tlt.spec.stats import SpecMetrics, finalize_request_stats, new_request_stats
from megatron_tlt.spec.tree import (DraftTree, Strategy, TreeBatch, TreeBuilder,  # noqa: F401 (re-exported)
                                    parse_depth_schedule, parse_strategy_schedule)
from megatron_tlt.spec.verify import nvtx_range, verify_tree_greedy, verify_tree_rejection
from megatron_tlt.spec.verify_math import GRAPHS_ENV, MATH_MAX_BATCH, VerifyMath, canonical_device

logger = logging.getLogger(__name__)

DEFER_ENV = "MEGATRON_TLT_SPEC_DEFER"
AHEAD_ENV = "MEGATRON_TLT_SPEC_AHEAD"
VERIFY_AHEAD_ENV = "MEGATRON_TLT_SPEC_VERIFY_AHEAD"
DEFER_MAX_BATCH = MATH_MAX_BATCH
"""Deferred drafts by default at every batch the verification fast path takes (larger
batches cannot defer). Session 9 (benchmarks/results/gpu_2026-12-03_session9, before the
draft-ahead) measured reading the drafts back ~8% faster at batch 32 and set the limit to
16, which also kept the draft-ahead (it needs a deferred step) off at batch 32; session 16
(gpu_2026-12-04_session16, tools/host_timeline.py, random 1.5B-shaped weights, depth-4
chains, one process): batch 32 deferred with the draft-ahead 5.21 ms per step, deferred
without it 5.58, read back 6.14; batch 16 4.01 / 4.30 / 4.51."""


class Drafter:
    """Base class of drafters (see the module docstring)."""

    name = "drafter"
    feature: str | None = None
    """Target hidden states the drafter consumes: "final" or None."""

    def bind(self, engine) -> None:
        """Called with the engine before each proposal (settings that follow the engine)."""

    def observe(self, seq, start: int, hidden: torch.Tensor) -> None:
        """hidden [n, hidden]: the target's `feature` states at positions start..start+n-1,
        all committed."""

    def propose(self, seqs: list, strategy: Strategy, caps: list[int], running: list) -> list[DraftTree]:
        """One tree per sequence of `seqs`, rooted at its last token and at most caps[i]
        deep. `running`: every sequence of this step (for drafters that look at others)."""
        raise NotImplementedError

    def launch(self, seqs: list, strategy: Strategy, caps: list[int], running: list):
        """Optional: start a proposal without reading it back (a chain whose drafts stay on
        the device for the verification; eagle_graph.ChainLaunch), or None (then propose)."""
        return None

    def launch_ahead(self, launched, verify_out, gidx: torch.Tensor, hidden: torch.Tensor):
        """Optional: queue the next step's proposal for `launched`'s sequences from the
        verification still on the device (SpecDecoder's draft-ahead), or None. When the
        returned object has device_tokens() ([B, D] drafts on the device, as the adopted
        launch's), SpecDecoder may queue the next verify forward after it too."""
        return None

    def adopt(self, ahead, seqs: list, strategy: Strategy, caps: list[int]):
        """Optional: the launch of a draft-ahead when it is exactly what `launch` would
        start for this step, else None (then launch anew)."""
        return None

    def release(self, seq) -> None:
        """Forget per-sequence state (preemption; the sequence will be re-observed)."""

    def finish(self, seq) -> None:
        """The sequence is done."""
        self.release(seq)

    def reset(self) -> None:
        """Forget every sequence (after an aborted generate)."""


def draft_logprobs(logits: torch.Tensor, params) -> torch.Tensor:
    """Scores for top-k trees: log of the processed draft distribution; at temperature 0
    log_softmax(logits) (T = 1), so a greedy tree still ranks alternatives."""
    if params.temperature <= 0:
        return torch.log_softmax(logits.float(), dim=-1)
    return process_logits(logits, params.temperature, max(params.top_k, 0), params.top_p).log()


def row_param(values: list, device, dtype) -> float | int | torch.Tensor:
    """A sampling parameter of the rows of a batch: the plain number when every row has
    the same value, else a [rows, 1] tensor."""
    if all(v == values[0] for v in values):
        return values[0]
    return torch.tensor(values, dtype=dtype, device=device)[:, None]


class TargetDrafter(Drafter):
    """The target itself as drafter (tests, debugging): drafts are the target's own greedy
    predictions (top-k trees ranked by its log-probs), computed by re-running the whole
    sequence through the engine's model with a private cache. In greedy mode every draft
    on the argmax path is accepted: acceptance length = depth + 1."""

    name = "target"

    def __init__(self, engine):
        from megatron_tlt.rollout.kv_cache import PagedKVCache
        self.engine = engine
        self._cache_cls = PagedKVCache

    def _next_logits(self, tokens: list[int]) -> torch.Tensor:
        from megatron_tlt.rollout.attention import AttentionMetadata
        e = self.engine
        n = len(tokens)
        bs = 16
        cache = self._cache_cls(num_layers=e.arch.num_layers, num_kv_heads=e.arch.num_kv_heads,
                                head_dim=e.arch.head_dim, num_blocks=-(-n // bs), block_size=bs,
                                dtype=e.dtype, device=e.device)
        cache.ensure(0, n)
        pos = torch.arange(n)
        meta = AttentionMetadata(slot_mapping=cache.slots(0, pos),
                                 query_start=torch.tensor([0, n]), context_lens=torch.tensor([n]),
                                 block_tables=torch.tensor([cache.block_table(0)]))
        dev = e.device
        meta = AttentionMetadata(slot_mapping=meta.slot_mapping.to(dev), query_start=meta.query_start.to(dev),
                                 context_lens=meta.context_lens.to(dev), block_tables=meta.block_tables.to(dev))
        out = e.model.forward(torch.tensor(tokens, device=dev), pos.to(dev), cache, meta,
                              logits_indices=torch.tensor([n - 1], device=dev))
        return out.logits[0]

    def propose(self, seqs, strategy, caps, running):
        trees = []
        for seq, cap in zip(seqs, caps):
            b = TreeBuilder(seq.token_ids[-1], strategy, cap)
            paths = {0: []}
            while not b.done:
                rows = []
                for node in b.frontier:
                    rows.append(self._next_logits(seq.token_ids + paths[node]))
                first_new = len(b.tokens)
                b.expand_topk(torch.log_softmax(torch.stack(rows), dim=-1).cpu())
                for i in range(first_new, len(b.tokens)):
                    paths[i] = paths[b.parents[i]] + [b.tokens[i]]
            trees.append(b.result())
        return trees


class BatchSchedulePolicy:
    """SD with a strategy chosen by the running batch size: the first (bound, strategy)
    whose bound is >= the batch size, else the last strategy; none (plain decoding) above
    `threshold`. A shallower chain at larger batches: each draft level costs every running
    sequence a drafter pass and a verified row, so the best depth falls as the batch grows."""

    def __init__(self, schedule: list[tuple[int | None, Strategy]], threshold: int | None = None):
        if not schedule:
            raise ConfigError("spec schedule is empty")
        if threshold is not None and (not isinstance(threshold, int) or threshold < 0):
            raise ConfigError(f"spec threshold must be an integer >= 0 or None, got {threshold!r}")
        self.schedule = list(schedule)
        self.threshold = threshold

    @property
    def strategies(self) -> list[Strategy]:
        return [st for _, st in self.schedule]

    def __call__(self, batch_size: int) -> Strategy | None:
        if self.threshold is not None and batch_size > self.threshold:
            return None
        for bound, st in self.schedule:
            if bound is None or batch_size <= bound:
                return st
        return self.schedule[-1][1]


class ThresholdPolicy(BatchSchedulePolicy):
    """SD with one fixed strategy while the running batch is <= threshold (always if None)."""

    def __init__(self, strategy: Strategy, threshold: int | None = None):
        super().__init__([(None, strategy)], threshold)
        self.strategy = strategy


def depth_policy(depth: str | int, *, topk: int = 1, num_verify_tokens: int | None = None,
                 threshold: int | None = None) -> BatchSchedulePolicy:
    """The policy of a `--spec-depth` value (parse_strategy_schedule) with these tree
    options (an entry's own DxK width overrides topk)."""
    return BatchSchedulePolicy([(b, Strategy(depth=d, topk=topk if k is None else k,
                                             num_verify_tokens=num_verify_tokens))
                                for b, d, k in parse_strategy_schedule(depth)], threshold)


def _env_switch(name: str, default: bool) -> bool:
    """An on/off environment setting: "1" on, "0" off, unset the default; else an error."""
    raw = os.environ.get(name, "1" if default else "0")
    if raw not in ("0", "1"):
        raise ConfigError(f"{name} must be 0 or 1, got {raw!r}")
    return raw == "1"


class SpecDecoder:
    """Speculative decoding for a RolloutEngine: `engine.spec_decoder = SpecDecoder(...)`."""

    def __init__(self, drafter: Drafter, strategy: Strategy | None = None, *,
                 threshold: int | None = None,
                 policy: Callable[[int], Strategy | None] | None = None,
                 metrics: SpecMetrics | None = None, verify_impl: str | None = None,
                 fast_verify: bool = True, verify_graphs: bool | None = None,
                 defer_drafts: bool | int | None = None, draft_ahead: bool | None = None,
                 verify_ahead: bool | None = None):
        """fast_verify: the static-buffer verification path (`VerifyMath`) for the steps it
        covers (False: every step takes the general path). verify_graphs: replay its math
        from CUDA graphs on a CUDA engine; None: unless MEGATRON_TLT_VERIFY_MATH_GRAPHS=0.
        defer_drafts: steps whose drafter can leave its drafts on the device
        (Drafter.launch) verify them there, with no host round trip in between (see
        `_deferred`): True at any batch size, an int N up to N sequences, False never;
        None: MEGATRON_TLT_SPEC_DEFER (0 never, N up to N), default up to
        DEFER_MAX_BATCH. draft_ahead: queue the next step's drafting before reading the
        verification (module docstring); None: MEGATRON_TLT_SPEC_AHEAD (0 off, default 1).
        verify_ahead: with the draft-ahead, also queue the next step's verify forward
        (module docstring); None: MEGATRON_TLT_SPEC_VERIFY_AHEAD (0 off, default 1)."""
        if drafter.feature not in (None, "final"):
            raise ConfigError(f"drafter {drafter.name!r} wants target features {drafter.feature!r}; "
                              f"the engine provides 'final' only")
        self.drafter = drafter
        self.policy = policy or ThresholdPolicy(strategy or Strategy(), threshold)
        self.metrics = metrics or SpecMetrics()
        self.verify_impl = verify_impl
        self.fast_verify = fast_verify
        self.fused_verify_probs: bool | None = None
        """VerifyMath's fused_probs (None: its default, the Triton kernels on CUDA); set
        before the first verification."""
        self.verify_graphs = os.environ.get(GRAPHS_ENV, "1") != "0" if verify_graphs is None else verify_graphs
        if defer_drafts is None:
            raw = os.environ.get(DEFER_ENV, str(DEFER_MAX_BATCH))
            if not raw.isdigit():
                raise ConfigError(f"{DEFER_ENV} must be 0 (off) or a batch size, got {raw!r}")
            defer_drafts = int(raw)
        elif isinstance(defer_drafts, bool):
            defer_drafts = 1 << 30 if defer_drafts else 0
        self.defer_max_batch = int(defer_drafts)
        """Largest batch whose steps verify drafts left on the device (0: never)."""
        self.draft_ahead = _env_switch(AHEAD_ENV, True) if draft_ahead is None else bool(draft_ahead)
        self.verify_ahead = _env_switch(VERIFY_AHEAD_ENV, True) if verify_ahead is None else bool(verify_ahead)
        self._ahead = None  # the draft-ahead queued by the last step, if any
        self._vahead = None  # (draft-ahead, sequence ids, its verify forward) queued after it
        self.num_verify_ahead = 0
        """Verify-aheads queued."""
        self.num_verify_adopted = 0
        """Verify-aheads the next step used as its verify forward (the rest were dropped)."""
        self.num_ahead = 0
        """Draft-aheads queued."""
        self.num_adopted = 0
        """Draft-aheads the next step adopted (the rest were dropped)."""
        self._math: VerifyMath | None = None
        self.num_deferred = 0
        """Steps verified on drafts left on the device (`_deferred`)."""
        self._preemptions: dict[int, int] = {}
        self._warned = False
        self.timings: dict[str, float] | None = None
        """Set to {} to accumulate wall seconds per phase of the step (draft, plain,
        verify_forward, verify: kernels and bookkeeping); the device is synchronised
        around each phase, so use it for breakdowns, not for headline speed."""

    @contextlib.contextmanager
    def _phase(self, name: str, device):
        # Under torch.profiler the phase is a "spec/<name>" range in the trace
        # (tools/trace_gaps.py reads device idle time per phase from it).
        label = (torch.profiler.record_function(f"spec/{name}")
                 if torch.autograd.profiler._is_profiler_enabled else contextlib.nullcontext())
        if self.timings is None:
            with label:
                yield
            return
        sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        try:
            with label:
                yield
        finally:
            sync()
            self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - t0

    def choose(self, batch_size: int) -> Strategy | None:
        return self.policy(batch_size)

    # ---- bookkeeping ------------------------------------------------------------------

    def _track(self, seq) -> None:
        if not seq.spec_stats:
            seq.spec_stats.update(new_request_stats(self.drafter.name))
        seen = self._preemptions.get(seq.seq_id)
        if seen is not None and seen != seq.num_preemptions:
            self.drafter.release(seq)
        self._preemptions[seq.seq_id] = seq.num_preemptions

    def finish(self, seq) -> None:
        if self._ahead is not None and seq.seq_id in self._ahead.seq_ids:
            self._ahead = self._vahead = None
        self._preemptions.pop(seq.seq_id, None)
        self.drafter.finish(seq)
        finalize_request_stats(seq.spec_stats)

    def reset(self) -> None:
        self._ahead = self._vahead = None
        self._preemptions.clear()
        self.drafter.reset()

    def capture_seconds(self) -> float:
        """Wall seconds this decoder's CUDA graphs took to capture (verification math and
        the EAGLE chain and tree graphs), warm-ups included; 0 without graphs (CPU)."""
        t = self._math.capture_s if self._math is not None else 0.0
        for name in ("_chain_graphs", "_tree_graphs"):
            g = getattr(self.drafter, name, None)
            t += g.capture_s if g is not None else 0.0
        return t

    def release_verify_graphs(self) -> None:
        """Free the verification fast path's graphs and buffers (e.g. while the engine
        sleeps); they are rebuilt at the next verify."""
        if self._math is not None:
            self._math.release()

    def verify_math(self, engine) -> VerifyMath | None:
        """The fast path's state for this engine (None when fast_verify is off)."""
        if not self.fast_verify:
            return None
        m = self._math
        if m is None or m.device != canonical_device(engine.device) or m.vocab != engine.arch.vocab_size:
            m = self._math = VerifyMath(engine.device, engine.arch.vocab_size,
                                        use_graphs=self.verify_graphs, impl=self.verify_impl,
                                        fused_probs=self.fused_verify_probs)
        return m

    def _depth_cap(self, engine, seq) -> int:
        """Deepest draft the step may verify: its depth + 1 positions within max_model_len.
        Not capped by max_new_tokens: the emitted tokens stop there anyway (append_token
        finishes the sequence; the rest of the accepted path is dropped with it, and every
        emitted token is still one the target would sample), while a capped chain takes
        the whole batch off the deferred path (full-depth chains only) for that step. On
        the H200 (session 20, batch 32, 256 tokens each) the steps after the first
        sequence finished took 4.75 ms on average against a 3.39 ms median step."""
        return engine.max_model_len - len(seq.token_ids) - 1

    # ---- the step ---------------------------------------------------------------------

    def step(self, engine, seqs: list, strategy: Strategy | None = None) -> None:
        """One engine step for `seqs`. `strategy` (a per-call override) replaces the
        policy's strategy but not its on/off decision."""
        bsz = len(seqs)
        chosen = self.choose(bsz)
        strategy = None if chosen is None else (strategy or chosen)
        for s in seqs:
            self._track(s)
        plain, cand, caps = [], [], []
        for s in seqs:
            cap = self._depth_cap(engine, s) if strategy is not None else 0
            if strategy is None or s.num_pending != 1 or cap < 1:
                plain.append(s)
            else:
                cand.append(s)
                caps.append(cap)
        spec, fallbacks, launched = [], 0, None
        vahead, self._vahead = self._vahead, None  # the last step's verify-ahead: this step's or none
        if cand:
            with self._phase("draft", engine.device), nvtx_range("spec/draft", engine.device):
                self.drafter.bind(engine)
                ahead, self._ahead, launched = self._ahead, None, None
                if len(cand) <= self.defer_max_batch:
                    if ahead is not None:
                        launched = self.drafter.adopt(ahead, cand, strategy, caps)
                        self.num_adopted += launched is not None
                    if launched is None or vahead is None or vahead[0] is not ahead:
                        vahead = None  # queued after a draft-ahead this step did not adopt
                    if launched is None:
                        launched = self.drafter.launch(cand, strategy, caps, seqs)
                if launched is not None:
                    spec = self._deferred(engine, launched)
                    if spec is None:  # not this step: read the drafts back now
                        trees, launched, spec, vahead = launched.collect(), None, [], None
                else:
                    trees = self.drafter.propose(cand, strategy, caps, seqs)
            if launched is None:
                for s, t, cap in zip(cand, trees, caps):
                    if t.fallback_reason is not None:
                        fallbacks += 1
                        self._fallback(s, t.fallback_reason)
                        plain.append(s)
                    elif t.num_drafts == 0:
                        plain.append(s)
                    else:
                        spec.append((s, t.truncate_depth(cap)))
                spec = self._reserve(engine, spec, plain)
        if plain:
            with self._phase("plain", engine.device):
                self._plain(engine, plain)
        verified = drafted = accepted = emitted = 0
        if spec:
            ahead = (self.draft_ahead and launched is not None and not plain
                     and self._ahead_fits(engine, spec, launched.depth))
            verified, drafted, accepted, emitted, failed = self._verify(engine, spec, launched, ahead, vahead)
            if failed:  # the drafter failed on the device (deferred step): decode them plainly
                for s in failed:
                    self._fallback(s, "non-finite drafter logits")
                with self._phase("plain", engine.device):
                    self._plain(engine, failed)
                fallbacks += len(failed)
                plain.extend(failed)
        self.metrics.record_step(bsz, strategy=None if strategy is None else strategy.as_dict(),
                                 num_drafts=verified, drafted=drafted, accepted=accepted,
                                 emitted=emitted + len(plain), fallbacks=fallbacks,
                                 plain_seqs=len(plain))

    def _fallback(self, seq, reason: str) -> None:
        seq.spec_stats["fallbacks"] += 1
        if not self._warned:
            self._warned = True
            logger.warning("drafter %s failed (%s); decoding those sequences plainly "
                           "(counted as fallbacks)", self.drafter.name, reason)

    def _deferred(self, engine, launched) -> list | None:
        """The step's (sequence, tree) pairs when its verification can read the drafts on
        the device (no host round trip between drafting and verifying: the host prepares
        the verification while the drafter runs): full-depth chains, the verification fast
        path, KV room for every tree. The trees are placeholders of the chains' shape
        (ChainLaunch.placeholder_trees). None: read the drafts back (the usual step)."""
        if not launched.full_depth:
            return None
        trees = launched.placeholder_trees()
        seqs = launched.seqs
        plan = None if self.verify_math(engine) is None else VerifyMath.plan(seqs, trees, engine.arch.vocab_size)
        if plan is None:
            return None
        q = launched.depth + 1
        if not all(engine.cache.ensure(s.seq_id, s.num_computed + q) for s in seqs):
            return None
        launched.advance_draws()
        launched.queue_failures()
        launched.plan = plan
        self.num_deferred += 1
        return list(zip(seqs, trees))

    def _reserve(self, engine, spec, plain):
        """Room in the KV pool for every tree (padded to one size); others decode plainly."""
        while spec:
            q = max(len(t.tokens) for _, t in spec)
            ok = []
            for s, t in spec:
                if engine.cache.ensure(s.seq_id, s.num_computed + q):
                    ok.append((s, t))
                else:
                    plain.append(s)
            if len(ok) == len(spec):
                return ok
            spec = ok
        return spec

    def _plain(self, engine, seqs) -> None:
        feature = self.drafter.feature
        starts = [s.num_computed for s in seqs]
        counts = [s.num_pending for s in seqs]
        out = engine.forward_pending(seqs, return_hidden=feature is not None)
        if feature is not None:
            h = out.hidden_final
            off = 0
            for s, lo, n in zip(seqs, starts, counts):
                self.drafter.observe(s, lo, h[off:off + n])
                off += n
        for s in seqs:
            s.spec_stats["plain_steps"] += 1
        engine.sample_and_append(seqs, out.logits)

    @staticmethod
    def _ahead_fits(engine, spec, depth: int) -> bool:
        """Whether every sequence of this deferred step (all of the step's sequences) will
        draft a full-depth chain again at the next step whatever it accepts now: this step
        emits at most depth + 1 tokens and cannot reach max_new_tokens, and the next has
        room for depth + 1 more positions (the same batch size picks the same strategy).
        Then the step queues a draft-ahead (a stop token may still end a sequence: the
        next step then drops it)."""
        for s, _ in spec:
            left = s.request.sampling_params.max_new_tokens - s.num_output
            if left < depth + 2 or engine.max_model_len - len(s.token_ids) < 2 * depth + 2:
                return False
        return True

    def _launch_ahead(self, engine, launched, verify_out, gidx, hidden) -> None:
        """VerifyMath.run's callback: queue the next step's drafting (Drafter.launch_ahead)
        and, with verify_ahead, the next step's verify forward after it
        (engine.verify_chains_ahead), before the host reads this verification."""
        launched.keep_ints()  # settle may read this step's drafts after the next replay
        self._ahead = ahead = self.drafter.launch_ahead(launched, verify_out, gidx, hidden)
        self.num_ahead += ahead is not None
        if ahead is None or not self.verify_ahead or not hasattr(ahead, "device_tokens"):
            return
        out = engine.verify_chains_ahead(launched.seqs, launched.depth, ahead.device_tokens(),
                                         verify_out.accept_length, verify_out.output_tokens,
                                         return_hidden=True)
        if out is not None:
            self._vahead = (ahead, [s.seq_id for s in launched.seqs], out)
            self.num_verify_ahead += 1

    def _verify(self, engine, spec, launched=None, ahead: bool = False,
                vahead=None) -> tuple[int, int, int, int, list]:
        """Verify, commit and append: (sequences verified, drafted, accepted, emitted,
        sequences whose deferred drafts failed: not committed, for a plain step).
        vahead: the last step's verify-ahead, this step's verify forward when `launched`
        is the draft-ahead it was queued after (adopted) for the same sequences."""
        seqs = [s for s, _ in spec]
        trees = [t for _, t in spec]
        vocab = engine.arch.vocab_size
        math = self.verify_math(engine)
        if launched is not None:
            plan = launched.plan  # _deferred's, for these trees
        else:
            plan = VerifyMath.plan(seqs, trees, vocab) if math is not None else None
        drafts = None if launched is None else launched.device_tokens()
        if drafts is not None and plan is None:
            raise AssertionError("deferred drafts need the verification fast path")
        if launched is not None:  # chains of one depth, drafts on the device: no tree batch
            # (the verification reads the draft distributions in the drafter's buffer)
            batch = None
            with self._phase("verify_forward", engine.device):
                if vahead is not None and vahead[1] == [s.seq_id for s in seqs]:
                    out = engine.adopt_verify_ahead(seqs, launched.depth, vahead[2])
                    self.num_verify_adopted += 1
                else:
                    out = engine.verify_chains_output(seqs, launched.depth, drafts[0], return_hidden=True)
            bsz, q = len(seqs), launched.depth + 1
        else:
            root_pos = [len(s.token_ids) - 1 for s in seqs]
            probs_out = math.draft_probs_buffer(plan) if plan is not None and plan.mode == "sampled" else None
            batch = TreeBatch.pack(trees, root_pos, vocab, probs_out=probs_out)
            with self._phase("verify_forward", engine.device):
                out = engine.verify_forward_output(seqs, batch.query_tokens, batch.positions,
                                                   batch.tree_mask, return_hidden=True)
            bsz, q = batch.parents.shape
        feature = self.drafter.feature
        kinds = {k for k in [feature] + [s.request.return_hidden_states for s in seqs] if k is not None}
        hid = {"final": out.hidden_final, "pre_norm": out.hidden_pre_norm}
        picked = {}  # the accepted nodes' hidden states, gathered once for every sequence

        def ahead_cb(vo, g):
            # The gather is queued before the draft-ahead and the verify-ahead: the latter
            # overwrites the verify forward's static outputs. g [bucket, Q]: sequence b's
            # accepted rows start at b * Q.
            picked.update({k: hid[k].view(bsz * q, -1)[g[:bsz].reshape(-1)] for k in kinds})
            self._launch_ahead(engine, launched, vo, g, out.hidden_final)

        with self._phase("verify", engine.device), nvtx_range("spec/verify", engine.device):
            if plan is not None:
                host_rows, gidx = math.run(plan, seqs, trees, out.logits, drafts=drafts,
                                           draft_probs=None if launched is None else launched.out.get("probs"),
                                           ahead=ahead_cb if ahead else None)
                width = q
            else:
                host_rows = self._verify_general(seqs, batch, out.logits.view(bsz, q, vocab))
                width, gidx = batch.max_depth + 1, None
        failed = launched.settle() if launched is not None else [False] * bsz
        if any(failed):
            # a failed row decodes plainly: not what the draft-ahead assumed
            self._ahead = self._vahead = None
        paths = []  # accepted nodes (host rows are floats: one int() per value read)
        for row in host_rows:
            paths.append(list(map(int, row[:int(row[width]) + 1])))
        offs = [b * width for b in range(bsz)]
        if kinds and not picked:  # (the draft-ahead's callback gathered them already)
            if gidx is not None:  # [B, width] on the device: sequence b's rows start at b * width
                index = gidx.reshape(-1)
            else:
                rows_of = []
                for b, path in enumerate(paths):
                    offs[b] = len(rows_of)
                    rows_of.extend(b * q + j for j in path)
                index = torch.tensor(rows_of, device=out.logits.device)
            picked = {k: hid[k].view(bsz * q, -1)[index] for k in kinds}
        verified = drafted = accepted = emitted = 0
        for b, s in enumerate(seqs):
            if failed[b]:
                engine.commit_kv(s, [])  # nothing kept: the plain step recomputes the root
                continue
            path = paths[b]
            acc = len(path) - 1
            row = host_rows[b]
            toks = list(map(int, row[width + 1:width + 2 + acc]))
            lp_b = row[2 * width + 1:3 * width + 1]
            plp_b = row[3 * width + 1:4 * width + 1]
            root_pos = len(s.token_ids) - 1
            engine.commit_kv(s, path)
            off = offs[b]
            if feature is not None:
                self.drafter.observe(s, root_pos, picked[feature][off:off + acc + 1])
            n_emit = 0
            for j, tok in enumerate(toks):
                n_emit += 1
                if engine.append_token(s, tok, lp_b[j], plp_b[j]):
                    break
            kind = s.request.return_hidden_states
            if kind is not None:  # one row per emitted token (a stop token may end the path early)
                s.hidden.append(picked[kind][off:off + n_emit].clone())
            s.spec_stats["num_drafts"] += 1
            s.spec_stats["drafted"] += trees[b].num_drafts
            s.spec_stats["accepted"] += acc
            verified += 1
            drafted += trees[b].num_drafts
            accepted += acc
            emitted += n_emit
        return verified, drafted, accepted, emitted, [s for s, f in zip(seqs, failed) if f]

    def _verify_general(self, seqs, batch: TreeBatch,
                        raw: torch.Tensor,  # [B, Q, vocab] the verify forward's logits
                        ) -> list[list[float]]:
        """Verification of any step (mixed greedy and sampled rows, top-k, top-p, the
        min_new_tokens ban): host rows [B][4W + 1] with W = max_depth + 1 (accept_index,
        accept_length, output tokens, logprobs, processed logprobs)."""
        bsz, q, vocab = raw.shape
        depth = batch.positions - batch.positions[:, :1]
        logits = self._ban(seqs, raw, depth)
        params = [s.request.sampling_params for s in seqs]
        dev = logits.device
        parents, draft_tokens = batch.parents.to(dev), batch.draft_tokens.to(dev)
        width = batch.max_depth + 1
        accept_index = torch.zeros(bsz, width, dtype=torch.int64, device=dev)
        accept_len = torch.zeros(bsz, dtype=torch.int64, device=dev)
        out_tokens = torch.zeros(bsz, width, dtype=torch.int64, device=dev)
        # Processed log-probs of the emitted tokens (0.0 for greedy rows, as the plain sampler).
        plp = torch.zeros(bsz, width, dtype=torch.float64, device=dev)
        g = [i for i, p in enumerate(params) if p.temperature <= 0]
        sm = [i for i, p in enumerate(params) if p.temperature > 0]
        if g:
            gd = torch.tensor(g, device=dev) if len(g) < bsz else slice(None)
            r = verify_tree_greedy(parents[gd], draft_tokens[gd], logits[gd].contiguous(),
                                   max_depth=batch.max_depth, impl=self.verify_impl)
            accept_index[gd], accept_len[gd], out_tokens[gd] = (
                r.accept_index, r.accept_length, r.output_tokens)
        if sm:
            smd = torch.tensor(sm, device=dev) if len(sm) < bsz else slice(None)
            # Plain numbers when every row agrees (no per-row tensors, no sorts for
            # disabled top-k/top-p); the probabilities are the same either way.
            temp = row_param([float(params[i].temperature) for i in sm], dev, torch.float32)
            top_k = row_param([max(int(params[i].top_k), 0) for i in sm], dev, torch.int64)
            top_p = row_param([float(params[i].top_p) for i in sm], dev, torch.float32)
            probs = process_logits(logits[smd], temp, top_k, top_p)
            # One batched draw each (a stream's draw d is the same values however many
            # are taken): coins past a sequence's node count are unused, set to 0.5.
            streams = [seqs[i].rng for i in sm]
            keys = torch.tensor([r.key for r in streams])
            coins = uniform_noise(keys, torch.tensor([r.take() for r in streams]), q, "cpu")
            nodes = torch.tensor([batch.num_nodes[i] for i in sm])
            coins[torch.arange(q)[None, :] >= nodes[:, None]] = 0.5
            noise = exponential_noise(keys, torch.tensor([r.take() for r in streams]), vocab, dev)
            dp = None
            if batch.draft_probs is not None:
                dp = batch.draft_probs.to(dev)[smd].contiguous()
            r = verify_tree_rejection(parents[smd], draft_tokens[smd], probs, dp,
                                      coins.to(dev), noise.to(dev), max_depth=batch.max_depth,
                                      impl=self.verify_impl)
            accept_index[smd], accept_len[smd], out_tokens[smd] = (
                r.accept_index, r.accept_length, r.output_tokens)
            rows = torch.arange(len(sm), device=dev)[:, None]
            plp[smd] = probs[rows, r.accept_index.clamp(min=0),
                             r.output_tokens.clamp(min=0)].log().double()
        # Reported logprobs: log_softmax(logits / T) before the min_new_tokens ban, at the
        # node each emitted token was verified at (T = 1 for greedy), as the plain sampler
        # reports them.
        t_eff = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params],
                             dtype=torch.float32, device=dev)
        node = accept_index.clamp(min=0)
        b_idx = torch.arange(bsz, device=dev)[:, None]
        lps = torch.log_softmax(raw[b_idx, node].float() / t_eff[:, None, None], dim=-1)
        lp = lps.gather(-1, out_tokens.clamp(min=0)[:, :, None])[:, :, 0]
        # One device-to-host transfer for the whole step.
        return torch.cat([accept_index.double(), accept_len[:, None].double(),
                          out_tokens.double(), lp.double(), plp], 1).cpu().tolist()

    @staticmethod
    def _ban(seqs, logits, depth):
        """Stop ids -> -inf at output positions below min_new_tokens (the plain sampler's
        ban), per node by its depth."""
        # banned_ids(n) is empty for every n >= min_new_tokens: a sequence without a ban at
        # its root's output position has none at any node (and costs no tensor op).
        todo = [b for b, s in enumerate(seqs) if s.stop.banned_ids(len(s.token_ids) - s.prompt_len)]
        if not todo:
            return logits
        out = logits.clone()
        max_depth = depth.max(1).values.tolist()
        for b in todo:
            s = seqs[b]
            n_out = len(s.token_ids) - s.prompt_len
            for d in range(int(max_depth[b]) + 1):
                ban = s.stop.banned_ids(n_out + d)
                if ban:
                    rows = (depth[b] == d).nonzero().squeeze(1)
                    idx = torch.tensor(sorted(ban))
                    out[b, rows[:, None], idx[None, :]] = float("-inf")
        return out
