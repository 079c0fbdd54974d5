"""A small RL run for tests: a random one-layer Llama actor (100-token tiny vocabulary)
saved as the starting checkpoint, numbered prompts, the digit-fraction reward, and
examples/tiny_cpu.yaml with the given overrides."""

from __future__ import annotations

import json
from pathlib import Path


def tiny_rl_config(tmp_path: Path, *, num_prompts: int, overrides: list[str]):
    from megatron_tlt.config import load_config
    from megatron_tlt.models import mcore
    from megatron_tlt.models.actor import Actor
    from megatron_tlt.models.arch import ModelArch
    from megatron_tlt.testing.tiny_models import tiny_hf_config

    mcore.init_parallel(1, 1, seed=0)
    arch = ModelArch.from_hf_config(tiny_hf_config("llama", vocab_size=100, num_layers=1,
                                                   max_position_embeddings=128).to_dict())
    Actor(arch, init_seed=0).save(str(tmp_path / "mcore"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"count {i}:", "answer": ""}) + "\n"
                               for i in range(num_prompts)))
    return load_config("examples/tiny_cpu.yaml", [
        f"model.mcore_ckpt={tmp_path / 'mcore'}", f"data.path={prompts}", "data.tokenizer=tiny",
        "rl.reward=megatron_tlt.testing.rewards:digit_fraction", "train.save_interval=0",
        f"train.out_dir={tmp_path / 'run'}", *overrides])
