"""Recording each layer's arguments: per decoder layer, what its decoder passes it beside the
hidden states (masks, rotary tables, position ids), recorded from the decoder's own forward on a
stand-in input, and bound to its template module on the device; the head as the causal LM runs it.
"""

from __future__ import annotations

import collections
import functools
import json
from dataclasses import dataclass

import torch

from megatrain_ray.models.image_text import is_pixels
from megatrain_ray.models.transformers import modules as hm
from megatrain_ray.models.transformers.arch import TransformersArch, parts
from megatrain_ray.models.transformers.flow import (PerLayerInput, SharedKV, common_input_of, hidden_stack, index_on,
                                                    layer_kv)
from megatrain_ray.models.transformers.names import input_embedding_name, output_embedding_name
from megatrain_ray.models.transformers.recording import (buffer_names, buffers_on, recording_decoder,
                                                         stand_ins_on, template_frozen, written_in_place)
from megatrain_ray.models.transformers.router import routers_in


@dataclass
class LayerCall:
    """What one decoder layer is called with beside its hidden states: its template module, the
    arguments the model's own forward passed it (masks, rotary tables, position ids), which of its
    tensors are buffers, and its non-persistent buffers on the device. Made outside the compiled
    block, so that the block looks nothing up."""

    template: int
    args: tuple
    kwargs: dict
    module: torch.nn.Module | None = None
    frozen: frozenset[str] = frozenset()
    buffers: dict | None = None
    routers: tuple = ()  # its routers' modules, whose logits the load-balancing loss reads
    per_layer: PerLayerInput | None = None  # where its per-layer input goes, for a model with them
    kv: SharedKV | None = None  # the keys and values it stores or reuses, for a model whose layers share them
    stack: int = 1  # copies of the hidden states its layer takes (hidden_stack)
    written: frozenset[str] = frozenset()  # the weights its forward writes in place (written_in_place)


@dataclass
class HeadCall:
    """The head as the causal LM runs it: the model with its decoder cut to the final norm, its
    buffers' names, and (tied) the LM head's name and the input embedding's it takes."""

    module: torch.nn.Module
    frozen: frozenset[str]
    tied: tuple[str, str] | None
    # a head that runs the decoder's own code after its layers (hm.post_layers_decoder): the
    # decoder's tensors it does not hold, (name, shape), read as zeros by its stand-in run
    stand_ins: tuple[tuple[str, tuple[int, ...]], ...] = ()


@functools.lru_cache(maxsize=8)
def head_call(config_json: str) -> HeadCall:
    p = hm.parts_of(config_json)
    tied = (output_embedding_name(p), input_embedding_name(p)) if p.tied else None
    module = hm.head_model(p, hidden_stack(json.loads(config_json)))
    stand_ins = ()
    if p.after_layers:
        held = tuple(p.root_prefix + m + "." for m in (p.final_norm, *p.after_layers))
        tied_input = p.root_prefix + input_embedding_name(p) if p.tied else None  # the LM head's, given
        stand_ins = tuple((p.root_prefix + n, tuple(t.shape)) for n, t in hm.persistent_tensors(p.root).items()
                          if not (p.root_prefix + n).startswith(held) and p.root_prefix + n != tied_input)
    return HeadCall(module, buffer_names(p.model), tied, stand_ins)


def per_layer_position(arch: TransformersArch, hidden: torch.Tensor, args: tuple) -> int:
    """Which of a layer's positional arguments is its per-layer input: the one tensor per token of
    the per-layer width."""
    shape = (*hidden.shape[-3:-1], arch.per_layer_input_width)  # [batch, tokens] (AltUp: behind the stack)
    found = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and tuple(a.shape) == shape]
    if len(found) != 1:
        raise hm.Unsupported(f"its decoder passes its layers {len(found)} tensors of the per-layer inputs' shape "
                             f"{shape}, not one")
    return found[0]


def refuse_per_layer_inputs(hidden: torch.Tensor, args: tuple) -> None:
    """A layer's positional arguments beside its hidden states are its decoder's masks and caches
    (GPT-2 passes them so); a tensor per token is an input of its own (Gemma 3n's per-layer inputs)."""
    if any(isinstance(a, torch.Tensor) and a.dim() == 3 and a.shape[:2] == hidden.shape[:2] for a in args):
        raise hm.Unsupported("its decoder passes its layers per-layer inputs beside the hidden states")


