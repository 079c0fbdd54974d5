"""First-level acceptance of an EAGLE drafter by proposal rule, from the target's own
responses and features: which draft shape can pay at a temperature, without a benchmark.

    python tools/drafter_acceptance.py --target DIR --drafter DIR
        (--tasks arith,sort [--num-prompts 64 --seed 3 --gen-temperature 1.0
         --max-new-tokens 256] | --samples FILE)
        [--temperature 0.9] [--max-samples 200] [--json OUT]

The target generates responses to --num-prompts prompts of the built-in tasks (seed
--seed: choose one the drafter was not trained on) with its final hidden states, or FILE
holds them (a train_drafter `samples.pt`, OUT/.train_state/samples.pt, kept while a run
is unfinished). At every response position,
with p and q the target's and the drafter's distributions at the temperature (the drafter
reading the target's features: the first draft level; a reduced draft vocabulary
scattered into the target's), the probability that the level emits a draft token:

- chain: one token sampled from q, accepted with min(1, p/q): sum min(p, q) = 1 - TV;
- iid_K: K siblings drawn i.i.d. from q, tested in turn by recursive rejection (each
  rejection leaves max(p - q, 0) renormalised), what the verifier does with draft_probs;
- top_K: the drafter's K most likely tokens as one-hot proposals (EAGLE-2 trees at a
  temperature): the target's probability of the set.

Deeper levels draft from the drafter's own features and accept less; the ratios between
rules are the point. Session 21 (benchmarks/results/cpu_2026-12-05_drafter_recipes).
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F


def level_acceptance(p: torch.Tensor, q: torch.Tensor, k: int = 4) -> dict[str, torch.Tensor]:
    """Per-row acceptance [R] float64 of one draft level by rule (module docstring) for
    target rows p and draft rows q [R, V] (each summing to 1): "chain", "iid_2".."iid_k",
    "top_1".."top_k"."""
    p, q = p.double(), q.double()
    out = {"chain": torch.minimum(p, q).sum(-1)}
    total, r = out["chain"].clone(), p
    for n in range(2, k + 1):
        r = torch.clamp(r - q, min=0)
        r = r / r.sum(-1, keepdim=True).clamp(min=1e-300)
        total = total + (1 - total) * torch.minimum(r, q).sum(-1)
        out[f"iid_{n}"] = total.clone()
    order = q.argsort(-1, descending=True)
    for n in range(1, k + 1):
        out[f"top_{n}"] = p.gather(1, order[:, :n]).sum(-1)
    return out


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--samples", help="train_drafter's samples.pt")
    src.add_argument("--tasks", help="built-in tasks the target answers (e.g. arith,sort)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--seed", type=int, default=3, help="prompt draw and sampling seed")
    ap.add_argument("--gen-temperature", type=float, default=1.0, help="of the target's responses")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--max-samples", type=int, default=200)
    ap.add_argument("--k", type=int, default=4, help="siblings / top-k up to this many")
    ap.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda when available)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not a.temperature > 0 or not math.isfinite(a.temperature):  # NaN passed `<= 0`
        raise SystemExit("drafter_acceptance: --temperature must be a finite number > 0 (greedy "
                         "acceptance is top_1)")
    if a.num_prompts < 1 or a.max_samples < 1 or a.k < 1 or a.max_new_tokens < 1:
        raise SystemExit("drafter_acceptance: --num-prompts, --max-samples, --k and "
                         "--max-new-tokens must be >= 1")
    from megatron_tlt.models.arch import ModelArch
    from megatron_tlt.rollout.weights import engine_dtype, load_hf
    from megatron_tlt.spec.export import load_drafter
    from megatron_tlt.spec.train_drafter import (TrainSample, float32_head, pack_samples, prompt_token_ids,
                                                target_samples)

    from megatron_tlt.rollout.weights import resolve_device
    dev = resolve_device(a.device)
    # the target in the rollout's dtype (bf16 on a GPU), as train_drafter generates with it
    arch, w = load_hf(a.target, device=dev, dtype=engine_dtype(ModelArch.from_hf_dir(a.target), dev))
    if a.samples:
        samples = [TrainSample(**d) for d in torch.load(a.samples, weights_only=True)][:a.max_samples]
    else:
        from megatron_tlt.data.tokenizer import load_tokenizer
        prompts = prompt_token_ids(path=None, tasks=a.tasks, n=a.num_prompts, seed=a.seed,
                                   tokenizer=load_tokenizer(a.target), model_dir=a.target)
        samples = target_samples(a.target, arch, w, prompts, max_new_tokens=a.max_new_tokens,
                                 temperature=a.gen_temperature, seed=a.seed, progress=False)
    # the drafter in float32 with float32 copies of the target's embedding and head, as
    # train_drafter trains and evaluates it; p from the same float32 head
    head = float32_head(w)
    d = load_drafter(a.drafter, arch, head.embed, head.lm_head, dtype=torch.float32, device=dev).eval()
    rows: dict[str, list[torch.Tensor]] = {}
    with torch.no_grad():
        for pk in pack_samples(samples, 4096):
            (_, lg, valid), = d.forward_unrolled(pk.tokens.to(dev), pk.features.to(dev, torch.float32),
                                                 pk.positions.to(dev), pk.segment_ids.to(dev), 1)
            m = pk.loss_mask.to(dev) & valid
            feats, lg = pk.target_features.to(dev)[m], lg[m]
            for i in range(0, feats.shape[0], 256):  # full-vocabulary rows: bounded memory
                p = torch.softmax(F.linear(feats[i:i + 256].float(), head.lm_head) / a.temperature, -1)
                q = d.scatter_to_target(torch.softmax(lg[i:i + 256] / a.temperature, -1))
                for key, v in level_acceptance(p, q, a.k).items():
                    rows.setdefault(key, []).append(v)
    report: dict = {key: float(torch.cat(v).mean()) for key, v in rows.items()}
    report["positions"] = int(sum(v.numel() for v in rows["chain"]))
    print(json.dumps({"drafter": a.drafter, "temperature": a.temperature, **report}))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"drafter": a.drafter, "target": a.target, "samples": a.samples or
                       f"{a.num_prompts} prompts of {a.tasks}, seed {a.seed}, T={a.gen_temperature}",
                       "temperature": a.temperature, **report}, f, indent=1)
    return report


if __name__ == "__main__":
    main()
