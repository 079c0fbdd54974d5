"""`megatron-tlt demo`: the foundation end to end on the built-in tiny default, on CPU.

HF checkpoint -> Megatron-Core dist-checkpoint (offline, one process) -> Megatron actor
forward, checked against HF transformers -> rollouts from the native engine on
held-out synthetic prompts, scored by the task rewards: the foundation alone (the
Quick start runs `megatron-tlt train`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from importlib import resources

import torch

from megatron_tlt.atomic_io import write_json, write_text
from megatron_tlt.errors import TLTError


def tiny_default_dir() -> str | None:
    path = resources.files("megatron_tlt") / "assets" / "tiny_default"
    return str(path) if (path / "config.json").is_file() else None


def main(args) -> int:
    ap = argparse.ArgumentParser(prog="megatron-tlt demo")
    ap.add_argument("--out-dir", default="runs/demo")
    ap.add_argument("--model", default=None, help="HF model directory (default: the shipped tiny default)")
    ap.add_argument("--n", type=int, default=8, help="held-out prompts to roll out")
    ns = ap.parse_args(getattr(args, "extra", []) or [])
    if ns.n < 1:
        raise TLTError(f"--n must be >= 1, got {ns.n}")
    os.makedirs(ns.out_dir, exist_ok=True)
    t0 = time.time()

    from megatron_tlt.convert import hf_to_mcore
    from megatron_tlt.models import mcore
    from megatron_tlt.models.actor import Actor
    from megatron_tlt.models.mcore_ckpt import read_meta

    model_dir = ns.model or tiny_default_dir()
    if model_dir is None:
        from megatron_tlt.testing.tiny_models import make_tiny_hf

        model_dir = make_tiny_hf(os.path.join(ns.out_dir, "random_tiny_hf"), "llama")
        print(f"[demo] no shipped tiny default in this build: using a RANDOM tiny Llama at {model_dir}")
    print(f"[demo] model: {model_dir}")

    mc_dir = os.path.join(ns.out_dir, "mcore")
    hf_to_mcore(model_dir, mc_dir)
    meta = read_meta(mc_dir)
    arch = meta["arch"]
    print(f"[demo] converted to Megatron-Core dist-checkpoint: {mc_dir} ({arch.family}, {arch.num_layers} layers, "
          f"{arch.num_params() / 1e6:.2f} M params, vocab {arch.vocab_size} padded to {arch.padded_vocab_size})")

    mcore.init_parallel(1, 1)
    actor = Actor(arch, dtype=meta["dtype"])
    actor.load(mc_dir)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, arch.vocab_size, (2, 16), generator=g)
    logits = actor.logits(tokens.to(actor.device)).float().cpu()
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        ref = hf(tokens).logits
    diff = (logits - ref).abs().max().item()
    print(f"[demo] Megatron actor vs HF transformers logits: max abs diff {diff:.2e}")

    summary = {"model": model_dir, "mcore": mc_dir, "actor_vs_hf_max_abs_diff": diff}
    if os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        summary.update(_rollouts(model_dir, ns.n, ns.out_dir))
    summary["seconds"] = round(time.time() - t0, 1)
    write_json(os.path.join(ns.out_dir, "summary.json"), summary)
    print(f"[demo] done in {summary['seconds']} s; summary: {os.path.join(ns.out_dir, 'summary.json')}")
    mcore.destroy_parallel()
    return 0


def _rollouts(model_dir: str, n: int, out_dir: str) -> dict:
    from megatron_tlt.data.tasks import get_task, make_dataset
    from megatron_tlt.data.tokenizer import load_tokenizer
    from megatron_tlt.rollout import Request, RolloutEngine, SamplingParams, load_hf

    tok = load_tokenizer(model_dir)
    arch, weights = load_hf(model_dir)
    engine = RolloutEngine(arch, weights, max_num_seqs=n, num_blocks=512, block_size=16,
                           eos_token_ids=[tok.eos_id], detokenize=tok.decode)
    samples = make_dataset(["arith", "sort"], n, seed=0, split="test")
    reqs = [Request(prompt_id=s.prompt_id, sample_index=0, prompt_token_ids=tok.encode_prompt(s.prompt),
                    sampling_params=SamplingParams(temperature=0.0, max_new_tokens=512)) for s in samples]
    results = engine.generate(reqs)
    rows, correct = [], 0
    for s, r in zip(samples, results):
        text = tok.decode(r.token_ids, skip_special_tokens=True)
        reward = get_task(s.task).reward(text, s.answer)
        correct += reward
        rows.append({"prompt_id": s.prompt_id, "reward": reward, "tokens": len(r.token_ids), "response": text})
    path = os.path.join(out_dir, "rollouts.jsonl")
    write_text(path, "".join(json.dumps(row) + "\n" for row in rows))
    lengths = sorted(len(r.token_ids) for r in results)
    print(f"[demo] {n} greedy rollouts on held-out prompts: exact answers {int(correct)}/{n}, "
          f"response tokens median {lengths[len(lengths) // 2]}, max {lengths[-1]}; written to {path}")
    return {"rollouts": path, "exact_answer_rate": correct / n}
