"""Engine construction defaults of the jobs."""

import importlib.util

import torch

from megatron_tlt.rollout.engine import fast_path_options


def test_fast_path_options_pick_triton_and_graphs_on_cuda_only():
    """The jobs (train, generate, train_drafter) build their engine with these: the torch
    reference backend on CPU, the Triton backend with CUDA graphs on a GPU."""
    assert fast_path_options("cpu") == {}
    want = {} if importlib.util.find_spec("triton") is None else {"attention_backend": "triton",
                                                                    "cuda_graphs": True}
    assert fast_path_options("cuda") == fast_path_options(torch.device("cuda", 0)) == want


def test_fused_prefill_is_on_unless_the_environment_turns_it_off(monkeypatch):
    """MEGATRON_TLT_FUSED_PREFILL: unset or "1" -> the fused prefill (where the engine runs
    the fused kernels at all: a CUDA engine with the Triton backend, `_fused_verify`);
    "0" -> the generic forward. A CPU engine never takes it, whatever the variable."""
    from megatron_tlt.models.arch import ModelArch
    from megatron_tlt.rollout.engine import FUSED_PREFILL_ENV, RolloutEngine
    from megatron_tlt.rollout.weights import EngineWeights

    arch = ModelArch(family="qwen2", vocab_size=64, hidden_size=32, intermediate_size=48,
                     num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                     max_position_embeddings=64, tie_word_embeddings=True, qkv_bias=True)
    w = EngineWeights.make_dummy(arch, seed=0)
    got = {}
    for value in (None, "1", "0"):
        if value is None:
            monkeypatch.delenv(FUSED_PREFILL_ENV, raising=False)
        else:
            monkeypatch.setenv(FUSED_PREFILL_ENV, value)
        eng = RolloutEngine(arch, w, max_num_seqs=2, num_blocks=8, block_size=4)
        got[value] = eng.fused_prefill
        assert not eng._fused_verify()  # CPU: the generic forward prefills either way
    assert got == {None: True, "1": True, "0": False}


def test_verify_chains_output_equals_verify_forward_output():
    """engine.verify_chains_output (the deferred step's entry: chains of one depth, drafts
    given as a tensor, query rows built as lists) == verify_forward_output of the same
    chains as tensors with a causal mask: logits and hidden states bit for bit, and the
    KV it leaves. Control: drafts shifted by one token give other logits."""
    from megatron_tlt.models.arch import ModelArch
    from megatron_tlt.rollout.engine import RolloutEngine
    from megatron_tlt.rollout.request import Request
    from megatron_tlt.rollout.sampling import SamplingParams
    from megatron_tlt.rollout.weights import EngineWeights

    arch = ModelArch(family="qwen2", vocab_size=300, hidden_size=64, intermediate_size=96,
                     num_layers=2, num_heads=6, num_kv_heads=2, head_dim=16,
                     max_position_embeddings=256, tie_word_embeddings=True, qkv_bias=True)
    w = EngineWeights.make_dummy(arch, seed=4)
    g = torch.Generator().manual_seed(0)
    depth = 3
    drafts = torch.randint(0, 300, (3, depth), generator=g)
    runs = []
    for mode in ("chains", "forward", "control"):
        eng = RolloutEngine(arch, w, max_num_seqs=4, num_blocks=32, block_size=4)
        reqs = [Request(prompt_id=i, prompt_token_ids=list(range(1 + i, 6 + 3 * i)),
                        sampling_params=SamplingParams(temperature=0.0, max_new_tokens=8))
                for i in range(3)]
        seqs = [eng.add_sequence(r) for r in reqs]
        eng.sample_and_append(seqs, eng.forward_pending(seqs).logits)  # each root pending
        if mode == "forward":
            roots = torch.tensor([s.token_ids[-1] for s in seqs])[:, None]
            pos = torch.tensor([len(s.token_ids) - 1 for s in seqs])[:, None] + torch.arange(depth + 1)
            mask = torch.ones(depth + 1, depth + 1, dtype=torch.bool).tril().expand(3, -1, -1)
            out = eng.verify_forward_output(seqs, torch.cat([roots, drafts], 1), pos, mask,
                                            return_hidden=True)
        else:
            d = drafts if mode == "chains" else (drafts + 1) % 300
            out = eng.verify_chains_output(seqs, depth, d, return_hidden=True)
        assert all(s.pending_verify == depth + 1 for s in seqs)
        runs.append((out.logits.clone(), out.hidden_final.clone(), eng.cache.k[0].clone()))
    (lc, hc, kc), (lf, hf, kf), (lx, _, _) = runs
    assert torch.equal(lc, lf) and torch.equal(hc, hf) and torch.equal(kc, kf)
    assert not torch.equal(lx, lf)
