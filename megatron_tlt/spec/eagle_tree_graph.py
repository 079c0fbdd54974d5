"""EAGLE-2 dynamic draft trees on static buffers, replayed from CUDA graphs (the GPU path
of EagleProposer's tree steps).

Why: trees were drafted only by the eager per-sequence path (`EagleProposer._draft_trees`:
per level and sequence, torch ops and a host sync), which on the H200 costs milliseconds
per step (the eager chain path took 9.4 ms for depth 4, session 4), so trees could not pay
there. At batch 1 a tree is the way to more accepted tokens per verify forward: with
one-hot (top-k) proposals a level accepts with the target's probability of the whole set
of siblings tried, not of one token.

One replay, for a batch bucket (1, 2, 4, 8 sequences), depth D and width K (= topk):
1. the extend of ChainGraphs (the same captured code): the root's feature and logits;
2. per level l = 0..D-1: the draft scores of every frontier row (l = 0: the root;
   else the K frontier lanes), `draft_logprobs` of the batch's one sampling setting; each
   row's K best tokens (CPU: stable sort, ties to the lowest id; CUDA: torch.topk, ties
   in the kernel's order); cumulative scores in float64
   (parent + log-prob, the sum the host builder makes in Python floats), the row-major
   candidates ranked by a stable descending sort (ties: lower frontier row, then the
   row's own rank: TreeBuilder.expand_topk's order); the first K are the next frontier.
   Below the last level the frontier's K lanes run the drafter layer: position
   base + l + 1, feature = the parent lane's f, attention over the committed slot keys
   (0..base-1) and over the tree's own keys of the lane's ancestors and itself (a scratch
   [bucket, (D - 1) K] buffer, ancestor masks gathered lane by lane), `attend_tree`;
3. outputs, one device-to-host copy: every level's candidates (target ids, parent lane,
   float64 score) and per level a failure flag: a real frontier row (finite score) with a
   non-finite logit, or one whose V was non-finite (V enters the scratch buffer through
   nan_to_num, as chain levels do).
The host then replays TreeBuilder with these candidates (`expand_candidates`: -inf
candidates dropped, a row's tree stops at its cap, a flagged level fails the tree) and
keeps the num_draft_nodes best nodes (`TreeBuilder.result`), so the static and the eager
paths build trees by one rule. The drafter's numbers are not the eager path's bit for bit
(there, attention runs over exactly each node's keys); proposals are one-hot and verified
by the target, so the output distribution does not depend on them.

Eligible (else the eager path): trees (topk > 1), at most MAX_TREE_BUCKET sequences, the
chain path's conditions on pending pairs, one sampling setting for the batch. Graphs keyed
by (bucket, (D, K), setting) and invalidated as ChainGraphs' are. Kill switch:
MEGATRON_TLT_TREE_GRAPHS=0.
"""

from __future__ import annotations

import os
import types

import torch

from megatron_tlt.spec.eagle_graph import _SLOT, ChainGraphs
from megatron_tlt.spec.tree import DraftTree, TreeBuilder

MAX_TREE_BUCKET = 8


def enabled() -> bool:
    return os.environ.get("MEGATRON_TLT_TREE_GRAPHS", "1") != "0"


