"""The transformers family: any decoder-only causal LM that transformers builds, run through its
own modules as stateless templates.

Its arch carries the model's whole config.json; its layers are the model's own: the embedding
(everything of the decoder before its layers), one block per decoder layer with its parameters
flat under their Hugging Face names, and the head (the final norm and the LM head). Layers of one
structure share a template module (models/hf_modules.py), called with torch.func.functional_call
on views of the streamed slot, so weights stay streamed and owned by the stores. It is chosen for
every model_type without a hand-written family (model.implementation auto), or for any with
model.implementation transformers.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatrain_ray.models import hf_modules as hm
from megatrain_ray.models import ops
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.family import IGNORE_INDEX, ModelFamily, Weights
from megatrain_ray.models.layout import BLOCK, EMBED, HEAD, LayerLayout, ParamSlot, lay_out
from megatrain_ray.models.image_text import embed_inputs, is_pixels, tower_bytes, vision_kwargs
from megatrain_ray.models.moe import stored_as, stored_in_rows, stored_per_expert

# config.json keys that say nothing about the model's tensors or arithmetic
VOLATILE_KEYS = ("transformers_version", "_name_or_path", "torch_dtype", "dtype", "architectures",
                 "_attn_implementation_autoset", "_commit_hash", "use_cache")


@dataclass(frozen=True)
class TransformersArch(ModelArch):
    """The shared fields (for the planner and the data), read from the config; `hf_config` is the
    whole config.json as canonical JSON (its class's defaults filled in): it decides the model."""

    hf_config: str = "{}"
    # A layer's working set per token in units of the compute dtype, the largest of its kinds as
    # planning/probe.py measured it on the run's device; 0: the estimate (WORKING_SET_PER_TOKEN)
    measured_working_set: float = 0.0
    # An image-text model's vision tower and projector train (model.train_vision); else frozen
    train_vision: bool = False

    @property
    def config(self) -> dict[str, Any]:
        return json.loads(self.hf_config)

    def model_fields(self) -> list[str]:
        return [name for name in super().model_fields() if name not in ("measured_working_set", "train_vision")]

    @property
    def per_layer_input_width(self) -> int:
        """The width of the input of its own that the embedding hands each decoder layer beside the
        hidden states (Gemma 3n/4's per-layer input embeddings, hidden_size_per_layer_input); 0 for
        a model without; an image-text model's: its decoder's, Gemma 4's)."""
        return int(decoder_config(self.config).get("hidden_size_per_layer_input") or 0)

    @property
    def deepstack_layers(self) -> int:
        """How many of the first decoder layers add to their output, at the image tokens, features
        of the vision tower's inner layers (Qwen3-VL's deepstack, vision_config's
        deepstack_visual_indexes: one feature map each); 0 for a model without."""
        vision = self.config.get("vision_config") or {}
        return min(len(vision.get("deepstack_visual_indexes") or ()), self.num_layers)

    @property
    def hidden_stack(self) -> int:
        """How many copies of the hidden states its layers take, stacked (Gemma 3n's AltUp
        predictions, altup_num_inputs); 1 for a model without."""
        return hidden_stack(self.config)

    @property
    def hidden_width(self) -> int:
        """The width of the hidden states of what flows between layers (the head reads these)."""
        return self.hidden_stack * self.hidden_size

    @property
    def shared_kv_width(self) -> int:
        """The width of the keys and values that layers store for later layers to reuse (Gemma 3n/4's
        shared KV), carried behind the hidden states; 0 for a model whose layers share none."""
        kv = shared_kv_of(self.hf_config)
        return kv.width if kv else 0

    @property
    def behind_hidden(self) -> tuple[int, int]:
        """(how many, how wide): the inputs of their own that flow behind the hidden states, one
        slice per layer that reads one: Gemma 4's per-layer inputs (every layer's), or Qwen3-VL's
        deepstack features (one per deepstack layer, hidden_size wide); or one that every layer
        reads (Zamba2's embedding output: common_input_of)."""
        if self.per_layer_input_width:
            return self.num_layers, self.per_layer_input_width
        if self.deepstack_layers:
            return self.deepstack_layers, self.hidden_size
        common = common_input_of(self.hf_config)
        return (1, common[1]) if common else (0, 0)

    @property
    def stream_width(self) -> int:
        """What flows between layers: the hidden states, the keys and values stored for later
        layers, then the layers' own inputs (the embedding computes them all; each block reads its
        own and hands all of them on)."""
        count, width = self.behind_hidden
        return self.hidden_width + self.shared_kv_width + count * width


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
    decoder, calls, _ = _recording_decoder(config_json, len(p.layers) - 1)
    calls.clear()
    cpu = torch.device("cpu")
    hidden = torch.zeros(1, 2, int(p.base.config.hidden_size))
    state = {**_buffers_on(config_json, "base", cpu), **stand_in_weights(p, torch.float32, cpu)}
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


def canonical_config(config: dict[str, Any]) -> dict[str, Any]:
    cfg = hm.config_object(config)
    full = json.loads(cfg.to_json_string(use_diff=False))
    return {k: v for k, v in sorted(full.items()) if k not in VOLATILE_KEYS}


def arch_from_config(config: dict[str, Any]) -> TransformersArch:
    canon = canonical_config(config)
    cfg = hm.config_object(canon).get_text_config()  # an image-text model's sizes are its decoder's
    value = functools.partial(_global_value, cfg)
    hidden = int(cfg.hidden_size)
    heads = int(value("num_attention_heads") or 1)  # none: a recurrent model
    kv = int(value("num_key_value_heads") or heads)
    head_dim = value("head_dim") or hidden // heads
    intermediate = value("intermediate_size") or value("moe_intermediate_size") or 4 * hidden
    tied = hm.parts_of(json.dumps(canon, sort_keys=True)).tied
    return TransformersArch(
        model_type=canon["model_type"], vocab_size=int(cfg.vocab_size), hidden_size=hidden,
        intermediate_size=int(intermediate), num_layers=int(cfg.num_hidden_layers), num_heads=heads,
        num_kv_heads=kv if heads % kv == 0 else heads, head_dim=int(head_dim),
        rms_norm_eps=float(value("rms_norm_eps") or 1e-6),
        tie_word_embeddings=tied,
        max_position_embeddings=int(value("max_position_embeddings") or 4096),
        hf_config=json.dumps(canon, sort_keys=True),
    )


def _global_value(cfg, name: str):
    """A config value for the planner's shared fields; None where the config has none, or one per
    layer only (Gemma 4's per_layer_config: the planner's estimate then falls back)."""
    try:
        value = getattr(cfg, name, None)
    except Exception:  # transformers refusing a global read of a per-layer attribute
        return None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def parts(arch: TransformersArch) -> hm.Parts:
    return hm.parts_of(arch.hf_config)


# ---------------------------------------------------------------------------------------------
# Layouts: the model's own tensors, flat per layer
# ---------------------------------------------------------------------------------------------


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
    embed = [s for s in embed if s[0] not in vision] + [s for s in embed if s[0] in vision]  # the vision tower last
    frozen_names = frozenset() if arch.train_vision else vision
    embedding = lay_out(0, EMBED, p.root_prefix, embed)
    ungraded = ungraded_tensors(arch, p)
    layouts = [marked_slots(frozen_slots(embedding, frozen_names), ungraded[0], gets_gradient=False)]
    for i, layer in enumerate(p.layers):
        # a block that several layers share lies in the first of them (hf_modules.shared_tensors)
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


def frozen_slots(layout: LayerLayout, names: frozenset[str]) -> LayerLayout:
    """The layout with the named tensors marked untrained (ParamSlot.trained): the vision tower, at
    the embedding layer's end whether it trains or not (the same offsets either way), then holds no
    optimizer state (LayerLayout.trained_numel)."""
    return marked_slots(layout, names, trained=False)


def ungraded_tensors(arch: TransformersArch, p: hm.Parts) -> list[frozenset[str]]:
    """Per layer (the embedding, each block, the head), the local names of its tensors that no
    gradient reaches (ParamSlot.gets_gradient): its persistent buffers, and in a decoder its
    parameters that transformers' forward runs but never differentiates, as a small instance of the
    same structure shows (hf_modules.ungraded_parameters; a block's are its template's, the small
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


def marked_slots(layout: LayerLayout, names: frozenset[str], **fields) -> LayerLayout:
    """The layout with the named tensors' slots given `fields` (ParamSlot's: trained, gets_gradient)."""
    if not names & {s.name for s in layout.params}:
        return layout
    params = tuple(dataclasses.replace(s, **fields) if s.name in names else s for s in layout.params)
    return dataclasses.replace(layout, params=params)


def with_stored_names(arch: TransformersArch, p: hm.Parts, layouts: tuple[LayerLayout, ...]) -> tuple[LayerLayout, ...]:
    """Each slot that transformers stores in pieces (stacked experts stored one by one) or under
    another name says so (ParamSlot.stored_as), as a small instance of the same structure shows
    (hf_modules.expert_pieces); a decoder or list of layers stored under another name (Nemotron-H's
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
    the sizes this model's own reverse conversion gives its tensor (hf_modules.stored_shapes)."""
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


# config.json keys of what a training forward draws at random, and such keys of heads other than the causal LM's
RANDOM_KEYS = ("dropout", "pdrop", "jitter")  # GPT-2 names its dropouts resid_pdrop, embd_pdrop, attn_pdrop
UNUSED_KEYS = ("classifier_dropout", "summary_first_dropout")


def random_settings(config: dict[str, Any]) -> dict[str, float]:
    """The config's positive dropout and jitter settings (a training forward draws random numbers),
    an image-text model's sub-configs' too (as `text_config.attention_dropout`)."""
    found = {k: v for k, v in config.items() if any(word in k for word in RANDOM_KEYS) and k not in UNUSED_KEYS
             and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0}
    for part in ("text_config", "vision_config"):
        if isinstance(config.get(part), dict):
            found.update({f"{part}.{k}": v for k, v in random_settings(config[part]).items()})
    return found


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


# ---------------------------------------------------------------------------------------------
# The stateless templates
# ---------------------------------------------------------------------------------------------


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


def buffer_names(module: torch.nn.Module) -> frozenset[str]:
    """Local names of a module's persistent buffers (in checkpoints, not parameters)."""
    params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    return frozenset(n for n in hm.persistent_tensors(module) if n not in params)


def frozen(w: Weights, names: frozenset[str]) -> Weights:
    """The weights with the model's persistent buffers (a router's score bias, an activation's
    constants) detached: checkpoints hold them and they stream with their layer, but they are no
    parameters, so no gradient reaches them and AdamW, given zero, leaves them as they are."""
    return {k: (v.detach() if k in names else v) for k, v in w.items()} if names else w


@functools.lru_cache(maxsize=64)
def _buffers_on(config_json: str, where: str, device: torch.device) -> dict[str, torch.Tensor]:
    """A module's non-persistent buffers (rotary frequencies) on `device`, made once per device.
    `where`: "base" (the decoder) or a template's layer index."""
    p = hm.parts_of(config_json)
    module = p.root if where == "base" else p.layers[int(where)]
    layers = p.decoder_in_root + p.layers_name + "." if where == "base" else "\0"
    return {n: b.to(device) for n, b in hm.transient_buffers(module).items() if not n.startswith(layers)}


@functools.lru_cache(maxsize=64)
def _template_frozen(config_json: str, template: int) -> frozenset[str]:
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
def _recording_decoder(config_json: str, stop_after: int):
    """The module that runs from the inputs to the first layer, its layers recording, and the
    decoder's own keyword arguments kept (hm.recording_root)."""
    calls: list = []
    entered: dict = {}
    return hm.recording_root(hm.parts_of(config_json), calls, stop_after, entered), calls, entered


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
    decoder, calls, entered = _recording_decoder(arch.hf_config, len(p.layers) - 1 if width else 0)
    calls.clear()
    w = frozen(w, buffer_names(p.root) | (frozenset() if arch.train_vision else vision_names(p)))
    inputs = inputs if isinstance(inputs, dict) else {"input_ids": inputs}  # ids alone: positions from 0
    kwargs = vision_kwargs(inputs, w) if p.decoder_in_root else inputs
    device = kwargs["input_ids"].device
    hm.run_until_layers(decoder, {**w, **_buffers_on(arch.hf_config, "base", device)}, calls, **kwargs)
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
def _stand_ins_on(config_json: str, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """stand_in_weights made once per device and dtype: layer_calls runs for every micro-batch, and the
    stand-ins are only read (expanded zeros cannot be written)."""
    return stand_in_weights(hm.parts_of(config_json), dtype, device)


def layer_calls(arch: TransformersArch, position_ids: torch.Tensor, dtype: torch.dtype,
                inputs: dict | None = None) -> list[LayerCall]:
    """Per decoder layer, the arguments its decoder passes it for these positions, recorded from
    the decoder's own forward on a stand-in input (so masks, windows, chunks and rotary tables are
    the model's own; packed documents are told from the position ids as transformers tells them).
    An image-text model's are recorded from its own forward on its `inputs` (image_text.embed_inputs)
    with a stand-in embedding and no images: its positions (Qwen2.5-VL's 3D rotary positions from
    the image grids) and masks (Gemma 3's bidirectional attention within an image) as it makes them."""
    p = parts(arch)
    decoder, calls, _ = _recording_decoder(arch.hf_config, len(p.layers) - 1)
    calls.clear()
    b, t = position_ids.shape
    # what runs before the first layer reads stand-in weights (a learned position embedding, a norm
    # of the embeddings, per-layer input projections): the blocks get the real ones
    state = {**_buffers_on(arch.hf_config, "base", position_ids.device),
             **_stand_ins_on(arch.hf_config, dtype, position_ids.device)}
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
    buffers = _buffers_on(arch.hf_config, str(t), device)
    module = parts(arch).layers[t]
    return LayerCall(t, call.args, call.kwargs, module, _template_frozen(arch.hf_config, t), buffers or None,
                     routers_in(arch, module), call.per_layer, call.kv, call.stack, written_in_place(arch.hf_config, t))


def own_copies(state: dict[str, torch.Tensor], names: frozenset[str]) -> dict[str, torch.Tensor]:
    """`state` with a copy of each named weight, for a layer that writes them in place: its write
    lands in the copy, which it computes with (its gradient passes through to the weight, as to the
    written parameter in transformers), never in the weights streamed to it. Those are views of one
    slot (streaming/executor.py) sharing one version counter, and torch.compile turns a write
    through `.data` into a write to the block's input, which counts: the backward of the compiled
    block would then refuse every tensor it saved of that slot (a norm's weight) as modified."""
    return {**state, **{name: state[name].clone() for name in names}} if names else state


def compiled_variant(arch: TransformersArch, index: int) -> tuple:
    """What torch.compile specialises layer `index`'s block on: its template, and the Python values
    of its call that the block branches on (LayerCall: PerLayerInput.adds, SharedKV's mode and type)."""
    kv = layer_kv(arch.hf_config, index)
    return parts(arch).kinds[index], index < arch.deepstack_layers, kv and (kv.mode, kv.layer_type)


def block_forward(w: Weights, x: torch.Tensor, call: LayerCall) -> torch.Tensor:
    """The layer on what flows in; a model with per-layer inputs has its layer read its own slice
    of them (in place of the recorded stand-in), one with deepstack features adds its own to its
    output, and either hands them all on behind its output; one whose layers share keys and values
    has its layer read them and store its own; stacked hidden states (AltUp) go in stacked."""
    state = own_copies(frozen(w, call.frozen), call.written)
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


def stacked(hidden: torch.Tensor, stack: int) -> torch.Tensor:
    """[..., stack x hidden] as the layers take stacked hidden states: [stack, ..., hidden]."""
    return hidden if stack == 1 else hidden.unflatten(-1, (stack, -1)).movedim(-2, 0)


def side_by_side(hidden: torch.Tensor, stack: int) -> torch.Tensor:
    """Stacked hidden states [stack, ..., hidden] as they flow: [..., stack x hidden]."""
    return hidden if stack == 1 else hidden.movedim(0, -2).flatten(-2)


# ---------------------------------------------------------------------------------------------
# The router's load-balancing loss (transformers' load_balancing_loss_func)
# ---------------------------------------------------------------------------------------------


def router_recorder(model: torch.nn.Module) -> tuple[type, int] | None:
    """(router class, index of its logits in its output) as the model records router logits for
    its load-balancing loss; None for a model that records none."""
    spec = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    if spec is None:
        return None
    if isinstance(spec, type):
        return spec, 0
    target = getattr(spec, "target_class", None)
    return (target, getattr(spec, "index", None) or 0) if isinstance(target, type) else None


def aux_settings(arch: TransformersArch) -> tuple[int, int, float] | None:
    """(experts, experts per token, coefficient) of the causal LM's own loss, where it computes one."""
    p = parts(arch)
    values = [getattr(p.model, name, None) for name in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")]
    if router_recorder(p.model) is None or not all(isinstance(v, (int, float)) for v in values):
        return None
    return int(values[0]), int(values[1]), float(values[2])


@functools.lru_cache(maxsize=64)
def _router_names(config_json: str, template: int) -> tuple[str, ...]:
    p = hm.parts_of(config_json)
    spec = router_recorder(p.model)
    if spec is None:
        return ()
    return tuple(n for n, m in p.layers[template].named_modules() if isinstance(m, spec[0]))


def routers_in(arch: TransformersArch, module: torch.nn.Module) -> tuple:
    if not arch.config.get("output_router_logits"):
        return ()
    template = parts(arch).layers.index(module)
    return tuple(module.get_submodule(n) for n in _router_names(arch.hf_config, template))


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


def router_aux_term(arch: TransformersArch, stats: torch.Tensor, totals: torch.Tensor) -> torch.Tensor:
    """One layer's share of coef x load_balancing_loss_func over all layers' router logits:
    E x sum_e C_e p_e / rows^2, with C all layers' assignment counts (constants), p this layer's
    probability sums and rows the tokens times the layers with a router (models/moe.py derives it)."""
    experts, per_token, coef = aux_settings(arch)
    counts = totals[0].detach()
    rows = counts.sum() / per_token
    return coef * experts * (counts * stats[1]).sum() / (rows * rows)


def head_state(head_call: HeadCall, head: Weights, embed: Weights | None) -> dict[str, torch.Tensor]:
    head = frozen(head, head_call.frozen)
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


def _chunk_loss(head_call: HeadCall, state: dict, hidden: torch.Tensor, _unused: torch.Tensor,
                labels: torch.Tensor) -> torch.Tensor:
    logits = head_logits(head_call, state, hidden).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


# ---------------------------------------------------------------------------------------------
# The family
# ---------------------------------------------------------------------------------------------

EXPERT = re.compile(r"(^|\.)experts\.")


def expert_counts(config: dict[str, Any]) -> tuple[int, int]:
    """(routed experts, experts per token) of a mixture-of-experts config; (0, 0) for a dense one."""
    experts = next((config[k] for k in ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
                    if isinstance(config.get(k), int) and config[k] > 0), 0)
    per_token = next((config[k] for k in ("num_experts_per_tok", "moe_k", "top_k", "experts_per_token")
                      if isinstance(config.get(k), int) and config[k] > 0), 0)
    return experts, per_token


def inactive_in(arch: TransformersArch, layout: LayerLayout) -> int:
    """A layer's expert parameters a token does not use: (E - k) / E of its routed experts' tensors."""
    experts, per_token = expert_counts(arch.config)
    if not experts:
        return 0
    routed = sum(p.numel for p in layout.params if EXPERT.search(p.name))
    return routed * (experts - per_token) // experts


# Per token, a dense decoder layer's tensors alive during its recompute and backward, in units of
# the compute dtype: the Llama family's fit (models/llama.py). An estimate for other structures
# until the probe measures them (planning/probe.py).
WORKING_SET_PER_TOKEN = (13, 1)  # x hidden_size, x intermediate_size


def _device_of(call: LayerCall) -> torch.device:
    """The device of a recorded call's tensors (its rotary tables, mask, position ids)."""
    for value in [*call.args, *call.kwargs.values()]:
        for t in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(t, torch.Tensor):
                return t.device
    return torch.device("cpu")


class TransformersFamily(ModelFamily):
    """Chosen by the registry for an arch of its own type (TransformersArch), not by model_type."""

    arch_type = TransformersArch

    # -- shapes and names ------------------------------------------------------------------------
    def arch_from_hf(self, config: dict[str, Any]) -> TransformersArch:
        return arch_from_config(config)

    def hf_config(self, arch: TransformersArch, torch_dtype: str) -> dict[str, Any]:
        return {**arch.config, "architectures": [type(parts(arch).model).__name__], "torch_dtype": torch_dtype}

    def layouts(self, arch: TransformersArch) -> tuple[LayerLayout, ...]:
        return layouts_of(arch)

    def draws_random(self, arch: TransformersArch) -> bool:
        return bool(random_settings(arch.config))

    @contextlib.contextmanager
    def evaluating(self, arch: TransformersArch):
        """transformers' modules in eval mode (no dropout), then in train mode again."""
        model = parts(arch).model
        model.train(False)
        try:
            yield
        finally:
            model.train(True)

    def read_as(self, arch: TransformersArch, name: str) -> str:
        return renamed_in_files(arch.hf_config).get(name, name) if parts(arch).decoder_in_root else name

    def carried(self, arch: TransformersArch, name: str) -> bool:
        """The tensors of the multi-token-prediction layers, stored as the decoder's layers after
        its last (model.layers.61.* for DeepSeek-V3) or as a module beside the model (`mtp.*`,
        Qwen3.5's), which transformers' model does not build."""
        return mtp_layers(arch.config) > 0 and (mtp_layer_of(arch, name) is not None or name.startswith(MTP_MODULE))

    def carried_note(self, arch: TransformersArch) -> str | None:
        n = mtp_layers(arch.config)
        if not n:
            return None
        return (f"{n} multi-token-prediction layer{'s' if n > 1 else ''} (config.json): run neither by "
                "transformers' model nor here; their tensors are carried unchanged to the checkpoints and the export")

    def init_param(self, slot: ParamSlot, view: torch.Tensor, gen: torch.Generator, std: float) -> None:
        """Random init for benchmarks: matrices normal, biases zero, other vectors (norms) one."""
        if slot.name.endswith("bias"):
            view.zero_()
        elif len(slot.shape) < 2:
            view.fill_(1.0)
        else:
            view.normal_(0.0, std, generator=gen)

    # -- the stateless templates -----------------------------------------------------------------
    def __init__(self):
        # config.json -> its HeadCall, read inside the compiled head by a plain dict lookup (a
        # cached function there would be traced into); filled by `context`, outside it
        self._heads: dict[str, HeadCall] = {}

    def _head(self, arch: TransformersArch) -> HeadCall:
        found = self._heads.get(arch.hf_config)
        if found is None:
            found = self._heads[arch.hf_config] = head_call(arch.hf_config)
        return found

    def context(self, arch: TransformersArch, position_ids: torch.Tensor, dtype: torch.dtype,
                packed: bool | None = None) -> list[LayerCall]:
        self._head(arch)
        inputs = {"input_ids": torch.zeros_like(position_ids)} if parts(arch).decoder_in_root else None
        return layer_calls(arch, position_ids, dtype, inputs)

    def embed_inputs(self, arch: TransformersArch, mb: dict[str, torch.Tensor]):
        """An image-text model's inputs (image_text.embed_inputs); a decoder's token ids and their
        positions (a learned position embedding reads them: GPT-2's wpe; packed documents restart them)."""
        if parts(arch).decoder_in_root:
            return embed_inputs(mb)
        return {"input_ids": mb["input_ids"], "position_ids": mb["position_ids"]}

    def batch_context(self, arch: TransformersArch, mb: dict[str, torch.Tensor], dtype: torch.dtype,
                      packed: bool | None = None) -> list[LayerCall]:
        if not parts(arch).decoder_in_root:
            return self.context(arch, mb["position_ids"], dtype, packed)
        self._head(arch)
        return layer_calls(arch, mb["position_ids"], dtype, embed_inputs(mb))

    def layer_context(self, arch: TransformersArch, ctx: list[LayerCall], layer: int) -> LayerCall:
        call = ctx[layer - 1]
        return bound_call(arch, call, _device_of(call))

    def embed(self, arch: TransformersArch, w: Weights, input_ids: torch.Tensor) -> torch.Tensor:
        return embed_forward(arch, w, input_ids)

    def block(self, arch: TransformersArch, w: Weights, x: torch.Tensor, ctx: LayerCall,
              mlp_chunk: int = 0, aux: bool = False):
        if aux:
            return block_with_router_stats(arch, w, x, ctx)
        return block_forward(w, x, ctx)

    def aux_loss_on(self, arch: TransformersArch) -> bool:
        return bool(arch.config.get("output_router_logits")) and aux_settings(arch) is not None

    def aux_loss_term(self, arch: TransformersArch, stats: torch.Tensor, totals: torch.Tensor) -> torch.Tensor:
        return router_aux_term(arch, stats, totals)

    def vision_bytes(self, arch: TransformersArch, tokens: int, dtype_bytes: int) -> int:
        config = arch.config
        return tower_bytes(config, tokens, dtype_bytes, arch.train_vision) if hm.is_image_text(config) else 0

    def compiled_variants(self, arch: TransformersArch) -> int:
        """Its layers' templates, told apart further by what of their call the block branches on:
        whether a deepstack layer adds its features, how a layer shares keys and values."""
        return len(set(compiled_variant(arch, index) for index in range(arch.num_layers)))

    def template_of(self, arch: TransformersArch, ctx: LayerCall) -> int:
        """Which template a block call runs (streaming/compiled.py falls back per template)."""
        return ctx.template

    def head_loss(self, arch: TransformersArch, head: Weights, embed: Weights | None, x: torch.Tensor,
                  labels: torch.Tensor, chunk_tokens: int, scale: float) -> torch.Tensor:
        call = self._head(arch)
        state = head_state(call, head, embed)
        x = x[..., :arch.hidden_width]  # the hidden states of what flows (per-layer inputs behind them)
        hidden = x.reshape(-1, x.shape[-1])
        dummy = hidden.new_empty(0)
        return ops.chunked_cross_entropy(functools.partial(_chunk_loss, call, state), hidden, dummy, labels,
                                         chunk_tokens, scale)

    def logits(self, arch: TransformersArch, head: Weights, embed: Weights | None, x: torch.Tensor) -> torch.Tensor:
        call = self._head(arch)
        return head_logits(call, head_state(call, head, embed), x[..., :arch.hidden_width])

    # -- what the planner and the benchmark count ----------------------------------------------
    def matmul_params(self, arch: TransformersArch) -> int:
        layouts = self.layouts(arch)
        total = sum(layout.numel for layout in layouts)
        embed = 0 if arch.tie_word_embeddings else layouts[0].numel
        return total - embed - self.inactive_params(arch)

    def inactive_params(self, arch: TransformersArch) -> int:
        return sum(inactive_in(arch, layout) for layout in self.layouts(arch))

    def template_kinds(self, arch: TransformersArch) -> tuple[int, ...]:
        """Per decoder layer, its template (the first layer of its structure): planning/probe.py's kinds."""
        return parts(arch).kinds

    def measures_working_set(self, arch: TransformersArch) -> bool:
        return True

    def layer_inactive_params(self, arch: TransformersArch, layout: LayerLayout) -> int:
        return inactive_in(arch, layout)

    def trains_vision(self, arch: TransformersArch) -> bool:
        return arch.train_vision

    def working_set_bytes(self, arch: TransformersArch, tokens: int, mlp_tokens: int, dtype_bytes: int) -> int:
        if arch.measured_working_set > 0:
            return int(tokens * arch.measured_working_set * dtype_bytes)
        per_h, per_i = WORKING_SET_PER_TOKEN
        experts, per_token = expert_counts(arch.config)
        rows = tokens * max(1, per_token if experts else 1)
        return (tokens * per_h * arch.hidden_size + rows * per_i * arch.intermediate_size) * dtype_bytes


TRANSFORMERS = TransformersFamily()
