"""Draft trees: the strategy, one sequence's tree, and the batched verify inputs.

A *draft tree* of one sequence has N nodes in topological order (parent index < child
index). Node 0 is the *root*: the sequence's last token, whose KV is not yet in the
target's cache (it is the pending token of a decode step). Every other node is a draft
token; `parents[i]` is its parent node. A chain is `parents = [-1, 0, 1, ..., N - 2]`.
The same layout as megatron_tlt.spec.verify_ref (which defines accepted / rejected /
recovered / bonus tokens and the acceptance metrics).

In the target, node i sits at RoPE position `root_position + depth(i)` and attends to the
whole committed prefix plus its ancestors and itself (`tree_mask`). `TreeBatch` pads the
trees of a batch to one N with *padding nodes* (parent -1, token -1 for the verifier;
token 0 at the root's position, seeing only itself, for the forward), which verification
ignores and `commit_kv` drops.

Strategy (what the adaptive engine tunes per batch-size bucket):
- depth: draft tokens along the longest path (chain length for a chain);
- topk: children expanded per node; 1 = a chain;
- num_verify_tokens: nodes sent to the target *including the root*, so a step verifies
  num_verify_tokens - 1 draft tokens (SGLang's `speculative_num_draft_tokens`). EAGLE-2
  dynamic trees keep the num_verify_tokens - 1 draft nodes with the highest cumulative
  draft log-probability (`select_top_nodes`).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from megatron_tlt.errors import ConfigError
from megatron_tlt.rollout.host import int64_tensor


@dataclasses.dataclass(frozen=True, kw_only=True)
class Strategy:
    depth: int = 4
    """Draft tokens along the longest root-to-leaf path (>= 1)."""
    topk: int = 1
    """Children expanded per node (1 = chain)."""
    num_verify_tokens: int | None = None
    """Tree nodes verified, root included; None: depth + 1 for a chain, 1 + depth * topk
    for a tree."""

    def __post_init__(self):
        for name in ("depth", "topk"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"spec {name} must be an integer >= 1, got {v!r}")
        n = self.num_verify_tokens
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 2):
            raise ConfigError(f"spec num_verify_tokens must be an integer >= 2 (the root and at "
                              f"least one draft token), got {n!r}")

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    @property
    def num_draft_nodes(self) -> int:
        """Draft nodes sent to the verifier (root excluded)."""
        if self.is_chain:
            full = self.depth
        else:
            full = self.depth * self.topk  # top-k per level after EAGLE-2 reranking
        if self.num_verify_tokens is None:
            return full
        return min(self.num_verify_tokens - 1, self.max_nodes())

    def max_nodes(self) -> int:
        """Most draft nodes a tree of this depth/topk can hold (topk at depth 1, topk^2 at
        each deeper level: the children of the topk expanded nodes)."""
        if self.is_chain:
            return self.depth
        return self.topk + (self.depth - 1) * self.topk * self.topk

    def as_dict(self) -> dict:
        return {"depth": self.depth, "topk": self.topk, "num_verify_tokens": self.num_draft_nodes + 1}


def parse_depth_schedule(text: str | int) -> list[tuple[int | None, int]]:
    """`--spec-depth` without tree widths: [(bound or None, depth)]
    (parse_strategy_schedule's form; a DEPTHxTOPK entry is an error here)."""
    out = []
    for b, d, k in parse_strategy_schedule(text):
        if k is not None:
            raise ConfigError(f"spec depth {text!r}: a tree width (DEPTHxTOPK) is not accepted here")
        out.append((b, d))
    return out


def _depth_entry(what: str, part: str, check: bool = True) -> tuple[int, int | None]:
    """(depth, topk or None) of "D" or "DxK"; `what` names the value in errors. check=False
    leaves the range to Strategy (one depth: its "spec depth must be an integer >= 1")."""
    d, x, k = part.strip().lower().partition("x")
    try:
        depth, topk = int(d), (int(k) if x else None)
    except ValueError:
        raise ConfigError(f"{what}: expected an integer or BATCH:DEPTH pairs (e.g. 1:6,8:4,32:3; "
                          f"a depth DxK drafts top-K trees: 1:6x2,8:4), got {part!r}") from None
    if check and (depth < 1 or (topk is not None and topk < 1)):
        raise ConfigError(f"{what}: batch sizes, depths and tree widths must be >= 1")
    return depth, topk


def parse_strategy_schedule(text: str | int) -> list[tuple[int | None, int, int | None]]:
    """`--spec-depth`: one depth ("4", 4) or depths by running batch size,
    "B1:D1,B2:D2,...": depth D1 while at most B1 sequences run, else D2 while at most B2,
    ...; above the last bound, the last depth. A depth may carry a tree width, DxK (e.g.
    "1:6x2,8:4,32:4": top-2 trees of depth 6 for one running sequence, chains above):
    K overrides --spec-topk for that entry. Returns [(bound or None, depth, topk or None)]."""
    raw = str(text).strip()
    if ":" not in raw:
        return [(None, *_depth_entry(f"spec depth {text!r}", raw, check=False))]
    out: list[tuple[int | None, int, int | None]] = []
    for part in raw.split(","):
        b, sep, d = part.partition(":")
        try:
            b = int(b)
        except ValueError:
            b = None
        if not sep or b is None:
            raise ConfigError(f"spec depth schedule {text!r}: {part!r} is not BATCH:DEPTH (e.g. "
                              "1:6,8:4,32:3)")
        if b < 1:
            raise ConfigError(f"spec depth schedule {text!r}: batch sizes, depths and tree widths must be >= 1")
        if out and b <= out[-1][0]:
            raise ConfigError(f"spec depth schedule {text!r}: batch bounds must increase")
        out.append((b, *_depth_entry(f"spec depth schedule {text!r}", d)))
    return out


@dataclasses.dataclass(eq=False)
class DraftTree:
    """One sequence's proposal. tokens[0] is the root (the last committed token)."""

    tokens: list[int]
    parents: list[int]
    draft_probs: torch.Tensor | None = None
    """[N, vocab] float32: the distribution each node's token was drawn from (row 0
    unused); None = deterministic proposals (one-hot)."""
    fallback_reason: str | None = None
    """Set when the drafter failed (e.g. non-finite outputs): decode this sequence plainly."""

    def __post_init__(self):
        if len(self.tokens) != len(self.parents) or not self.tokens or self.parents[0] != -1:
            raise ValueError(f"DraftTree: tokens {self.tokens} / parents {self.parents} malformed")
        for i in range(1, len(self.parents)):
            if not 0 <= self.parents[i] < i:
                raise ValueError(f"DraftTree: parent {self.parents[i]} of node {i} is not an earlier node")

    @classmethod
    def failed(cls, root: int, reason: str) -> "DraftTree":
        return cls([root], [-1], None, reason)

    @property
    def num_drafts(self) -> int:
        return len(self.tokens) - 1

    def depths(self) -> list[int]:
        d = [0] * len(self.parents)
        for i in range(1, len(self.parents)):
            d[i] = d[self.parents[i]] + 1
        return d

    def truncate_depth(self, max_depth: int) -> "DraftTree":
        """Drop the nodes deeper than max_depth (renumbering the rest)."""
        if len(self.tokens) - 1 <= max_depth:
            return self  # no node is deeper than N - 1
        depths = self.depths()
        keep = [i for i in range(len(self.tokens)) if depths[i] <= max_depth]
        if len(keep) == len(self.tokens):
            return self
        new_index = {old: new for new, old in enumerate(keep)}
        parents = [-1] + [new_index[self.parents[i]] for i in keep[1:]]
        probs = None if self.draft_probs is None else self.draft_probs[keep]
        return DraftTree([self.tokens[i] for i in keep], parents, probs, self.fallback_reason)


def chain(root: int, tokens: list[int], draft_probs: torch.Tensor | None = None) -> DraftTree:
    return DraftTree([root] + list(tokens), list(range(-1, len(tokens))), draft_probs)


def trie(root: int, continuations: list[list[int]], max_nodes: int) -> DraftTree:
    """Merge token continuations (in priority order) into a prefix tree, at most
    max_nodes draft nodes; earlier continuations get lower node indices first."""
    tokens, parents = [root], [-1]
    children: dict[tuple[int, int], int] = {}
    for cont in continuations:
        cur = 0
        for tok in cont:
            nxt = children.get((cur, tok))
            if nxt is None:
                if len(tokens) - 1 >= max_nodes:
                    break
                tokens.append(tok)
                parents.append(cur)
                nxt = len(tokens) - 1
                children[(cur, tok)] = nxt
            cur = nxt
    return DraftTree(tokens, parents)


def select_top_nodes(scores: list[float], parents: list[int], n: int) -> list[int]:
    """EAGLE-2 reranking: indices of the n draft nodes (1..len-1; 0 is the root) with the
    highest cumulative log-probability, as a sorted list. Along a path scores never
    increase, so the selection is closed under ancestors; ties go to the earlier node
    (a parent precedes its children), which keeps that true for log-prob 0 steps too."""
    order = sorted(range(1, len(scores)), key=lambda i: (-scores[i], i))
    chosen = set(order[:n])
    for i in list(chosen):  # defensive: NaN-free scores never need this
        p = parents[i]
        while p > 0 and p not in chosen:
            chosen.add(p)
            p = parents[p]
    return sorted(chosen)


def subtree(tree_tokens: list[int], tree_parents: list[int], keep: list[int],
            draft_probs: torch.Tensor | None = None) -> DraftTree:
    """The tree restricted to the root and the draft nodes `keep` (sorted, closed under
    ancestors), renumbered."""
    index = {0: 0}
    for new, old in enumerate(keep, 1):
        index[old] = new
    nodes = [0] + keep
    parents = [-1] + [index[tree_parents[i]] for i in keep]
    probs = None if draft_probs is None else draft_probs[nodes]
    return DraftTree([tree_tokens[i] for i in nodes], parents, probs)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[B, N] int64 parents (-1: root or padding) -> [B, N, N] bool: node i sees node j iff
    j is i or an ancestor of i. Padding nodes see only themselves."""
    b, n = parents.shape
    mask = torch.eye(n, dtype=torch.bool, device=parents.device).expand(b, n, n).clone()
    for i in range(1, n):
        p = parents[:, i]
        has = p >= 0
        if bool(has.any()):
            rows = has.nonzero().squeeze(1)
            mask[rows, i] |= mask[rows, p[rows]]
    return mask


def node_depths(parents: torch.Tensor) -> torch.Tensor:
    """[B, N] parents -> [B, N] int64 depths (root and padding 0)."""
    b, n = parents.shape
    depth = torch.zeros(b, n, dtype=torch.int64, device=parents.device)
    for i in range(1, n):
        p = parents[:, i]
        depth[:, i] = torch.where(p >= 0, depth.gather(1, p.clamp(min=0)[:, None])[:, 0] + 1, 0)
    return depth


@functools.lru_cache(maxsize=1024)
def _tree_rows(parents: tuple[int, ...], n: int) -> tuple[tuple[int, ...], bytes, int]:
    """(depths, ancestor mask, depth) of a tree with these parents padded to n nodes, for
    TreeBatch.pack: depths 0 for padding nodes; the mask as n * n bytes, row-major, byte
    i * n + j = 1 iff node j is node i or one of its ancestors (padding nodes see only
    themselves). Cached: the trees of a run come in few shapes (mostly chains of the
    strategy's depth)."""
    depth = [0] * n
    anc = [1 << i for i in range(n)]  # ancestor sets as bit masks (bit j: node j)
    for i in range(1, len(parents)):
        p = parents[i]
        depth[i] = depth[p] + 1
        anc[i] |= anc[p]
    mask = bytes((a >> j) & 1 for a in anc for j in range(n))
    return tuple(depth), mask, max(depth)


@dataclasses.dataclass(kw_only=True)
class TreeBatch:
    """Draft trees of a batch, padded to one N: the inputs of verify_forward and verify."""

    parents: torch.Tensor  # [B, N] int64, -1 for the root and padding
    draft_tokens: torch.Tensor  # [B, N] int64, -1 for padding
    query_tokens: torch.Tensor  # [B, N] int64 forward inputs (padding -> 0)
    positions: torch.Tensor  # [B, N] int64 RoPE positions (padding -> root position)
    tree_mask: torch.Tensor  # [B, N, N] bool: query i sees query j
    draft_probs: torch.Tensor | None  # [B, N, vocab] float32, None = one-hot proposals
    num_nodes: list[int]  # real nodes per sequence (root included)
    max_depth: int

    @classmethod
    def pack(cls, trees: list[DraftTree], root_positions: list[int], vocab: int, *,
             probs_out: torch.Tensor | None = None) -> "TreeBatch":
        """Pad the trees to one N. The int tables are built in Python and converted with
        one int64_tensor call (this runs every speculative step, on the host); a tree's
        depths and ancestor mask depend on its parents only (`_tree_rows`, cached).

        probs_out: optional [B', N, vocab] float32 buffer (B' >= B; e.g. the static input of
        a CUDA graph) that receives the draft probabilities; batch.draft_probs is then its
        first B rows. Without it they are allocated on the drafter's device."""
        n = max(len(t.tokens) for t in trees)
        par_rows, tok_rows, pos_rows, masks, depth_max = [], [], [], [], 0
        for t, root in zip(trees, root_positions):
            depth, mask, tree_depth = _tree_rows(tuple(t.parents), n)
            pad = [-1] * (n - len(t.tokens))
            par_rows.append(t.parents + pad)
            tok_rows.append(t.tokens + pad)
            pos_rows.append([root + d for d in depth])  # padding nodes: the root's position
            masks.append(mask)
            depth_max = max(depth_max, tree_depth)
        table = int64_tensor([par_rows, tok_rows, pos_rows])
        parents, tokens, positions = table[0], table[1], table[2]
        # [B, N, N]: j in anc(i), from the trees' mask bytes (bool storage is one 0/1 byte)
        mask = torch.frombuffer(bytearray(b"".join(masks)), dtype=torch.bool).view(len(trees), n, n)
        return cls(parents=parents, draft_tokens=tokens, query_tokens=tokens.clamp(min=0),
                   positions=positions, tree_mask=mask,
                   draft_probs=cls._pack_draft_probs(trees, tokens, vocab, probs_out),
                   num_nodes=[len(t.tokens) for t in trees], max_depth=depth_max)

    @staticmethod
    def _pack_draft_probs(trees: list[DraftTree], tokens: torch.Tensor,  # [B, N] int64, -1 padded
                          vocab: int, out: torch.Tensor | None) -> torch.Tensor | None:
        """[B, N, vocab] float32 draft probabilities of a batch, or None when every tree is
        one-hot. Sampled trees carry draft_probs; when a batch mixes them with one-hot trees,
        the one-hot ones get explicit one-hot rows (the same proposal, verified the same way).
        One torch.stack when every tree has float32 probabilities of full length on one device
        (sampled chains of equal depth, the common case); row by row otherwise."""
        with_probs = [t.draft_probs for t in trees if t.draft_probs is not None]
        if not with_probs:
            return None
        b, n = tokens.shape
        dev = with_probs[0].device if out is None else out.device
        if out is not None:
            if out.dim() != 3 or out.shape[0] < b or tuple(out.shape[1:]) != (n, vocab) or out.dtype != torch.float32:
                raise ValueError(f"probs_out must be [>= {b}, {n}, {vocab}] float32, got "
                                 f"{tuple(out.shape)} {out.dtype}")
            out = out[:b]
        if len(with_probs) == b and all(p.shape == (n, vocab) and p.dtype == torch.float32 and p.device == dev
                                        for p in with_probs):
            return torch.stack(with_probs) if out is None else torch.stack(with_probs, out=out)
        probs = torch.zeros(b, n, vocab, device=dev) if out is None else out.zero_()
        for i, t in enumerate(trees):
            k = len(t.tokens)
            if t.draft_probs is not None:
                probs[i, :k] = t.draft_probs.float()
            else:
                probs[i, torch.arange(1, k), tokens[i, 1:k]] = 1.0
        return probs

    @classmethod
    def make_dummy(cls, batch: int = 2, depth: int = 3, topk: int = 2, vocab: int = 32,
                   seed: int = 0) -> "TreeBatch":
        """Random full top-k trees (chains for topk=1) rooted at position 7, for tests."""
        g = torch.Generator().manual_seed(seed)
        trees = []
        for _ in range(batch):
            toks, pars, frontier = [int(torch.randint(vocab, (), generator=g))], [-1], [0]
            for _ in range(depth):
                new = []
                for f in frontier[:topk]:
                    for _ in range(topk):
                        toks.append(int(torch.randint(vocab, (), generator=g)))
                        pars.append(f)
                        new.append(len(toks) - 1)
                frontier = new
            trees.append(DraftTree(toks, pars))
        return cls.pack(trees, [7] * batch, vocab)


class TreeBuilder:
    """Builds one sequence's draft tree level by level (EAGLE-2 dynamic tree; a chain when
    topk = 1). The drafter forwards `frontier` nodes (tokens `tokens[i]`, parents
    `parents[i]`), then calls `expand_topk` with their draft log-probabilities (top-k
    children each, deterministic: ties -> lowest id) or, for sampled chains,
    `expand_sampled`. The top-k candidates by cumulative log-probability form the next
    frontier; `result()` keeps the num_draft_nodes best nodes of all candidates."""

    def __init__(self, root: int, strategy: Strategy, max_depth: int):
        self.strategy = strategy
        self.tokens = [root]
        self.parents = [-1]
        self.scores = [0.0]
        self.rows: dict[int, torch.Tensor] = {}  # node -> draft distribution [vocab] (sampled)
        self.frontier = [0]
        self.level = 0
        levels = min(strategy.depth, max_depth)
        if strategy.is_chain:
            levels = min(levels, strategy.num_draft_nodes)
        self.max_levels = max(levels, 0)
        self.fallback_reason: str | None = None

    @property
    def done(self) -> bool:
        return self.fallback_reason is not None or self.level >= self.max_levels or not self.frontier

    def fail(self, reason: str) -> None:
        self.fallback_reason = reason

    def _add(self, token: int, parent: int, score: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.scores.append(score)
        return len(self.tokens) - 1

    def expand_topk(self, logp: torch.Tensor,  # [len(frontier), V'] draft log-probs (-inf allowed)
                    to_target=None) -> None:
        k = min(self.strategy.topk, logp.shape[-1])  # a draft vocabulary may be smaller than topk
        vals, ids = torch.sort(logp.float(), dim=-1, descending=True, stable=True)
        vals, ids = vals[:, :k].tolist(), ids[:, :k]
        if to_target is not None:
            ids = to_target(ids)
        ids = ids.tolist()
        cands = []
        for r, f in enumerate(self.frontier):
            for j in range(k):
                if vals[r][j] != float("-inf"):
                    cands.append((self.scores[f] + vals[r][j], r, j, f, ids[r][j]))
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        self.expand_candidates([(tok, r, s) for s, r, _, _, tok in cands])

    def expand_candidates(self, cands: list[tuple[int, int, float]]) -> None:
        """One level's candidates (token, frontier row, cumulative score), already in rank
        order (score descending, then frontier row, then the row's own rank): each is a new
        node, those of score -inf dropped; the first topk are the next frontier (what
        expand_topk does with the candidates it ranks; eagle_tree_graph ranks them on the
        device)."""
        f = self.frontier
        nodes = [self._add(tok, f[r], s) for tok, r, s in cands if s != float("-inf")]
        self.frontier = nodes[:self.strategy.topk]
        self.level += 1

    def expand_sampled(self, token: int, draft_row: torch.Tensor) -> None:
        """Chains at temperature > 0: the child token drawn from draft_row ([vocab], the
        processed draft distribution in the target vocabulary)."""
        self.expand_chain(token, draft_row)

    def expand_chain(self, token: int, draft_row: torch.Tensor | None = None) -> None:
        """Chains: append the child `token` (greedy: the draft argmax, lowest id on ties,
        what expand_topk picks; sampled: drawn from draft_row). Chain scores are unused."""
        (f,) = self.frontier
        node = self._add(token, f, 0.0)
        if draft_row is not None:
            self.rows[node] = draft_row
        self.frontier = [node]
        self.level += 1

    def result(self, vocab: int | None = None) -> DraftTree:
        if self.fallback_reason is not None:
            return DraftTree.failed(self.tokens[0], self.fallback_reason)
        probs = None
        if self.rows:
            first = next(iter(self.rows.values()))
            probs = torch.zeros(len(self.tokens), vocab, device=first.device)
            for node, row in self.rows.items():
                probs[node] = row
        if self.strategy.is_chain:
            return DraftTree(self.tokens, self.parents, probs)
        keep = select_top_nodes(self.scores, self.parents, self.strategy.num_draft_nodes)
        return subtree(self.tokens, self.parents, keep, probs)
