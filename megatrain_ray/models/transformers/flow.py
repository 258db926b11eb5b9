"""What flows between the layers of a transformers model beside its hidden states: stacked hidden
states (AltUp), the keys and values layers share (Gemma 3n/4), and the inputs of their own that the
embedding hands them (Gemma 4's per-layer inputs, Qwen3-VL's deepstack features, Zamba2's common
input).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from typing import Any

import torch

from megatrain_ray.models.transformers import modules as hm
from megatrain_ray.models.transformers.recording import buffers_on, recording_decoder, stand_in_weights


def decoder_config(config: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config: an image-text model's text_config, else the config itself."""
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def hidden_stack(config: dict[str, Any]) -> int:
    """How many copies of the hidden states the layers take, stacked (Gemma 3n's AltUp predictions)."""
    return int(config.get("altup_num_inputs") or 1)


@dataclass(frozen=True)
class SharedKV:
    """Keys and values that a layer stores for later layers to reuse (Gemma 3n/4's shared KV: the
    last layer of each attention type before the sharing ones stores them, the later layers of its
    type read them): they flow behind the hidden states, per storing layer its keys then its values,
    each `widths` (key-value heads x head width) wide, zero until their layer stores them. `keys`:
    what the layers name them by in their `shared_kv_states` (kv_sharing). A layer's own copy says
    its `layer_type`, its `mode` ("store", "reuse" or None) and the `key` it stores under."""

    heads: tuple[int, ...]
    widths: tuple[int, ...]
    keys: tuple[str | int, ...]
    layer_type: str | None = None
    mode: str | None = None
    key: str | int | None = None

    @property
    def width(self) -> int:
        return 2 * sum(self.widths)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(what flows before the keys and values, the keys and values)."""
        return x.split([x.shape[-1] - self.width, self.width], dim=-1)

    def states(self, kv: torch.Tensor) -> dict[str | int, tuple[torch.Tensor, torch.Tensor]]:
        """The stored keys and values as the model's layers leave them: key -> ([B, heads, T, head
        width] keys, values)."""
        pieces = kv.split([w for w in self.widths for _ in (0, 1)], dim=-1)
        return {k: tuple(piece.unflatten(-1, (h, -1)).transpose(-3, -2) for piece in pieces[2 * i:2 * i + 2])
                for i, (k, h) in enumerate(zip(self.keys, self.heads))}

    def after(self, kv: torch.Tensor, states: dict) -> torch.Tensor:
        """The keys and values that flow on: those this layer stored in its own place."""
        if self.mode != "store":
            return kv
        pieces = list(kv.split([w for w in self.widths for _ in (0, 1)], dim=-1))
        i = self.keys.index(self.key)
        pieces[2 * i:2 * i + 2] = [t.transpose(-3, -2).flatten(-2) for t in states[self.key]]
        return torch.cat(pieces, dim=-1)


@functools.lru_cache(maxsize=8)
def kv_sharing(config_json: str) -> tuple[tuple[str | None, str | int], ...]:
    """Per layer, (its part in sharing keys and values: "store", "reuse" or None, the name its
    `shared_kv_states` holds its keys and values under), as its attention module holds them: the
    module's flags, which transformers sets in every version (its config's `kv_sharing_modes`, from
    5.24 on, says the same). transformers 5.24 names them by the layer's type (Gemma 3n and 4); its
    Gemma 3n before that by the storing layer's index, which a reusing layer holds in
    `kv_shared_layer_index` (a KeyError otherwise: 5.17's)."""
    p = hm.parts_of(config_json)
    attention = [getattr(layer, "self_attn", None) for layer in p.layers]
    by_index = any(getattr(a, "kv_shared_layer_index", None) is not None for a in attention)
    return tuple(("reuse" if getattr(a, "is_kv_shared_layer", False)
                  else "store" if getattr(a, "store_full_length_kv", False) else None,
                  i if by_index else getattr(a, "layer_type", None)) for i, a in enumerate(attention))


@functools.lru_cache(maxsize=8)
def shared_kv_of(config_json: str) -> SharedKV | None:
    """The keys and values its layers share (kv_sharing), None where they share none: their
    widths those of the storing layers' key projections."""
    p = hm.parts_of(config_json)
    modes = [mode for mode, _ in kv_sharing(config_json)]
    if "reuse" not in modes:
        return None
    stores = [i for i, mode in enumerate(modes) if mode == "store"]
    try:
        attention = [p.layers[i].self_attn for i in stores]
        widths = tuple(int(a.k_proj.weight.shape[0]) for a in attention)
        heads = tuple(w // int(a.head_dim) for w, a in zip(widths, attention))
    except AttributeError as e:
        raise hm.Unsupported(f"its layers share keys and values (kv_sharing_modes), but not through an attention "
                             f"module with a key projection (self_attn.k_proj): {e}") from None
    keys = [key for _, key in kv_sharing(config_json)]
    return SharedKV(heads, widths, tuple(keys[i] for i in stores))


def layer_kv(config_json: str, index: int) -> SharedKV | None:
    """Layer `index`'s view of the shared keys and values."""
    kv = shared_kv_of(config_json)
    if kv is None:
        return None
    mode, key = kv_sharing(config_json)[index]
    return dataclasses.replace(kv, layer_type=hm.parts_of(config_json).base.config.layer_types[index], mode=mode,
                               key=key if mode == "store" else None)


@functools.lru_cache(maxsize=8)
def common_input_of(config_json: str) -> tuple[int, int] | None:
    """(its position among a layer's arguments, its width) of an input per token that the decoder
    passes every layer alike beside the hidden states (Zamba2's original_hidden_states: the
    embedding's output, which its hybrid layers join to their input), found on a stand-in input as
    the one such tensor that every layer is given; None for a decoder that passes none (or a model
    whose layers take inputs of their own, which flow otherwise)."""
    p = hm.parts_of(config_json)
    if p.decoder_in_root or json.loads(config_json).get("hidden_size_per_layer_input"):
        return None
    decoder, calls, _ = recording_decoder(config_json, len(p.layers) - 1)
    calls.clear()
    cpu = torch.device("cpu")
    hidden = torch.zeros(1, 2, int(p.base.config.hidden_size))
    state = {**buffers_on(config_json, "base", cpu), **stand_in_weights(p, torch.float32, cpu)}
    try:
        with torch.no_grad():
            hm.run_until_layers(decoder, state, calls, inputs_embeds=hidden, position_ids=torch.arange(2)[None])
    except Exception:  # a part before the layers that needs real inputs: refused where it runs, saying why
        calls.clear()
        return None
    recorded = list(calls)
    calls.clear()
    if not recorded:
        return None
    first = recorded[0][1]
    found = [i for i, a in enumerate(first) if isinstance(a, torch.Tensor) and a.dim() == 3 and
             a.shape[:2] == hidden.shape[:2] and all(len(args) > i and args[i] is a for _, args, _ in recorded)]
    return (found[0], int(first[found[0]].shape[-1])) if len(found) == 1 else None


@dataclass(frozen=True)
class PerLayerInput:
    """A layer's own input, the slice `index` of the `layers` x `width` inputs that flow behind the
    hidden states (stream_width): Gemma 4's per-layer input, the layer's positional argument
    `position`, or (one of `layers` 1, index 0 for every layer) Zamba2's input that every layer
    reads; or (position None) Qwen3-VL's deepstack features, zero but at the image tokens, added to
    the output of each of the first `layers` layers, as its decoder adds them.

    The block reads its slice through `at`, the index as a tensor on the device, and whether it adds
    one through `adds`: torch.compile specialises on a Python int that the block reads, so an int
    index would make it compile the block once per layer, not once per layer template."""

    position: int | None
    index: int
    layers: int
    width: int
    at: torch.Tensor = dataclasses.field(default=None, compare=False, repr=False)
    adds: bool = False

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the hidden states, all layers' own inputs [..., layers, width]) of what flows."""
        hidden, inputs = x.split([x.shape[-1] - self.layers * self.width, self.layers * self.width], dim=-1)
        return hidden, inputs.unflatten(-1, (self.layers, self.width))

    def placed(self, args: tuple, inputs: torch.Tensor) -> tuple:
        """The layer's recorded positional arguments with its own per-layer input in its place."""
        if self.position is None:
            return args
        return (*args[:self.position], self.own(inputs), *args[self.position + 1:])

    def added(self, out: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """The layer's output with its deepstack features added (a layer past them: as it is)."""
        return out + self.own(inputs) if self.adds else out

    def own(self, inputs: torch.Tensor) -> torch.Tensor:
        """The layer's slice [..., width] of all layers' inputs [..., layers, width]."""
        return inputs.index_select(-2, self.at).squeeze(-2)


@functools.lru_cache(maxsize=1024)
def index_on(index: int, device: torch.device) -> torch.Tensor:
    """A layer's index as a one-element tensor on `device` (PerLayerInput.at), made once."""
    return torch.tensor([index], device=device)


def stacked(hidden: torch.Tensor, stack: int) -> torch.Tensor:
    """[..., stack x hidden] as the layers take stacked hidden states: [stack, ..., hidden]."""
    return hidden if stack == 1 else hidden.unflatten(-1, (stack, -1)).movedim(-2, 0)


def side_by_side(hidden: torch.Tensor, stack: int) -> torch.Tensor:
    """Stacked hidden states [stack, ..., hidden] as they flow: [..., stack x hidden]."""
    return hidden if stack == 1 else hidden.movedim(0, -2).flatten(-2)
