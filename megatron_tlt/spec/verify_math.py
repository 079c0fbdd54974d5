"""The verification fast path of the speculative-decoding step (`SpecDecoder` in
megatron_tlt.spec.decode uses it).

When every row of the step is greedy, or every row
is sampled with temperature > 0 and top-k and top-p off, the math after the verify
forward runs on static buffers at a padded batch (a power of two, <= MATH_MAX_BATCH,
bucket x Q <= MATH_MAX_ROWS): one pinned non-blocking copy of the per-row int table (tree,
noise stream keys and draw numbers, temperature, node count; while a min_new_tokens ban
holds, a second table of the stop ids banned at each node, <= MATH_MAX_BAN), the noise
drawn on the device, the verify op, the logprobs, the outputs packed into one buffer and
ONE device-to-host copy. On CUDA the math is one graph replay per step (a graph per
(mode, bucket, Q, ban columns), captured lazily into one memory pool);
`MEGATRON_TLT_VERIFY_MATH_GRAPHS=0` turns the graphs off (the same math then runs eagerly
on the same buffers and shapes; read when the SpecDecoder is built). Other steps take the
general path (`_verify_general`). The two compute the same function: bit for bit on CPU
(tests/unit/test_verify_fast.py); on CUDA the padded shape may change a reduction's order
and so the last bit of a probability (as a different batch size already could), never
the distribution. Graph replay and the eager math at the same padded shape agree bit for
bit (tests/gpu/test_spec_gpu.py). On CUDA, sampled steps without a ban take the target
probabilities and the logprobs from two Triton kernels (spec/triton_verify_probs.py: the
same function in other roundings, a few float32 ulps from the torch ops; off with
MEGATRON_TLT_FUSED_VERIFY_PROBS=0).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import struct
import time

import torch

from megatron_tlt.rollout.host import graph_capture
from megatron_tlt.rollout.sampling import exponential_noise, has_triton, uniform_noise
from megatron_tlt.spec import _ops
from megatron_tlt.spec.tree import DraftTree
from megatron_tlt.spec.verify import VerifyOutput, verify_tree_greedy, verify_tree_rejection


MATH_MAX_BATCH = 64
"""Largest batch bucket of the verification fast path; larger batches take the general path."""
MATH_MAX_ROWS = 512
"""Largest bucket x Q of the fast path: its static logits and draft-probability buffers hold
this many vocabulary rows each (311 MB each at a 151,936 vocabulary)."""
MATH_MAX_BAN = 16
"""Most stop ids a node may have banned (min_new_tokens) on the fast path
(MEGATRON_TLT_VERIFY_FAST_BAN=0: steps under a ban take the general path, as before 6a92f92)."""
GRAPHS_ENV = "MEGATRON_TLT_VERIFY_MATH_GRAPHS"
FUSED_PROBS_ENV = "MEGATRON_TLT_FUSED_VERIFY_PROBS"

# Columns of the fast path's per-row int table after the tree (parents [0, Q), draft
# tokens [Q, 2Q)): noise stream key, draw number of the coins, draw number of the exp-noise,
# temperature (float64 bits), real nodes (root included).
_KEY, _COIN_DRAW, _NOISE_DRAW, _TEMP, _NODES = range(5)
_NCOL = 5


def _f64_bits(x: float) -> int:
    """The IEEE float64 bits of x as a signed int64 (read back on the device with .view)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


# _f64_bits of a sampled row's temperature, per value (a run has few): the cache keys by
# ==, which would confuse 0.0 with -0.0, but sampled temperatures are > 0.
_temperature_bits = functools.lru_cache(maxsize=256)(_f64_bits)


def sampled_probs(logits: torch.Tensor,  # [B, Q, vocab]
                  temperature: torch.Tensor,  # [B] float32, > 0
                  ) -> torch.Tensor:  # [B, Q, vocab] float32
    """process_logits(logits, temperature) with temperature > 0 and top-k, top-p off: its
    ops in its order (divide, softmax, renormalise) without the greedy branch it adds for
    tensor temperatures (an argmax and a one-hot of [B, Q, vocab]). Bit for bit the same
    (tests/unit/test_verify_fast.py)."""
    return _normalised_softmax(logits.float() / temperature[:, None, None])


