"""The GRPO loss, from the papers' formulas, as pure functions of per-token tensors.

GRPO (DeepSeekMath, Shao et al. 2024): for each prompt, G completions o_1..o_G with rewards r_i;
the advantage of every token of o_i is A_i = (r_i - mean(r)) / std(r) over its group. The loss
of a token is the PPO clipped surrogate

    l_t = -min(ratio_t * A_i, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A_i) + beta * KL_t,
    ratio_t = exp(logp_t - logp_old_t),
    KL_t = exp(logp_ref_t - logp_t) - (logp_ref_t - logp_t) - 1   (the k3 estimator, always >= 0),

and the step's loss normalises the token losses (`normalizer`):

- `sequence` (GRPO): the mean over completions of each completion's mean token loss;
- `token` (DAPO, Yu et al. 2025): the sum over every token of the step over their count;
- `constant` (Dr. GRPO, Liu et al. 2025): the sum over every token over (completions x max new
  tokens), a constant, with advantages left unscaled by the group's std (`scale_by_std` False).

The executor (streaming/executor.py) computes the token log-probabilities chunk by chunk at the
head and calls `token_losses` on each chunk: the normalisation is a weight per token
(`token_weights`), fixed for the whole step before it starts, so the chunks' and the micro-batches'
sums add up to the step's loss whatever the split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

NORMALIZERS = ("sequence", "token", "constant")


@dataclass(frozen=True)
class TokenLoss:
    """The head's loss of language modelling: the token cross-entropy of the family's `head_loss`,
    compiled with the blocks where they compile. The executor receives the objective's head loss
    through the step plan (this, or `PolicyLoss`) and asks it what to compute."""

    policy: ClassVar[bool] = False  # the chunk's loss is the policy loss (with its metrics), not the family's


@dataclass(frozen=True)
class PolicyLoss:
    """The clipped policy-ratio loss's settings, as the step plan hands them to the executor."""

    policy: ClassVar[bool] = True

    clip_low: float = 0.2  # ratio clipped below at 1 - clip_low
    clip_high: float = 0.2  # ... and above at 1 + clip_high (DAPO's clip-higher: 0.28)
    kl_coef: float = 0.0  # beta: weight of the k3 KL to the reference policy; 0: no reference


def group_advantages(rewards: torch.Tensor, group_size: int, scale_by_std: bool = True,
                     eps: float = 1e-4) -> torch.Tensor:
    """Each completion's reward less its group's mean, over the group's std (+ eps) unless
    `scale_by_std` is off (Dr. GRPO). Groups are `group_size` consecutive rewards; the std is the
    sample std (n - 1), as TRL's GRPOTrainer."""
    grouped = rewards.to(torch.float32).view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_by_std:
        std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(centred)
        centred = centred / (std + eps)
    return centred.reshape(-1)


def token_weights(completion_mask: torch.Tensor, normalizer: str, max_new_tokens: int) -> torch.Tensor:
    """The weight of each completion token in the step's loss, [completions x tokens], so that the
    loss is the weighted sum of the token losses. `completion_mask`: 1 on every completion token of
    the step (every micro-batch's), 0 elsewhere."""
    mask = completion_mask.to(torch.float32)
    if normalizer == "sequence":
        lengths = mask.sum(dim=1, keepdim=True).clamp(min=1)
        return mask / lengths / mask.shape[0]
    if normalizer == "token":
        return mask / mask.sum().clamp(min=1)
    if normalizer == "constant":
        return mask / (mask.shape[0] * max_new_tokens)
    raise ValueError(f"normalizer must be one of {', '.join(NORMALIZERS)}, got {normalizer!r}")


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """The k3 estimator of KL(policy || reference) per token (Schulman; DeepSeekMath, eq. 4)."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1


@dataclass
class TokenLosses:
    """One chunk's token losses and what the metrics count of them (`clipped`: the tokens whose
    clipped term is the one taken and has no gradient; `kl`: zeros without a reference)."""

    loss: torch.Tensor
    clipped: torch.Tensor
    kl: torch.Tensor


def token_losses(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                 ref_logp: torch.Tensor | None, settings: PolicyLoss) -> TokenLosses:
    """Per token: -min(ratio A, clip(ratio) A) + beta KL. All tensors of one shape; `logp` carries
    the gradient, the others are constants."""
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - settings.clip_low, 1 + settings.clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    kl = torch.zeros_like(logp) if ref_logp is None else kl_k3(logp, ref_logp)
    if settings.kl_coef:
        loss = loss + settings.kl_coef * kl
    region = ((ratio < 1 - settings.clip_low) & (advantages < 0)) | ((ratio > 1 + settings.clip_high) & (advantages > 0))
    return TokenLosses(loss, region.detach(), kl.detach())


def label_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's log-probability of its label (0 where the label is ignored, negative) and
    the entropy of its distribution, from logits in fp32 (`labels`: shifted, as the executor's)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    safe = labels.clamp(min=0)
    picked = logprobs.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logprobs.exp() * logprobs).sum(dim=-1)
    return picked * (labels >= 0), entropy


class PolicyMetrics:
    """What a step's policy loss tells besides its value, summed over its completion tokens on the
    device (one sync at the step's end): tokens, clipped tokens, the KL and the entropy."""

    KEYS = ("policy_tokens", "clipped_tokens", "kl_sum", "entropy_sum")

    def __init__(self, device: torch.device):
        self.sums = torch.zeros(len(self.KEYS), dtype=torch.float64, device=device)

    def add(self, mask: torch.Tensor, losses: TokenLosses, entropy: torch.Tensor) -> None:
        m = mask.to(torch.float64)
        parts = [m.sum(), (losses.clipped * m).sum(), (losses.kl.double() * m).sum(), (entropy.double() * m).sum()]
        self.sums += torch.stack(parts)

    def as_dict(self) -> dict[str, float]:
        return dict(zip(self.KEYS, self.sums.tolist()))
