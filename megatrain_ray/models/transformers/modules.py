"""A transformers causal language model taken apart for streaming: its classes built with no
memory (on the meta device), its decoder layers grouped by structure, its tensors' names, and what its own forward
passes to each layer.

The model is built from its config on the meta device, then its non-persistent buffers (rotary
frequencies) are computed on the CPU: the modules hold no weights, only code and shapes.
Weights arrive per call through torch.func.functional_call, as views of a streamed buffer. The
parts around the layers run the model's own code: the embedding is its forward stopped at the
first layer; the masks, rotary tables and any other per-layer arguments are recorded from its
forward on a stand-in input; the head is its causal-LM forward with the decoder cut down to the
final norm (so logit scaling and soft-capping are the model's own).
"""

from __future__ import annotations

import contextlib
import copy
import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch import nn


class Unsupported(ValueError):
    """A model whose structure the transformers family does not run; the message says which part."""


def config_object(config: dict[str, Any]):
    """The transformers config of a config.json dict (its own class, defaults filled in), read as
    AutoConfig.from_pretrained reads the file: the floats JSON cannot hold ({"__float__":
    "Infinity"}, as transformers writes a Mamba layer's time_step_limit) decoded first."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[config["model_type"]]
    fields = {k: v for k, v in config.items() if k != "model_type"}
    return config_class.from_dict(config_class._decode_special_floats(fields))


def is_image_text(config: dict[str, Any]) -> bool:
    """An image-text model (AutoModelForImageTextToText): a language decoder beside a vision tower,
    each with its own config (text_config, vision_config)."""
    return isinstance(config.get("text_config"), dict) and isinstance(config.get("vision_config"), dict)


def of_image_text_model(config: dict[str, Any]) -> bool:
    """is_image_text of a config.json with its class's defaults filled in (False where
    transformers cannot read it)."""
    try:
        return is_image_text({**config_object(config).to_dict(), **config})
    except Exception:  # no config class for it, or one that refuses it: refused elsewhere, saying why
        return False


def auto_class(config: dict[str, Any]):
    """transformers' auto class that builds the model: the image-text one, or the causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_image_text(config) else AutoModelForCausalLM


def build_empty(config: dict[str, Any]) -> nn.Module:
    """The causal LM (or image-text model) with parameters on meta, in fp32, attention through SDPA
    where the model offers it (eager where it does not: soft-capped attention)."""
    cfg = config_object(config)
    if getattr(cfg, "is_encoder_decoder", False):
        raise Unsupported("it is an encoder-decoder model")
    last_error = None
    for attn in ("sdpa", "eager"):
        try:
            with torch.device("meta"):
                model = auto_class(config).from_config(cfg, attn_implementation=attn, dtype=torch.float32)
            return with_real_buffers(model)
        except ValueError as e:  # transformers refuses an attention implementation the model lacks
            last_error = e
            if "attention" not in str(e).lower() and "sdpa" not in str(e).lower():
                break
    raise Unsupported(f"transformers cannot build it as a causal LM: {last_error}")


def with_real_buffers(model: nn.Module) -> nn.Module:
    """Non-persistent buffers (rotary frequencies, embedding scales) computed on the CPU as
    transformers computes them after building a model on meta: its own _init_weights."""
    holders: set[str] = set()
    for name, module in model.named_modules():
        names = [n for n in module._non_persistent_buffers_set if module._buffers.get(n) is not None]
        for n in names:
            module._buffers[n] = torch.empty_like(module._buffers[n], device="cpu")
        if names:
            parts = name.split(".") if name else []
            holders.update(".".join(parts[:i]) for i in range(len(parts) + 1))
    # each holder and the modules above it, children first: a model may fill its layers' buffers
    # from above (Falcon-H1's decoder writes each Mamba mixer's mup_vector)
    # (an image-text model's vision tower is a model of its own, whose _init_weights fills its buffers)
    owners = {n: m for n, m in model.named_modules() if hasattr(m, "_init_weights")}
    for name, module in reversed(list(model.named_modules())):
        if name in holders:
            owner = max((n for n in owners if n == "" or name == n or name.startswith(n + ".")), key=len)
            owners[owner]._init_weights(module)
    return model