def _normalised_softmax(scaled: torch.Tensor) -> torch.Tensor:
    """process_logits' softmax and renormalisation of logits / T."""
    probs = torch.softmax(scaled, dim=-1)
    return probs / probs.sum(-1, keepdim=True)


@dataclasses.dataclass(frozen=True)
class FastPlan:
    """A verify step the fast path takes (`VerifyMath.plan`)."""

    mode: str
    """"greedy"; "sampled" (draft_probs given); "one_hot" (sampled, one-hot proposals)."""
    batch: int
    bucket: int
    """batch padded to a power of two."""
    q: int
    """query rows (tree nodes) per sequence."""
    ban: int = 0
    """stop ids banned per node (min_new_tokens): columns of the ban table; 0: no ban."""


def canonical_device(device: torch.device | str) -> torch.device:
    """The device with its index: torch.device("cuda") != torch.device("cuda:0"), and a
    tensor's .device always carries the index (the in-place logits check compares them)."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


class VerifyMath:
    """The verification math of `SpecDecoder` on static buffers at a padded batch, replayed
    from a CUDA graph per (mode, bucket, Q) on CUDA (see the module docstring).

    Static inputs: the per-row int table [bucket, 2Q + 5] (`_load`: one pinned, non-blocking
    host-to-device copy), the logits [bucket, Q, vocab] (the verify forward's output read in
    place when its storage holds bucket x Q rows at the address the graph was captured
    with, e.g. the decode runner's static verify logits; else copied into our buffer), the
    draft probabilities [bucket, Q, vocab] (written by TreeBatch.pack). Outputs: one
    float64 buffer [bucket, 4Q + 1] (accept_index, accept_length, output tokens, logprobs,
    processed logprobs) fetched with one device-to-host copy, and the accepted nodes' rows
    [bucket, Q] for the hidden-state gather.

    Padding sequences (rows batch..bucket) are a root alone (token 0, every other node
    padding): valid input that reads no draft probability and no coin; their outputs are
    ignored. Their logits rows hold whatever was there (zeros, an earlier step's rows).
    With max_depth = Q - 1 the ops give the general path's walk (no tree is deeper), with
    more -1 columns.
    """

    def __init__(self, device: torch.device | str, vocab: int, *, use_graphs: bool, impl: str | None = None,
                 fused_probs: bool | None = None):
        self.device = canonical_device(device)
        self.vocab = vocab
        self.impl = impl
        # Sampled steps without a ban take the target probabilities and logprobs from
        # spec/triton_verify_probs.py (None: on CUDA with Triton, unless
        # MEGATRON_TLT_FUSED_VERIFY_PROBS=0; True forces it, e.g. under the interpreter).
        if fused_probs is None:
            fused_probs = (self.device.type == "cuda" and has_triton()
                           and os.environ.get(FUSED_PROBS_ENV, "1") != "0")
        self.fused_probs = bool(fused_probs)
        impl_name = impl or os.environ.get("MEGATRON_TLT_VERIFY_IMPL", "auto")
        # Capture needs the compiled CUDA op (the PyTorch reference loops on data: syncs).
        self.use_graphs = bool(use_graphs and self.device.type == "cuda" and impl_name != "reference"
                               and _ops.has_kernel("cuda"))
        self._static: dict[tuple[int, int], dict] = {}  # (bucket, Q) -> small static tensors
        self._rows = 0  # vocabulary rows the big buffers hold
        self._logits: torch.Tensor | None = None  # [rows * vocab] float32
        self._dp: torch.Tensor | None = None  # [rows * vocab] float32
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}  # (mode, bucket, Q, source ptr, ban)
        self._in_place: dict[tuple[str, int, int], int] = {}  # (mode, bucket, Q) -> ptr
        self._in_place_miss: dict[tuple[str, int, int], int] = {}  # the last other ptr seen
        self._pool = None
        self.num_steps = 0
        self.num_captures = 0
        self.capture_s = 0.0
        """Wall seconds spent capturing (warm-ups included)."""
        self.num_replays = 0

    @staticmethod
    def plan(seqs, trees: list[DraftTree], vocab: int) -> FastPlan | None:
        """The fast path's plan for this step, or None (general path)."""
        b = len(seqs)
        if b > MATH_MAX_BATCH:
            return None
        bucket = 1 << (b - 1).bit_length()
        q = max(len(t.tokens) for t in trees)
        if bucket * q > MATH_MAX_ROWS:
            return None
        greedy = ban = 0
        for s in seqs:
            # banned_ids(n) is empty for every n >= min_new_tokens and the same set below:
            # the root's output position has the most any node has.
            ban = max(ban, len(s.stop.banned_ids(len(s.token_ids) - s.prompt_len)))
            p = s.request.sampling_params
            if p.temperature <= 0:
                greedy += 1
            elif not ((p.top_k <= 0 or p.top_k >= vocab) and p.top_p >= 1):
                return None
        if greedy == b:
            mode = "greedy"
        elif greedy == 0:
            mode = "sampled" if any(t.draft_probs is not None for t in trees) else "one_hot"
        else:
            return None
        if ban > MATH_MAX_BAN or (ban and os.environ.get("MEGATRON_TLT_VERIFY_FAST_BAN", "1") == "0"):
            return None
        return FastPlan(mode=mode, batch=b, bucket=bucket, q=q, ban=ban)

    # ---- buffers ----------------------------------------------------------------------

    def release(self) -> None:
        """Drop the graphs, their memory pool and the big buffers."""
        self._graphs.clear()
        self._in_place.clear()
        self._in_place_miss.clear()
        self._pool = None
        self._logits = self._dp = None
        self._rows = 0

    def _reserve(self, rows: int) -> None:
        """Big buffers for `rows` vocabulary rows. Growing drops every graph (they hold the
        old addresses); batches mostly shrink during a rollout, so this is rare."""
        if rows > self._rows:
            self.release()
            self._rows = rows

    def _big(self, name: str, bucket: int, q: int) -> torch.Tensor:  # [bucket, Q, vocab]
        buf = getattr(self, name)
        if buf is None:  # zeros: padding rows start finite
            buf = torch.zeros(self._rows * self.vocab, dtype=torch.float32, device=self.device)
            setattr(self, name, buf)
        return buf[:bucket * q * self.vocab].view(bucket, q, self.vocab)

    def draft_probs_buffer(self, plan: FastPlan) -> torch.Tensor:  # [bucket, Q, vocab] float32
        """The static draft probabilities, for TreeBatch.pack(probs_out=...)."""
        self._reserve(plan.bucket * plan.q)
        return self._big("_dp", plan.bucket, plan.q)

    def _small(self, bucket: int, q: int) -> dict:
        st = self._static.get((bucket, q))
        if st is None:
            dev, ncol = self.device, 2 * q + _NCOL
            rows = torch.arange(bucket, device=dev)[:, None]
            st = {"ints": torch.zeros(bucket, ncol, dtype=torch.int64, device=dev),
                  "host": torch.zeros(bucket, ncol, dtype=torch.int64, pin_memory=dev.type == "cuda"),
                  "pad": [-1] * q + [0] + [-1] * (q - 1) + [0, 0, 0, _f64_bits(1.0), 1],
                  "verify": VerifyOutput.empty(bucket, q - 1, dev),
                  "out": torch.zeros(bucket, 4 * q + 1, dtype=torch.float64, device=dev),
                  "gidx": torch.zeros(bucket, q, dtype=torch.int64, device=dev),
                  "rows": rows, "base": rows * q, "cols": torch.arange(q, device=dev),
                  "zeros": torch.zeros(bucket, q, dtype=torch.float64, device=dev)}
            self._static[(bucket, q)] = st
        return st

    def _load(self, plan: FastPlan, seqs, trees: list[DraftTree]) -> None:
        """The per-row int table, built in Python, host -> device in one copy (on CPU written
        into the static table itself). Sampled rows take their two draws here, coins first
        (the order of the general path)."""
        st = self._small(plan.bucket, plan.q)
        q, sampled = plan.q, plan.mode != "greedy"
        one = _f64_bits(1.0)
        rows = []
        for s, t in zip(seqs, trees):
            k = len(t.tokens)
            pad = [-1] * (q - k)
            if sampled:
                rng = s.rng
                temp = _temperature_bits(s.request.sampling_params.temperature)
                tail = [rng.key, rng.take(), rng.take(), temp, k]
            else:
                tail = [0, 0, 0, one, k]
            rows.append(t.parents + pad + t.tokens + pad + tail)
        rows.extend([st["pad"]] * (plan.bucket - plan.batch))
        if plan.ban:
            self._load_ban(plan, seqs, trees)
        if self.device.type == "cuda":
            # Reusing the pinned buffer is safe: the previous step's copy out of it finished
            # before that step's blocking device-to-host copy of the outputs returned.
            st["host"].numpy()[:] = rows  # converted straight into the buffer
            st["ints"].copy_(st["host"], non_blocking=True)
        else:
            st["ints"].numpy()[:] = rows

    def _ban_table(self, bucket: int, q: int, k: int) -> dict:
        """Static [bucket, Q, k] stop ids banned at each node (-1: none) and its pinned
        host twin."""
        st = self._small(bucket, q)
        if f"ban{k}" not in st:
            st[f"ban{k}"] = torch.full((bucket, q, k), -1, dtype=torch.int64, device=self.device)
            st[f"ban_host{k}"] = torch.full((bucket, q, k), -1, dtype=torch.int64,
                                            pin_memory=self.device.type == "cuda")
        return st

    def _load_ban(self, plan: FastPlan, seqs, trees: list[DraftTree]) -> None:
        """The general path's `_ban` as a table: node i of sequence b (depth d) bans
        stop.banned_ids(outputs so far + d), sorted; padding nodes and rows ban nothing."""
        k = plan.ban
        st = self._ban_table(plan.bucket, plan.q, k)
        host = st[f"ban_host{k}"]
        h = host.numpy()
        h.fill(-1)
        for b, (s, t) in enumerate(zip(seqs, trees)):
            n_out = len(s.token_ids) - s.prompt_len
            if not s.stop.banned_ids(n_out):
                continue
            for i, d in enumerate(t.depths()):
                ids = sorted(s.stop.banned_ids(n_out + d))
                h[b, i, :len(ids)] = ids
        st[f"ban{k}"].copy_(host, non_blocking=self.device.type == "cuda")

    def _source(self, plan: FastPlan, logits: torch.Tensor,  # [B * Q, vocab]
                ) -> tuple[torch.Tensor, int | None]:
        """(logits [bucket, Q, vocab] the math reads, the data_ptr when read in place)."""
        n, v = plan.bucket * plan.q, self.vocab
        self._reserve(n)
        if (logits.dtype == torch.float32 and logits.device == self.device and logits.dim() == 2
                and logits.shape[1] == v and logits.is_contiguous()
                and logits.untyped_storage().nbytes() >= (logits.storage_offset() + n * v) * 4):
            ptr = logits.data_ptr()
            if not self.use_graphs or self._in_place_ok((plan.mode, plan.bucket, plan.q), ptr):
                return logits.as_strided((plan.bucket, plan.q, v), (plan.q * v, v, 1)), ptr
        own = self._big("_logits", plan.bucket, plan.q)
        own.view(n, v)[:logits.shape[0]].copy_(logits)
        return own, None

    def _in_place_ok(self, key: tuple[str, int, int], ptr: int) -> bool:
        """One in-place graph per (mode, bucket, Q), reading the first address seen (the
        decode runner's static verify logits, normally); other addresses are copied. An
        address seen on two steps in a row instead of it takes over (the runner's buffer
        moved, e.g. after engine.sleep()); the old graph is dropped. Alternating addresses
        (fresh allocations) never take over, so graphs are not recaptured every step."""
        cur = self._in_place.setdefault(key, ptr)
        if cur == ptr:
            self._in_place_miss.pop(key, None)
            return True
        if self._in_place_miss.get(key) != ptr:
            self._in_place_miss[key] = ptr
            return False
        del self._in_place_miss[key]
        for k in [k for k in self._graphs if k[:4] == key + (cur,)]:  # any ban width
            del self._graphs[k]
        self._in_place[key] = ptr
        return True

    # ---- the math ---------------------------------------------------------------------

    def run(self, plan: FastPlan, seqs, trees: list[DraftTree],
            logits: torch.Tensor,  # [B * Q, vocab] the verify forward's logits
            drafts: tuple[torch.Tensor, torch.Tensor] | None = None,
            draft_probs: torch.Tensor | None = None,
            ahead=None,
            ) -> tuple[list[list[float]], torch.Tensor]:
        """(host rows [B][4Q + 1], accepted nodes' rows of the verify output [B, Q] on the
        device). drafts: chains whose tokens are still on the device (trees of their
        shape with placeholder tokens): ([B, Q - 1] int64 draft ids, [B] bool rows that
        failed); a failed row is verified as its root alone (valid input, outputs unused).
        draft_probs: sampled mode, the draft distributions [>= B, Q, vocab] float32 on
        the device (rows 0..B-1 used) read where they are (e.g. the chain drafter's static
        output) instead of from `draft_probs_buffer`; copied there when their shape does
        not cover the bucket.
        ahead: called as ahead(verify_output, gidx) (the math's static outputs on the
        device, rows 0..B-1 real) after the math is queued and before the host waits for
        it; on CUDA the results' copy to the host is queued before the call, so work the
        call queues (the next step's drafting: SpecDecoder's draft-ahead) runs on the
        device while the host reads the results and does its bookkeeping."""
        self._reserve(plan.bucket * plan.q)
        st = self._small(plan.bucket, plan.q)
        dp = None
        if draft_probs is not None and plan.mode == "sampled":
            if (draft_probs.shape[0] >= plan.bucket and tuple(draft_probs.shape[1:]) == (plan.q, self.vocab)
                    and draft_probs.dtype == torch.float32 and draft_probs.is_contiguous()
                    and draft_probs.device == self.device):
                dp = draft_probs[:plan.bucket]
            else:
                self._big("_dp", plan.bucket, plan.q)[:plan.batch].copy_(draft_probs[:plan.batch])
        self._load(plan, seqs, trees)
        if drafts is not None:
            tok, bad = drafts
            ints, b, q = st["ints"], plan.batch, plan.q
            ints[:b, q + 1:2 * q] = tok.masked_fill(bad[:, None], -1)
            ints[:b, 1:q].masked_fill_(bad[:, None], -1)
        src, ptr = self._source(plan, logits)
        if self.use_graphs:
            key = (plan.mode, plan.bucket, plan.q, ptr, plan.ban, None if dp is None else dp.data_ptr())
            graph = self._graphs.get(key)
            if graph is None:
                graph = self._graphs[key] = self._capture(plan, src, dp)
            graph.replay()
            self.num_replays += 1
        else:
            self._math(plan.mode, plan.bucket, plan.q, src, plan.ban, dp)
        self.num_steps += 1
        out = st["out"][:plan.batch]
        if ahead is None:
            return out.cpu().tolist(), st["gidx"][:plan.batch]  # the one D2H copy
        if out.is_cuda:
            host = st.get("out_host")
            if host is None:
                host = st["out_host"] = torch.zeros(st["out"].shape, dtype=st["out"].dtype, pin_memory=True)
                st["out_ready"] = torch.cuda.Event()
            # The previous step read this pinned buffer after its event: free to overwrite.
            host[:plan.batch].copy_(out, non_blocking=True)
            st["out_ready"].record()
            ahead(st["verify"], st["gidx"])
            st["out_ready"].synchronize()  # the results only, not what ahead queued after them
            rows = host[:plan.batch].tolist()
        else:
            rows = out.tolist()
            ahead(st["verify"], st["gidx"])
        return rows, st["gidx"][:plan.batch]

    def _capture(self, plan: FastPlan, src: torch.Tensor,
                 dp: torch.Tensor | None = None) -> "torch.cuda.CUDAGraph":
        """Warm up on a side stream (first-call initialisation stays out of the graph),
        then capture into the shared pool. Graphs never run concurrently and their outputs
        are our static buffers, so they can share the pool's intermediates."""
        dev = self.device
        t0 = time.perf_counter()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        cur = torch.cuda.current_stream(dev)
        side = torch.cuda.Stream(dev)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            self._math(plan.mode, plan.bucket, plan.q, src, plan.ban, dp)
        cur.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with graph_capture(graph, pool=self._pool):
            self._math(plan.mode, plan.bucket, plan.q, src, plan.ban, dp)
        self.num_captures += 1
        torch.cuda.synchronize(dev)
        self.capture_s += time.perf_counter() - t0
        return graph

    def _math(self, mode: str, bucket: int, q: int,
              logits: torch.Tensor,  # [bucket, Q, vocab] float32
              ban: int = 0,  # columns of the ban table (0: no min_new_tokens ban this step)
              dp: torch.Tensor | None = None,  # [bucket, Q, vocab] draft probs (default: _dp)
              ) -> None:
        """The general path's math (`SpecDecoder._verify_general`) for one mode, on the
        static buffers, with no host sync (capturable)."""
        st = self._static[(bucket, q)]
        ints, out, dev = st["ints"], st["verify"], self.device

        def banned(x: torch.Tensor) -> torch.Tensor:
            """x with the ban table's stop ids at -inf (`_ban`; division by T keeps -inf, so
            banning after it gives the bits of banning before). amin: -inf where banned, the
            +inf of empty entries leaves x as it is."""
            if not ban:
                return x
            table = st[f"ban{ban}"]
            fill = torch.where(table >= 0, float("-inf"), float("inf"))
            return x.clone().scatter_reduce_(-1, table.clamp(min=0), fill, reduce="amin")

        parents, tokens, col = ints[:, :q], ints[:, q:2 * q], ints[:, 2 * q:]
        if mode == "greedy":
            verify_tree_greedy(parents, tokens, banned(logits), max_depth=q - 1, out=out,
                               validate=False, impl=self.impl)
            scaled, stats = logits, None  # T = 1, and x / 1 == x exactly
        else:
            keys = col[:, _KEY]
            temp = col[:, _TEMP].view(torch.float64).float()  # as torch.tensor(float32) rounds
            # The coins are drawn on the device, the general path draws them on the CPU: the
            # same values. noise_bits is integer SplitMix64 (wrapping int64 arithmetic, the
            # same bits on any device); uniform_noise turns the top 24 bits k into float32
            # (exact), adds 1/2 (one IEEE round-to-nearest-even, the same on CPU and GPU;
            # exact for k < 2^23) and scales by 2^-24 (exact).
            coins = uniform_noise(keys, col[:, _COIN_DRAW], q, dev)
            coins = torch.where(st["cols"] < col[:, _NODES, None], coins, 0.5)  # unused ones: 0.5
            noise = exponential_noise(keys, col[:, _NOISE_DRAW], self.vocab, dev)
            if self.fused_probs and not ban:
                # triton_verify_probs: the probabilities and each row's max and log-sum,
                # from which the logprobs below are gathered (no log_softmax pass)
                from megatron_tlt.spec import triton_verify_probs as tvp
                probs, *stats = tvp.verify_probs(logits, temp)
            else:
                # sampled_probs, with the quotient kept for the logprobs below (which the
                # general path takes before the ban)
                scaled = logits.float() / temp[:, None, None]
                probs, stats = _normalised_softmax(banned(scaled)), None
            if mode != "sampled":
                dp = None
            elif dp is None:
                dp = self._big("_dp", bucket, q)
            verify_tree_rejection(parents, tokens, probs, dp, coins, noise, max_depth=q - 1, out=out,
                                  validate=False, impl=self.impl)
        node = out.accept_index.clamp(min=0)
        tok = out.output_tokens.clamp(min=0)
        rows = st["rows"]
        if stats is not None:  # the fused kernels' M and log Z: gather B x Q logits only
            lp = tvp.token_logprobs(logits, temp, stats[0], stats[1], rows, node, tok)
        else:
            # The general path takes log_softmax(logits[rows, node] / T); log_softmax works
            # row by row (its reductions depend only on the row length), so taking it over
            # every row of the quotient and then picking [rows, node, tok] gives the same
            # bits without a [bucket, Q, vocab] gather and a second division.
            lp = torch.log_softmax(scaled, dim=-1)[rows, node, tok]
        plp = st["zeros"] if mode == "greedy" else probs[rows, node, tok].log().double()
        torch.cat([out.accept_index.double(), out.accept_length[:, None].double(),
                   out.output_tokens.double(), lp.double(), plp], 1, out=st["out"])
        torch.add(st["base"], node, out=st["gidx"])
