"""megatron_tlt: RL post-training of reasoning LLMs on Megatron-Core with lossless,
adaptive speculative-decoding rollouts. See README.md and DESIGN.md."""

__version__ = "0.1.0"
