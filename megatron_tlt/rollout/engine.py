"""RolloutEngine: continuous-batching generation over the paged KV cache.

`generate(requests)` is the whole API most callers need. Its step is split into parts
that a speculative-decoding step reuses (draft -> `verify_forward` -> accept ->
`commit_kv` -> append tokens):

- `forward_pending(seqs)`: run every pending token of each sequence (prefill, decode or
  re-prefill; one varlen forward) and return the logits of each sequence's last token;
- `sample_and_append(seqs, logits)`: one token per sequence from its own generator, then
  the stop checks;
- `verify_forward(seqs, query_tokens, positions, tree_mask)`: Q query tokens per sequence
  with an explicit mask among them and full attention to the committed prefix; their KV
  is written to the Q cache positions after the committed ones, uncommitted;
- `commit_kv(seq, accepted)`: move the accepted entries to contiguous positions and
  drop the rest;
- `append_token(seq, token, logprob, processed_logprob)`: append one token and run the
  stop checks (shared by the plain and the speculative step).

Speculative decoding plugs in as `spec_decoder` (megatron_tlt.spec.decode.SpecDecoder):
when set, each step's sequences go through `spec_decoder.step(engine, seqs)`, which
decodes some plainly (the two calls above) and speculates on the others.

Bad requests are rejected one by one (`Result.error`, `finish_reason="error"`), before any
work starts, and never affect the other requests of the batch.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from typing import Callable, Mapping, Sequence as Seq

import torch

from megatron_tlt.errors import ConfigError, TLTError
from megatron_tlt.models.arch import ModelArch
from megatron_tlt.rollout.attention import AttentionMetadata, make_backend
from megatron_tlt.rollout.host import int64_tensor, limit_host_threads, to_device
from megatron_tlt.rollout.kv_cache import PagedKVCache
from megatron_tlt.rollout.model import ForwardOutput, InferenceModel
from megatron_tlt.rollout.request import HIDDEN_KINDS, Request, Result
from megatron_tlt.rollout.sampling import (SamplingParams, StopChecker, has_triton,
                                           make_noise_stream, sample_streams)
from megatron_tlt.rollout.scheduler import Scheduler, Sequence
from megatron_tlt.rollout.weights import EngineWeights

FUSED_PREFILL_ENV = "MEGATRON_TLT_FUSED_PREFILL"


def fast_path_options(device: torch.device | str) -> dict:
    """RolloutEngine keyword arguments for a job's engine on `device`: on CUDA the Triton
    attention backend with CUDA-graph decode (the fast path `bench rollout` measures);
    elsewhere the torch backend (the reference; its paged attention loops over sequences
    in Python, fine for tiny CPU models, far too slow for a GPU rollout)."""
    if torch.device(device).type != "cuda" or not has_triton():
        return {}
    return {"attention_backend": "triton", "cuda_graphs": True}


@dataclasses.dataclass
class Progress:
    num_done: int
    """Requests finished (rejected ones included)."""
    num_total: int
    num_generated_tokens: int
    elapsed_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


class RolloutEngine:
    def __init__(self, arch: ModelArch, weights: EngineWeights, *, max_num_seqs: int = 64,
                 num_blocks: int = 1024, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 max_model_len: int | None = None, max_num_batched_tokens: int = 8192,
                 eos_token_ids: Seq[int] = (), detokenize: Callable[[list[int]], str] | None = None,
                 seed: int = 0, attention_backend: str = "torch",
                 batch_invariant: bool | None = None, spec_decoder=None,
                 cuda_graphs: bool = False, cuda_graph_batch_sizes: Seq[int] | None = None):
        """
        max_model_len: longest prompt + output (default: the model's max_position_embeddings).
        max_num_batched_tokens: prefill token budget per step (a lone prompt may exceed it).
        eos_token_ids: stop every request (with each request's stop_token_ids).
        detokenize: token ids -> text, needed only by requests with stop_strings.
        seed: used by requests whose SamplingParams.seed is None.
        batch_invariant: fixed-shape matmul tiles so tokens do not depend on the batch
            (default: on for CPU).
        spec_decoder: a megatron_tlt.spec.decode.SpecDecoder (None: plain decoding).
        cuda_graphs: decode steps replay CUDA graphs (needs attention_backend="triton" on
            CUDA); cuda_graph_batch_sizes: the graph buckets (default 1, 2, 4, ..., 128).
        On a CUDA device the process's torch intra-op CPU threads are set to one
        (rollout.host.limit_host_threads; MEGATRON_TLT_HOST_THREADS overrides).
        """
        device = torch.device(device)
        if device.type == "cuda":
            limit_host_threads()
        if weights.dtype != dtype:
            raise ConfigError(f"engine dtype {dtype} differs from the weights' dtype {weights.dtype}")
        if weights.device.type != device.type:
            raise ConfigError(f"engine device {device} differs from the weights' device {weights.device}")
        for name, value in (("max_num_seqs", max_num_seqs), ("num_blocks", num_blocks),
                            ("block_size", block_size),
                            ("max_num_batched_tokens", max_num_batched_tokens)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"rollout {name} must be an integer >= 1, got {value!r}")
        max_model_len = arch.max_position_embeddings if max_model_len is None else max_model_len
        if not 1 <= max_model_len <= arch.max_position_embeddings:
            raise ConfigError(f"max_model_len ({max_model_len}) must be in [1, max_position_embeddings "
                              f"({arch.max_position_embeddings})]")
        for tok in eos_token_ids:
            if not 0 <= tok < arch.vocab_size:
                raise ConfigError(f"eos token id {tok} is outside the vocabulary [0, {arch.vocab_size})")
        self.arch = arch
        self.weights = weights
        self.dtype = dtype
        self.device = device
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        self.detokenize = detokenize
        self.seed = seed
        if batch_invariant is None:
            batch_invariant = device.type == "cpu"
        self.model = InferenceModel(arch, weights, max_positions=max_model_len,
                                    attention=make_backend(attention_backend, precise=batch_invariant),
                                    batch_invariant=batch_invariant)
        _check_kv_fits(arch, num_blocks, block_size, dtype, device)
        self.cache = PagedKVCache(num_layers=arch.num_layers, num_kv_heads=arch.num_kv_heads,
                                  head_dim=arch.head_dim, num_blocks=num_blocks,
                                  block_size=block_size, dtype=dtype, device=device)
        self.decode_runner = None
        """GPU decode fast path (rollout/cuda_graphs.py), with attention_backend="triton"."""
        if attention_backend == "triton":
            from megatron_tlt.rollout.cuda_graphs import DecodeRunner
            self.decode_runner = DecodeRunner(self.model, self.cache, max_num_seqs=max_num_seqs,
                                              max_model_len=max_model_len, use_graphs=cuda_graphs,
                                              batch_sizes=cuda_graph_batch_sizes)
        elif cuda_graphs:
            raise ConfigError(f"cuda_graphs=True needs attention_backend='triton', "
                              f"got {attention_backend!r}")
        self.fused_prefill = os.environ.get(FUSED_PREFILL_ENV, "1") != "0"
        """Prefill through the decode runner's fused kernels (`DecodeRunner.extend`) where
        verifies take them (`_fused_verify`); MEGATRON_TLT_FUSED_PREFILL=0 takes the generic
        forward instead. On by default since session 15 timed it on the H200 (random
        1.5B-shaped weights, tools/prefill_ab.py): 2.0x / 2.95x / 6.3x / 10.6x faster at
        batch 1 / 4 / 16 / 32 with 80-160-token prompts, 1.9-2.25x with 1-2k-token ones,
        the decode steps after it unchanged; float32 equal to the generic path within
        1e-5, bfloat16 within twice the generic path's rounding (tests/gpu)."""
        self.scheduler = Scheduler(self.cache, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens)
        self._seq_ids = itertools.count()
        self.spec_decoder = spec_decoder
        self._spec_strategy = None  # per-generate-call override of the decoder's policy
        self.num_appended = 0
        """Tokens appended by this engine so far (all requests, all calls)."""
        self._chain_masks: dict[tuple[int, int], torch.Tensor] = {}  # causal [B, Q, Q] masks
        self.step_log: list[tuple[int, float]] = []
        """(sequences the step ran, wall seconds) of every step of the last generate call:
        the time per running-batch size and the long tail's share of it (rl/loop.py)."""

    # ---- weights and memory -----------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self.weights.version

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """In-place policy update (HF names); see EngineWeights.update_weights."""
        self.weights.update_weights(named_tensors, version)

    def capture_seconds(self) -> float:
        """Wall seconds spent so far capturing CUDA graphs (decode, sampling, verify forwards,
        and the speculative decoder's), warm-ups included: on a first call Triton compiles
        its kernels and the linear planner times its candidates there. One-time work per
        process or per wake (sleep drops the decode graphs), inside whatever generate call
        meets it; 0 on CPU."""
        t = self.decode_runner.capture_s if self.decode_runner is not None else 0.0
        return t + (self.spec_decoder.capture_seconds() if self.spec_decoder is not None else 0.0)

    def sleep(self) -> None:
        """Release the KV cache memory (only between generate calls). Decode CUDA graphs
        hold the pool's address: they are dropped here and recaptured at the next decode;
        so are the speculative decoder's verification buffers and graphs (hundreds of MB
        of [batch x tree nodes x vocabulary] rows on real vocabularies)."""
        self.cache.check_idle()  # before the graphs go: a refused sleep leaves them
        if self.decode_runner is not None:
            self.decode_runner.release()
        if self.spec_decoder is not None:
            self.spec_decoder.release_verify_graphs()
        self.cache.sleep()

    def wake(self) -> None:
        self.cache.wake()

    # ---- requests -----------------------------------------------------------------------

    def check_request(self, req: Request) -> None:
        """Raise TLTError saying what is wrong with `req` (without naming it)."""
        if not isinstance(req, Request):
            raise TLTError(f"expected a Request, got {type(req).__name__}")
        v = self.arch.vocab_size
        ids = req.prompt_token_ids
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        if not isinstance(ids, (list, tuple)):
            raise TLTError(f"prompt_token_ids must be a list of integers, got {type(ids).__name__}")
        if not ids:
            raise TLTError("prompt is empty (no prompt tokens)")
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool):
                raise TLTError(f"prompt token id {t!r} at index {i} is not an integer")
            if not 0 <= t < v:
                raise TLTError(f"prompt token id {t!r} at index {i} is outside the vocabulary [0, {v})")
        try:  # the request's seed hashes it (sampling.request_seed)
            str(req.prompt_id).encode("utf-8")
        except UnicodeEncodeError:
            raise TLTError(f"prompt_id {req.prompt_id!r} is not valid Unicode text (an unpaired "
                           f"surrogate)") from None
        si = req.sample_index
        if not isinstance(si, int) or isinstance(si, bool) or si < 0:
            raise TLTError(f"sample_index must be an integer >= 0, got {si!r}")
        params = req.sampling_params
        if not isinstance(params, SamplingParams):
            raise TLTError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.check(v)
        if params.stop_strings and self.detokenize is None:
            raise TLTError("stop_strings need a tokenizer, but the engine has no detokenize function")
        if req.return_hidden_states not in (None,) + HIDDEN_KINDS:
            raise TLTError(f"return_hidden_states must be None, 'final' or 'pre_norm', "
                           f"got {req.return_hidden_states!r}")
        total = len(ids) + params.max_new_tokens
        if total > self.max_model_len:
            raise TLTError(f"prompt length {len(ids)} + max_new_tokens {params.max_new_tokens} = "
                           f"{total} exceeds max_model_len {self.max_model_len}")
        blocks = self.cache.blocks_for(total)
        if blocks > self.cache.num_blocks:
            raise TLTError(f"prompt + max_new_tokens = {total} tokens need {blocks} KV blocks, but "
                           f"the cache has only {self.cache.num_blocks} (block_size "
                           f"{self.cache.block_size})")

    def add_sequence(self, req: Request, *, index: int = 0) -> Sequence:
        """A validated, unscheduled sequence (for `generate` and for step-level callers)."""
        self.check_request(req)
        params = req.sampling_params
        seed = self.seed if params.seed is None else params.seed
        ids = req.prompt_token_ids
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return Sequence(seq_id=next(self._seq_ids), request=req, index=index, token_ids=ids,
                        prompt_len=len(ids),
                        rng=make_noise_stream(seed, req.prompt_id, req.sample_index),
                        stop=StopChecker(params, self.eos_token_ids, self.detokenize),
                        policy_version=self.weights.version)

    def free_sequence(self, seq: Sequence) -> None:
        self.cache.free(seq.seq_id)
        seq.num_computed = 0
        seq.pending_verify = 0

    # ---- generate ---------------------------------------------------------------------

    def generate(self, requests: list[Request], *,
                 progress: Callable[[Progress], None] | None = None,
                 spec_strategy=None) -> list[Result]:
        """Generate for every request; results in request order. Rejected requests get a
        Result with `error` set and do not stop the others. spec_strategy (a
        megatron_tlt.spec.tree.Strategy) replaces the spec decoder's strategy for this call
        (its on/off decision, e.g. the batch-size threshold, still applies)."""
        if self.cache.is_sleeping:
            raise RuntimeError("RolloutEngine.generate() while asleep; call wake() first")
        version = self.weights.version
        results: list[Result | None] = [None] * len(requests)
        seen: dict[tuple[str, int], int] = {}
        self._spec_strategy = spec_strategy
        self.step_log = log = []
        try:  # from the first admission: an error or interrupt leaves nothing queued
            for i, req in enumerate(requests):
                name = (f"request {i} (prompt_id={getattr(req, 'prompt_id', None)!r}, "
                        f"sample_index={getattr(req, 'sample_index', None)!r})")
                try:
                    seq = self.add_sequence(req, index=i)
                    key = (str(req.prompt_id), req.sample_index)
                    if key in seen:
                        raise TLTError(f"duplicate of request {seen[key]} (same prompt_id and "
                                       f"sample_index would sample identical tokens)")
                    seen[key] = i
                except TLTError as e:
                    results[i] = Result.rejected(req, f"{name}: {e}", version)
                    continue
                self.scheduler.add(seq)
            num_done = sum(r is not None for r in results)
            first_token = self.num_appended
            start = time.perf_counter()
            while self.scheduler.has_work():
                t0 = time.perf_counter()
                scheduled, finished = self.step()
                log.append((len(scheduled), time.perf_counter() - t0))
                num_tokens = self.num_appended - first_token
                for seq in finished:
                    results[seq.index] = self._result(seq)
                num_done += len(finished)
                if progress is not None:
                    progress(Progress(num_done, len(requests), num_tokens,
                                      time.perf_counter() - start))
        except BaseException:
            self.scheduler.abort_all()
            if self.spec_decoder is not None:
                self.spec_decoder.reset()
            raise
        finally:
            self._spec_strategy = None
        return results  # type: ignore[return-value]

    def step(self) -> tuple[list[Sequence], list[Sequence]]:
        """One scheduling step: (sequences that ran, sequences that finished)."""
        plan = self.scheduler.schedule()
        if not plan.seqs:
            raise RuntimeError("scheduler could not run anything: the KV cache is held by "
                               "sequences outside the scheduler")
        if self.spec_decoder is not None:
            self.spec_decoder.step(self, plan.seqs, self._spec_strategy)
        else:
            out = self.forward_pending(plan.seqs)
            self.sample_and_append(plan.seqs, out.logits)
        finished = [s for s in plan.seqs if s.finish_reason is not None]
        for s in finished:
            self.scheduler.finish(s)
            if self.spec_decoder is not None:
                self.spec_decoder.finish(s)
        return plan.seqs, finished

    def _result(self, seq: Sequence) -> Result:
        hidden = None
        if seq.request.return_hidden_states is not None:
            hidden = torch.cat(seq.hidden).cpu() if seq.hidden else None
        want_lp = seq.request.sampling_params.logprobs
        return Result(prompt_id=seq.request.prompt_id, sample_index=seq.request.sample_index,
                      token_ids=list(seq.output_ids),
                      logprobs=list(seq.logprobs) if want_lp else None,
                      processed_logprobs=list(seq.processed_logprobs) if want_lp else None,
                      finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                      policy_version=seq.policy_version, hidden_states=hidden,
                      num_preemptions=seq.num_preemptions, spec_stats=dict(seq.spec_stats))

    # ---- step parts ---------------------------------------------------------------------

    def forward_pending(self, seqs: list[Sequence], *, return_hidden: bool = False) -> ForwardOutput:
        """Run the pending tokens `token_ids[num_computed:]` of each sequence; commit their
        KV. Returns logits [B, vocab] of each sequence's last token; with return_hidden
        (or when a request asks for hidden states) also the hidden states of every pending
        token, sequences concatenated in order."""
        if self.decode_runner is not None:
            out = self.decode_runner.decode(seqs, return_hidden=return_hidden)  # None unless a plain decode step
            if out is not None:
                return out
        ids, positions, slots, starts, ctx = [], [], [], [0], []
        for seq in seqs:
            lo, hi = seq.num_computed, len(seq.token_ids)
            if hi <= lo:
                raise RuntimeError(f"sequence {seq.seq_id} has no pending tokens")
            if not self.cache.ensure(seq.seq_id, hi):
                raise RuntimeError(f"sequence {seq.seq_id}: KV cache has no room for {hi} tokens")
            ids.extend(seq.token_ids[lo:hi])
            positions.extend(range(lo, hi))
            slots.extend(self.cache.slot_range(seq.seq_id, lo, hi))
            starts.append(starts[-1] + hi - lo)
            ctx.append(hi)
        meta, head = self._metadata(seqs, slots, starts, ctx, tree_mask=None, head=ids + positions)
        want_hidden = return_hidden or any(s.request.return_hidden_states for s in seqs)
        if self.fused_prefill and self._fused_verify():
            max_q = max(starts[b + 1] - starts[b] for b in range(len(seqs)))
            out = self.decode_runner.extend(head[:len(ids)], head[len(ids):], meta, max_q,
                                            meta.query_start[1:] - 1, return_hidden=want_hidden)
        else:
            out = self.model.forward(head[:len(ids)], head[len(ids):], self.cache, meta,
                                     logits_indices=meta.query_start[1:] - 1,
                                     return_hidden=want_hidden)
        for b, seq in enumerate(seqs):
            seq.num_computed = len(seq.token_ids)
            seq.pending_verify = 0
            kind = seq.request.return_hidden_states
            if kind is not None:
                h = out.hidden_final if kind == "final" else out.hidden_pre_norm
                seq.hidden.append(h[starts[b]:starts[b + 1]].clone())
        return out

    def sample_and_append(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """Sample one token per sequence (logits [B, vocab] float32), append it, run the stop
        checks (setting finish_reason). Returns the tokens [B] (from the decode runner's
        sampled path, a view of its static buffer, valid until its next step)."""
        runner = self.decode_runner
        if runner is not None:
            # Device paths (cuda_graphs.py), bit-identical to the generic path below:
            # every request greedy; or the runner's decode logits with no top-k, top-p or ban.
            fast = runner.sample_greedy(seqs, logits)
            if fast is None:
                fast = runner.sample_fast(seqs, logits)
            if fast is not None:
                tokens, token_list, lps, plps = fast
                for i, seq in enumerate(seqs):
                    self.append_token(seq, token_list[i], lps[i], plps[i])
                return tokens
        b, v = logits.shape
        temps, top_k, top_p, keys, draws = [], [], [], [], []
        banned = None
        for i, seq in enumerate(seqs):
            p = seq.request.sampling_params
            temps.append(float(p.temperature))
            top_k.append(int(p.top_k))
            top_p.append(float(p.top_p))
            if p.temperature > 0:  # the request's one draw; greedy rows take none
                keys.append(seq.rng.key)
                draws.append(seq.rng.take())
            else:
                keys.append(0)
                draws.append(0)
            ban = seq.stop.banned_ids(seq.num_output)
            if ban:
                if banned is None:
                    banned = torch.zeros(b, v, dtype=torch.bool)
                banned[i, list(ban)] = True
        dev = logits.device
        out = sample_streams(logits, torch.tensor(temps, device=dev), torch.tensor(keys, device=dev),
                             torch.tensor(draws, device=dev), top_k=torch.tensor(top_k, device=dev),
                             top_p=torch.tensor(top_p, device=dev),
                             banned=None if banned is None else banned.to(dev))
        tokens = out.token_ids.tolist()
        lps = out.logprobs.tolist()
        plps = out.processed_logprobs.tolist()
        for i, seq in enumerate(seqs):
            self.append_token(seq, tokens[i], lps[i], plps[i])
        return out.token_ids

    def append_token(self, seq: Sequence, token: int, logprob: float,
                     processed_logprob: float) -> bool:
        """Append one generated token and run the stop checks; True once `seq` is finished
        (finish_reason set)."""
        seq.token_ids.append(token)
        seq.logprobs.append(logprob)
        seq.processed_logprobs.append(processed_logprob)
        self.num_appended += 1
        reason, stop = seq.stop.check(seq.token_ids, seq.prompt_len, len(seq.token_ids) >= self.max_model_len)
        if reason is not None:
            seq.finish_reason, seq.stop_reason = reason, stop
            return True
        return False

    def verify_forward(self, seqs: list[Sequence],
                       query_tokens: torch.Tensor,  # [B, Q] int64
                       positions: torch.Tensor,  # [B, Q] int64 RoPE positions
                       tree_mask: torch.Tensor,  # [B, Q, Q] bool: query i sees query j
                       *, return_hidden: str | None = None,
                       ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits [B, Q, vocab] of Q query tokens per sequence that see the whole committed
        prefix plus the query tokens `tree_mask` allows. Their KV goes to cache positions
        num_computed .. num_computed + Q - 1 (uncommitted until `commit_kv`). With
        return_hidden ("final" / "pre_norm") also returns hidden states [B, Q, hidden]."""
        out = self.verify_forward_output(seqs, query_tokens, positions, tree_mask,
                                         return_hidden=return_hidden is not None)
        logits = out.logits.view(len(seqs), query_tokens.shape[1], -1)
        if return_hidden is None:
            return logits
        h = out.hidden_final if return_hidden == "final" else out.hidden_pre_norm
        return logits, h.view(len(seqs), query_tokens.shape[1], -1)

    def verify_forward_output(self, seqs: list[Sequence],
                              query_tokens: torch.Tensor,  # [B, Q] int64
                              positions: torch.Tensor,  # [B, Q] int64 RoPE positions
                              tree_mask: torch.Tensor,  # [B, Q, Q] bool: query i sees query j
                              *, return_hidden: bool = False,
                              draft_ids: torch.Tensor | None = None) -> ForwardOutput:
        """verify_forward returning the raw ForwardOutput: logits [B * Q, vocab] and, with
        return_hidden, both hidden kinds [B * Q, hidden] (rows sequence-major).
        draft_ids: [B, Q - 1] int64 on the engine's device, the query tokens after each
        root, taken from there instead of query_tokens (drafts that never left the
        device; their values are not checked on the host: they must be valid ids)."""
        bsz, q = query_tokens.shape
        if positions.shape != (bsz, q) or tree_mask.shape != (bsz, q, q) or len(seqs) != bsz:
            raise ValueError(f"verify_forward: {len(seqs)} seqs, query_tokens {tuple(query_tokens.shape)}, "
                             f"positions {tuple(positions.shape)}, tree_mask {tuple(tree_mask.shape)} "
                             f"do not agree")
        tree_mask = tree_mask.to(torch.bool)
        if not bool(tree_mask.diagonal(dim1=1, dim2=2).all()):
            raise ValueError("verify_forward: every query token must see itself (tree_mask diagonal)")
        if int(positions.max()) >= self.max_model_len:
            raise ValueError(f"verify_forward: position {int(positions.max())} >= max_model_len")
        return self._verify(seqs, q, query_tokens.reshape(-1).tolist(), positions.reshape(-1).tolist(),
                            tree_mask, None, draft_ids, return_hidden)

    def verify_chains_output(self, seqs: list[Sequence], depth: int, draft_ids: torch.Tensor,
                             *, return_hidden: bool = False) -> ForwardOutput:
        """verify_forward_output of chains of `depth` drafts after each sequence's last
        token, the drafts [B, depth] int64 already on the device (SpecDecoder's deferred
        step): the query tokens, positions and causal chain mask are built here, as
        Python lists for the runner's verify graph (no tensor ops on the host)."""
        bsz, q = len(seqs), depth + 1
        mask = self._chain_masks.get((bsz, q))
        if mask is None:
            # contiguous: the eager path pins it (to_device), which rejects expanded views
            mask = torch.ones(q, q, dtype=torch.bool).tril().expand(bsz, q, q).contiguous()
            self._chain_masks[(bsz, q)] = mask
        tokens, positions = [], []
        pad = [0] * depth
        for s in seqs:
            root = len(s.token_ids) - 1
            tokens.append(s.token_ids[-1])
            tokens.extend(pad)
            positions.extend(range(root, root + q))
        if max(positions) >= self.max_model_len:
            raise ValueError(f"verify_forward: position {max(positions)} >= max_model_len")
        return self._verify(seqs, q, tokens, positions, mask, "chain", draft_ids, return_hidden)

    def verify_chains_ahead(self, seqs: list[Sequence], depth: int, draft_ids: torch.Tensor,
                            accept_length: torch.Tensor, output_tokens: torch.Tensor,
                            *, return_hidden: bool = False) -> ForwardOutput | None:
        """The next step's verify_chains_output of `seqs` at `depth`, queued before the host
        has read this step's verification (accept_length [B] and output_tokens [B, Q] on
        the device; DecodeRunner.verify_ahead): None where no verify graph path serves
        it, the last verify was not these sequences' chains at this depth, or the KV pool
        cannot hold every sequence's worst case. Hand the result to adopt_verify_ahead
        once the host has committed and appended this step's tokens and the next step
        is these sequences' chains at this depth with these drafts; else drop it (its KV
        writes lie past every sequence's committed entries)."""
        if not self._fused_verify():
            return None
        return self.decode_runner.verify_ahead(seqs, depth + 1, accept_length, output_tokens, draft_ids,
                                               return_hidden=return_hidden)

    def adopt_verify_ahead(self, seqs: list[Sequence], depth: int, out: ForwardOutput) -> ForwardOutput:
        """verify_chains_output's result for a verify_chains_ahead the caller found to be
        this step's verify: its Q entries per sequence stay uncommitted until commit_kv."""
        q = depth + 1
        for seq in seqs:
            if seq.num_computed + q > self.cache.num_slots(seq.seq_id):
                raise RuntimeError(f"sequence {seq.seq_id}: adopting a verify-ahead beyond its KV blocks")
            seq.pending_verify = q
        return out

    def _verify(self, seqs, q: int, tokens: list[int], positions: list[int], tree_mask: torch.Tensor,
                mask_key: str | None, draft_ids: torch.Tensor | None, return_hidden: bool) -> ForwardOutput:
        """The verify forward of both entries: KV room for Q more entries per sequence,
        then the runner's verify graph (inputs in one host-to-device copy) or, where no
        graph serves, `_verify_eager`; the Q entries stay uncommitted until commit_kv."""
        for seq in seqs:
            if not self.cache.ensure(seq.seq_id, seq.num_computed + q):
                raise RuntimeError(f"sequence {seq.seq_id}: KV cache has no room for "
                                   f"{seq.num_computed + q} entries")
        out = None
        if self._fused_verify():
            out = self.decode_runner.verify_rows(seqs, q, tokens, positions, tree_mask, mask_key=mask_key,
                                                 draft_ids=draft_ids, return_hidden=return_hidden)
        if out is None:
            out = self._verify_eager(seqs, q, tokens, positions, tree_mask, return_hidden, draft_ids)
        for seq in seqs:
            seq.pending_verify = q
        return out

    def _verify_eager(self, seqs, q, tokens, positions, tree_mask, return_hidden, draft_ids):
        """verify_forward_output without a verify graph: metadata in one copy, then the
        runner's eager fused forward or the generic model forward."""
        bsz = len(seqs)
        slots, starts, ctx = [], [0], []
        for seq in seqs:
            base = seq.num_computed
            slots.extend(self.cache.slot_range(seq.seq_id, base, base + q))
            starts.append(starts[-1] + q)
            ctx.append(base + q)
        meta, head = self._metadata(seqs, slots, starts, ctx, tree_mask=to_device(tree_mask, self.device),
                                    head=tokens + positions)
        ids, pos = head[:bsz * q], head[bsz * q:]
        if draft_ids is not None:
            if tuple(draft_ids.shape) != (bsz, q - 1) or draft_ids.device != ids.device:
                raise ValueError(f"verify_forward: draft_ids {tuple(draft_ids.shape)} on {draft_ids.device}, "
                                 f"expected {(bsz, q - 1)} on {ids.device}")
            ids.view(bsz, q)[:, 1:] = draft_ids
        if self._fused_verify():
            return self.decode_runner.verify(ids, pos, meta, return_hidden=return_hidden)
        return self.model.forward(ids, pos, self.cache, meta, logits_indices=None,
                                  return_hidden=return_hidden)

    def capture_verify_graphs(self, max_batch: int, max_q: int) -> int:
        """Capture the verify graphs of up to max_batch sequences x 2..max_q query rows
        now rather than at first use (DecodeRunner.capture_verify_graphs); the number
        captured, 0 where verifies take no graphs (CPU, eager, batch-invariant engines)."""
        if not self._fused_verify():
            return 0
        return self.decode_runner.capture_verify_graphs(max_batch, max_q)

    def _fused_verify(self) -> bool:
        """Verify through the decode runner's fused kernels (a third of the generic
        forward's launches): on a GPU engine with the Triton backend, unless the engine is
        batch-invariant (the fused projections' kernel choice depends on the row count)."""
        return (self.decode_runner is not None and self.device.type == "cuda"
                and not self.model.batch_invariant)

    def commit_kv(self, seq: Sequence, accepted_slot_indices: Seq[int] | torch.Tensor) -> None:
        """Keep the KV of the accepted query tokens of the last verify_forward (indices into
        its Q queries, strictly increasing, i.e. a root-to-node path in topological order):
        move them to cache positions num_computed, num_computed + 1, ... and drop the rest.
        The caller appends the accepted tokens (and the bonus token) to seq.token_ids."""
        q = seq.pending_verify
        if isinstance(accepted_slot_indices, (list, tuple)) and \
                list(accepted_slot_indices) == list(range(len(accepted_slot_indices))) and \
                len(accepted_slot_indices) <= q:
            # A chain's accepted prefix: already in place, nothing to move (no tensor ops:
            # this runs per sequence per speculative step).
            seq.num_computed += len(accepted_slot_indices)
            seq.pending_verify = 0
            return
        idx = torch.as_tensor(accepted_slot_indices, dtype=torch.int64).reshape(-1).cpu()
        if idx.numel():
            if int(idx.min()) < 0 or int(idx.max()) >= q:
                raise ValueError(f"commit_kv: accepted indices {idx.tolist()} outside the last "
                                 f"verify's {q} query tokens")
            if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
                raise ValueError(f"commit_kv: accepted indices {idx.tolist()} must be strictly increasing")
            base = seq.num_computed
            dst = torch.arange(idx.numel())
            moved = idx != dst  # a chain's accepted prefix is already in place: no copy
            if bool(moved.any()):
                self.cache.move(seq.seq_id, base + idx[moved], base + dst[moved])
            seq.num_computed = base + idx.numel()
        seq.pending_verify = 0

    def _metadata(self, seqs, slots: list[int], starts: list[int], ctx: list[int], tree_mask,
                  head: list[int] = ()) -> tuple[AttentionMetadata, torch.Tensor]:
        """The attention metadata of a forward over `seqs` (slots, query starts, context
        lengths, block tables padded with 0) and `head` (token ids and positions), all in
        one host-to-device copy (this runs on every step): (metadata, head on the device)."""
        b = len(seqs)
        tables = [self.cache.block_table(s.seq_id) for s in seqs]
        width = max(len(t) for t in tables)
        flat = list(head)
        flat += slots
        flat += starts
        flat += ctx
        for t in tables:
            flat += t
            flat += [0] * (width - len(t))
        buf = to_device(int64_tensor(flat), self.device)
        h, n = len(head), len(slots)
        parts = buf[h:].split([n, b + 1, b, b * width])
        return AttentionMetadata(slot_mapping=parts[0], query_start=parts[1], context_lens=parts[2],
                                 block_tables=parts[3].view(b, width), tree_mask=tree_mask,
                                 host_query_start=list(starts), host_context_lens=list(ctx)), buf[:h]


def _device_memory_bytes(device: torch.device) -> int | None:
    """The device's total memory (physical RAM for the CPU), None where unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):
            return None
    return None


def _check_kv_fits(arch, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
    """ConfigError, before allocating, for a KV cache larger than the device's whole memory
    (an oversized --num-blocks / --block-size died in the allocator or the OOM killer)."""
    need = (2 * arch.num_layers * num_blocks * block_size * arch.num_kv_heads * arch.head_dim
            * torch.empty((), dtype=dtype).element_size())
    have = _device_memory_bytes(device)
    if have is not None and need > have:
        raise ConfigError(f"the KV cache ({num_blocks} blocks x {block_size} tokens) needs "
                          f"{need / 2**30:.1f} GiB, more than the {device.type} device's "
                          f"{have / 2**30:.1f} GiB; lower num_blocks or block_size")
