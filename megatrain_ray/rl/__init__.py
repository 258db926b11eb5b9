"""Reinforcement learning with verifiable rewards (GRPO and its variants DAPO and Dr. GRPO): the
loss (`loss.py`), the reward functions (`rewards.py`), the prompts (`prompts.py`), the rollout's
policy copy that samples completions (`rollout.py`) and one step's data (`batch.py`)."""
