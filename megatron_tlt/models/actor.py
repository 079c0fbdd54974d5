"""The policy as a Megatron-Core actor: build, load/save, forward, forward-backward.

One `Actor` per rank holds this rank's pipeline stage of the model (no virtual
pipeline stages yet) and runs Megatron's pipeline schedules, so TP, PP and DP all go
through Megatron-Core. Losses are plain functions of (vocab-parallel logits, batch)
that return a scalar and a dict of detached metrics.

Padded vocabulary columns (see `models/arch.py`) hold zero weights, so their logits
are 0, not -inf: every log-probability here masks them first (`mask_padded_vocab`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Optional

import torch

from megatron_tlt.models import mcore, mcore_ckpt
from megatron_tlt.models.arch import ModelArch


@dataclasses.dataclass
class MicroBatch:
    """Plain-data input of one micro-batch (same on every rank of a TP/PP group)."""

    tokens: torch.Tensor  # [b, s] int64
    position_ids: torch.Tensor  # [b, s] int64
    labels: Optional[torch.Tensor] = None  # [b, s] int64, the next token at each position
    loss_mask: Optional[torch.Tensor] = None  # [b, s] float, 1 where the loss counts
    attention_mask: Optional[torch.Tensor] = None  # [b, 1, s, s] bool, True = masked; None = causal
    segment_ids: Optional[torch.Tensor] = None
    """[b, s] int64, packed rows: `to` builds the block-diagonal causal attention_mask from
    these where the batch runs (when attention_mask is None), so the host neither builds
    nor ships [b, 1, s, s] per micro-batch (8 MB at the SFT benchmark's 2 x 2048)."""
    extra: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def make_dummy(cls, batch: int = 2, seq: int = 8, vocab: int = 100, seed: int = 0) -> "MicroBatch":
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        return cls(tokens=tokens[:, :-1].contiguous(), position_ids=mcore.causal_position_ids(batch, seq),
                   labels=tokens[:, 1:].contiguous(), loss_mask=torch.ones(batch, seq))

    def to(self, device) -> "MicroBatch":
        """This batch on `device`: CPU tensors go to a GPU through pinned memory without
        blocking (a copy from pageable memory synchronises the stream, so the host could not
        queue the next micro-batch's kernels ahead of the device: rollout/host.to_device);
        with segment_ids, the attention mask is built there."""
        from megatron_tlt.data.packing import block_causal_mask
        from megatron_tlt.rollout.host import to_device

        device = torch.device(device)

        def mv(x):
            return to_device(x, device) if isinstance(x, torch.Tensor) else x
        out = MicroBatch(**{f.name: mv(getattr(self, f.name)) for f in dataclasses.fields(self)
                            if f.name != "extra"}, extra=self.extra)
        if out.segment_ids is not None and out.attention_mask is None:
            out.attention_mask = block_causal_mask(out.segment_ids)
        return out


def local_vocab_range(arch: ModelArch) -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    r = ps.get_tensor_model_parallel_rank()
    per = arch.padded_vocab_size // tp
    return r * per, (r + 1) * per


def mask_padded_vocab(logits: torch.Tensor, arch: ModelArch) -> torch.Tensor:
    """Set the padded vocabulary columns of vocab-parallel logits to -inf."""
    start, end = local_vocab_range(arch)
    if end <= arch.vocab_size:
        return logits
    first_pad = max(arch.vocab_size - start, 0)
    logits = logits.clone()
    logits[..., first_pad:] = float("-inf")
    return logits


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, arch: ModelArch,
                   temperature: float = 1.0) -> torch.Tensor:
    """log p(label) under the full (TP-gathered) softmax of logits / temperature; logits are
    vocab-parallel [b, s, V/tp]. temperature 0 (greedy) counts as 1, as the rollout
    engine reports it (rollout/sampling.py: `logprobs` is log_softmax(logits / T))."""
    from megatron.core import tensor_parallel

    scaled = temperature > 0 and temperature != 1.0
    # A float32 tensor of our own: the cross entropy below subtracts the row max from its
    # input in place (a bf16 model's .float() is a new tensor already).
    x = logits.float() if logits.dtype != torch.float32 or scaled else logits.clone()
    if scaled:
        x = x / temperature
    x = mask_padded_vocab(x, arch)
    # -log p. Megatron's vocab-parallel cross entropy works row by row over any leading
    # dims ([b, s, v/tp] with [b, s] labels here: no [s, b] transposed copies of the logits).
    return -tensor_parallel.vocab_parallel_cross_entropy(x, labels)