def layer_calls(arch: TransformersArch, position_ids: torch.Tensor, dtype: torch.dtype,
                inputs: dict | None = None) -> list[LayerCall]:
    """Per decoder layer, the arguments its decoder passes it for these positions, recorded from
    the decoder's own forward on a stand-in input (so masks, windows, chunks and rotary tables are
    the model's own; packed documents are told from the position ids as transformers tells them).
    An image-text model's are recorded from its own forward on its `inputs` (image_text.embed_inputs)
    with a stand-in embedding and no images: its positions (Qwen2.5-VL's 3D rotary positions from
    the image grids) and masks (Gemma 3's bidirectional attention within an image) as it makes them."""
    p = parts(arch)
    decoder, calls, _ = recording_decoder(arch.hf_config, len(p.layers) - 1)
    calls.clear()
    b, t = position_ids.shape
    # what runs before the first layer reads stand-in weights (a learned position embedding, a norm
    # of the embeddings, per-layer input projections): the blocks get the real ones
    state = {**buffers_on(arch.hf_config, "base", position_ids.device),
             **stand_ins_on(arch.hf_config, dtype, position_ids.device)}
    width = arch.per_layer_input_width
    if inputs is None:
        # real zeros, not expanded ones: a decoder may scale its input in place (CTRL's `inputs_embeds *=`)
        stand_in = torch.zeros((b, t, arch.hidden_size), dtype=dtype, device=position_ids.device)
        kwargs = {"inputs_embeds": stand_in, "position_ids": position_ids}
        if width:  # stand-in per-layer inputs
            kwargs["per_layer_inputs"] = stand_in.new_zeros(()).expand(b, t, len(p.layers), width)
    else:  # an image-text model's own forward from its inputs, without images: its positions and masks
        kwargs = {k: v for k, v in inputs.items() if not is_pixels(k)}
    cuda = [position_ids.device] if position_ids.device.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=cuda):  # the stand-in's dropout draws nothing of the step's
        hm.run_until_layers(decoder, state, calls, **kwargs)
    recorded = list(calls)
    calls.clear()
    if len(recorded) > len(p.layers):
        raise hm.Unsupported(f"its decoder made {len(recorded)} layer calls for its {len(p.layers)} layers: it runs "
                             "some of them more than once (a looped section), and megatrain-ray streams each layer "
                             "once a pass")
    if len(recorded) != len(p.layers):
        raise hm.Unsupported(f"its decoder called {len(recorded)} of its {len(p.layers)} layers")
    out = []
    device = position_ids.device
    for index, (kind, (hidden, args, kwargs)) in enumerate(zip(p.kinds, recorded)):
        shared = {"kv": layer_kv(arch.hf_config, index), "stack": arch.hidden_stack}
        kwargs = keeping_no_kv(kwargs)
        if arch.deepstack_layers:  # each layer hands the features on; the first ones add theirs
            count, stack_width = arch.behind_hidden
            per_layer = PerLayerInput(None, index, count, stack_width, index_on(min(index, count - 1), device),
                                      adds=index < count)
            out.append(LayerCall(kind, args, kwargs, per_layer=per_layer, **shared))
            continue
        common = common_input_of(arch.hf_config)
        if common:  # every layer reads the one input that flows behind the hidden states
            per_layer = PerLayerInput(common[0], 0, 1, common[1], index_on(0, device))
            out.append(LayerCall(kind, args, kwargs, per_layer=per_layer, **shared))
            continue
        if not width:
            refuse_per_layer_inputs(hidden, args)
            out.append(LayerCall(kind, args, kwargs, **shared))
            continue
        per_layer = PerLayerInput(per_layer_position(arch, hidden, args), index, len(p.layers), width,
                                  index_on(index, device))
        out.append(LayerCall(kind, args, kwargs, per_layer=per_layer, **shared))
    return out


class DropsWrites(collections.UserDict):
    """A container that keeps nothing written to it."""

    def __setitem__(self, key, value) -> None:
        pass


def keeping_no_kv(kwargs: dict) -> dict:
    """A layer's keyword arguments with the container in which Gemma 3n/4's layers leave their keys
    and values for later layers (`shared_kv_states`) keeping nothing: what it kept would hold a
    layer's keys, values and their graph for as long as the micro-batch's layer arguments live. A
    model whose later layers read them has each block given a container of its own, from what flows
    (SharedKV, block_forward)."""
    return {**kwargs, "shared_kv_states": DropsWrites()} if "shared_kv_states" in kwargs else kwargs


def bound_call(arch: TransformersArch, call: LayerCall, device: torch.device) -> LayerCall:
    """`call` with its template's module, buffer names and device buffers filled in."""
    t = call.template
    buffers = buffers_on(arch.hf_config, str(t), device)
    module = parts(arch).layers[t]
    return LayerCall(t, call.args, call.kwargs, module, template_frozen(arch.hf_config, t), buffers or None,
                     routers_in(arch, module), call.per_layer, call.kv, call.stack, written_in_place(arch.hf_config, t))


def compiled_variant(arch: TransformersArch, index: int) -> tuple:
    """What torch.compile specialises layer `index`'s block on: its template, and the Python values
    of its call that the block branches on (LayerCall: PerLayerInput.adds, SharedKV's mode and type)."""
    kv = layer_kv(arch.hf_config, index)
    return parts(arch).kinds[index], index < arch.deepstack_layers, kv and (kv.mode, kv.layer_type)


def device_of(call: LayerCall) -> torch.device:
    """The device of a recorded call's tensors (its rotary tables, mask, position ids)."""
    for value in [*call.args, *call.kwargs.values()]:
        for t in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(t, torch.Tensor):
                return t.device
    return torch.device("cpu")