def attend_tree(q: torch.Tensor,  # [B, K, H, D]: the frontier lanes' queries, RoPE applied
                slot_k: torch.Tensor,  # [B, S, KVH, D]: each sequence's committed keys (its slot)
                slot_v: torch.Tensor,
                slot_seen: torch.Tensor,  # [B, S] bool
                tree_k: torch.Tensor,  # [B, M, KVH, D]: the step's draft nodes' keys
                tree_v: torch.Tensor,
                tree_seen: torch.Tensor,  # [B, K, M] bool: the lane's ancestors and itself
                scale: float) -> torch.Tensor:  # [B, K, H, D]
    """Attention of each lane's query over its sequence's slot and its own tree nodes, one
    softmax over both parts (masked weights exactly 0). The slot's keys are read once per
    sequence for all K lanes. On the CPU the products are broadcast multiplies and sums
    (row-local bits, as drafter_kv.attend_masked); on CUDA batched matmuls."""
    b, k, h, d = q.shape
    kvh = slot_k.shape[2]
    rep = h // kvh
    qg = q.reshape(b, k, kvh, rep, d).permute(0, 2, 1, 3, 4)  # [B, KVH, K, rep, D]
    ks, vs = slot_k.permute(0, 2, 1, 3), slot_v.permute(0, 2, 1, 3)  # [B, KVH, S, D]
    kt, vt = tree_k.permute(0, 2, 1, 3), tree_v.permute(0, 2, 1, 3)  # [B, KVH, M, D]
    s = ks.shape[2]
    if q.device.type == "cpu":
        sc_s = (qg[..., None, :] * ks[:, :, None, None]).sum(-1)  # [B, KVH, K, rep, S]
        sc_t = (qg[..., None, :] * kt[:, :, None, None]).sum(-1)  # [B, KVH, K, rep, M]
    else:
        flat = qg.reshape(b, kvh, k * rep, d)
        sc_s = torch.matmul(flat, ks.transpose(2, 3)).view(b, kvh, k, rep, s)
        sc_t = torch.matmul(flat, kt.transpose(2, 3)).view(b, kvh, k, rep, kt.shape[2])
    seen = torch.cat([slot_seen[:, None, :].expand(b, k, s), tree_seen], dim=-1)  # [B, K, S + M]
    scores = torch.cat([sc_s, sc_t], dim=-1) * scale
    scores = scores.masked_fill(~seen[:, None, :, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    ps, pt = probs[..., :s], probs[..., s:]
    if q.device.type == "cpu":
        out = (ps[..., None] * vs[:, :, None, None]).sum(-2) + (pt[..., None] * vt[:, :, None, None]).sum(-2)
    else:
        out = (torch.matmul(ps.reshape(b, kvh, k * rep, s), vs)
               + torch.matmul(pt.reshape(b, kvh, k * rep, -1), vt)).view(b, kvh, k, rep, d)
    return out.permute(0, 2, 1, 3, 4).reshape(b, k, h, d)


class TreeGraphs(ChainGraphs):
    """Static buffers and graphs of EagleProposer's tree steps (the chain path's buffers,
    extend and graph handling; its own body)."""

    def setting(self, seqs, strategy) -> tuple | None:
        """("greedy",) or ("sampled", T, top_k, top_p): the batch's one sampling setting
        (the draft scores' processing), or None for the eager path."""
        p = self.p
        if (strategy.is_chain or not p.batched or not 0 < len(seqs) <= MAX_TREE_BUCKET
                or strategy.topk > p.drafter.config.head_size):
            return None
        if not self._ready(seqs):
            return None
        return self._sampling_setting(seqs)

    @torch.no_grad()
    def propose(self, seqs, strategy, caps, setting) -> list[DraftTree]:
        p = self.p
        k, depth = strategy.topk, strategy.depth
        states = [p.states[s.seq_id] for s in seqs]
        bucket, buf = self._load_inputs(seqs, states, depth, sampled=False)  # no noise drawn
        out = self._run(bucket, (depth, k), setting, buf)
        self.num_steps += 1
        self._consumed(seqs, states)
        n = len(seqs)
        packed = out["packed"][:n].cpu()  # the one device-to-host copy
        widths = [k] + [k * k] * (depth - 1)
        total = sum(widths)
        ints = packed[:, :2 * total + depth].tolist()
        scores = packed[:, 2 * total + depth:].contiguous().view(torch.float64).tolist()
        trees = []
        for r, (s, cap) in enumerate(zip(seqs, caps)):
            b = TreeBuilder(s.token_ids[-1], strategy, cap)
            toks, lanes, fails = ints[r][:total], ints[r][total:2 * total], ints[r][2 * total:]
            off = 0
            for lvl, w in enumerate(widths):
                if b.done:
                    break
                if fails[lvl]:
                    b.fail("non-finite drafter logits")
                    break
                b.expand_candidates(list(zip(toks[off:off + w], lanes[off:off + w], scores[r][off:off + w])))
                off += w
            trees.append(b.result(p.drafter.arch.vocab_size))
        return trees

    def _body(self, bucket: int, shape: tuple[int, int], setting: tuple, buf) -> dict[str, torch.Tensor]:
        """Extend + the tree's levels for `bucket` rows of static inputs; no host syncs
        (capturable). Returns {"packed": [bucket, 2 T + D + T] int64}: candidate target
        ids, parent lanes (T = K + (D - 1) K^2 candidates in rank order per level), the D
        failure flags, then the candidates' float64 scores viewed as int64."""
        from megatron_tlt.spec.decode import draft_logprobs
        depth, k = shape
        d, kv = self.p.drafter, self.p.kv
        a = d.arch
        ints = buf["ints"]
        dev = ints.device
        slot = ints[:, _SLOT]
        f, lg, base = self._extend_body(bucket, buf)
        top = d.rope_cos.shape[0] - 1
        params = types.SimpleNamespace(temperature=0.0, top_k=0, top_p=1.0)
        if setting[0] == "sampled":
            params = types.SimpleNamespace(temperature=setting[1], top_k=setting[2], top_p=setting[3])
        m = max(depth - 1, 1) * k
        tree_k = torch.zeros(bucket, m, a.num_kv_heads, a.head_dim, dtype=f.dtype, device=dev)
        tree_v = torch.zeros_like(tree_k)
        node_ids = torch.arange(m, device=dev)
        anc = None  # [B, K, M] bool: the frontier lanes' ancestors and themselves
        slot_k, slot_v = kv.k.index_select(0, slot), kv.v.index_select(0, slot)  # [B, cap, KVH, D]
        slot_seen = torch.arange(kv.capacity, device=dev)[None, :] < base[:, None]  # pairs 0..base-1
        lanes_f = f[:, None]  # [B, w, hidden]: the frontier rows' features (w = 1: the root)
        lg = lg.view(bucket, 1, -1)
        score = torch.zeros(bucket, 1, dtype=torch.float64, device=dev)
        v_ok = torch.ones(bucket, 1, dtype=torch.bool, device=dev)
        toks, lanes, scores, fails = [], [], [], []
        lane_ids = torch.arange(k, device=dev)
        for lvl in range(depth):
            w = lg.shape[1]
            real = torch.isfinite(score)  # [B, w]: a node of the host's tree
            fails.append(((~torch.isfinite(lg).all(-1) | ~v_ok) & real).any(-1))
            logp = draft_logprobs(lg.reshape(bucket * w, -1), params).view(bucket, w, -1)
            if logp.is_cuda:  # a selection, not a full sort of every row over the vocabulary
                vals, ids = torch.topk(logp, k, dim=-1, sorted=True)  # ties: the kernel's order
            else:  # ties to the lowest id, as TreeBuilder.expand_topk
                vals, ids = torch.sort(logp, dim=-1, descending=True, stable=True)
                vals, ids = vals[..., :k], ids[..., :k]  # [B, w, K]
            cand = torch.where(real[..., None], score[..., None] + vals.double(), float("-inf"))
            cand = cand.reshape(bucket, w * k)
            cand = cand.masked_fill(torch.isnan(cand), float("-inf"))  # a failed row's; flagged
            order = torch.sort(cand, dim=-1, descending=True, stable=True).indices
            tok = d.to_target_ids(ids.reshape(bucket, w * k).gather(1, order))
            sc = cand.gather(1, order)
            lane = order // k
            toks.append(tok)
            lanes.append(lane)
            scores.append(sc)
            if lvl == depth - 1:
                break
            # The next frontier: the first K candidates, forwarded as K lanes.
            par, score = lane[:, :k], sc[:, :k]
            g = lanes_f.gather(1, par[..., None].expand(bucket, k, lanes_f.shape[-1]))
            own = node_ids[None, :] == (lvl * k + lane_ids)[:, None]  # [K, M]: each lane's own key
            if lvl == 0:
                anc = own.expand(bucket, k, m)
            else:
                anc = anc.gather(1, par[..., None].expand(bucket, k, m)) | own
            pos = (base + lvl + 1).clamp(max=top)[:, None].expand(bucket, k).reshape(-1)
            x, q, kk, vv = d.layer_qkv(tok[:, :k].reshape(-1), g.reshape(bucket * k, -1), pos)
            v_ok = torch.isfinite(vv).flatten(1).all(-1).view(bucket, k)
            tree_k[:, lvl * k:(lvl + 1) * k] = kk.view(bucket, k, a.num_kv_heads, a.head_dim)
            tree_v[:, lvl * k:(lvl + 1) * k] = torch.nan_to_num(vv).view(bucket, k, a.num_kv_heads, a.head_dim)
            o = attend_tree(q.view(bucket, k, a.num_heads, a.head_dim), slot_k, slot_v, slot_seen,
                            tree_k, tree_v, anc, d.scale)
            fl = d.layer_out(x, o.reshape(bucket * k, a.num_heads, a.head_dim))
            lanes_f = fl.view(bucket, k, -1)
            lg = d.logits(fl).view(bucket, k, -1)
        flags = torch.stack(fails, dim=1).long()  # [B, D]
        sc = torch.cat(scores, dim=1)
        packed = torch.cat([torch.cat(toks, dim=1), torch.cat(lanes, dim=1), flags, sc.view(torch.int64)], dim=1)
        return {"packed": packed}

