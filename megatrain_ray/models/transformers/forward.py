"""The transformers family's stateless templates: the embedding (the decoder's own forward to its
first layer), a block (the layer's module called on the streamed weights), a block with its routers'
statistics, and the head's logits and loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatrain_ray.models.family import IGNORE_INDEX, Weights
from megatrain_ray.models.image_text import vision_kwargs
from megatrain_ray.models.layout import detached
from megatrain_ray.models.transformers import modules as hm
from megatrain_ray.models.transformers.arch import TransformersArch, parts
from megatrain_ray.models.transformers.calls import (HeadCall, LayerCall, head_call, per_layer_position,
                                                     refuse_per_layer_inputs)
from megatrain_ray.models.transformers.flow import common_input_of, side_by_side, stacked
from megatrain_ray.models.transformers.recording import (buffer_names, buffers_on, own_copies,
                                                         recording_decoder)
from megatrain_ray.models.transformers.router import aux_settings, router_recorder


def embed_forward(arch: TransformersArch, w: Weights, inputs) -> torch.Tensor:
    """The decoder's own forward from the token ids (and their positions, `embed_inputs`) to its
    first layer's input (scaling and a learned position embedding included);
    an image-text model's from its inputs (`inputs`, a dict: image_text.embed_inputs), its image
    features in place of the image tokens' embeddings, as its own forward puts them. A model with
    per-layer inputs: its forward runs to its last layer, and every layer's per-layer input, as the
    decoder passes it, follows the hidden states (arch.stream_width wide). A model with deepstack
    features: they follow the hidden states, one [..., hidden] slice per deepstack layer, zero but
    at the image tokens (deepstack_features)."""
    p = hm.parts_of(arch.hf_config)
    width = arch.per_layer_input_width
    decoder, calls, entered = recording_decoder(arch.hf_config, len(p.layers) - 1 if width else 0)
    calls.clear()
    w = detached(w, buffer_names(p.root))  # a frozen vision tower: the executor detaches it (LayerLayout.frozen_names)
    inputs = inputs if isinstance(inputs, dict) else {"input_ids": inputs}  # ids alone: positions from 0
    kwargs = vision_kwargs(inputs, w) if p.decoder_in_root else inputs
    device = kwargs["input_ids"].device
    hm.run_until_layers(decoder, {**w, **buffers_on(arch.hf_config, "base", device)}, calls, **kwargs)
    recorded, handed = list(calls), dict(entered)
    calls.clear()
    entered.clear()
    hidden, args, _ = recorded[0]
    flowing = [side_by_side(hidden, arch.hidden_stack)]
    if arch.shared_kv_width:  # zero until their layers store them
        flowing.append(flowing[0].new_zeros(*flowing[0].shape[:-1], arch.shared_kv_width))
    if arch.deepstack_layers:
        flowing.append(deepstack_features(arch, hidden, handed).flatten(-2))
    elif width:
        position = per_layer_position(arch, hidden, args)
        flowing.append(torch.stack([layer_args[position] for _, layer_args, _ in recorded], dim=-2).flatten(-2))
    elif common_input_of(arch.hf_config):
        flowing.append(args[common_input_of(arch.hf_config)[0]])
    else:
        refuse_per_layer_inputs(hidden, args)
    return flowing[0] if len(flowing) == 1 else torch.cat(flowing, dim=-1)


def deepstack_features(arch: TransformersArch, hidden: torch.Tensor, handed: dict) -> torch.Tensor:
    """[..., deepstack layers, hidden]: what the model's forward handed its language model to add
    after each of its first layers (`deepstack_visual_embeds`, one [image tokens, hidden] map each,
    at `visual_pos_masks`), placed at the image tokens, zero elsewhere (zero where it handed none:
    a micro-batch without images, or a vision tower with fewer inner layers than named)."""
    out = hidden.new_zeros(*hidden.shape[:-1], arch.deepstack_layers, hidden.shape[-1])
    maps, at = handed.get("deepstack_visual_embeds"), handed.get("visual_pos_masks")
    if not maps or at is None:
        return out
    maps = [m.to(hidden.dtype) for m in maps[:arch.deepstack_layers]]
    found = torch.stack(maps, dim=-2)  # [image tokens, found maps, hidden]
    if len(maps) < arch.deepstack_layers:
        missing = found.new_zeros(found.shape[0], arch.deepstack_layers - len(maps), found.shape[-1])
        found = torch.cat([found, missing], dim=-2)
    return out.index_put((at.to(hidden.device),), found)


def block_forward(w: Weights, x: torch.Tensor, call: LayerCall) -> torch.Tensor:
    """The layer on what flows in; a model with per-layer inputs has its layer read its own slice
    of them (in place of the recorded stand-in), one with deepstack features adds its own to its
    output, and either hands them all on behind its output; one whose layers share keys and values
    has its layer read them and store its own; stacked hidden states (AltUp) go in stacked."""
    state = own_copies(detached(w, call.frozen), call.written)
    if call.buffers:
        state = {**state, **call.buffers}
    hidden, args, kwargs, inputs, kv, states = x, call.args, call.kwargs, None, None, None
    if call.per_layer is not None:
        hidden, inputs = call.per_layer.split(x)
        args = call.per_layer.placed(call.args, inputs)
    if call.kv is not None:
        hidden, kv = call.kv.split(hidden)
        states = call.kv.states(kv)
        kwargs = {**kwargs, "shared_kv_states": states}
    out = hm.layer_output(torch.func.functional_call(call.module, state, (stacked(hidden, call.stack), *args), kwargs,
                                                     strict=False))
    out = side_by_side(out, call.stack)
    if inputs is not None:
        out = call.per_layer.added(out, inputs)
    flowing = [out] + ([call.kv.after(kv, states)] if kv is not None else []) + \
        ([inputs.flatten(-2)] if inputs is not None else [])
    return flowing[0] if len(flowing) == 1 else torch.cat(flowing, dim=-1)


def block_with_router_stats(arch: TransformersArch, w: Weights, x: torch.Tensor, call: LayerCall):
    """The block and its routers' statistics [2, E]: each expert's top-k assignments (no gradient)
    and its routing probabilities summed over tokens; None for a layer without a router."""
    if not call.routers:
        return block_forward(w, x, call), None
    index = router_recorder(parts(arch).model)[1]
    logits: list[torch.Tensor] = []

    def keep(module, inputs, output):
        logits.append(output[index] if isinstance(output, (tuple, list)) else output)

    hooks = [router.register_forward_hook(keep) for router in call.routers]
    try:
        y = block_forward(w, x, call)
    finally:
        for hook in hooks:
            hook.remove()
    experts, per_token, _ = aux_settings(arch)
    probs = F.softmax(torch.cat([t.reshape(-1, t.shape[-1]) for t in logits]).float(), dim=-1)
    chosen = torch.topk(probs, per_token, dim=-1).indices
    counts = F.one_hot(chosen, experts).sum(dim=(0, 1)).float()
    return y, torch.stack([counts.detach(), probs.sum(dim=0)])


def head_state(head_call: HeadCall, head: Weights, embed: Weights | None) -> dict[str, torch.Tensor]:
    head = detached(head, head_call.frozen)
    if head_call.stand_ins:  # the decoder's weights before its layers, read on a stand-in input
        some = next(iter(head.values()))
        zero = torch.zeros((), dtype=some.dtype, device=some.device)
        head = {**{name: zero.expand(shape) for name, shape in head_call.stand_ins}, **head}
    if head_call.tied is None:
        return head
    assert embed is not None, "tied embeddings: the head needs the embedding's weights"
    out_name, in_name = head_call.tied
    return {**head, out_name: embed[in_name]}


def head_logits(head_call: HeadCall, state: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The causal LM's own head on hidden states [..., H]: final norm, LM head, its scaling and
    soft-capping; logits [..., vocab]."""
    flat = x.reshape(1, -1, x.shape[-1])
    out = torch.func.functional_call(head_call.module, state, (), {"inputs_embeds": flat, "use_cache": False},
                                     strict=False)
    return out.logits.reshape(*x.shape[:-1], -1)


def chunk_loss(head_call: HeadCall, state: dict, hidden: torch.Tensor, _unused: torch.Tensor,
                labels: torch.Tensor) -> torch.Tensor:
    logits = head_logits(head_call, state, hidden).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
