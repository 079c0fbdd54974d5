"""GPU decode fast path of the rollout engine: static inputs, bucketed CUDA graphs, sampling
on the device.

`DecodeRunner` serves `RolloutEngine.forward_pending` when every scheduled sequence has
exactly one pending token (a decode step); `sample_and_append` when every request is
greedy (`sample_greedy`, any logits), or, for the logits of a decode step it served, when
no row has top-k, top-p or a min_new_tokens ban (`sample_fast`, greedy and sampled rows
mixed); and (eagerly, `verify`) the speculative verify forward of a GPU engine that is not
batch-invariant. Anything else (prefill, re-prefill, hidden states of decode steps,
sampling with top-k / top-p / a ban) takes the engine's generic path.

Decode step (`decode(seqs)`):
1. inputs — token ids, positions, slot mapping, context lengths and block tables — are
   written into one pinned host buffer `[max_batch, 4 + max_blocks]` int32 (a sequence's
   block-table row is rewritten only when its table changed) and copied with ONE
   host-to-device copy into the static device buffer the graphs read;
2. the batch is padded to the next bucket (1, 2, 4, ..., 128 by default; the largest is
   at least max_num_seqs): padding rows have slot -1 (no K/V write), context length 1;
3. the bucket's graph is replayed (or, with use_graphs=False, the same forward runs
   eagerly at the same padded shape, so graph and eager decode compute identical
   numbers); logits land in a static [max_batch, vocab] float32 buffer. The returned
   logits are a view into it, valid until the next decode step.

Sampled decode step (`sample_fast(seqs, logits)`), after `decode`:
1. per row (stream key, draw number, temperature as float64 bits; temperature 0 is the
   greedy flag, as in `sampling.sample`) go into one pinned host buffer [max_batch, 3]
   int64 and ONE host-to-device copy; only sampled rows take a draw (`rng.take()`), as in
   the generic path; padding rows are greedy with key 0, draw 0;
2. `sampling.sample_streams` (no top-k / top-p / ban: no host sync; on a GPU the fused
   Triton sampler, rollout/triton_sample.py, else `exponential_noise` + `sample`) runs on
   all `bucket` rows of the decode's padded logits, replayed from a graph per bucket
   (captured at first use into the shared pool) or, with use_graphs=False, eagerly at
   the same shape;
3. (token, logprob, processed logprob) per row land in one static [max_batch, 3] int64
   buffer (the logprobs as float64 bits) and come back with ONE device-to-host copy.
Same numbers as the generic path bit for bit: it calls the same function on the same
device; the noise is elementwise in (key, draw, index), and everything else is computed
per row (the fused sampler's parts are fixed by the vocabulary), so a row's results do
not depend on how many rows are in the batch
(the generic path samples [n] rows and draws noise for its sampled rows only, this path
[bucket] rows; tests/unit/test_sample_graph.py checks both). The environment variable
MEGATRON_TLT_SAMPLE_GRAPHS=0, read when a runner is constructed, turns this path off
(`sample_graphs`; the greedy path is unaffected), to compare or to rule it out.

Graphs: captured lazily at the first decode step (or by `capture()`), largest bucket
first, all into ONE memory pool (`torch.cuda.graph_pool_handle()`): the buckets never
run concurrently, so their intermediates share memory and the pool costs about as much
as the largest bucket alone. Split-K factors are fixed per bucket at capture.

What a graph holds by address, and why it stays valid:
- weights: `EngineWeights.update_weights` copies in place (data_ptr()s never change), so
  policy updates need no recapture;
- the KV pool: `engine.sleep()` frees it and `wake()` allocates a new one at whatever
  address the allocator returns. We chose to RECAPTURE rather than to pin the address
  (which would need a virtual-memory allocator): `sleep()` drops the graphs and their
  pool (freeing that memory too), and the next decode step recaptures (about a second;
  once per wake). As a guard, every step compares the pool's data_ptr() with the one
  captured and recaptures on a mismatch;
- the static input and logits buffers (the sampling ones included): owned here, never
  reallocated while graphs live. A sampling graph reads and writes only those; what it
  allocates is intermediate, freed at the end of its capture, like a decode graph's, so
  it reads nothing another graph left in the pool. Its intermediates are the sampler's:
  the fused one's per-part statistics (a few KB per row); with MEGATRON_TLT_FUSED_SAMPLE=0
  the torch sampler's [bucket, vocab] noise and float32 planes (about 0.6 GB at bucket
  128 and a 151,936 vocabulary), held by the pool while the graphs live.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from typing import Sequence as Seq

import torch

from megatron_tlt.errors import ConfigError
from megatron_tlt.rollout.gpu_model import DecodeModel
from megatron_tlt.rollout.host import graph_capture
from megatron_tlt.rollout.kv_cache import PagedKVCache
from megatron_tlt.rollout.model import ForwardOutput, InferenceModel
from megatron_tlt.rollout.sampling import sample_streams
from megatron_tlt.rollout.triton_attention import block_n_for, choose_num_splits, num_sms, splits_for
from megatron_tlt.rollout.triton_linear import LinearPlanner

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
MAX_VERIFY_GRAPH_ROWS = int(os.environ.get("MEGATRON_TLT_VERIFY_GRAPH_ROWS", "256"))
"""Largest bucket x Q served by a verify graph (its static logits buffer holds this many
rows of the vocabulary: 156 MB at 151,936); larger verifies run eagerly. The environment
variable sets it; 0 turns verify graphs off (to compare, or to rule them out)."""
_ID, _POS, _SLOT, _CTX = 0, 1, 2, 3  # columns of the input buffer; block table from column 4
_NCOL = 4
_KEY, _DRAW, _TEMP = 0, 1, 2  # columns of the sampling input buffer (_TEMP: float64 bits)
_TOKEN, _LP, _PLP = 0, 1, 2  # columns of the sampling output buffer (_LP, _PLP: float64 bits)


def _f64_bits(x: float) -> int:
    """The bits of float64 x as an int64 (read back on the device with .view(torch.float64))."""
    return struct.unpack("=q", struct.pack("=d", x))[0]


def bucket_sizes(batch_sizes: Seq[int] | None, max_num_seqs: int) -> list[int]:
    """Sorted bucket sizes <= max_num_seqs; max_num_seqs is added when no bucket covers it."""
    sizes = DEFAULT_BATCH_SIZES if batch_sizes is None else tuple(batch_sizes)
    for b in sizes:
        if not isinstance(b, int) or isinstance(b, bool) or b < 1:
            raise ConfigError(f"cuda graph batch sizes must be integers >= 1, got {b!r}")
    out = sorted({b for b in sizes if b <= max_num_seqs})
    if not out or out[-1] < max_num_seqs:
        out.append(max_num_seqs)
    return out


class DecodeRunner:
    def __init__(self, model: InferenceModel, cache: PagedKVCache, *, max_num_seqs: int,
                 max_model_len: int, use_graphs: bool = True,
                 batch_sizes: Seq[int] | None = None):
        if use_graphs and cache.device.type != "cuda":
            raise ConfigError(f"cuda_graphs=True needs a CUDA device, the engine runs on {cache.device}")
        arch = model.arch
        self.cache = cache
        self.device = cache.device
        self.use_graphs = use_graphs
        # One kernel planner per device for every engine of the process: the same kernels,
        # so the same roundings, whichever engine decodes (linear_plans.py).
        self.model = DecodeModel(arch, model.weights, model.cos, model.sin,
                                 planner=LinearPlanner.shared(self.device))
        self.vocab_size = arch.vocab_size
        self.buckets = bucket_sizes(batch_sizes, max_num_seqs)
        self.max_batch = self.buckets[-1]
        self.width = -(-max_model_len // cache.block_size)
        self.max_model_len = max_model_len
        self.num_splits = self._decode_splits()
        """Split-K factor of the attention kernel per bucket (chosen again by release():
        triton_attention.set_split_min_tiles changes it)."""
        shape = (self.max_batch, _NCOL + self.width)
        self._meta = torch.zeros(shape, dtype=torch.int32, device=self.device)  # graph inputs
        self._host = torch.zeros(shape, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        self._pad = torch.tensor([0, 0, -1, 1], dtype=torch.int32)
        self._host[:, :_NCOL] = self._pad
        self._meta.copy_(self._host)
        self._rows: list[list[int] | None] = [None] * self.max_batch  # block table per row
        self._advance_work: torch.Tensor | None = None  # advance_greedy's (greedy_advance_work)
        self._copy_done = None
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._ghidden: dict[int, dict[str, torch.Tensor]] = {}  # each decode graph's hidden outputs
        self._pool = None
        self._logits: torch.Tensor | None = None
        self._kv_ptr: int | None = None
        self.num_captures = 0
        """How many times the graphs were captured (1 + one per wake after a sleep)."""
        self.capture_s = 0.0
        """Wall seconds spent capturing graphs (decode, sampling, verify), their warm-ups
        included: Triton compilation, the linear planner's timings on first use."""
        self.num_steps = 0
        """Decode steps served by this runner."""
        self._vgraphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, dict]] = {}
        self._veye: dict[int, torch.Tensor] = {}  # padding sequences' tree mask per Q
        self._veye_cpu: dict[int, torch.Tensor] = {}  # the same on the host
        self._vstage: dict[tuple[int, int], dict] = {}  # static inputs per verify graph
        self._vlogits: torch.Tensor | None = None
        self._vcopy_done = None
        self.num_verify_replays = 0
        """Verify forwards served from a graph."""
        self._vrows_warned: set[tuple[int, int]] = set()  # (bucket, Q) over MAX_VERIFY_GRAPH_ROWS
        self.static_verify = False
        """Without graphs (use_graphs=False), still verify through the static inputs of
        `verify_rows` (the forward then runs eagerly at the padded shape), as a graph
        engine does: for tests of that path and of `verify_ahead` on CPU."""
        self._last_verify: tuple | None = None  # (bucket, Q, sequence ids) of the last verify_rows
        self.num_verify_ahead = 0
        """Verify forwards queued by `verify_ahead`."""
        self.sample_graphs = os.environ.get("MEGATRON_TLT_SAMPLE_GRAPHS", "1") != "0"
        """Sampled decode steps take `sample_fast` (graphs with use_graphs, else eager);
        False: the engine's generic path. MEGATRON_TLT_SAMPLE_GRAPHS=0 sets it False."""
        pinned = self.device.type == "cuda"
        self._sin = torch.zeros(self.max_batch, 3, dtype=torch.int64, device=self.device)
        self._shost = torch.zeros(self.max_batch, 3, dtype=torch.int64, pin_memory=pinned)
        self._sout = torch.zeros(self.max_batch, 3, dtype=torch.int64, device=self.device)
        self._spad = torch.zeros(3, dtype=torch.int64)  # greedy (temperature 0.0), key 0, draw 0
        self._scopy_done = None
        self._sgraphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._served: tuple[torch.Tensor, torch.Tensor] | None = None
        """The last decode step's logits [n, vocab] and the bucket's [bucket, vocab] they view."""
        self.num_fast_samples = 0
        """Decode steps sampled by `sample_fast`."""

    # ---- buckets and static inputs ------------------------------------------------------

    def bucket_for(self, batch: int) -> int:
        for b in self.buckets:
            if b >= batch:
                return b
        raise ValueError(f"decode batch {batch} exceeds the largest bucket {self.max_batch}")

    def static_inputs(self, bucket: int) -> dict[str, torch.Tensor]:
        """Views of the device input buffer for the first `bucket` rows (int32)."""
        m = self._meta[:bucket]
        return {"input_ids": m[:, _ID], "positions": m[:, _POS], "slot_mapping": m[:, _SLOT],
                "context_lens": m[:, _CTX], "block_tables": m[:, _NCOL:]}

    def advance_greedy(self, n: int, logits: torch.Tensor) -> None:
        """A device decode loop's step (bench rollout's): the first `n` rows of the input
        buffer take argmax(logits) as their next token, their position and context length
        + 1 and that position's slot, in one launch (triton_sample.greedy_advance). The
        sequences' blocks must already hold the next position (cache.ensure)."""
        from megatron_tlt.rollout.triton_sample import greedy_advance, greedy_advance_work

        if self._advance_work is None:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("advance_greedy: first call during CUDA graph capture; run it "
                                   "eagerly first (its work buffer is allocated then)")
            self._advance_work = greedy_advance_work(self.max_batch, self.vocab_size, self.device)
        greedy_advance(logits[:n], self._meta, self.cache.block_size, id_col=_ID, pos_col=_POS,
                       slot_col=_SLOT, ctx_col=_CTX, table_col=_NCOL, work=self._advance_work)

    def prepare(self, seqs) -> int:
        """Write the decode inputs of `seqs` (each with one pending token, its blocks
        allocated) into the static buffer; returns the bucket."""
        n = len(seqs)
        bucket = self.bucket_for(n)
        if self._copy_done is not None:
            self._copy_done.synchronize()  # the host buffer is still being read otherwise
        host, bs = self._host, self.cache.block_size
        cols = []
        for i, seq in enumerate(seqs):
            p = len(seq.token_ids) - 1
            table = self.cache.block_table(seq.seq_id)
            if len(table) > self.width:
                raise RuntimeError(f"sequence {seq.seq_id} holds {len(table)} blocks, more than "
                                   f"max_model_len allows ({self.width})")
            if self._rows[i] != table:
                host[i, _NCOL:_NCOL + len(table)] = torch.tensor(table, dtype=torch.int32)
                self._rows[i] = table
            cols.append((seq.token_ids[-1], p, table[p // bs] * bs + p % bs, p + 1))
        host[:n, :_NCOL] = torch.tensor(cols, dtype=torch.int32)
        if bucket > n:
            host[n:bucket, :_NCOL] = self._pad
        self._meta[:bucket].copy_(host[:bucket], non_blocking=True)
        if self.device.type == "cuda":
            if self._copy_done is None:
                self._copy_done = torch.cuda.Event()
            self._copy_done.record()
        return bucket

    # ---- forward ----------------------------------------------------------------------

    def _forward(self, bucket: int, logits_out: torch.Tensor | None = None,
                 hidden_out: dict | None = None) -> torch.Tensor:
        x = self.static_inputs(bucket)
        return self.model.forward(x["input_ids"], x["positions"], x["slot_mapping"],
                                  x["block_tables"], x["context_lens"], self.cache,
                                  num_splits=self.num_splits[bucket], logits_out=logits_out,
                                  hidden_out=hidden_out)

    def run(self, bucket: int, *, hidden: dict | None = None) -> torch.Tensor:
        """Logits [bucket, vocab] float32 of the prepared inputs (graph replay or eager).
        `hidden`, when given, receives the step's hidden states ("final", "pre_norm":
        [bucket, hidden]; with graphs, views of static buffers valid until the next step)."""
        if not self.use_graphs:
            return self._forward(bucket, hidden_out=hidden)
        if not self._graphs or self._kv_ptr != self.cache.k[0].data_ptr():
            self.capture()
        self._graphs[bucket].replay()
        if hidden is not None:
            hidden.update(self._ghidden[bucket])
        return self._logits[:bucket]

    def decode(self, seqs, *, return_hidden: bool = False) -> ForwardOutput | None:
        """The engine's decode step for `seqs`, or None when this is not a plain decode step
        (some sequence has != 1 pending token or wants hidden states of its own, which the
        generic path collects). return_hidden: also the hidden states of the step's tokens
        (copies, [n, hidden]): a speculative decoder's drafter observes every position,
        so its plain steps take this path too, not the generic forward."""
        n = len(seqs)
        if n == 0 or n > self.max_batch:
            return None
        for seq in seqs:
            if seq.num_pending != 1 or seq.request.return_hidden_states is not None:
                return None
        for seq in seqs:
            if not self.cache.ensure(seq.seq_id, len(seq.token_ids)):
                raise RuntimeError(f"sequence {seq.seq_id}: KV cache has no room for "
                                   f"{len(seq.token_ids)} tokens")
        bucket = self.prepare(seqs)
        hidden = {} if return_hidden else None
        padded = self.run(bucket, hidden=hidden)
        logits = padded[:n]
        self._served = (logits, padded)
        for seq in seqs:
            seq.num_computed = len(seq.token_ids)
            seq.pending_verify = 0
        self.num_steps += 1
        if hidden is None:
            return ForwardOutput(logits=logits)
        return ForwardOutput(logits=logits, hidden_final=hidden["final"][:n].clone(),
                             hidden_pre_norm=hidden["pre_norm"][:n].clone())

    def verify(self, input_ids: torch.Tensor,  # [B * Q] int64
               positions: torch.Tensor,  # [B * Q] int64
               meta, *, return_hidden: bool = False) -> ForwardOutput:
        """The speculative verify forward (tree mask) through the fused decode model,
        eagerly: the same kernels as a decode step, Q query rows per sequence (the graph
        path is `verify_rows`)."""
        q = meta.tree_mask.shape[1]
        return self._eager(input_ids, positions, meta, meta.block_tables.shape[1] * self.cache.block_size,
                           q, return_hidden, tree_mask=meta.tree_mask)

    def extend(self, input_ids: torch.Tensor,  # [T] int64, every sequence's new tokens
               positions: torch.Tensor,  # [T] int64
               meta, max_query_len: int, logits_rows: torch.Tensor,  # [B]: each sequence's last row
               *, return_hidden: bool = False) -> ForwardOutput:
        """A prefill (or re-prefill after a partial prefix) through the fused decode model,
        eagerly: each sequence's new tokens attend causally to its prefix and themselves in
        one paged-attention launch per layer, against the generic forward's per-op kernels
        (RMSNorm and RoPE in several ops each, an SDPA per group of equal prompt lengths).
        Logits of `logits_rows` only; hidden states of every row with return_hidden."""
        return self._eager(input_ids, positions, meta, max(meta.host_lengths()[1]), max_query_len,
                           return_hidden, max_query_len=max_query_len, logits_rows=logits_rows)

    def _eager(self, input_ids, positions, meta, max_context: int, q: int, return_hidden: bool,
               **model_kw) -> ForwardOutput:
        """`verify` and `extend`: the fused decode model over `meta`'s rows, split-K chosen
        for contexts up to max_context and Q query rows per sequence."""
        arch = self.model.arch
        splits = splits_for(self.cache.k[0], meta.block_tables.shape[0], max_context,
                            q * (arch.num_heads // arch.num_kv_heads))
        hidden: dict | None = {} if return_hidden else None
        logits = self.model.forward(input_ids, positions, meta.slot_mapping, meta.block_tables,
                                    meta.context_lens, self.cache, num_splits=splits,
                                    query_start=meta.query_start, hidden_out=hidden, **model_kw)
        if not return_hidden:
            return ForwardOutput(logits=logits)
        return ForwardOutput(logits=logits, hidden_final=hidden["final"],
                             hidden_pre_norm=hidden["pre_norm"])

    # ---- verify graphs ----------------------------------------------------------------

    def verify_graph_bucket(self, bsz: int, q: int) -> int | None:
        """The bucket whose verify graph serves `bsz` sequences of Q query rows, or None
        (no graphs, or beyond the largest bucket / MAX_VERIFY_GRAPH_ROWS: eager)."""
        if not (self.use_graphs or self.static_verify) or bsz > self.max_batch:
            return None
        bucket = self.bucket_for(bsz)
        if bucket * q <= MAX_VERIFY_GRAPH_ROWS:
            return bucket
        if MAX_VERIFY_GRAPH_ROWS > 0 and (bucket, q) not in self._vrows_warned:
            self._vrows_warned.add((bucket, q))
            # Session 14 (H200, 1.5B): batch 32 at depth 8 (288 rows) verified eagerly in
            # 9.45 ms per step against 2.48 ms at depth 4 from a graph.
            logger.warning("verify of %d sequences x %d rows (bucket %d: %d rows) exceeds the verify "
                           "graphs' %d rows and runs eagerly, several times slower: use a shallower "
                           "chain at this batch size (--spec-depth BATCH:DEPTH,..., rollout.spec_depth) "
                           "or raise MEGATRON_TLT_VERIFY_GRAPH_ROWS (a [rows, vocab] float32 buffer)",
                           bsz, q, bucket, bucket * q, MAX_VERIFY_GRAPH_ROWS)
        return None

    def verify_rows(self, seqs, q: int, tokens: list[int], positions: list[int],
                    tree_mask: torch.Tensor,  # [B, Q, Q] bool on the host
                    *, draft_ids: torch.Tensor | None = None, mask_key: str | None = None,
                    return_hidden: bool = False) -> ForwardOutput | None:
        """The verify forward replayed from the graph of (bucket, Q), its inputs built on
        the host: token ids and positions ([B * Q] Python ints, sequence-major), each
        sequence's slots num_computed .. num_computed + Q - 1, context lengths and block
        tables (rows rewritten only when they changed), and the padding sequences' rows,
        all written into one pinned staging buffer and sent in one host-to-device copy
        into the graph's static inputs; the tree mask is sent only when it differs from
        the one already there (a batch of chains sends it once; mask_key names a mask
        that is always the same for one B and Q, e.g. "chain": then not even compared).
        draft_ids: [B, Q - 1]
        int64 on the device, written over each sequence's query tokens after the root.
        None when no graph serves this shape (`verify_graph_bucket`): use `verify`.
        The outputs are views of static buffers, valid until the next verify."""
        bsz = len(seqs)
        bucket = self.verify_graph_bucket(bsz, q)
        if bucket is None:
            return None
        tree_mask = tree_mask.to("cpu", torch.bool)
        self._drop_if_kv_moved()
        self._decode_graphs_first()
        st = self._verify_stage(bucket, q)
        v = st["views"]
        if self.use_graphs and (bucket, q) not in self._vgraphs:
            self._capture_verify(bucket, q, v)
            st["mask_rows"] = -1  # the capture left padding in the device mask
        if self._vcopy_done is not None:
            self._vcopy_done.synchronize()  # the pinned staging buffer may still be read
        self._verify_host_rows(st, seqs, q, tokens, positions)
        st["dev"].copy_(st["host"], non_blocking=True)
        if self.device.type == "cuda":  # one event, recorded again: the staging's last copy
            if self._vcopy_done is None:
                self._vcopy_done = torch.cuda.Event()
            self._vcopy_done.record()
        same = st["mask_rows"] == bsz and (
            (mask_key is not None and st["mask_key"] == mask_key)
            or torch.equal(st["mask_host"][:bsz], tree_mask))
        if not same:
            full = self._veye_host(q).expand(bucket, q, q).clone()
            full[:bsz] = tree_mask
            src = full.pin_memory() if self.device.type == "cuda" else full
            v["mask"].copy_(src, non_blocking=True)  # pinned block: torch's caching host allocator
            st["mask_host"], st["mask_rows"], st["mask_key"] = full, bsz, mask_key
        elif mask_key is not None:
            st["mask_key"] = mask_key  # the same content, now known by its name
        n = bsz * q
        if draft_ids is not None:
            if tuple(draft_ids.shape) != (bsz, q - 1) or draft_ids.device != v["ids"].device:
                raise ValueError(f"verify_rows: draft_ids {tuple(draft_ids.shape)} on {draft_ids.device}, "
                                 f"expected {(bsz, q - 1)} on {v['ids'].device}")
            v["ids"].view(bucket, q)[:bsz, 1:] = draft_ids
        self._last_verify = (bucket, q, [s.seq_id for s in seqs])
        return self._verify_run(bucket, q, n, return_hidden)

    def _verify_run(self, bucket: int, q: int, n: int, return_hidden: bool) -> ForwardOutput:
        """Replay the verify graph of (bucket, Q) on its static inputs (eagerly without
        graphs: `static_verify`); the first n rows' outputs."""
        v = self._vstage[(bucket, q)]["views"]
        if self.use_graphs:
            graph, hidden = self._vgraphs[(bucket, q)]
            graph.replay()
            self.num_verify_replays += 1
        else:
            hidden = {}
            self._verify_forward(bucket, q, v, hidden)
        logits = v["logits"][:n]
        if not return_hidden:
            return ForwardOutput(logits=logits)
        return ForwardOutput(logits=logits, hidden_final=hidden["final"][:n],
                             hidden_pre_norm=hidden["pre_norm"][:n])

    @staticmethod
    def _next_roots(roots: torch.Tensor, accept_length: torch.Tensor) -> torch.Tensor:
        """Each chain's next root position: past its root and accepted drafts (committed),
        where its bonus token goes."""
        return roots + accept_length + 1

    @torch.no_grad()
    def verify_ahead(self, seqs, q: int,
                     accept_length: torch.Tensor,  # [>= B] int64 on the device
                     output_tokens: torch.Tensor,  # [>= B, >= Q] int64 on the device
                     draft_ids: torch.Tensor,  # [B, Q - 1] int64 on the device
                     *, return_hidden: bool = False) -> ForwardOutput | None:
        """The next chain step's verify forward, queued before the host has read this
        step's verification (SpecDecoder's verify-ahead): what `verify_rows` of the same
        sequences at the same Q will be once each sequence has committed its root and
        accepted drafts (accept_length[b] + 1 entries) and appended them and the bonus
        token, its inputs built on the device from the last verify's static inputs: the
        new root position = the last root's + accept_length + 1, its token the bonus
        output_tokens[b, accept_length[b]], then draft_ids; slots from the block tables
        on the device, context lengths root + Q; the chain mask and the padding rows stay
        as the last verify left them. Same inputs in the same buffers as verify_rows, so
        the same forward. The last verify must be this runner's verify_rows (or
        verify_ahead) of these sequences at this Q with the chain mask (else None), and
        every sequence's table is grown here to the worst case (every draft accepted:
        num_computed + 2Q entries; the rows that changed are sent to the device); None,
        nothing queued and nothing grown, when the pool would keep fewer than a block per
        sequence. The host's sequence state is left alone: the caller sets pending_verify
        when it adopts the result. The outputs are the static buffers verify_rows returns
        (valid until the next verify)."""
        bsz = len(seqs)
        bucket = self.verify_graph_bucket(bsz, q)
        if bucket is None or self._last_verify != (bucket, q, [s.seq_id for s in seqs]):
            return None
        st = self._vstage[(bucket, q)]
        if st["mask_rows"] != bsz or st["mask_key"] != "chain":
            return None
        cache, w = self.cache, self.width
        # Grown early (by at most a block per sequence beyond what the next step will
        # need) only while the pool keeps a block per sequence to spare: near exhaustion
        # the early blocks could change who the scheduler preempts (the tokens would not
        # change on a batch-invariant engine, but a bf16 recompute rounds differently).
        need = 0
        for s in seqs:
            # max_model_len too: the table's width rounds it up to whole blocks, and a
            # position past it would read beyond the RoPE table (SpecDecoder checks it first)
            if s.num_computed + 2 * q > self.max_model_len or cache.blocks_for(s.num_computed + 2 * q) > w:
                return None
            need += cache.extra_blocks_needed(s.seq_id, s.num_computed + 2 * q)
        if need and need + bsz > cache.num_free_blocks:
            return None
        rows, changed = st["tables"], False
        h, o = st["np"], st["off"]
        for i, s in enumerate(seqs):
            cache.ensure(s.seq_id, s.num_computed + 2 * q)
            table = cache.block_table(s.seq_id)
            if rows[i] != table:
                if not changed and self._vcopy_done is not None:
                    self._vcopy_done.synchronize()  # the pinned staging buffer may still be read
                h[o["bt"] + i * w:o["bt"] + i * w + len(table)] = table
                rows[i], changed = table, True
        v = st["views"]
        if changed:  # the staging's table rows (verify_rows sends the whole buffer later)
            v["bt"].copy_(st["host"][o["bt"]:o["bt"] + bucket * w].view(bucket, w), non_blocking=True)
            if self.device.type == "cuda":
                if self._vcopy_done is None:
                    self._vcopy_done = torch.cuda.Event()
                self._vcopy_done.record()
        bs = cache.block_size
        acc = accept_length[:bsz]
        pos, ids, slot = (v[k].view(bucket, q) for k in ("pos", "ids", "slot"))
        root = self._next_roots(pos[:bsz, 0], acc)  # [B], before pos is overwritten
        new_pos = root[:, None] + torch.arange(q, device=root.device)
        slot[:bsz] = v["bt"][:bsz].gather(1, new_pos // bs) * bs + new_pos % bs
        pos[:bsz] = new_pos
        v["ctx"][:bsz] = root + q
        ids[:bsz, 0] = output_tokens[:bsz].gather(1, acc[:, None])[:, 0]
        ids[:bsz, 1:] = draft_ids
        self.num_verify_ahead += 1
        return self._verify_run(bucket, q, bsz * q, return_hidden)

    def _verify_host_rows(self, st: dict, seqs, q: int, tokens: list[int], positions: list[int]) -> None:
        """Write one verify's inputs into the staging buffer's host side (numpy views of
        pinned memory): ids, positions, slots, context lengths of the real rows, block
        tables where a row's table changed, and `_pad_verify_rows` for the rest."""
        h, o, w, rows = st["np"], st["off"], self.width, st["tables"]
        bsz = len(seqs)
        n = bsz * q
        h[o["ids"]:o["ids"] + n] = tokens
        h[o["pos"]:o["pos"] + n] = positions
        slots, ctx = [], []
        for i, s in enumerate(seqs):
            base = s.num_computed
            slots.extend(self.cache.slot_range(s.seq_id, base, base + q))
            ctx.append(base + q)
            table = self.cache.block_table(s.seq_id)
            if rows[i] != table:
                if len(table) > w:
                    raise RuntimeError(f"sequence {s.seq_id} holds {len(table)} blocks, more than "
                                       f"max_model_len allows ({w})")
                h[o["bt"] + i * w:o["bt"] + i * w + len(table)] = table
                rows[i] = table
        h[o["slot"]:o["slot"] + n] = slots
        h[o["ctx"]:o["ctx"] + bsz] = ctx
        self._pad_verify_rows(st, bsz, q)

    def _pad_verify_rows(self, st: dict, bsz: int, q: int) -> None:
        """Host rows of the padding sequences bsz..bucket-1 (`_fill_verify_padding`'s
        values: token 0 at position 0, no K/V write, context Q; their tree mask is set
        with the mask): a larger earlier verify left real slots there."""
        h, o, bucket = st["np"], st["off"], st["bucket"]
        n, end = bsz * q, bucket * q
        h[o["ids"] + n:o["ids"] + end] = 0
        h[o["pos"] + n:o["pos"] + end] = 0
        h[o["slot"] + n:o["slot"] + end] = -1
        h[o["ctx"] + bsz:o["ctx"] + bucket] = q

    def _veye_host(self, q: int) -> torch.Tensor:
        eye = self._veye_cpu.get(q)
        if eye is None:
            eye = self._veye_cpu[q] = torch.eye(q, dtype=torch.bool)
        return eye

    def _verify_logits(self) -> torch.Tensor:
        """The verify graphs' shared logits output, [MAX_VERIFY_GRAPH_ROWS, vocab] float32."""
        if self._vlogits is None:
            self._vlogits = torch.empty(MAX_VERIFY_GRAPH_ROWS, self.vocab_size, dtype=torch.float32,
                                        device=self.device)
        return self._vlogits

    def _verify_stage(self, bucket: int, q: int) -> dict:
        """The static inputs of the verify graph of (bucket, Q): one flat int64 buffer on
        the device (ids, positions, slots [bucket * Q]; context lengths [bucket]; query
        starts [bucket + 1]; block tables [bucket, width]) and its pinned host twin, plus
        the tree mask [bucket, Q, Q] and the host copy of what the device mask holds."""
        st = self._vstage.get((bucket, q))
        if st is None:
            n, w = bucket * q, self.width
            sizes = {"ids": n, "pos": n, "slot": n, "ctx": bucket, "qs": bucket + 1, "bt": bucket * w}
            off, at = {}, 0
            for k, size in sizes.items():
                off[k] = at
                at += size
            pinned = self.device.type == "cuda"
            host = torch.zeros(at, dtype=torch.int64, pin_memory=pinned)
            h = host.numpy()
            h[off["qs"]:off["qs"] + bucket + 1] = range(0, (bucket + 1) * q, q)
            dev = host.to(self.device) if pinned else host.clone()
            views = {k: dev[off[k]:off[k] + size] for k, size in sizes.items()}
            views["bt"] = views["bt"].view(bucket, w)
            views["mask"] = torch.zeros(bucket, q, q, dtype=torch.bool, device=self.device)
            views["logits"] = self._verify_logits()[:n]
            st = self._vstage[(bucket, q)] = {
                "bucket": bucket, "host": host, "np": h, "dev": dev, "off": off, "views": views,
                "tables": [None] * bucket, "mask_host": None, "mask_rows": -1,
                "mask_key": None}
            self._pad_verify_rows(st, 0, q)
        return st

    def _fill_verify_padding(self, v: dict[str, torch.Tensor], bsz: int, q: int) -> None:
        """Rows of padding sequences bsz.. on the device (the capture's warm-up: every
        row padding): token 0 at position 0, no K/V write (slot -1), context q (the tree
        part only), each query seeing only itself."""
        n = bsz * q
        v["ids"][n:] = 0
        v["pos"][n:] = 0
        v["slot"][n:] = -1
        v["ctx"][bsz:] = q
        eye = self._veye.get(q)
        if eye is None:
            eye = self._veye[q] = torch.eye(q, dtype=torch.bool, device=self.device)
        v["mask"][bsz:] = eye

    def _verify_forward(self, bucket: int, q: int, v: dict[str, torch.Tensor], hidden: dict) -> None:
        splits = splits_for(self.cache.k[0], bucket, self.width * self.cache.block_size,
                            q * (self.model.arch.num_heads // self.model.arch.num_kv_heads))
        self.model.forward(v["ids"], v["pos"], v["slot"], v["bt"], v["ctx"], self.cache,
                           num_splits=splits, logits_out=v["logits"], query_start=v["qs"],
                           tree_mask=v["mask"], hidden_out=hidden)

    def _capture_verify(self, bucket: int, q: int, v: dict[str, torch.Tensor]) -> None:
        """Capture the verify graph of (bucket, Q) into the shared pool: a warm-up run on a
        side stream first (Triton compilation, the linear planner's timing for this row
        count), with every row padding so nothing is written to the KV pool."""
        if self.cache.is_sleeping:
            raise RuntimeError("DecodeRunner: verify while the KV cache is asleep; wake() first")
        t0 = time.perf_counter()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        self._fill_verify_padding(v, 0, q)
        torch.cuda.synchronize(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._verify_forward(bucket, q, v, {})
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph, hidden = torch.cuda.CUDAGraph(), {}
        with graph_capture(graph, pool=self._pool):
            self._verify_forward(bucket, q, v, hidden)
        # The hidden-state outputs were allocated inside the capture: holding them keeps
        # their memory out of later captures' reach.
        self._vgraphs[(bucket, q)] = (graph, hidden)
        self._kv_ptr = self.cache.k[0].data_ptr()
        torch.cuda.synchronize(self.device)
        self.capture_s += time.perf_counter() - t0

    def _decode_graphs_first(self) -> None:
        """Capture the decode graphs before the first verify graph: capture() releases
        every graph, so verify graphs captured before the first decode step were dropped
        there and recaptured one by one, mid-run, as they were next used."""
        if self.use_graphs and not self._graphs:
            self.capture()

    def _drop_if_kv_moved(self) -> None:
        """Release every graph when the KV pool moved since they were captured (sleep/wake):
        they read stale addresses."""
        if self._kv_ptr is not None and self._kv_ptr != self.cache.k[0].data_ptr():
            self.release()

    @property
    def num_verify_graphs(self) -> int:
        return len(self._vgraphs)

    def capture_verify_graphs(self, max_batch: int, max_q: int) -> int:
        """Capture now every verify graph that steps of up to `max_batch` sequences and
        2..max_q query rows can replay (each bucket up to max_batch's that
        `verify_graph_bucket` serves) and that is not captured yet; returns how many were.
        Otherwise each is captured at its first use, which costs that step tens of
        milliseconds: a chain cut short by max_new_tokens verifies fewer rows, so such
        shapes turn up late and at random (session 12: one inside a timed bench run)."""
        if not self.use_graphs:
            return 0
        if self.cache.is_sleeping:
            raise RuntimeError("DecodeRunner.capture_verify_graphs() while the KV cache is asleep; wake() first")
        self._drop_if_kv_moved()
        self._decode_graphs_first()
        top = self.bucket_for(min(max_batch, self.max_batch))
        n = 0
        for bucket in self.buckets[:self.buckets.index(top) + 1]:
            for q in range(2, max_q + 1):
                if self.verify_graph_bucket(bucket, q) != bucket or (bucket, q) in self._vgraphs:
                    continue
                st = self._verify_stage(bucket, q)
                self._capture_verify(bucket, q, st["views"])
                st["mask_rows"] = -1  # the capture left padding in the device mask
                n += 1
        return n

    # ---- graphs -----------------------------------------------------------------------

    def capture(self) -> None:
        """(Re)capture one graph per bucket, largest first, into one shared memory pool."""
        if not self.use_graphs:
            return
        if self.cache.is_sleeping:
            raise RuntimeError("DecodeRunner.capture() while the KV cache is asleep; wake() first")
        self.release()
        t0 = time.perf_counter()
        saved = self._meta.clone()
        self._meta[:, :_NCOL] = self._pad.to(self.device)  # warm-up and capture write no K/V
        self._logits = torch.empty(self.max_batch, self.vocab_size, dtype=torch.float32,
                                   device=self.device)
        self._pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize(self.device)
        for bucket in reversed(self.buckets):
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # compiles the Triton kernels, initialises cuBLAS
                self._forward(bucket, self._logits[:bucket])
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph, hidden = torch.cuda.CUDAGraph(), {}
            with graph_capture(graph, pool=self._pool):
                self._forward(bucket, self._logits[:bucket], hidden_out=hidden)
            self._graphs[bucket] = graph
            # The hidden-state outputs (allocated in the capture) are held, so later
            # captures into the pool cannot reuse their memory.
            self._ghidden[bucket] = hidden
        self._meta.copy_(saved)
        self._kv_ptr = self.cache.k[0].data_ptr()
        self.num_captures += 1
        torch.cuda.synchronize(self.device)
        self.capture_s += time.perf_counter() - t0

    def _decode_splits(self) -> dict[int, int]:
        sms = num_sms(self.device)
        return {b: choose_num_splits(b, self.model.arch.num_kv_heads, self.max_model_len, sms=sms,
                                     block_n=block_n_for(self.cache.dtype), device=self.device)
                for b in self.buckets}

    def release(self) -> None:
        """Drop the graphs (decode, sampling and verify), their memory pool and the logits
        buffers (engine.sleep()); the next capture takes the split-K factors chosen now."""
        self.num_splits = self._decode_splits()
        self._graphs.clear()
        self._ghidden.clear()
        self._sgraphs.clear()
        self._served = None
        self._vgraphs.clear()
        self._vstage.clear()
        self._last_verify = None
        self._vlogits = None
        self._vcopy_done = None
        self._pool = None
        self._logits = None
        self._kv_ptr = None

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    # ---- sampling ---------------------------------------------------------------------

    def sample_greedy(self, seqs, logits: torch.Tensor,  # [B, vocab] float32
                      ) -> tuple[torch.Tensor, list[int], list[float], list[float]] | None:
        """Greedy tokens on the device with one host sync, as the engine's generic path
        computes greedy rows (`sampling.sample_streams` at temperature 0: argmax of the
        banned logits, lowest id on ties; logprob from log_softmax of the unbanned logits;
        the same function, so the same bits): (tokens [B], token ids, logprobs, processed
        logprobs = 0.0). None unless every request is greedy."""
        for seq in seqs:
            if seq.request.sampling_params.temperature > 0:
                return None
        rows: list[int] = []
        cols: list[int] = []
        for i, seq in enumerate(seqs):
            ban = seq.stop.banned_ids(seq.num_output)
            if ban:
                rows.extend([i] * len(ban))
                cols.extend(sorted(ban))
        b, dev = logits.shape[0], logits.device
        banned = None
        if rows:
            banned = torch.zeros(logits.shape, dtype=torch.bool, device=dev)
            banned[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = True
        zeros = torch.zeros(b, dtype=torch.int64, device=dev)
        s = sample_streams(logits, torch.zeros(b, dtype=torch.float32, device=dev), zeros, zeros,
                           banned=banned)
        host = torch.stack([s.token_ids.to(torch.float64), s.logprobs.to(torch.float64)]).tolist()
        return s.token_ids, [int(t) for t in host[0]], host[1], [0.0] * len(seqs)

    def sample_fast(self, seqs, logits: torch.Tensor,  # [B, vocab] float32
                    ) -> tuple[torch.Tensor, list[int], list[float], list[float]] | None:
        """One token per sequence for the logits of the decode step this runner just served,
        on the device with one copy each way (module docstring): (tokens [B] int64 on the
        device, a view valid until the next call; token ids; logprobs; processed
        logprobs), equal bit for bit to the engine's generic path. None, with no draw
        taken, when `logits` are not that step's or a row has top-k, top-p or a
        min_new_tokens ban at this position (or `sample_graphs` is off)."""
        served = self._served
        if not self.sample_graphs or served is None or logits is not served[0]:
            return None
        vocab = self.vocab_size
        for seq in seqs:
            p = seq.request.sampling_params
            if 0 < p.top_k < vocab or p.top_p < 1 or seq.stop.banned_ids(seq.num_output):
                return None
        n, padded = len(seqs), served[1]
        bucket = padded.shape[0]
        if n != logits.shape[0]:
            raise ValueError(f"sample_fast: {n} sequences for {logits.shape[0]} rows of logits")
        if self._scopy_done is not None:
            self._scopy_done.synchronize()  # the host buffer is still being read otherwise
        rows = []
        for seq in seqs:
            t = float(seq.request.sampling_params.temperature)
            if t > 0:  # greedy rows take no draw (nor does the generic path)
                rows.append((seq.rng.key, seq.rng.take(), _f64_bits(t)))
            else:
                rows.append((0, 0, _f64_bits(t)))
        host = self._shost
        host[:n] = torch.tensor(rows, dtype=torch.int64)
        if bucket > n:
            host[n:bucket] = self._spad
        self._sin[:bucket].copy_(host[:bucket], non_blocking=True)
        if self.device.type == "cuda":
            if self._scopy_done is None:
                self._scopy_done = torch.cuda.Event()
            self._scopy_done.record()
        if self.use_graphs:
            self._sample_graph(bucket).replay()
        else:
            self._sample_forward(bucket, padded)
        out = self._sout[:n].cpu()
        lps = out[:, _LP:].view(torch.float64)
        self.num_fast_samples += 1
        return (self._sout[:n, _TOKEN], out[:, _TOKEN].tolist(), lps[:, 0].tolist(),
                lps[:, 1].tolist())

    def _sample_forward(self, bucket: int, logits: torch.Tensor) -> None:  # [bucket, vocab]
        """The generic path's sampling ops on the static inputs of `bucket` rows (no host
        sync: capturable); results into the static output buffer."""
        x = self._sin[:bucket]
        temperature = x[:, _TEMP].view(torch.float64).float()
        s = sample_streams(logits, temperature, x[:, _KEY], x[:, _DRAW])
        o = self._sout[:bucket]
        o[:, _TOKEN].copy_(s.token_ids)
        o[:, _LP].view(torch.float64).copy_(s.logprobs)
        o[:, _PLP].view(torch.float64).copy_(s.processed_logprobs)

    def _sample_graph(self, bucket: int) -> torch.cuda.CUDAGraph:
        """The bucket's sampling graph, reading the decode graphs' logits buffer; captured
        at first use into the shared pool (after a warm-up on a side stream, as the other
        captures; the replay that follows overwrites the warm-up's outputs)."""
        graph = self._sgraphs.get(bucket)
        if graph is not None:
            return graph
        t0 = time.perf_counter()
        logits = self._logits[:bucket]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._sample_forward(bucket, logits)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with graph_capture(graph, pool=self._pool):
            self._sample_forward(bucket, logits)
        self._sgraphs[bucket] = graph
        torch.cuda.synchronize(self.device)
        self.capture_s += time.perf_counter() - t0
        return graph

    @property
    def num_sample_graphs(self) -> int:
        return len(self._sgraphs)
