"""EAGLE drafter: one decoder layer over (token embedding, target feature) pairs.

    f[t] = norm(layer(fc(concat(embed(x[t+1]), g[t]))))      logits[t] = head(f[t])

Terms and alignment (canonical, used by training and drafting alike):
- h[t] is the target's hidden state at position t AFTER its final norm — exactly what its
  LM head multiplies (Request.return_hidden_states="final"). EAGLE-1/2 take the base
  model's output after the final norm too; we use it because `head(h[t])` then *is* the
  target's next-token logits, so feature and token losses share one target.
- Pair t = (token x[t+1], feature g[t] = h[t]) sits at RoPE position t + 1 (the token's
  position) and predicts x[t+2]: f[t] regresses h[t+1], logits[t] the target's
  distribution of x[t+2].
- Drafting beyond the committed sequence feeds the drafter's own f back as g (the draft
  token at position p goes with f of its parent node).
- EAGLE-3-style fusion (`DrafterConfig.fuse_layers`, k target layers): g[t] =
  fuse(concat(h_l1[t], ..., h_lk[t])) (fuse: k*hidden -> hidden); drafted nodes still feed
  f back directly. The rollout engine only exposes the final layer today, so fused
  drafters train and run from features the caller provides (see DrafterConfig).
- Reduced draft vocabulary: the head is `lm_head[draft_to_target]` (rows of the target's
  head, the N most frequent tokens), `draft_to_target` maps draft ids to target ids. A
  draft distribution is scattered into the full vocabulary with zeros elsewhere, so the
  target still verifies with its full distribution (lossless).

Ownership: the drafter owns fc (and fuse), its one layer and its norm. The target's
embedding and LM head are held BY REFERENCE as plain tensors (not parameters, not
buffers), never written: `parameters()` / `state_dict()` never contain them, and an
optimizer over the drafter cannot touch them (DESIGN.md invariant).

Layer math is the target family's (RMSNorm, RoPE, GQA, SwiGLU, Qwen2 QKV bias, Qwen3
q/k norm), built from rollout.model's functions so it cannot drift from the engine.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron_tlt.errors import ConfigError
from megatron_tlt.models.arch import ModelArch
from megatron_tlt.rollout.model import apply_rope, linear, rms_norm, rope_table
from megatron_tlt.rollout.sampling import exponential_noise
from megatron_tlt.spec.decode import Drafter, row_param, draft_logprobs
from megatron_tlt.spec.sampling_ref import process_logits
from megatron_tlt.spec.sampling_ref import sample as race_sample
from megatron_tlt.spec.tree import TreeBuilder


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterConfig:
    arch: ModelArch
    """The target's architecture (the drafter's layer has the same shapes and family)."""
    fuse_layers: tuple[int, ...] = ()
    """EAGLE-3 fusion: target layer indices whose outputs are fused (empty: final feature)."""
    draft_vocab_size: int | None = None
    """Reduced head size (None: the full target vocabulary)."""
    fc_bias: bool = True
    """EAGLE-1's fc has a bias."""

    def __post_init__(self):
        v = self.draft_vocab_size
        if v is not None and (not isinstance(v, int) or not 1 <= v <= self.arch.vocab_size):
            raise ConfigError(f"draft_vocab_size must be in [1, vocab_size={self.arch.vocab_size}], got {v!r}")
        for i in self.fuse_layers:
            if not isinstance(i, int) or not 0 <= i < self.arch.num_layers:
                raise ConfigError(f"fuse_layers entry {i!r} is not a target layer index in "
                                  f"[0, {self.arch.num_layers})")

    @property
    def feature_dim(self) -> int:
        """Width of the target feature the drafter consumes per position."""
        k = len(self.fuse_layers)
        return self.arch.hidden_size * (k if k else 1)

    @property
    def head_size(self) -> int:
        return self.draft_vocab_size or self.arch.vocab_size


class _RMSNorm(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))


class _Attention(nn.Module):
    def __init__(self, a: ModelArch):
        super().__init__()
        self.q_proj = nn.Linear(a.hidden_size, a.q_size, bias=a.qkv_bias)
        self.k_proj = nn.Linear(a.hidden_size, a.kv_size, bias=a.qkv_bias)
        self.v_proj = nn.Linear(a.hidden_size, a.kv_size, bias=a.qkv_bias)
        self.o_proj = nn.Linear(a.q_size, a.hidden_size, bias=a.qkv_bias and a.family != "qwen2")
        if a.qk_norm:
            self.q_norm = _RMSNorm(a.head_dim)
            self.k_norm = _RMSNorm(a.head_dim)