def lm_loss(logits: torch.Tensor, mb: MicroBatch, arch: ModelArch):
    """Mean next-token cross-entropy over loss_mask (a loss function for `forward_backward`)."""
    lp = token_logprobs(logits, mb.labels, arch)
    mask = mb.loss_mask if mb.loss_mask is not None else torch.ones_like(lp)
    loss = -(lp * mask).sum() / mask.sum().clamp(min=1)
    return loss, {"lm_loss": loss.detach()}


class Actor:
    """This rank's pipeline stage of the policy, with Megatron's schedules."""

    def __init__(self, arch: ModelArch, *, tp: int = 1, pp: int = 1, dtype: str = "float32",
                 use_te: Optional[bool] = None, recompute: bool = False, init_seed: Optional[int] = None):
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            raise RuntimeError("call megatron_tlt.models.mcore.init_parallel(tp, pp) before building an Actor")
        if ps.get_tensor_model_parallel_world_size() != tp or ps.get_pipeline_model_parallel_world_size() != pp:
            raise RuntimeError("Actor tp/pp differ from the initialised process groups")
        self.arch, self.tp, self.pp, self.dtype = arch, tp, pp, dtype
        self.config = mcore.transformer_config(arch, tp=tp, pp=pp, dtype=dtype, recompute=recompute)
        if init_seed is not None:
            torch.manual_seed(init_seed)  # CPU init draws the full weight, then shards: same at any TP
        self.model = mcore.build_gpt_model(arch, self.config, use_te=use_te)
        self.device = next(self.model.parameters()).device

    # ---- checkpoints ------------------------------------------------------------------
    def load(self, ckpt_dir: str) -> dict:
        return mcore_ckpt.load_model(self.model, self.arch, ckpt_dir)

    def save(self, ckpt_dir: str, tokenizer_from: Optional[str] = None) -> None:
        mcore_ckpt.save_model(self.model, self.arch, ckpt_dir, dtype=self.dtype, tp=self.tp, pp=self.pp,
                              tokenizer_from=tokenizer_from)

    def parameters(self) -> Iterable[torch.nn.Parameter]:
        return self.model.parameters()

    # ---- schedules -------------------------------------------------------------------
    def forward_backward(self, microbatches: list[MicroBatch],
                         loss_fn: Callable[[torch.Tensor, MicroBatch], tuple],
                         forward_only: bool = False) -> list[dict]:
        """Run Megatron's pipeline schedule over `microbatches`; returns the loss dicts
        (on the last pipeline stage; empty elsewhere). Gradients accumulate into .grad
        (scaled by 1/len(microbatches))."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        device = self.device

        def forward_step(data_iterator, model):
            mb = next(data_iterator).to(device)
            out = model(mb.tokens, mb.position_ids, mb.attention_mask)
            return out, lambda logits: loss_fn(logits, mb)

        seq = microbatches[0].tokens.shape[1]
        mbs = microbatches[0].tokens.shape[0]
        for mb in microbatches:
            if tuple(mb.tokens.shape) != (mbs, seq):
                raise ValueError("all micro-batches must share one [micro_batch_size, seq_length] shape")
        fb = get_forward_backward_func()
        self.model.train(not forward_only)
        ctx = torch.no_grad() if forward_only else torch.enable_grad()
        with ctx:
            return fb(forward_step_func=forward_step, data_iterator=iter(microbatches), model=[self.model],
                      num_microbatches=len(microbatches), seq_length=seq, micro_batch_size=mbs,
                      forward_only=forward_only)

    def logits(self, tokens: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Full unpadded logits [b, s, V] on the last pipeline stage (None elsewhere)."""
        from megatron.core import parallel_state as ps

        b, s = tokens.shape
        if position_ids is None:
            position_ids = mcore.causal_position_ids(b, s)
        mb = MicroBatch(tokens=tokens, position_ids=position_ids)
        out = self.forward_backward([mb], lambda lg, _mb: (lg.sum() * 0, {"logits": mcore.gather_logits(lg, self.arch)}),
                                    forward_only=True)
        if ps.is_pipeline_last_stage():
            return out[0]["logits"]
        return None
