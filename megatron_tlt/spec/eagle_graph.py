"""EAGLE chain drafting replayed from CUDA graphs (the GPU fast path of EagleProposer).

Why: on the H200 a speculative step at batch 1 spent 9.4 ms drafting a depth-4 chain
with a one-layer drafter whose kernels take well under a millisecond: ~600 eager torch
ops at 10-25 us of CPU each (tools/profile_generate.py, benchmarks/results/
gpu_2026-12-02_session4). A graph replays them in one launch.

What one replay computes, for a batch bucket (1, 2, 4, ..., 64 sequences):
1. extend: each sequence's new pairs (at most QUERY_TILE; in the steady state the
   tokens accepted at the last step), one tile per sequence through the first half of the
   layer, K/V written into its slot; then only the tile's last real pair, the root,
   attends over the slot (SlotKV.attend_one) and runs the rest of the layer and the head;
2. the chain: D levels of pick (greedy: argmax of log_softmax; sampled: the race over the
   processed draft distribution with the request's next noise draws, draw number =
   draws taken + level) and, below the last level, one layer forward writing the level's
   KV at index num_pairs + level. On CUDA a level's attention is the engine's paged decode
   kernel over the slot (SlotKV.attend_one) and, with top-k and top-p off, a sampled
   pick is one Triton kernel writing the tokens, flags and distributions in place
   (spec/triton_pick.py; the eager chain takes both too, so the paths still agree);
3. outputs in static buffers: tokens and finiteness flags [bucket, 2D] int64 (ONE
   device-to-host copy after the replay) and, for sampled chains, the draft
   distributions scattered to the target vocabulary [bucket, D + 1, vocab] (row 0 zero);
   for a verification that reads the drafts on the device, the tokens with failed rows'
   set to 0 and the failed rows.
The host then builds the DraftTrees exactly as the eager path (`_draft_chains`): a row's
chain stops at its depth cap; a non-finite level fails the whole tree (plain decode);
sampled rows advance their noise stream by the levels actually drafted
(`ChainLaunch.collect`). SpecDecoder may instead verify the drafts where they are
(`ChainLaunch.placeholder_trees` / `device_tokens` / `settle`; spec/decode.py).

Same numbers as the eager path: every op is the eager path's op on the same rows; the
extra rows (tile padding, levels below a row's cap, padding sequences) are row-local
(the drafter runs batch-invariant: 16-row matmul tiles, attention over whole slots), so
they cannot change a real row's bits; they write KV only at positions no real query has
seen yet (beyond the committed pairs, overwritten before they are read) or in a scratch
slot reserved for padding sequences. Caveat: the extend needs capacity for
num_pairs + QUERY_TILE + D positions, so the slot buffers may grow a little earlier
than on the eager path (capacity changes attention's reduction shapes; compare the two
paths at equal capacity).

Eligible steps (else the eager path, unchanged): chains, batched proposer, at most
MAX_BUCKET sequences, each with 1..QUERY_TILE new pairs and exactly their features
pending, and one sampling setting for the whole batch (all greedy, or all sampled with
the same temperature / top-k / top-p, baked into the graph).

Graph validity: keyed by (bucket, depth, sampling setting) and invalidated when the
drafter's KV buffers are reallocated (slot or capacity growth) or the gathered head of
a reduced vocabulary moves. The drafter's and the target's weights are read in place
(EngineWeights.update_weights copies in place; EagleDrafter.head_weight refreshes its
gathered head in place). Kill switch: MEGATRON_TLT_DRAFT_GRAPHS=0.
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from megatron_tlt.rollout.host import graph_capture
from megatron_tlt.rollout.sampling import exponential_noise, has_triton
from megatron_tlt.spec.drafter_kv import QUERY_TILE
from megatron_tlt.spec.sampling_ref import process_logits
from megatron_tlt.spec.sampling_ref import sample as race_sample
from megatron_tlt.spec.tree import DraftTree

MAX_BUCKET = 64
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def plan_rows(n: int) -> int:
    """The row count a step of n sequences is planned for: its bucket (a power of two, as
    BUCKETS up to MAX_BUCKET), so the eager path's live rows and the graphs' padded ones run
    the same projection configs (spec/drafter_kernels.py)."""
    return 1 << max(0, (int(n) - 1).bit_length())
_TOK, _SLOT, _LO, _N, _KEY, _DRAW = 0, QUERY_TILE, QUERY_TILE + 1, QUERY_TILE + 2, QUERY_TILE + 3, QUERY_TILE + 4
_NCOL = QUERY_TILE + 5


def enabled() -> bool:
    return os.environ.get("MEGATRON_TLT_DRAFT_GRAPHS", "1") != "0"


def fused_pick(lg: torch.Tensor, top_ks, top_ps) -> bool:
    """Whether a sampled chain pick over draft logits lg takes the one-kernel path
    (spec/triton_pick.py): a CUDA tensor, Triton present, MEGATRON_TLT_FUSED_PICK not 0,
    and top-k / top-p off for every row (process_logits' rule: top_k <= 0 or >= the
    draft vocabulary, top_p >= 1)."""
    if not lg.is_cuda or os.environ.get("MEGATRON_TLT_FUSED_PICK", "1") == "0" or not has_triton():
        return False
    v = lg.shape[-1]
    return all(k <= 0 or k >= v for k in top_ks) and all(p >= 1 for p in top_ps)


class ChainGraphs:
    """Static buffers and graphs of one EagleProposer. use_graphs=False runs the same
    function eagerly on the same padded shapes (CPU tests of the static-buffer path)."""

    def __init__(self, proposer, *, use_graphs: bool):
        self.p = proposer
        self.use_graphs = use_graphs
        self._bufs: dict[int, dict[str, torch.Tensor]] = {}
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph | None, dict]] = {}
        self._pool = None
        self._pad_slot: int | None = None
        self._copy_done = None
        self._kv_key = None
        self.num_steps = 0
        """Propose steps served (graph replays or, without graphs, eager runs)."""
        self.num_replays = 0
        self.num_captures = 0
        self.capture_s = 0.0
        """Wall seconds spent capturing (warm-ups included)."""
        self.num_invalidations = 0
        """Times every graph was dropped because a buffer it reads moved."""

    # ---- eligibility --------------------------------------------------------------------

    def setting(self, seqs, strategy) -> tuple | None:
        """The batch's sampling setting ("greedy",) or ("sampled", T, top_k, top_p), or
        None when this step must take the eager path."""
        p = self.p
        if not strategy.is_chain or not p.batched or not 0 < len(seqs) <= MAX_BUCKET:
            return None
        if not self._ready(seqs):
            return None
        # one_hot_chains: argmax chains (one-hot proposals for sampled targets)
        return self._sampling_setting(seqs, greedy=p.one_hot_chains)

    @staticmethod
    def _sampling_setting(seqs, *, greedy: bool = False) -> tuple | None:
        """("greedy",) when `greedy` or every sequence is greedy; ("sampled", T, top_k,
        top_p) when all share one sampled setting (baked into the graph); else None."""
        params = [s.request.sampling_params for s in seqs]
        if greedy or all(x.temperature <= 0 for x in params):
            return ("greedy",)
        key = {(float(x.temperature), max(int(x.top_k), 0), float(x.top_p)) for x in params}
        if len(key) != 1 or next(iter(key))[0] <= 0:
            return None
        return ("sampled",) + next(iter(key))

    def _ready(self, seqs) -> bool:
        """Every sequence has a drafter state with features for all its committed pairs,
        1..QUERY_TILE of them new, exactly those pending (what one tile extends)."""
        p = self.p
        for s in seqs:
            st = p.states.get(s.seq_id)
            n = len(s.token_ids) - 1 - (st.num_pairs if st else 0)
            if st is None or st.num_features != len(s.token_ids) - 1 or not 1 <= n <= QUERY_TILE:
                return False
            if sum(x.shape[0] for x in st.pending) != n:
                return False
        return True

    # ---- buffers ------------------------------------------------------------------------

    def _buffers(self, bucket: int) -> dict[str, torch.Tensor]:
        b = self._bufs.get(bucket)
        if b is None:
            d = self.p.drafter
            p0 = next(d.parameters())
            dev = p0.device
            pin = dev.type == "cuda"
            b = self._bufs[bucket] = {
                "host": torch.zeros(bucket, _NCOL, dtype=torch.int64, pin_memory=pin),
                "ints": torch.zeros(bucket, _NCOL, dtype=torch.int64, device=dev),
                "feats": torch.zeros(bucket * QUERY_TILE, d.arch.hidden_size, dtype=p0.dtype, device=dev),
                # the feature rows' destinations (pinned host twin: no staging allocation)
                "dest_host": torch.zeros(bucket * QUERY_TILE, dtype=torch.int64, pin_memory=pin),
                "dest": torch.zeros(bucket * QUERY_TILE, dtype=torch.int64, device=dev),
                # the failed-row flags read back after the verification (ChainLaunch.settle)
                "bad_host": torch.zeros(bucket, dtype=torch.bool, pin_memory=pin),
            }
        return b

    def _probs(self, buf, bucket: int, depth: int) -> torch.Tensor:
        """[bucket, depth + 1, vocab] float32 draft distributions of the fused pick, zeroed
        once: the kernel writes only the draft vocabulary's columns of levels 1..depth."""
        key = f"probs{depth}"
        if key not in buf:
            buf[key] = torch.zeros(bucket, depth + 1, self.p.drafter.arch.vocab_size,
                                   dtype=torch.float32, device=buf["ints"].device)
        return buf[key]

    def _pad(self) -> int:
        """A KV slot no sequence owns: padding sequences write there."""
        if self._pad_slot is None:
            self._pad_slot = self.p.kv.acquire()
        return self._pad_slot

    def reset(self) -> None:
        """The proposer's KV slots were all freed (the scratch slot too)."""
        self._pad_slot = None

    # ---- the step -----------------------------------------------------------------------

    @torch.no_grad()
    def propose(self, seqs, strategy, caps, setting) -> list[DraftTree]:
        return self.launch(seqs, strategy, caps, setting).collect()

    @torch.no_grad()
    def launch(self, seqs, strategy, caps, setting) -> "ChainLaunch":
        """Load the step's inputs and replay (no host sync): the drafts stay on the device
        until ChainLaunch.collect (or, for a verification that reads them there,
        ChainLaunch.settle). The drafter's own bookkeeping (pairs consumed) is done here;
        the noise streams are advanced by collect / advance_draws."""
        p = self.p
        n_seq = len(seqs)
        depth = min(strategy.depth, strategy.num_draft_nodes)
        states = [p.states[s.seq_id] for s in seqs]
        sampled = setting[0] == "sampled"
        bucket, buf = self._load_inputs(seqs, states, depth, sampled)
        out = self._run(bucket, depth, setting, buf)
        self.num_steps += 1
        self._consumed(seqs, states)
        draws = [s.rng.draws for s in seqs] if sampled else None
        return ChainLaunch(seqs=list(seqs), caps=list(caps), depth=depth, out=out, draws=draws,
                           _bad_host=buf["bad_host"][:n_seq], setting=setting)

    @torch.no_grad()
    def launch_ahead(self, launched: "ChainLaunch", verify_out, gidx: torch.Tensor,
                     hidden: torch.Tensor) -> "ChainAhead | None":
        """The next chain step of `launched`'s sequences, queued before the host has read
        this step's verification (SpecDecoder's draft-ahead): the inputs `launch` would
        build after the bookkeeping, built on the device from the verification's outputs
        still there. Sequence r's new pairs are its accepted tokens and bonus,
        verify_out.output_tokens[r, :n] with n = accept_length[r] + 1, and their features
        are the verify forward's hidden rows gidx[r, :n] (what the host would observe);
        every other input (slot, first pair = the root position, noise key and draw) is
        known on the host already. Same values in the same static buffers as `launch`
        (tokens and features beyond n zero, padding rows as there), so the same replay.
        The proposer's bookkeeping is left alone until `adopt`; a step that does not
        adopt it launches anew, rewriting the same pair KV. None (nothing queued) for
        chains deeper than a query tile less one."""
        p, seqs, depth, setting = self.p, launched.seqs, launched.depth, launched.setting
        if depth + 1 > QUERY_TILE:
            return None  # up to depth + 1 new pairs per sequence would not fit one tile
        n_seq = len(seqs)
        states = [p.states[s.seq_id] for s in seqs]
        lo = [len(s.token_ids) - 1 for s in seqs]  # the pairs `launched` committed
        sampled = setting[0] == "sampled"
        draws = [s.rng.draws for s in seqs] if sampled else None
        bucket, buf = self._load_rows(seqs, states, lo, depth, sampled, tokens=False)
        ints, feats = buf["ints"], buf["feats"]
        ints.copy_(buf["host"], non_blocking=True)
        self._copied(ints)
        q1 = depth + 1
        n = verify_out.accept_length[:n_seq] + 1  # [B] new pairs per sequence
        keep = torch.arange(q1, device=ints.device)[None, :] < n[:, None]  # [B, Q]
        toks = verify_out.output_tokens[:n_seq, :q1].masked_fill(~keep, 0)
        ints[:n_seq, _TOK:_TOK + q1] = toks
        ints[:n_seq, _N] = n
        feats.zero_()
        h = hidden.index_select(0, gidx[:n_seq, :q1].reshape(-1)).view(n_seq, q1, -1)
        tile = feats.view(bucket, QUERY_TILE, -1)
        tile[:n_seq, :q1] = h.to(feats.dtype).masked_fill(~keep[:, :, None], 0)
        out = self._run(bucket, depth, setting, buf)
        return ChainAhead(graphs=self, seq_ids=[s.seq_id for s in seqs], states=states, lo=lo,
                          depth=depth, setting=setting, draws=draws, out=out,
                          bad_host=buf["bad_host"][:n_seq])

    def _load_inputs(self, seqs, states, depth: int, sampled: bool) -> tuple[int, dict]:
        """(bucket, buffers) with the step's inputs queued into the static buffers: the
        int table (`_load_rows`) and each sequence's pending features at its tile rows."""
        bucket, buf = self._load_rows(seqs, states, [st.num_pairs for st in states], depth, sampled,
                                      tokens=True)
        dest, pieces = [], []
        for r, (s, st) in enumerate(zip(seqs, states)):
            n = len(s.token_ids) - 1 - st.num_pairs
            dest.extend(range(r * QUERY_TILE, r * QUERY_TILE + n))
            pieces.extend(st.pending)
        m = len(dest)
        buf["dest_host"].numpy()[:m] = dest
        ints, feats = buf["ints"], buf["feats"]
        ints.copy_(buf["host"], non_blocking=True)
        idx = buf["dest"][:m]
        idx.copy_(buf["dest_host"][:m], non_blocking=True)
        self._copied(ints)
        feats.zero_()
        src = pieces[0] if len(pieces) == 1 else torch.cat(pieces)  # one sequence: no concatenation
        feats.index_copy_(0, idx, src.to(feats.device, feats.dtype))
        return bucket, buf

    @staticmethod
    def _consumed(seqs, states) -> None:
        """The proposer's bookkeeping once a step's inputs are loaded: every committed pair
        consumed, no features pending."""
        for s, st in zip(seqs, states):
            st.num_pairs = len(s.token_ids) - 1
            st.pending = []

    def _load_rows(self, seqs, states, lo: list[int], depth: int, sampled: bool, *,
                   tokens: bool) -> tuple[int, dict]:
        """(bucket, buffers) with the step's per-row int table written into the pinned
        host buffer (not yet copied): each sequence's slot, first new pair lo and, sampled,
        noise key and draw count; with `tokens` also its new pairs' tokens and count
        (the host knows them; the draft-ahead writes them on the device); padding rows
        write one pair into the scratch slot. The drafter KV is sized for the step first."""
        n_seq = len(seqs)
        bucket = next(b for b in BUCKETS if b >= n_seq)
        pad = self._pad()
        self.p.kv.ensure_capacity(max(lo) + QUERY_TILE + depth)
        buf = self._buffers(bucket)
        if self._copy_done is not None:
            self._copy_done.synchronize()  # the pinned host buffer may still be read
        rows = [[0] * _NCOL for _ in range(bucket)]
        for r in range(n_seq, bucket):
            rows[r][_SLOT], rows[r][_N] = pad, 1
        for r, (s, st) in enumerate(zip(seqs, states)):
            row = rows[r]
            row[_SLOT], row[_LO] = st.slot, lo[r]
            if tokens:
                hi = len(s.token_ids) - 1
                row[_TOK:_TOK + hi - lo[r]] = s.token_ids[lo[r] + 1:hi + 1]
                row[_N] = hi - lo[r]
            if sampled:
                row[_KEY], row[_DRAW] = s.rng.key, s.rng.draws
        buf["host"].numpy()[:] = rows  # converted straight into the pinned buffer
        return bucket, buf

    def _copied(self, ints: torch.Tensor) -> None:
        """Record that the host buffers' copies are queued (one event, recorded again each
        step: `_load_rows` waits for it before writing them again)."""
        if ints.is_cuda:
            if self._copy_done is None:
                self._copy_done = torch.cuda.Event()
            self._copy_done.record()

    def adopt(self, ahead: "ChainAhead", seqs, caps) -> "ChainLaunch":
        """The ChainLaunch of a draft-ahead the proposer found valid for this step
        (EagleProposer.adopt): its bookkeeping, as `launch` does."""
        for s, st in zip(seqs, ahead.states):
            st.num_pairs = len(s.token_ids) - 1
            st.pending = []
        self.num_steps += 1
        return ChainLaunch(seqs=list(seqs), caps=list(caps), depth=ahead.depth, out=ahead.out,
                           draws=ahead.draws, _bad_host=ahead.bad_host, setting=ahead.setting)

    def _run(self, bucket: int, shape, setting: tuple, buf) -> dict[str, torch.Tensor]:
        """The step's body for `bucket` rows (shape: the chain depth; TreeGraphs: (depth,
        topk)): replayed from its graph on CUDA (captured at first use), else run."""
        if not self.use_graphs:
            return self._body(bucket, shape, setting, buf)
        kv, d = self.p.kv, self.p.drafter
        d.refresh_fused()  # in place: the graphs read the fused weights
        kv_key = (kv.k.data_ptr(), kv.v.data_ptr(), kv.capacity, kv.num_slots,
                  d.head_weight().data_ptr(), tuple(t.data_ptr() for _, t in d._fused.values()))
        if kv_key != self._kv_key:
            self.release()  # buffers moved: every graph reads stale addresses
            self._kv_key = kv_key
        key = (bucket, shape, setting)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = self._capture(bucket, shape, setting, buf)
        graph, out = entry
        graph.replay()
        self.num_replays += 1
        return out

    def _capture(self, bucket, shape, setting, buf):
        dev = buf["ints"].device
        t0 = time.perf_counter()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # Warm-up and capture run the real inputs: the body's writes go to positions past
        # each sequence's committed pairs (and the scratch slot), which the replay that
        # follows rewrites with the same values.
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            self._body(bucket, shape, setting, buf)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with graph_capture(graph, pool=self._pool):
            out = self._body(bucket, shape, setting, buf)
        self.num_captures += 1
        torch.cuda.synchronize(dev)
        self.capture_s += time.perf_counter() - t0
        return graph, out

    def release(self) -> None:
        if self._graphs:
            self.num_invalidations += 1
        self._graphs.clear()
        self._pool = None

    # ---- the captured function ------------------------------------------------------------

    def _extend_body(self, bucket: int, buf) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The captured extend: each row's new pairs (one tile per sequence) through the
        layer's first half, K/V into its slot; only the tile's last real pair, the root,
        goes on. Returns the roots' (f [bucket, hidden], draft logits, base [bucket]: the
        committed pairs after the extend, the first draft level's pair index)."""
        d, kv = self.p.drafter, self.p.kv
        ints, feats = buf["ints"], buf["feats"]
        dev = ints.device
        slot, lo, n = ints[:, _SLOT], ints[:, _LO], ints[:, _N]
        tile = torch.arange(QUERY_TILE, device=dev)
        last = lo[:, None] + tile  # [bucket, tile]: pair index of each tile row
        pair = last.reshape(-1)
        # RoPE positions within the drafter's table: only padding rows (tile rows past a
        # sequence's pairs, levels past its cap) reach beyond it, near max_position_embeddings
        top = d.rope_cos.shape[0] - 1
        tile_tokens = ints[:, _TOK:_TOK + QUERY_TILE].reshape(-1)
        tile_slots = slot[:, None].expand(bucket, QUERY_TILE).reshape(-1)
        # Only each tile's root (its last real pair) goes on: the other pairs' K/V are all
        # the chain needs of them (as in the eager extend).
        root = torch.arange(bucket, device=dev) * QUERY_TILE + n - 1
        f, lg, _ = d.forward_kv(tile_tokens, feats, (pair + 1).clamp(max=top), kv, tile_slots, pair,
                                rows=bucket * QUERY_TILE, query=root, query_rows=bucket)
        return f, lg, lo + n

    def _body(self, bucket: int, depth: int, setting: tuple, buf) -> dict[str, torch.Tensor]:
        """Extend + chain for `bucket` rows of static inputs; no host syncs, no host->device
        copies (capturable)."""
        d = self.p.drafter
        a, kv = d.arch, self.p.kv
        ints = buf["ints"]
        dev = ints.device
        slot = ints[:, _SLOT]
        f, lg, base = self._extend_body(bucket, buf)
        top = d.rope_cos.shape[0] - 1
        out_ints = torch.zeros(bucket, 2 * depth, dtype=torch.int64, device=dev)
        out = {"ints": out_ints}
        sampled = setting[0] == "sampled"
        pick = sampled and fused_pick(lg, [setting[2]], [setting[3]])
        greedy = not sampled and fused_pick(lg, [0], [1.0])  # one kernel too (triton_pick.greedy_pick)
        if greedy:
            from megatron_tlt.spec.triton_pick import greedy_pick
        if pick:  # one kernel per level (spec/triton_pick.py), writing into static outputs
            from megatron_tlt.spec.triton_pick import chain_pick
            out["probs"] = self._probs(buf, bucket, depth)  # zero outside the draft vocabulary
            temp = torch.full((bucket,), setting[1], dtype=torch.float32, device=dev)
        elif sampled:
            out["probs"] = torch.zeros(bucket, depth + 1, a.vocab_size, dtype=torch.float32, device=dev)
        ok = None
        if depth > 1:  # every level's K/V index, key count, position and flat destination at once
            lvl_idx = base[None, :] + torch.arange(depth - 1, device=dev)[:, None]  # [depth - 1, bucket]
            lvl_ctx = lvl_idx + 1
            lvl_pos = lvl_ctx.clamp(max=top)
            lvl_map = torch.add(lvl_idx, slot[None, :], alpha=kv.capacity)
        for lvl in range(depth):
            if pick:
                chain_pick(lg, temp, ints[:, _KEY], ints[:, _DRAW], lvl, d.draft_to_target,
                           out["probs"][:, lvl + 1], out_ints[:, lvl], out_ints[:, depth + lvl], ok)
                tok = out_ints[:, lvl]
            elif greedy:
                greedy_pick(lg, d.draft_to_target, out_ints[:, lvl], out_ints[:, depth + lvl], ok)
                tok = out_ints[:, lvl]
            elif sampled:
                _, temp, top_k, top_p = setting
                qd = process_logits(lg, temp, top_k, top_p)
                noise = exponential_noise(ints[:, _KEY], ints[:, _DRAW] + lvl, qd.shape[-1], dev)
                tok = race_sample(qd, noise)
                out["probs"][:, lvl + 1] = d.scatter_to_target(qd).float()
            else:
                tok = torch.log_softmax(lg.float(), dim=-1).argmax(-1)  # first max = lowest id
            if not (pick or greedy):
                finite = torch.isfinite(lg).all(-1)
                if ok is not None:
                    finite &= ok
                tok = d.to_target_ids(tok)
                out_ints[:, lvl] = tok
                out_ints[:, depth + lvl] = finite.long()
            if lvl == depth - 1:
                break
            f, lg, ok = d.forward_kv(tok, f, lvl_pos[lvl], kv, slot, lvl_idx[lvl], rows=bucket, sanitize=True,
                                     slot_mapping=lvl_map[lvl], context_lens=lvl_ctx[lvl])
        # For a verification that reads the drafts on the device (ChainLaunch.settle): a
        # row with a non-finite level fails (as collect decides for full-depth chains), and
        # its tokens are replaced by 0 so they stay valid ids for the target's forward.
        out["bad"] = (out_ints[:, depth:] == 0).any(-1)
        out["tokens"] = out_ints[:, :depth].masked_fill(out["bad"][:, None], 0)
        return out


