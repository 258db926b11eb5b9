"""What a run needs, where it lives, and whether it fits: before anything is allocated.

GPU memory by use (weight slots, gradient buffers, boundary activations, one layer's working set,
the loss chunk, an image-text model's vision tower, the forward graphs the last blocks keep where
memory is left over), per device when several GPUs share a step, host memory per node (from the
placement), and a step-time prediction from the measured rates of the GPU machine: what bounds the
step (compute, PCIe, host memory bandwidth, the host optimizer) and how many tokens a step keeps N
GPUs busy.
`megatrain-ray plan` prints it; a run's step plan (planning/step_plan.py) checks it once, before
anything is allocated, and refuses with what to change a run that will not fit.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from megatrain_ray.config import Config
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.registry import family, model_layouts, num_params
from megatrain_ray.objective import objective_of

GiB = 1024**3

# Rates measured on the H100 machine (examples/benchmarks/, `megatrain-ray bench --parts`).
LAYER_TFLOPS = 620e12  # one decoder layer's fwd+bwd, compiled
H2D_BYTES_PER_S = 50e9  # pinned / registered host memory
# host/adamw_kernel.py's one-pass kernel inside the pipeline on the H100 machine (16 cores, threads: its
# cores less two), as `bench` reports it ("host optimizer ... G params/s") at 1.5B to 7B: one pass
# over the state is what makes it faster than torch's three-pass AdamW (examples/benchmarks/).
HOST_ADAMW_PARAMS_PER_S = 4.8e9
HOST_ADAMW_THREADS = 14  # the threads that rate was measured with: per core, about 0.34 G params/s
TRANSPORT_CORES = 1  # a RAM node's core for its store's TCP links (socket copies) and its raylet, beside AdamW
# Not measured directly, a floor inferred from the optimizer: the one-pass AdamW moves 28 bytes a
# parameter (three fp32 buffers read and written, the bf16 gradient read, the bf16 weight written)
# at 4.8 G params/s, about 134 GB/s, beside the pipeline's copies. Several GPUs reading every layer
# share it; with one GPU its copies never come near it (their PCIe link binds first).
HOST_MEMORY_BYTES_PER_S = 100e9
# Assumed, not measured on our machines: NCCL summing a layer's fp32 gradient between two GPUs of
# one node (NVLink moves several times this, PCIe about half). It overlaps backward, so it binds
# only far below these rates.
GPU_LINK_BYTES_PER_S = 100e9
# Causal attention's kernel (SDPA's flash attention) at long context. Its backward recomputes the
# scores: 5 of its matmuls to the forward's 2, 2.5 forwards where the usual count (the families'
# attention_flops_per_token, 6 = 2 forward + 4 backward) takes 2; and it runs below a decoder layer's
# rate (LAYER_TFLOPS, measured at 4,096 tokens where the matmuls dominate). The share is fitted to the
# H100 machine's long-context steps (examples/benchmarks/2026-11-22-h100.md): Qwen2.5-1.5B at 524,288
# tokens, 226 s a step, nearly all attention (tests/planning/test_planner.py holds the plan to it and
# to the 7B at 131,072 tokens). With the old count (2 backward passes at the layer's rate) the plan
# took Qwen2.5-7B at 524,288 tokens for 403 s; it is 547 s.
ATTENTION_BACKWARD_PASSES = 2.5
ATTENTION_RATE_SHARE = 0.8
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


AUTO_OFFLOAD_MARGIN = 0.85  # offload before the prediction comes close to the free memory
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


def with_auto_settings(config: Config) -> Config:
    """`config` with the settings left on auto at their defaults."""
    return config.replace(executor=dataclasses.replace(config.executor, loss_chunk_tokens=loss_chunk_setting(config),
                                                       mlp_chunk_tokens=mlp_chunk_setting(config),
                                                       num_slots=num_slots_setting(config)))


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


def check_parked_fit(arch: ModelArch, config: Config, headroom_bytes: int, where: str, offload: bool = True,
                     summed_bytes: int = 0) -> None:
    """Parked activations (where `offload`) and gradients summed in host memory (`summed_bytes`:
    host_gradient_bytes) come on top of the stores' state: refuse before the node runs out.

    `headroom_bytes`: what the node can still give before Ray's memory monitor kills workers.
    """
    need = (parked_bytes(arch, config) if offload else 0) + summed_bytes + HOST_PARK_RESERVE
    what = " and " .join(w for w, on in (("parking the boundary activations", offload),
                                         ("summing the vocabulary layers' gradients", summed_bytes)) if on)
    if need > headroom_bytes:
        raise PlanError(
            f"{what} in host memory needs {need / GiB:.1f} GiB on {where}, which can "
            f"give {headroom_bytes / GiB:.1f} GiB beside the stores before Ray's memory monitor steps in. Fewer "
            f"micro-batches per step (train.grad_accum) or tokens per micro-batch (train.micro_batch_size, "
            f"data.seq_len), or RAM nodes to hold the model (runtime.store_on_gpu_node: false)"
        )


def kept_graph_bytes(arch: ModelArch, config: Config, num_gpus: int = 1) -> int:
    """One block's kept forward graph for every micro-batch of a GPU's share, and the copy of its
    weights the graph reads: the block's working set (ModelFamily.working_set_bytes) per
    micro-batch times KEPT_GRAPH_PER_WORKING_SET, or the _BUDGETED factor where the block runs
    compiled (executor.compile, no MLP chunks) within its family's activation budget."""
    d = dtype_bytes(config)
    mb_tokens = config.train.micro_batch_size * config.data.seq_len
    mlp_tokens = mlp_chunk_tokens(arch, mb_tokens, config)
    working_set = family(arch).working_set_bytes(arch, mb_tokens, mlp_tokens, d)
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
             embedding_on_device: bool = False) -> GpuPlan:
    """Peak bytes by use on each GPU for one optimizer step of this config (activations offloaded or
    not, `kept` blocks keeping their forward graphs, the embedding's AdamW step on the device or
    not), with `num_gpus` GPUs sharing the step's micro-batches."""
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
    plan.by_use["one layer's working set"] = family(arch).working_set_bytes(arch, mb_tokens, mlp_tokens, d)
    chunk = min(loss_chunk_setting(config), mb_tokens)
    per_logit = POLICY_LOSS_BYTES_PER_LOGIT if objective_of(config).head_loss.policy else LOSS_BYTES_PER_LOGIT
    plan.by_use["loss chunk"] = chunk * arch.vocab_size * per_logit
    plan.by_use["RoPE tables"] = 2 * micro_batches_per_gpu(config, num_gpus) * mb_tokens * arch.head_dim * d
    vision = family(arch).vision_bytes(arch, mb_tokens, d)
    if vision:
        plan.by_use[vision_line(arch)] = vision
    plan.by_use[KEPT] = kept * kept_graph_bytes(arch, config, num_gpus)
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


