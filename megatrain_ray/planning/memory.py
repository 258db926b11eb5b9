"""The memory model of a step, before anything is allocated: GPU memory by use (weight slots,
gradient buffers, boundary activations, one layer's working set, the loss chunk, an image-text
model's vision tower, the forward graphs the last blocks keep, the embedding's step on the device),
per device when several GPUs share a step, and the host memory the GPU node parks activations and
sums gradients in. It decides nothing: planning/decisions.py chooses with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatrain_ray.config import Config
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.registry import family, model_layouts
from megatrain_ray.objective import objective_of

GiB = 1024**3


# NCCL's own buffers on each GPU (outside torch's allocator): an allowance, not a measurement.
NCCL_BUFFER_BYTES = GiB // 2
# bytes per element of a loss chunk's [tokens x vocab] tensors at their peak (bf16 logits, fp32
# log-softmax and its gradient, not all alive at once). These constants are fitted to peaks measured
# on the H100 (7B and 1.5B shapes from 4k to 512k tokens, small models; examples/benchmarks/results):
# within 8% for steps of several micro-batches, and over (the safe side) for steps of one short
# sequence. A block's working set is its family's to say (ModelFamily.working_set_bytes), fitted to
# the same peaks.
LOSS_BYTES_PER_LOGIT = 9
# The policy loss of reinforcement learning (GRPO's head loss, rl/loss.py) runs uncompiled:
# bf16 logits, their fp32 copy, the log-softmax, the entropy's two fp32 temporaries, then the
# log-softmax's and the cast's gradients. An estimate from those tensors, not yet measured.
POLICY_LOSS_BYTES_PER_LOGIT = 20


BOUNDARY = "boundary activations (input of every layer, every micro-batch)"


KEPT = "kept forward graphs (the last blocks: no recompute)"
# A kept graph per micro-batch against the block's working set: what each kept block added to the
# measured peak (7B at seq 1024 with 2 and 4 blocks kept; smaller blocks added less), the larger
# kept so that the plan errs on the safe side.
KEPT_GRAPH_PER_WORKING_SET = 1.15
# The same, compiled within the family's kept_activation_budget (where the block is compiled: no
# MLP chunks): the partition keeps about three quarters of the working set for one block alone
# (examples/benchmarks/probe_kept_block.py), and less inside a whole step, where 0.7 plans the
# measured peaks of Qwen2.5-3B with 12 to 17 blocks kept just above each.
KEPT_GRAPH_PER_WORKING_SET_BUDGETED = 0.7
HOST_PARK_RESERVE = 1 * GiB  # the GPU actor's own growth beside its parked activations


class PlanError(ValueError):
    """A run that will not fit; the message says what to change."""


@dataclass
class GpuPlan:
    by_use: dict[str, int] = field(default_factory=dict)
    offload: bool = False  # the boundary activations parked in host memory
    kept: int = 0  # blocks keeping their forward graphs

    @property
    def total(self) -> int:
        return sum(self.by_use.values())


def dtype_bytes(config: Config) -> int:
    return 2 if config.model.compute_dtype == "bfloat16" else 4


# executor.loss_chunk_tokens, executor.mlp_chunk_tokens and executor.num_slots left on auto (null):
# these, made smaller by the step plan (fit_auto_settings) down to the least where the GPU memory needs it.
LOSS_CHUNK_TOKENS = 4096
MLP_CHUNK_TOKENS = 16384
NUM_SLOTS = 3
SMALLEST_LOSS_CHUNK = 256  # below it the head's matmuls are too thin to run at speed
SMALLEST_MLP_CHUNK = 1024
FEWEST_SLOTS = 2  # one computing, one filling


def loss_chunk_setting(config: Config) -> int:
    """executor.loss_chunk_tokens as set, or (null) its default: the step plan's choice is in its config."""
    chunk = config.executor.loss_chunk_tokens
    return LOSS_CHUNK_TOKENS if chunk is None else chunk


def mlp_chunk_setting(config: Config) -> int:
    chunk = config.executor.mlp_chunk_tokens
    return MLP_CHUNK_TOKENS if chunk is None else chunk


def num_slots_setting(config: Config) -> int:
    slots = config.executor.num_slots
    return NUM_SLOTS if slots is None else slots


def mlp_chunk_tokens(arch: ModelArch, tokens: int, config: Config) -> int:
    chunk = mlp_chunk_setting(config)
    return tokens if chunk <= 0 else min(tokens, chunk)


def hidden_state_bytes(arch: ModelArch, config: Config) -> int:
    """One micro-batch's hidden states: a layer's input, or the gradient flowing back into it."""
    return config.train.micro_batch_size * config.data.seq_len * arch.stream_width * dtype_bytes(config)