class _MLP(nn.Module):
    def __init__(self, a: ModelArch):
        super().__init__()
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)


class _Layer(nn.Module):
    def __init__(self, a: ModelArch):
        super().__init__()
        self.input_layernorm = _RMSNorm(a.hidden_size)
        self.self_attn = _Attention(a)
        self.post_attention_layernorm = _RMSNorm(a.hidden_size)
        self.mlp = _MLP(a)


def attend(q: torch.Tensor,  # [Tq, heads, head_dim], RoPE applied
           k: torch.Tensor,  # [Tk, kv_heads, head_dim]
           v: torch.Tensor,  # [Tk, kv_heads, head_dim]
           mask: torch.Tensor,  # [Tq, Tk] bool: query i sees key j
           scale: float) -> torch.Tensor:  # [Tq, heads, head_dim]
    """Masked softmax attention with GQA (query head h reads KV head h // (H / KVH))."""
    rep = q.shape[1] // k.shape[1]
    kh = k.repeat_interleave(rep, dim=1).transpose(0, 1)  # [H, Tk, D]
    vh = v.repeat_interleave(rep, dim=1).transpose(0, 1)
    scores = torch.matmul(q.transpose(0, 1), kh.transpose(1, 2)) * scale  # [H, Tq, Tk]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, vh).transpose(0, 1)


@dataclasses.dataclass
class KVChunk:
    """Keys/values of some drafter positions: k, v [T, kv_heads, head_dim]."""
    k: torch.Tensor
    v: torch.Tensor


