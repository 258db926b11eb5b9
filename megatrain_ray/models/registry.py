"""Which family runs a model: model_type -> family, and the lookups everyone else uses.

To add a family, write its file (see models/family.py and models/README.md)
and put its object in FAMILIES.
"""

from __future__ import annotations

import dataclasses
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from megatrain_ray.config import ConfigError, ModelConfig, nearest_hint
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.family import ModelFamily
from megatrain_ray.models.gemma3 import GEMMA3
from megatrain_ray.models.hf_adapter import overridable_keys
from megatrain_ray.models.transformers.family import TRANSFORMERS
from megatrain_ray.models.transformers.arch import TransformersArch
from megatrain_ray.models.transformers.modules import is_image_text, of_image_text_model
from megatrain_ray.models.layout import LayerLayout, ParamSlot, frozen_slots
from megatrain_ray.models.gpt_oss import GPT_OSS
from megatrain_ray.models.llama import LLAMA
from megatrain_ray.models.mixtral import MIXTRAL
from megatrain_ray.models.phi3 import PHI3
from megatrain_ray.models.qwen3_moe import QWEN3_MOE

FAMILIES: tuple[ModelFamily, ...] = (LLAMA, GEMMA3, PHI3, MIXTRAL, QWEN3_MOE, GPT_OSS)
SUPPORTED_MODEL_TYPES = tuple(t for family in FAMILIES for t in family.model_types)
PRESETS: dict[str, ModelArch] = {name: arch for family in FAMILIES for name, arch in family.presets.items()}


def family_of(model_type: str) -> ModelFamily:
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")


def family(arch: ModelArch) -> ModelFamily:
    if isinstance(arch, TransformersArch):
        return TRANSFORMERS
    return family_of(arch.model_type)


IMPLEMENTATIONS = ("auto", "native", "transformers")


def implementation_of(arch: ModelArch) -> str:
    """How `arch` runs: 'transformers' (transformers' own modules) or 'native' (a hand-written family)."""
    return "transformers" if isinstance(arch, TransformersArch) else "native"


def how_it_runs(arch: ModelArch, train_vision: bool) -> str:
    """For the model line printed at start: a model run through transformers' modules says so, and
    that its check against transformers (model_arch: models/transformers/check.py) passed; an
    image-text model whether its vision tower trains (`train_vision`: model.train_vision)."""
    if implementation_of(arch) == "native":
        return ""
    if is_image_text(arch.config):
        vision = "trained (model.train_vision)" if train_vision else "frozen (model.train_vision: false)"
        return (f" through transformers' own modules, an image-text model of a type tested against transformers "
                f"with images; its vision tower and projector {vision}")
    return (" through transformers' own modules (its check against transformers' model passed: a small random "
            "instance's logits and gradients agree)")


@lru_cache(maxsize=32)
def model_layouts(arch: ModelArch, train_vision: bool = False) -> tuple[LayerLayout, ...]:
    """The model's streamed layers, with what trains: an image-text model's vision tower and projector
    (ModelFamily.vision_tensors) frozen unless `train_vision` (the run's model.train_vision, which
    the arch, the model's shape, does not hold). The one place that setting marks the layouts: the
    stores, the executor and the plan read what trains from these (ParamSlot.trained)."""
    layouts = family(arch).layouts(arch)
    if train_vision:
        return layouts
    return (frozen_slots(layouts[0], family(arch).vision_tensors(arch)), *layouts[1:])


def num_params(arch: ModelArch) -> int:
    return sum(layout.numel for layout in model_layouts(arch))


def params_text(count: int) -> str:
    """A parameter count for people: 850 params, 12.35 K, 1.234 M, 7.616 B (four significant digits)."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.4g} {unit} params"
    return f"{count} params"


def hf_names(arch: ModelArch) -> dict[str, tuple[int, ParamSlot]]:
    """Every Hugging Face tensor name of the model, as checkpoint files name them -> (layer index, slot)."""
    return {layout.stored_name(p.name): (layout.index, p) for layout in model_layouts(arch) for p in layout.stored_params()}


def arch_from_hf_config(config: dict[str, Any], implementation: str = "auto") -> ModelArch:
    """A transformers config.json dict as an arch, refusing what no family can run.
    `implementation` (model.implementation): auto takes the hand-written family where one runs
    the model_type, else transformers' own modules; native and transformers insist on one."""
    model_type = config.get("model_type")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"model.implementation must be one of {', '.join(IMPLEMENTATIONS)}, got {implementation!r}")
    native = model_type in SUPPORTED_MODEL_TYPES or any(model_type in f.refused for f in FAMILIES)
    if implementation == "transformers" or (implementation == "auto" and (not native or of_image_text_model(config))):
        return transformers_arch(config)
    try:
        fam = family_of(model_type)
    except ValueError:
        why = next((f.refused[model_type] for f in FAMILIES if model_type in f.refused), None)
        raise ValueError(f"config.json model_type {model_type!r} has no hand-written family"
                         + (f": {why}" if why else f"; those with one: {', '.join(SUPPORTED_MODEL_TYPES)}; "
                            "model.implementation auto or transformers runs it through transformers' "
                            "own modules")) from None
    return fam.arch_from_hf(config)


def transformers_arch(config: dict[str, Any]) -> ModelArch:
    """The arch of the transformers family, or a ValueError that says in one paragraph why the
    model cannot run that way (models/transformers/check.py)."""
    from megatrain_ray.models.transformers.check import refusal

    model_type = config.get("model_type")
    why = refusal(config)
    if why:
        raise ValueError(" ".join(f"model_type {model_type!r} cannot be trained: {why}".split()))  # one paragraph
    try:
        return TRANSFORMERS.arch_from_hf(config)
    except (AttributeError, TypeError, KeyError) as e:  # a config without a decoder's sizes (a multimodal one)
        raise ValueError(" ".join(f"model_type {model_type!r} cannot be trained: its config does not read as a "
                                  f"decoder's ({type(e).__name__}: {e}); megatrain-ray trains decoder-only causal "
                                  "language models".split())) from None


