"""Actor (TP/PP, gloo) -> engine weight sync: randomize the engine, sync, logits equal."""

import json
from pathlib import Path

import pytest

from megatron_tlt.convert import hf_to_mcore
from megatron_tlt.testing.tiny_models import make_tiny_hf

SCRIPT = Path(__file__).parent / "scripts" / "sync_check.py"


@pytest.mark.parametrize("family,tp,pp", [("qwen2", 1, 1), ("qwen3", 2, 1), ("llama", 1, 2)])
def test_sync_into_engine(tmp_path, run_torchrun, family, tp, pp):
    hf = make_tiny_hf(str(tmp_path / "hf"), family, vocab_size=250, num_kv_heads=2,
                      tie_word_embeddings=(family == "qwen3"))
    mc = str(tmp_path / "mc")
    hf_to_mcore(hf, mc, progress=False)
    out = tmp_path / "r.json"
    run_torchrun(SCRIPT, tp * pp, ["--mcore", mc, "--tp", str(tp), "--pp", str(pp), "--out", str(out)], timeout=600)
    r = json.loads(out.read_text())
    assert r["before"] > 1e-2, "negative control: a randomized engine must disagree with the actor"
    assert r["after"] < 1e-5, r
    assert r["ptrs_same"] and r["version"] == 7
    # one bucket's gathers (or none: another stage's bucket comes first) when the first
    # bucket arrives, not the stage's every layer
    assert r["gathers_first"] <= 1 < r["gathers_total"], r