class EagleDrafter(nn.Module):
    """The drafter. Build with the target's embedding and LM head tensors (shared by
    reference, read-only) and, for a reduced vocabulary, `draft_to_target` ids."""

    def __init__(self, config: DrafterConfig, target_embed: torch.Tensor,  # [vocab, hidden]
                 target_lm_head: torch.Tensor,  # [vocab, hidden]
                 draft_to_target: torch.Tensor | None = None):  # [draft_vocab] int64
        super().__init__()
        a = config.arch
        if tuple(target_embed.shape) != (a.vocab_size, a.hidden_size) or \
                tuple(target_lm_head.shape) != (a.vocab_size, a.hidden_size):
            raise ConfigError(f"drafter: target embedding {tuple(target_embed.shape)} / lm_head "
                              f"{tuple(target_lm_head.shape)} do not match the arch "
                              f"({a.vocab_size}, {a.hidden_size})")
        self.config = config
        self.arch = a
        h = a.hidden_size
        if config.fuse_layers:
            self.fuse = nn.Linear(config.feature_dim, h, bias=False)
        self.fc = nn.Linear(2 * h, h, bias=config.fc_bias)
        self.layers = nn.ModuleList([_Layer(a)])
        self.norm = _RMSNorm(h)
        # Plain attributes: not registered, so never in parameters()/state_dict().
        object.__setattr__(self, "_target_embed", target_embed)
        object.__setattr__(self, "_target_lm_head", target_lm_head)
        if config.draft_vocab_size is not None:
            if draft_to_target is None or draft_to_target.shape != (config.draft_vocab_size,):
                raise ConfigError(f"drafter: draft_vocab_size={config.draft_vocab_size} needs "
                                  f"draft_to_target ids of that length")
            ids = draft_to_target.to(torch.int64)
            if int(ids.min()) < 0 or int(ids.max()) >= a.vocab_size or ids.unique().numel() != ids.numel():
                raise ConfigError("drafter: draft_to_target must hold distinct target token ids")
        else:
            ids = None
        self.register_buffer("draft_to_target", ids, persistent=False)
        self._head_cache: tuple[int, int, torch.Tensor] | None = None
        cos, sin = rope_table(a.max_position_embeddings, a.head_dim, a.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.batch_invariant = False
        self.reset_parameters()

    # ---- parameters ---------------------------------------------------------------

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0, std: float = 0.02) -> None:
        """Random init (deterministic given seed): normal(std) weights, zero biases,
        unit norms; fc starts as [0 | I]-ish so an untrained drafter passes the feature on."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
        h = self.arch.hidden_size
        self.fc.weight[:, h:] += torch.eye(h)

    def set_target(self, target_embed: torch.Tensor, target_lm_head: torch.Tensor) -> None:
        """Point at (new) target tensors, e.g. after moving the engine's weights."""
        object.__setattr__(self, "_target_embed", target_embed)
        object.__setattr__(self, "_target_lm_head", target_lm_head)
        self._head_cache = None

    @property
    def target_embed(self) -> torch.Tensor:
        return self._target_embed

    @property
    def target_lm_head(self) -> torch.Tensor:
        return self._target_lm_head

    def head_weight(self) -> torch.Tensor:
        """[head_size, hidden]: the target's LM head rows of the draft vocabulary (a
        gathered copy for a reduced vocabulary, cached per storage/version of the head)."""
        w = self._target_lm_head.detach()
        if self.draft_to_target is None:
            return w
        key = (w.data_ptr(), w._version)
        if self._head_cache is None or self._head_cache[:2] != key:
            self._head_cache = (key[0], key[1], w.index_select(0, self.draft_to_target.to(w.device)))
        return self._head_cache[2]

    # ---- math ---------------------------------------------------------------------

    def _lin(self, x: torch.Tensor, mod: nn.Linear) -> torch.Tensor:
        return linear(x, mod.weight, mod.bias, batch_invariant=self.batch_invariant)

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [T, feature_dim] -> g [T, hidden]."""
        if features.shape[-1] != self.config.feature_dim:
            raise ValueError(f"drafter expects target features of width {self.config.feature_dim}, "
                             f"got {features.shape[-1]}")
        if self.config.fuse_layers:
            return self._lin(features, self.fuse)
        return features

    def layer_qkv(self, tokens: torch.Tensor,  # [T] int64 target ids
                  g: torch.Tensor,  # [T, hidden] fused feature or drafter f
                  positions: torch.Tensor,  # [T] int64
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """First half of the layer: (x after fc [T, hidden], q [T,H,D], k, v [T,KVH,D])."""
        a = self.arch
        t = tokens.shape[0]
        emb = F.embedding(tokens, self._target_embed.detach()).to(g.dtype)
        x = self._lin(torch.cat([emb, g], dim=-1), self.fc)
        lay = self.layers[0]
        att = lay.self_attn
        y = rms_norm(x, lay.input_layernorm.weight, a.rms_norm_eps)
        q = self._lin(y, att.q_proj).reshape(t, a.num_heads, a.head_dim)
        k = self._lin(y, att.k_proj).reshape(t, a.num_kv_heads, a.head_dim)
        v = self._lin(y, att.v_proj).reshape(t, a.num_kv_heads, a.head_dim)
        if a.qk_norm:
            q = rms_norm(q, att.q_norm.weight, a.rms_norm_eps)
            k = rms_norm(k, att.k_norm.weight, a.rms_norm_eps)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        return x, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def layer_out(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Second half: residual + o_proj, MLP, final norm -> f [T, hidden]."""
        a = self.arch
        lay = self.layers[0]
        x = x + self._lin(o.reshape(o.shape[0], -1), lay.self_attn.o_proj)
        y = rms_norm(x, lay.post_attention_layernorm.weight, a.rms_norm_eps)
        gate = self._lin(y, lay.mlp.gate_proj)
        up = self._lin(y, lay.mlp.up_proj)
        x = x + self._lin(F.silu(gate) * up, lay.mlp.down_proj)
        return rms_norm(x, self.norm.weight, a.rms_norm_eps)

    def logits(self, f: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, head_size] float32 (draft vocabulary)."""
        return linear(f, self.head_weight().to(f.dtype), batch_invariant=self.batch_invariant).float()

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.arch.head_dim)

    def forward_packed(self, tokens: torch.Tensor,  # [T] int64: x[t+1] of each pair
                       features: torch.Tensor,  # [T, feature_dim]: target features h[t]
                       positions: torch.Tensor,  # [T] int64: t + 1
                       segment_ids: torch.Tensor,  # [T] int64: sample of each pair
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Training forward over packed samples (causal within a sample, nothing across
        samples). Returns (f [T, hidden], logits [T, head_size] float32)."""
        x, q, k, v = self.layer_qkv(tokens, self.fuse_features(features), positions)
        idx = torch.arange(tokens.shape[0], device=tokens.device)
        mask = (segment_ids[:, None] == segment_ids[None, :]) & (idx[None, :] <= idx[:, None])
        f = self.layer_out(x, attend(q, k, v, mask, self.scale))
        return f, self.logits(f)

    # ---- draft vocabulary -------------------------------------------------------------

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        if self.draft_to_target is None:
            return draft_ids
        return self.draft_to_target.to(draft_ids.device)[draft_ids]

    def scatter_to_target(self, probs: torch.Tensor) -> torch.Tensor:
        """[..., head_size] -> [..., vocab] with zeros outside the draft vocabulary."""
        if self.draft_to_target is None:
            return probs
        out = probs.new_zeros(*probs.shape[:-1], self.arch.vocab_size)
        idx = self.draft_to_target.to(probs.device).expand(*probs.shape[:-1], -1)
        return out.scatter_(-1, idx, probs)


