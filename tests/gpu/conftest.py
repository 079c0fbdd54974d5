"""GPU tests: a CUDA engine would set torch to one intra-op CPU thread for the whole
process (rollout.host.limit_host_threads), which slows these tests' CPU reference
computations (vocabulary-sized rows over large grids); the thread count has no effect on
results, so the tests keep torch's own setting unless told otherwise."""

import os

os.environ.setdefault("MEGATRON_TLT_HOST_THREADS", "0")
