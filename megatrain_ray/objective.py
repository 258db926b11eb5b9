"""What a run trains for (train.objective), resolved once from the config: language modelling (the
next token of data.source) or GRPO (rewards on completions the run samples from data.source's
prompts). An `Objective` holds everything that differs between them: its checks, how many
micro-batches a step takes and the LR schedule's length, the loss the head computes (handed to the
executor through the step plan), the GPU memory its rollout reserves, the data it reads before the
cluster starts and the steps the training loop takes. Every other module asks it; none compares
train.objective itself (tests/entry/test_structure.py). It decides nothing about the device: the
step plan (planning/step_plan.py) does, from what the objective says it needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatrain_ray.config import Config, ConfigError, GrpoConfig, check_divisible
from megatrain_ray.host.memory import dtype_of, element_size
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.rl.loss import PolicyLoss, TokenLoss
from megatrain_ray.rl.rollout import rollout_bytes


class Objective:
    """The language-modelling objective; `Grpo` extends it. Built by `objective_of` alone."""

    samples = False  # a rollout samples completions (runtime/actors.py, RolloutActor)

    def __init__(self, config: Config):
        self.config = config

    def problems(self) -> list[str]:
        """What in the config cannot work for this objective (`check`)."""
        return []

    def check(self) -> "Objective":
        """Itself, where a run of it can work; else a ConfigError with every problem in one message
        (a run and `plan` check before Ray starts)."""
        problems = self.problems()
        if problems:
            raise ConfigError("; ".join(problems))
        if self.config.runtime.num_gpus is not None:
            check_divisible(self.micro_batches, self.config.runtime.num_gpus)
        return self

    @property
    def micro_batches(self) -> int:
        """A step's micro-batches, over every GPU worker."""
        return self.config.train.grad_accum

    @property
    def schedule_steps(self) -> int:
        """The LR schedule's length: optim.schedule_steps, else one step of it per update."""
        return self.config.optim.schedule_steps or self.config.train.steps

    @property
    def head_loss(self) -> TokenLoss | PolicyLoss:
        return TokenLoss()

    def rollout_gpus(self, use_cuda: bool) -> int:
        """The GPUs the rollout holds of its own (none where nothing samples)."""
        return 0

    def samples_on(self, kind: str) -> bool:
        """Whether a rollout samples on the workers' node's GPUs, a device of `kind` ("cuda" or "cpu")."""
        return False

    def read_data(self, arch: ModelArch) -> tuple[dict | None, tuple]:
        """The data, checked before the cluster starts (a DataError there): its counts for
        metrics.jsonl (data/summary.py) and (the steps' data, the validation micro-batches or None)."""
        from megatrain_ray.data import build_datasets
        from megatrain_ray.data.summary import summarize_data

        c, t = self.config, self.config.train
        counted = summarize_data(c.data, c.eval, arch.vocab_size, t.seed)
        train, held_out = build_datasets(c.data, c.eval, arch.vocab_size, t.seed)
        fixed = held_out.fixed_batches(t.micro_batch_size, c.eval.batches) if held_out is not None else None
        return counted, (train, fixed)

    def steps(self, session, data, meta: dict | None, bad_rows):
        """The training loop's steps: each call (with the step's number) trains one step and
        returns its result, the data position after it and further metrics (None here)."""
        from megatrain_ray.data import DataPosition

        t = self.config.train
        saved = meta.get("data_position") if meta else None
        batches = data.batches(t.micro_batch_size, t.grad_accum, DataPosition.from_dict(saved) if saved else None,
                               bad_rows)

        def step_on(step: int):
            micro_batches, upcoming = next(batches)
            return session.train_step(micro_batches, f"step {step}"), upcoming, None
        return step_on


