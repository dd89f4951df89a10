"""Rule-based rewards. Any function (prompt: str, response: str) -> float can be a reward.

The built-in rewards for question/answer tasks follow one convention:
`f(prompt, response, **fields) -> float | None`, where `fields` are the dataset row's other
columns (e.g. `answer="72"`) plus `completion_ids` (the response's token ids); the caller
passes only the keywords a function's signature names, or all of them to a `**kwargs`
function. `None` means "does not apply to this sample" (e.g. a gold answer that cannot be
read), which is not the same as a wrong answer (0.0).
"""

from __future__ import annotations

import importlib
import re
import threading
from decimal import Decimal
from typing import Callable, Sequence


def digit_fraction(prompt: str, response: str) -> float:
    """The quickstart's task, "answer with digits": the share of the response's characters
    that are digits (0.0 to 1.0). An empty response scores 0."""
    if not response:
        return 0.0
    return sum(ch.isdigit() for ch in response) / len(response)


def resolve_reward_function(spec: str | Callable) -> Callable[[str, str], float]:
    """A callable as is, or a "module:function" path (the one string reference allowed in a
    run file, since YAML cannot hold a function)."""
    if callable(spec):
        return spec
    module_name, _, attr = str(spec).partition(":")
    if not attr:
        raise ValueError(f"reward_function: {spec!r} should look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"reward_function: {spec!r}: cannot import {module_name} ({error}). "
                         f"Fix: check the module path, or install the package that provides it.") from None
    function = getattr(module, attr, None)
    if not callable(function):
        raise ValueError(f"reward_function: {spec!r}: {module_name} has no function {attr!r}")
    return function


def math_accuracy(prompt: str, response: str, *, answer: object, **_) -> float | None:
    """1.0 if math-verify finds the response equivalent to the gold `answer`, else 0.0; None
    when the gold answer itself cannot be parsed.

    Both sides go through `math_verify.parse` with its default extraction (LaTeX, including
    `\\boxed{}`, expressions and plain numbers), then `math_verify.verify(gold, predicted)`
    compares them symbolically: `\\boxed{\\frac{1}{2}}` matches a gold `0.5`.

    math-verify bounds its own parsing and comparison with SIGALRM, which only works in a
    process's main thread (elsewhere `signal` raises ValueError). Its timeouts are therefore
    kept only in the main thread and turned off in any other one (a Dask worker's task
    thread); there the caller must bound the call (pipeline.roles.bounded_calls does, and
    runs each call in its child's main thread, where these timeouts are on again).
    """
    from math_verify import parse, verify  # lazy: sympy takes a second to import

    seconds = _MATH_VERIFY_SECONDS if threading.current_thread() is threading.main_thread() else None
    gold = parse(str(answer), parsing_timeout=seconds)
    if not gold:
        return None
    predicted = parse(response, parsing_timeout=seconds)
    return 1.0 if verify(gold, predicted, timeout_seconds=seconds) else 0.0


_MATH_VERIFY_SECONDS = 5  # math-verify's own default, for parsing and for each comparison

# A number as GSM8K writes it: optional minus, digits with optional thousands commas
# ("1,000" but not "3,4", which reads as 3 and 4), optional decimals.
_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_AFTER_MARK = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")


def gsm8k_accuracy(prompt: str, response: str, *, answer: object, strict: bool = False, **_) -> float | None:
    """GSM8K final-answer match: 1.0 if the predicted number equals the gold one, else 0.0;
    None when the gold answer holds no number.

    Gold: the text after the last `####` of `answer`, with commas and `$` removed (GSM8K's
    answers end in a `#### 72` line), or `answer` itself when it is a plain number.
    Prediction, "flexible" rule (the default): the number after the response's last `####`
    if the response has one, else the last number anywhere in the response.
    `strict=True` requires the `####`: a response without one scores 0.0.
    Numbers compare as numbers: 72, 72.0 and 72.00 are equal; 1,000 is 1000.
    """
    gold = _gold_number(str(answer))
    if gold is None:
        return None
    predicted = _predicted_number(response, strict)
    return 1.0 if predicted is not None and predicted == gold else 0.0


def _gold_number(answer: str) -> Decimal | None:
    text = answer.rpartition("####")[2] if "####" in answer else answer
    return _as_number(text.replace(",", "").replace("$", "").strip())


def _predicted_number(response: str, strict: bool) -> Decimal | None:
    if "####" in response:
        found = _AFTER_MARK.match(response[response.rindex("####"):])
        return _as_number(found.group(1).replace(",", "")) if found else None
    if strict:
        return None
    numbers = re.findall(_NUMBER, response)
    return _as_number(numbers[-1].replace(",", "")) if numbers else None


def _as_number(text: str) -> Decimal | None:
    """Decimal, so that 0.1 + 0.2 style rounding never decides a match; None if not a number."""
    return Decimal(text) if re.fullmatch(r"-?(?:\d+(?:\.\d*)?|\.\d+)", text) else None


THINK_ANSWER_PATTERN = r"^<think>.*?</think>\s*<answer>.*?</answer>$"


def format_reward(prompt: str, response: str, *, pattern: str = THINK_ANSWER_PATTERN, **_) -> float:
    """1.0 if the whole response, stripped of surrounding whitespace, matches `pattern`
    (re.DOTALL, so `.` spans lines), else 0.0. The default asks for a reasoning block then an
    answer block and nothing else: `<think>...</think>` then `<answer>...</answer>`."""
    return 1.0 if re.fullmatch(pattern, response.strip(), re.DOTALL) else 0.0


def soft_overlong_penalty(prompt: str, response: str, *, completion_ids: Sequence[int],
                          max_response_tokens: int, buffer_tokens: int, **_) -> float:
    """DAPO's soft overlong punishment on the response's length L = len(completion_ids):
    0 if L <= max_response_tokens - buffer_tokens; (max - buffer - L) / buffer, falling
    linearly from 0 to -1, if max - buffer < L <= max; -1 if L > max.

    The two lengths are the run's, not the dataset's: bind them once, e.g.
    `functools.partial(soft_overlong_penalty, max_response_tokens=512, buffer_tokens=128)`,
    and weight this beside an accuracy reward.
    """
    if not 0 < buffer_tokens <= max_response_tokens:
        raise ValueError(f"soft_overlong_penalty: buffer_tokens={buffer_tokens} with max_response_tokens="
                         f"{max_response_tokens}. Fix: choose 0 < buffer_tokens <= max_response_tokens.")
    length = len(completion_ids)
    free = max_response_tokens - buffer_tokens
    if length <= free:
        return 0.0
    if length <= max_response_tokens:
        return (free - length) / buffer_tokens
    return -1.0
