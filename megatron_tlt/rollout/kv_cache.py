"""Paged KV cache: a fixed pool of blocks and one block table per sequence.

Terms:
- *block*: `block_size` consecutive token slots of one sequence, for every layer, K and V.
- *cache position* `p` of a sequence: the p-th KV entry it owns; its *slot* (flat index
  into a layer's `[num_blocks * block_size, num_kv_heads, head_dim]` view) is
  `block_table[p // block_size] * block_size + p % block_size`. Cache positions equal
  token positions for committed entries; during tree verification the uncommitted
  entries sit past the committed ones in query order until `move` compacts them.

The whole pool is one tensor `[2, num_layers, num_blocks, block_size, num_kv_heads,
head_dim]`; `k[layer]` / `v[layer]` are views into it, so a CUDA graph can capture fixed
addresses.

Sleep/wake: `sleep()` releases the pool (every KV entry is lost) and is only allowed when
no sequence holds blocks — the engine sleeps between `generate` calls, never inside one,
so no request ever needs re-prefilling because of a sleep. `wake()` allocates a fresh pool
(new addresses: graphs captured against the old pool must be re-captured).
"""

from __future__ import annotations

import torch


class PagedKVCache:
    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim), ("num_blocks", num_blocks),
                            ("block_size", block_size)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"PagedKVCache {name} must be a positive integer, got {value!r}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        # Pop from the end: lowest block ids are handed out first (deterministic layout).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[int, list[int]] = {}
        self._pool: torch.Tensor | None = None
        self.k: list[torch.Tensor] = []  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
        self.v: list[torch.Tensor] = []
        self.wake()

    # ---- memory -------------------------------------------------------------------

    @property
    def is_sleeping(self) -> bool:
        return self._pool is None

    def bytes_per_block(self) -> int:
        return (2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim
                * torch.empty((), dtype=self.dtype).element_size())

    def check_idle(self) -> None:
        """RuntimeError unless no sequence holds blocks (what sleep() needs)."""
        if self._tables:
            raise RuntimeError(f"PagedKVCache.sleep() with {len(self._tables)} sequences holding "
                               f"blocks; finish or free them first (sleep is only allowed when idle)")

    def sleep(self) -> None:
        """Free the pool's memory. Only allowed when no sequence holds blocks."""
        self.check_idle()
        self.k, self.v, self._pool = [], [], None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
        """(Re)allocate the pool; a no-op when awake."""
        if self._pool is not None:
            return
        self._pool = torch.zeros(2, self.num_layers, self.num_blocks, self.block_size,
                                 self.num_kv_heads, self.head_dim, dtype=self.dtype,
                                 device=self.device)
        self.k = list(self._pool[0].unbind(0))
        self.v = list(self._pool[1].unbind(0))

    def _check_awake(self) -> None:
        if self._pool is None:
            raise RuntimeError("PagedKVCache is asleep; call wake() first")

    # ---- block accounting ------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_slots(self, seq_id: int) -> int:
        """Token slots currently allocated to `seq_id`."""
        return len(self._tables.get(seq_id, ())) * self.block_size

    def extra_blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(self._tables.get(seq_id, ())))

    def can_hold(self, seq_id: int, num_tokens: int) -> bool:
        return self.extra_blocks_needed(seq_id, num_tokens) <= len(self._free)

    def ensure(self, seq_id: int, num_tokens: int) -> bool:
        """Grow `seq_id`'s table to hold `num_tokens` entries; False (and no change) if the
        pool is short."""
        self._check_awake()
        table = self._tables.get(seq_id)
        if table is not None and num_tokens <= len(table) * self.block_size:
            return True  # already held (the usual case: every step asks for every sequence)
        need = self.extra_blocks_needed(seq_id, num_tokens)
        if need > len(self._free):
            return False
        table = self._tables.setdefault(seq_id, [])
        for _ in range(need):
            table.append(self._free.pop())
        return True

    def free(self, seq_id: int) -> None:
        """Return `seq_id`'s blocks to the pool (no-op for an unknown id)."""
        table = self._tables.pop(seq_id, None)
        if table:
            self._free.extend(reversed(table))

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._tables.get(seq_id, ()))

    def has_sequences(self) -> bool:
        return bool(self._tables)

    # ---- slots ------------------------------------------------------------------------

    def slots(self, seq_id: int, positions: torch.Tensor, device=None) -> torch.Tensor:
        """Flat slot ids of cache positions `positions` ([N] int64) of `seq_id` -> [N] int64,
        on `device` (default: the cache's)."""
        table = torch.tensor(self._tables.get(seq_id, []), dtype=torch.int64)
        positions = positions.to(torch.int64).cpu()
        if positions.numel() and int(positions.max()) >= table.numel() * self.block_size:
            raise RuntimeError(f"sequence {seq_id}: cache position {int(positions.max())} is beyond "
                               f"its {table.numel()} allocated blocks")
        return (table[positions // self.block_size] * self.block_size
                + positions % self.block_size).to(self.device if device is None else device)

    def slot_range(self, seq_id: int, lo: int, hi: int) -> list[int]:
        """Flat slot ids of cache positions lo..hi-1 of `seq_id`, as Python ints (the
        engine's per-step metadata: no tensor op per sequence)."""
        table = self._tables.get(seq_id, ())
        bs = self.block_size
        if hi > len(table) * bs:
            raise RuntimeError(f"sequence {seq_id}: cache position {hi - 1} is beyond "
                               f"its {len(table)} allocated blocks")
        return [table[p // bs] * bs + p % bs for p in range(lo, hi)]

    @torch.no_grad()
    def move(self, seq_id: int, src_positions: torch.Tensor, dst_positions: torch.Tensor) -> None:
        """Copy the KV entries at cache positions `src_positions` ([N]) to `dst_positions`
        ([N]) in every layer. Gathers before scattering, so overlapping moves are safe."""
        self._check_awake()
        src = self.slots(seq_id, src_positions)
        dst = self.slots(seq_id, dst_positions)
        flat = self._pool.view(2, self.num_layers, self.num_blocks * self.block_size,
                               self.num_kv_heads, self.head_dim)
        flat[:, :, dst] = flat[:, :, src].clone()
