"""examples/sft_bench_1p5b.yaml (the one-H200 SFT benchmark) parses, and a scaled-down
copy of it — same family (Qwen2: QKV bias), same 151,936-token vocabulary, tied
embeddings, rope theta 1e6, bf16 — runs 2 steps on a CPU end to end (packing, loss,
optimizer, checkpoint, HF export)."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_tlt.config import load_config

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCH = REPO_ROOT / "examples" / "sft_bench_1p5b.yaml"


def test_bench_config_is_the_qwen2p5_1p5b_shape():
    cfg = load_config(str(BENCH))
    from megatron_tlt.sft import arch_from_config

    arch = arch_from_config(cfg)
    assert arch.family == "qwen2" and arch.qkv_bias and arch.tie_word_embeddings
    assert 1.50e9 < arch.num_params() < 1.56e9  # Qwen2.5-1.5B: 1.54B
    assert arch.padded_vocab_size == 151936
    assert cfg.train.global_batch_size % cfg.train.micro_batch_size == 0
    assert cfg.model.seq_length <= arch.max_position_embeddings
    assert not cfg.model.use_te and cfg.sft.pack  # packed rows need the mask-honouring local spec


def test_scaled_down_copy_runs_two_steps_on_cpu(tmp_path):
    from megatron_tlt import sft
    from megatron_tlt.metrics import read_metrics
    from megatron_tlt.models import mcore

    mcore.init_parallel(1, 1)
    out = tmp_path / "run"
    cfg = load_config(str(BENCH), [
        f"train.out_dir={out}", "train.steps=2", "train.global_batch_size=2", "train.micro_batch_size=2",
        "model.seq_length=128", "rollout.max_new_tokens=64", "model.arch.hidden_size=96",
        "model.arch.head_dim=8", "model.arch.intermediate_size=128", "model.arch.num_layers=2",
        "model.arch.max_position_embeddings=256", "data.num_train=32", "data.num_val=4",
        "sft.eval_interval=0", "sft.progress=false", "optim.lr_warmup_steps=1", "logging.log_interval=1"])
    assert cfg.model.arch.vocab_size == 151936 and cfg.model.dtype == "bfloat16"
    assert sft.main(cfg) == 0
    recs = read_metrics(str(out / "metrics.jsonl"))
    assert [r["step"] for r in recs] == [1, 2]
    assert all(r["loss"] > 0 and r["grad_norm"] > 0 for r in recs) and "val_loss" in recs[-1]
    hf_cfg = json.loads((out / "hf" / "config.json").read_text())
    assert hf_cfg["model_type"] == "qwen2" and hf_cfg["vocab_size"] == 151936
    assert hf_cfg["torch_dtype"] == "bfloat16" and hf_cfg["rope_theta"] == 1e6