@dataclasses.dataclass(eq=False)
class ChainAhead:
    """A chain step queued before the previous step's verification was read
    (ChainGraphs.launch_ahead), waiting for EagleProposer.adopt."""

    graphs: ChainGraphs
    seq_ids: list
    states: list
    """The proposer's per-sequence states at launch (the same objects must still be there)."""
    lo: list[int]
    """Each sequence's first new pair (its root position at the previous step)."""
    depth: int
    setting: tuple
    draws: list[int] | None
    """Sampled: each noise stream's draw count the chain started from."""
    out: dict[str, torch.Tensor]
    bad_host: torch.Tensor

    def device_tokens(self) -> torch.Tensor:
        """[B, D] int64 drafted target ids on the device, failed rows 0 (what the adopted
        ChainLaunch.device_tokens returns; SpecDecoder's verify-ahead reads them)."""
        return self.out["tokens"][:len(self.seq_ids)]


@dataclasses.dataclass
class ChainLaunch:
    """A chain step replayed but not yet read back (ChainGraphs.launch)."""

    seqs: list
    caps: list[int]
    depth: int
    out: dict[str, torch.Tensor]
    """The replay's static outputs: "ints" [bucket, 2D] tokens and finiteness flags,
    "tokens" [bucket, D] the tokens with failed rows' set to 0, "bad" [bucket] bool,
    "probs" [bucket, D + 1, vocab] for sampled chains."""
    draws: list[int] | None
    """Sampled chains: each noise stream's draw count at launch (the chain's level l used
    draw draws[i] + l)."""
    plan: object = None
    """The verification's FastPlan, set by the SpecDecoder that verifies these drafts on
    the device."""
    _bad_host: torch.Tensor | None = None
    setting: tuple | None = None
    """The sampling setting the chains were drafted with (ChainGraphs.setting)."""

    def keep_ints(self) -> None:
        """Hold a device copy of the tokens and finiteness flags, for `settle` after a
        draft-ahead replays the same graph (whose static outputs these are) before the
        host reads this step's failures."""
        n = len(self.seqs)
        self.out = dict(self.out, ints=self.out["ints"][:n].clone())

    @staticmethod
    def _drafted(row: list[int], depth: int, levels: int) -> tuple[int, bool]:
        """(levels drafted before the first non-finite one, whether one was non-finite)
        of a row of "ints" whose chain stops at `levels`."""
        finite = row[depth:depth + levels]
        failed = not all(finite)
        return (finite.index(0) if failed else levels), failed

    def collect(self) -> list[DraftTree]:
        """The DraftTrees, as the eager path builds them (one device-to-host copy): a row's
        chain stops at its depth cap; a non-finite level fails the whole tree (plain
        decode); sampled rows' streams advance by the levels actually drafted."""
        depth, out = self.depth, self.out
        flat = out["ints"][:len(self.seqs)].tolist()
        trees = []
        for r, (s, cap) in enumerate(zip(self.seqs, self.caps)):
            root = s.token_ids[-1]
            row = flat[r]
            n_ok, failed = self._drafted(row, depth, min(depth, cap))
            toks = row[:n_ok]  # up to the first failed level
            if self.draws is not None:
                s.rng.draws = self.draws[r] + len(toks)
            if failed:
                trees.append(DraftTree.failed(root, "non-finite drafter logits"))
            else:
                probs = out["probs"][r, :len(toks) + 1] if self.draws is not None else None
                trees.append(DraftTree([root] + toks, list(range(-1, len(toks))), probs))
        return trees

    # ---- verification on the device's drafts (SpecDecoder's deferred step) -------------

    @property
    def full_depth(self) -> bool:
        """Every chain is drafted to full depth (no cap below it): the trees' shapes are
        known before the drafts are read."""
        return all(c >= self.depth for c in self.caps)

    def placeholder_trees(self) -> list[DraftTree]:
        """Chains of full depth with token 0 at every draft node (the drafts themselves
        are `device_tokens`) and, sampled, the device's draft distributions."""
        d, n = self.depth, len(self.seqs)
        parents = list(range(-1, d))
        probs = self.out["probs"][:n, :d + 1].unbind(0) if self.draws is not None else [None] * n
        pad = [0] * d
        return [DraftTree([s.token_ids[-1]] + pad, parents, p) for s, p in zip(self.seqs, probs)]

    def device_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, D] int64 drafted target ids, failed rows 0; [B] bool failed rows), on the
        device."""
        n = len(self.seqs)
        return self.out["tokens"][:n], self.out["bad"][:n]

    def advance_draws(self) -> None:
        """Sampled chains: every stream past its D draft draws (what collect does for a
        chain that did not fail), before the verification takes its own draws."""
        if self.draws is not None:
            for s, d0 in zip(self.seqs, self.draws):
                s.rng.draws = d0 + self.depth

    def queue_failures(self) -> None:
        """Queue the failed-row flags' copy to the host behind the replay (no sync), for
        settle: into ChainGraphs' pinned buffer (the previous step read it back before
        this step's launch)."""
        bad = self.out["bad"][:len(self.seqs)]
        self._bad_host.copy_(bad, non_blocking=bad.is_cuda)

    def settle(self) -> list[bool]:
        """After the verification's device-to-host copy (which waited for the flags' copy
        queued before it): which rows failed (a non-finite level). A failed row's noise
        stream is set back to where collect leaves it (the levels drafted before the
        failure), undoing advance_draws and the verification's draws: the row then
        decodes plainly exactly as on the collect path. The drafts are read back only
        when a row failed."""
        failed = self._bad_host.tolist()
        if any(failed) and self.draws is not None:
            flat = self.out["ints"][:len(self.seqs)].tolist()
            for r, s in enumerate(self.seqs):
                if failed[r]:
                    s.rng.draws = self.draws[r] + self._drafted(flat[r], self.depth, self.depth)[0]
        return failed
