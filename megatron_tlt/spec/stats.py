"""Speculative-decoding metrics: per request and per batch-size bucket.

Terms (verify_ref.py defines them; vLLM's definitions):
- drafted: draft tokens sent to the verifier; accepted: those it kept;
- num_drafts: verification steps (one per sequence per speculative step);
- acceptance rate = accepted / drafted;
- acceptance length = 1 + accepted / num_drafts: mean tokens per verification step
  before truncation: drafts the verifier accepted count even where a stop token, stop
  string or max_new_tokens then cut them from the output (a measure of the drafter, as
  vLLM counts it; the output can hold fewer tokens);
- fallbacks: steps where a sequence meant to speculate decoded plainly because its
  drafter failed (non-finite outputs); plain_steps counts every plain decode step.

Buckets group steps by the running batch size (the number of sequences the step ran),
the quantity the adaptive engine switches on: 1, 2-4, 5-8, 9-16, 17-32, 33+.
"""

from __future__ import annotations

import dataclasses

BUCKETS = ((1, 1), (2, 4), (5, 8), (9, 16), (17, 32), (33, None))


def bucket_of(batch_size: int) -> str:
    for lo, hi in BUCKETS:
        if hi is None or batch_size <= hi:
            if batch_size >= lo:
                return f"{lo}+" if hi is None else (str(lo) if lo == hi else f"{lo}-{hi}")
    return "0"


def new_request_stats(method: str) -> dict:
    return {"method": method, "num_drafts": 0, "drafted": 0, "accepted": 0, "plain_steps": 0,
            "fallbacks": 0}


def finalize_request_stats(stats: dict) -> dict:
    """Add acceptance_rate and acceptance_length (None when undefined) in place."""
    if not stats:
        return stats
    d, a, n = stats["drafted"], stats["accepted"], stats["num_drafts"]
    stats["acceptance_rate"] = a / d if d else None
    stats["acceptance_length"] = 1.0 + a / n if n else None
    return stats


@dataclasses.dataclass
class _Bucket:
    steps: int = 0
    spec_steps: int = 0
    num_drafts: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    fallbacks: int = 0
    plain_seq_steps: int = 0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["acceptance_rate"] = self.accepted / self.drafted if self.drafted else None
        d["acceptance_length"] = 1.0 + self.accepted / self.num_drafts if self.num_drafts else None
        return d


class SpecMetrics:
    """Aggregates speculative steps by batch-size bucket (`summary()` for logs/JSON)."""

    def __init__(self):
        self.buckets: dict[str, _Bucket] = {}
        self.strategies: dict[str, int] = {}

    def record_step(self, batch_size: int, *, strategy: dict | None, num_drafts: int = 0,
                    drafted: int = 0, accepted: int = 0, emitted: int = 0, fallbacks: int = 0,
                    plain_seqs: int = 0) -> None:
        b = self.buckets.setdefault(bucket_of(batch_size), _Bucket())
        b.steps += 1
        b.spec_steps += int(num_drafts > 0)
        b.num_drafts += num_drafts
        b.drafted += drafted
        b.accepted += accepted
        b.emitted += emitted
        b.fallbacks += fallbacks
        b.plain_seq_steps += plain_seqs
        key = "off" if strategy is None else "d{depth}k{topk}n{num_verify_tokens}".format(**strategy)
        self.strategies[key] = self.strategies.get(key, 0) + 1

    def summary(self) -> dict:
        order = [bucket_of(lo) for lo, _ in BUCKETS]
        by_bucket = {k: self.buckets[k].as_dict() for k in order if k in self.buckets}
        total = _Bucket()
        for b in self.buckets.values():
            for f in dataclasses.fields(_Bucket):
                setattr(total, f.name, getattr(total, f.name) + getattr(b, f.name))
        return {"total": total.as_dict(), "by_batch_size": by_bucket,
                "strategy_steps": dict(self.strategies)}

    def reset(self) -> None:
        self.buckets.clear()
        self.strategies.clear()