def choose_host_gradients(arch: ModelArch, config: Config, budget: int, num_gpus: int = 1,
                          embedding_on_device: bool = False) -> Config:
    """`config` with executor.host_gradients decided: as set, or (null) on only where the step does not
    fit the GPU's `budget` even with the smallest chunks and slots (fit_auto_settings) and summing the
    vocabulary layers' gradients in host memory spares the device their fp32 accumulator (its cost:
    each micro-batch's and loss chunk's share crosses to the host, where the CPU adds it). A setting of
    true that no layer can follow (a tied head, several GPUs) is refused."""
    setting = config.executor.host_gradients
    on = config.replace(executor=dataclasses.replace(config.executor, host_gradients=True))
    if setting and not host_gradient_layers(arch, on, num_gpus, embedding_on_device):
        raise PlanError("executor.host_gradients is true but no layer's gradient can be summed in host memory here: "
                        "that takes one GPU worker (runtime.num_gpus: 1) and an untied LM head; set it to null or false")
    if setting is None:
        off = config.replace(executor=dataclasses.replace(config.executor, host_gradients=False))
        setting = bool(host_gradient_layers(arch, on, num_gpus, embedding_on_device)) and not fits_leanest(
            arch, fit_auto_settings(arch, off, budget, num_gpus, embedding_on_device), budget, num_gpus,
            embedding_on_device)
    return config.replace(executor=dataclasses.replace(config.executor, host_gradients=setting))


# an image-text model's vision tower line (ModelFamily.vision_bytes), frozen or trained
FROZEN_VISION = "vision tower and projector: pixels, forward (one micro-batch, every token an image token at most)"
TRAINED_VISION = ("vision tower and projector: pixels, forward, and what its backward keeps (model.train_vision) "
                  "(one micro-batch, every token an image token at most)")


def vision_line(arch: ModelArch) -> str:
    return TRAINED_VISION if family(arch).trains_vision(arch) else FROZEN_VISION


# The new weights stay on the device between steps (two copies at the turn: the last step's and
# the next's); the fp32 state (12 bytes a parameter) is there only from the last blocks' backward
# to the next step's first layers, when the kept graphs, the loss chunk and the working set are
# gone: only what exceeds them counts (tests/planning/test_planner.py holds it to a small model's
# measured peak at the turn).
EMBEDDING_STEP = "the embedding's AdamW step on the GPU (new weights between steps, state at the turn)"


