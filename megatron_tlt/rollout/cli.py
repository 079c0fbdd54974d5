"""`megatron-tlt generate`: rollouts from a JSONL prompt file with the native engine.

Prompt lines: a JSON object with `prompt` (text, tokenized as-is with the model's
tokenizer — no chat template is applied) or `prompt_token_ids` (list of ints), an
optional `prompt_id` (default: the 0-based index of the line among non-blank lines) and an
optional `n` (samples for this prompt, default --n).

Output lines, one per sample, in prompt order then sample order: prompt_id, sample_index,
token_ids, text (generated tokens decoded with special tokens skipped; null without a
tokenizer), logprobs (log_softmax(logits / T) of each token, before top-k/top-p),
finish_reason, stop_reason, policy_version, spec (speculative-decoding stats; empty while
--spec is off) and error (null, or why this request was rejected).

Speculative decoding (lossless: the same tokens as --spec off in greedy mode, the same
distribution otherwise): --spec eagle --drafter DIR (a drafter from
`python -m megatron_tlt.spec.train_drafter` or `megatron-tlt export-drafter`) or --spec
ngram (model-free suffix matching against the prompt, the other samples of the prompt and
earlier responses). --spec-depth/--spec-topk/--spec-num-verify set the draft tree (topk 1:
chain; --spec-depth 1:6,8:4,32:3 sets the depth by running batch size, 1:6x2,8:4 a top-2
tree at batch 1); --spec-threshold N
speculates only while at most N sequences run. Per request,
`spec` holds drafted/accepted/num_drafts/acceptance_rate/acceptance_length/fallbacks;
a summary by batch-size bucket goes to stderr and, with --spec-summary FILE, to JSON.

A malformed line stops the run before any work, naming the line; a well-formed but bad
request (empty prompt, token outside the vocabulary, too long, n < 1) gets an error line
and the others still run; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from megatron_tlt.config import DEFAULT_SPEC_DEPTH
from megatron_tlt.errors import TLTError
from megatron_tlt.models.arch import ModelArch
from megatron_tlt.rollout.weights import ENGINE_DTYPES

SPEC_CHOICES = ("off", "eagle", "ngram", "adaptive")


def add_generate_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("generate")
    g.add_argument("--model", required=True, help="HF model directory (config.json, safetensors, tokenizer)")
    g.add_argument("--prompts", required=True,
                   help="input JSONL: prompt or prompt_token_ids, optional prompt_id, n")
    g.add_argument("--out", required=True, help="output JSONL, one line per sample")
    g.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 disables")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--min-new-tokens", type=int, default=0, help="ban stop tokens until reached")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--n", type=int, default=1, help="samples per prompt")
    g.add_argument("--spec", choices=SPEC_CHOICES, default="off",
                   help="speculative decoding: off, eagle (needs --drafter) or ngram (adaptive: not yet)")
    g.add_argument("--drafter", default=None, help="drafter directory (for --spec eagle/adaptive)")
    g.add_argument("--spec-depth", default=DEFAULT_SPEC_DEPTH,
                   help="draft tokens along the longest path; or by running batch size, "
                        "BATCH:DEPTH,... (e.g. 1:6,8:4,32:3: 6 while one sequence runs, 4 up to "
                        f"8, else 3; default {DEFAULT_SPEC_DEPTH}: 6 at batch 1, else 4); a depth "
                        "DxK drafts top-K trees for that entry (e.g. 1:6x2,8:4,32:4)")
    g.add_argument("--spec-topk", type=int, default=1, help="children per tree node (1 = chain)")
    g.add_argument("--spec-num-verify", type=int, default=None,
                   help="tree nodes verified per step, root included (default: depth + 1 for a "
                        "chain, 1 + depth * topk for a tree)")
    g.add_argument("--spec-threshold", type=int, default=None,
                   help="speculate only while the running batch is <= this (default: always)")
    g.add_argument("--spec-ngram", type=int, default=4, help="longest suffix matched by --spec ngram")
    g.add_argument("--spec-summary", default=None, metavar="FILE",
                   help="write speculative-decoding stats by batch-size bucket as JSON")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks (default: enough for --max-num-seqs of the longest requests)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--dtype", choices=("auto",) + ENGINE_DTYPES, default="auto")
    g.add_argument("--device", default="auto", help="auto, cpu or cuda[:i]")
    return parser


def _arg(args, name, default):
    return getattr(args, name, default)


def read_prompts(path: str) -> list[tuple[int, dict]]:
    """[(line number, record)]; TLTError naming the line for anything malformed."""
    if not os.path.isfile(path):
        raise TLTError(f"--prompts file not found: {path}")
    records = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise TLTError(f"{where}: not valid UTF-8 (byte {e.start + 1} of the line)") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise TLTError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            except (ValueError, RecursionError) as e:  # integers past 4300 digits, deep nesting
                raise TLTError(f"{where}: not valid JSON input ({type(e).__name__}: "
                               f"{str(e).splitlines()[0][:120]})") from None
            if not isinstance(rec, dict):
                raise TLTError(f"{where}: expected a JSON object, got {type(rec).__name__}")
            has_text, has_ids = "prompt" in rec, "prompt_token_ids" in rec
            if has_text == has_ids:
                raise TLTError(f"{where}: give exactly one of 'prompt' (text) or 'prompt_token_ids'")
            if has_text and not isinstance(rec["prompt"], str):
                raise TLTError(f"{where}: 'prompt' must be a string, got {type(rec['prompt']).__name__}")
            if has_ids and not isinstance(rec["prompt_token_ids"], list):
                raise TLTError(f"{where}: 'prompt_token_ids' must be a list of integers")
            pid = rec.get("prompt_id", len(records))
            if not isinstance(pid, (str, int)) or isinstance(pid, bool):
                raise TLTError(f"{where}: 'prompt_id' must be a string or an integer, got {pid!r}")
            for key in ("prompt", "prompt_id"):
                try:
                    if isinstance(rec.get(key), str):
                        rec[key].encode("utf-8")
                except UnicodeEncodeError:
                    raise TLTError(f"{where}: '{key}' is not valid Unicode text (an unpaired "
                                   f"surrogate such as \\ud800)") from None
            rec["prompt_id"] = pid
            records.append((lineno, rec))
    if not records:
        raise TLTError(f"--prompts file {path} has no prompts")
    return records


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _load_tokenizer(model_dir: str, needed: bool):
    # transformers may build an *empty* tokenizer from config.json alone; require files.
    if not any(os.path.isfile(os.path.join(model_dir, f)) for f in _TOKENIZER_FILES):
        if needed:
            raise TLTError(f"cannot load the tokenizer from {model_dir} (needed for text prompts): "
                           f"none of {', '.join(_TOKENIZER_FILES)} is there")
        return None
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any failure means "no usable tokenizer"
        if needed:
            raise TLTError(f"cannot load the tokenizer from {model_dir} (needed for text prompts): "
                           f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
        return None


def _eos_ids(model_dir: str, tokenizer) -> list[int]:
    for fname in ("generation_config.json", "config.json"):
        path = os.path.join(model_dir, fname)
        if os.path.isfile(path):
            try:
                with open(path) as f:
                    eos = json.load(f).get("eos_token_id")
            except (json.JSONDecodeError, AttributeError) as e:
                raise TLTError(f"{path}: cannot read eos_token_id ({e})") from None
            if eos is not None:
                return [eos] if isinstance(eos, int) else [int(e) for e in eos]
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return [int(tokenizer.eos_token_id)]
    return []


def main(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from megatron_tlt.rollout.engine import RolloutEngine, fast_path_options
    from megatron_tlt.rollout.request import MAX_SAMPLES, Result, expand_requests
    from megatron_tlt.rollout.sampling import SamplingParams
    from megatron_tlt.rollout.weights import engine_dtype, load_hf, resolve_device

    spec = _arg(args, "spec", "off")
    policy = _spec_checked(args, spec)
    n = args.n
    if not 1 <= n <= MAX_SAMPLES:
        raise TLTError(f"--n must be in [1, {MAX_SAMPLES}], got {n}")
    if os.path.isdir(args.out):  # before the generation, not at its rename
        raise TLTError(f"--out {args.out} is a directory, not a file")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        raise TLTError(f"--out {args.out}: directory {out_dir} does not exist")
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise TLTError(f"--out {args.out}: directory {out_dir} is not writable")
    if os.path.exists(args.prompts) and os.path.realpath(args.out) == os.path.realpath(args.prompts):
        raise TLTError(f"--out {args.out} is the --prompts file; the results would replace the prompts")
    block_size = _arg(args, "block_size", 16)
    max_num_seqs = _arg(args, "max_num_seqs", 64)
    num_blocks = _arg(args, "num_blocks", None)
    max_model_len = _arg(args, "max_model_len", None)
    for flag, value in (("--block-size", block_size), ("--max-num-seqs", max_num_seqs),
                        ("--num-blocks", num_blocks), ("--max-model-len", max_model_len)):
        if value is not None and value < 1:
            raise TLTError(f"{flag} must be >= 1, got {value}")
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens,
                            min_new_tokens=_arg(args, "min_new_tokens", 0),
                            stop_strings=tuple(_arg(args, "stop", None) or ()), seed=args.seed)
    records = read_prompts(args.prompts)

    device = resolve_device(_arg(args, "device", "auto"))
    arch = ModelArch.from_hf_dir(args.model)
    dtype = engine_dtype(arch, device, _arg(args, "dtype", "auto"))
    try:
        params.check(arch.vocab_size)
    except TLTError as e:
        raise TLTError(f"sampling flags: {e}") from None
    arch, weights = load_hf(args.model, dtype=dtype, device=device)
    tokenizer = _load_tokenizer(args.model, needed=any("prompt" in r for _, r in records))
    if params.stop_strings and tokenizer is None:
        raise TLTError(f"--stop needs a tokenizer, and none could be loaded from {args.model}")

    # slots, one per output line: (index into requests, line number) or (None, error record)
    requests, slots = [], []
    for lineno, rec in records:
        pid = rec["prompt_id"]
        ids = rec.get("prompt_token_ids")
        if ids is None:
            ids = tokenizer.encode(rec["prompt"])
        try:
            reqs = expand_requests(pid, ids, params, rec.get("n", n))
        except TLTError as e:
            slots.append((None, {"prompt_id": pid, "sample_index": None,
                                 "error": f"{args.prompts}:{lineno}: {e}"}))
            continue
        for r in reqs:
            slots.append((len(requests), lineno))
            requests.append(r)

    max_model_len = max_model_len or arch.max_position_embeddings
    if num_blocks is None:
        # room for the largest draft tree the policy may verify
        extra = 0 if policy is None else max(st.num_draft_nodes for st in policy.strategies) + 1
        per = sorted((-(-min(len(r.prompt_token_ids) + params.max_new_tokens + extra, max_model_len)
                        // block_size) for r in requests), reverse=True) or [1]
        num_blocks = max(1, sum(per[:max_num_seqs]))
    engine = RolloutEngine(arch, weights, max_num_seqs=max_num_seqs, num_blocks=num_blocks,
                           block_size=block_size, dtype=dtype, device=device,
                           max_model_len=max_model_len, eos_token_ids=_eos_ids(args.model, tokenizer),
                           detokenize=(lambda t: tokenizer.decode(t, skip_special_tokens=True))
                           if tokenizer is not None else None, seed=args.seed,
                           **fast_path_options(device))
    if policy is not None:
        engine.spec_decoder = _spec_decoder(args, spec, policy, arch, weights)

    # Rejected here rather than by generate(), which cannot name the line.
    valid, seen = [], {}
    for k, (idx, lineno) in enumerate(slots):
        if idx is None:
            continue
        r = requests[idx]
        key = (str(r.prompt_id), r.sample_index)
        try:
            engine.check_request(r)
            if key in seen:
                raise TLTError(f"same prompt_id and sample_index as line {seen[key]} (both would "
                               f"sample identical tokens)")
        except TLTError as e:
            slots[k] = (None, {"prompt_id": r.prompt_id, "sample_index": r.sample_index,
                               "error": f"{args.prompts}:{lineno}: prompt {r.prompt_id!r} sample "
                                        f"{r.sample_index}: {e}"})
            continue
        seen[key] = lineno
        slots[k] = (len(valid), lineno)
        valid.append(r)
    requests = valid

    bar = tqdm(total=len(requests), unit="req", desc="generate", dynamic_ncols=True)

    def on_progress(p):
        bar.n = p.num_done
        bar.set_postfix(tok_s=f"{p.tokens_per_s:.1f}", refresh=False)
        bar.refresh()

    try:
        results: list[Result] = engine.generate(requests, progress=on_progress) if requests else []
    except KeyboardInterrupt:
        bar.close()
        print(f"generate: interrupted with {bar.n} of {len(requests)} requests done; nothing "
              f"written to {args.out}", file=sys.stderr)
        raise
    finally:
        bar.close()

    num_errors = 0
    tmp = args.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for idx, at in slots:
            if idx is None:
                line = {"prompt_id": at["prompt_id"], "sample_index": at["sample_index"], "token_ids": [],
                        "text": None, "logprobs": None, "finish_reason": "error", "stop_reason": None,
                        "policy_version": engine.policy_version, "spec": {}, "error": at["error"]}
            else:
                r = results[idx]
                text = None
                if tokenizer is not None and r.error is None:
                    text = tokenizer.decode(r.token_ids, skip_special_tokens=True)
                line = {"prompt_id": r.prompt_id, "sample_index": r.sample_index,
                        "token_ids": r.token_ids, "text": text, "logprobs": r.logprobs,
                        "finish_reason": r.finish_reason, "stop_reason": r.stop_reason,
                        "policy_version": r.policy_version, "spec": dict(r.spec_stats),
                        "error": None if r.error is None else f"{args.prompts}:{at}: {r.error}"}
            if line["error"] is not None:
                num_errors += 1
                print(f"warning: {line['error']}", file=sys.stderr)
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
    os.replace(tmp, args.out)
    if engine.spec_decoder is not None:
        _report_spec(args, engine.spec_decoder.metrics.summary())
    if num_errors:
        print(f"{num_errors} of {len(slots)} output lines are rejected requests (see 'error' in {args.out})",
              file=sys.stderr)
        return 1
    return 0


def _spec_checked(args, spec: str):
    """The --spec flags' policy (spec.decode.BatchSchedulePolicy; None for --spec off),
    checked before any work."""
    drafter = _arg(args, "drafter", None)
    if spec == "off":
        if drafter:
            raise TLTError("--drafter needs --spec eagle (speculative decoding is off)")
        return None
    if spec == "adaptive":
        raise TLTError("--spec adaptive is not available yet (use eagle or ngram)")
    if spec == "eagle" and not drafter:
        raise TLTError("--spec eagle needs --drafter DIR")
    if spec == "ngram" and drafter:
        raise TLTError("--drafter is not used by --spec ngram (model-free)")
    threshold = _arg(args, "spec_threshold", None)
    if threshold is not None and threshold < 0:
        raise TLTError(f"--spec-threshold must be >= 0, got {threshold}")
    ngram = _arg(args, "spec_ngram", 4)
    if ngram < 1:
        raise TLTError(f"--spec-ngram must be >= 1, got {ngram}")
    from megatron_tlt.spec.decode import depth_policy
    try:
        return depth_policy(_arg(args, "spec_depth", DEFAULT_SPEC_DEPTH), topk=_arg(args, "spec_topk", 1),
                            num_verify_tokens=_arg(args, "spec_num_verify", None), threshold=threshold)
    except TLTError as e:
        raise TLTError(f"--spec flags: {e}") from None


def _spec_decoder(args, spec, policy, arch, weights):
    """A SpecDecoder with `spec`'s drafter (args.drafter for eagle) and this policy."""
    from megatron_tlt.spec.decode import SpecDecoder

    if spec == "eagle":
        from megatron_tlt.spec.eagle import EagleProposer
        from megatron_tlt.spec.export import load_drafter
        drafter = EagleProposer(load_drafter(args.drafter, arch, weights.embed, weights.lm_head,
                                             dtype=weights.dtype, device=weights.device))
    else:
        from megatron_tlt.spec.ngram import NgramDrafter
        drafter = NgramDrafter(max_ngram=_arg(args, "spec_ngram", 4))
    return SpecDecoder(drafter, policy=policy)


def _report_spec(args, summary: dict) -> None:
    t = summary["total"]
    rate = "n/a" if t["acceptance_rate"] is None else f"{t['acceptance_rate']:.3f}"
    length = "n/a" if t["acceptance_length"] is None else f"{t['acceptance_length']:.3f}"
    print(f"spec {args.spec}: acceptance rate {rate}, acceptance length {length} "
          f"({t['num_drafts']} verifications, {t['fallbacks']} fallbacks)", file=sys.stderr)
    path = _arg(args, "spec_summary", None)
    if path:
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
        os.replace(tmp, path)
