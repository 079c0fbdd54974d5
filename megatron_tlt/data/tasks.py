"""Synthetic long-tail reasoning tasks: built in, seeded, no downloads.

Each `TaskFamily` generates `(prompt, reference solution, answer)` triples whose
solutions are step-by-step traces, one short regular line per step, ending in the
final answer in ONE fixed format used everywhere in this package:

    <trace lines>
    #### <answer>

The number of steps is drawn from a capped discrete Pareto distribution, so
response lengths are heavy-tailed the way reasoning RL rollouts are (most short, a
few very long): over 1,000 mixed prompts the p99 response is >10x the median in
tokens of the built-in character tokenizer (tests/unit/data checks it). Formats
are made for a tiny LM learning on a CPU: small numbers (mod 100, single digits),
character-level-friendly, each line computable from the line above it.

Families:
  * ``arith`` -- multi-step arithmetic mod 100, evaluated left to right, one
    operation per line (``17+5=22``); steps ~ Pareto, so length is linear in steps.
  * ``sort``  -- bubble sort of a list of digits, one line per pass showing the list
    after that pass; list length ~ Pareto and the trace grows quadratically.

Train/test disjointness is by content, not by seed: a prompt belongs to the test
split iff a hash of (family, prompt) falls in the test bucket, and each split's
generator rejects prompts of the other split. So no test prompt ever appears in a
train set, whatever seeds the two were made with.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
import re
from typing import Any

from megatron_tlt.errors import ConfigError

ANSWER_MARKER = "####"
"""The final answer is the rest of the last line starting with this marker."""

TEST_FRACTION_PER_MILLE = 100
"""Share of the prompt space (per 1000, by content hash) reserved for the test split."""

SPLITS = ("train", "test")


@dataclasses.dataclass(frozen=True)
class Sample:
    """One prompt with its reference solution and verifiable answer.

    `solution` is None for loaded datasets that carry only prompts and answers.
    `task` names the reward that scores responses to this prompt.
    """

    prompt: str
    solution: str | None
    answer: str
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    prompt_id: str = ""
    task: str = ""


def format_final_answer(answer: str) -> str:
    """The closing line of every synthetic solution."""
    return f"{ANSWER_MARKER} {answer}"


_MARKER_LINE = re.compile(r"^[ \t]*" + re.escape(ANSWER_MARKER) + r"[ \t]*(.*?)[ \t\r]*$", re.MULTILINE)


def extract_final_answer(response: Any) -> str | None:
    """The text after the LAST ``####`` line of a response, or None if there is none."""
    if not isinstance(response, str):
        return None
    matches = _MARKER_LINE.findall(response)
    return matches[-1] if matches else None


def exact_answer_reward(response: Any, answer: Any) -> float:
    """1.0 iff the response's final ``####`` answer equals `answer` exactly
    (surrounding whitespace ignored), else 0.0; never raises on garbage."""
    got = extract_final_answer(response)
    if got is None or not isinstance(answer, str):
        return 0.0
    return 1.0 if got == answer.strip() else 0.0


exact_answer_reward.zero_if_truncated = True  # rewards.compute_rewards: a cut answer line


def pareto_int(rng: random.Random, k_min: int, alpha: float, cap: int) -> int:
    """A discrete Pareto draw: P(K >= k) = (k_min / k) ** alpha for k_min <= k <= cap
    (the mass above `cap` is put on `cap`)."""
    u = 1.0 - rng.random()  # in (0, 1]
    return min(cap, int(math.floor(k_min / u ** (1.0 / alpha))))


class TaskFamily:
    """A synthetic task: `generate(rng) -> Sample` and `reward(response, answer)`."""

    name: str = ""

    def generate(self, rng: random.Random) -> Sample:  # pragma: no cover - interface
        raise NotImplementedError

    def reward(self, response: Any, answer: Any) -> float:
        """1.0 for the exact final answer, else 0.0 (robust to any input)."""
        return exact_answer_reward(response, answer)

    reward.zero_if_truncated = True  # rewards.compute_rewards: a cut answer line

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class ArithmeticTask(TaskFamily):
    """Left-to-right arithmetic mod 100.

    Prompt:   ``Compute left to right, mod 100: 17+5*3-8``
    Solution: ``17+5=22`` / ``22*3=66`` / ``66-8=58`` / ``#### 58``
    Operands: ``+a`` and ``-a`` with a in 1..99, ``*a`` with a in 2..9; every
    intermediate is reduced mod 100 into 0..99.
    """

    name = "arith"

    def __init__(self, k_min: int = 2, alpha: float = 1.1, max_steps: int = 120):
        self.k_min, self.alpha, self.max_steps = k_min, alpha, max_steps

    def generate(self, rng: random.Random) -> Sample:
        steps = pareto_int(rng, self.k_min, self.alpha, self.max_steps)
        value = rng.randrange(100)
        expr, lines = [str(value)], []
        for _ in range(steps):
            op = rng.choice("+-*")
            operand = rng.randrange(2, 10) if op == "*" else rng.randrange(1, 100)
            new = {"+": value + operand, "-": value - operand, "*": value * operand}[op] % 100
            expr.append(f"{op}{operand}")
            lines.append(f"{value}{op}{operand}={new}")
            value = new
        answer = str(value)
        lines.append(format_final_answer(answer))
        prompt = f"Compute left to right, mod 100: {''.join(expr)}\n"
        return Sample(prompt, "\n".join(lines), answer, {"steps": steps}, task=self.name)


