"""Rewards: registry, dotted-path lookup, math-verify checks, threads, error wrapping."""

import sys
import threading
import types

import pytest

from megatron_tlt.data import rewards
from megatron_tlt.data.rewards import (compute_rewards, get_reward, last_boxed, list_rewards, math_reward,
                                       register_reward)
from megatron_tlt.data.tasks import list_tasks, make_dataset
from megatron_tlt.errors import ConfigError, TLTError

pytest.importorskip("math_verify")

MATH_CASES = [
    # (response, reference, expected reward)
    ("so the answer is \\boxed{1/2}", "1/2", 1.0),
    ("\\boxed{0.5}", "1/2", 1.0),
    ("\\boxed{\\frac{1}{2}}", "1/2", 1.0),
    ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{0.6}", "1/2", 0.0),
    ("\\boxed{2}", "1/2", 0.0),
    ("first \\boxed{3}, finally \\boxed{\\frac{1}{2}}", "1/2", 1.0),  # the LAST box counts
    ("first \\boxed{\\frac{1}{2}}, finally \\boxed{3}", "1/2", 0.0),
    ("\\boxed{\\frac{1}{2}", "1/2", 0.0),  # unclosed: no answer
    ("the answer is 1/2", "1/2", 0.0),  # no box
    ("\\boxed{42}", "42", 1.0),
    ("\\boxed{42}", "\\boxed{42}", 1.0),  # boxed reference
    ("\\boxed{x^2+1}", "1+x^2", 1.0),
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}", 1.0),
    ("\\boxed{}", "1/2", 0.0),
    # MATH writes amounts with an escaped dollar: not a math delimiter (these scored 0.0)
    ("\\boxed{18.90}", "\\$18.90", 1.0),
    ("\\boxed{\\$18.90}", "\\$18.90", 1.0),
    ("\\boxed{1000}", "\\$1,000", 1.0),
    ("\\boxed{19.90}", "\\$18.90", 0.0),
    ("\\boxed{18.90}", "$18.90$", 1.0),
]


@pytest.mark.parametrize("response,answer,expected", MATH_CASES)
def test_math_reward(response, answer, expected):
    assert math_reward(response, answer) == expected


@pytest.mark.parametrize("garbage", [None, 3, b"\\boxed{1}", "\\boxed{{{{", "\\boxed{\\frac{", "}" * 50,
                                     "\\boxed{" + "1" * 5000 + "}"])
def test_math_reward_robust_to_garbage(garbage):
    assert math_reward(garbage, "1/2") == 0.0
    assert math_reward("\\boxed{1}", garbage if not isinstance(garbage, str) else "") == 0.0


def test_last_boxed_nested_braces():
    assert last_boxed("\\boxed{a} \\boxed{\\frac{1}{\\sqrt{2}}} tail") == "\\frac{1}{\\sqrt{2}}"
    assert last_boxed("\\fbox{7}") == "7"
    assert last_boxed("\\boxed {7}") == "7"
    assert last_boxed("\\boxed{a}\\boxed{b") is None
    assert last_boxed("no box") is None


def test_math_reward_from_worker_threads():
    results = {}

    def work(k):
        results[k] = [math_reward(r, a) for r, a, _ in MATH_CASES]

    threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(results[k] == [e for _, _, e in MATH_CASES] for k in range(3))


def test_math_reward_worker_timeout(monkeypatch):
    monkeypatch.setattr(rewards, "MATH_TIMEOUT_S", 0.05)
    release = threading.Event()
    monkeypatch.setattr(rewards, "_math_check", lambda *a: release.wait(5) or 1.0)
    out = []
    t = threading.Thread(target=lambda: out.append(math_reward("\\boxed{1}", "1")))
    t.start()
    t.join()
    release.set()
    assert out == [0.0]


def test_builtin_rewards_registered():
    assert {"math", *list_tasks()} <= set(list_rewards())
    for name in list_tasks():
        s = make_dataset([name], 1, seed=0)[0]
        assert get_reward(name)(s.solution, s.answer) == 1.0


def test_unknown_reward_lists_known():
    with pytest.raises(ConfigError, match=r"unknown reward 'nope'; known rewards: .*arith.*math.*sort"):
        get_reward("nope")


