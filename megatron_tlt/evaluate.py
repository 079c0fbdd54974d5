"""`megatron-tlt eval`: exact-answer rate of a model on held-out synthetic prompts.

Greedy decoding (temperature 0, the default) with the native rollout engine on `n` prompts of the
test split of the synthetic tasks (`data.tasks.make_dataset(..., split="test")`:
never seen in training, whatever seed SFT used), each prompt fed as SFT fed it
(`tokenizer.encode_prompt`). A response is right when the task's reward is 1 (its
final ``####`` answer equals the reference). Reports the rate overall, per task and by
reference-solution length (the long tail: short problems should be solved, long ones
mostly not), the mean response length, and how many responses hit the token limit.

Sampling instead (`--temperature T --samples K`): K responses per prompt, each seeded by
(seed, prompt id, sample index) so the run replays; the rates are then over all
responses (the expected reward GRPO maximises at that temperature) and `pass_at_k` is
the share of prompts with at least one right response among their K (roughly the most
that sharpening the sampled distribution towards its best responses can reach).

Each request gets at most `max_new_tokens` new tokens, fewer when the prompt leaves
less room in the model's context (max_position_embeddings); a response cut off by
the limit has no final answer and counts as wrong.

The model is an HF directory (`--model`) or a Megatron-Core checkpoint (`--ckpt`): a
model directory (`tlt_model.json`, as `convert hf-to-mcore` writes), one training
checkpoint `step_<N>`, or a run's `train.out_dir` (its latest complete checkpoint, as
`train.resume=auto` would pick). A checkpoint is converted to HF in a temporary
directory first (`convert.mcore_to_hf`, the tested path), so both are evaluated by the
same code; its tokenizer is the one the run saved beside the model (`--tokenizer`
overrides).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import tempfile
import time
from typing import Iterator, Optional, Sequence

from megatron_tlt.errors import TLTError

log = logging.getLogger(__name__)

LENGTH_BUCKETS = (64, 128, 256, 512)
"""Upper bounds (reference solution tokens) of the length buckets in the report."""


def _bucket(n_tokens: int) -> str:
    lo = 0
    for hi in LENGTH_BUCKETS:
        if n_tokens < hi:
            return f"{lo}-{hi - 1}"
        lo = hi
    return f">={lo}"


def add_eval_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", metavar="DIR",
                       help="HF model directory (config.json, safetensors, tokenizer files)")
    which.add_argument("--ckpt", metavar="DIR",
                       help="Megatron-Core checkpoint: a model directory (tlt_model.json), a training "
                            "checkpoint step_<N>, or a run's out_dir (its latest complete checkpoint)")
    parser.add_argument("--tokenizer", metavar="NAME",
                        help="'tiny' or a tokenizer directory (default: the model's own)")
    parser.add_argument("--tasks", default="arith,sort", help="comma-separated synthetic tasks")
    parser.add_argument("--n", type=int, default=200, help="held-out prompts (cycled over the tasks)")
    parser.add_argument("--seed", type=int, default=0, help="which held-out prompts")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    parser.add_argument("--samples", type=int, default=1, help="responses per prompt (needs --temperature > 0 "
                                                                "when > 1); reports pass@k too")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="engine batch size")
    parser.add_argument("--device", default="auto",
                        help="auto (cuda when available, else cpu), cpu or cuda[:i]; float32 on CPU, "
                             "the checkpoint's dtype on GPU")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    return parser


def resolve_mcore_checkpoint(path: str) -> tuple[str, Optional[int]]:
    """(Megatron-Core model directory, training step or None) that `path` names.

    path: a model directory (tlt_model.json); a complete training checkpoint step_<N>;
    or a run's out_dir / its checkpoints/ folder (the latest complete checkpoint)."""
    from megatron_tlt.checkpoint import MODEL_DIR, Checkpointer, verify_complete
    from megatron_tlt.models.mcore_ckpt import META_FILE

    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise TLTError(f"--ckpt {path}: no such directory")
    if os.path.isfile(os.path.join(path, META_FILE)):
        return path, None
    if os.path.basename(path).startswith("step_") or os.path.isfile(os.path.join(path, "manifest.json")):
        manifest = verify_complete(path, "--ckpt:")
        return os.path.join(path, MODEL_DIR), int(manifest["step"])
    out_dir = os.path.dirname(path) if os.path.basename(path) == "checkpoints" else path
    found = Checkpointer(out_dir, keep_last=0).resolve("auto")
    if found is None:
        raise TLTError(f"--ckpt {path}: not a Megatron-Core model directory ({META_FILE}), nor a training "
                       f"checkpoint, nor a run directory with a complete checkpoint under checkpoints/")
    return os.path.join(found, MODEL_DIR), int(verify_complete(found)["step"])


