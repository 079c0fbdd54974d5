"""Native rollout engine: paged KV cache, continuous batching, inference forward, sampling.

CPU-correct reference paths throughout; GPU kernels (attention, sampling) and CUDA graphs
slot in behind the same plain-data interfaces (`AttentionMetadata`, `sample`).
"""

from megatron_tlt.rollout.engine import Progress, RolloutEngine
from megatron_tlt.rollout.kv_cache import PagedKVCache
from megatron_tlt.rollout.request import Request, Result, expand_requests
from megatron_tlt.rollout.sampling import SamplingParams
from megatron_tlt.rollout.weights import EngineWeights, load_hf

__all__ = ["EngineWeights", "PagedKVCache", "Progress", "Request", "Result", "RolloutEngine",
           "SamplingParams", "expand_requests", "load_hf"]
