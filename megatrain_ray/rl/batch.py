"""One step's sampled completions as the executor's micro-batches: each row a prompt followed by one
of its completions, the labels on the completion's tokens only, and beside them per token the
completion's advantage and its weight in the step's normalised loss (rl/loss.py); the old and the
reference log-probabilities join later, from forwards over these same micro-batches."""

from __future__ import annotations

import numpy as np
import torch

from megatrain_ray.models.family import IGNORE_INDEX
from megatrain_ray.rl.loss import token_weights


def completion_weights(lengths: list[int], normalizer: str, max_new_tokens: int) -> list[np.ndarray]:
    """Each completion's tokens' weights in the step's loss (rl/loss.py, token_weights)."""
    width = max(1, max(lengths))
    mask = torch.zeros(len(lengths), width)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    weights = token_weights(mask, normalizer, max_new_tokens)
    return [weights[i, :n].numpy() for i, n in enumerate(lengths)]


def policy_row(prompt: np.ndarray, completion: np.ndarray, advantage: float, weights: np.ndarray,
               width: int) -> dict[str, np.ndarray]:
    """One row, right-padded to `width`: the completion's first token is the label of the prompt's
    last position (labels are shifted: labels[t] is position t's target)."""
    p, c = len(prompt), len(completion)
    input_ids = np.zeros(width, dtype=np.int64)
    input_ids[:p], input_ids[p:p + c] = prompt, completion
    labels = np.full(width, IGNORE_INDEX, dtype=np.int64)
    labels[p - 1:p - 1 + c] = completion
    advantages = np.zeros(width, dtype=np.float32)
    advantages[p - 1:p - 1 + c] = advantage
    loss_weights = np.zeros(width, dtype=np.float32)
    loss_weights[p - 1:p - 1 + c] = weights
    return {"input_ids": input_ids, "labels": labels, "position_ids": np.arange(width, dtype=np.int64),
            "advantages": advantages, "loss_weights": loss_weights}


def policy_micro_batches(prompts: list[np.ndarray], completions: list[np.ndarray], advantages: list[float],
                         normalizer: str, max_new_tokens: int, rows_per_micro_batch: int) -> list[dict]:
    """The step's rows (completion i after prompt i), `rows_per_micro_batch` at a time, each
    micro-batch padded to its longest row. Completions without a token (a first sampled EOS is a
    token) are kept: their weights are empty and they add nothing."""
    weights = completion_weights([len(c) for c in completions], normalizer, max_new_tokens)
    out = []
    for start in range(0, len(prompts), rows_per_micro_batch):
        rows = range(start, min(start + rows_per_micro_batch, len(prompts)))
        width = max(len(prompts[i]) + len(completions[i]) for i in rows)
        built = [policy_row(prompts[i], completions[i], advantages[i], weights[i], width) for i in rows]
        out.append({key: np.stack([row[key] for row in built]) for key in built[0]})
    return out


def with_logprobs(micro_batches: list[dict], key: str, logprobs: list[np.ndarray]) -> list[dict]:
    """The micro-batches with each one's per-token log-probabilities under `key` (old_logprobs,
    ref_logprobs), from a forward over them (streaming/executor.py, token_logprobs)."""
    return [{**mb, key: np.asarray(lp, dtype=np.float32)} for mb, lp in zip(micro_batches, logprobs)]


def placed_logprobs(micro_batches: list[dict], prompts: list[np.ndarray], logprobs: list[np.ndarray],
                    rows_per_micro_batch: int) -> list[np.ndarray]:
    """Each completion's per-token log-probabilities (the rollout's, as it sampled them) where a
    forward over the micro-batches gives them (`token_logprobs`): at its labels' positions, 0
    elsewhere."""
    out = []
    for m, mb in enumerate(micro_batches):
        placed = np.zeros(mb["labels"].shape, dtype=np.float32)
        for r in range(len(placed)):
            i = m * rows_per_micro_batch + r
            start = len(prompts[i]) - 1
            placed[r, start:start + len(logprobs[i])] = logprobs[i]
        out.append(placed)
    return out
