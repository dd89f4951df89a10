"""The built-in rewards, on hand-written cases whose expected values are worked out by hand."""

from __future__ import annotations

import functools
import threading

import pytest

from pipeline.rewards import format_reward, gsm8k_accuracy, math_accuracy, soft_overlong_penalty

GSM8K_ANSWER = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")


# math_accuracy --------------------------------------------------------------------------------

@pytest.mark.parametrize("response, answer, expected", [
    (r"So the result is $\boxed{\frac{1}{2}}$.", "0.5", 1.0),           # LaTeX fraction vs decimal
    ("0.5", r"\frac{1}{2}", 1.0),                                         # and the other way round
    (r"$\boxed{1+x^2}$", "$x^2+1$", 1.0),                                 # symbolic equality
    ("The answer is 72", "72", 1.0),                                      # plain numbers
    (r"$\boxed{\frac{1}{3}}$", "0.5", 0.0),                               # wrong
    ("I do not know", "0.5", 0.0),                                        # nothing to read
    ("1000", "1,000", 1.0),                                               # thousands comma in the gold
])
def test_math_accuracy_hand_cases(response, answer, expected):
    assert math_accuracy("q", response, answer=answer) == expected


def test_math_accuracy_is_none_when_the_gold_cannot_be_parsed():
    assert math_accuracy("q", "42", answer="no number here") is None
    assert math_accuracy("q", "42", answer="") is None


def test_math_accuracy_takes_a_numeric_gold_and_ignores_other_fields():
    assert math_accuracy("q", r"\boxed{72}", answer=72, completion_ids=[1, 2, 3], source="gsm8k") == 1.0


def test_math_accuracy_works_outside_the_main_thread():
    # math-verify's SIGALRM timeouts would raise "signal only works in main thread" here.
    results = []
    worker = threading.Thread(target=lambda: results.append(
        [math_accuracy("q", r"$\boxed{\frac{1}{2}}$", answer="0.5"), math_accuracy("q", "3", answer="4")]))
    worker.start()
    worker.join()
    assert results == [[1.0, 0.0]]


# gsm8k_accuracy -------------------------------------------------------------------------------

@pytest.mark.parametrize("response, answer, expected", [
    ("She sold 72 clips in all.", GSM8K_ANSWER, 1.0),                     # flexible: the last number
    ("48 + 24 = 72\n#### 72", GSM8K_ANSWER, 1.0),                         # the #### line
    ("#### 72.00", GSM8K_ANSWER, 1.0),                                    # 72.00 is 72
    ("#### 72.5", GSM8K_ANSWER, 0.0),
    ("72 first, but #### 24", GSM8K_ANSWER, 0.0),                         # #### wins over the last number
    ("#### 72 and then 5", GSM8K_ANSWER, 1.0),                            # the number right after ####
    ("#### none", GSM8K_ANSWER, 0.0),                                     # #### without a number
    ("It costs $1,000.", "The total is 10*100 = 1000\n#### 1,000", 1.0),  # commas and $ on both sides
    ("#### $1,000", "#### 1000", 1.0),
    ("The total is 1,000 or 999", "#### 1,000", 0.0),                     # the last number is 999
    ("We get 3,4 as the pair", "4", 1.0),                                 # "3,4" is no thousands group
    ("the change is -5", "#### -5", 1.0),
    ("72", "72.0", 1.0),                                                  # a plain-number gold
    ("no digits at all", GSM8K_ANSWER, 0.0),
])
def test_gsm8k_accuracy_flexible(response, answer, expected):
    assert gsm8k_accuracy("q", response, answer=answer) == expected


@pytest.mark.parametrize("response, expected", [
    ("She sold 72 clips in all.", 0.0),     # no ####: strict gives nothing
    ("So: 48 + 24 = 72\n#### 72", 1.0),
    ("#### 7,2", 0.0),                      # reads as 7, not 72
])
def test_gsm8k_accuracy_strict_requires_the_mark(response, expected):
    assert gsm8k_accuracy("q", response, answer=GSM8K_ANSWER, strict=True) == expected


def test_gsm8k_accuracy_is_none_without_a_gold_number():
    assert gsm8k_accuracy("q", "72", answer="seventy-two") is None
    assert gsm8k_accuracy("q", "72", answer="work...\n#### ") is None


# format_reward --------------------------------------------------------------------------------

@pytest.mark.parametrize("response, expected", [
    ("<think>2+2 is 4</think><answer>4</answer>", 1.0),
    ("  <think>first line\nsecond line</think>\n\n<answer>4</answer>\n", 1.0),  # spans lines, stripped
    ("<answer>4</answer>", 0.0),                                                # no reasoning block
    ("<think>x</think><answer>4</answer> and more", 0.0),                       # trailing text
    ("Sure! <think>x</think><answer>4</answer>", 0.0),                          # leading text
    ("<answer>4</answer><think>x</think>", 0.0),                                # wrong order
])
def test_format_reward_default_pattern(response, expected):
    assert format_reward("q", response) == expected


def test_format_reward_custom_pattern_must_match_the_whole_response():
    assert format_reward("q", "Answer: 12", pattern=r"Answer: \d+") == 1.0
    assert format_reward("q", "Answer: 12 apples", pattern=r"Answer: \d+") == 0.0


# soft_overlong_penalty ------------------------------------------------------------------------

@pytest.mark.parametrize("length, expected", [
    (0, 0.0), (16, 0.0),          # up to max - buffer = 20 - 4 = 16: no penalty
    (17, -0.25),                  # (16 - 17) / 4
    (18, -0.5), (19, -0.75),
    (20, -1.0),                   # (16 - 20) / 4 at the limit itself
    (21, -1.0), (100, -1.0),      # past the limit
])
def test_soft_overlong_penalty_at_the_boundaries(length, expected):
    penalty = functools.partial(soft_overlong_penalty, max_response_tokens=20, buffer_tokens=4)
    assert penalty("q", "r", completion_ids=list(range(length))) == expected


def test_soft_overlong_penalty_whole_range_as_buffer():
    # buffer = max = 8: the penalty starts at the first token, -1/8 per token.
    assert soft_overlong_penalty("q", "r", completion_ids=[0] * 3, max_response_tokens=8, buffer_tokens=8) == -0.375


@pytest.mark.parametrize("max_tokens, buffer", [(20, 0), (20, 21), (20, -1)])
def test_soft_overlong_penalty_refuses_a_bad_buffer(max_tokens, buffer):
    with pytest.raises(ValueError, match="buffer_tokens.*Fix"):
        soft_overlong_penalty("q", "r", completion_ids=[1], max_response_tokens=max_tokens, buffer_tokens=buffer)