def embedding_step_on_device(setting: str, device: str, workers: int, in_reach: bool,
                             exact_state: bool = True, frozen_part: bool = False) -> bool:
    """executor.embedding_step: `device` wherever it can run, `auto` on a GPU, `host` never. It can
    run where the process of the worker that owns the embedding's gradient reaches its store memory
    (in process, or shared memory on its node: not over the network); with several data-parallel
    workers that owner steps it and sends the new weights to the others (`workers` changes nothing).
    Lean optimizer state (optim.master/optim.moments: `exact_state` False) steps on the host only:
    the device step moves and updates fp32 state (config validation refuses `device` with it). An
    embedding layer with a frozen part (an image-text model's vision tower), whose moments the store
    does not hold, steps on the host too."""
    if frozen_part and setting == "device":
        raise PlanError("executor.embedding_step is 'device' but the embedding layer holds a frozen vision tower, "
                        "which has no optimizer state to step there; set it to auto or host, or "
                        "model.train_vision: true")
    if setting == "host" or (setting == "auto" and (device != "cuda" or not exact_state or frozen_part)):
        return False
    if setting == "device" and not in_reach:
        raise PlanError("executor.embedding_step is 'device' but the embedding's step cannot run on the device "
                        "with its store on another node; set it to auto or host")
    return in_reach


def embedding_step_line(arch: ModelArch, workers: int = 1) -> str:
    n = model_layouts(arch)[0].numel
    where = "the GPU" if workers == 1 else "the GPU that owns its gradient, which sends the others its new weights"
    return (f"the embedding's AdamW step runs on {where} (executor.embedding_step): "
            f"its fp32 state ({size(12 * n)}) crosses PCIe during the last blocks' backward and goes back during the "
            f"next forward, so the next step starts without waiting for the host's update of the step's last gradient")


def host_gradients_line(arch: ModelArch, config: Config, layers: tuple[int, ...]) -> str:
    names = {0: "the embedding's", len(model_layouts(arch)) - 1: "the LM head's"}
    return (f"{' and '.join(names[i] for i in layers)} weight gradient summed in pinned host memory "
            f"(executor.host_gradients; {size(host_gradient_bytes(arch, config))} there): the device holds one "
            "micro-batch's or loss chunk's share at a time instead of an fp32 accumulator of the whole vocabulary; "
            "each share crosses to the host and the CPU adds it")


@dataclass(frozen=True)
class NetworkTimes:
    """Seconds a step's network transfers take (planning/traffic.py): weights in ahead of the forward and
    again ahead of the backward, gradients out during the backward, and at the turn of the step
    the first layer's gradient out, its store's update and its new weights back, which nothing hides
    (overlapped piece by piece: StepTraffic.turn_seconds)."""

    forward_in_s: float = 0.0
    backward_in_s: float = 0.0
    out_s: float = 0.0
    boundary_s: float = 0.0


@dataclass(frozen=True)
class StepPrediction:
    compute_s: float  # each GPU's share
    h2d_s: float  # each GPU, over its own PCIe link
    optimizer_s: float
    optimizer_exposed_s: float
    step_s: float
    bound: str  # compute, PCIe, host memory, GPU link, network or host optimizer
    network_exposed_s: float = 0.0
    num_gpus: int = 1
    tokens: int = 0  # per step, all GPUs
    host_read_bytes: int = 0  # weights read out of host memory per step: every GPU reads every layer, twice
    host_memory_s: float = 0.0  # the copies' host-memory traffic: those reads and the gradients back (once)
    reduce_s: float = 0.0  # gradients summed across the GPUs, overlapping backward
    busy_tokens: int = 0  # tokens per step (all GPUs) from which no GPU waits for the host, the network or the links
    forward_s: float = 0.0  # each GPU's forward share of compute_s
    host_summed_s: float = 0.0  # the vocabulary layers' gradient shares copied out and added on the host (not hidden)


def shared_network(net: NetworkTimes, num_gpus: int) -> NetworkTimes:
    """One GPU worker's transfers as N workers make them over the same links: every worker fetches
    every remote layer; each gradient leaves once."""
    if num_gpus == 1:
        return net
    return NetworkTimes(num_gpus * net.forward_in_s, num_gpus * net.backward_in_s, net.out_s, net.boundary_s)


