"""The transformers family's shape: its arch carries the model's whole config.json (canonical,
its class's defaults filled in), the shared fields read from it for the planner and the data; what
the config says of dropout and experts; the model's transformers modules (`parts`).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.layout import LayerLayout
from megatrain_ray.models.transformers import modules as hm
from megatrain_ray.models.transformers.flow import common_input_of, decoder_config, hidden_stack, shared_kv_of


# config.json keys that say nothing about the model's tensors or arithmetic
VOLATILE_KEYS = ("transformers_version", "_name_or_path", "torch_dtype", "dtype", "architectures",
                 "_attn_implementation_autoset", "_commit_hash", "use_cache")


@dataclass(frozen=True)
class TransformersArch(ModelArch):
    """The shared fields (for the planner and the data), read from the config; `hf_config` is the
    whole config.json as canonical JSON (its class's defaults filled in): it decides the model."""

    hf_config: str = "{}"

    @property
    def config(self) -> dict[str, Any]:
        return json.loads(self.hf_config)

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
