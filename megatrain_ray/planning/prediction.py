"""A step's predicted time from the measured rates of the GPU machine: what bounds the step
(compute, PCIe, host memory bandwidth, the GPU link, the network, the host optimizer), how many
tokens a step keeps N GPUs busy, and how many cores the host optimizer needs to stay hidden.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatrain_ray.config import Config
from megatrain_ray.host.muon import newton_schulz_flops
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.registry import family, model_layouts, num_params
from megatrain_ray.planning.memory import (block_numels, boundary_bytes, dtype_bytes, host_gradient_layers,
                                           loss_chunk_setting, mlp_chunk_tokens, num_blocks, num_slots_setting)

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
    newton_schulz_s: float = 0.0  # Muon's orthogonalization on the GPUs, between the backward and the next forward


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
    All weights cross PCIe twice (the kept blocks once), overlapped with everything; boundary
    activations parked in host memory (executor.offload_activations "on", as the step plan's
    planned_config says) cross it too, each layer's input of each micro-batch out in the forward and
    back in the backward (parked_link_bytes), beside the weights.
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
    link = rates.h2d_bytes_per_s if rates else H2D_BYTES_PER_S
    h2d = (read * d + parked_link_bytes(arch, config, num_gpus)) / link  # weights in twice (some kept blocks once), parked inputs back
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
    newton_schulz = muon_seconds(arch, config, rates) / num_gpus  # each block's on its owner's GPU
    step = max(forward + backward + net.boundary_s + link_exposed,
               copies + max(0.0, optimizer - fwd_compute)) + newton_schulz
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
                          host_read, host_memory, reduce, math.ceil(num_gpus * busy_per_gpu), fwd_compute, summed,
                          newton_schulz)


def parked_link_bytes(arch: ModelArch, config: Config, num_gpus: int = 1) -> int:
    """Bytes one GPU's parked boundary activations move each way over its host link a step: every
    layer's input (the head's too) for each of its micro-batches (0: they stay on the device)."""
    if config.executor.offload_activations != "on":
        return 0
    return boundary_bytes(arch, config, len(model_layouts(arch)) - 1, num_gpus)


def muon_seconds(arch: ModelArch, config: Config, rates=None) -> float:
    """One GPU's time for every Muon block's Newton-Schulz iterations of a step (streaming/muon_step.py),
    at the blocks' matmul rate: bf16 products of the blocks' own sizes (0: optim.name adamw)."""
    if config.optim.name != "muon":
        return 0.0
    flops = sum(newton_schulz_flops(layout, "muon", config.optim.muon_ns_steps) for layout in model_layouts(arch))
    return flops / (rates.layer_flops_per_s if rates else LAYER_TFLOPS)


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