def predict_step(arch: ModelArch, config: Config, network: NetworkTimes | None = None,
                 optimizer_s: float | None = None, num_gpus: int = 1, kept: int = 0, rates=None) -> StepPrediction:
    """Step time from the measured rates, in two phases. Compute with recompute is 8 FLOP per
    parameter a token uses, per token (a mixture of experts counts its routed experts only), 2 of
    them forward; the LM head 6 (streaming/executor.py differentiates it chunk by chunk: no recompute). The
    `kept` blocks that keep their graphs skip their share of the recompute (2 of the 8), unless
    the MLP runs in checkpointed chunks (they still recompute those: counted as recomputing
    whole), and the weights of those beyond the blocks resident across the turn cross PCIe once.
    Attention runs its forward, its share of the recompute and a backward of ATTENTION_BACKWARD_PASSES
    forwards, at ATTENTION_RATE_SHARE of the layer's rate: at long context nearly all of the step.
    The forward waits for the slowest of its compute, the host optimizer of the step before (over
    all parameters, layer by layer in the same order) and the weights coming over the network; the
    backward for the slowest of its compute, the weights coming again and the gradients leaving.
    All weights cross PCIe twice (the kept blocks once), overlapped with everything.
    `optimizer_s`: the slowest store machine's AdamW time (default: the whole model on one).
    `rates`: the GPU's (planning/rates.py; default: the H100 machine's, the constants above).

    With `num_gpus` GPUs each computes its share of the tokens and reads every layer (PCIe: its own
    link; host memory and the network's weights: shared, N times the bytes), each gradient is summed
    across the GPUs during the backward and leaves once, and the host optimizer runs once over all
    weights, hidden only behind one GPU's share of the forward: N GPUs need N times one's tokens."""
    t = config.train
    tokens = t.micro_batch_size * t.grad_accum * config.data.seq_len
    params = num_params(arch)
    active = family(arch).matmul_params(arch)  # not an untied embedding's lookup, nor idle experts
    d = dtype_bytes(config)
    mb_tokens = t.micro_batch_size * config.data.seq_len
    chunked = mlp_chunk_tokens(arch, mb_tokens, config) < mb_tokens
    flops = 8 - (0 if chunked else 2 * min(kept, num_blocks(arch)) / num_blocks(arch))  # per block parameter and token
    head = arch.vocab_size * arch.hidden_size  # differentiated as it goes: never recomputed
    # attention's forward (2 of the family's 6), its share of recompute, its backward; at its own rate
    attention = family(arch).attention_flops_per_token(arch, config.data.seq_len) / 3
    attention_passes = 1 + (flops - 6) / 2 + ATTENTION_BACKWARD_PASSES
    step_flops = flops * (active - head) + 6 * head + attention * attention_passes / ATTENTION_RATE_SHARE
    forward_share = (2 * active + attention / ATTENTION_RATE_SHARE) / step_flops  # in layer-rate FLOPs per token
    per_token = step_flops / (rates.layer_flops_per_s if rates else LAYER_TFLOPS)  # one GPU's seconds per token
    compute = per_token * tokens / num_gpus
    read = 2 * params - kept_reads_saved(arch, config, kept)
    h2d = read * d / (rates.h2d_bytes_per_s if rates else H2D_BYTES_PER_S)  # weights in twice, some kept blocks once
    host_read = num_gpus * read * d
    host_memory = (host_read + params * d) / HOST_MEMORY_BYTES_PER_S
    reduce = 4 * params / GPU_LINK_BYTES_PER_S if num_gpus > 1 else 0.0
    optimizer = params / HOST_ADAMW_PARAMS_PER_S if optimizer_s is None else optimizer_s
    net = shared_network(network or NetworkTimes(), num_gpus)
    fwd_compute = compute * forward_share
    bwd_compute = compute - fwd_compute
    summed = host_summed_seconds(arch, config, rates.h2d_bytes_per_s if rates else H2D_BYTES_PER_S)
    forward = max(fwd_compute, optimizer, net.forward_in_s)
    backward = max(bwd_compute, net.backward_in_s, net.out_s) + summed
    exposed = max(0.0, optimizer - max(fwd_compute, net.forward_in_s))
    network_exposed = (max(fwd_compute, net.forward_in_s) - fwd_compute) + (backward - bwd_compute) + net.boundary_s
    link_exposed = max(0.0, reduce - backward)
    copies = max(h2d, host_memory)
    step = max(forward + backward + net.boundary_s + link_exposed, copies + max(0.0, optimizer - fwd_compute))
    if exposed > 0.1 * step and exposed >= network_exposed:
        bound = "host optimizer"
    elif network_exposed > 0.1 * step:
        bound = "network"
    elif link_exposed > 0.1 * step:
        bound = "GPU link"
    else:
        overlapped = {"compute": compute, "PCIe": h2d, "host memory": host_memory}
        bound = max(overlapped, key=overlapped.get)
    busy_per_gpu = max(max(optimizer, net.forward_in_s) / forward_share,
                       max(net.backward_in_s, net.out_s, reduce) / (1 - forward_share), copies) / per_token
    return StepPrediction(compute, h2d, optimizer, exposed, step, bound, network_exposed, num_gpus, tokens,
                          host_read, host_memory, reduce, math.ceil(num_gpus * busy_per_gpu), fwd_compute, summed)


# per parameter of a share summed in host memory: its bf16 read, the fp32 sum read and written
HOST_ADD_BYTES = 10


def host_summed_seconds(arch: ModelArch, config: Config, link_bytes_per_s: float) -> float:
    """The time the gradients summed in host memory (host_gradient_layers; the embedding counted, as
    where its step runs on the device the plan sums none) add to a step, none of it hidden: each
    share (the embedding's per micro-batch, the head's per loss chunk) crosses the GPU's link and
    waits there, and the CPU's add of it, at the host memory's rate, overlaps the next share's compute
    but is counted whole (the safe side)."""
    layers = host_gradient_layers(arch, config)
    if not layers:
        return 0.0
    layouts = model_layouts(arch)
    mb_tokens = config.train.micro_batch_size * config.data.seq_len
    per_param = dtype_bytes(config) / link_bytes_per_s + HOST_ADD_BYTES / HOST_MEMORY_BYTES_PER_S
    shares = {0: 1, len(layouts) - 1: math.ceil(mb_tokens / min(loss_chunk_setting(config), mb_tokens))}
    return config.train.grad_accum * sum(shares[i] * layouts[i].numel for i in layers) * per_param


