"""Synthetic tasks: determinism, reference solutions, rewards, long tail, splits."""

import random

import pytest

from megatron_tlt.data import tasks
from megatron_tlt.data.tasks import extract_final_answer, get_task, list_tasks, make_dataset
from megatron_tlt.data.tokenizer import load_tokenizer
from megatron_tlt.errors import ConfigError

FAMILIES = list_tasks()


def test_at_least_two_families():
    assert len(FAMILIES) >= 2 and {"arith", "sort"} <= set(FAMILIES)


def test_make_dataset_is_deterministic_and_seed_sensitive():
    a = make_dataset(FAMILIES, 200, seed=3)
    b = make_dataset(FAMILIES, 200, seed=3)
    c = make_dataset(FAMILIES, 200, seed=4)
    assert a == b
    # Negative control: another seed changes (nearly) every prompt.
    same = sum(x.prompt == y.prompt for x, y in zip(a, c))
    assert same < 20, f"{same}/200 prompts equal across seeds 3 and 4"
    # A smaller n is a prefix of a larger one (per-sample RNG streams).
    assert make_dataset(FAMILIES, 50, seed=3) == a[:50]


def test_generate_is_deterministic_given_rng():
    for name in FAMILIES:
        fam = get_task(name)
        assert fam.generate(random.Random(7)) == fam.generate(random.Random(7))


def test_prompt_ids_unique_and_stable():
    ds = make_dataset(FAMILIES, 300, seed=0, split="test")
    ids = [s.prompt_id for s in ds]
    assert len(set(ids)) == len(ids)
    assert ids[0] == f"{FAMILIES[0]}-test-s0-0"
    assert all(s.task in FAMILIES for s in ds)


@pytest.mark.parametrize("name", FAMILIES)
def test_reference_scores_one_and_corrupted_scores_zero(name):
    fam = get_task(name)
    ds = make_dataset([name], 300, seed=1)
    for s in ds:
        assert s.solution.endswith(f"#### {s.answer}")
        assert extract_final_answer(s.solution) == s.answer
        assert fam.reward(s.solution, s.answer) == 1.0, s.prompt_id
        # Corrupt the final answer: change one digit.
        i = max(i for i, c in enumerate(s.answer) if c.isdigit())
        bad_answer = s.answer[:i] + str((int(s.answer[i]) + 1) % 10) + s.answer[i + 1:]
        corrupted = s.solution[: -len(s.answer)] + bad_answer
        assert fam.reward(corrupted, s.answer) == 0.0, s.prompt_id
        # Wrong final line after a correct one: the LAST answer counts.
        assert fam.reward(s.solution + "\n#### " + bad_answer, s.answer) == 0.0
        assert fam.reward(s.solution[: -len(s.answer) - 5], s.answer) == 0.0  # no answer line


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("garbage", [None, 42, b"#### 1", "", "####", "#", "\x00\n####\n", ["#### 1"]])
def test_reward_robust_to_garbage(name, garbage):
    fam = get_task(name)
    assert fam.reward(garbage, "1") == 0.0
    assert fam.reward("#### 1", None) == 0.0


def test_arith_trace_is_correct():
    s = get_task("arith").generate(random.Random(0))
    value = int(s.prompt.split(": ")[1].split("+")[0].split("-")[0].split("*")[0])
    for line in s.solution.splitlines()[:-1]:
        lhs, rhs = line.split("=")
        assert int(eval(lhs)) % 100 == int(rhs)  # noqa: S307 - digits and + - * only
        assert lhs.startswith(str(value))
        value = int(rhs)
    assert str(value) == s.answer


def test_sort_answer_is_sorted():
    for s in make_dataset(["sort"], 100, seed=0):
        given = [int(x) for x in s.prompt.split("[")[1].rstrip("]\n").split(",")]
        assert s.answer == "[" + ",".join(map(str, sorted(given))) + "]"
        assert len(s.solution.splitlines()) - 1 == s.meta["passes"] <= max(0, len(given) - 1)


def test_length_distribution_is_heavy_tailed():
    tok = load_tokenizer("tiny")
    ds = make_dataset(FAMILIES, 1000, seed=0)
    lengths = [len(tok.encode(s.solution)) + 1 for s in ds]  # + <eos>
    st = tasks.length_stats(lengths)
    msg = f"response token stats {st}"
    assert st["p99"] >= 10 * st["median"], msg
    assert 10 <= st["median"] <= 100, msg
    assert st["max"] <= 1500, msg
    assert max(len(tok.encode_prompt(s.prompt)) for s in ds) <= 400, msg


def test_train_and_test_are_disjoint():
    train = make_dataset(FAMILIES, 2000, seed=0, split="train")
    test = make_dataset(FAMILIES, 500, seed=0, split="test")
    test_other_seed = make_dataset(FAMILIES, 500, seed=1, split="test")
    train_prompts = {s.prompt for s in train}
    assert not train_prompts & {s.prompt for s in test + test_other_seed}
    assert all(tasks.split_of(s.task, s.prompt) == "test" for s in test)
    # Negative control: without the content split, short prompts do collide.
    raw = {get_task("sort").generate(random.Random(i)).prompt for i in range(3000)}
    assert raw & train_prompts


def test_bad_arguments():
    with pytest.raises(ConfigError, match=r"unknown task 'nope'; known tasks: arith, sort"):
        make_dataset(["arith", "nope"], 5, seed=0)
    with pytest.raises(ConfigError, match="split 'val'"):
        make_dataset(["arith"], 5, seed=0, split="val")
    with pytest.raises(ConfigError, match="task_names is empty"):
        make_dataset([], 5, seed=0)