@contextlib.contextmanager
def hf_view_of_checkpoint(path: str) -> Iterator[tuple[str, str, Optional[int]]]:
    """(HF directory, Megatron-Core model directory, step) of checkpoint `path`: the
    checkpoint converted into a temporary directory, removed on exit."""
    import torch.distributed as dist

    from megatron_tlt.convert import mcore_to_hf
    from megatron_tlt.models import mcore

    model_dir, step = resolve_mcore_checkpoint(path)
    owned = not (dist.is_available() and dist.is_initialized())
    with tempfile.TemporaryDirectory(prefix="tlt-eval-") as tmp:
        hf_dir = os.path.join(tmp, "hf")
        try:
            mcore_to_hf(model_dir, hf_dir, progress=False)
        finally:
            if owned:  # conversion builds a world-of-one model; leave no process group behind
                mcore.destroy_parallel()
        yield hf_dir, model_dir, step


def evaluate_checkpoint(path: str, tasks: Sequence[str] = ("arith", "sort"), n: int = 200, seed: int = 0,
                        max_new_tokens: int = 512, **kwargs) -> dict:
    """`evaluate` of a Megatron-Core checkpoint (see `resolve_mcore_checkpoint` for `path`);
    the report's "model" is the checkpoint's model directory and "step" its training step."""
    with hf_view_of_checkpoint(path) as (hf_dir, model_dir, step):
        report = evaluate(hf_dir, tasks, n, seed, max_new_tokens, **kwargs)
    report["model"] = model_dir
    report["step"] = step
    return report