def kept_reads_saved(arch: ModelArch, config: Config, kept: int) -> int:
    """Parameters whose second fetch the kept blocks spare: those of the kept blocks beyond the last
    `num_slots - 1`, which stay resident across the turn into backward anyway."""
    blocks = block_numels(arch)
    k = min(kept, len(blocks))
    return sum(blocks[len(blocks) - k : len(blocks) - min(k, num_slots_setting(config) - 1)])


def host_parking(arch: ModelArch, config: Config, offload: bool, num_gpus: int = 1,
                 embedding_on_device: bool = False) -> int:
    """Host bytes the GPU node parks activations in (0 when they stay on the device); its GPUs'
    shares together, each parking its own micro-batches; and the pinned sums of gradients summed
    there (host_gradient_bytes)."""
    parked = parked_bytes(arch, config) + num_gpus * HOST_PARK_RESERVE if offload else 0
    return parked + host_gradient_bytes(arch, config, num_gpus, embedding_on_device)


def choose_offload(arch: ModelArch, config: Config, free_bytes: int, num_gpus: int = 1,
                   embedding_on_device: bool = False) -> bool:
    """executor.offload_activations: on, off, or (auto) only when the step does not fit otherwise."""
    mode = config.executor.offload_activations
    if mode != "auto":
        return mode == "on"
    wanted = min(config.executor.keep_graphs or 0, num_blocks(arch))  # an auto count fills what is left later
    plan = gpu_plan(arch, config, num_gpus=num_gpus, kept=wanted, embedding_on_device=embedding_on_device)
    return plan.total > AUTO_OFFLOAD_MARGIN * free_bytes