def test_register_and_dotted_path(monkeypatch):
    mod = types.ModuleType("tlt_user_rewards")
    mod.length_reward = lambda response, answer: float(len(response) == len(answer))
    mod.NOT_CALLABLE = 3
    monkeypatch.setitem(sys.modules, "tlt_user_rewards", mod)
    assert get_reward("tlt_user_rewards:length_reward") is mod.length_reward
    assert get_reward("tlt_user_rewards.length_reward") is mod.length_reward
    with pytest.raises(ConfigError, match="has no attribute 'missing'"):
        get_reward("tlt_user_rewards:missing")
    with pytest.raises(ConfigError, match="int object is not callable"):
        get_reward("tlt_user_rewards:NOT_CALLABLE")
    with pytest.raises(ConfigError, match="cannot import module 'tlt_no_such_pkg.mod'"):
        get_reward("tlt_no_such_pkg.mod:fn")

    monkeypatch.setattr(rewards, "_REWARDS", dict(rewards._REWARDS))
    register_reward("always_one")(lambda r, a: 1.0)
    assert compute_rewards("always_one", ["x", "y"], ["1", "2"], ["p0", "p1"]) == [1.0, 1.0]
    with pytest.raises(ConfigError):
        register_reward("has.dot")


def test_compute_rewards_wraps_exceptions_with_prompt_id():
    def flaky(response, answer):
        if response == "boom":
            raise ValueError("cannot parse")
        return 1.0

    assert compute_rewards(flaky, ["a", "b"], ["1", "2"], ["p0", "p1"]) == [1.0, 1.0]
    with pytest.raises(TLTError) as err:
        compute_rewards(flaky, ["a", "boom"], ["1", "2"], ["p0", "p1"])
    assert str(err.value).startswith("reward function ")
    assert "flaky failed on prompt p1: ValueError('cannot parse')" in str(err.value)
    assert err.value.prompt_id == "p1" and isinstance(err.value.__cause__, ValueError)


def test_compute_rewards_rejects_non_numbers():
    with pytest.raises(TLTError, match=r"failed on prompt q: TypeError\(\"returned 'yes'"):
        compute_rewards(lambda r, a: "yes", ["a"], ["b"], ["q"])
    with pytest.raises(TLTError, match="failed on prompt q"):
        compute_rewards(lambda r, a: float("nan"), ["a"], ["b"], ["q"])
    with pytest.raises(ValueError, match="expected equal lengths"):
        compute_rewards("math", ["a"], [], ["q"])


def test_compute_rewards_math_by_name():
    out = compute_rewards("math", ["\\boxed{1/2}", "\\boxed{0.5}", "\\boxed{3}"], ["1/2"] * 3, ["a", "b", "c"])
    assert out == [1.0, 1.0, 0.0]


def test_compute_rewards_accepts_real_numbers():
    np = pytest.importorskip("numpy")
    assert compute_rewards(lambda r, a: np.float32(0.5), ["a"], ["b"], ["q"]) == [0.5]
    assert compute_rewards(lambda r, a: True, ["a"], ["b"], ["q"]) == [1.0]


def test_truncated_answer_line_scores_zero_for_answer_line_rewards():
    # "#### 5" cut from "#### 58" by the token limit scored as the answer 5.
    got = compute_rewards("arith", ["#### 5", "#### 5", "#### 58"], ["5", "5", "58"], ["a", "b", "c"],
                          truncated=[True, False, False])
    assert got == [0.0, 1.0, 1.0]
    assert compute_rewards("sort", ["#### [1,2]"], ["[1,2]"], ["a"], truncated=[True]) == [0.0]
    # math: a closed box is an answer even in a truncated response (an unclosed one is not)
    assert compute_rewards("math", ["\\boxed{5} and then", "\\boxed{5"], ["5", "5"], ["a", "b"],
                           truncated=[True, True]) == [1.0, 0.0]
    # user rewards keep their own rule unless they ask for it
    assert compute_rewards(lambda r, a: 1.0, ["x"], ["y"], ["a"], truncated=[True]) == [1.0]
    with pytest.raises(ValueError, match="1 truncated flags for 2 responses"):
        compute_rewards("arith", ["a", "b"], ["1", "2"], ["p", "q"], truncated=[True])


def test_sort_reward_ignores_whitespace_around_the_reference():
    for ref in ("[1,2,3]\n", "\t[1, 2, 3]", "[1,2,3]\r\n"):
        assert compute_rewards("sort", ["#### [1, 2, 3]"], [ref], ["a"]) == [1.0], repr(ref)
    assert compute_rewards("sort", ["#### [1, 3, 2]"], ["[1,2,3]\n"], ["a"]) == [0.0]
