"""Whole-model training beside the streaming trainer: same weights and data, one autograd graph over
the model of helpers/reference_model.py (the project's layer code, see there), torch.optim.AdamW,
torch's clipping and a LambdaLR over the schedule written here."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatrain_ray.config import Config
from megatrain_ray.runtime.local import LocalTrainer
from megatrain_ray.models.arch import ModelArch
from helpers.reference_model import ReferenceModel


def reference_lr_factor(update: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """The documented schedule, written here and not taken from megatrain_ray.host.adamw: the
    learning rate rises linearly over `warmup_steps` updates to its full value at the last of them
    (update 0 gets 1/warmup_steps of it), then follows a half cosine from the full value down to
    `min_ratio` of it over the remaining `total_steps - warmup_steps` updates, and stays there.
    After the warm-up this is transformers' get_cosine_with_min_lr_schedule_with_warmup
    (tests/host/test_host_adamw.py checks it against that function); `update` counts from 0, as
    LambdaLR's does."""
    if update < warmup_steps:
        return (update + 1) / warmup_steps
    decay_updates = max(1, total_steps - warmup_steps)
    decayed = min(1.0, (update - warmup_steps) / decay_updates)
    return min_ratio + (1 - min_ratio) * (1 + math.cos(math.pi * decayed)) / 2


def reference_lr(optim, update: int, total_steps: int) -> float:
    """optim.lr times reference_lr_factor: the learning rate of update `update` (from 0)."""
    return optim.lr * reference_lr_factor(update, optim.warmup_steps, total_steps, optim.min_lr_ratio)


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


def adamw_loop(config: Config, groups: tuple[list, list], clip: list, steps_data, loss_sum,
               muon: list | None = None) -> list[float]:
    """The plain loop every comparison runs: torch.optim.AdamW (weight decay on the first group
    only), torch's LambdaLR over reference_lr_factor (not the project's schedule), clip_grad_norm_ over `clip`, each step's loss the summed token
    losses of its micro-batches (`loss_sum(mb)`) over the step's target tokens. Returns the losses.
    `muon`: parameters that torch.optim.Muon steps instead (optim.name muon; out of `groups`), a
    stacked one (3-D) expert by expert through torch's functional Muon on its matrices' views."""
    o = config.optim
    decay, no_decay = groups
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=o.lr, betas=o.betas, eps=o.eps,
    )
    factor = lambda k: reference_lr_factor(k, o.warmup_steps, o.schedule_steps or config.train.steps,  # noqa: E731
                                           o.min_lr_ratio)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    if muon:
        opt = _WithMuon(opt, muon, o, factor)
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


class _WithMuon:
    """AdamW beside torch.optim.Muon (its own LambdaLR): zero_grad and step on both."""

    def __init__(self, adamw, params: list, o, factor):
        self.adamw = adamw
        lr = o.lr if o.muon_lr is None else o.muon_lr
        wd = o.weight_decay if o.muon_weight_decay is None else o.muon_weight_decay
        self.settings = dict(weight_decay=wd, momentum=o.muon_momentum, nesterov=o.muon_nesterov,
                             ns_steps=o.muon_ns_steps, adjust_lr_fn=o.muon_adjust_lr)
        self.matrices = torch.optim.Muon([p for p in params if p.dim() == 2], lr=lr, **self.settings)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.matrices, factor)
        self.stacked = [p for p in params if p.dim() > 2]
        self.buffers = [torch.zeros_like(p) for p in self.stacked]

    def zero_grad(self, set_to_none=True):
        self.adamw.zero_grad(set_to_none=set_to_none)
        self.matrices.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self):
        from torch.optim._muon import muon, DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS

        lr = self.matrices.param_groups[0]["lr"]  # the scheduled one
        for p, buf in zip(self.stacked, self.buffers):
            views = lambda t: list(t.reshape(-1, *t.shape[-2:]).unbind(0))  # noqa: E731
            muon(views(p), views(p.grad), views(buf), lr=lr, ns_coefficients=(DEFAULT_A, DEFAULT_B, DEFAULT_C),
                 eps=EPS, has_complex=False, **self.settings)
        self.adamw.step()
        self.matrices.step()
        self.sched.step()


