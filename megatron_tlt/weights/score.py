"""Full-sequence logits from the rollout engine (re-scoring a fixed batch)."""

from __future__ import annotations

import torch

from megatron_tlt.rollout import Request


@torch.no_grad()
def engine_logits(engine, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [b, s, V] of every position of `tokens` [b, s] under the engine's weights:
    a one-token prefill, then the rest as one causal chain through `verify_forward`."""
    out = []
    for i, row in enumerate(tokens.tolist()):
        seq = engine.add_sequence(Request(prompt_id=f"__score{i}", prompt_token_ids=row[:1]))
        try:
            first = engine.forward_pending([seq]).logits[-1:]
            rest = row[1:]
            if rest:
                q = torch.tensor([rest])
                pos = torch.arange(1, len(row)).unsqueeze(0)
                mask = torch.ones(len(rest), len(rest), dtype=torch.bool).tril().unsqueeze(0)
                more = engine.verify_forward([seq], q, pos, mask)[0]
                out.append(torch.cat([first.float(), more.float()], dim=0))
            else:
                out.append(first.float())
        finally:
            engine.free_sequence(seq)
    return torch.stack(out)
