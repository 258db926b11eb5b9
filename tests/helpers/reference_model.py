"""The whole model as one nn.Module with ordinary autograd, built from the project's own layer code.

Its forward runs the family's `embed`, `block` and `logits` (megatrain_ray/models), the same
functions the streaming executor runs: it is not an independent model. What it checks is the
streaming around that code: layers streamed through weight slots, recomputed in backward, each
layer's gradient accumulated over micro-batches and copied out once, clipping, and the host AdamW
(tests train it with torch.optim.AdamW beside the streaming trainer, on the same weights and data).
The layer code itself is compared with transformers' own models in tests/models/
(test_transformers_parity.py, test_families_parity.py, test_moe_parity.py, helpers/hf_parity.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.family import IGNORE_INDEX
from megatrain_ray.models.layout import BLOCK, EMBED, module_key
from megatrain_ray.models.registry import family, model_layouts


class ReferenceModel(nn.Module):
    def __init__(self, arch: ModelArch, layer_weights: list[torch.Tensor] | None = None, dtype=torch.float32):
        super().__init__()
        self.arch = arch
        self.layouts = model_layouts(arch)
        self.layers = nn.ModuleList()
        for layout in self.layouts:
            module = nn.Module()
            for p in layout.params:
                module.register_parameter(module_key(p.name), nn.Parameter(torch.zeros(p.shape, dtype=dtype)))
            self.layers.append(module)
        if layer_weights is not None:
            self.load_layer_weights(layer_weights)

    def load_layer_weights(self, flats: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for layout, module, flat in zip(self.layouts, self.layers, flats, strict=True):
                for name, view in layout.views(flat).items():
                    getattr(module, module_key(name)).copy_(view)

    def layer_weights(self) -> list[torch.Tensor]:
        """Each layer's parameters flattened in layout order (fp32), to compare with the stores."""
        return [
            torch.cat([getattr(m, module_key(p.name)).detach().float().reshape(-1) for p in layout.params])
            for layout, m in zip(self.layouts, self.layers, strict=True)
        ]

    def bound(self, index: int) -> dict[str, torch.Tensor]:
        return {p.name: getattr(self.layers[index], module_key(p.name)) for p in self.layouts[index].params}

    def decay_groups(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        decay, no_decay = [], []
        for layout, module in zip(self.layouts, self.layers, strict=True):
            for p in layout.params:
                (decay if p.decays else no_decay).append(getattr(module, module_key(p.name)))
        return decay, no_decay

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, compute_dtype=None) -> torch.Tensor:
        """Logits [B, T, vocab]. A family's auxiliary loss of this call is then `self.aux_loss`."""
        arch, fam = self.arch, family(self.arch)
        aux = fam.aux_loss_on(arch)
        x = fam.embed(arch, self.bound(0), fam.embed_inputs(arch, {"input_ids": input_ids, "position_ids": position_ids}))
        ctx = fam.context(arch, position_ids, compute_dtype or x.dtype)
        stats = []
        for layout in self.layouts:
            if layout.kind == BLOCK:
                layer_ctx = fam.layer_context(arch, ctx, layout.index)
                if aux:
                    x, s = fam.block(arch, self.bound(layout.index), x, layer_ctx, aux=True)
                    stats += [] if s is None else [s]
                else:
                    x = fam.block(arch, self.bound(layout.index), x, layer_ctx)
        # all layers' statistics at once, as transformers computes its load-balancing loss
        self.aux_loss = fam.aux_loss_term(arch, sum(stats), sum(stats).detach()) if stats else None
        head = self.bound(len(self.layouts) - 1)
        return fam.logits(arch, head, self.bound(0) if self.layouts[0].kind == EMBED else None, x)

    def loss_sum(self, batch: dict[str, torch.Tensor], compute_dtype=None) -> torch.Tensor:
        """Summed token cross-entropy, plus the auxiliary loss (if on) times the target tokens:
        divided by them, the mean loss transformers reports."""
        logits = self(batch["input_ids"], batch["position_ids"], compute_dtype)
        loss = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1),
            ignore_index=IGNORE_INDEX, reduction="sum",
        )
        if self.aux_loss is not None:
            loss = loss + self.aux_loss * int((batch["labels"] != IGNORE_INDEX).sum())
        return loss