def train_reference(config: Config, arch: ModelArch, init: list[torch.Tensor], steps_data, device="cpu",
                    autocast_dtype=None, dtype=torch.float32):
    """Returns (losses per step, final layer weights flattened in `dtype`, the model)."""
    model = ReferenceModel(arch, [w.to(dtype) for w in init], dtype=dtype).to(device)

    def loss_sum(mb):
        mb = {k: v.to(device) for k, v in mb.items()}
        with torch.autocast(device_type=torch.device(device).type, dtype=autocast_dtype,
                            enabled=autocast_dtype is not None):
            return model.loss_sum(mb, compute_dtype=autocast_dtype)

    losses = adamw_loop(config, model.decay_groups(), list(model.parameters()), steps_data, loss_sum)
    weights = [torch.cat([p.detach().reshape(-1) for p in model.bound(i).values()]) for i in range(len(model.layers))]
    return losses, weights, model


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# How much further from the exact result the streaming trainer may land than plain PyTorch's own fp32
# run does. Both round the same products, summed in other orders (chunks of the loss, of the MLP and
# of the experts, micro-batches accumulated in the store), so their errors are of one size, not
# equal: over every preset and option of tests/streaming/test_trainer_reference.py the ratio was
# 1.8 at most (the MLP in chunks, Qwen2's embedding), per tensor against transformers' own models
# (tests/models/test_transformers_parity.py) 1.9; 4 leaves room for another CPU's kernels. A bug
# (a chunk dropped, a step skipped, a bias not decayed) moves the weights by orders more.
NOISE_FACTOR = 4
FP32_EPS = torch.finfo(torch.float32).eps


def assert_within_fp32_noise(ours: torch.Tensor, plain: torch.Tensor, exact: torch.Tensor, what: str):
    """`ours` is within NOISE_FACTOR times plain PyTorch's fp32 error of the exact (fp64) result.

    The bound is measured, not guessed: where a few steps of Adam amplify rounding (near-zero
    gradients of an embedding row), plain fp32 lands far from fp64 too, and the bound grows with it.
    Its floor, 4 eps of the result, covers plain fp32 landing on the exact value by chance."""
    ours, plain, exact = (torch.as_tensor(t, dtype=torch.float64) for t in (ours, plain, exact))
    noise = max(float((plain - exact).norm()), 4 * FP32_EPS * float(exact.norm()))
    error = float((ours - exact).norm())
    assert error <= NOISE_FACTOR * noise, (
        f"{what}: {error:.3g} from the fp64 result, plain PyTorch's fp32 run {noise:.3g} (bound x{NOISE_FACTOR})")


@dataclass(frozen=True)
class Both:
    """The streaming trainer's run beside plain PyTorch's from the same initial weights, in fp32
    (what it is compared with) and in fp64 (the exact result both round)."""
    results: list          # the streaming trainer's StepResults
    init: list[torch.Tensor]
    ours: list[torch.Tensor]
    plain_losses: list[float]
    plain_weights: list[torch.Tensor]
    exact_losses: list[float]
    exact_weights: list[torch.Tensor]

    def assert_trains_like_plain_pytorch(self):
        for step, (r, plain, exact) in enumerate(zip(self.results, self.plain_losses, self.exact_losses, strict=True)):
            assert_within_fp32_noise(r.loss, plain, exact, f"loss of step {step}")
        for i, (a, plain, exact) in enumerate(zip(self.ours, self.plain_weights, self.exact_weights, strict=True)):
            assert_within_fp32_noise(a, plain, exact, f"layer {i}")
            assert not torch.equal(a, self.init[i]), f"layer {i} did not train"


def train_both(config, arch, data, num_stores: int = 1, check=lambda trainer: None) -> Both:
    """The streaming trainer's steps from its own initial weights, then plain PyTorch's from the
    same, in fp32 and in fp64."""
    trainer = LocalTrainer(config, arch, num_stores=num_stores)
    check(trainer)
    init = [w.clone() for w in trainer.layer_weights()]
    results = [trainer.train_step(step) for step in data]
    ours = trainer.layer_weights()
    trainer.close()
    plain_losses, plain_weights, _ = train_reference(config, arch, init, data)
    exact_losses, exact_weights, _ = train_reference(config, arch, init, data, dtype=torch.float64)
    return Both(results, init, ours, plain_losses, plain_weights, exact_losses, exact_weights)
