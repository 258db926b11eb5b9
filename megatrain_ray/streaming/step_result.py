"""What a step and a validation pass report, per GPU worker and combined over workers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepResult:
    loss: float  # mean token loss over the step
    grad_norm: float  # before clipping
    tokens: int
    target_tokens: int
    finite: bool
    seconds: float
    h2d_bytes: int
    d2h_bytes: int
    h2d_gbps: float  # achieved while copying
    d2h_gbps: float
    prefetch_wait_s: float  # host blocked until a layer's optimizer update had landed
    compute_s: float  # device busy computing; the rest of `seconds` is exposed waiting
    weight_copies: int
    peak_device_bytes: int
    lr: float | None = None  # the update's learning rate; None when the step was skipped or not applied
    num_gpus: int = 1  # data-parallel workers whose results this combines
    wait_before_s: float = 0.0  # of the exposed wait: before the first layer computed
    wait_between_s: float = 0.0  # between layers
    wait_after_s: float = 0.0  # after the last layer computed
    host_add_wait_s: float = 0.0  # of `seconds`: blocked on the host's adds of gradients summed in host memory
    policy: dict | None = None  # a policy loss's sums over its completion tokens (rl/loss.py, PolicyMetrics)


def combine_results(results: list[StepResult]) -> StepResult:
    """One step of several data-parallel workers: loss, norm and finiteness are already global
    (summed across them); work and bytes add up; times are the slowest worker's; copy rates add up
    (each GPU has its own link)."""
    if len(results) == 1:
        return results[0]
    first = results[0]
    total = lambda key: sum(getattr(r, key) for r in results)  # noqa: E731
    slowest = lambda key: max(getattr(r, key) for r in results)  # noqa: E731
    return StepResult(
        loss=first.loss, grad_norm=first.grad_norm, tokens=total("tokens"), target_tokens=total("target_tokens"),
        finite=first.finite, seconds=slowest("seconds"), h2d_bytes=total("h2d_bytes"), d2h_bytes=total("d2h_bytes"),
        h2d_gbps=total("h2d_gbps"), d2h_gbps=total("d2h_gbps"), prefetch_wait_s=slowest("prefetch_wait_s"),
        compute_s=slowest("compute_s"), weight_copies=total("weight_copies"),
        peak_device_bytes=slowest("peak_device_bytes"), lr=first.lr, num_gpus=len(results),
        wait_before_s=slowest("wait_before_s"), wait_between_s=slowest("wait_between_s"),
        wait_after_s=slowest("wait_after_s"), host_add_wait_s=slowest("host_add_wait_s"),
        policy=None if first.policy is None else {k: sum(r.policy[k] for r in results) for k in first.policy},
    )


@dataclass
class EvalResult:
    """Validation over a set of micro-batches: forward only, no update."""

    loss_sum: float  # summed token losses; loss_sum / target_tokens is the mean
    target_tokens: int
    tokens: int
    seconds: float

    @property
    def loss(self) -> float:
        return self.loss_sum / max(1, self.target_tokens)
