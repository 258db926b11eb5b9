"""Running the model's own decoder on stand-ins: the module that runs from the inputs to the
first layer with its layers recording, its buffers on a device, stand-in weights, and the weights
that a layer's forward detaches or writes in place.
"""

from __future__ import annotations

import functools

import torch

from megatrain_ray.models.transformers import modules as hm


def buffer_names(module: torch.nn.Module) -> frozenset[str]:
    """Local names of a module's persistent buffers (in checkpoints, not parameters)."""
    params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    return frozenset(n for n in hm.persistent_tensors(module) if n not in params)


@functools.lru_cache(maxsize=64)
def buffers_on(config_json: str, where: str, device: torch.device) -> dict[str, torch.Tensor]:
    """A module's non-persistent buffers (rotary frequencies) on `device`, made once per device.
    `where`: "base" (the decoder) or a template's layer index."""
    p = hm.parts_of(config_json)
    module = p.root if where == "base" else p.layers[int(where)]
    layers = p.decoder_in_root + p.layers_name + "." if where == "base" else "\0"
    return {n: b.to(device) for n, b in hm.transient_buffers(module).items() if not n.startswith(layers)}


@functools.lru_cache(maxsize=64)
def template_frozen(config_json: str, template: int) -> frozenset[str]:
    return buffer_names(hm.parts_of(config_json).layers[template])


# Weights that transformers' layers write in place in a training forward, through `.data` (a write
# autograd does not see), by the class of the module that holds them: Gemma 3n's AltUp clamps its
# prediction coefficients to +-altup_coef_clip before each prediction (Gemma3nTextAltUp.predict).
WRITTEN_IN_PLACE = {"Gemma3nTextAltUp": ("prediction_coefs.weight",)}


@functools.lru_cache(maxsize=64)
def written_in_place(config_json: str, template: int) -> frozenset[str]:
    """A template's weights that its forward writes in place (WRITTEN_IN_PLACE), by local name."""
    layer = hm.parts_of(config_json).layers[template]
    return frozenset(f"{name}.{tensor}" if name else tensor for name, module in layer.named_modules()
                     for tensor in WRITTEN_IN_PLACE.get(type(module).__name__, ()))


@functools.lru_cache(maxsize=8)
def recording_decoder(config_json: str, stop_after: int):
    """The module that runs from the inputs to the first layer, its layers recording, and the
    decoder's own keyword arguments kept (hm.recording_root)."""
    calls: list = []
    entered: dict = {}
    return hm.recording_root(hm.parts_of(config_json), calls, stop_after, entered), calls, entered


def stand_in_weights(p: hm.Parts, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Zeros (one element, expanded) for the tensors the model's forward reads before its first
    layer: what its forward reads of them without images is their dtype and device."""
    zero, layers = {}, p.decoder_in_root + p.layers_name + "."
    for name, t in hm.persistent_tensors(p.root).items():
        if name.startswith(layers):
            continue
        kind = dtype if t.is_floating_point() else t.dtype
        zero[name] = torch.zeros((), dtype=kind, device=device).expand(t.shape)
    return zero


@functools.lru_cache(maxsize=64)
def stand_ins_on(config_json: str, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """stand_in_weights made once per device and dtype: layer_calls runs for every micro-batch, and the
    stand-ins are only read (expanded zeros cannot be written)."""
    return stand_in_weights(hm.parts_of(config_json), dtype, device)


def own_copies(state: dict[str, torch.Tensor], names: frozenset[str]) -> dict[str, torch.Tensor]:
    """`state` with a copy of each named weight, for a layer that writes them in place: its write
    lands in the copy, which it computes with (its gradient passes through to the weight, as to the
    written parameter in transformers), never in the weights streamed to it. Those are views of one
    slot (streaming/executor.py) sharing one version counter, and torch.compile turns a write
    through `.data` into a write to the block's input, which counts: the backward of the compiled
    block would then refuse every tensor it saved of that slot (a norm's weight) as modified."""
    return {**state, **{name: state[name].clone() for name in names}} if names else state
