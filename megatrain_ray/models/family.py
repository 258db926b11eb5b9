"""The model interface: everything the executor, the stores, the planner and the HF import/export
need to know about a family of models, and nothing else.

A family is one file (models/llama.py is the first) with one object, an instance of a subclass of
`ModelFamily`. The executor binds each streamed layer's weights as views into a device slot and
calls the family's pure templates on them; the stores lay out and initialise the layers;
files/hf.py names their tensors; the planner and the benchmark count their memory and FLOPs.
Registering the object in models/registry.py makes its model_types trainable.

A subclass must give the abstract members (its shapes, names and templates) and may override the
defaults below, which fit a dense decoder with Llama's conventions. A family close to another
inherits from it instead (Phi-3 from Llama, Qwen3-MoE and GPT-OSS from Mixtral).
"""

from __future__ import annotations

import abc
import contextlib
from typing import Any, Callable

import torch

from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.hf_adapter import DECODER_FIELDS, HfField
from megatrain_ray.models.layout import LayerLayout, ParamSlot, matmul_params

Weights = dict[str, torch.Tensor]
IGNORE_INDEX = -100  # label of a position that carries no loss

# The share of a kept graph's activations that torch.compile's partitioner may keep for backward
# (streaming/compiled.py): it recomputes the cheapest of the rest (pointwise ops such as SwiGLU's
# product) instead. 0.8 spared the most recompute per byte kept on a Qwen2.5-3B block.
KEPT_ACTIVATION_BUDGET = 0.8


