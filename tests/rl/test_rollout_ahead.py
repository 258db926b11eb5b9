"""A rollout one policy version behind (grpo.rollout_gpu=own; rl/step.py, GrpoStep.ahead), in one
process: while a step trains, the rollout samples the next step's prompts from the weights before
the update, and the next step takes the rollout's log-probabilities as the old policy's."""

import numpy as np
import torch

from megatrain_ray.config import config_from_dict
from megatrain_ray.models.registry import PRESETS
from megatrain_ray.rl.batch import policy_micro_batches
from megatrain_ray.rl.prompts import Prompt
from megatrain_ray.rl.rewards import Rewards
from megatrain_ray.rl.rollout import CopyTiming, Rollout
from megatrain_ray.rl.step import GrpoStep, Sampled
from megatrain_ray.runtime.local import LocalTrainer
from helpers.grpo import TokenIds
from helpers.threads import one_thread  # noqa: F401 (a fixture)


class Recorded:
    """The trainer, each step's micro-batches kept with its policy's log-probabilities before the update."""

    def __init__(self, trainer):
        self.trainer, self.steps = trainer, []

    def rollout_weights(self):
        return self.trainer.rollout_weights()

    def train_step(self, micro_batches):
        self.steps.append((micro_batches, self.trainer.token_logprobs(micro_batches)))
        return self.trainer.train_step(micro_batches)


def test_the_rollout_samples_the_next_step_from_the_weights_before_the_update(one_thread):
    config = config_from_dict({
        "model": {"preset": "tiny-llama", "compute_dtype": "float32", "init_std": 0.05},
        "train": {"objective": "grpo", "micro_batch_size": 8},
        "optim": {"lr": 1e-2, "weight_decay": 0.0},
        "data": {"seq_len": 16},
        "grpo": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 6, "rollout_gpu": "own",
                 "rewards": {"helpers.grpo:low_tokens": 1.0}},
        "executor": {"device": "cpu"},
    })
    arch = PRESETS["tiny-llama"]
    gen = np.random.default_rng(0)
    a, b, c = ([Prompt(gen.integers(0, arch.vocab_size, 5), "", {}) for _ in range(2)] for _ in range(3))
    trainer = LocalTrainer(config, arch)
    try:
        before = [(i, w.clone()) for i, w in trainer.rollout_weights()]
        policy = Recorded(trainer)
        step = GrpoStep(config.grpo, 8, Rollout(arch, torch.float32, torch.device("cpu"), seed=0), Rewards(config.grpo.rewards),
                        TokenIds())
        _, _, pending = step.ahead(policy, None, a, b)  # trains on a (sampled now), samples b meanwhile
        _, metrics, _ = step.ahead(policy, pending, None, c)  # trains on b
    finally:
        trainer.close()
    # b came from the weights before the first update: a copy of them replays its draws and scores
    replay = Rollout(arch, torch.float32, torch.device("cpu"), seed=0)
    replay.load(before)
    replay.sample_scored([p.ids for p in a], 4, step.sampling())
    completions, logprobs, _ = replay.sample_scored([p.ids for p in b], 4, step.sampling())
    assert all(np.array_equal(x, y) for x, y in zip(completions, pending.completions, strict=True))
    assert all(np.array_equal(x, y) for x, y in zip(logprobs, pending.logprobs, strict=True))
    # the second step's old policy is the rollout's (the weights before the first update), not the current one
    mbs, current = policy.steps[1]
    assert [mb["input_ids"].tolist() for mb in mbs] == [mb["input_ids"].tolist() for mb in policy_micro_batches(
        [p.ids for p in b for _ in range(4)], pending.completions, [0.0] * 8, "sequence", 6, 8)]
    scored_before = replay.policy_logprobs(mbs)
    for mb, old, then, now in zip(mbs, (mb["old_logprobs"] for mb in mbs), scored_before, current, strict=True):
        at = mb["labels"] >= 0
        assert np.abs(old[at] - then[at]).max() < 1e-5  # decoding's incremental forward against a whole one
        assert np.abs(old[at] - now[at]).max() > 1e-3  # the first update moved the policy
        assert (old[~at] == 0).all()
    assert metrics["rollout_tokens_per_s"] > 0


def test_the_next_steps_completions_survive_a_checkpoint():
    sampled = Sampled([Prompt(np.array([1, 2]), "", {})], [np.array([5, 6, 7])], [np.array([-0.1, -2.5, -1e-7], np.float32)],
                      [CopyTiming(10.0, 11.5, 3, 0.5, 2, 1.2)], 0.25)
    again = Sampled.from_dict(sampled.prompts, sampled.to_dict())
    assert np.array_equal(again.completions[0], sampled.completions[0]) and again.completions[0].dtype == np.int64
    assert np.array_equal(again.logprobs[0], sampled.logprobs[0]) and again.logprobs[0].dtype == np.float32
    assert (again.seconds, again.refresh_seconds, again.copies) == (1.5, 0.25, sampled.copies)
    older = {k: v for k, v in sampled.to_dict().items() if k != "copies"} | {"seconds": 1.5}  # before copies were timed
    assert Sampled.from_dict(sampled.prompts, older).seconds == 1.5