def choose_kept(arch: ModelArch, config: Config, free_bytes: int | None, num_gpus: int = 1, offload: bool = False,
                embedding_on_device: bool = False) -> int:
    """executor.keep_graphs: as set, or (null) as many of the last blocks as the memory the step
    (with `offload` as decided) leaves free holds, under the same margin as offloading; none
    without a GPU (`free_bytes` None)."""
    wanted = config.executor.keep_graphs
    if wanted is not None:
        return min(wanted, num_blocks(arch))
    if free_bytes is None:
        return 0
    rest = AUTO_OFFLOAD_MARGIN * free_bytes - gpu_plan(arch, config, offload, num_gpus,
                                                       embedding_on_device=embedding_on_device).total
    return max(0, min(num_blocks(arch), int(rest // kept_graph_bytes(arch, config, num_gpus))))


def device_budget(free_bytes: int | None, config: Config) -> int | None:
    """The device memory a step is planned against: what the GPU has free, or executor.gpu_memory_gib
    where that is less (the worker's allocator is then held to it: runtime/worker.py)."""
    cap = config.executor.gpu_memory_gib
    if free_bytes is None or cap is None:
        return free_bytes
    return min(free_bytes, int(cap * GiB))


def leanest_plan(arch: ModelArch, config: Config, num_gpus: int = 1, embedding_on_device: bool = False) -> GpuPlan:
    """The step's memory with what the plan may still give up given up: the activations parked
    (unless executor.offload_activations is off) and no kept graphs (unless executor.keep_graphs
    asks for some)."""
    offload = config.executor.offload_activations != "off"
    kept = min(config.executor.keep_graphs or 0, num_blocks(arch))
    return gpu_plan(arch, config, offload, num_gpus, kept, embedding_on_device)


def fits_leanest(arch: ModelArch, config: Config, budget: int, num_gpus: int = 1,
                 embedding_on_device: bool = False) -> bool:
    return leanest_plan(arch, config, num_gpus, embedding_on_device).total <= AUTO_OFFLOAD_MARGIN * budget


def fit_auto_settings(arch: ModelArch, config: Config, budget: int, num_gpus: int = 1,
                      embedding_on_device: bool = False) -> Config:
    """`config` with the settings the user left on auto (null) chosen: their defaults, or, where the
    step does not fit the GPU's `budget` even with its activations parked and no graph kept, the
    loss chunk halved first (down to SMALLEST_LOSS_CHUNK), then the MLP chunk (down to
    SMALLEST_MLP_CHUNK), then one weight slot fewer (down to FEWEST_SLOTS). A value the user set
    stays as set."""
    planned = with_auto_settings(config)
    for knob in ("loss_chunk_tokens", "mlp_chunk_tokens", "num_slots"):
        if getattr(config.executor, knob) is not None:
            continue
        while not fits_leanest(arch, planned, budget, num_gpus, embedding_on_device):
            less = smaller(arch, planned, knob)
            if less is None:
                break
            planned = planned.replace(executor=dataclasses.replace(planned.executor, **{knob: less}))
    return planned


def smaller(arch: ModelArch, config: Config, knob: str) -> int | None:
    """The next smaller value of an executor setting that fit_auto_settings chooses (None: at its least)."""
    mb_tokens = config.train.micro_batch_size * config.data.seq_len
    if knob == "loss_chunk_tokens":
        less = min(loss_chunk_setting(config), mb_tokens) // 2
        return less if less >= SMALLEST_LOSS_CHUNK else None
    if knob == "mlp_chunk_tokens":
        less = mlp_chunk_tokens(arch, mb_tokens, config) // 2
        return less if less >= SMALLEST_MLP_CHUNK else None
    less = num_slots_setting(config) - 1
    return less if less >= FEWEST_SLOTS else None


def gpu_memory(arch: ModelArch, config: Config, free_bytes: int, num_gpus: int = 1,
               embedding_on_device: bool = False) -> GpuPlan:
    """A GPU's memory for the step (`config` with its auto settings chosen: fit_auto_settings): offloading
    decided, then the kept blocks with it (the step plan's decisions: planning/step_plan.py calls
    it, once)."""
    offload = choose_offload(arch, config, free_bytes, num_gpus, embedding_on_device)
    kept = choose_kept(arch, config, free_bytes, num_gpus, offload, embedding_on_device)
    return gpu_plan(arch, config, offload, num_gpus, kept, embedding_on_device)


def check_gpu_fit(plan: GpuPlan, free_bytes: int, where: str, capped: bool = False) -> None:
    """Refuse a step the GPU cannot hold, with what to change; `capped`: `free_bytes` is
    executor.gpu_memory_gib, less than the GPU has free."""
    if plan.total <= free_bytes:
        return
    acts = plan.by_use[BOUNDARY]
    kept = (f", fewer blocks keeping their forward graphs (executor.keep_graphs: {plan.by_use[KEPT] / GiB:.1f} GiB)"
            if plan.by_use[KEPT] else "")
    tower = plan.by_use.get(TRAINED_VISION, 0)
    if tower:
        kept += f", the vision tower frozen (model.train_vision: false; trained, it takes {tower / GiB:.1f} GiB)"
    has = (f"may use {free_bytes / GiB:.1f} GiB of {where} (executor.gpu_memory_gib; it fits under "
           f"{math.ceil(10 * plan.total / GiB) / 10:.1f} GiB as planned here)" if capped
           else f"{where} has {free_bytes / GiB:.1f} GiB free")
    raise PlanError(
        f"the step needs about {plan.total / GiB:.1f} GiB of GPU memory but {has} "
        f"({format_gpu_plan(plan, inline=True)}). Fewer tokens per micro-batch "
        f"(train.micro_batch_size, data.seq_len) or fewer micro-batches per step (train.grad_accum: the boundary "
        f"activations are {acts / GiB:.1f} GiB{', offloaded to host memory already' if plan.offload else ''}){kept}, a "
        f"smaller executor.loss_chunk_tokens, or executor.mlp_chunk_tokens for long sequences"
    )


def host_memory(arch: ModelArch, config: Config, num_gpus: int = 1) -> GpuPlan:
    """A CPU worker's memory for the step: what a GPU would hold (slots, activations, the loss chunk)."""
    return gpu_plan(arch, config, num_gpus=num_gpus, kept=choose_kept(arch, config, None, num_gpus))


def check_host_fit(plan: GpuPlan, headroom_bytes: int, where: str, num_gpus: int = 1) -> None:
    """The executor on the CPU keeps its step's memory in host memory beside the stores: refuse a
    step Ray's memory monitor would kill instead. With several CPU workers on the node, all of theirs."""
    if plan.total * num_gpus <= headroom_bytes:
        return
    raise PlanError(
        f"the step needs about {num_gpus * plan.total / GiB:.1f} GiB of memory for the CPU executor"
        f"{f' ({num_gpus} workers)' if num_gpus > 1 else ''} but {where} can give "
        f"{headroom_bytes / GiB:.1f} GiB beside the stores before Ray's memory monitor steps in "
        f"({format_gpu_plan(plan, inline=True)}). Fewer tokens per micro-batch (train.micro_batch_size, "
        f"data.seq_len) or fewer micro-batches per step (train.grad_accum: the boundary activations are "
        f"{plan.by_use[BOUNDARY] / GiB:.1f} GiB), or a smaller executor.loss_chunk_tokens"
    )


def recompute_line(arch: ModelArch, config: Config, kept: int, num_gpus: int) -> str:
    if kept == 0:
        return ("every layer recomputes its forward in backward; weights are fetched twice per step (the last "
                f"{num_slots_setting(config) - 1} blocks stay resident across the turn)")
    graphs = kept * kept_graph_bytes(arch, config, num_gpus)
    return (f"kept forward graphs: the last {kept} of {num_blocks(arch)} blocks ({size(graphs)}), whose backward skips "
            "the recompute; every other layer recomputes its forward in backward")


def chunks_line(arch: ModelArch, config: Config) -> str:
    """The chunk sizes the step runs with (`config` as planned: StepPlan.planned_config)."""
    ex = config.executor
    mb_tokens = config.train.micro_batch_size * config.data.seq_len
    mlp = mlp_chunk_tokens(arch, mb_tokens, config)
    return (f"loss in chunks of {min(ex.loss_chunk_tokens, mb_tokens)} tokens (executor.loss_chunk_tokens); MLP "
            + (f"in checkpointed chunks of {mlp} tokens" if mlp < mb_tokens else "unchunked")
            + f" (executor.mlp_chunk_tokens); {ex.num_slots} weight slots per layer size (executor.num_slots)")


def size(b: float) -> str:
    return f"{b / GiB:.2f} GiB" if b >= GiB else f"{b / 2**20:.1f} MiB"


def format_gpu_plan(plan: GpuPlan, inline: bool = False) -> str:
    parts = [f"{use}: {size(b)}" for use, b in plan.by_use.items() if b]
    return "; ".join(parts) if inline else "\n".join("  " + p for p in parts)


def optimizer_cores(params: int, seconds: float) -> int:
    """Cores whose host AdamW updates `params` in `seconds`, at the H100 machine's rate per optimizer
    thread (the rate is the memory's past about its 14 threads: more cores help only with more memory
    bandwidth)."""
    per_core = HOST_ADAMW_PARAMS_PER_S / HOST_ADAMW_THREADS
    return max(1, math.ceil(params / max(seconds, 1e-9) / per_core))


def ram_node_cores(params: int, forward_s: float) -> int:
    """Cores a RAM node needs to keep up with the GPU step: its store's AdamW over its `params` within
    the forward (optimizer_cores), and its links' (TRANSPORT_CORES)."""
    return optimizer_cores(params, forward_s) + TRANSPORT_CORES


def optimizer_cores_line(arch: ModelArch, p: "StepPrediction", placement=None) -> str:
    """How many cores keep the host optimizer hidden behind the forward, in all and for each RAM node
    of the placement (planning/placement.py), with the threads its store will run where known."""
    cores = optimizer_cores(num_params(arch), p.forward_s)
    lines = [f"host AdamW cores that keep up (the step's update within the {p.forward_s:.2f} s forward, at "
             f"{HOST_ADAMW_PARAMS_PER_S / HOST_ADAMW_THREADS / 1e9:.2f} G params/s a core, the H100 machine's "
             f"{HOST_ADAMW_PARAMS_PER_S / 1e9:.1f} over {HOST_ADAMW_THREADS} optimizer threads): {cores} over all the "
             f"stores; a RAM node holding a fraction f of the parameters needs f x {cores} optimizer threads "
             f"(runtime.optimizer_threads) and {TRANSPORT_CORES} core for its links"]
    numels = [layout.numel for layout in model_layouts(arch)]
    for store in (s for s in (placement.stores if placement else ()) if s.node.ram_node):
        params = sum(numels[i] for i in store.layers)
        need = ram_node_cores(params, p.forward_s)
        has = (f"; its store runs {store.threads} optimizer thread{'s' if store.threads > 1 else ''}"
               + (" (enough)" if store.threads >= need - TRANSPORT_CORES else
                  f": {params / (store.threads * HOST_ADAMW_PARAMS_PER_S / HOST_ADAMW_THREADS):.2f} s of AdamW "
                  f"a step, beyond the forward") if store.threads else "")
        lines.append(f"  RAM node {store.node.ip} ({params / 1e9:.2f} B parameters): {need} cores keep up "
                     f"(`ray start --num-cpus`, default all of them){has}")
    return "\n".join(lines)


def disk_step_line(p: StepPrediction, disk_s: float) -> str:
    """The disk tier's term in the predicted step: its reads and writes run beside the host optimizer,
    behind the next step's forward, and are hidden from the tokens whose forward lasts as long."""
    exposed = max(0.0, disk_s - p.forward_s)
    hiding = math.ceil(p.tokens * disk_s / p.forward_s) if p.forward_s > 0 else 0
    return (f"disk tier: {disk_s:.2f} s of reads and writes a step (in the host optimizer's term above), behind the "
            f"forward's {p.forward_s:.2f} s of compute: {exposed:.2f} s not hidden; hidden from {hiding} tokens a step")


def describe(arch: ModelArch, config: Config, step, network: NetworkTimes | None = None,
             optimizer_s: float | None = None, rates=None, no_prediction: str | None = None) -> str:
    """The step plan (planning/step_plan.py: StepPlan) as text, with the step's predicted time; it
    decides nothing. `rates` (planning/rates.py) name whose rates predict the step (default: the
    H100 machine's); `no_prediction`, where no GPU's rates apply, says so instead of any step time."""
    num_gpus, kept, offload, plan, gpu_free = step.workers, step.kept, step.offload, step.memory, step.free_bytes
    config = step.planned_config(config)
    p = predict_step(arch, config, network, optimizer_s, num_gpus, kept, rates)
    net = shared_network(network or NetworkTimes(), num_gpus)
    each = "each GPU's " if num_gpus > 1 else ""
    lines = [
        f"device memory, {each}predicted peak {size(plan.total)}"
        + (f" of {size(gpu_free)} {'may use (executor.gpu_memory_gib)' if step.memory_cap == gpu_free else 'free'}"
           if gpu_free is not None else "") + ":",
        format_gpu_plan(plan),
        chunks_line(arch, config),
        f"boundary activations {'offloaded to host memory (pinned, overlapped): ' + size(parked_bytes(arch, config)) + ' on the GPU node' if offload else 'kept on the device'}",
        recompute_line(arch, config, kept, num_gpus),
    ]
    if step.embedding_on_device:
        lines.append(embedding_step_line(arch, step.workers))
    if step.host_gradients:
        lines.append(host_gradients_line(arch, config, step.host_gradients))
    if num_gpus > 1:
        lines.append(
            f"{num_gpus} GPUs, data parallel: {micro_batches_per_gpu(config, num_gpus)} micro-batches each; every GPU "
            f"reads every layer: {p.host_read_bytes / 1e9:.1f} GB out of host memory per step "
            f"({p.host_memory_s:.2f} s of host memory at {HOST_MEMORY_BYTES_PER_S / 1e9:.0f} GB/s, with the gradients back); "
            f"each layer's fp32 gradient is summed across the GPUs ({p.reduce_s:.2f} s at an assumed "
            f"{GPU_LINK_BYTES_PER_S / 1e9:.0f} GB/s, overlapping backward) and leaves from one GPU"
        )
    if no_prediction is not None:
        return "\n".join(lines + [no_prediction])
    if network is not None and (net.forward_in_s or net.out_s):
        lines.append(
            f"network: weights in {net.forward_in_s:.2f} s before the forward (beside {p.forward_s:.2f} s of "
            f"forward compute and the host optimizer) + {net.backward_in_s:.2f} s before the backward, gradients out "
            f"{net.out_s:.2f} s (beside {p.compute_s - p.forward_s:.2f} s of backward compute), {net.boundary_s:.2f} s for "
            f"the first layer between steps (out, updated, back, in pieces); {p.network_exposed_s:.2f} s not hidden"
        )
    whose = rates.describe() if rates else "the H100 machine's measured rates"
    lines.append(
        f"predicted step on {whose} ({p.tokens} tokens{f', {p.tokens // num_gpus} per GPU' if num_gpus > 1 else ''}): "
        f"compute {p.compute_s:.2f} s, host->GPU {p.h2d_s:.2f} s{' per GPU' if num_gpus > 1 else ''} (overlapped), "
        + (f"gradients summed in host memory {p.host_summed_s:.2f} s (not hidden), " if p.host_summed_s else "")
        + f"host optimizer {p.optimizer_s:.2f} s of which {p.optimizer_exposed_s:.2f} s not hidden -> "
        f"{p.step_s:.2f} s/step, {p.tokens / p.step_s:.0f} tokens/s, bound by {p.bound}"
        + ("; the host optimizer at the exact mode's rate (the lean modes' own: `megatrain-ray bench --parts`)"
           if (config.optim.master, config.optim.moments) != ("fp32", "fp32") else "")
    )
    disk_s = step.placement.disk_seconds() if step.placement is not None else 0.0
    if disk_s:
        lines.append(disk_step_line(p, disk_s))
    lines.append(
        f"tokens per step that keep {'the ' + str(num_gpus) + ' GPUs' if num_gpus > 1 else 'the GPU'} busy (the host "
        f"optimizer hidden behind the forward, the copies and transfers behind compute): {p.busy_tokens}"
    )
    lines.append(optimizer_cores_line(arch, p, step.placement))
    inactive = family(arch).inactive_params(arch)
    if inactive:
        params = num_params(arch)
        lines.append(f"mixture of experts: each layer's slot holds all its experts ({params / 1e9:.2f} B parameters "
                     f"stream and are updated); compute counts the {(params - inactive) / 1e9:.2f} B a token uses")
    if p.bound == "host optimizer":
        lines.append("  to hide the optimizer: more tokens per step (train.grad_accum), or RAM nodes (each adds its cores)")
    if p.bound == "network":
        lines.append("  to hide the network: more tokens per step (train.grad_accum), faster links, or (where the GPU node "
                     "has the memory) a deeper window (runtime.remote_window): layers it holds cross once a step")
    return "\n".join(lines)
