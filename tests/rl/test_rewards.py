"""The rewards: the built-in answer and format checks, a user's function named by import path and
called on the batch with the prompts' columns, and one clear error for each wrong name."""

import sys

import pytest

from megatrain_ray.rl.rewards import RewardBatch, RewardError, Rewards, final_answer


def batch(completions, **columns):
    n = len(completions)
    return RewardBatch([f"p{i}" for i in range(n)], list(completions), [[i] for i in range(n)],
                       {k: list(v) for k, v in columns.items()})


def test_exact_answer_reads_the_final_answer_and_compares_numbers_as_numbers():
    completions = ["so <answer> 1,000 </answer>", "the sum is 12.0", "#### seven", "I think 3 then 4", "no idea"]
    assert final_answer(completions[0]) == "1,000" and final_answer(completions[3]) == "4"
    totals, each = Rewards({"exact_answer": 2.0})(batch(completions, answer=["1000", "12", "seven", "3", "42"]))
    assert each["exact_answer"] == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert totals == [2.0, 2.0, 2.0, 0.0, 0.0]
    # a worked solution as the answer column (GSM8K's): its marked final answer counts
    _, each = Rewards({"exact_answer": 1.0})(batch(["it is 72", "70"], answer=["48 + 24 = 72\n#### 72"] * 2))
    assert each["exact_answer"] == [1.0, 0.0]


def test_math_answer_uses_math_verify_for_equal_expressions():
    completions = [r"thus \boxed{\frac{1}{2}}", r"\boxed{0.5}", r"\boxed{\frac{1}{3}}"]
    _, each = Rewards({"math_answer": 1.0})(batch(completions, answer=["1/2", "1/2", "1/2"]))
    assert each["math_answer"] == [1.0, 1.0, 0.0]


def test_format_and_weights_add_up():
    rewards = Rewards({"format": 0.5, "exact_answer": 1.0}, format_pattern=r"(?s).*<answer>.+</answer>")
    totals, each = rewards(batch(["<answer>3</answer>", "3", "<answer>4</answer>"], answer=[3, 3, 3]))
    assert each["format"] == [1.0, 0.0, 1.0]
    assert totals == [1.5, 1.0, 0.5]


def test_a_users_function_gets_the_batch_and_the_columns(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def short(prompts, completions, completion_ids, target, **rest):\n"
        "    return [1.0 if len(c) <= t else None for c, t in zip(completions, target)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _, each = Rewards({"my_rewards:short": 1.0})(batch(["ab", "abcdef"], target=[3, 3]))
    assert each["my_rewards:short"] == [1.0, 0.0]  # None counts as 0
    sys.modules.pop("my_rewards", None)


@pytest.mark.parametrize("name,says", [
    ("correctness", "module:function"),
    ("no_such_module_xyz:fn", "cannot be imported"),
    ("json:no_such_function", "has no function 'no_such_function'"),
])
def test_a_wrong_reward_name_is_refused_saying_what_to_do(name, says):
    with pytest.raises(RewardError, match=says):
        Rewards({name: 1.0})


def test_a_missing_answer_column_and_a_wrong_count_are_refused(tmp_path, monkeypatch):
    with pytest.raises(RewardError, match="column 'answer'.*they have: solution"):
        Rewards({"exact_answer": 1.0})(batch(["1"], solution=["1"]))
    (tmp_path / "bad_rewards.py").write_text("def one(prompts, completions, **kw):\n    return [1.0]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match="returned 1 values for 2 completions"):
        Rewards({"bad_rewards:one": 1.0})(batch(["a", "b"]))
    sys.modules.pop("bad_rewards", None)


@pytest.mark.parametrize("grpo,says", [
    ({"eval": {"holdout_fraction": 0.1}}, "no validation loss"),
    ({"grpo": {"kl_coef": 0.1}}, "kl_coef > 0 needs model.path"),
    ({"train": {"micro_batch_size": 3}}, "multiple of train.micro_batch_size"),
    ({"grpo": {"max_new_tokens": 64}}, "max_new_tokens must be below data.seq_len"),
])
def test_a_grpo_config_that_cannot_work_is_refused(grpo, says):
    from megatrain_ray.config import ConfigError, config_from_dict
    from megatrain_ray.objective import objective_of

    raw = {"model": {"preset": "tiny-llama"}, "data": {"seq_len": 64}, "grpo": {"max_new_tokens": 16}}
    for section, values in grpo.items():
        raw[section] = {**raw.get(section, {}), **values}
    raw["train"] = {"objective": "grpo", **raw.get("train", {})}
    with pytest.raises(ConfigError, match=says):  # the objective's checks, before anything starts
        objective_of(config_from_dict(raw)).check()
