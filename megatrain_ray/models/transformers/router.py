"""The router's load-balancing loss as transformers computes it (load_balancing_loss_func): which
modules record router logits, the causal LM's settings of the loss, and one layer's share of it.
"""

from __future__ import annotations

import functools

import torch

from megatrain_ray.models.transformers import modules as hm
from megatrain_ray.models.transformers.arch import TransformersArch, parts


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


def router_aux_term(arch: TransformersArch, stats: torch.Tensor, totals: torch.Tensor) -> torch.Tensor:
    """One layer's share of coef x load_balancing_loss_func over all layers' router logits:
    E x sum_e C_e p_e / rows^2, with C all layers' assignment counts (constants), p this layer's
    probability sums and rows the tokens times the layers with a router (models/moe.py derives it)."""
    experts, per_token, coef = aux_settings(arch)
    counts = totals[0].detach()
    rows = counts.sum() / per_token
    return coef * experts * (counts * stats[1]).sum() / (rows * rows)
