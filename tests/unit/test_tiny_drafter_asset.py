"""The shipped EAGLE drafter for the tiny default (megatron_tlt/assets/tiny_drafter): small,
loads against the tiny default, and drafts what the target says (a fresh drafter does not)."""

from __future__ import annotations

import os

import torch

from megatron_tlt.sft import TINY_DEFAULT_DIR

TINY_DRAFTER_DIR = os.path.join(os.path.dirname(TINY_DEFAULT_DIR), "tiny_drafter")


def test_small_and_complete():
    from megatron_tlt.spec.export import validate_drafter_dir

    files = sorted(os.listdir(TINY_DRAFTER_DIR))
    assert files == ["README.md", "config.json", "model.safetensors"], files
    total = sum(os.path.getsize(os.path.join(TINY_DRAFTER_DIR, f)) for f in files)
    assert total < 2 * 2**20, f"{total} bytes: the shipped drafter must stay under 2 MiB"
    validate_drafter_dir(TINY_DRAFTER_DIR)


def _acceptance_length(drafter_dir):
    from megatron_tlt.data.tasks import make_dataset
    from megatron_tlt.data.tokenizer import load_tokenizer
    from megatron_tlt.rollout import Request, RolloutEngine, SamplingParams, load_hf
    from megatron_tlt.spec.decode import SpecDecoder
    from megatron_tlt.spec.eagle import EagleProposer
    from megatron_tlt.spec.export import load_drafter
    from megatron_tlt.spec.tree import Strategy

    arch, weights = load_hf(TINY_DEFAULT_DIR)
    tok = load_tokenizer(TINY_DEFAULT_DIR)
    engine = RolloutEngine(arch, weights, max_num_seqs=4, num_blocks=4 * 8, block_size=16, max_model_len=128,
                           eos_token_ids=[tok.eos_id], seed=0)
    drafter = load_drafter(drafter_dir, arch, weights.embed, weights.lm_head, dtype=weights.dtype,
                           device=weights.device)
    sd = SpecDecoder(EagleProposer(drafter), Strategy(depth=4, topk=1), threshold=None)
    engine.spec_decoder = sd
    reqs = [Request(prompt_id=s.prompt_id, prompt_token_ids=tok.encode_prompt(s.prompt),
                    sampling_params=SamplingParams(temperature=0.0, max_new_tokens=48))
            for s in make_dataset(["sort"], 4, seed=3, split="test")]
    engine.generate(reqs)
    return sd.metrics.summary()["total"]["acceptance_length"]


def test_drafts_the_tiny_default(tmp_path):
    from safetensors.torch import load_file, save_file

    shipped = _acceptance_length(TINY_DRAFTER_DIR)
    # Negative control: the same layout with re-drawn weights drafts far worse.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "config.json").write_bytes(open(os.path.join(TINY_DRAFTER_DIR, "config.json"), "rb").read())
    gen = torch.Generator().manual_seed(0)
    w = load_file(os.path.join(TINY_DRAFTER_DIR, "model.safetensors"))
    save_file({k: torch.randn(v.shape, generator=gen) * 0.05 if v.ndim == 2 else v for k, v in w.items()},
              str(fresh / "model.safetensors"))
    random = _acceptance_length(str(fresh))
    assert shipped >= 2.0 and shipped > random + 0.5, (shipped, random)
