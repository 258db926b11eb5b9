"""Plain PyTorch training beside the streaming trainer: same weights, data, AdamW, clipping, schedule."""

from __future__ import annotations

import torch

from megatrain_ray.config import Config
from megatrain_ray.runtime.local import LocalTrainer
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.reference import ReferenceModel
from megatrain_ray.host.adamw import lr_factor


def random_micro_batches(arch: ModelArch, steps: int, grad_accum: int, batch: int, seq: int, seed: int,
                         distinct: int | None = None):
    """Token batches with shifted labels, a few ignored positions, positions from 0.

    With `distinct`, rows are drawn from that many fixed sequences: data a model can learn.
    """
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, arch.vocab_size, (distinct, seq + 1), generator=gen) if distinct else None
    out = []
    for _ in range(steps):
        step = []
        for _ in range(grad_accum):
            if pool is None:
                ids = torch.randint(0, arch.vocab_size, (batch, seq + 1), generator=gen)
            else:
                ids = pool[torch.randint(0, distinct, (batch,), generator=gen)]
            labels = ids[:, 1:].clone()
            labels[torch.rand(labels.shape, generator=gen) < 0.1] = -100
            step.append({
                "input_ids": ids[:, :-1].contiguous(),
                "labels": labels,
                "position_ids": torch.arange(seq).expand(batch, seq).contiguous(),
            })
        out.append(step)
    return out


def adamw_loop(config: Config, groups: tuple[list, list], clip: list, steps_data, loss_sum) -> list[float]:
    """The plain loop every comparison runs: torch.optim.AdamW (weight decay on the first group
    only), LambdaLR(lr_factor), clip_grad_norm_ over `clip`, each step's loss the summed token
    losses of its micro-batches (`loss_sum(mb)`) over the step's target tokens. Returns the losses."""
    o = config.optim
    decay, no_decay = groups
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=o.lr, betas=o.betas, eps=o.eps,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: lr_factor(k, o.warmup_steps, config.train.steps, o.min_lr_ratio)
    )
    losses = []
    for micro_batches in steps_data:
        opt.zero_grad(set_to_none=True)
        target = sum(int((mb["labels"] != -100).sum()) for mb in micro_batches)
        total = 0.0
        for mb in micro_batches:
            loss = loss_sum(mb) / target
            loss.backward()
            total += float(loss.detach())
        if o.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(clip, o.grad_clip)
        opt.step()
        sched.step()
        losses.append(total)
    return losses


def train_reference(config: Config, arch: ModelArch, init: list[torch.Tensor], steps_data, device="cpu",
                    autocast_dtype=None):
    """Returns (losses per step, final layer weights, the model)."""
    model = ReferenceModel(arch, [w.clone() for w in init]).to(device)

    def loss_sum(mb):
        mb = {k: v.to(device) for k, v in mb.items()}
        with torch.autocast(device_type=torch.device(device).type, dtype=autocast_dtype,
                            enabled=autocast_dtype is not None):
            return model.loss_sum(mb, compute_dtype=autocast_dtype)

    losses = adamw_loop(config, model.decay_groups(), list(model.parameters()), steps_data, loss_sum)
    return losses, model.layer_weights(), model


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def train_both(config, arch, data, num_stores: int = 1, check=lambda trainer: None):
    """The streaming trainer's steps from its own initial weights, then plain PyTorch's from the
    same: (our step results, the initial weights, our final weights, their losses, their weights)."""
    trainer = LocalTrainer(config, arch, num_stores=num_stores)
    check(trainer)
    init = [w.clone() for w in trainer.layer_weights()]
    results = [trainer.train_step(step) for step in data]
    ours = trainer.layer_weights()
    trainer.close()
    ref_losses, ref_weights, _ = train_reference(config, arch, init, data)
    return results, init, ours, ref_losses, ref_weights
