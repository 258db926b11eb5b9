"""The embedding's step on the device tells its store which step's state the store's memory holds
(streaming/device_step.py, host/store.py held_marker): in flux while the state is written back, the
update count once it has landed. On the CPU path, where the copies back run as they are issued."""

import torch

from megatrain_ray.host.adamw import AdamWStep
from megatrain_ray.host.sources import HostLayerState
from megatrain_ray.host.store import IN_FLUX
from megatrain_ray.streaming.device_step import DeviceStepSource
from megatrain_ray.streaming.streams import CpuEvent

N = 8


class Inner:
    """The source under the device step, for the one layer it steps: nothing to do."""

    def begin_step(self, order) -> None: ...

    def gradient_ready(self, layer, landed) -> None: ...

    def drain(self) -> None: ...


def test_the_marker_is_in_flux_while_the_state_is_written_back_then_the_count_it_holds():
    held = torch.zeros(1, dtype=torch.int64)
    marks: dict[str, list[int]] = {}  # the marker each time a store buffer is written, by buffer

    class StoreBuffer(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.Tensor.copy_ and getattr(args[0], "buffer", None):
                marks.setdefault(args[0].buffer, []).append(int(held.item()))
            return super().__torch_function__(func, types, args, kwargs or {})

    def buffer(name):
        t = torch.full((N,), 0.5).as_subclass(StoreBuffer)
        t.buffer = name
        return t

    state = HostLayerState(buffer("master"), buffer("exp_avg"), buffer("exp_avg_sq"), buffer("compute"),
                           [(0, N, True)], 0, held)
    source = DeviceStepSource(Inner(), {0: state}, torch.device("cpu"), torch.float32, lambda layer, n: None)
    hp = AdamWStep(lr_position=1, lr=1e-2, grad_scale=1.0, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)

    for step, step_hp in ((1, hp), (2, hp), (3, None)):  # step 3 is non-finite: no update, the state unchanged
        source.begin_step([0])
        source.take_gradient(0, torch.ones(N))
        source.update(0, step_hp, CpuEvent())
        source.drain()
        assert held.item() == min(step, 2)

    assert marks["master"] == marks["exp_avg"] == marks["exp_avg_sq"] == [IN_FLUX, IN_FLUX]
    assert marks["compute"] == [IN_FLUX, IN_FLUX, 2]  # the non-finite step rewrites the weights only
    assert held.item() == 2 == state.updates