class Grpo(Objective):
    """GRPO: a step's micro-batches are its completions (grpo.prompts_per_step x grpo.group_size)
    in rows of train.micro_batch_size, whatever train.grad_accum says; with several updates per
    rollout the LR schedule spans every update (unless optim.schedule_steps says otherwise)."""

    samples = True

    def problems(self) -> list[str]:
        c, t, g = self.config, self.config.train, self.config.grpo
        checks = [
            (g.max_new_tokens < c.data.seq_len,
             "grpo.max_new_tokens must be below data.seq_len (a row holds the prompt and its completion)"),
            (c.eval.source is None and c.eval.holdout_fraction == 0,
             "train.objective=grpo has no validation loss: unset eval.source and eval.holdout_fraction (the rewards "
             "in metrics.jsonl tell how it goes)"),
            (g.kl_coef == 0 or c.model.path is not None,
             "grpo.kl_coef > 0 needs model.path: the reference policy is the model it names (or set grpo.kl_coef=0)"),
            (self.completions % t.micro_batch_size == 0,
             f"grpo.prompts_per_step x grpo.group_size ({self.completions} completions a step) must be a multiple "
             f"of train.micro_batch_size ({t.micro_batch_size}): the step's rows fill its micro-batches"),
        ]
        return [message for ok, message in checks if not ok]

    @property
    def completions(self) -> int:
        return self.config.grpo.prompts_per_step * self.config.grpo.group_size

    @property
    def micro_batches(self) -> int:
        return max(1, self.completions // self.config.train.micro_batch_size)

    @property
    def schedule_steps(self) -> int:
        return self.config.optim.schedule_steps or self.config.train.steps * self.config.grpo.updates_per_rollout

    @property
    def head_loss(self) -> PolicyLoss:
        g = self.config.grpo
        return PolicyLoss(g.clip_low, g.clip_high, g.kl_coef)

    def rollout_gpus(self, use_cuda: bool) -> int:
        g = self.config.grpo
        return (g.rollout_gpus or 1) if use_cuda and g.rollout_gpu == "own" else 0

    def rows_per_copy(self, copies: int) -> int:
        """The completions the busiest of `copies` rollout copies samples (rl/rollout.py, prompt_parts)."""
        g = self.config.grpo
        return -(-g.prompts_per_step // copies) * g.group_size

    def samples_on(self, kind: str) -> bool:
        return kind == "cuda" and self.config.grpo.rollout_device != "cpu"

    @property
    def rollout_dtype_bytes(self) -> int:
        return element_size(dtype_of(self.config.grpo.rollout_dtype))

    def rollout_bytes(self, arch: ModelArch, resident_layers: int | None = None, copies: int = 1) -> int:
        """The device memory a rollout copy takes while it samples its share of a step's completions
        (rl/rollout.py; `copies` of them), with `resident_layers` of its decoder layers on the device
        (None: all)."""
        return rollout_bytes(arch, self.rows_per_copy(copies), self.config.data.seq_len, self.rollout_dtype_bytes,
                             resident_layers)

    def read_data(self, arch: ModelArch) -> tuple[dict | None, tuple]:
        return None, (grpo_data(self.config, arch), None)

    def steps(self, session, data, meta: dict | None, bad_rows):
        """The session's GRPO steps (runtime/grpo_steps.py): its rollout actors sample, the policy it
        fans out over its workers trains."""
        return session.grpo_steps(self.config, data, meta.get("data_position") if meta else None)


OBJECTIVES = {"lm": Objective, "grpo": Grpo}


def objective_of(config: Config) -> Objective:
    """The run's objective (train.objective), resolved here alone."""
    return OBJECTIVES[config.train.objective](config)


@dataclass(frozen=True)
class GrpoData:
    tokens: Any  # rl/prompts.py, Tokens
    prompts: list
    rewards: Any  # rl/rewards.py, Rewards


def grpo_data(config: Config, arch: ModelArch) -> GrpoData:
    """The tokenizer, every prompt and the rewards, checked: a DataError or a RewardError before the
    cluster starts."""
    from megatrain_ray.rl.prompts import Tokens, read_prompts
    from megatrain_ray.rl.rewards import Rewards

    g: GrpoConfig = config.grpo
    tokens = Tokens(config)
    prompts = read_prompts(config, tokens, arch.vocab_size)
    rewards = Rewards(g.rewards, g.answer_column, g.format_pattern)
    print(f"prompts: {len(prompts)} from {config.data.source}; {g.group_size} completions each, "
          f"{g.prompts_per_step} prompts a step; rewards: "
          f"{', '.join(f'{name} x {weight:g}' for name, weight in g.rewards.items())}", flush=True)
    return GrpoData(tokens, prompts, rewards)