class BubbleSortTask(TaskFamily):
    """Bubble sort of a list of digits, one line per pass that changed the list.

    Prompt:   ``Sort with bubble sort: [3,1,2]``
    Solution: ``[1,2,3]`` (after pass 1) ... ``#### [1,2,3]``
    A pass compares neighbours left to right and swaps out-of-order pairs; passes
    repeat until one makes no swap (that pass is not shown). The trace has up to
    n-1 lines of 2n+1 characters: quadratic in the list length n.
    """

    name = "sort"

    def __init__(self, k_min: int = 3, alpha: float = 1.3, max_len: int = 24):
        self.k_min, self.alpha, self.max_len = k_min, alpha, max_len

    @staticmethod
    def fmt(xs: list[int]) -> str:
        return "[" + ",".join(map(str, xs)) + "]"

    def generate(self, rng: random.Random) -> Sample:
        n = pareto_int(rng, self.k_min, self.alpha, self.max_len)
        xs = [rng.randrange(10) for _ in range(n)]
        prompt = f"Sort with bubble sort: {self.fmt(xs)}\n"
        lines, work = [], list(xs)
        while True:
            swapped = False
            for i in range(len(work) - 1):
                if work[i] > work[i + 1]:
                    work[i], work[i + 1] = work[i + 1], work[i]
                    swapped = True
            if not swapped:
                break
            lines.append(self.fmt(work))
        answer = self.fmt(work)
        lines.append(format_final_answer(answer))
        return Sample(prompt, "\n".join(lines), answer, {"length": n, "passes": len(lines) - 1},
                      task=self.name)

    def reward(self, response: Any, answer: Any) -> float:
        # Whitespace inside or around the list carries no meaning: "[1, 2]" == "[1,2]".
        got = extract_final_answer(response)
        if got is None or not isinstance(answer, str):
            return 0.0
        return 1.0 if "".join(got.split()) == "".join(answer.split()) else 0.0

    reward.zero_if_truncated = True  # rewards.compute_rewards: a cut answer line


_TASKS: dict[str, TaskFamily] = {t.name: t for t in (ArithmeticTask(), BubbleSortTask())}


def list_tasks() -> list[str]:
    """Names of the built-in task families, sorted."""
    return sorted(_TASKS)


def get_task(name: str) -> TaskFamily:
    """The built-in task family called `name`; ConfigError listing the known ones."""
    try:
        return _TASKS[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown task {name!r}; known tasks: {', '.join(list_tasks())}") from None


def split_of(task: str, prompt: str) -> str:
    """'test' or 'train': the split a prompt belongs to, by a hash of its content."""
    digest = hashlib.sha256(f"{task}\0{prompt}".encode()).digest()
    return "test" if int.from_bytes(digest[:4], "big") % 1000 < TEST_FRACTION_PER_MILLE else "train"


def make_dataset(task_names: list[str] | tuple[str, ...] | str, n: int, seed: int,
                 split: str = "train") -> list[Sample]:
    """`n` samples cycling through `task_names`, deterministic given (`seed`, `split`).

    Sample i comes from its own RNG seeded by (seed, split, i), so a smaller n gives
    a prefix of a larger one. Prompts are confined to their split by content hash
    (see module docstring): train and test sets never share a prompt. Prompt ids
    are ``"{task}-{split}-s{seed}-{i}"``.
    """
    if isinstance(task_names, str):
        task_names = [task_names]
    families = [get_task(t) for t in task_names]
    if not families:
        raise ConfigError("make_dataset: task_names is empty; known tasks: " + ", ".join(list_tasks()))
    if split not in SPLITS:
        raise ConfigError(f"make_dataset: split {split!r} must be one of {SPLITS}")
    if not isinstance(n, int) or n < 0:
        raise ConfigError(f"make_dataset: n ({n!r}) must be a non-negative int")
    out = []
    for i in range(n):
        family = families[i % len(families)]
        rng = random.Random(f"megatron_tlt/{family.name}/{split}/{seed}/{i}")
        for _ in range(10_000):
            sample = family.generate(rng)
            if split_of(family.name, sample.prompt) == split:
                break
        else:  # pragma: no cover - would need a degenerate family
            raise RuntimeError(f"task {family.name}: no {split} prompt in 10000 draws")
        out.append(dataclasses.replace(sample, prompt_id=f"{family.name}-{split}-s{seed}-{i}",
                                       task=family.name))
    return out


def length_stats(lengths: list[int]) -> dict[str, float]:
    """median / p90 / p99 / max of a list of lengths (nearest-rank percentiles)."""
    xs = sorted(lengths)
    if not xs:
        raise ValueError("length_stats: empty list")

    def pct(p: float) -> float:
        return float(xs[min(len(xs) - 1, max(0, math.ceil(p / 100 * len(xs)) - 1))])

    return {"median": pct(50), "p90": pct(90), "p99": pct(99), "max": float(xs[-1]),
            "mean": sum(xs) / len(xs)}

