"""Tasks, data, rewards and tokenizers.

* `tasks`     -- synthetic long-tail reasoning tasks (``arith``, ``sort``): seeded
                 generators of (prompt, step-by-step solution, ``#### answer``).
* `tokenizer` -- the built-in character tokenizer (``"tiny"``) and offline HF
                 tokenizer loading behind one small `Tokenizer` interface.
* `datasets`  -- prompt datasets from JSONL / Parquet, validated at load.
* `rewards`   -- reward registry (task rewards, math-verify ``math``, user dotted
                 paths) and `compute_rewards`.
"""

from megatron_tlt.data.datasets import load_prompt_dataset
from megatron_tlt.data.rewards import (
    compute_rewards,
    get_reward,
    list_rewards,
    math_reward,
    register_reward,
)
from megatron_tlt.data.tasks import (
    ANSWER_MARKER,
    Sample,
    TaskFamily,
    extract_final_answer,
    get_task,
    list_tasks,
    make_dataset,
)
from megatron_tlt.data.tokenizer import Tokenizer, build_tiny_tokenizer, load_tokenizer

__all__ = [
    "ANSWER_MARKER",
    "Sample",
    "TaskFamily",
    "Tokenizer",
    "build_tiny_tokenizer",
    "compute_rewards",
    "extract_final_answer",
    "get_reward",
    "get_task",
    "list_rewards",
    "list_tasks",
    "load_prompt_dataset",
    "load_tokenizer",
    "make_dataset",
    "math_reward",
    "register_reward",
]
