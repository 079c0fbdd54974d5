"""tools/ablate_decode.py without a GPU: each ablation takes effect on DecodeModel's
forward (the logits change: what it leaves out was on the step's path) and leaves the model
as it found it (the next base forward equals the first, bit for bit) and does nothing
before its context is entered (session 32: all:empty did, at the name check); the base variant
changes nothing (negative control: a forward under `base` equals the reference); an unknown
variant raises. The timing itself needs CUDA graphs (GPU only).

float32 through Triton's interpreter; skipped without triton (CI), as every interpreter test."""

import sys
from pathlib import Path

import pytest
import torch

from rollout_testutil import tiny_decode, triton_interpreter  # noqa: E402

pytestmark = triton_interpreter()

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))

import ablate_decode as ab  # noqa: E402

from megatron_tlt.rollout.gpu_model import FUSED_ROPE_ENV  # noqa: E402


def test_each_ablation_changes_the_step_and_is_undone(monkeypatch):
    monkeypatch.setenv(FUSED_ROPE_ENV, "1")
    # two splits of 32-key tiles: sequence 1's 51 keys fill both, so the merge launch runs
    bt = torch.randperm(40, generator=torch.Generator().manual_seed(0))[:32].view(2, 16).to(torch.int32)
    model, _, run = tiny_decode(bt, torch.tensor([5, 50], dtype=torch.int32),
                                torch.tensor([3, 250], dtype=torch.int32), num_blocks=40)
    ref = run()
    for v in ab.VARIANTS:  # ablation() alone (the tool checks names so) patches nothing
        ab.ablation(v, model)
    assert torch.equal(run(), ref), "a variant took effect before its context was entered"
    # prefetch:none has nothing to remove on a CPU (no PDL, no prefetch): not listed
    changed = [v for v in ab.VARIANTS if v != "prefetch:none"]
    for v in changed:
        with ab.ablation(v, model):
            out = run()
        assert torch.equal(run(), ref), f"{v} was not undone"
        if v == "base":
            assert torch.equal(out, ref)
        else:
            assert not torch.equal(out, ref), f"{v} left the step unchanged"
    with pytest.raises(ValueError, match="unknown variant"):
        ab.ablation("norm:half", model)


def test_stand_in_projection_feeds_the_same_planes(monkeypatch):
    """oproj:none's stand-in hands the next RMSNorm planes of the shape and dtype the real
    projection's (so the consumer and its plan key are those of the real step)."""
    from megatron_tlt.rollout import gpu_model
    monkeypatch.setenv(FUSED_ROPE_ENV, "1")
    bt = torch.tensor([[2, 5, 0, 8], [1, 7, 3, 9]], dtype=torch.int32)
    model, _, run = tiny_decode(bt, torch.tensor([5, 12], dtype=torch.int32),
                                torch.tensor([3, 250], dtype=torch.int32), num_blocks=12)
    seen = []
    real = gpu_model.rms_norm
    monkeypatch.setattr(gpu_model, "rms_norm", lambda x, *a, **k: seen.append(
        (tuple(x.shape), x.dtype)) or real(x, *a, **k))
    run()
    base, seen[:] = list(seen), []
    with ab.ablation("oproj:none", model):
        run()
    assert seen == base and len(base) == 5  # layer 0's input norm, 2 x post-attn, 1 input, final