def build_small(config: dict[str, Any]) -> nn.Module:
    """transformers' model of a small config, with real (CPU, fp32) weights as the model draws
    them, its attention as build_empty picks it."""
    attn = build_empty(config).config._attn_implementation
    return auto_class(config).from_config(config_object(config), attn_implementation=attn, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# A small instance of the same structure
# ---------------------------------------------------------------------------------------------

SMALL = {
    "hidden_size": 64, "intermediate_size": 64, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "ffn_hidden_size": 64, "vocab_size": 128, "num_attention_heads": 4, "head_dim": 16,
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_k": 2, "n_group": 1, "num_expert_group": 1, "topk_group": 1, "sliding_window": 8,
    "attention_chunk_size": 8, "ffn_dim": 64, "dff": 64, "n_inner": 64, "rotary_dim": 8,
    "num_experts_per_token": 2, "linear_num_heads": 4, "linear_head_dim": 16, "num_heads": 8,
    "vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 8, "laurel_rank": 8,
    "unpadded_vocab_size": 128,  # the rows a checkpoint holds, padded to vocab_size on load (Inkling 2)
    "mamba_d_state": 16, "mamba_n_heads": 8, "mamba_chunk_size": 16, "chunk_size": 16, "mamba_d_ssm": 64, "mamba_num_heads": 8, "ssm_state_size": 16,
}
# The same keys in other proportions, for the tests and the model table (a size that only fits
# SMALL's proportions shows there): heads x head width unlike the hidden size, linear attention's
# key and value widths unlike each other and unlike the attention's, 6 experts with 3 per token.
OTHER_PROPORTIONS = dict(
    SMALL, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, shared_expert_intermediate_size=40,
    ffn_hidden_size=80, vocab_size=160, num_attention_heads=6, kv_lora_rank=24, q_lora_rank=40, qk_rope_head_dim=4,
    qk_nope_head_dim=12, v_head_dim=20, linear_num_key_heads=3, linear_num_value_heads=6, linear_key_head_dim=12,
    num_experts=6, n_routed_experts=6, num_local_experts=6, moe_num_experts=6, num_experts_per_tok=3, moe_k=3,
    num_experts_per_token=3, sliding_window=6, attention_chunk_size=6, linear_num_heads=3, linear_head_dim=20,
    num_heads=6, vocab_size_per_layer_input=160, hidden_size_per_layer_input=16, laurel_rank=4,
    unpadded_vocab_size=160, mamba_d_state=8, mamba_n_heads=12, mamba_chunk_size=8, chunk_size=8, mamba_d_ssm=96,
    mamba_num_heads=16, ssm_state_size=8, ffn_dim=80, dff=80, n_inner=80, rotary_dim=4)


def small_config(config: dict[str, Any], kinds: tuple[int, ...], sizes: dict[str, int] = SMALL) -> dict[str, Any]:
    """The config with small widths (none larger than `sizes`) and only the layers up to the last
    first-of-its-kind (counted as the config counts them: counted_per_layer), the layer counts that
    must add up to them cut in proportion (layer_parts)."""
    small = small_sizes(config, sizes=sizes)
    counted = counted_per_layer(config, kinds)
    parts = layer_parts(config)
    layers = max(max(kinds.index(k) for k in set(kinds)) + 1, len(parts))
    if config.get("head_dim") is not None and config.get("head_dim") == config.get("qk_rope_head_dim"):
        small["head_dim"] = small["qk_rope_head_dim"]  # MLA: the rotary part's width
    small.update(rederived(config, small, list(sizes)))
    small.update(small_kv_heads(config, sizes=sizes))
    if all(isinstance(small.get(k), int) for k in ("mamba_expand", "mamba_n_heads", "mamba_d_head", "hidden_size")):
        # a Mamba layer's heads x head width is its inner width: mamba_d_ssm where set (cut to a multiple of
        # the heads, which may have been small already), else expand x hidden
        heads = small["mamba_n_heads"]
        if small.get("mamba_d_ssm"):
            small["mamba_d_ssm"] = max(heads, small["mamba_d_ssm"] - small["mamba_d_ssm"] % heads)
        inner = small.get("mamba_d_ssm") or small["mamba_expand"] * small["hidden_size"]
        small["mamba_d_head"] = inner // heads
    vocab = small.get("vocab_size")
    for key, value in config.items():
        if key.endswith("token_id") and isinstance(value, int) and isinstance(vocab, int) and value >= vocab:
            small[key] = vocab - 1
    small["num_hidden_layers"] = layers * counted
    cut = cut_in_proportion({key: config[key] // counted for key in parts}, layers)
    small.update({key: n * counted for key, n in cut.items()})
    shared = config.get("num_kv_shared_layers")
    if isinstance(shared, int) and shared > 0:  # the layers that reuse keys and values: from the same first one
        small["num_kv_shared_layers"] = max(0, layers - (config["num_hidden_layers"] - shared))
    per_layer = [key for key, value in config.items() if isinstance(value, list) and len(value) == len(kinds) * counted]
    for key in per_layer:
        small[key] = small[key][:layers * counted]
    small.update(rederived(config, small, ["num_hidden_layers", *per_layer]))  # Zamba2's hybrid_layer_ids
    if isinstance(config.get("per_layer_config"), dict):  # a layer's own sizes (Gemma 4's global head_dim), cut
        # last: the class derives it again from the layer count with its full sizes (Dots3's sliding layers)
        small["per_layer_config"] = {k: small_sizes(v, config, sizes) if isinstance(v, dict) else v
                                     for k, v in config["per_layer_config"].items() if int(k) < layers}
    return small


def small_image_text_config(config: dict[str, Any], kinds: tuple[int, ...]) -> dict[str, Any]:
    """An image-text config with its decoder's small_config and a vision tower of one small block
    (its merger's output as wide as the small decoder)."""
    text, vision = small_config(config["text_config"], kinds), small_sizes(config["vision_config"])
    vision.update({key: 1 for key in ("depth", "num_hidden_layers") if isinstance(vision.get(key), int)})
    vision.update({key: min(vision[key], SMALL["num_attention_heads"]) for key in ("num_heads", "num_attention_heads")
                   if isinstance(vision.get(key), int)})
    if isinstance(vision.get("out_hidden_size"), int):
        vision["out_hidden_size"] = text["hidden_size"]
    return {**config, "text_config": text, "vision_config": vision}


def counted_per_layer(config: dict[str, Any], kinds: tuple[int, ...]) -> int:
    """How many of num_hidden_layers (and of the lists of a value each) a decoder layer is: 1, or
    where the config counts more, as Dory's counts each layer's attention and MLP blocks apart, 2."""
    stored = config.get("num_hidden_layers")
    return stored // len(kinds) if type(stored) is int and stored > len(kinds) and stored % len(kinds) == 0 else 1


def layer_parts(config: dict[str, Any]) -> list[str]:
    """The layer counts that the config class requires to add up to its layers (Dory's
    n_input_layers + n_recurrent_layers + n_output_layers == num_hidden_layers): the integer
    `*_layers` keys beside num_hidden_layers, where they do."""
    total = config.get("num_hidden_layers")
    keys = [k for k, v in config.items() if k.endswith("_layers") and k != "num_hidden_layers"
            and type(v) is int and v > 0]
    return keys if len(keys) > 1 and sum(config[k] for k in keys) == total else []


def cut_in_proportion(counts: dict[str, int], total: int) -> dict[str, int]:
    """`counts` scaled to add up to `total`, each at least 1 (total >= their number), the largest
    remainders rounded up."""
    if not counts:
        return {}
    whole = sum(counts.values())
    spare = total - len(counts)  # beyond the one each keeps
    shares = {k: spare * v / whole for k, v in counts.items()}
    out = {k: 1 + int(share) for k, share in shares.items()}
    for k in sorted(shares, key=lambda k: int(shares[k]) - shares[k])[:total - sum(out.values())]:
        out[k] += 1
    return out


def small_sizes(config: dict[str, Any], outer: dict[str, Any] | None = None,
                sizes: dict[str, int] = SMALL) -> dict[str, Any]:
    """The config with each size of `sizes` no larger than there (a size per layer too: Gemma 3n's
    intermediate_size); a layer's own config (`outer` the model's) with its key-value heads as
    small_kv_heads makes them, its heads read from the model's where it leaves them unset."""
    small = dict(config)
    names = own_names(config)
    for key, value in sizes.items():
        key = names.get(key, key)
        if isinstance(small.get(key), int) and not isinstance(small[key], bool) and small[key] > value:
            small[key] = value
        elif isinstance(small.get(key), list) and small[key] and all(type(v) is int for v in small[key]):
            small[key] = [min(v, value) for v in small[key]]
    if outer is not None:
        small.update(small_kv_heads(config, outer, sizes))
    return small


RENAMED_WIDTHS = ("hidden_size", "num_attention_heads")  # what a class may call otherwise; not head_dim,
# which some derive from them (Zamba's attention_head_dim: twice the hidden size over the heads)


def own_names(config: dict[str, Any]) -> dict[str, str]:
    """The config's own names for the hidden size and the heads (GPT-J's n_embd and n_head, XGLM's
    d_model): its class's attribute_map, whose keys a config.json does not hold."""
    from transformers import CONFIG_MAPPING

    try:
        mapping = getattr(CONFIG_MAPPING[config.get("model_type")], "attribute_map", {}) or {}
    except KeyError:
        return {}
    return {common: own for common, own in mapping.items()
            if common in RENAMED_WIDTHS and common not in config and own in config}


def small_kv_heads(config: dict[str, Any], outer: dict[str, Any] | None = None,
                   sizes: dict[str, int] = SMALL) -> dict[str, Any]:
    """The small config's key-value heads: one, all its heads or two, as they were."""
    heads = config.get("num_attention_heads", (outer or {}).get("num_attention_heads"))
    kv = config.get("num_key_value_heads")
    if not (isinstance(kv, int) and isinstance(heads, int)):
        return {}
    return {"num_key_value_heads": 1 if kv == 1 else (min(heads, sizes["num_attention_heads"]) if kv == heads else 2)}


def rederived(config: dict[str, Any], small: dict[str, Any], keys: list[str] | None = None) -> dict[str, Any]:
    """The values the config class derives from the sizes (Zamba2's mamba_headdim, its attention
    widths), or from `keys` (the layer count and the lists of one value per layer: Zamba2's
    hybrid_layer_ids), derived again from the small ones, where the config holds what the class
    derives from its own (a config.json that transformers wrote stores them)."""
    from transformers import CONFIG_MAPPING

    sizes = [k for k in (SMALL if keys is None else keys) if k in config and k in small]
    try:
        config_class = CONFIG_MAPPING[config["model_type"]]
        big = config_class(**{k: config[k] for k in sizes}).to_dict()
        little = config_class(**{k: small[k] for k in sizes}).to_dict()
    except Exception:  # the class refuses the sizes alone: nothing is derived again
        return {}
    return {k: v for k, v in little.items()
            if k not in sizes and k in config and big.get(k) != v and config[k] == big.get(k)}


@dataclass
class Parts:
    """The model as the streaming layers see it."""

    model: nn.Module  # the causal LM (parameters on meta)
    base: nn.Module  # its decoder (`model.model`)
    base_prefix: str  # "model."
    layers: list[nn.Module]
    final_norm: str  # the decoder's child applied after the layers
    kinds: tuple[int, ...]  # per decoder layer: the index of its template (first layer of its structure)
    tied: bool  # the LM head is the input embedding
    layers_name: str = "layers"  # the decoder's child that holds the list of layers
    # The module whose forward runs from the model's inputs to its first layer, and its prefix: the
    # decoder itself, or an image-text model's inner model (its vision tower, its projector and the
    # decoder, at `decoder_in_root`: "language_model.")
    root: nn.Module | None = None
    root_prefix: str = ""
    decoder_in_root: str = ""
    # The decoder's other children with weights that its forward runs after its last layer (Gemma
    # 3n's AltUp unembedding projections): the head then runs the decoder's own code after its layers
    after_layers: tuple[str, ...] = ()
    # per decoder layer: the earlier layer whose tensors it also runs with (a block that several
    # layers share, Zamba2's shared transformer, held by the first of them), else None
    shares: tuple[int | None, ...] = ()
    # per decoder layer: the names of those tensors in it (the same in the layer that holds them)
    shared_names: tuple[frozenset[str], ...] = ()
    # the decoder reads a layer's output as a tuple, the hidden states first (GPT-Neo: outputs[0])
    layers_return_tuples: bool = False


def decoder_parts(model: nn.Module) -> Parts:
    """The decoder's parts found by their roles, whatever the model names them: the decoder is the
    causal LM's child that holds the input embedding and a list of the config's num_hidden_layers
    layers; the final norm is the decoder's one other child with weights (the module between the
    last layer and the LM head)."""
    prefix, layers_name = _decoder_and_layers(model)
    base = model.get_submodule(prefix)
    layers = getattr(base, layers_name)
    for name, module in layers.named_modules():
        if any(word in name for word in ("cross_attn", "encoder_attn", "crossattention")):
            raise Unsupported(f"its layers have cross-attention ({name})")
    shares, shared_names = shared_tensors(layers)
    tuples = layers_return_tuples(base, layers_name)
    norm = _final_module(base, layers_name, model.get_input_embeddings(), tuples)
    after = tuple(n for n in _children_run_after_layers(base, layers_name, tuples) if n != norm)
    keys: dict[tuple, int] = {}  # a layer that holds a shared block and one that runs it are of two kinds
    kinds = tuple(keys.setdefault((structure_key(layer), names), i)
                  for i, (layer, names) in enumerate(zip(layers, shared_names)))
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    tied = out is not None and inp is not None and out.weight is inp.weight
    root_prefix, _, decoder_in_root = prefix.partition(".")
    if not hasattr(model.config, "vision_config"):  # a decoder below its model (OPT's model.decoder) is the root
        root_prefix, decoder_in_root = prefix, ""
    return Parts(model, base, prefix + ".", list(layers), norm, kinds, tied, layers_name,
                 model.get_submodule(root_prefix), root_prefix + ".", decoder_in_root + "." if decoder_in_root else "",
                 after, shares, shared_names, tuples)


def shared_tensors(layers: nn.ModuleList) -> tuple[tuple[int | None, ...], tuple[frozenset[str], ...]]:
    """Per layer, the earlier layer that holds tensors it runs with too (Zamba2's hybrid layers
    share one transformer block, or `num_mem_blocks` in turn), or None, and their names. The first
    layer that runs a tensor holds it, as save_pretrained stores it; a later one streams that
    layer's weights beside its own, and runs them under its own names for them, which must be the
    holder's."""
    holder: dict[int, tuple[int, str]] = {}
    shares, names = [], []
    for i, layer in enumerate(layers):
        found: dict[str, tuple[int, str]] = {}
        for name, t in persistent_tensors(layer).items():
            first = holder.setdefault(id(t), (i, name))
            if first[0] != i:
                found[name] = first
        held_by = {layer_index for layer_index, _ in found.values()}
        if len(held_by) > 1:
            raise Unsupported(f"its layer {i} runs tensors that several earlier layers hold "
                              f"(layers {', '.join(map(str, sorted(held_by)))}): a layer may share one layer's block")
        renamed = [(name, first) for name, first in found.items() if first[1] != name]
        if renamed:
            name, (j, there) = renamed[0]
            raise Unsupported(f"its layer {i} runs layer {j}'s {there} as {name}: a shared block must have the "
                              "same names in every layer that runs it")
        shares.append(held_by.pop() if held_by else None)
        names.append(frozenset(found))
    return tuple(shares), tuple(names)


def _decoder_and_layers(model: nn.Module) -> tuple[str, str]:
    """(the causal LM's child that is its decoder, the decoder's child that lists its layers); an
    image-text model's decoder is its language model (model.language_model), a grandchild."""
    count = getattr(model.config.get_text_config(), "num_hidden_layers", None)
    embedding = model.get_input_embeddings()
    if hasattr(model.config, "vision_config"):
        decoder = model.get_decoder()
        path = next(n for n, m in model.named_modules() if m is decoder)
        lists = [n for n, c in decoder.named_children() if isinstance(c, nn.ModuleList) and len(c) == count]
        if len(lists) != 1:
            raise Unsupported(f"its language model ({path}) has no one list of its {count} layers")
        return path, lists[0]
    for prefix, base in model.named_children():
        if embedding is None or not any(m is embedding for m in base.modules()):
            continue
        lists = [(n, c) for n, c in base.named_children() if isinstance(c, nn.ModuleList) and len(c)]
        lists = [(n, c) for n, c in lists if len(c) == count] or lists
        if len(lists) == 1:
            return prefix, lists[0][0]
        if len(lists) > 1:
            raise Unsupported(f"its decoder ({prefix}) has several lists of layers "
                              f"({', '.join(n for n, _ in lists)})")
    nested = [(path, name) for path, module in model.named_modules() if "." in path and
              any(m is embedding for m in module.modules()) and _alone_below(model, path)
              for name, child in module.named_children() if isinstance(child, nn.ModuleList) and len(child) == count]
    if len(nested) == 1:  # a decoder below the causal LM's child, alone there (OPT: model.decoder)
        return nested[0]
    raise Unsupported("its decoder holds no list of layers beside its input embedding")


def layers_return_tuples(base: nn.Module, layers_name: str) -> bool:
    """Whether the decoder reads its layers' outputs as tuples (GPT-Neo indexes outputs[0]) rather
    than as the hidden states: told by its forward on zeros with layers that pass the hidden
    states through as a tensor, which such a decoder cannot run to its end, then as a tuple."""
    for as_tuple in (False, True):
        calls: list = []
        decoder = recording_decoder(base, layers_name, calls, stop_after=-1, as_tuple=as_tuple)
        ran = _run_on_zeros(decoder, base, len(decoder._modules[layers_name]), [])
        if ran and all(isinstance(hidden, torch.Tensor) for hidden, _, _ in calls):
            return as_tuple
    return False


def _alone_below(model: nn.Module, path: str) -> bool:
    """Whether the modules above `path` hold nothing with weights beside it (OPT's model holds only
    its decoder; Fuyu's holds its patch embedding beside its language model)."""
    parts = path.split(".")
    for depth in range(1, len(parts)):
        above = model.get_submodule(".".join(parts[:depth]))
        if any(name != parts[depth] and persistent_tensors(child) for name, child in above.named_children()):
            return False
    return True


def _final_module(base: nn.Module, layers_name: str, embedding: nn.Module, tuples: bool = False) -> str:
    """The decoder's child that its forward calls after its last layer; where a run on a stand-in
    input cannot tell, its one child with weights that is neither its layers nor (part of) its
    input embedding, or of several the one registered after the layers. The check of a small
    instance against transformers (transformers/check.py) confirms the choice."""
    called = _called_after_layers(base, layers_name, tuples)
    if called is not None:
        return called
    names = list(base._modules)
    others = [n for n, c in base.named_children()
              if n != layers_name and c is not embedding and not any(m is embedding for m in c.modules())
              and persistent_tensors(c)]
    after = [n for n in others if names.index(n) > names.index(layers_name)]
    if len(others) == 1 or len(after) == 1:
        return after[0] if len(after) == 1 else others[0]
    if not others:
        raise Unsupported("its decoder has no final norm (no module between its last layer and the LM head)")
    raise Unsupported(f"its decoder has modules with weights beside its embedding, its layers and one final norm "
                      f"({', '.join(others)})")


def _called_after_layers(base: nn.Module, layers_name: str, tuples: bool = False) -> str | None:
    """The first of the decoder's children that its forward calls after its last layer, run with
    layers that pass the hidden states through (None where that run fails before)."""
    calls: list = []
    decoder = recording_decoder(base, layers_name, calls, stop_after=-1, as_tuple=tuples)
    count, found = len(decoder._modules[layers_name]), []

    def pre_hook(name):
        def hook(module, args):
            if len(calls) >= count:
                found.append(name)
                raise _Stop
        return hook

    hooks = [child.register_forward_pre_hook(pre_hook(n)) for n, child in decoder.named_children() if n != layers_name]
    ran = _run_on_zeros(decoder, base, count, hooks)
    return found[0] if ran and found else None


def _children_run_after_layers(base: nn.Module, layers_name: str, tuples: bool = False) -> list[str]:
    """The decoder's children with weights any part of which its forward runs after its last layer,
    run to its end on stand-in weights with layers that pass the hidden states through (none
    where that run fails)."""
    calls: list = []
    decoder = recording_decoder(base, layers_name, calls, stop_after=-1, as_tuple=tuples)
    count, found = len(decoder._modules[layers_name]), []

    def pre_hook(name):
        def hook(module, args):
            if len(calls) >= count and name not in found:
                found.append(name)
        return hook

    hooks = [module.register_forward_pre_hook(pre_hook(n)) for n, child in decoder.named_children()
             if n != layers_name and persistent_tensors(child) for module in child.modules()]
    return found if _run_on_zeros(decoder, base, count, hooks) else []


def _run_on_zeros(decoder: nn.Module, base: nn.Module, count: int, hooks: list) -> bool:
    """The decoder's forward on stand-in weights (zeros) and inputs, its hooks removed after;
    False where a part of it needs real weights."""
    # stand-in weights (zeros) for what runs before the layers; stand-in per-layer inputs (Gemma 3n/4's)
    zeros = {n: torch.zeros((), dtype=t.dtype).expand(t.shape) for n, t in persistent_tensors(decoder).items()}
    inputs = {"inputs_embeds": torch.zeros(1, 2, base.config.hidden_size), "use_cache": False}
    per_layer = getattr(base.config, "hidden_size_per_layer_input", None)
    if per_layer:
        inputs["per_layer_inputs"] = torch.zeros(1, 2, count, per_layer)
    try:
        with torch.no_grad():
            torch.func.functional_call(decoder, zeros, (), inputs, strict=False)
    except _Stop:
        pass
    except Exception:  # a part before the layers that needs real weights
        return False
    finally:
        for hook in hooks:
            hook.remove()
    return True


SIMPLE = (int, float, str, bool, type(None))


def structure_key(layer: nn.Module) -> str:
    """What makes two layers run the same code on the same shapes: their modules' classes, plain
    attributes (all but the layer's index) and tensor shapes. Layers with one key share a template."""
    parts = []
    for name, module in layer.named_modules():
        attrs = sorted((k, v) for k, v in vars(module).items()
                       if not k.startswith("_") and k not in ("layer_idx", "training") and _plain(v))
        parts.append((name, type(module).__qualname__, attrs))
    tensors = [(n, tuple(t.shape), str(t.dtype)) for n, t in layer.state_dict(keep_vars=True).items()]
    return repr((parts, tensors))


def _plain(v) -> bool:
    if isinstance(v, (tuple, list)):
        return all(_plain(x) for x in v)
    return isinstance(v, SIMPLE)


def persistent_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers (what a checkpoint holds), by local name, in module order."""
    return dict(module.state_dict(keep_vars=True))


def ungraded_parameters(model: nn.Module) -> frozenset[str]:
    """Full names of the parameters that a training forward runs but never differentiates: their
    module runs, yet the backward of the logits reaches none of them (DeepSeek-V3.2's indexer,
    whose scores only pick the positions attention reads). torch.optim.AdamW skips them every step.
    A module that does not run in this forward (an expert no token chose) is no such case. None
    where the plain forward of token ids fails (the model's own check, which runs it as a run does,
    says why): its tensors then all take AdamW's step, weight decay included."""
    ran: set[int] = set()
    hooks = [m.register_forward_hook(lambda m, args, out: ran.add(id(m))) for m in model.modules()]
    try:
        ids = torch.arange(16).remainder(model.config.get_text_config().vocab_size).view(1, 16)
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, use_cache=False).logits.float().sum().backward()
    except Exception:  # noqa: BLE001 (any model's own error: see above)
        return frozenset()
    finally:
        for hook in hooks:
            hook.remove()
    found = frozenset(f"{path}.{name}".lstrip(".") for path, module in model.named_modules() if id(module) in ran
                      for name, t in module.named_parameters(recurse=False) if t.requires_grad and t.grad is None)
    model.zero_grad(set_to_none=True)
    return found


def transient_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """Non-persistent buffers (rotary frequencies): computed at construction, never stored."""
    stored = set(module.state_dict(keep_vars=True))
    return {n: b for n, b in module.named_buffers() if n not in stored}


# ---------------------------------------------------------------------------------------------
# Checkpoint names: how save_pretrained stores each in-memory tensor
# ---------------------------------------------------------------------------------------------


def expert_pieces(small_model: nn.Module) -> dict[str, tuple[str, ...]]:
    """In-memory tensors that transformers stores otherwise: full name -> the stored names of expert
    e's pieces, with "{}" for e, in the order they lie in the tensor (stacked experts stored as
    `experts.{e}.gate_proj.weight`, ...), or the one name of a tensor stored whole under another. Found by giving every value of a small model a
    number of its own and running transformers' own reverse conversion (what save_pretrained runs):
    each stored piece must be a contiguous block, expert e's k pieces its rows in k equal parts."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers without load-time conversions stores tensors as they are
        return {}
    state, start, total = {}, {}, 0
    for name, t in small_model.state_dict().items():
        start[name] = total
        state[name] = torch.arange(total, total + t.numel(), dtype=torch.float64).view(t.shape)
        total += t.numel()
    stored = revert_weight_conversion(small_model, dict(state))
    found: dict[str, list[tuple[int, str, torch.Tensor]]] = {}
    for name, t in stored.items():
        if name in state and torch.equal(t, state[name]):
            continue
        first = int(t.reshape(-1)[0])
        owner = max((n for n in start if start[n] <= first), key=start.get)
        offset = first - start[owner]
        if not torch.equal(t.reshape(-1), torch.arange(first, first + t.numel(), dtype=torch.float64)):
            raise Unsupported(f"transformers stores {owner} in pieces that are not contiguous blocks of it")
        found.setdefault(owner, []).append((offset, name, t))
    out = {}
    for owner, pieces in found.items():
        pieces = sorted(pieces, key=lambda p: p[0])
        if len(pieces) == 1 and pieces[0][2].numel() == state[owner].numel():
            out[owner] = (pieces[0][1],)  # stored whole under another name
        elif split_along_rows(state[owner], pieces):
            out[owner] = tuple((name, tuple(t.shape)) for _, name, t in pieces)
        else:
            out[owner] = per_expert_names(owner, tuple(state[owner].shape), sorted(pieces, key=lambda p: p[0]))
    return out


def stored_shapes(model: nn.Module, names: list[str]) -> dict[str, tuple[int, ...]]:
    """The stored name and shape of each piece that save_pretrained makes of the named in-memory
    tensors of `model` (built on meta: no memory), by transformers' own reverse conversion of them,
    so that the pieces' sizes are the model's whatever its config (Kimi-Linear's and OLMo-Hybrid's
    short convolution, saved as three equal chunks of the fused one, whatever its query, key and
    value widths)."""
    from transformers.core_model_loading import revert_weight_conversion

    state = model.state_dict()
    return {name: tuple(t.shape) for name, t in revert_weight_conversion(model, {n: state[n] for n in names}).items()}


def split_along_rows(whole: torch.Tensor, pieces: list) -> bool:
    """Whether the pieces, in order, are the tensor cut along its first dimension (Kimi-Linear's
    fused q/k/v short convolution stored as three), with no expert index in them."""
    rows = sum(t.shape[0] for _, _, t in pieces)
    offsets = [0]
    for _, _, t in pieces[:-1]:
        offsets.append(offsets[-1] + t.numel())
    return (whole.dim() != 3 or len(pieces) % whole.shape[0] != 0) and rows == whole.shape[0] and \
        all(tuple(t.shape[1:]) == tuple(whole.shape[1:]) and off == o for (off, _, t), o in zip(pieces, offsets))


def per_expert_names(owner: str, shape: tuple[int, ...], pieces: list) -> tuple[str, ...]:
    """The stored-name templates of one expert's k pieces, after checking that the pieces are the
    experts' rows in k equal parts, in order (models/moe.py, stored_per_expert, is that layout)."""
    if len(shape) != 3 or len(pieces) % shape[0]:
        raise Unsupported(f"transformers stores {owner} in pieces that are not one set per expert")
    experts, rows, cols = shape
    k = len(pieces) // experts
    templates = []
    for i, (offset, name, t) in enumerate(pieces):
        e, j = divmod(i, k)
        marker = f".{e}."
        if offset != (e * rows + j * rows // k) * cols or t.numel() != rows // k * cols or marker not in name:
            raise Unsupported(f"transformers stores {owner} in pieces that are not its experts' rows in order")
        head, _, tail = name.rpartition(marker)
        template = f"{head}.{{}}.{tail}"
        if e == 0:
            templates.append(template)
        elif template != templates[j]:
            raise Unsupported(f"transformers stores {owner}'s experts under names without one pattern")
    return tuple(templates)


# ---------------------------------------------------------------------------------------------
# Running the model's own code around the layers
# ---------------------------------------------------------------------------------------------


class _Stop(Exception):
    """Raised by a recording layer to leave the decoder's forward early."""


class StandIn(nn.Module):
    """A module that stands in for another: reads of attributes it lacks go to that one."""

    def __init__(self, stands_for: nn.Module):
        super().__init__()
        object.__setattr__(self, "_stands_for", stands_for)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_stands_for"), name)


class Recorder(StandIn):
    """Stands in for a decoder layer: records what the decoder passes it and hands the hidden
    states on unchanged. Reads of the layer's attributes (attention_type, layer_type, ...) go to
    the layer it stands for."""

    def __init__(self, layer: nn.Module, calls: list, last: bool, as_tuple: bool = False):
        super().__init__(layer)
        object.__setattr__(self, "_calls", calls)
        object.__setattr__(self, "_last", last)
        object.__setattr__(self, "_as_tuple", as_tuple)

    def forward(self, hidden_states, *args, **kwargs):
        self._calls.append((hidden_states, args, kwargs))
        if self._last:
            raise _Stop
        return (hidden_states,) if self._as_tuple else hidden_states


def recording_decoder(base: nn.Module, layers_name: str, calls: list, stop_after: int,
                      entered: dict | None = None, as_tuple: bool = False) -> nn.Module:
    """A shallow copy of the decoder whose layers record their calls and stop after `stop_after`;
    given `entered`, the decoder's own keyword arguments are kept there at each call (what an
    image-text model's forward hands its language model beside the embeddings: Qwen3-VL's
    deepstack features)."""
    clone = with_module(base, layers_name, nn.ModuleList(
        [Recorder(layer, calls, i == stop_after, as_tuple) for i, layer in enumerate(base._modules[layers_name])]))
    if entered is not None:
        forward = clone.forward  # the decoder's own, bound to the copy

        def keeping_arguments(*args, **kwargs):
            entered.clear()
            entered.update(kwargs)
            return forward(*args, **kwargs)

        object.__setattr__(clone, "forward", keeping_arguments)
    return clone


def recording_root(parts: Parts, calls: list, stop_after: int, entered: dict | None = None) -> nn.Module:
    """The module that runs from the inputs to the first layer (parts.root), its decoder's layers
    recording: the recording decoder itself, or a shallow copy of an image-text model's inner
    model holding it."""
    decoder = recording_decoder(parts.base, parts.layers_name, calls, stop_after, entered, parts.layers_return_tuples)
    return with_module(parts.root, parts.decoder_in_root[:-1], decoder) if parts.decoder_in_root else decoder


def run_until_layers(decoder: nn.Module, state: dict[str, torch.Tensor], calls: list, **inputs) -> None:
    """The decoder's forward on `state` (the weights and buffers it reads) until a recording layer stops it."""
    with contextlib.suppress(_Stop):
        torch.func.functional_call(decoder, state, args=(), kwargs={**inputs, "use_cache": False}, strict=False)


class _HiddenOnly(dict):
    """The decoder's output as the causal-LM forward reads it: the hidden states, None for the rest."""

    def __getattr__(self, name):
        return self.get(name)

    def __getitem__(self, key):
        return self["last_hidden_state"] if key == 0 else dict.__getitem__(self, key)

    def to_tuple(self):
        return (self["last_hidden_state"],)


class FinalNorm(StandIn):
    """Stands in for the decoder (an image-text model's inner model) inside the causal LM: applies
    the final norm to `inputs_embeds`. The norm sits at its own path below it (`norm`, or
    `language_model.norm`), so that its tensors keep their names. Reads of the decoder's other
    attributes (Falcon-H1's lm_head_multiplier) go to the decoder."""

    def __init__(self, norm: nn.Module, path: str, decoder: nn.Module):
        nn.Module.__init__(self)
        holder: nn.Module = self
        *above, name = path.split(".")
        for part in above:  # before it stands for the decoder, which has modules of these names
            holder.add_module(part, nn.Module())
            holder = getattr(holder, part)
        holder.add_module(name, norm)
        self.norm_path = path
        self.config = decoder.config
        object.__setattr__(self, "_stands_for", decoder)

    def forward(self, *args, inputs_embeds=None, **kwargs):  # positional: input_ids (None) and the like
        out = _HiddenOnly()
        dict.__setitem__(out, "last_hidden_state", self.get_submodule(self.norm_path)(inputs_embeds))
        return out


class HandsOn(StandIn):
    """Stands in for a decoder layer in the head's decoder (post_layers_decoder): the first hands on
    the last layer's output that the head was given, the others pass what they get through."""

    def __init__(self, layer: nn.Module, given: dict, first: bool):
        super().__init__(layer)
        object.__setattr__(self, "_given", given)
        object.__setattr__(self, "_first", first)

    def forward(self, hidden_states, *args, **kwargs):
        return self._given["output"] if self._first else hidden_states


def post_layers_decoder(parts: Parts, stack: int) -> nn.Module:
    """A shallow copy of the decoder that runs its own forward after its last layer on what it is
    given as `inputs_embeds` (the last layer's output, `stack` copies of the hidden states side by
    side: Gemma 3n's AltUp predictions), for a decoder that runs more than its final norm there
    (Gemma 3n's AltUp unembedding). Its forward runs from a stand-in input of zeros (its weights
    before the layers: stand-ins too, forward.head_state), and its first layer hands on what it was given."""
    base, given = parts.base, {}
    clone = with_module(base, parts.layers_name, nn.ModuleList(
        [HandsOn(layer, given, i == 0) for i, layer in enumerate(base._modules[parts.layers_name])]))
    forward = clone.forward

    def from_the_last_layer(*args, inputs_embeds=None, **kwargs):
        given["output"] = inputs_embeds.unflatten(-1, (stack, -1)).movedim(-2, 0) if stack > 1 else inputs_embeds
        try:
            stand_in = inputs_embeds.new_zeros(()).expand(*inputs_embeds.shape[:-1], base.config.hidden_size)
            return forward(*args, inputs_embeds=stand_in, **kwargs)
        finally:
            given.clear()

    object.__setattr__(clone, "forward", from_the_last_layer)
    return clone


def head_model(parts: Parts, stack: int = 1) -> nn.Module:
    """A shallow copy of the causal LM whose decoder is only the final norm, or (parts.after_layers)
    its own code after its last layer (post_layers_decoder)."""
    if parts.after_layers:
        if parts.decoder_in_root:
            raise Unsupported("its language model runs more than a final norm after its last layer")
        return with_module(parts.model, parts.root_prefix[:-1], post_layers_decoder(parts, stack))
    return with_module(parts.model, parts.root_prefix[:-1], FinalNorm(getattr(parts.base, parts.final_norm),
                                                                      parts.decoder_in_root + parts.final_norm,
                                                                      parts.root))


def with_module(model: nn.Module, path: str, module: nn.Module) -> nn.Module:
    """A shallow copy of `model` with `module` at `path` (dotted: the modules above it copied too)."""
    copied = copy.copy(model)
    copied._modules = dict(model._modules)
    first, _, rest = path.partition(".")
    copied._modules[first] = with_module(model._modules[first], rest, module) if rest else module
    return copied


def layer_output(out) -> torch.Tensor:
    """A decoder layer's hidden states, whether it returns them alone or first in a tuple."""
    return out[0] if isinstance(out, (tuple, list)) else out


@lru_cache(maxsize=8)
def parts_of(config_json: str) -> Parts:
    """The parts of the model of a canonical config.json (built once per process)."""
    return decoder_parts(build_empty(json.loads(config_json)))
