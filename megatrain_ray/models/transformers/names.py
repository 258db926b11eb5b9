"""The transformers family's layers and tensor names: the model's own tensors flat per layer
(the embedding, each block, the head), which train and which a gradient reaches, the names and
pieces checkpoint files store them as, and the multi-token-prediction layers the files hold beside
them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import torch

from megatrain_ray.models.layout import BLOCK, EMBED, HEAD, LayerLayout, lay_out, marked_slots
from megatrain_ray.models.moe import stored_as, stored_in_rows, stored_per_expert
from megatrain_ray.models.transformers import modules as hm
from megatrain_ray.models.transformers.arch import TransformersArch, expert_counts, parts
from megatrain_ray.models.transformers.flow import decoder_config
from megatrain_ray.models.transformers.recording import buffer_names


def _local_shapes(tensors: dict[str, torch.Tensor], keep=lambda name: True) -> list[tuple[str, tuple[int, ...]]]:
    return [(name, tuple(t.shape)) for name, t in tensors.items() if keep(name)]


@functools.lru_cache(maxsize=8)
def layouts_of(arch: TransformersArch) -> tuple[LayerLayout, ...]:
    p = parts(arch)
    base_tensors = hm.persistent_tensors(p.base)
    after = tuple(p.decoder_in_root + m + "." for m in (p.final_norm, *p.after_layers))  # the head's
    in_layers = p.decoder_in_root + p.layers_name + "."
    # the embedding: everything the model runs before its first layer (an image-text model's vision
    # tower and projector too), as named under the module that runs it
    embed = _local_shapes(hm.persistent_tensors(p.root), lambda n: not n.startswith((in_layers, *after)))
    vision = vision_names(p)
    # the vision tower last: frozen (registry.model_layouts, unless model.train_vision), it holds no moments
    embed = [s for s in embed if s[0] not in vision] + [s for s in embed if s[0] in vision]
    ungraded = ungraded_tensors(arch, p)
    layouts = [marked_slots(lay_out(0, EMBED, p.root_prefix, embed), ungraded[0], gets_gradient=False)]
    for i, layer in enumerate(p.layers):
        # a block that several layers share lies in the first of them (modules.shared_tensors)
        shared = p.shared_names[i]
        block = lay_out(i + 1, BLOCK, f"{p.base_prefix}{p.layers_name}.{i}.",
                        _local_shapes(hm.persistent_tensors(layer), lambda n: n not in shared))
        block = marked_slots(block, ungraded[i + 1], gets_gradient=False)
        layouts.append(block if p.shares[i] is None else dataclasses.replace(block, shares=(p.shares[i] + 1,)))
    outer = _local_shapes(hm.persistent_tensors(p.model), lambda n: not n.startswith(p.root_prefix))
    head_modules = tuple(m + "." for m in (p.final_norm, *p.after_layers))
    head = [(p.base_prefix + n, s) for n, s in _local_shapes(base_tensors, lambda n: n.startswith(head_modules))]
    if p.tied:
        outer = [(n, s) for n, s in outer if n != output_embedding_name(p)]
    layouts.append(marked_slots(lay_out(len(p.layers) + 1, HEAD, "", head + outer), ungraded[-1],
                                gets_gradient=False))
    return with_stored_names(arch, p, tuple(layouts))


def output_embedding_name(p: hm.Parts) -> str:
    out = p.model.get_output_embeddings()
    return next(n for n, m in p.model.named_modules() if m is out) + ".weight"


def input_embedding_name(p: hm.Parts) -> str:
    """The input embedding's name in the embedding layer (under the module that runs it)."""
    inp = p.model.get_input_embeddings()
    return next(n for n, m in p.root.named_modules() if m is inp) + ".weight"


def vision_names(p: hm.Parts) -> frozenset[str]:
    """An image-text model's vision tower and projector: the embedding layer's tensors outside its
    language model (none for a decoder alone)."""
    if not p.decoder_in_root:
        return frozenset()
    return frozenset(n for n in hm.persistent_tensors(p.root) if not n.startswith(p.decoder_in_root))


def ungraded_tensors(arch: TransformersArch, p: hm.Parts) -> list[frozenset[str]]:
    """Per layer (the embedding, each block, the head), the local names of its tensors that no
    gradient reaches (ParamSlot.gets_gradient): its persistent buffers, and in a decoder its
    parameters that transformers' forward runs but never differentiates, as a small instance of the
    same structure shows (modules.ungraded_parameters; a block's are its template's, the small
    instance's first block of its structure)."""
    small = frozenset() if p.decoder_in_root else _ungraded_parameters(arch.hf_config, p.kinds)

    def under(module_prefix: str) -> frozenset[str]:  # a name no slot of the layer has marks nothing
        return frozenset(n[len(module_prefix):] for n in small if n.startswith(module_prefix))

    blocks = [buffer_names(layer) | under(f"{p.base_prefix}{p.layers_name}.{p.kinds[i]}.")
              for i, layer in enumerate(p.layers)]
    return [buffer_names(p.root) | under(p.root_prefix), *blocks, buffer_names(p.model) | small]


