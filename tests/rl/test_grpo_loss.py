"""The GRPO loss of one update against a loss written in plain PyTorch from the papers' formulas: the
same prompts, completions and rewards, the whole model as one nn.Module of the project's own layer
code with ordinary autograd (helpers/reference_model.py; that code is checked against transformers in tests/models/),
its loss from DeepSeekMath's objective (group-normalised advantages, the clipped ratio, the k3 KL)
with GRPO's, DAPO's and Dr. GRPO's normalisations. The streaming executor computes the token
log-probabilities a chunk at a time at its head, rows split over micro-batches; the loss and every
layer's gradient must agree within fp32 rounding."""

import dataclasses

import numpy as np
import pytest
import torch

from megatrain_ray.config import config_from_dict
from megatrain_ray.models.registry import PRESETS
from megatrain_ray.rl.batch import policy_micro_batches, with_logprobs
from megatrain_ray.rl.loss import group_advantages
from megatrain_ray.runtime.local import LocalTrainer
from helpers.reference_model import ReferenceModel
from helpers.threads import one_thread  # noqa: F401 (a fixture)

PRESET, G, MAX_NEW = "tiny-llama", 4, 6
REWARDS = [1.0, 0.0, 0.5, 0.0, 2.0, 2.0, 1.0, 0.0]  # two prompts, four completions each


def grpo_config(normalizer: str, kl_coef: float):
    """The KL's weight set past the config's check (a run takes its reference from model.path;
    here the reference log-probabilities are given)."""
    config = config_from_dict({
        "model": {"preset": PRESET, "compute_dtype": "float32", "init_std": 0.2},
        "train": {"objective": "grpo", "micro_batch_size": 4, "seed": 3},
        "data": {"seq_len": 16},
        "grpo": {"group_size": G, "prompts_per_step": 2, "max_new_tokens": MAX_NEW, "loss_normalizer": normalizer,
                 "clip_low": 0.2, "clip_high": 0.28},
        "executor": {"device": "cpu", "loss_chunk_tokens": 5},
    })
    return config.replace(grpo=dataclasses.replace(config.grpo, kl_coef=kl_coef))


def fixed_rollouts(vocab: int):
    """Two prompts of 3 and 5 tokens, each with four completions of 1 to 6 tokens."""
    gen = np.random.default_rng(0)
    prompts = [gen.integers(0, vocab, 3), gen.integers(0, vocab, 5)]
    lengths = [6, 1, 4, 3, 2, 6, 5, 4]
    completions = [gen.integers(0, vocab, n) for n in lengths]
    return [prompts[i // G] for i in range(2 * G)], completions


def plain_grpo_loss(model, prompts, completions, rewards, old_shift, ref_shift, normalizer, beta):
    """DeepSeekMath's objective, one completion at a time, from the formulas: A_i = (r_i - mean) /
    (std + 1e-4) (Dr. GRPO: unscaled, not tested here), ratio = pi / pi_old, the min of the
    unclipped and clipped surrogates, KL_t = pi_ref/pi - log(pi_ref/pi) - 1."""
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, G)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).reshape(-1)
    per_completion, tokens = [], 0
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        ids = torch.tensor(np.concatenate([p, c]))[None]
        logits = model(ids, torch.arange(ids.shape[1])[None])[0].float()
        logp_all = torch.log_softmax(logits[len(p) - 1:len(p) - 1 + len(c)], dim=-1)
        logp = logp_all[torch.arange(len(c)), torch.tensor(c)]
        old = logp.detach() + old_shift[i][:len(c)]
        ratio = torch.exp(logp - old)
        surrogate = torch.minimum(ratio * adv[i], torch.clamp(ratio, 0.8, 1.28) * adv[i])
        ref = logp.detach() + ref_shift[i][:len(c)]
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        per_completion.append(-surrogate + beta * kl)
        tokens += len(c)
    if normalizer == "sequence":
        return sum(l.mean() for l in per_completion) / len(per_completion)
    if normalizer == "token":
        return sum(l.sum() for l in per_completion) / tokens
    return sum(l.sum() for l in per_completion) / (len(per_completion) * MAX_NEW)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("normalizer,kl_coef", [("sequence", 0.0), ("token", 0.05), ("constant", 0.05)])
def test_one_update_equals_plain_pytorch(normalizer, kl_coef):
    arch = PRESETS[PRESET]
    config = grpo_config(normalizer, kl_coef)
    prompts, completions = fixed_rollouts(arch.vocab_size)
    trainer = LocalTrainer(config, arch)
    try:
        init = [w.clone() for w in trainer.layer_weights()]
        model = ReferenceModel(arch, init)
        # the old and reference policies as shifts of the current log-probabilities: ratios from
        # about 0.6 to 1.6, so that both clip bounds bind on some tokens
        gen = torch.Generator().manual_seed(1)
        old_shift = [torch.empty(MAX_NEW).uniform_(-0.5, 0.5, generator=gen) for _ in completions]
        ref_shift = [torch.empty(MAX_NEW).uniform_(-0.3, 0.3, generator=gen) for _ in completions]
        advantages = group_advantages(torch.tensor(REWARDS), G).tolist()
        mbs = policy_micro_batches(prompts, completions, advantages, normalizer, MAX_NEW, rows_per_micro_batch=3)
        # the old policy's log-probabilities through the streamed forward, then shifted
        current = trainer.executor.token_logprobs(mbs)
        olds, refs = [], []
        for k, (mb, lp) in enumerate(zip(mbs, current, strict=True)):
            old, ref = lp.copy(), lp.copy()
            for row in range(mb["labels"].shape[0]):
                i = 3 * k + row
                at = np.flatnonzero(mb["labels"][row] >= 0)
                old[row, at] += old_shift[i][:len(at)].numpy()
                ref[row, at] += ref_shift[i][:len(at)].numpy()
            olds.append(old)
            refs.append(ref)
        mbs = with_logprobs(with_logprobs(mbs, "old_logprobs", olds), "ref_logprobs", refs)

        result = trainer.executor.train_step(mbs, None)  # no update: the gradients stay in the stores' buffers
        ours = [trainer.source.grad_buffer(i).clone() for i in range(len(init))]
    finally:
        trainer.close()

    loss = plain_grpo_loss(model, prompts, completions, REWARDS, old_shift, ref_shift, normalizer, kl_coef)
    loss.backward()
    plain = [torch.cat([p.grad.reshape(-1) for p in model.bound(i).values()]) for i in range(len(init))]

    assert result.loss == pytest.approx(float(loss.detach()), rel=1e-5)
    clipped = result.policy["clipped_tokens"] / result.policy["policy_tokens"]
    assert result.policy["policy_tokens"] == sum(len(c) for c in completions)
    assert 0.1 < clipped < 0.9, "the clipped region must hold some tokens and not all"
    for i, (a, b) in enumerate(zip(ours, plain, strict=True)):
        assert float((a - b).norm()) <= 1e-5 * float(b.norm()), f"layer {i}: {float((a - b).norm() / b.norm()):.2e}"


def test_advantages_are_group_normalised_and_dr_grpo_leaves_them_unscaled():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0, 3.0, 3.0, 3.0])
    scaled = group_advantages(r, 4)
    assert scaled[:4].tolist() == pytest.approx([a / (0.5 + 1e-4) for a in (0.75, -0.25, -0.25, -0.25)])  # sample std 0.5
    assert scaled[4:].tolist() == [0.0] * 4  # a group of equal rewards teaches nothing
    assert group_advantages(r, 4, scale_by_std=False)[:4].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])
