"""The shipped tiny default policy (megatron_tlt/assets/tiny_default): complete, small,
the architecture its README describes, loadable by the rollout engine, and better than
chance on short held-out problems."""

from __future__ import annotations

import json
import os

from megatron_tlt.sft import TINY_DEFAULT_DIR


def test_files_and_size():
    names = set(os.listdir(TINY_DEFAULT_DIR))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "generation_config.json", "README.md"} <= names
    total = sum(os.path.getsize(os.path.join(TINY_DEFAULT_DIR, n)) for n in names)
    assert total < 10 * 2**20, f"shipped model is {total / 2**20:.1f} MiB"
    cfg = json.load(open(os.path.join(TINY_DEFAULT_DIR, "config.json")))
    assert cfg["model_type"] == "llama" and cfg["vocab_size"] == 100 and cfg["eos_token_id"] == 2


def test_loads_in_the_engine_and_solves_short_sorts():
    from megatron_tlt.data.tokenizer import load_tokenizer
    from megatron_tlt.evaluate import evaluate
    from megatron_tlt.rollout import load_hf

    arch, _ = load_hf(TINY_DEFAULT_DIR)
    assert (arch.hidden_size, arch.num_layers, arch.num_heads, arch.num_kv_heads) == (128, 4, 4, 2)
    assert load_tokenizer(TINY_DEFAULT_DIR).vocab_size == 100
    report = evaluate(TINY_DEFAULT_DIR, ["sort"], n=12, seed=1, max_new_tokens=96)
    short = report["by_reference_length"].get("0-63", {"correct": 0})
    assert short["correct"] >= 3, report  # a random or broken model gets none


def test_eval_command_line(tmp_path):
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    env.pop("RANK", None)

    def run(*args):
        return subprocess.run([sys.executable, "-m", "megatron_tlt", "eval", "--model", TINY_DEFAULT_DIR, *args],
                              capture_output=True, text=True, env=env, timeout=120)

    out = tmp_path / "eval.json"
    ok = run("--tasks", "sort", "--n", "2", "--max-new-tokens", "8", "--json", str(out))
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("exact-answer rate: ")
    report = json.loads(out.read_text())
    assert report["n"] == 2 and report["tasks"] == ["sort"] and report["device"] == "cpu"
    bad = run("--tasks", "sort,sorting")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == \
        "error: unknown task 'sorting'; known tasks: arith, sort"