@functools.lru_cache(maxsize=8)
def _ungraded_parameters(config_json: str, kinds: tuple[int, ...]) -> frozenset[str]:
    return hm.ungraded_parameters(hm.build_small(hm.small_config(json.loads(config_json), kinds)))


def with_stored_names(arch: TransformersArch, p: hm.Parts, layouts: tuple[LayerLayout, ...]) -> tuple[LayerLayout, ...]:
    """Each slot that transformers stores in pieces (stacked experts stored one by one) or under
    another name says so (ParamSlot.stored_as), as a small instance of the same structure shows
    (modules.expert_pieces); a decoder or list of layers stored under another name (Nemotron-H's
    `model.` as `backbone.`, EXAONE 3's `model.layers.` as `transformer.h.`) has its layers say
    where (LayerLayout.stored_prefix)."""
    pieces = _image_text_expert_pieces(arch.hf_config, p.kinds) if p.decoder_in_root \
        else _expert_pieces(arch.hf_config, p.kinds)
    if not pieces:
        return layouts
    stored_decoder, stored_layers = decoder_stored_prefixes(p, pieces, layouts)
    in_layers = f"{p.base_prefix}{p.layers_name}."

    def stored(prefix: str) -> str:
        if prefix.startswith(in_layers):
            return stored_layers + prefix[len(in_layers):]
        if prefix.startswith(p.base_prefix):  # the embedding
            return stored_decoder + prefix[len(p.base_prefix):]
        return prefix

    out = []
    for layout in layouts:
        # a block is stored as the small instance's first block of its structure
        small_prefix = layout.prefix
        if layout.kind == BLOCK:
            small_prefix = f"{p.base_prefix}{p.layers_name}.{p.kinds[layout.index - 1]}."
        stored_prefix, small_stored = stored(layout.prefix), stored(small_prefix)
        params = []
        for s in layout.params:
            templates = pieces.get(small_prefix + s.name)
            if templates and isinstance(templates[0], tuple):  # cut along its rows, in order
                s = stored_in_rows(s, [(_local(small_stored, name), shape)
                                       for name, shape in row_pieces(p, small_prefix + s.name, templates, s.shape)])
            elif templates:
                local = tuple(_local(small_stored, t) for t in templates)
                if "{}" in local[0]:
                    s = stored_per_expert(s, lambda e, local=local: [t.format(e) for t in local])
                else:
                    s = stored_as(s, local[0])
            elif stored_prefix != layout.prefix:
                raise hm.Unsupported(f"transformers stores {small_prefix + s.name} as it is, but the rest of its "
                                     f"layer ({small_prefix}) under {small_stored}")
            params.append(s)
        out.append(dataclasses.replace(layout, params=tuple(params),
                                       stored_prefix=None if stored_prefix == layout.prefix else stored_prefix))
    return tuple(out)


