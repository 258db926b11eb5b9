"""The transformers family: any decoder-only causal LM that transformers builds, run through its
own modules as stateless templates.

Its arch carries the model's whole config.json; its layers are the model's own: the embedding
(everything of the decoder before its layers), one block per decoder layer with its parameters
flat under their Hugging Face names, and the head (the final norm and the LM head). Layers of one
structure share a template module (models/transformers/modules.py), called with torch.func.functional_call
on views of the streamed slot, so weights stay streamed and owned by the stores. It is chosen for
every model_type without a hand-written family (model.implementation auto), or for any with
model.implementation transformers.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from megatrain_ray.models import ops
from megatrain_ray.models.family import ModelFamily, Weights
from megatrain_ray.models.image_text import embed_inputs, tower_bytes
from megatrain_ray.models.layout import LayerLayout, ParamSlot
from megatrain_ray.models.transformers import modules as hm
from megatrain_ray.models.transformers.arch import (TransformersArch, arch_from_config, expert_counts, inactive_in,
                                                    parts, random_settings)
from megatrain_ray.models.transformers.calls import (HeadCall, LayerCall, bound_call, compiled_variant, device_of,
                                                     head_call, layer_calls)
from megatrain_ray.models.transformers.forward import (block_forward, block_with_router_stats, chunk_loss,
                                                       embed_forward, head_logits, head_state)
from megatrain_ray.models.transformers.names import (MTP_MODULE, layouts_of, mtp_layer_of, mtp_layers, renamed_in_files,
                                                     vision_names)
from megatrain_ray.models.transformers.router import aux_settings, router_aux_term


# Per token, a dense decoder layer's tensors alive during its recompute and backward, in units of
# the compute dtype: the Llama family's fit (models/llama.py). An estimate for other structures
# until the probe measures them (planning/probe.py).
WORKING_SET_PER_TOKEN = (13, 1)  # x hidden_size, x intermediate_size


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
        return bound_call(arch, call, device_of(call))

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

    def vision_bytes(self, arch: TransformersArch, tokens: int, dtype_bytes: int, trained: bool) -> int:
        config = arch.config
        return tower_bytes(config, tokens, dtype_bytes, trained) if hm.is_image_text(config) else 0

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
        return ops.chunked_cross_entropy(functools.partial(chunk_loss, call, state), hidden, dummy, labels,
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

    def vision_tensors(self, arch: TransformersArch) -> frozenset[str]:
        return vision_names(parts(arch))

    def working_set_bytes(self, arch: TransformersArch, tokens: int, mlp_tokens: int, dtype_bytes: int) -> int:
        per_h, per_i = WORKING_SET_PER_TOKEN
        experts, per_token = expert_counts(arch.config)
        rows = tokens * max(1, per_token if experts else 1)
        return (tokens * per_h * arch.hidden_size + rows * per_i * arch.intermediate_size) * dtype_bytes


TRANSFORMERS = TransformersFamily()