def micro_batches_per_gpu(config: Config, num_gpus: int) -> int:
    """Each of the data-parallel GPUs takes an equal share of the step's micro-batches."""
    return max(1, config.train.grad_accum // num_gpus)


def boundary_bytes(arch: ModelArch, config: Config, layers: int, num_gpus: int = 1) -> int:
    """The inputs of `layers` layers for every micro-batch of one GPU's share, kept for their recompute."""
    return layers * micro_batches_per_gpu(config, num_gpus) * hidden_state_bytes(arch, config)


def parked_bytes(arch: ModelArch, config: Config) -> int:
    """Pinned host memory that offloaded boundary activations take on the GPU node: every layer's
    input, every micro-batch of the step (all its GPUs park on that node), each block rounded up to
    a power of two as torch's caching host allocator does."""
    one = hidden_state_bytes(arch, config)
    return (len(model_layouts(arch)) - 1) * config.train.grad_accum * (1 << (one - 1).bit_length())


def layer_working_set(arch: ModelArch, config: Config, tokens: int, mlp_tokens: int, measured: float = 0.0) -> int:
    """One layer's working set for a micro-batch of `tokens`: `measured` elements a token where the
    workers measured it on their device (DeviceFacts.measured_working_set, planning/probe.py), else
    the family's fit (ModelFamily.working_set_bytes)."""
    d = dtype_bytes(config)
    if measured > 0:
        return int(tokens * measured * d)
    return family(arch).working_set_bytes(arch, tokens, mlp_tokens, d)


def kept_graph_bytes(arch: ModelArch, config: Config, num_gpus: int = 1, measured: float = 0.0) -> int:
    """One block's kept forward graph for every micro-batch of a GPU's share, and the copy of its
    weights the graph reads: the block's working set (ModelFamily.working_set_bytes) per
    micro-batch times KEPT_GRAPH_PER_WORKING_SET, or the _BUDGETED factor where the block runs
    compiled (executor.compile, no MLP chunks) within its family's activation budget."""
    d = dtype_bytes(config)
    mb_tokens = config.train.micro_batch_size * config.data.seq_len
    mlp_tokens = mlp_chunk_tokens(arch, mb_tokens, config)
    working_set = layer_working_set(arch, config, mb_tokens, mlp_tokens, measured)
    budgeted = config.executor.compile and mlp_tokens >= mb_tokens and family(arch).kept_activation_budget is not None
    per_working_set = KEPT_GRAPH_PER_WORKING_SET_BUDGETED if budgeted else KEPT_GRAPH_PER_WORKING_SET
    graph = math.ceil(per_working_set * working_set) * micro_batches_per_gpu(config, num_gpus)
    return graph + max(block_numels(arch)) * d


def block_numels(arch: ModelArch) -> list[int]:
    """Each decoder block's parameters, in order (the layouts between the embedding and the head)."""
    return [layout.numel for layout in model_layouts(arch)[1:-1]]


def num_blocks(arch: ModelArch) -> int:
    return len(block_numels(arch))


def gpu_plan(arch: ModelArch, config: Config, offload: bool = False, num_gpus: int = 1, kept: int = 0,
             embedding_on_device: bool = False, measured: float = 0.0) -> GpuPlan:
    """Peak bytes by use on each GPU for one optimizer step of this config (activations offloaded or
    not, `kept` blocks keeping their forward graphs, the embedding's AdamW step on the device or
    not), with `num_gpus` GPUs sharing the step's micro-batches; `measured`: the working set a token
    the workers measured (layer_working_set)."""
    layouts = model_layouts(arch)
    d = dtype_bytes(config)
    t = config.train
    mb_tokens = t.micro_batch_size * config.data.seq_len
    plan = GpuPlan(offload=offload, kept=kept)
    counts: dict[int, int] = {}
    for layout in layouts:
        counts[layout.numel] = counts.get(layout.numel, 0) + 1
    plan.by_use["weight slots"] = sum(min(num_slots_setting(config), c) * n * d for n, c in counts.items())
    host = host_gradient_layers(arch, config, num_gpus, embedding_on_device)
    largest = max(layout.numel for i, layout in enumerate(layouts) if i not in host)
    if host:  # one layer's gradient at a time: a block's accumulator, or one share of a vocabulary layer's
        plan.by_use[HOST_SUMMED_GRADIENT] = max(largest * (4 + 2 * d), max(layouts[i].numel for i in host) * d)
    else:
        plan.by_use["gradient (fp32 accumulator, its bf16 copy out, autograd's)"] = largest * (4 + 2 * d)
    if num_gpus > 1:
        plan.by_use["gradient being summed across the GPUs (fp32, one layer)"] = largest * 4
        plan.by_use["NCCL buffers (an allowance)"] = NCCL_BUFFER_BYTES
    if arch.tie_word_embeddings:
        plan.by_use["tied embedding gradient held through backward"] = layouts[0].numel * 4
    held = {layer for layout in layouts for layer in layout.shares}  # a shared block's holders (LayerLayout.shares)
    if held:
        plan.by_use["shared blocks' gradients held through backward"] = sum(layouts[i].numel for i in held) * 4
    held_layers = 2 if offload else len(layouts) - 1  # offloaded: the one in use and the one coming back
    plan.by_use[BOUNDARY] = boundary_bytes(arch, config, held_layers, num_gpus)
    plan.by_use["boundary gradients in flight"] = boundary_bytes(arch, config, 2, num_gpus)
    mlp_tokens = mlp_chunk_tokens(arch, mb_tokens, config)
    plan.by_use["one layer's working set"] = layer_working_set(arch, config, mb_tokens, mlp_tokens, measured)
    chunk = min(loss_chunk_setting(config), mb_tokens)
    per_logit = POLICY_LOSS_BYTES_PER_LOGIT if objective_of(config).head_loss.policy else LOSS_BYTES_PER_LOGIT
    plan.by_use["loss chunk"] = chunk * arch.vocab_size * per_logit
    plan.by_use["RoPE tables"] = 2 * micro_batches_per_gpu(config, num_gpus) * mb_tokens * arch.head_dim * d
    vision = family(arch).vision_bytes(arch, mb_tokens, d, config.model.train_vision)
    if vision:
        plan.by_use[vision_line(config.model.train_vision)] = vision
    plan.by_use[KEPT] = kept * kept_graph_bytes(arch, config, num_gpus, measured)
    if embedding_on_device:
        n = layouts[0].numel
        gone = plan.by_use[KEPT] + plan.by_use["loss chunk"] + plan.by_use["one layer's working set"]
        plan.by_use[EMBEDDING_STEP] = 2 * n * d + max(0, 12 * n - gone)
    return plan


HOST_SUMMED_GRADIENT = ("gradient (a block's fp32 accumulator, its bf16 copy out, autograd's; the vocabulary layers' "
                        "summed in host memory, one micro-batch's or loss chunk's share here at a time)")


def host_gradient_layers(arch: ModelArch, config: Config, num_gpus: int = 1, embedding_on_device: bool = False
                         ) -> tuple[int, ...]:
    """The layers whose weight gradient the step sums in pinned host memory where executor.host_gradients
    is on (as set, or as the plan chose: choose_host_gradients): the embedding (unless its AdamW step
    runs on the device, which takes its gradient there) and the LM head, vocabulary-sized both, of a
    model whose head is untied (a tied embedding's gradient starts in the head and is held through the
    backward); none with several GPUs (their gradients are summed across them on the devices)."""
    if not config.executor.host_gradients or num_gpus > 1 or arch.tie_word_embeddings:
        return ()
    last = len(model_layouts(arch)) - 1
    return (last,) if embedding_on_device else (0, last)


def host_gradient_bytes(arch: ModelArch, config: Config, num_gpus: int = 1, embedding_on_device: bool = False) -> int:
    """Pinned host memory of the gradients summed there: an fp32 sum and two staging buffers of the
    largest such layer (streaming/host_gradients.py)."""
    host = host_gradient_layers(arch, config, num_gpus, embedding_on_device)
    numel = max((model_layouts(arch)[i].numel for i in host), default=0)
    return numel * (4 + 2 * dtype_bytes(config))


# an image-text model's vision tower line (ModelFamily.vision_bytes), frozen or trained
FROZEN_VISION = "vision tower and projector: pixels, forward (one micro-batch, every token an image token at most)"
TRAINED_VISION = ("vision tower and projector: pixels, forward, and what its backward keeps (model.train_vision) "
                  "(one micro-batch, every token an image token at most)")


def vision_line(train_vision: bool) -> str:
    return TRAINED_VISION if train_vision else FROZEN_VISION


# The new weights stay on the device between steps (two copies at the turn: the last step's and
# the next's); the fp32 state (12 bytes a parameter) is there only from the last blocks' backward
# to the next step's first layers, when the kept graphs, the loss chunk and the working set are
# gone: only what exceeds them counts (tests/planning/test_planner.py holds it to a small model's
# measured peak at the turn).
EMBEDDING_STEP = "the embedding's AdamW step on the GPU (new weights between steps, state at the turn)"


def host_parking(arch: ModelArch, config: Config, offload: bool, num_gpus: int = 1,
                 embedding_on_device: bool = False) -> int:
    """Host bytes the GPU node parks activations in (0 when they stay on the device); its GPUs'
    shares together, each parking its own micro-batches; and the pinned sums of gradients summed
    there (host_gradient_bytes)."""
    parked = parked_bytes(arch, config) + num_gpus * HOST_PARK_RESERVE if offload else 0
    return parked + host_gradient_bytes(arch, config, num_gpus, embedding_on_device)


def size(b: float) -> str:
    return f"{b / GiB:.2f} GiB" if b >= GiB else f"{b / 2**20:.1f} MiB"


def format_gpu_plan(plan: GpuPlan, inline: bool = False) -> str:
    parts = [f"{use}: {size(b)}" for use, b in plan.by_use.items() if b]
    return "; ".join(parts) if inline else "\n".join("  " + p for p in parts)