def row_pieces(p: hm.Parts, name: str, small: tuple[tuple[str, tuple], ...],
               shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """The pieces, (stored name, shape) in order along its rows, that transformers stores the
    model's tensor `name` as: the small instance's names and order (`small`, found from its values),
    the sizes this model's own reverse conversion gives its tensor (modules.stored_shapes)."""
    shapes = hm.stored_shapes(p.model, [name])
    pieces = [(stored, shapes.get(stored)) for stored, _small_shape in small]
    if set(shapes) != {stored for stored, _ in pieces} or sum(s[0] for _, s in pieces) != shape[0] or \
            any(tuple(s[1:]) != tuple(shape[1:]) for _, s in pieces):
        raise hm.Unsupported(f"transformers stores {name} {tuple(shape)} as {shapes}, not its rows cut in the pieces "
                             f"a small instance shows ({', '.join(stored for stored, _ in small)})")
    return pieces


def decoder_stored_prefixes(p: hm.Parts, pieces: dict[str, tuple], layouts) -> tuple[str, str]:
    """The prefixes under which transformers stores the decoder's tensors and its list of layers
    (each layer's index after it): its own (`model.`, `model.layers.`), or the ones their stored
    names share (Nemotron-H's `backbone.`, `backbone.layers.`; EXAONE 3's `transformer.`,
    `transformer.h.`), as the small instance shows: its first layer of each structure is one of the
    layouts' (a layer's own index is its template's)."""
    def stored(name: str) -> str:
        first = pieces.get(name, (name,))[0]
        return first[0] if isinstance(first, tuple) else first  # cut along its rows: (name, shape)

    def in_template(layout: LayerLayout) -> list[str]:
        if layout.kind == BLOCK and p.kinds[layout.index - 1] != layout.index - 1:
            return []
        names = [layout.prefix + s.name for s in layout.params]
        return [stored(name) for name in names if name.startswith(p.base_prefix)]

    decoder = shared_module_prefix([n for layout in layouts for n in in_template(layout)])
    layers = set()
    for layout in layouts:
        names = in_template(layout) if layout.kind == BLOCK else []
        if not names:
            continue
        index, shared = str(layout.index - 1), shared_module_prefix(names)
        parts = shared[len(decoder):].split(".")
        if not shared.startswith(decoder) or index not in parts:
            raise hm.Unsupported(f"transformers stores the tensors of its layer {index} as {names[0]}, ..., "
                                 f"not under one prefix with the layer's index")
        layers.add(decoder + "".join(part + "." for part in parts[:parts.index(index)]))
    if len(layers) != 1:
        raise hm.Unsupported(f"transformers stores its layers under several prefixes ({', '.join(sorted(layers))})")
    return decoder, layers.pop()


def shared_module_prefix(names: list[str]) -> str:
    """The longest module path that all the tensor names lie under ("" for none), with its dot."""
    paths = [name.split(".")[:-1] for name in names]
    shared = []
    for parts in zip(*paths):
        if any(part != parts[0] for part in parts):
            break
        shared.append(parts[0])
    return "".join(part + "." for part in shared)


@functools.lru_cache(maxsize=8)
def _expert_pieces(config_json: str, kinds: tuple[int, ...]) -> dict[str, tuple[str, ...]]:
    config = json.loads(config_json)
    return hm.expert_pieces(hm.build_small(hm.small_config(config, kinds)))


@functools.lru_cache(maxsize=8)
def _image_text_expert_pieces(config_json: str, kinds: tuple[int, ...]) -> dict[str, tuple]:
    """An image-text decoder's experts that transformers stores one by one (Qwen3.5-MoE's), as a
    small instance shows; its tensors stored whole under other names are renamed_in_files'."""
    config = json.loads(config_json)
    if not expert_counts(config["text_config"])[0]:
        return {}
    pieces = hm.expert_pieces(hm.build_small(hm.small_image_text_config(config, kinds)))
    return {name: stored for name, stored in pieces.items() if len(stored) > 1 or "{}" in stored[0]}


@functools.lru_cache(maxsize=8)
def renamed_in_files(config_json: str) -> dict[str, str]:
    """An image-text model's tensors that save_pretrained stores under other names (their names
    before transformers 5: `language_model.model.layers.0...`, `visual.blocks...`): stored name ->
    in-memory name, by transformers' own reverse conversion. The layouts and the exports use the
    in-memory names, which transformers loads as they are; files in the older names are read too."""
    from transformers.core_model_loading import revert_weight_conversion

    model = hm.parts_of(config_json).model
    state = model.state_dict()
    memory = {id(t): name for name, t in state.items()}
    stored = revert_weight_conversion(model, dict(state))
    return {name: memory[id(t)] for name, t in stored.items() if memory.get(id(t), name) != name}


def _local(prefix: str, name: str) -> str:
    if not name.startswith(prefix):
        raise hm.Unsupported(f"transformers stores a tensor of {prefix or 'the head'} as {name}, outside it")
    return name[len(prefix):]


# config.json keys that count multi-token-prediction layers
MTP_KEYS = ("num_nextn_predict_layers", "num_mtp_layers", "mtp_num_hidden_layers", "num_mtp_modules")


# where Qwen3-Next and Qwen3.5 store their multi-token-prediction module: beside the model, which
# ignores it on load (its class's _keys_to_ignore_on_load_unexpected)
MTP_MODULE = "mtp."


def mtp_layers(config: dict[str, Any]) -> int:
    """The multi-token-prediction layers a config counts (an image-text model's: its decoder's)."""
    config = decoder_config(config)
    return next((config[k] for k in MTP_KEYS if isinstance(config.get(k), int) and config[k] > 0), 0)


def mtp_layer_of(arch: TransformersArch, name: str) -> int | None:
    """The layer index of a tensor named under the decoder's layers past its last one, else None."""
    p = parts(arch)
    prefix = f"{p.base_prefix}{p.layers_name}."
    if not name.startswith(prefix):
        return None
    index = name[len(prefix):].split(".", 1)[0]
    return int(index) if index.isdigit() and int(index) >= len(p.layers) else None
