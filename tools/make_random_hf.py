"""A random-weight HF checkpoint of a benchmark shape, for timing `bench spec` and the
rollout engine without a trained target (the machine lent for a session keeps nothing).

    python tools/make_random_hf.py --shape 1.5b --out /tmp/random_1p5b [--device cuda]

Weights are `transformers`' own initialisation (bfloat16), the tokenizer is the built-in
character one (its ids are < 100 of the shape's vocabulary), so `bench spec --tasks`
finds prompts. What it samples is noise: use it for time, never for acceptance lengths.
"""

from __future__ import annotations

import argparse
import shutil

import torch

from megatron_tlt.bench import SHAPES
from megatron_tlt.data.tokenizer import TINY_TOKENIZER_DIR
from megatron_tlt.models.arch import ModelArch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = ModelArch(**SHAPES[a.shape]).to_hf_config()
    hf_cfg = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(a.seed)
    with torch.device(a.device):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16)
    model.save_pretrained(a.out, safe_serialization=True)
    for f in TINY_TOKENIZER_DIR.iterdir():
        shutil.copy(f, a.out)
    print(f"wrote {a.out}: {a.shape}, {sum(t.numel() for t in model.parameters()) / 1e9:.2f}B parameters")


if __name__ == "__main__":
    main()