class ModelFamily(abc.ABC):
    """One family of decoder models: its shapes and names, its stateless templates, and what the
    planner and the benchmark count. Abstract members are the family's to say; the others are
    defaults that a family overrides where it differs."""

    model_types: tuple[str, ...] = ()  # the Hugging Face config.json model_type values it runs
    arch_type: type[ModelArch] = ModelArch  # ModelArch, or a subclass with the family's own fields
    presets: dict[str, ModelArch] = {}  # named shapes, for random-initialised runs and benchmarks
    # the arch fields its config.json holds, under which keys, with what defaults (models/hf_adapter.py)
    hf_fields: tuple[HfField, ...] = DECODER_FIELDS
    embed_name = "model.embed_tokens.weight"  # the HF name of the input embedding ...
    tied_head_name = "lm_head.weight"  # ... and of an LM head that may be tied to it
    refused: dict[str, str] = {}  # model_types it knowingly does not run -> why, and what to do instead
    # The activation budget its kept graphs compile within (streaming/compiled.py); None:
    # torch.compile's default partition, for a family whose blocks the budgeted partition does not run.
    kept_activation_budget: float | None = KEPT_ACTIVATION_BUDGET
    # Which template a block call runs, (arch, ctx) -> a key, for a family whose layers run several
    # (models/transformers/): its compiled block falls back to eager per template where compiling one
    # fails (streaming/compiled.py). None: one template, compiled or not.
    template_of: Callable[[ModelArch, Any], Any] | None = None

    # -- shapes and names ------------------------------------------------------------------------
    @abc.abstractmethod
    def arch_from_hf(self, config: dict[str, Any]) -> ModelArch:
        """A transformers config.json as an arch; ValueError for what the templates cannot run."""

    @abc.abstractmethod
    def hf_config(self, arch: ModelArch, torch_dtype: str) -> dict[str, Any]:
        """The config.json that transformers needs to load an export."""

    @abc.abstractmethod
    def layouts(self, arch: ModelArch) -> tuple[LayerLayout, ...]:
        """The streamed layers in order: an EMBED layer, BLOCK layers, a HEAD layer."""

    # -- what callers outside models/ ask of any family (none of them tests a family's class) --------
    def template_kinds(self, arch: ModelArch) -> tuple | None:
        """Per decoder layer, the template it runs (layers of one template are probed once:
        planning/probe.py); None: the layers' tensor names and shapes tell them apart."""
        return None

    def measures_working_set(self, arch: ModelArch) -> bool:
        """Whether the plan measures its layers' working set on the worker's device (planning/probe.py)
        rather than take the family's fit (working_set_bytes)."""
        return False

    def layer_inactive_params(self, arch: ModelArch, layout: LayerLayout) -> int:
        """A layer's parameters a token does not use (experts it is not routed to), where the family
        counts them per layer for the probe's FLOPs."""
        return 0

    def vision_tensors(self, arch: ModelArch) -> frozenset[str]:
        """An image-text model's vision tower and projector: the local names of their tensors in the
        embedding layer, which registry.model_layouts marks frozen unless model.train_vision; none
        for a decoder alone."""
        return frozenset()

    def dense_equivalent(self, arch: ModelArch) -> ModelArch | None:
        """A dense model with as many active parameters as a mixture of experts (the benchmark's
        comparison: bench/parts.py); None for a dense model."""
        return None

    def draws_random(self, arch: ModelArch) -> bool:
        """Whether a training forward draws random numbers (dropout, a router's jitter): the
        executor then replays each layer's draws in its recompute (streaming/rng.py)."""
        return False

    def evaluating(self, arch: ModelArch):
        """A context in which the templates compute as in evaluation (no dropout)."""
        return contextlib.nullcontext()

    def read_as(self, arch: ModelArch, name: str) -> str:
        """The layouts' name of a tensor that a model's files hold under `name` (an older name
        transformers still loads), else `name`."""
        return name

    def carried(self, arch: ModelArch, name: str) -> bool:
        """Whether a tensor of the model's files is carried unchanged to the checkpoints and the
        export without being trained or streamed (multi-token-prediction layers that the model's
        forward does not run): files/carried.py."""
        return False

    def carried_note(self, arch: ModelArch) -> str | None:
        """The one line said at start about what `carried` keeps, None if nothing."""
        return None

    def init_param(self, slot: ParamSlot, view: torch.Tensor, gen: torch.Generator, std: float) -> None:
        """Random initialisation of one parameter or a piece of it (`view`), in place, from `gen`
        only: norm weights one, biases zero, everything else normal with standard deviation `std`."""
        if slot.name.endswith("norm.weight"):
            view.fill_(1.0)
        elif slot.name.endswith("bias"):
            view.zero_()
        else:
            view.normal_(0.0, std, generator=gen)

    # -- the stateless templates -----------------------------------------------------------------
    @abc.abstractmethod
    def context(self, arch: ModelArch, position_ids: torch.Tensor, dtype: torch.dtype,
                packed: bool | None = None) -> Any:
        """Per micro-batch, shared by every block: position tables, masks. `packed`: whether a row
        packs several documents, where the caller knows it from the host's copy of the batch
        (models/ops.py, packs_documents); None: asked of `position_ids`."""

    def layer_context(self, arch: ModelArch, ctx: Any, layer: int) -> Any:
        """What block `layer` (its layout index) takes of the micro-batch context: the context itself
        when every block is alike (this default); a sliding-window block's own RoPE tables and mask
        (Gemma 3). Called outside the compiled block, once per block call."""
        return ctx

    def batch_context(self, arch: ModelArch, mb: dict[str, torch.Tensor], dtype: torch.dtype,
                      packed: bool | None = None) -> Any:
        """`context` of a micro-batch (an image-text model's reads more of it than its positions)."""
        return self.context(arch, mb["position_ids"], dtype, packed)

    def embed_inputs(self, arch: ModelArch, mb: dict[str, torch.Tensor]) -> Any:
        """What `embed` takes of a micro-batch: its token ids (an image-text model's: its images too)."""
        return mb["input_ids"]

    @abc.abstractmethod
    def embed(self, arch: ModelArch, w: Weights, input_ids: torch.Tensor) -> torch.Tensor: ...

    @abc.abstractmethod
    def block(self, arch: ModelArch, w: Weights, x: torch.Tensor, ctx: Any, mlp_chunk: int = 0) -> torch.Tensor:
        """One decoder block; `mlp_chunk` > 0: its MLP over checkpointed chunks of that many tokens.
        A family with an auxiliary loss also takes `aux` (see `aux_loss_on`)."""

    @abc.abstractmethod
    def head_loss(self, arch: ModelArch, head: Weights, embed: Weights | None, x: torch.Tensor,
                  labels: torch.Tensor, chunk_tokens: int, scale: float) -> torch.Tensor:
        """Final norm, LM head and summed token cross-entropy times `scale`, in chunks of tokens."""

    @abc.abstractmethod
    def logits(self, arch: ModelArch, head: Weights, embed: Weights | None, x: torch.Tensor) -> torch.Tensor:
        """All logits at once: for the plain-PyTorch reference, never for training."""

    # -- what the planner and the benchmark count ----------------------------------------------
    def matmul_params(self, arch: ModelArch) -> int:
        """Parameters that take part in a matmul per token: all but an untied input embedding
        (active ones only, for mixtures of experts)."""
        return matmul_params(arch, self.layouts(arch))

    def attention_flops_per_token(self, arch: ModelArch, seq_len: int) -> float:
        """Attention score and value FLOPs per token, forward and backward, causal: 6 x layers x
        seq x (heads x head_dim), half the full 12 as the causal mask halves the work."""
        return 6 * arch.num_layers * seq_len * arch.num_heads * arch.head_dim

    @abc.abstractmethod
    def working_set_bytes(self, arch: ModelArch, tokens: int, mlp_tokens: int, dtype_bytes: int) -> int:
        """One block's tensors alive during its recompute and backward over `tokens` tokens."""

    def inactive_params(self, arch: ModelArch) -> int:
        """Parameters a token does not use (experts it is not routed to), for the step-time model."""
        return 0

    # -- an auxiliary loss ----------------------------------------------------------------------
    # A loss whose value needs statistics of every block of a micro-batch (a router's load-balancing
    # loss averages the expert loads over all layers), while the executor streams layer-major. So:
    # with `aux_loss_on(arch)`, `block(..., aux=True)` returns `(y, stats)` (`stats` None for a block
    # that has none, e.g. a dense layer in a mixture-of-experts model); forward sums each
    # micro-batch's stats over its blocks, without gradient (`totals`); the backward recompute of
    # each block adds `aux_loss_term(arch, stats, totals)` to what it differentiates. The terms of
    # all blocks must add up to the loss, and its gradient must flow only through `stats` (the
    # totals are constants): true of a loss linear in each block's differentiable statistics once
    # the non-differentiable ones (counts) are fixed.
    def aux_loss_on(self, arch: ModelArch) -> bool:
        return False

    def vision_bytes(self, arch: ModelArch, tokens: int, dtype_bytes: int, trained: bool) -> int:
        """An image-text model's vision tower and projector on the device for a micro-batch of
        `tokens` positions, `trained` (model.train_vision) or frozen (planning/memory.py's line for
        it): none for a decoder alone."""
        return 0

    def compiled_variants(self, arch: ModelArch) -> int:
        """How many layer structures torch.compile specialises the block on (streaming/compiled.py
        sizes its recompile limit by it): one where every layer runs the same code."""
        return 1

    def aux_loss_term(self, arch: ModelArch, stats: torch.Tensor, totals: torch.Tensor) -> torch.Tensor:
        """One block's share of the auxiliary loss of a micro-batch (a scalar, already weighted)."""
        raise NotImplementedError(f"{type(self).__name__} has no auxiliary loss")
