"""The baselines' model: the family's templates as ordinary modules, one child module per decoder
block that owns its parameters directly, as both FSDP2 and ZeRO-3 gather a module's own
parameters in hooks around its forward; per-block activation checkpointing; the chunked loss.
Embedding, final norm and LM head live on the root (the head may be tied to the embedding)."""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import nn

from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.layout import BLOCK, EMBED, HEAD, LayerLayout, module_key
from megatrain_ray.models.registry import family, model_layouts

INIT_STD = 0.02
LOSS_CHUNK_TOKENS = 8192  # as `bench --loss-chunk-tokens`


def _register_layout(module: nn.Module, layout: LayerLayout, dtype: torch.dtype) -> None:
    for p in layout.params:
        module.register_parameter(module_key(p.name), nn.Parameter(torch.empty(p.shape, dtype=dtype)))


def _bound(module: nn.Module, layout: LayerLayout) -> dict[str, torch.Tensor]:
    """Look the parameters up at call time: FSDP2 and ZeRO-3 swap them in their hooks."""
    return {p.name: getattr(module, module_key(p.name)) for p in layout.params}


class DecoderBlock(nn.Module):
    """One decoder block that owns its parameters; checkpointing happens inside forward, so that
    FSDP2/ZeRO-3 hooks run around it once and backward recomputes with the gathered weights."""

    def __init__(self, arch: ModelArch, layout: LayerLayout, checkpoint: bool, dtype: torch.dtype):
        super().__init__()
        self.arch, self.layout, self.checkpoint = arch, layout, checkpoint
        _register_layout(self, layout, dtype)

    def _block(self, x: torch.Tensor, ctx) -> torch.Tensor:
        fam = family(self.arch)
        return fam.block(self.arch, _bound(self, self.layout), x, fam.layer_context(self.arch, ctx, self.layout.index))

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        if self.checkpoint and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._block, x, ctx, use_reentrant=False)
        return self._block(x, ctx)


class BaselineModel(nn.Module):
    """The model as ordinary modules: embedding, final norm and LM head live on the root (the
    head may be tied to the embedding), decoder blocks are children. forward(batch) returns the
    summed token cross-entropy in fp32; the synthetic data is unpacked, so attention is causal."""

    def __init__(self, arch: ModelArch, checkpoint_blocks: bool = True, compute_dtype: torch.dtype = torch.bfloat16,
                 loss_chunk_tokens: int = LOSS_CHUNK_TOKENS, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.arch, self.compute_dtype, self.loss_chunk_tokens = arch, compute_dtype, loss_chunk_tokens
        layouts = model_layouts(arch)
        self.embed_layout = next(lay for lay in layouts if lay.kind == EMBED)
        self.head_layout = next(lay for lay in layouts if lay.kind == HEAD)
        _register_layout(self, self.embed_layout, dtype)
        _register_layout(self, self.head_layout, dtype)
        self.blocks = nn.ModuleList(
            DecoderBlock(arch, lay, checkpoint_blocks, dtype) for lay in layouts if lay.kind == BLOCK
        )

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        arch, fam = self.arch, family(self.arch)
        embed = _bound(self, self.embed_layout)
        head = _bound(self, self.head_layout)
        x = fam.embed(arch, embed, fam.embed_inputs(arch, batch))
        ctx = fam.context(arch, batch["position_ids"], self.compute_dtype)
        for block in self.blocks:  # (a family's auxiliary loss is not counted: a throughput baseline)
            x = block(x, fam.layer_context(arch, ctx, block.layout.index))
        return fam.head_loss(arch, head, embed, x, batch["labels"], self.loss_chunk_tokens, 1.0)

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Weight decay on matrices only (not on stacked expert biases), as the streaming trainer does."""
        named = list(self.named_parameters())
        decay = [p for n, p in named if p.ndim >= 2 and not n.endswith("bias")]
        no_decay = [p for n, p in named if not (p.ndim >= 2 and not n.endswith("bias"))]
        return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, std: float = INIT_STD, init_device: torch.device | None = None) -> None:
    """Norms 1, biases 0, matrices N(0, std). Random numbers are drawn on `init_device` (the GPU
    when there is one: drawing 7B normals on one CPU thread takes most of a minute) and copied to
    wherever each parameter lives."""
    init_device = init_device or (torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    gen = torch.Generator(device=init_device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm__weight"):
            p.fill_(1.0)
        elif name.endswith("__bias"):
            p.zero_()
        else:
            p.copy_(torch.randn(p.shape, generator=gen, device=init_device, dtype=torch.float32).mul_(std))
