"""Model-free n-gram (suffix-match) drafter.

Proposes what followed the longest recent suffix of the sequence elsewhere:

- sources, in priority order: the sequence itself (prompt + response so far), the other
  live responses of its group (GRPO samples of the same prompt, generated concurrently),
  and earlier finished responses to the same prompt (a per-prompt store that persists
  across `generate` calls, newest first, at most `max_store_per_prompt` per prompt);
- match: the longest suffix of n tokens, n from `max_ngram` down to `min_ngram`; within a
  source the most recent occurrence first; the continuation is the tokens after it;
- a chain (topk = 1) is the first continuation found; a tree (topk > 1) merges up to topk
  distinct continuations (longest matches first) into a prefix tree of at most
  num_verify_tokens - 1 nodes.

No weights and no randomness: proposals are deterministic functions of the token
sequences. They are one-hot (draft_probs=None), which the verifier accepts losslessly
however they were chosen. A sequence with no match decodes plainly that step. At
temperature > 0 the drafts decide which of a request's coins test which tokens, so the
tokens sampled (not their distribution) depend on the sources: the same requests, seeds,
schedule and store give the same tokens. The RL loop checkpoints the store per rank
(`state_dict`), so a resumed run replays the uninterrupted run's tokens.

Index: per token list, a dict from each n-gram (n in [min_ngram, max_ngram]) to the
positions right after its occurrences, updated incrementally as tokens are appended,
so a lookup costs O(max_ngram) dict probes instead of a scan.

A group is keyed by (str(prompt_id), prompt tokens): the same prompt_id with another
prompt never mixes.
"""

from __future__ import annotations

import collections

from megatron_tlt.errors import ConfigError
from megatron_tlt.spec.decode import Drafter
from megatron_tlt.spec.tree import DraftTree, Strategy, chain, trie


class SuffixIndex:
    """A growing token list with an n-gram -> end positions index."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}

    def extend(self, tokens) -> None:
        for t in tokens:
            self.tokens.append(int(t))
            end = len(self.tokens)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.ends.setdefault(tuple(self.tokens[end - n:end]), []).append(end)

    def sync(self, tokens: list[int]) -> None:
        """Catch up with a list this index mirrors (tokens are only ever appended)."""
        if len(tokens) > len(self.tokens):
            self.extend(tokens[len(self.tokens):])

    def continuations(self, suffix: tuple[int, ...], length: int, limit: int):
        """Up to `limit` continuations (newest occurrence first) of `suffix`, each at
        most `length` tokens, never empty."""
        out = []
        for end in reversed(self.ends.get(suffix, ())):
            if end < len(self.tokens):
                out.append(self.tokens[end:end + length])
                if len(out) >= limit:
                    break
        return out


class NgramDrafter(Drafter):
    name = "ngram"
    feature = None

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, *, max_store_per_prompt: int = 16,
                 use_group: bool = True, use_store: bool = True):
        if not isinstance(min_ngram, int) or not isinstance(max_ngram, int) or not 1 <= min_ngram <= max_ngram:
            raise ConfigError(f"n-gram sizes must satisfy 1 <= min_ngram ({min_ngram!r}) <= "
                              f"max_ngram ({max_ngram!r})")
        if not isinstance(max_store_per_prompt, int) or max_store_per_prompt < 0:
            raise ConfigError(f"max_store_per_prompt must be an integer >= 0, got {max_store_per_prompt!r}")
        self.min_n, self.max_n = min_ngram, max_ngram
        self.max_store = max_store_per_prompt
        self.use_group, self.use_store = use_group, use_store
        self.live: dict[int, tuple[object, SuffixIndex]] = {}  # seq_id -> (group key, index)
        self.store: dict[object, collections.deque[SuffixIndex]] = {}

    @staticmethod
    def group_key(seq) -> tuple:
        return (str(seq.request.prompt_id), tuple(seq.token_ids[:seq.prompt_len]))

    def _index(self, seq) -> SuffixIndex:
        entry = self.live.get(seq.seq_id)
        if entry is None:
            entry = self.live[seq.seq_id] = (self.group_key(seq), SuffixIndex(self.min_n, self.max_n))
        entry[1].sync(seq.token_ids)
        return entry[1]

    def _sources(self, seq, own: SuffixIndex) -> list[SuffixIndex]:
        key = self.live[seq.seq_id][0]
        out = [own]
        if self.use_group:
            others = [(sid, idx) for sid, (k, idx) in self.live.items() if k == key and sid != seq.seq_id]
            out.extend(idx for _, idx in sorted(others, key=lambda e: e[0]))
        if self.use_store:
            out.extend(reversed(self.store.get(key, ())))
        return out

    def lookup(self, seq, own: SuffixIndex, length: int, limit: int) -> list[list[int]]:
        """Up to `limit` distinct continuations, longest suffix match first."""
        tokens = own.tokens
        found: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        sources = self._sources(seq, own)
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            suffix = tuple(tokens[-n:])
            for src in sources:
                for cont in src.continuations(suffix, length, limit):
                    key = tuple(cont)
                    if key not in seen:
                        seen.add(key)
                        found.append(cont)
                        if len(found) >= limit:
                            return found
        return found

    def propose(self, seqs, strategy: Strategy, caps, running):
        for s in running:  # group members are sources even when they do not speculate
            self._index(s)
        trees = []
        for seq, cap in zip(seqs, caps):
            own = self._index(seq)
            depth = min(strategy.depth, cap)
            root = seq.token_ids[-1]
            if strategy.is_chain:
                conts = self.lookup(seq, own, min(depth, strategy.num_draft_nodes), 1)
                trees.append(chain(root, conts[0]) if conts else DraftTree([root], [-1]))
            else:
                conts = self.lookup(seq, own, depth, strategy.topk)
                trees.append(trie(root, conts, strategy.num_draft_nodes))
        return trees

    def release(self, seq):
        pass  # token lists survive preemption; nothing to rebuild

    def finish(self, seq):
        entry = self.live.pop(seq.seq_id, None)
        if entry is None or not self.use_store or self.max_store == 0 or seq.finish_reason == "error":
            return
        key, idx = entry
        idx.sync(seq.token_ids)
        q = self.store.setdefault(key, collections.deque(maxlen=self.max_store))
        q.append(idx)

    def reset(self):
        self.live.clear()

    def clear_store(self) -> None:
        self.store.clear()

    # The store is state: at temperature > 0 the drafts decide which coins test which
    # tokens, so the tokens sampled depend on it (still from the target's distribution).
    # A resumed RL run restores it to replay the uninterrupted run's tokens.
    def state_dict(self) -> dict:
        """The per-prompt store: {"store": [[prompt_id, prompt tokens, [response token
        lists, oldest first]], ...]} (plain lists; torch.save / JSON-safe)."""
        return {"format": 1, "store": [[key[0], list(key[1]), [idx.tokens[:] for idx in q]]
                                       for key, q in self.store.items()]}

    def load_state_dict(self, state: dict) -> None:
        """Replace the store with a state_dict()'s (the live sequences are untouched)."""
        if not isinstance(state, dict) or state.get("format") != 1:
            raise ValueError(f"not an NgramDrafter state (format {state.get('format') if isinstance(state, dict) else None!r})")
        self.store.clear()
        for pid, prompt, lists in state["store"]:
            q = self.store.setdefault((pid, tuple(prompt)), collections.deque(maxlen=self.max_store))
            for tokens in lists:
                idx = SuffixIndex(self.min_n, self.max_n)
                idx.extend(tokens)
                q.append(idx)
