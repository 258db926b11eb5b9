"""Decoder layers of a transformers model whose weights stay in host memory and pass through the
device each time the model runs: the streamed rollout (rl/rollout.py) of a model whose copy does
not fit the GPU beside its KV cache and the training step.

The streamed layers' parameters are views into two device slots, fixed once: the k-th streamed
layer computes from slot k % 2. Hooks on the layers' modules fill the slots as transformers runs
its decoder layers in order: as the first decoder layer of a forward starts (resident or not), the
first two streamed layers are copied in, behind the resident layers' compute; after streamed layer
k, layer k + 2 is copied into the slot it frees. On a GPU the copies run on a side stream, so
layer k + 1's copy overlaps layer k's compute (events order the two streams);
a forward then moves every streamed layer's bytes host to device once, whatever the number of
sequences decoding, which is what bounds a decode step's speed. On the CPU the copies are plain
copies, in order: the same arithmetic as resident weights, which the tests hold it to.

The host weights of a layer are read in place where they are what the slots need (the rollout's
dtype, and page-locked on a GPU: the stores' shared compute copies, registered by the rollout's
actor), else copied once per load into a page-locked buffer of the layer's own.
"""

from __future__ import annotations

from functools import partial

import torch

from megatrain_ray.models.layout import LayerLayout


class LayerStream:
    def __init__(self, model: torch.nn.Module, first_layer: str, layouts: list[LayerLayout], dtype: torch.dtype,
                 device: torch.device):
        """`first_layer`: the name of the model's first decoder layer (as it starts, a forward's
        copies start); `layouts`: the streamed decoder layers, in the order the model runs them;
        their parameters in `model` become views into the slots (their values come with `hold`)."""
        self.layouts, self.dtype, self.device = layouts, dtype, device
        numel = max(layout.numel for layout in layouts)
        self.slots = [torch.empty(numel, dtype=dtype, device=device) for _ in range(min(2, len(layouts)))]
        self.host: list[torch.Tensor | None] = [None] * len(layouts)  # each layer's flat weights, in host memory
        self.owned: dict[int, torch.Tensor] = {}  # page-locked copies of weights not readable in place
        self.copies = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.loaded: list[torch.cuda.Event | None] = [None] * len(layouts)  # layer k's weights are in its slot
        self.freed: list[torch.cuda.Event | None] = [None] * len(self.slots)  # the slot's last layer has run
        self.positions = {layout.index: k for k, layout in enumerate(layouts)}
        model.get_submodule(first_layer).register_forward_pre_hook(self._begin)
        for k, layout in enumerate(layouts):
            module = model.get_submodule(layout.prefix.rstrip("."))
            point_at_slot(module, layout, self.slots[k % 2])
            module.register_forward_pre_hook(partial(self._before, k))
            module.register_forward_hook(partial(self._after, k))

    def streams(self, layer: int) -> bool:
        return layer in self.positions

    def bytes_per_forward(self) -> int:
        """Host-to-device bytes of one forward of the model (a decode step, a prompt's forward)."""
        return sum(layout.numel for layout in self.layouts) * self.slots[0].element_size()

    def hold(self, layer: int, flat: torch.Tensor) -> None:
        """Layer `layer`'s flat weights, read at every forward until the next `hold` of it: in place
        where they are in the slots' dtype (and page-locked, on a GPU), else a copy of them now."""
        k = self.positions[layer]
        in_place = flat.dtype == self.dtype and (self.device.type != "cuda" or flat.is_pinned())
        if in_place:
            self.owned.pop(k, None)
            self.host[k] = flat
            return
        if k not in self.owned:
            self.owned[k] = torch.empty(flat.numel(), dtype=self.dtype, pin_memory=self.device.type == "cuda")
        self.host[k] = self.owned[k].copy_(flat)

    # -- the hooks: a forward's copies, in the order transformers runs the layers ------------------
    def _begin(self, module, args) -> None:
        for k in range(len(self.slots)):
            self._fetch(k)

    def _before(self, k: int, module, args) -> None:
        if self.copies is not None:
            torch.cuda.current_stream(self.device).wait_event(self.loaded[k])

    def _after(self, k: int, module, args, output) -> None:
        if self.copies is not None:
            self.freed[k % 2] = torch.cuda.current_stream(self.device).record_event()
        if k + 2 < len(self.layouts):
            self._fetch(k + 2)

    def _fetch(self, k: int) -> None:
        """Layer k's weights into its slot, once the slot's last layer has run."""
        host = self.host[k]
        if host is None:
            raise RuntimeError(f"the rollout's streamed layer {self.layouts[k].index} has no weights: load them first")
        slot = self.slots[k % 2][:host.numel()]
        if self.copies is None:
            slot.copy_(host)
            return
        with torch.cuda.stream(self.copies):
            if self.freed[k % 2] is not None:
                self.copies.wait_event(self.freed[k % 2])
            slot.copy_(host, non_blocking=True)
            self.loaded[k] = self.copies.record_event()


def point_at_slot(module: torch.nn.Module, layout: LayerLayout, slot: torch.Tensor) -> None:
    """The layer's parameters (on the meta device until now) as views into `slot`, by the layout's offsets."""
    local = layout.prefix.rstrip(".")
    for name, view in layout.views(slot).items():
        owner, _, leaf = layout.hf_name(name)[len(local) + 1:].rpartition(".")
        sub = module.get_submodule(owner) if owner else module
        shape = getattr(sub, leaf).shape
        setattr(sub, leaf, torch.nn.Parameter(view.view(shape), requires_grad=False))
