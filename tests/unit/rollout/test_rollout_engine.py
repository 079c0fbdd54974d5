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
