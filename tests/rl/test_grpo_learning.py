"""A tiny random model learns a task by GRPO that it can only learn from its rewards: the reward is
the fraction of its sampled tokens below 32 (an eighth of the vocabulary, 0.125 at the start).
Within 20 steps the mean reward rises past 0.5; the same steps without the update (a control:
the same rollouts, rewards and loss, the gradients computed and dropped) stay where they started.
In one process (the streaming executor, its stores, the rollout's copy): 0.03 s a step."""

import numpy as np
import torch

from megatrain_ray.config import config_from_dict
from megatrain_ray.models.registry import PRESETS
from megatrain_ray.rl.prompts import Prompt
from megatrain_ray.rl.rewards import Rewards
from megatrain_ray.rl.rollout import Rollout
from megatrain_ray.rl.step import GrpoStep
from megatrain_ray.runtime.local import LocalTrainer
from helpers.grpo import TokenIds
from helpers.threads import one_thread  # noqa: F401 (a fixture)

STEPS = 20


class WithoutUpdate:
    """The trainer, its step's gradients computed and never applied."""

    def __init__(self, trainer):
        self.trainer = trainer

    def rollout_weights(self):
        return self.trainer.rollout_weights()

    def token_logprobs(self, micro_batches):
        return self.trainer.token_logprobs(micro_batches)

    def train_step(self, micro_batches):
        return self.trainer.executor.train_step(micro_batches, None)


def mean_rewards(update: bool) -> list[float]:
    config = config_from_dict({
        "model": {"preset": "tiny-llama", "compute_dtype": "float32", "init_std": 0.05},
        "train": {"objective": "grpo", "micro_batch_size": 16, "seed": 3, "steps": STEPS},
        "optim": {"lr": 1e-2, "weight_decay": 0.0, "min_lr_ratio": 1.0},
        "data": {"seq_len": 16},
        "grpo": {"group_size": 8, "prompts_per_step": 4, "max_new_tokens": 8,
                 "rewards": {"helpers.grpo:low_tokens": 1.0}},
        "executor": {"device": "cpu"},
    })
    arch = PRESETS["tiny-llama"]
    trainer = LocalTrainer(config, arch)
    rollout = Rollout(arch, torch.float32, torch.device("cpu"), seed=0)
    step = GrpoStep(config.grpo, 16, rollout, Rewards(config.grpo.rewards), TokenIds())
    gen = np.random.default_rng(0)
    prompts = [Prompt(gen.integers(0, arch.vocab_size, 6), "", {}) for _ in range(16)]
    policy = trainer if update else WithoutUpdate(trainer)
    try:
        return [step(policy, prompts[4 * (k % 4):4 * (k % 4) + 4])[1]["reward_mean"] for k in range(STEPS)]
    finally:
        trainer.close()


def test_a_tiny_model_learns_from_its_rewards_and_not_without_the_update(one_thread):
    learned, control = mean_rewards(update=True), mean_rewards(update=False)
    assert np.mean(learned[:2]) < 0.2 and np.mean(control[:2]) < 0.2
    assert np.mean(learned[-3:]) > 0.5, learned
    assert np.mean(control[-3:]) < 0.2, control
