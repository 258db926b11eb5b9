"""The step plan as text (`megatrain-ray plan`, a run's start): its memory by use, its decisions
and the step's predicted time. It decides nothing.
"""

from __future__ import annotations

import math

from megatrain_ray.config import Config
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.registry import family, model_layouts, num_params
from megatrain_ray.planning.memory import (format_gpu_plan, host_gradient_bytes, kept_graph_bytes,
                                           micro_batches_per_gpu, mlp_chunk_tokens, num_blocks, num_slots_setting,
                                           parked_bytes, size)
from megatrain_ray.planning.prediction import (GPU_LINK_BYTES_PER_S, HOST_ADAMW_PARAMS_PER_S, HOST_ADAMW_THREADS,
                                               HOST_MEMORY_BYTES_PER_S, NetworkTimes, StepPrediction, TRANSPORT_CORES,
                                               optimizer_cores, predict_step, ram_node_cores, shared_network)

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


def recompute_line(arch: ModelArch, config: Config, kept: int, num_gpus: int, measured: float = 0.0) -> str:
    if kept == 0:
        return ("every layer recomputes its forward in backward; weights are fetched twice per step (the last "
                f"{num_slots_setting(config) - 1} blocks stay resident across the turn)")
    graphs = kept * kept_graph_bytes(arch, config, num_gpus, measured)
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
        recompute_line(arch, config, kept, num_gpus, step.measured_working_set),
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
        + (f"Muon's Newton-Schulz on the GPU {p.newton_schulz_s:.2f} s (not hidden), " if p.newton_schulz_s else "")
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