def evaluate(model_dir: str, tasks: Sequence[str] = ("arith", "sort"), n: int = 200, seed: int = 0,
             max_new_tokens: int = 512, *, max_num_seqs: int = 64, progress: bool = False,
             keep_responses: bool = False, device: str = "auto", tokenizer: Optional[str] = None,
             temperature: float = 0.0, samples: int = 1) -> dict:
    """Exact-answer evaluation (greedy by default); returns the report as a dict (see module
    docstring).

    tokenizer: 'tiny' or a tokenizer directory; None: the one in `model_dir`.
    temperature, samples: sampled evaluation, `samples` responses per prompt."""
    from megatron_tlt.data.rewards import compute_rewards
    from megatron_tlt.data.tasks import get_task, make_dataset
    from megatron_tlt.data.tokenizer import load_tokenizer
    from megatron_tlt.rollout import Request, RolloutEngine, SamplingParams, load_hf
    from megatron_tlt.rollout.weights import engine_dtype, resolve_device

    if n < 1:
        raise TLTError(f"--n must be >= 1, got {n}")
    if max_new_tokens < 1:
        raise TLTError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if samples < 1:
        raise TLTError(f"--samples must be >= 1, got {samples}")
    if temperature < 0:
        raise TLTError(f"--temperature must be >= 0, got {temperature}")
    if samples > 1 and temperature == 0:
        raise TLTError(f"--samples {samples} needs --temperature > 0 (greedy responses are all the same)")
    tasks = [t.strip() for t in tasks if t.strip()]
    for t in tasks:
        get_task(t)  # unknown names fail before any work
    if not tasks:
        raise TLTError("--tasks is empty; give e.g. --tasks arith,sort")
    prompts = make_dataset(tasks, n, seed, split="test")
    from megatron_tlt.models.arch import ModelArch

    declared = ModelArch.from_hf_dir(model_dir)  # a missing/bad model directory fails here, first
    tokenizer = load_tokenizer(tokenizer or model_dir)
    device = resolve_device(device)
    dtype = engine_dtype(declared, device)
    arch, weights = load_hf(model_dir, dtype=dtype, device=device)
    max_len = arch.max_position_embeddings
    requests = []
    for s in prompts:
        ids = tokenizer.encode_prompt(s.prompt)
        room = max_len - len(ids)
        if room < 1:
            raise TLTError(f"prompt {s.prompt_id} has {len(ids)} tokens, no room left in the model's "
                           f"context ({max_len})")
        params = SamplingParams(temperature=temperature, max_new_tokens=min(max_new_tokens, room), logprobs=False)
        for j in range(samples):  # the engine seeds each request by (seed, prompt id, sample index)
            requests.append(Request(prompt_id=s.prompt_id, sample_index=j, prompt_token_ids=ids,
                                    sampling_params=params))
    block = 16
    per_seq = sorted((-(-(len(r.prompt_token_ids) + r.sampling_params.max_new_tokens) // block)
                      for r in requests), reverse=True)
    engine = RolloutEngine(arch, weights, max_num_seqs=max_num_seqs, num_blocks=sum(per_seq[:max_num_seqs]),
                           block_size=block, max_model_len=max_len, eos_token_ids=[tokenizer.eos_id],
                           seed=seed, dtype=dtype, device=device)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), unit="prompt", desc="eval", dynamic_ncols=True)

    def on_progress(p):
        bar.n = p.num_done
        bar.set_postfix(tok_s=f"{p.tokens_per_s:.0f}", refresh=False)
        bar.refresh()

    t0 = time.perf_counter()
    try:
        results = engine.generate(requests, progress=on_progress if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    elapsed = time.perf_counter() - t0

    def new_group():
        return {"n": 0, "correct": 0, "response_tokens": 0, "truncated": 0}

    overall, per_task, per_bucket = new_group(), {t: new_group() for t in tasks}, {}
    solved = {}  # prompt_id -> any of its responses right
    responses = []
    for i, r in enumerate(results):
        s = prompts[i // samples]
        if r.error is not None:
            raise TLTError(f"prompt {s.prompt_id}: rejected by the engine: {r.error}")
        text = tokenizer.decode(r.token_ids, skip_special_tokens=True)
        ok = compute_rewards(get_task(s.task).reward, [text], [s.answer], [s.prompt_id],
                             truncated=[r.finish_reason == "length"])[0] == 1.0
        solved[s.prompt_id] = solved.get(s.prompt_id, False) or ok
        ref_len = len(tokenizer.encode(s.solution)) + 1
        bucket = _bucket(ref_len)
        for g in (overall, per_task[s.task], per_bucket.setdefault(bucket, new_group())):
            g["n"] += 1
            g["correct"] += int(ok)
            g["response_tokens"] += len(r.token_ids)
            g["truncated"] += int(r.finish_reason == "length")
        if keep_responses:
            responses.append({"prompt_id": s.prompt_id, "sample_index": r.sample_index, "task": s.task,
                              "correct": ok, "answer": s.answer,
                              "response": text, "reference_tokens": ref_len, "finish_reason": r.finish_reason})

    def summary(g):
        return {"n": g["n"], "correct": g["correct"], "rate": g["correct"] / max(1, g["n"]),
                "mean_response_tokens": g["response_tokens"] / max(1, g["n"]), "truncated": g["truncated"]}

    order = {b: i for i, b in enumerate([_bucket(x - 1) for x in LENGTH_BUCKETS] + [_bucket(10**9)])}
    report = {"model": os.path.abspath(model_dir), "tasks": tasks, "n": n, "seed": seed,
              "max_new_tokens": max_new_tokens, "device": str(device), "overall": summary(overall),
              "per_task": {t: summary(g) for t, g in per_task.items()},
              "by_reference_length": {b: summary(per_bucket[b]) for b in sorted(per_bucket, key=order.get)},
              "generated_tokens": overall["response_tokens"], "elapsed_s": elapsed,
              "temperature": temperature, "samples": samples}
    if samples > 1:
        def pass_at_k(group):
            ids = [s.prompt_id for s in prompts if group is None or s.task == group]
            return {"n": len(ids), "solved": sum(solved[i] for i in ids),
                    "rate": sum(solved[i] for i in ids) / max(1, len(ids))}

        report["pass_at_k"] = {"overall": pass_at_k(None), "per_task": {t: pass_at_k(t) for t in tasks}}
    if keep_responses:
        report["responses"] = responses
    return report


def format_report(report: dict) -> str:
    o = report["overall"]
    where = report["model"] if report.get("step") is None else f"{report['model']} (step {report['step']})"
    lines = [f"exact-answer rate: {o['rate']:.1%} ({o['correct']}/{o['n']})  "
             f"mean response {o['mean_response_tokens']:.1f} tokens  truncated {o['truncated']}  "
             f"[{where}, split=test, seed={report['seed']}, {_decoding(report)}]"]
    lines.append(f"  {'':<20}{'rate':>8}{'correct':>10}{'mean tokens':>13}{'truncated':>11}")
    for title, groups in (("task", report["per_task"]), ("ref. tokens", report["by_reference_length"])):
        for name, g in groups.items():
            lines.append(f"  {title + ' ' + name:<20}{g['rate']:>8.1%}{g['correct']:>5}/{g['n']:<4}"
                         f"{g['mean_response_tokens']:>13.1f}{g['truncated']:>11}")
    if "pass_at_k" in report:
        k, pk = report["samples"], report["pass_at_k"]
        lines.append(f"  pass@{k} (a prompt with >= 1 right response of {k}): {pk['overall']['rate']:.1%} "
                     f"({pk['overall']['solved']}/{pk['overall']['n']} prompts)")
    return "\n".join(lines)


def _decoding(report: dict) -> str:
    t, k = report.get("temperature", 0.0), report.get("samples", 1)
    return "greedy" if t == 0 else f"temperature {t:g}, {k} sample{'s' if k > 1 else ''} per prompt"


def main(args: argparse.Namespace) -> int:
    kwargs = dict(max_num_seqs=getattr(args, "max_num_seqs", 64), progress=sys.stderr.isatty(),
                  device=getattr(args, "device", "auto"), tokenizer=getattr(args, "tokenizer", None),
                  temperature=getattr(args, "temperature", 0.0), samples=getattr(args, "samples", 1))
    tasks = args.tasks.split(",")
    if args.json:  # before the evaluation, not after it
        from megatron_tlt.atomic_io import check_output_file
        check_output_file(args.json)
    if getattr(args, "ckpt", None):
        report = evaluate_checkpoint(args.ckpt, tasks, n=args.n, seed=args.seed,
                                     max_new_tokens=args.max_new_tokens, **kwargs)
    else:
        report = evaluate(args.model, tasks, n=args.n, seed=args.seed, max_new_tokens=args.max_new_tokens,
                          **kwargs)
    print(format_report(report), flush=True)
    if args.json:
        from megatron_tlt.atomic_io import write_json
        write_json(args.json, report)
    return 0
