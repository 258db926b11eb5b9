"""The rewards of a step's completions: built-in checks of an answer and of a format, and the
user's own functions named by import path. A reward function takes the batch, as TRL's do:

    def reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]], **columns) -> list[float]

`columns` holds every other column of the prompts' rows, one value per completion (the row of its
prompt): a reference answer, test cases, anything the check needs. It returns one number per
completion (None counts as 0). The step's reward is the weighted sum of the configured rewards
(grpo.rewards: name -> weight).
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable

from megatrain_ray.config import ConfigError

RewardFn = Callable[..., list]
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
ANSWER_TAG = re.compile(r"(?s)<answer>(.*?)</answer>")


class RewardError(ConfigError):
    """A reward that cannot be used as configured; the message says what to change (the CLI: a
    configuration error, exit 2)."""


def final_answer(text: str) -> str:
    """What a completion answers: inside its last <answer>...</answer> or \\boxed{...}, else after
    its last '####', else its last number, else the text itself; stripped."""
    for pattern in (ANSWER_TAG, BOXED):
        found = pattern.findall(text)
        if found:
            return found[-1].strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    numbers = NUMBER.findall(text)
    return numbers[-1].strip() if numbers else text.strip()


def same_answer(given: str, expected: Any) -> bool:
    """Equal as numbers where both read as one (1,000 = 1000.0), else as stripped text."""
    given, expected = str(given).strip(), str(expected).strip()
    try:
        return float(given.replace(",", "")) == float(expected.replace(",", ""))
    except ValueError:
        return given == expected


def column(columns: dict[str, list], name: str, reward: str) -> list:
    if name not in columns:
        raise RewardError(f"the {reward} reward compares with the prompts' column {name!r} (grpo.answer_column), "
                          f"which the rows do not have (they have: {', '.join(sorted(columns)) or 'no other column'})")
    return columns[name]


def reference_answer(value: Any) -> str:
    """The row's answer: a worked solution's final answer where it marks one (GSM8K's '#### 72',
    MATH's \\boxed{...}, <answer>...</answer>), else the value itself."""
    text = str(value)
    marked = "####" in text or BOXED.search(text) or ANSWER_TAG.search(text)
    return final_answer(text) if marked else text


def exact_answer(completions: list[str], columns: dict[str, list], answer_column: str) -> list[float]:
    """1 where the completion's final answer equals the row's answer (numbers as numbers), else 0."""
    answers = column(columns, answer_column, "exact_answer")
    return [float(same_answer(final_answer(c), reference_answer(a))) for c, a in zip(completions, answers)]


def math_answer(completions: list[str], columns: dict[str, list], answer_column: str) -> list[float]:
    """1 where math-verify finds the completion's answer equal to the row's (LaTeX, fractions,
    sets, units of equality that plain text misses), else 0."""
    try:
        from math_verify import parse, verify
    except ImportError:
        raise RewardError("the math_answer reward needs math-verify: pip install 'math-verify'") from None
    answers = column(columns, answer_column, "math_answer")
    out = []
    for c, a in zip(completions, answers):
        gold = parse(str(a) if "$" in str(a) or "\\" in str(a) else f"${a}$")
        out.append(float(bool(gold) and verify(gold, parse(c))))
    return out


def format_match(completions: list[str], pattern: str) -> list[float]:
    """1 where the whole completion matches the regex (grpo.format_pattern), else 0."""
    compiled = re.compile(pattern)
    return [float(compiled.fullmatch(c) is not None) for c in completions]


def import_reward(path: str) -> RewardFn:
    """The function `module:function` names, imported as Python would (the module on sys.path or in
    the working directory); a RewardError saying what is wrong otherwise."""
    module_name, _, name = path.partition(":")
    if not module_name or not name:
        raise RewardError(f"grpo.rewards names {path!r}: a reward is exact_answer, math_answer, format or the "
                          f"import path of your own function, module:function (e.g. my_rewards:correct)")
    if os.getcwd() not in sys.path and "" not in sys.path:  # a console script's path lacks the directory it runs in
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise RewardError(f"grpo.rewards names {path!r}, but the module {module_name!r} cannot be imported ({e}). "
                          f"Put its file in the directory you start the run from or on PYTHONPATH (the run's "
                          f"Ray workers need not see it: rewards are computed by the driver)") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(n for n in vars(module) if callable(getattr(module, n)) and not n.startswith("_"))
        raise RewardError(f"grpo.rewards names {path!r}, but {module_name} has no function {name!r} "
                          f"(its functions: {', '.join(found) or 'none'})")
    return fn


@dataclass(frozen=True)
class RewardBatch:
    """What every reward sees of one step's completions, one entry per completion."""

    prompts: list[str]
    completions: list[str]
    completion_ids: list[list[int]]
    columns: dict[str, list]  # the prompts' other columns, repeated for each completion of a prompt


class Rewards:
    """grpo.rewards: each named reward with its weight; `__call__` gives each completion's total
    and each reward's own values (for the metrics)."""

    BUILT_IN = ("exact_answer", "math_answer", "format")

    def __init__(self, weights: dict[str, float], answer_column: str = "answer", format_pattern: str = ""):
        self.weights = dict(weights)
        self.answer_column, self.format_pattern = answer_column, format_pattern
        self.user = {name: import_reward(name) for name in weights if name not in self.BUILT_IN}
        if "format" in weights:
            try:
                re.compile(format_pattern)
            except re.error as e:
                raise RewardError(f"grpo.format_pattern {format_pattern!r} is not a regular expression: {e}") from None
        if "math_answer" in weights:
            try:
                import math_verify  # noqa: F401
            except ImportError:
                raise RewardError("the math_answer reward needs math-verify: pip install 'math-verify'") from None

    def one(self, name: str, batch: RewardBatch) -> list[float]:
        if name == "exact_answer":
            return exact_answer(batch.completions, batch.columns, self.answer_column)
        if name == "math_answer":
            return math_answer(batch.completions, batch.columns, self.answer_column)
        if name == "format":
            return format_match(batch.completions, self.format_pattern)
        values = self.user[name](prompts=batch.prompts, completions=batch.completions,
                                 completion_ids=batch.completion_ids, **batch.columns)
        if values is None or len(values) != len(batch.completions):
            raise RewardError(f"the reward {name} returned {'nothing' if values is None else f'{len(values)} values'} "
                              f"for {len(batch.completions)} completions: it must return one number per completion")
        return [0.0 if v is None else float(v) for v in values]

    def __call__(self, batch: RewardBatch) -> tuple[list[float], dict[str, list[float]]]:
        each = {name: self.one(name, batch) for name in self.weights}
        totals = [sum(self.weights[name] * each[name][i] for name in each) for i in range(len(batch.completions))]
        return totals, each