def arch_to_hf_config(arch: ModelArch, torch_dtype: str = "float32") -> dict[str, Any]:
    return family(arch).hf_config(arch, torch_dtype)


def arch_from_dict(fields: dict[str, Any]) -> ModelArch:
    """An arch as a checkpoint's meta.json (ModelArch.to_dict) recorded it (one written while
    model.train_vision lived on the arch records it there too: the meta's config holds it)."""
    if "hf_config" in fields:
        return TransformersArch.from_dict({k: v for k, v in fields.items() if k != "train_vision"})
    return family_of(fields["model_type"]).arch_type.from_dict(fields)


def load_hf_arch(model_dir: str | Path, implementation: str = "auto") -> ModelArch:
    path = Path(model_dir) / "config.json" if Path(model_dir).is_dir() else Path(model_dir)
    if not Path(model_dir).exists():
        relative = "" if Path(model_dir).expanduser().is_absolute() else f" (relative to {Path.cwd()})"
        raise FileNotFoundError(f"model.path {str(model_dir)!r}: no such file or directory{relative}; a Hugging Face "
                                f"Hub name has the form owner/name")
    if not path.exists():
        raise FileNotFoundError(f"no config.json at {path}")
    return arch_from_hf_config(json.loads(path.read_text()), implementation)


def resolve_arch(preset: str | None = None, path: str | None = None, implementation: str = "auto") -> ModelArch:
    """A preset name, or a Hugging Face model directory / config.json path; a hand-written
    family's preset with implementation transformers runs through transformers' modules."""
    if path:
        return load_hf_arch(path, implementation)
    if preset is None:
        raise ValueError("set model.preset or model.path")
    if preset in PRESETS:
        arch = PRESETS[preset]
        return transformers_arch(arch_to_hf_config(arch)) if implementation == "transformers" else arch
    if Path(preset).exists():
        return load_hf_arch(preset, implementation)
    raise ValueError(f"unknown model preset {preset!r}; presets: {', '.join(PRESETS)}")


def model_arch(cfg: ModelConfig) -> ModelArch:
    """The preset or HF config with model.overrides applied; a bad name or value is a ConfigError.
    A model run through transformers' modules is first checked against transformers itself
    (models/transformers/check.py)."""
    try:
        arch = resolve_arch(cfg.preset, cfg.path, cfg.implementation)
        if isinstance(arch, TransformersArch):
            from megatrain_ray.models.transformers.check import checked

            arch = checked(with_config_overrides(arch, cfg.overrides, cfg.router_aux_loss_coef))
            return with_vision_tower_checked(arch, cfg.train_vision)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from None
    arch = with_router_aux_loss(with_vision_tower_checked(arch, cfg.train_vision), cfg.router_aux_loss_coef)
    if not cfg.overrides:
        return arch
    names = [f.name for f in dataclasses.fields(arch)]
    for key in cfg.overrides:
        if key not in names:
            raise ConfigError(f"unknown key model.overrides.{key}{nearest_hint(key, names)}")
    try:
        arch = arch.replace(**cfg.overrides)
        family(arch)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"model.overrides: {e}") from None
    return arch


def with_config_overrides(arch: TransformersArch, overrides: dict[str, Any], aux_coef: float | None) -> ModelArch:
    """model.overrides on a transformers-family model change its config.json keys (the shared
    field names num_layers, num_heads, ... stand for theirs); a list per layer (layer_types) is cut
    to a smaller num_hidden_layers. model.router_aux_loss_coef as for the hand-written families."""
    if not overrides and aux_coef is None:
        return arch
    config = arch.config
    for key, value in overrides.items():
        key = overridable_keys().get(key, key)
        if key not in config:
            raise ConfigError(f"unknown key model.overrides.{key}: {arch.model_type}'s config.json has no such key"
                              f"{nearest_hint(key, list(config))}")
        config[key] = value
    layers = config.get("num_hidden_layers")
    for key, value in list(config.items()):
        if isinstance(value, list) and isinstance(layers, int) and len(value) > layers and key.startswith("layer"):
            config[key] = value[:layers]
    if aux_coef is not None:
        if "output_router_logits" not in config:
            raise ConfigError(f"model.router_aux_loss_coef: {arch.model_type} has no router (mixture-of-experts models only)")
        config["output_router_logits"] = aux_coef != 0
        if aux_coef:
            config["router_aux_loss_coef"] = aux_coef
    return transformers_arch(config)


def with_vision_tower_checked(arch: ModelArch, train_vision: bool) -> ModelArch:
    """The arch, where model.train_vision asks for a vision tower that it has; the setting stays the
    run's (model_layouts takes it), not the arch's."""
    if train_vision and not family(arch).vision_tensors(arch):
        raise ConfigError(f"model.train_vision: {arch.model_type} has no vision tower (image-text models only)")
    return arch


def with_router_aux_loss(arch: ModelArch, coef: float | None) -> ModelArch:
    """model.router_aux_loss_coef: None keeps what config.json says (transformers counts the loss
    only with output_router_logits); a number turns it on with that coefficient, 0 turns it off."""
    if coef is None:
        return arch
    if not hasattr(arch, "output_router_logits"):
        raise ConfigError(f"model.router_aux_loss_coef: {arch.model_type} has no router (mixture-of-experts models only)")
    if coef == 0:
        return arch.replace(output_router_logits=False)
    return arch.replace(router_aux_loss_coef=coef, output_router_logits=True)
