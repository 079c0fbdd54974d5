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
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron_tlt.errors import ConfigError
from megatron_tlt.models.arch import ModelArch
from megatron_tlt.rollout.host import int64_tensor, to_device
from megatron_tlt.rollout.model import apply_rope, linear, rms_norm, rope_table
from megatron_tlt.rollout.sampling import exponential_noise, has_triton
from megatron_tlt.spec.decode import Drafter, row_param, draft_logprobs
from megatron_tlt.spec.drafter_kv import QUERY_TILE, SlotKV, paged_levels
from megatron_tlt.spec.eagle_graph import ChainGraphs
from megatron_tlt.spec.eagle_graph import enabled as chain_graphs_enabled
from megatron_tlt.spec.eagle_graph import fused_pick, plan_rows
from megatron_tlt.spec.eagle_tree_graph import TreeGraphs
from megatron_tlt.spec.eagle_tree_graph import enabled as tree_graphs_enabled
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
        self._fused: dict[str, tuple[tuple, torch.Tensor]] = {}
        env = os.environ.get("MEGATRON_TLT_DRAFTER_FUSED")
        self.fused_products: bool | None = None if env is None else env != "0"
        """The fused products of `_fast`: None (default) on a CUDA drafter, off on CPU (the
        CPU tests' exact path); True / False force them (MEGATRON_TLT_DRAFTER_FUSED=1 / 0)."""
        env = os.environ.get("MEGATRON_TLT_DRAFTER_KERNELS")
        self.kernel_layers: bool | None = None if env is None else env != "0"
        """Chain levels and extends through the decode model's Triton kernels
        (spec/drafter_kernels.py, ~15 launches per layer forward instead of ~35): None
        (default) on a CUDA drafter that is not batch-invariant and whose chain levels use
        the paged attention kernel; off on CPU. True forces them (the CPU tests run them
        under Triton's interpreter, with fixed projection configs: then batch-invariant
        too); False / MEGATRON_TLT_DRAFTER_KERNELS=0 keeps the torch ops. Never while
        training (grad enabled)."""
        self.planner = None
        """The LinearPlanner of the kernel path's projections (None: the process's shared
        planner for the device, the one the engine's decode model uses)."""
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
        c = self._head_cache
        if c is None or c[:2] != key:
            ids = self.draft_to_target.to(w.device)
            if c is not None and c[2].dtype == w.dtype and c[2].device == w.device:
                # Refreshed in place (a policy update copies the target's head in place):
                # the gathered head keeps its address, so drafting CUDA graphs stay valid.
                torch.index_select(w, 0, ids, out=c[2])
                self._head_cache = (key[0], key[1], c[2])
            else:
                self._head_cache = (key[0], key[1], w.index_select(0, ids))
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

    def _fast(self) -> bool:
        """Fused products where the drafter is neither batch-invariant nor being trained
        (rollout on a CUDA engine): one QKV and one gate/up product instead of five, and
        RoPE on q and k at once; about 14 launches fewer per layer forward (a depth-4 chain
        runs four). Same math, other roundings: cuBLAS picks its kernel by the product's
        width, so the outputs are within bf16 rounding of the separate products.
        On by default on CUDA (`fused_products`): on the H200 its GPU tests passed
        (tests/gpu/test_eagle_graph_gpu.py, 10 passed) and a depth-4 chain replay took
        0.79 ms instead of 0.90 at batch 1 (1.21 / 1.28 at batch 32, random 1.5B shape,
        benchmarks/results/gpu_2026-12-03_session8)."""
        fused = self.fused_products
        if fused is None:
            fused = self.fc.weight.is_cuda
        return fused and not self.batch_invariant and not torch.is_grad_enabled()

    def kernels_on(self, x: torch.Tensor) -> bool:
        """Whether a forward over x (a tensor on the drafter's device) takes the Triton
        kernel path (`kernel_layers`)."""
        if torch.is_grad_enabled():
            return False
        on = self.kernel_layers
        if on is None:
            on = x.is_cuda and not self.batch_invariant and paged_levels(x)
        return bool(on) and has_triton()

    def _fused_weight(self, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
        """The row-concatenation of `parts` (weights or biases), cached and refreshed IN
        PLACE when a part changes (its storage or version): a CUDA graph that read the
        cached tensor stays valid (ChainGraphs refreshes before every replay)."""
        key = tuple((t.data_ptr(), t._version) for t in parts)
        c = self._fused.get(name)
        if c is None or c[0] != key:
            with torch.no_grad():
                src = [t.detach() for t in parts]
                buf = c[1] if c is not None else None
                if buf is not None and buf.device == src[0].device and buf.dtype == src[0].dtype \
                        and buf.shape[0] == sum(t.shape[0] for t in src):
                    torch.cat(src, 0, out=buf)
                else:
                    buf = torch.cat(src, 0)
            self._fused[name] = c = (key, buf)
        return c[1]

    def _fused_qkv(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(fused QKV weight, fused QKV bias or None)."""
        att = self.layers[0].self_attn
        w = self._fused_weight("qkv", [att.q_proj.weight, att.k_proj.weight, att.v_proj.weight])
        if att.q_proj.bias is None:
            return w, None
        return w, self._fused_weight("qkv_bias", [att.q_proj.bias, att.k_proj.bias, att.v_proj.bias])

    def _fused_gate_up(self) -> torch.Tensor:
        mlp = self.layers[0].mlp
        return self._fused_weight("gate_up", [mlp.gate_proj.weight, mlp.up_proj.weight])

    def refresh_fused(self) -> None:
        """Build, or bring up to date in place, everything the fused path reads (before a
        graph replay, so a capture never meets a tensor created inside it)."""
        if not (self._fast() or self.kernels_on(self.fc.weight)):
            return
        w, _ = self._fused_qkv()
        self._fused_gate_up()
        self._rope_table(w.dtype)

    def _rope_table(self, dtype: torch.dtype) -> torch.Tensor:
        """[max_positions, 2, head_dim]: cos and the sign-folded sin (-sin on the first
        half) in `dtype`. x * cos + roll(x, head_dim / 2) * sin_signed is apply_rope's
        x * cos + rotate_half(x) * sin bit for bit (negation is exact)."""
        key = f"rope:{dtype}:{self.rope_cos.device}"
        c = self._fused.get(key)
        if c is None:
            half = self.rope_sin.shape[-1] // 2
            sin_signed = torch.cat([-self.rope_sin[:, :half], self.rope_sin[:, half:]], dim=-1)
            table = torch.stack([self.rope_cos, sin_signed], dim=1).to(dtype)
            self._fused[key] = c = ((), table)
        return c[1]

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm: on a CUDA device, unless batch-invariant, torch's fused kernel (one
        launch instead of seven: a chain step runs three to five of them per level);
        elsewhere the reference's composite form (the CPU tests' exact path)."""
        if x.is_cuda and not self.batch_invariant:
            return torch.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), self.arch.rms_norm_eps)
        return rms_norm(x, weight, self.arch.rms_norm_eps)

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
        y = self._norm(x, lay.input_layernorm.weight)
        if self._fast():
            h, kvh = a.num_heads, a.num_kv_heads
            qkv = F.linear(y, *self._fused_qkv()).view(t, h + 2 * kvh, a.head_dim)
            v = qkv[:, h + kvh:]
            if not a.qk_norm:
                cs = self._rope_table(qkv.dtype).index_select(0, positions)  # [T, 2, D]
                qk = qkv[:, :h + kvh]
                qk = qk * cs[:, :1] + qk.roll(a.head_dim // 2, dims=-1) * cs[:, 1:]
                return x, qk[:, :h], qk[:, h:], v
            q = self._norm(qkv[:, :h], att.q_norm.weight)
            k = self._norm(qkv[:, h:h + kvh], att.k_norm.weight)
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
            return x, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v
        q = self._lin(y, att.q_proj).reshape(t, a.num_heads, a.head_dim)
        k = self._lin(y, att.k_proj).reshape(t, a.num_kv_heads, a.head_dim)
        v = self._lin(y, att.v_proj).reshape(t, a.num_kv_heads, a.head_dim)
        if a.qk_norm:
            q = self._norm(q, att.q_norm.weight)
            k = self._norm(k, att.k_norm.weight)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        return x, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def layer_out(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Second half: residual + o_proj, MLP, final norm -> f [T, hidden]."""
        lay = self.layers[0]
        x = x + self._lin(o.reshape(o.shape[0], -1), lay.self_attn.o_proj)
        y = self._norm(x, lay.post_attention_layernorm.weight)
        if self._fast():
            gate, up = F.linear(y, self._fused_gate_up()).chunk(2, dim=-1)
        else:
            gate = self._lin(y, lay.mlp.gate_proj)
            up = self._lin(y, lay.mlp.up_proj)
        x = x + self._lin(F.silu(gate) * up, lay.mlp.down_proj)
        return self._norm(x, self.norm.weight)

    def forward_kv(self, tokens: torch.Tensor,  # [T] int64 target ids
                   g: torch.Tensor,  # [T, hidden] fused feature or the drafter's own f
                   positions: torch.Tensor,  # [T] int64 RoPE positions
                   kv: SlotKV, slots: torch.Tensor, index: torch.Tensor,  # [T] int64 each
                   *, rows: int,  # the step's planned row count (drafter_kernels.layer)
                   query: torch.Tensor | None = None,  # rows that go on (default: all)
                   query_rows: int | None = None,
                   sanitize: bool = False,
                   slot_mapping: torch.Tensor | None = None,
                   context_lens: torch.Tensor | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The layer and the head at rollout: every row's K/V written into kv at (slots,
        index); the `query` rows attend over their slot's keys 0..index and go on. Returns
        (f, logits, ok). On the Triton kernel path (`kernels_on`: spec/drafter_kernels.py,
        which takes rows / query_rows / slot_mapping / context_lens) ok is None: a
        non-finite V fails its row through the logits. On the torch ops with `sanitize`
        (chain levels) V goes in through nan_to_num, since the slot keeps it past this step
        (masked, weight exactly 0, and 0 * inf would be NaN), and ok [T] flags the rows whose
        V was finite (they fail at the next pick, as the per-sequence path did)."""
        if self.kernels_on(g):
            from megatron_tlt.spec.drafter_kernels import layer
            f, lg = layer(self, tokens, g, positions, kv, slots, index, rows=rows, query=query,
                          query_rows=query_rows, slot_mapping=slot_mapping, context_lens=context_lens)
            return f, lg, None
        x, q, k, v = self.layer_qkv(tokens, g, positions)
        ok = None
        if sanitize:
            ok = torch.isfinite(v).flatten(1).all(-1)
            v = torch.nan_to_num(v)
        kv.write(slots, index, k, v)
        if query is not None:
            x, q, slots, index = (t.index_select(0, query) for t in (x, q, slots, index))
        f = self.layer_out(x, kv.attend_one(q, slots, index, self.scale))
        return f, self.logits(f), ok

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
        return self.forward_unrolled(tokens, features, positions, segment_ids, 1)[0][:2]

    def forward_unrolled(self, tokens: torch.Tensor,  # [T] int64: x[t+1] of each pair
                         features: torch.Tensor,  # [T, feature_dim]: target features h[t]
                         positions: torch.Tensor,  # [T] int64: t + 1
                         segment_ids: torch.Tensor,  # [T] int64: sample of each pair
                         steps: int,
                         ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Training forward that also runs the chain the drafter drafts at rollout (a
        training-time test, as EAGLE-3 trains): step 1 is `forward_packed`; at step s > 1
        row i is the level-s node of the chain rooted at pair i, its input the true token
        of pair i + s - 1 with the drafter's own f of step s - 1 (not the target's
        feature), at position positions[i] + s - 1, attending to the pairs <= i of its
        sample (their step-1 K/V, from target features: the committed prefix) and to its
        own chain's earlier levels (row i of steps 2..s), exactly what a chain level sees
        when drafting. Returns per step (f [T, hidden], logits [T, head_size] float32,
        valid [T] bool: pair i + s - 1 exists in the same sample, i.e. there is a target)."""
        t = tokens.shape[0]
        idx = torch.arange(t, device=tokens.device)
        same = segment_ids[:, None] == segment_ids[None, :]
        causal = same & (idx[None, :] <= idx[:, None])
        eye = idx[:, None] == idx[None, :]
        x, q, k, v = self.layer_qkv(tokens, self.fuse_features(features), positions)
        f = self.layer_out(x, attend(q, k, v, causal, self.scale))
        out = [(f, self.logits(f), torch.ones(t, dtype=torch.bool, device=tokens.device))]
        keys, values, masks = [k], [v], [causal]
        for s in range(1, steps):
            ahead = torch.clamp(idx + s, max=t - 1)
            valid = (idx + s < t) & (segment_ids[ahead] == segment_ids)
            # rows without a target (outputs unused): any valid id and position
            tok = torch.where(valid, tokens[ahead], tokens)
            x, q, k, v = self.layer_qkv(tok, f, torch.where(valid, positions + s, positions))
            keys.append(k)
            values.append(v)
            masks.append(eye)
            o = attend(q, torch.cat(keys), torch.cat(values), torch.cat(masks, dim=1), self.scale)
            f = self.layer_out(x, o)
            out.append((f, self.logits(f), valid))
        return out

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


def _row_param(values: list, device, dtype):
    """row_param for [rows, vocab] logits: a [rows] tensor when the rows differ (row_param's
    [rows, 1] is for [rows, nodes, vocab]; process_logits would fail on it)."""
    p = row_param(values, device, dtype)
    return p[:, 0] if isinstance(p, torch.Tensor) else p


@dataclasses.dataclass(eq=False)
class _SeqState:
    """The drafter's view of one sequence: its KV slot (pair t at index t, `num_pairs`
    committed) and target features observed but not yet consumed."""
    slot: int
    pending: list[torch.Tensor]  # feature rows for positions num_pairs .. num_features - 1
    num_features: int = 0
    num_pairs: int = 0


class EagleProposer(Drafter):
    """Drafts with an EagleDrafter for SpecDecoder.

    Per step, for the sequences that speculate: (1) *extend*: run the pairs of every
    committed position not yet consumed (tokens x[t+1], target features h[t]), all
    sequences in one forward, writing their KV into the sequence's slot of the drafter's
    cache (drafter_kv.SlotKV; the slot is freed on preemption and rebuilt from the
    re-prefill's features); the last pair's output f is the root feature and its logits
    give depth-1 candidates; (2) one forward per deeper level over the frontier nodes
    (token, parent's f) attending to the slot plus the node's drafted ancestors (their KV
    lives only for this step); (3) TreeBuilder picks the tree.
    Chains (topk = 1) draft all sequences at once with a fixed number of ops per level
    (`_draft_chains`: one layer forward, one head, one batched pick of the tokens, one
    host sync); trees go level by level per sequence (`_draft_trees`). `batched=False`
    sends chains through the per-sequence path too (a reference for tests).
    Features observed while the sequence does not speculate (SD off, prefill) wait until
    its next speculative step, or are consumed eagerly once more than `max_pending` pile up.
    Temperature 0: top-k by log_softmax; temperature > 0: chains sample each token from
    the processed draft distribution (noise from the request's stream; draft_probs
    passed to the verifier), or with `one_hot_chains` take the argmax (one-hot
    proposals), and trees take the top-k (one-hot proposals).
    Non-finite drafter outputs for a sequence -> DraftTree.failed (plain decode)."""

    name = "eagle"
    feature = "final"

    def __init__(self, drafter: EagleDrafter, *, max_pending: int = 256, min_kv_capacity: int = 256):
        if drafter.config.fuse_layers:
            raise ConfigError("EAGLE-3 fused drafters need per-layer target hidden states, which "
                              "the rollout engine does not expose yet (only 'final')")
        t = drafter.target_embed
        self.drafter = drafter.to(device=t.device, dtype=t.dtype).eval()  # where the target runs
        self.drafter.batch_invariant = True  # until bind(): the engine's setting
        a = drafter.arch
        self.kv = SlotKV(a.num_kv_heads, a.head_dim, t.dtype, t.device, min_capacity=min_kv_capacity)
        self.states: dict[int, _SeqState] = {}
        self.max_pending = max_pending
        """Observed features a sequence may hold before the drafter consumes them eagerly
        (during SD-off stretches features would otherwise pile up: hidden floats/token)."""
        self.batched = True
        """Chains drafted batched (False: per sequence, the tree path; tests' reference)."""
        self.static_chains: bool | None = None
        """Chain steps through eagle_graph.ChainGraphs (static buffers, one CUDA graph
        replay per step). None: on a CUDA device unless MEGATRON_TLT_DRAFT_GRAPHS=0;
        True: also on CPU (run eagerly on the static buffers; tests); False: never."""
        self.one_hot_chains = False
        """Sampled targets too get chains of the drafter's argmax tokens (one-hot
        proposals, as trees already are), verified by the one-hot rule (accept x with the
        target's probability of x): lossless like the sampled chains, with no draft
        distributions written or read and no noise drawn for the drafts. Off by default
        (`bench spec --drafters eagle-onehot` times it against the sampled chains)."""
        self._chain_graphs: ChainGraphs | None = None
        self.static_trees: bool | None = None
        """Tree steps through eagle_tree_graph.TreeGraphs (static buffers, one CUDA graph
        replay and one read-back per step). None: on a CUDA device unless
        MEGATRON_TLT_TREE_GRAPHS=0; True: also on CPU (eagerly on the static buffers);
        False: never (the per-sequence tree path)."""
        self._tree_graphs: TreeGraphs | None = None
        self.num_eager_steps = 0
        """Proposals drafted on the eager path (trees, or chains the static path does not
        serve)."""

    # ---- Drafter interface ------------------------------------------------------------

    def bind(self, engine) -> None:
        """Batch invariance follows the engine's: fixed 16-row matmul tiles where tokens must
        not depend on the batch (the CPU default, the tests), plain products otherwise (a
        CUDA engine's fused kernels are not batch-invariant either, and tiling multiplied
        the drafter's weight reads by rows / 16: 32 reads per linear to extend 32 sequences)."""
        inv = bool(engine.model.batch_invariant)
        if inv != self.drafter.batch_invariant:
            self.drafter.batch_invariant = inv
            for g in (self._chain_graphs, self._tree_graphs):
                if g is not None:
                    g.release()  # captured with the other products

    def _state(self, seq) -> _SeqState:
        st = self.states.get(seq.seq_id)
        if st is None:
            st = self.states[seq.seq_id] = _SeqState(slot=self.kv.acquire(), pending=[])
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
        st = self.states.pop(seq.seq_id, None)
        if st is not None:
            self.kv.release(st.slot)

    def reset(self):
        self.states.clear()
        self.kv.reset()
        for g in (self._chain_graphs, self._tree_graphs):
            if g is not None:
                g.reset()

    def chain_graphs(self) -> ChainGraphs | None:
        """The static-buffer chain drafter, when this proposer uses one (static_chains)."""
        if self._chain_graphs is None and self.static_chains is not False:
            cuda = torch.device(self.kv.device).type == "cuda"
            if self.static_chains or (cuda and chain_graphs_enabled()):
                self._chain_graphs = ChainGraphs(self, use_graphs=cuda)
        return self._chain_graphs

    def tree_graphs(self) -> TreeGraphs | None:
        """The static-buffer tree drafter, when this proposer uses one (static_trees)."""
        if self._tree_graphs is None and self.static_trees is not False:
            cuda = torch.device(self.kv.device).type == "cuda"
            if self.static_trees or (cuda and tree_graphs_enabled()):
                self._tree_graphs = TreeGraphs(self, use_graphs=cuda)
        return self._tree_graphs

    # ---- drafting -------------------------------------------------------------------------

    def _attend_rows(self, q, k, v, groups):
        """groups: per sequence (row slice, keys k [S,KVH,D], values v, mask [n, S])."""
        out = torch.empty_like(q)
        for sl, kk, vv, mask in groups:
            out[sl] = attend(q[sl], kk, vv, mask, self.drafter.scale)
        return out

    def _committed_kv(self, st: _SeqState) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv.k[st.slot, :st.num_pairs], self.kv.v[st.slot, :st.num_pairs]

    @torch.no_grad()
    def _extend(self, seqs, keep_last: bool = False) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Run every pair whose token is known (t + 1 < len(token_ids)) and whose feature
        was observed, writing its KV into the sequence's slot. All sequences' pairs go
        through one packed forward of the layer's first half (K/V); then each sequence's
        last pair alone attends over its slot and runs the rest (a fixed number of ops
        whatever the batch). Returns, per index into seqs that ran pairs, (f, logits) of
        its last pair. keep_last: leave the newest observed pair for the next propose
        (whose root it is)."""
        d = self.drafter
        toks, pieces, take, pair_idx, slot_of = [], [], [], [], []  # per packed pair
        last_row = {}  # index into seqs -> packed row of its last pair
        base = 0  # rows of torch.cat(pieces) before this sequence's
        for i, s in enumerate(seqs):
            st = self._state(s)
            lo = st.num_pairs
            hi = min(st.num_features - int(keep_last), len(s.token_ids) - 1)
            n = max(0, hi - lo)
            avail = sum(p.shape[0] for p in st.pending)
            if n == 0:
                continue
            pieces.extend(st.pending)
            take.extend(range(base, base + n))
            base += avail
            # Rows beyond the n used stay pending (only with keep_last, or features ahead
            # of the tokens): a per-sequence copy, outside the steady state.
            st.pending = [torch.cat(st.pending)[n:]] if avail > n else []
            toks.extend(s.token_ids[lo + 1:hi + 1])
            pair_idx.extend(range(lo, hi))
            slot_of.extend([st.slot] * n)
            st.num_pairs = hi
            last_row[i] = len(toks) - 1
        out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if not toks:
            return out
        p0 = next(d.parameters())
        dev = p0.device
        self.kv.ensure_capacity(max(pair_idx) + 1)
        feats = torch.cat(pieces)  # one op whatever the number of sequences
        if len(take) != feats.shape[0]:
            feats = feats[to_device(int64_tensor(take), feats.device)]
        # The index tables in one non-blocking copy (from pageable memory each .to(dev)
        # waited for every queued kernel: this runs at every admission under continuous
        # batching, _catch_up)
        flat = to_device(int64_tensor([pair_idx, slot_of, toks]), dev)
        idx, tokens = flat[:2], flat[2]
        g = d.fuse_features(feats.to(dev, p0.dtype))
        # Only each sequence's last pair goes on (its (f, logits) are all a proposal uses;
        # the other pairs' K/V are written): one query per sequence.
        rows = to_device(int64_tensor(list(last_row.values())), dev)
        bucket = plan_rows(len(seqs))  # planned as the graphs' extend of this step's bucket is
        f, lg, _ = d.forward_kv(tokens, g, idx[0] + 1, self.kv, idx[1], idx[0], rows=bucket * QUERY_TILE,
                                query=rows, query_rows=bucket)
        for j, i in enumerate(last_row):
            out[i] = (f[j], lg[j])
        return out

    @torch.no_grad()
    def propose(self, seqs, strategy, caps, running):
        d = self.drafter
        a = d.arch
        launched = self.launch(seqs, strategy, caps, running)
        if launched is not None:
            return launched.collect()
        if not strategy.is_chain:
            tg = self.tree_graphs()
            setting = tg.setting(seqs, strategy) if tg is not None else None
            if setting is not None:
                return tg.propose(seqs, strategy, caps, setting)
        self.num_eager_steps += 1
        builders = [TreeBuilder(s.token_ids[-1], strategy, cap) for s, cap in zip(seqs, caps)]
        # (1) extend over the committed pairs not yet consumed; the last one is the root.
        roots = self._extend(seqs)
        for i, s in enumerate(seqs):
            st = self.states[s.seq_id]
            if i not in roots or st.num_pairs != len(s.token_ids) - 1:
                builders[i].fail(f"drafter has features for {st.num_features} of "
                                 f"{len(s.token_ids) - 1} positions")
        if strategy.is_chain and self.batched:
            self._draft_chains(seqs, builders, roots)
        else:
            self._draft_trees(seqs, builders, roots, strategy)
        return [b.result(a.vocab_size) for b in builders]

    @torch.no_grad()
    def launch(self, seqs, strategy, caps, running):
        """Chain steps the static-buffer path serves (eagle_graph.ChainGraphs): replayed,
        not yet read back (an eagle_graph.ChainLaunch); None for every other step."""
        self._catch_up(seqs)
        cg = self.chain_graphs() if self.static_chains is not False else None
        setting = cg.setting(seqs, strategy) if cg is not None else None
        if setting is None:
            return None
        return cg.launch(seqs, strategy, caps, setting)

    @torch.no_grad()
    def launch_ahead(self, launched, verify_out, gidx, hidden):
        """The next chain step queued from the device's verification outputs
        (ChainGraphs.launch_ahead) for a static-path launch, else None."""
        cg = self._chain_graphs
        if cg is None or launched.setting is None:
            return None
        return cg.launch_ahead(launched, verify_out, gidx, hidden)

    def adopt(self, ahead, seqs, strategy, caps):
        """`ahead`'s launch when it drafted exactly what `launch` would now: the same
        sequences in the same order with the same per-sequence states (no preemption, no
        release), each sequence's first new pair where the draft-ahead started it and the
        new pairs its verification implied (`setting`'s checks), the same depth, sampling
        setting and noise draws, and no chain capped below the depth; else None."""
        cg = self._chain_graphs
        depth = min(strategy.depth, strategy.num_draft_nodes)
        if (cg is None or ahead.graphs is not cg or ahead.depth != depth
                or [s.seq_id for s in seqs] != ahead.seq_ids or min(caps) < depth):
            return None
        for i, s in enumerate(seqs):
            st = self.states.get(s.seq_id)
            if st is not ahead.states[i] or st.num_pairs != ahead.lo[i]:
                return None
            if ahead.draws is not None and s.rng.draws != ahead.draws[i]:
                return None
        if cg.setting(seqs, strategy) != ahead.setting:
            return None
        return cg.adopt(ahead, seqs, caps)

    def _catch_up(self, seqs) -> None:
        """Sequences with more committed pairs waiting than a query tile (new ones, one
        re-prefilled after a preemption) run all but their newest pair through one eager
        extend first. Why: the static-buffer step extends at most QUERY_TILE pairs per
        sequence, so one newly admitted sequence sent the whole batch's step down the eager
        path (~20x the launches) — under continuous batching, at every admission. Every
        proposal goes through here (propose calls launch), so the eager and the static
        paths compute the same pairs in the same chunks."""
        long = []
        for s in seqs:
            st = self.states.get(s.seq_id)
            if (st is not None and st.num_features == len(s.token_ids) - 1
                    and len(s.token_ids) - 1 - st.num_pairs > QUERY_TILE):
                long.append(s)
        if long:
            self._extend(long, keep_last=True)

    def _draft_chains(self, seqs, builders, roots) -> None:
        """Chains of every sequence at once. Per level: pick each live row's token from its
        logits (greedy: argmax of log_softmax, lowest id on ties; sampled: the race over the
        processed draft distribution with the request's next noise draw, exactly the
        per-sequence values), one host sync (tokens + finiteness), then one layer forward
        of the rows that draft deeper, writing their KV at index num_pairs + level of their
        slot. The only host value that changes from step to step is the number of live
        rows (and the rows' slots / positions / noise counters, which are tensor data)."""
        d = self.drafter
        cur = [i for i in sorted(roots) if not builders[i].done]
        if not cur:
            return
        states = [self.states[seqs[i].seq_id] for i in cur]
        self.kv.ensure_capacity(max(st.num_pairs + builders[i].max_levels for st, i in zip(states, cur)))
        f = torch.stack([roots[i][0] for i in cur])
        lg = torch.stack([roots[i][1] for i in cur])
        dev = lg.device
        slot_t, base_t = torch.tensor([[st.slot for st in states], [st.num_pairs for st in states]]).to(dev)
        ok_t = None  # rows whose last level wrote finite V (torch ops; forward_kv)
        bucket = plan_rows(len(seqs))  # planned for the step's bucket, as the graphs' levels are
        level = 0
        while True:
            tok, probs, sampled = self._pick_chain_tokens(seqs, cur, lg)
            finite = torch.isfinite(lg).all(-1)
            if ok_t is not None:
                finite &= ok_t
            host = torch.stack([tok, finite.long()]).tolist()  # the level's one host sync
            for r, i in enumerate(cur):
                if host[1][r]:
                    builders[i].expand_chain(int(host[0][r]), probs[sampled[i]] if i in sampled else None)
                else:
                    builders[i].fail("non-finite drafter logits")
                    if i in sampled:
                        seqs[i].rng.draws -= 1  # not drawn: the stream stays where it was
            keep = [r for r, i in enumerate(cur) if not builders[i].done]
            if not keep:
                return
            if len(keep) < len(cur):
                sel = torch.tensor(keep, device=dev)
                tok, f, slot_t, base_t = tok[sel], f[sel], slot_t[sel], base_t[sel]
                cur = [cur[r] for r in keep]
            idx = base_t + level
            f, lg, ok_t = d.forward_kv(tok, f, idx + 1, self.kv, slot_t, idx, rows=bucket, sanitize=True)
            level += 1

    def _pick_chain_tokens(self, seqs, cur, lg):
        """Draft tokens (target ids, [len(cur)] on the device) for rows `cur` with logits
        lg; for temperature > 0 rows also the processed draft distributions (target
        vocabulary) and {builder index: row of them}. Takes one noise draw per sampled row."""
        d = self.drafter
        dev = lg.device
        params = [seqs[i].request.sampling_params for i in cur]
        sampled = [p.temperature > 0 and not self.one_hot_chains for p in params]
        s_rows = [r for r, x in enumerate(sampled) if x]
        g_rows = [r for r, x in enumerate(sampled) if not x]
        tok = probs = None
        if g_rows:  # target ids
            lg_g = lg if not s_rows else lg[torch.tensor(g_rows, device=dev)]
            if fused_pick(lg_g, [0], [1.0]):  # one kernel, as the chain graphs pick (triton_pick.py)
                from megatron_tlt.spec.triton_pick import greedy_pick
                flags = torch.empty(2, lg_g.shape[0], dtype=torch.int64, device=dev)
                greedy_pick(lg_g.float().contiguous(), d.draft_to_target, flags[0], flags[1])
                tok = flags[0]
            else:
                tok = d.to_target_ids(torch.log_softmax(lg_g.float(), dim=-1).argmax(-1))  # first max = lowest id
        if s_rows:
            lg_s = lg if not g_rows else lg[torch.tensor(s_rows, device=dev)]
            sp = [params[r] for r in s_rows]
            streams = [seqs[cur[r]].rng for r in s_rows]
            keys = torch.tensor([s.key for s in streams])
            draws = torch.tensor([s.take() for s in streams])
            if fused_pick(lg_s, [int(p.top_k) for p in sp], [float(p.top_p) for p in sp]):
                from megatron_tlt.spec.triton_pick import chain_pick
                n_s = len(s_rows)
                probs = torch.zeros(n_s, d.arch.vocab_size, dtype=torch.float32, device=dev)
                flags = torch.empty(2, n_s, dtype=torch.int64, device=dev)
                chain_pick(lg_s.float().contiguous(),
                           torch.tensor([float(p.temperature) for p in sp], dtype=torch.float32).to(dev),
                           keys.to(dev), draws.to(dev), 0, d.draft_to_target, probs, flags[0], flags[1])
                tok_s = flags[0]  # target ids already
            else:
                qd = process_logits(lg_s,
                                    _row_param([float(p.temperature) for p in sp], dev, torch.float32),
                                    _row_param([max(int(p.top_k), 0) for p in sp], dev, torch.int64),
                                    _row_param([float(p.top_p) for p in sp], dev, torch.float32))
                noise = exponential_noise(keys, draws, qd.shape[-1], dev)
                tok_s = d.to_target_ids(race_sample(qd, noise))
                probs = d.scatter_to_target(qd).float()
            if tok is None:
                tok = tok_s
            else:
                tok = torch.empty(len(cur), dtype=torch.int64, device=dev) \
                    .index_put_((torch.tensor(g_rows, device=dev),), tok) \
                    .index_put_((torch.tensor(s_rows, device=dev),), tok_s)
        return tok, probs, {cur[r]: j for j, r in enumerate(s_rows)}

    def _draft_trees(self, seqs, builders, roots, strategy) -> None:
        """Level by level with per-sequence attention (trees; chains when not batched)."""
        d = self.drafter
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
                sampled = [i for i in ok if strategy.is_chain and params[i].temperature > 0
                           and not self.one_hot_chains]
                if sampled:
                    # Sampled chains, all sequences at once: the processed draft distribution,
                    # each sequence's next noise draw (the same values as drawing alone),
                    # the race; one host transfer for the tokens.
                    dev = lgs[sampled[0]].device
                    qd = process_logits(
                        torch.cat([lgs[i] for i in sampled]),
                        _row_param([float(params[i].temperature) for i in sampled], dev, torch.float32),
                        _row_param([max(int(params[i].top_k), 0) for i in sampled], dev, torch.int64),
                        _row_param([float(params[i].top_p) for i in sampled], dev, torch.float32))
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
                ck, cv = self._committed_kv(st)
                kk = torch.cat([ck] + [temp_kv[i][m][0][None] for m in anc] + [k[mine]])
                vv = torch.cat([cv] + [temp_kv[i][m][1][None] for m in anc] + [v[mine]])
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