def count_frequent_tokens(token_lists, vocab_size: int, n: int) -> torch.Tensor:
    """The n most frequent token ids over `token_lists` (ties -> lower id), sorted by id,
    padded with the lowest unseen ids when fewer than n distinct tokens occur."""
    if not 1 <= n <= vocab_size:
        raise ConfigError(f"draft vocabulary size {n} must be in [1, {vocab_size}]")
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for toks in token_lists:
        t = torch.as_tensor(toks, dtype=torch.int64)
        counts += torch.bincount(t, minlength=vocab_size)[:vocab_size]
    # Sort by count desc, then id asc (stable sort on ids already ascending).
    order = torch.sort(-counts, stable=True).indices
    return order[:n].sort().values


# ---- drafting at rollout time ----------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _SeqState:
    """The drafter's view of one sequence: KV of its committed pairs (pair t at index t,
    contiguous) and target features observed but not yet consumed."""
    k: torch.Tensor  # [S, kv_heads, head_dim]
    v: torch.Tensor
    pending: list[torch.Tensor]  # feature rows for positions S .. num_features - 1
    num_features: int = 0

    @property
    def num_pairs(self) -> int:
        return self.k.shape[0]


class EagleProposer(Drafter):
    """Drafts with an EagleDrafter for SpecDecoder.

    Per step, for the sequences that speculate: (1) *extend*: run the pairs of every
    committed position not yet consumed (tokens x[t+1], target features h[t]) and append
    their KV to the drafter's per-sequence cache (contiguous; dropped on preemption and
    rebuilt from the re-prefill's features); the last pair's output f is the root feature
    and its logits give depth-1 candidates; (2) one forward per deeper level over the
    frontier nodes (token, parent's f) with tree attention to the cache plus the node's
    drafted ancestors (their KV lives only for this step); (3) TreeBuilder picks the tree.
    Features observed while the sequence does not speculate (SD off, prefill) wait until
    its next speculative step, or are consumed eagerly once more than `max_pending` pile up.
    Temperature 0: top-k by log_softmax; temperature > 0: chains sample each token from
    the processed draft distribution (noise from the request's stream; draft_probs
    passed to the verifier), trees take the top-k (one-hot proposals).
    Non-finite drafter outputs for a sequence -> DraftTree.failed (plain decode)."""

    name = "eagle"
    feature = "final"

    def __init__(self, drafter: EagleDrafter, *, max_pending: int = 256):
        if drafter.config.fuse_layers:
            raise ConfigError("EAGLE-3 fused drafters need per-layer target hidden states, which "
                              "the rollout engine does not expose yet (only 'final')")
        t = drafter.target_embed
        self.drafter = drafter.to(device=t.device, dtype=t.dtype).eval()  # where the target runs
        self.drafter.batch_invariant = True
        self.states: dict[int, _SeqState] = {}
        self.max_pending = max_pending
        """Observed features a sequence may hold before the drafter consumes them eagerly
        (during SD-off stretches features would otherwise pile up: hidden floats/token)."""

    # ---- Drafter interface ------------------------------------------------------------

    def _state(self, seq) -> _SeqState:
        st = self.states.get(seq.seq_id)
        if st is None:
            a = self.drafter.arch
            p = next(self.drafter.parameters())
            z = torch.zeros(0, a.num_kv_heads, a.head_dim, dtype=p.dtype, device=p.device)
            st = self.states[seq.seq_id] = _SeqState(k=z, v=z.clone(), pending=[])
        return st

    def observe(self, seq, start, hidden):
        st = self._state(seq)
        if start != st.num_features:  # out of step (cannot happen via SpecDecoder): rebuild
            self.release(seq)
            if start != 0:
                return
            st = self._state(seq)
        st.pending.append(hidden.detach())
        st.num_features += hidden.shape[0]
        if st.num_features - st.num_pairs > self.max_pending:
            with torch.no_grad():
                self._extend([seq], keep_last=True)  # SD off: bound the features held

    def release(self, seq):
        self.states.pop(seq.seq_id, None)

    def reset(self):
        self.states.clear()

    # ---- drafting -------------------------------------------------------------------------

    def _attend_rows(self, q, k, v, groups):
        """groups: per sequence (row slice, keys k [S,KVH,D], values v, mask [n, S])."""
        out = torch.empty_like(q)
        for sl, kk, vv, mask in groups:
            out[sl] = attend(q[sl], kk, vv, mask, self.drafter.scale)
        return out

    @torch.no_grad()
    def _extend(self, seqs, keep_last: bool = False) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Run every pair whose token is known (t + 1 < len(token_ids)) and whose feature
        was observed, appending its KV to the sequence's cache. Returns, per index into
        seqs that ran pairs, (f, logits) of its last pair. keep_last: leave the newest
        observed pair for the next propose (whose root it is)."""
        d = self.drafter
        toks, feats, pos, sizes, states = [], [], [], [], []
        for s in seqs:
            st = self._state(s)
            lo = st.num_pairs
            hi = min(st.num_features - int(keep_last), len(s.token_ids) - 1)
            n = max(0, hi - lo)
            states.append(st)
            sizes.append(n)
            if n == 0:
                continue
            f = torch.cat(st.pending) if len(st.pending) > 1 else st.pending[0]
            feats.append(f[:n])
            st.pending = [f[n:]] if f.shape[0] > n else []
            toks.append(torch.tensor(s.token_ids[lo + 1:hi + 1], dtype=torch.int64))
            pos.append(torch.arange(lo + 1, hi + 1))
        out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if not toks:
            return out
        p0 = next(d.parameters())
        tokens = torch.cat(toks).to(p0.device)
        g = d.fuse_features(torch.cat(feats).to(p0.device, p0.dtype))
        x, q, k, v = d.layer_qkv(tokens, g, torch.cat(pos).to(p0.device))
        groups, off = [], 0
        for st, n in zip(states, sizes):
            if n == 0:
                continue
            s_pairs = st.num_pairs
            kk = torch.cat([st.k, k[off:off + n]])
            vv = torch.cat([st.v, v[off:off + n]])
            causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            mask = torch.cat([torch.ones(n, s_pairs, dtype=torch.bool, device=q.device), causal], 1)
            groups.append((slice(off, off + n), kk, vv, mask))
            st.k, st.v = kk, vv
            off += n
        f = d.layer_out(x, self._attend_rows(q, k, v, groups))
        lg = d.logits(f)
        off = 0
        for i, n in enumerate(sizes):
            if n:
                off += n
                out[i] = (f[off - 1], lg[off - 1])
        return out

    @torch.no_grad()
    def propose(self, seqs, strategy, caps, running):
        d = self.drafter
        a = d.arch
        builders = [TreeBuilder(s.token_ids[-1], strategy, cap) for s, cap in zip(seqs, caps)]
        # (1) extend over the committed pairs not yet consumed; the last one is the root.
        roots = self._extend(seqs)
        for i, s in enumerate(seqs):
            st = self.states[s.seq_id]
            if i not in roots or st.num_pairs != len(s.token_ids) - 1:
                builders[i].fail(f"drafter has features for {st.num_features} of "
                                 f"{len(s.token_ids) - 1} positions")
        states = [self.states[s.seq_id] for s in seqs]
        # (2) the tree, level by level. Node features f per builder node; temp KV per node.
        node_f: list[dict[int, torch.Tensor]] = [dict() for _ in seqs]
        node_logits: list[dict[int, torch.Tensor]] = [dict() for _ in seqs]
        temp_kv: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [dict() for _ in seqs]
        for i, (f0, lg0) in roots.items():
            node_f[i][0], node_logits[i][0] = f0, lg0
        while True:
            # Expand every live builder's frontier from the logits of its frontier nodes.
            # One host sync per level: which sequences' logits are finite.
            live = [i for i, b in enumerate(builders) if not b.done]
            if live:
                lgs = {i: torch.stack([node_logits[i][n] for n in builders[i].frontier]) for i in live}
                row_ok = torch.isfinite(torch.cat([lgs[i] for i in live])).all(-1).tolist()
                ok, off = [], 0
                for i in live:
                    n = lgs[i].shape[0]
                    if all(row_ok[off:off + n]):
                        ok.append(i)
                    else:
                        builders[i].fail("non-finite drafter logits")
                    off += n
                params = {i: seqs[i].request.sampling_params for i in ok}
                sampled = [i for i in ok if strategy.is_chain and params[i].temperature > 0]
                if sampled:
                    # Sampled chains, all sequences at once: the processed draft distribution,
                    # each sequence's next noise draw (the same values as drawing alone),
                    # the race; one host transfer for the tokens.
                    dev = lgs[sampled[0]].device
                    qd = process_logits(
                        torch.cat([lgs[i] for i in sampled]),
                        row_param([float(params[i].temperature) for i in sampled], dev, torch.float32),
                        row_param([max(int(params[i].top_k), 0) for i in sampled], dev, torch.int64),
                        row_param([float(params[i].top_p) for i in sampled], dev, torch.float32))
                    streams = [seqs[i].rng for i in sampled]
                    noise = exponential_noise(torch.tensor([r.key for r in streams]),
                                              torch.tensor([r.take() for r in streams]),
                                              qd.shape[-1], dev)
                    toks = d.to_target_ids(race_sample(qd, noise)).tolist()
                    rows = d.scatter_to_target(qd).float()
                    for j, i in enumerate(sampled):
                        builders[i].expand_sampled(int(toks[j]), rows[j])
                for i in ok:
                    if i not in sampled:
                        builders[i].expand_topk(draft_logprobs(lgs[i], params[i]).cpu(), d.to_target_ids)
            # Forward the new frontier nodes (only where another level will be drafted).
            rows = [(i, n) for i, b in enumerate(builders) if not b.done for n in b.frontier]
            if not rows:
                break
            tokens = torch.tensor([builders[i].tokens[n] for i, n in rows], dtype=torch.int64)
            g = torch.stack([node_f[i][builders[i].parents[n]] for i, n in rows])
            depth_of = [self._depth(builders[i], n) for i, n in rows]
            positions = torch.tensor([len(seqs[i].token_ids) - 1 + dd for (i, _), dd in zip(rows, depth_of)])
            x, q, k, v = d.layer_qkv(tokens.to(g.device), g, positions.to(g.device))
            groups, off = [], 0
            for i in sorted({i for i, _ in rows}):
                mine = [r for r, (j, _) in enumerate(rows) if j == i]
                nodes = [rows[r][1] for r in mine]
                st = states[i]
                anc = list(temp_kv[i].keys())
                kk = torch.cat([st.k] + [temp_kv[i][m][0][None] for m in anc] + [k[mine]])
                vv = torch.cat([st.v] + [temp_kv[i][m][1][None] for m in anc] + [v[mine]])
                # Built on the host (element writes to a device tensor are a launch each),
                # then one copy.
                mask = torch.zeros(len(nodes), kk.shape[0], dtype=torch.bool)
                mask[:, :st.num_pairs] = True
                for r, node in enumerate(nodes):
                    ancestors = self._ancestors(builders[i], node)
                    for c, m in enumerate(anc):
                        mask[r, st.num_pairs + c] = m in ancestors
                    mask[r, st.num_pairs + len(anc) + r] = True
                mask = mask.to(q.device)
                assert mine == list(range(off, off + len(mine)))
                groups.append((slice(off, off + len(mine)), kk, vv, mask))
                off += len(mine)
            f = d.layer_out(x, self._attend_rows(q, k, v, groups))
            lg = d.logits(f)
            for r, (i, n) in enumerate(rows):
                node_f[i][n], node_logits[i][n] = f[r], lg[r]
                temp_kv[i][n] = (k[r], v[r])
        return [b.result(a.vocab_size) for b in builders]

    @staticmethod
    def _depth(b, node: int) -> int:
        depth = 0
        while node > 0:
            node = b.parents[node]
            depth += 1
        return depth

    @staticmethod
    def _ancestors(b, node: int) -> set[int]:
        out = set()
        node = b.parents[node]
        while node > 0:
            out.add(node)
            node = b.parents[node]
        return out
