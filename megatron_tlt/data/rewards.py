"""Reward functions (verifiers): a registry, built-ins, and safe batch scoring.

A reward function is ``fn(response: str, answer: str) -> float``. Built-ins:

* one per synthetic task family (``arith``, ``sort``): 1.0 for the exact final
  ``#### answer``, else 0.0;
* ``math``: the LAST ``\\boxed{...}`` of the response (nested braces handled),
  checked against the reference with the math-verify library, so ``\\boxed{0.5}``
  and ``\\boxed{\\frac{1}{2}}`` both match ``1/2``.

A reward function with the attribute ``zero_if_truncated = True`` (the ``####`` ones:
a response cut off by the token limit inside its answer line, "#### 5" of "#### 58",
would otherwise be scored as that answer) scores 0.0 for responses that stopped at
``max_new_tokens``: `compute_rewards(..., truncated=...)`, as the RL loop and
``evaluate`` call it. ``math`` needs no flag: an unclosed box is no answer.

`get_reward` also accepts a user function by dotted path, ``mypkg.mymod:fn`` or
``mypkg.mymod.fn``, imported at lookup. `compute_rewards` scores a batch and turns
any exception into a TLTError naming the reward and the prompt id.

Timeouts: math-verify bounds its sympy work with ``signal.alarm``, which only works
in the main thread. `math_reward` uses that in the main thread; from any other
thread it runs the check in a daemon helper thread and gives up (reward 0.0) after
`MATH_TIMEOUT_S`. A thread cannot be killed, so a pathological input may keep one
CPU core busy in the background until sympy returns; inputs are capped at
`MATH_MAX_CHARS` to make that rare.
"""

from __future__ import annotations

import functools
import importlib
import logging
import math
import numbers
import re
import threading
from typing import Any, Callable, Sequence

from megatron_tlt.data import tasks
from megatron_tlt.errors import ConfigError, TLTError

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, str], float]

MATH_TIMEOUT_S = 5
"""Seconds math-verify may spend on one parse or comparison."""
MATH_MAX_CHARS = 1000
"""Boxed answers (and references) longer than this score 0.0 without parsing."""

_REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: ``@register_reward("mine")`` makes `get_reward("mine")` return fn."""
    if not isinstance(name, str) or not name or ":" in name or "." in name:
        raise ConfigError(f"reward name {name!r} must be a non-empty string without '.' or ':'")

    def deco(fn: RewardFn) -> RewardFn:
        if not callable(fn):
            raise ConfigError(f"register_reward({name!r}): {fn!r} is not callable")
        _REWARDS[name] = fn
        return fn

    return deco


def list_rewards() -> list[str]:
    """Names of the registered rewards, sorted."""
    return sorted(_REWARDS)


def _import_dotted(spec: str) -> Any:
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
    else:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"reward {spec!r}: expected 'package.module:function' or "
                          f"'package.module.function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigError(f"reward {spec!r}: cannot import module {module_name!r}: {exc!r}; "
                          f"known rewards: {', '.join(list_rewards())}") from None
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"reward {spec!r}: module {module_name!r} has no attribute "
                              f"{attr!r}") from None
    return obj


def get_reward(name: str | RewardFn) -> RewardFn:
    """A registered reward by name, or a user function by dotted path.

    A callable is returned as is. Unknown names raise ConfigError listing the
    registered rewards.
    """
    if callable(name):
        return name
    if not isinstance(name, str) or not name:
        raise ConfigError(f"reward {name!r}: expected a reward name or 'module:function'; "
                          f"known rewards: {', '.join(list_rewards())}")
    if name in _REWARDS:
        return _REWARDS[name]
    if ":" not in name and "." not in name:
        raise ConfigError(f"unknown reward {name!r}; known rewards: {', '.join(list_rewards())} "
                          "(or give a dotted path 'package.module:function')")
    fn = _import_dotted(name)
    if not callable(fn):
        raise ConfigError(f"reward {name!r}: {type(fn).__name__} object is not callable")
    return fn


def reward_name(fn: Any) -> str:
    """The registered name of `fn`, else its qualified name."""
    for key, value in _REWARDS.items():
        if value is fn or value == fn:
            return key
    mod, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    return f"{mod}.{qual}" if mod and qual else repr(fn)


def compute_rewards(fn: str | RewardFn, responses: Sequence[str], answers: Sequence[str],
                    prompt_ids: Sequence[str], truncated: Sequence[bool] | None = None) -> list[float]:
    """Score each (response, answer); float results, one per response. `truncated`: which
    responses stopped at the token limit; those score 0.0 when `fn` is zero_if_truncated.

    Any exception raised by `fn`, or a result that is not a finite number, becomes
    ``TLTError("reward function {name} failed on prompt {pid}: {exc!r}")`` with
    ``.prompt_id`` set; the original exception is its ``__cause__``.
    """
    fn = get_reward(fn)
    name = reward_name(fn)
    if not len(responses) == len(answers) == len(prompt_ids):
        raise ValueError(f"compute_rewards: {len(responses)} responses, {len(answers)} answers, "
                         f"{len(prompt_ids)} prompt ids; expected equal lengths")
    if truncated is not None and len(truncated) != len(responses):
        raise ValueError(f"compute_rewards: {len(truncated)} truncated flags for {len(responses)} responses")
    cut = list(truncated) if truncated is not None and getattr(fn, "zero_if_truncated", False) else None
    out = []
    for i, (response, answer, pid) in enumerate(zip(responses, answers, prompt_ids)):
        if cut is not None and cut[i]:
            out.append(0.0)
            continue
        try:
            value = fn(response, answer)
            if not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise TypeError(f"returned {value!r}; expected a finite real number")
        except Exception as exc:
            err = TLTError(f"reward function {name} failed on prompt {pid}: {exc!r}")
            err.prompt_id = pid  # type: ignore[attr-defined]
            raise err from exc
        out.append(float(value))
    return out


# ---------------------------------------------------------------- math (boxed)

_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: Any) -> str | None:
    """Content of the LAST ``\\boxed{...}`` (or ``\\fbox{...}``) in `text`, nested
    braces matched; None if there is none or the last one is unclosed (a response
    cut off inside its answer has no answer)."""
    if not isinstance(text, str):
        return None
    opens = list(_BOX_OPEN.finditer(text))
    if not opens:
        return None
    start = opens[-1].end()  # just past the opening brace
    depth = 1
    for j in range(start, len(text)):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start:j]
    return None


class _DropTimeoutDisabledWarning(logging.Filter):
    # Off the main thread we disable math-verify's signal timeouts on purpose and
    # enforce our own (see module docstring); its warning about that is noise.
    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _logger_name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_logger_name).addFilter(_DropTimeoutDisabledWarning())


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str, timeout: int | None) -> Any:
    from math_verify import parse

    inner = last_boxed(answer)
    text = f"\\boxed{{{inner}}}" if inner is not None else answer
    # Math mode unless the text has its own: an unescaped $ or a box (an escaped \$, as
    # MATH writes amounts, is a dollar sign inside math, not a delimiter).
    delimited = re.search(r"(?<!\\)\$", text) is not None or "\\boxed" in text
    parsed = parse(text if delimited else f"${text}$", parsing_timeout=timeout)
    return parsed or parse(answer, parsing_timeout=timeout) or parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout)


def _math_check(boxed: str, answer: str, timeout: int | None) -> float:
    from math_verify import parse, verify

    gold = _parse_gold(answer, timeout)
    pred = parse(f"\\boxed{{{boxed}}}", parsing_timeout=timeout)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=timeout) else 0.0


def math_reward(response: Any, answer: Any) -> float:
    """1.0 iff the last ``\\boxed{...}`` of `response` equals `answer` per
    math-verify; 0.0 on no box, parse failure, timeout or garbage. Thread-safe."""
    boxed = last_boxed(response)
    if boxed is None or not isinstance(answer, str) or not answer.strip():
        return 0.0
    if len(boxed) > MATH_MAX_CHARS or len(answer) > MATH_MAX_CHARS:
        return 0.0
    if threading.current_thread() is threading.main_thread():
        try:  # math-verify's own signal.alarm timeouts
            return _math_check(boxed, answer, MATH_TIMEOUT_S)
        except Exception:
            return 0.0
    result: list[float] = []

    def run() -> None:
        try:
            result.append(_math_check(boxed, answer, None))
        except Exception:
            result.append(0.0)

    worker = threading.Thread(target=run, name="math-verify", daemon=True)
    worker.start()
    worker.join(MATH_TIMEOUT_S)
    if not result:
        logger.warning("math reward: verification timed out after %ss; scoring 0.0", MATH_TIMEOUT_S)
        return 0.0
    return result[0]


register_reward("math")(math_reward)
for _name in tasks.list_tasks():
    register_reward(_name)(tasks.get_task(_name).reward)
