"""Packing (prompt, solution) token sequences into fixed-length training rows.

A *sample* is the token list ``encode_prompt(prompt) + encode(solution) + [eos]``
with `prompt_len` marking where the solution starts. Each sample of L tokens fills
L - 1 positions of a row: inputs ``ids[:-1]``, labels ``ids[1:]`` (the eos is a label,
never an input, so no position is spent predicting across a sample boundary).

Per row (`PackedRows`, all [rows, seq_length]):

- ``tokens`` / ``labels``: inputs and next-token targets; padding is ``pad_id``.
- ``loss_mask``: 1.0 exactly where the label is a solution token or the eos.
- ``position_ids``: restart at 0 at every sample (RoPE sees each sample alone).
- ``segment_ids``: 0, 1, 2, ... per sample in the row; the padding tail is one more
  segment (so no query row of the attention mask is fully masked — that would give
  NaN softmax rows).
- ``attention_mask()``: [rows, 1, s, s] bool, True = masked (Megatron's convention):
  position i sees j iff j <= i and both lie in the same segment. With it, the logits
  of a packed row equal the logits of each sample run alone (tests/unit/test_packing.py).

Packing is greedy and sequential: samples go into the current row in stream order
while they fit; the first one that does not fit starts the next row. So the rows of a
batch, and the index of the first unconsumed sample (the data position a checkpoint
records), depend only on the stream — deterministic, resumable.

A sample longer than seq_length + 1 tokens cannot fit a row: ``overlong="drop"``
skips it (callers filter them out up front, `fits`), ``"truncate"`` keeps its first
seq_length + 1 tokens (the solution then has no eos in the row).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Sequence

import torch

OVERLONG_POLICIES = ("drop", "truncate")


@dataclasses.dataclass(frozen=True)
class TokenizedSample:
    """One training sample: `ids` = prompt tokens + solution tokens + eos."""

    ids: tuple[int, ...]
    prompt_len: int
    """Tokens of `ids` that belong to the prompt (no loss on them as labels)."""

    def __len__(self) -> int:
        return len(self.ids)


def tokenize_sample(tokenizer, prompt: str, solution: str) -> TokenizedSample:
    """The sample as the model sees it: `encode_prompt(prompt)` (bos + prompt, as the
    rollout engine feeds it) + `encode(solution)` + eos."""
    p = tokenizer.encode_prompt(prompt)
    ids = tuple(p) + tuple(tokenizer.encode(solution)) + (tokenizer.eos_id,)
    return TokenizedSample(ids, len(p))


def fits(sample: TokenizedSample, seq_length: int) -> bool:
    """Whether `sample` fits one row of `seq_length` positions (it fills len - 1)."""
    return 2 <= len(sample) <= seq_length + 1


@dataclasses.dataclass
class PackedRows:
    """Plain-data packed rows (see module docstring); all tensors [rows, seq_length]."""

    tokens: torch.Tensor  # [rows, seq] int64
    labels: torch.Tensor  # [rows, seq] int64
    loss_mask: torch.Tensor  # [rows, seq] float32
    position_ids: torch.Tensor  # [rows, seq] int64
    segment_ids: torch.Tensor  # [rows, seq] int64
    num_samples: int
    """Samples packed into these rows."""
    num_tokens: int
    """Positions holding sample tokens (the rest is padding)."""

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_length(self) -> int:
        return self.tokens.shape[1]

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def attention_mask(self) -> torch.Tensor:
        """[rows, 1, seq, seq] bool, True = masked: block-diagonal causal."""
        return block_causal_mask(self.segment_ids)

    def slice(self, start: int, end: int) -> "PackedRows":
        """Rows [start, end) (e.g. this data-parallel rank's share); the counts of a
        slice are not tracked (-1)."""
        return PackedRows(self.tokens[start:end], self.labels[start:end], self.loss_mask[start:end],
                          self.position_ids[start:end], self.segment_ids[start:end],
                          num_samples=-1, num_tokens=-1)

    def microbatches(self, micro_batch_size: int, *, with_mask: bool = True) -> list:
        """Consecutive `MicroBatch`es of `micro_batch_size` rows (the actor's input).

        with_mask=False leaves attention_mask None (plain causal): only right when each
        row holds one sample (unpacked rows), e.g. for attention kernels that take no
        arbitrary mask. with_mask=True passes the rows' segment ids: MicroBatch.to builds
        the block-diagonal causal mask on the device the batch runs on."""
        from megatron_tlt.models.actor import MicroBatch

        if self.num_rows % micro_batch_size:
            raise ValueError(f"{self.num_rows} rows do not split into micro-batches of {micro_batch_size}")
        out = []
        for i in range(0, self.num_rows, micro_batch_size):
            j = i + micro_batch_size
            seg = self.segment_ids[i:j]
            out.append(MicroBatch(tokens=self.tokens[i:j], position_ids=self.position_ids[i:j],
                                  labels=self.labels[i:j], loss_mask=self.loss_mask[i:j],
                                  segment_ids=seg if with_mask else None))
        return out

    @classmethod
    def make_dummy(cls, rows: int = 2, seq_length: int = 16, vocab: int = 100, seed: int = 0,
                   pad_id: int = 0) -> "PackedRows":
        """Random samples (ids in [4, vocab)) packed into `rows` rows, for tests and idle ranks."""
        g = torch.Generator().manual_seed(seed)
        samples = []
        for _ in range(rows * 4):
            n = int(torch.randint(3, max(4, seq_length // 2), (), generator=g))
            ids = tuple(torch.randint(4, vocab, (n,), generator=g).tolist())
            samples.append(TokenizedSample(ids, int(torch.randint(1, n - 1, (), generator=g))))
        packed, _ = pack(samples.__getitem__, 0, rows, seq_length, pad_id, limit=len(samples))
        return packed


def block_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """[rows, seq] segment ids -> [rows, 1, seq, seq] bool mask, True = masked."""
    s = segment_ids.shape[-1]
    same = segment_ids.unsqueeze(-1) == segment_ids.unsqueeze(-2)  # [rows, s, s]: query i, key j
    causal = torch.ones(s, s, dtype=torch.bool, device=segment_ids.device).tril()
    return ~(same & causal).unsqueeze(1)


def pack(get_sample: Callable[[int], TokenizedSample], start: int, num_rows: int, seq_length: int,
         pad_id: int, *, overlong: str = "drop", one_per_row: bool = False,
         limit: int | None = None) -> tuple[PackedRows, int]:
    """Fill `num_rows` rows from samples `get_sample(start)`, `get_sample(start + 1)`, ...

    Returns (rows, next index): the index of the first sample not packed. `limit`: stop
    at this index (a finite dataset); rows left empty are all padding (loss_mask 0).
    `one_per_row`: one sample per row (no packing; rows are then plain causal).
    """
    if overlong not in OVERLONG_POLICIES:
        raise ValueError(f"overlong must be one of {OVERLONG_POLICIES}, got {overlong!r}")
    if seq_length < 1 or num_rows < 1:
        raise ValueError(f"need seq_length >= 1 and num_rows >= 1, got {seq_length}, {num_rows}")
    tokens = torch.full((num_rows, seq_length), pad_id, dtype=torch.int64)
    labels = torch.full((num_rows, seq_length), pad_id, dtype=torch.int64)
    loss_mask = torch.zeros(num_rows, seq_length, dtype=torch.float32)
    position_ids = torch.zeros(num_rows, seq_length, dtype=torch.int64)
    segment_ids = torch.zeros(num_rows, seq_length, dtype=torch.int64)
    idx, row, used, seg, packed, real = start, 0, 0, 0, 0, 0

    def close_row():
        nonlocal row, used, seg
        if used < seq_length:  # the padding tail: its own causal segment
            segment_ids[row, used:] = seg
            position_ids[row, used:] = torch.arange(seq_length - used)
        row, used, seg = row + 1, 0, 0

    while row < num_rows:
        if limit is not None and idx >= limit:
            close_row()
            continue
        sample = get_sample(idx)
        ids, plen = sample.ids, sample.prompt_len
        if len(ids) > seq_length + 1:
            if overlong == "drop":
                idx += 1
                continue
            ids = ids[: seq_length + 1]
        if len(ids) < 2:
            idx += 1  # nothing to predict
            continue
        n = len(ids) - 1
        if used + n > seq_length or (one_per_row and used > 0):
            close_row()
            continue
        sl = slice(used, used + n)
        tokens[row, sl] = torch.tensor(ids[:-1], dtype=torch.int64)
        labels[row, sl] = torch.tensor(ids[1:], dtype=torch.int64)
        # label k (= ids[k + 1]) is a solution token iff k + 1 >= prompt_len
        loss_mask[row, used + max(plen - 1, 0): used + n] = 1.0
        position_ids[row, sl] = torch.arange(n)
        segment_ids[row, sl] = seg
        used, seg, idx, packed, real = used + n, seg + 1, idx + 1, packed + 1, real + n
        if used == seq_length:
            close_row()
    rows = PackedRows(tokens, labels, loss_mask, position_ids, segment_ids, num_samples=packed,
                      num_tokens=real)
    return rows, idx


def pack_all(samples: Sequence[TokenizedSample], seq_length: int, pad_id: int, *,
             overlong: str = "drop", one_per_row: bool = False,
             rows_multiple_of: int = 1) -> PackedRows:
    """Pack a whole finite list (e.g. a validation set) into as many rows as it needs,
    padded with empty rows to a multiple of `rows_multiple_of`."""
    rows: list[PackedRows] = []
    idx, n = 0, len(samples)
    while idx < n:
        part, idx = pack(samples.__getitem__, idx, 1, seq_length, pad_id, overlong=overlong,
                         one_per_row=one_per_row, limit=n)
        if part.num_samples:
            rows.append(part)
    while not rows or len(rows) % rows_multiple_of:
        rows.append(pack(samples.__getitem__, n, 1, seq_length, pad_id, limit=n)[0])
    return concat(rows)


def concat(parts: Iterable[PackedRows]) -> PackedRows:
    parts = list(parts)
    return PackedRows(*(torch.cat([getattr(p, f) for p in parts]) for f in
                        ("tokens", "labels", "loss_mask", "position_ids", "segment_ids")),
                      num_samples=sum(p.num_samples for p in parts),
                      num_tokens=sum(p.num_tokens for p in parts))
