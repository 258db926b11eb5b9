"""Baselines for `megatrain-ray bench --baseline`: the same model shape, batch and data, trained
the usual ways, so that the streaming trainer's tokens/s has something to be compared with.

- `plain`: everything on the GPU (fp32 master weights, bf16 autocast, fused AdamW on the GPU),
  the fastest thing there is while the model's state fits.
- `fsdp2_offload`: PyTorch FSDP2 on one GPU with CPUOffloadPolicy (params, grads and AdamW on
  the host, bf16 compute).
- `deepspeed_offload`: DeepSpeed ZeRO-3 with parameters and optimizer offloaded to the host
  (DeepSpeedCPUAdam).

All three run the same module (`BaselineModel`: the family's templates (models/family.py), one
child module per decoder block that owns its parameters directly, as both FSDP2 and ZeRO-3
gather a module's own parameters in hooks around its forward), the same optimizer settings
as the streaming trainer (AdamW, betas (0.9, 0.95), weight decay 0.1 on matrices, global
gradient-norm clip 1.0), per-block activation checkpointing, and the same chunked loss.
`baseline_process.run_baselines` runs each in a fresh process, so that one's GPU memory,
process group or crash never reaches the next.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import socket
import statistics
import time
import sys
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from megatrain_ray.bench.baseline_model import BaselineModel, init_weights
from megatrain_ray.bench.workload import synthetic_micro_batches
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.family import IGNORE_INDEX

BASELINES = ("plain", "fsdp2_offload", "deepspeed_offload")
BETAS = (0.9, 0.95)  # the streaming trainer's defaults (config.OptimConfig)
EPS = 1e-8
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
INIT_STD = 0.02
LOSS_CHUNK_TOKENS = 8192  # as `bench --loss-chunk-tokens`


@dataclass(frozen=True)
class BaselineResult:
    name: str
    status: str  # "ok" | "oom" | "error" | "unavailable: <why>"
    tokens_per_s: float = 0.0  # median over the timed steps
    step_seconds: list[float] = field(default_factory=list)  # timed steps only
    peak_gpu_bytes: int = 0  # max allocated during the training steps (0 on CPU)
    losses: list[float] = field(default_factory=list)  # every step, warm-up included
    error: str = ""
    config: dict = field(default_factory=dict)  # what it ran with: the step split and its tuning


# ---------------------------------------------------------------------------------------------
# The timed loop, shared by all baselines

StepFn = Callable[[list[dict[str, torch.Tensor]], int], float]  # (micro-batches, target tokens) -> mean loss


def count_targets(micro_batches: list[dict[str, torch.Tensor]]) -> int:
    return int(sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro_batches))


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def resolve_device(device: str | torch.device) -> torch.device:
    """With an index on CUDA: torch.cuda.set_device refuses a bare "cuda"."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _timed_steps(name: str, step: StepFn, arch: ModelArch, seq_len: int, micro_batch: int, grad_accum: int,
                 steps: int, warmup: int, device: torch.device) -> BaselineResult:
    """warmup + steps optimizer steps on the same data as the streaming bench (seed = step); the
    clock runs from a synchronize before a step (its host-to-device batch copy included) to one
    after it."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds, losses, rates = [], [], []
    for i in range(warmup + steps):
        micro_batches = synthetic_micro_batches(arch, seq_len, micro_batch, grad_accum, seed=i)
        targets = count_targets(micro_batches)
        _sync(device)
        t0 = time.perf_counter()
        losses.append(step(micro_batches, targets))
        _sync(device)
        dt = time.perf_counter() - t0
        if i >= warmup:
            seconds.append(dt)
            rates.append(seq_len * micro_batch * grad_accum / dt)
        print(f"{name}: step {i}{' (warm-up)' if i < warmup else ''} {dt:.3f} s, loss {losses[-1]:.4f}",
              file=sys.stderr, flush=True)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return BaselineResult(name, "ok", statistics.median(rates), seconds, int(peak), losses,
                          config={"micro_batch": micro_batch, "grad_accum": grad_accum})


def _guarded(name: str, device: torch.device, run: Callable[[], BaselineResult]) -> BaselineResult:
    """A CUDA OOM becomes status "oom", anything else "error"; the exception (and the frames
    holding the model) is dropped before the memory is given back."""
    result = None
    try:
        result = run()
    except Exception as e:  # noqa: BLE001 - a baseline failing is a result, not a crash of the bench
        if _is_oom(e):
            result = BaselineResult(name, "oom", error=(str(e).splitlines() or ["CUDA out of memory"])[0])
        else:
            result = BaselineResult(name, "error", error=traceback.format_exc(limit=8))
    _free_device_memory(device)
    return result


def _is_oom(e: BaseException) -> bool:
    """torch.cuda.OutOfMemoryError, or the RuntimeError that some extension paths raise instead."""
    return isinstance(e, torch.cuda.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and "out of memory" in str(e).lower() and "cuda" in str(e).lower())


def _accumulate_clip_step(model, optimizer, dev: torch.device, autocast: bool):
    """One optimizer step of an ordinary PyTorch loop: accumulate, clip, AdamW."""

    def step(micro_batches, targets: int) -> float:
        total = torch.zeros((), device=dev)
        for mb in micro_batches:
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
                loss = model(to_device(mb, dev))
            (loss / targets).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return _loss_scalar(total, targets)

    return step


def _loss_scalar(total: torch.Tensor | float, targets: int) -> float:
    return float(total) / max(targets, 1)


# ---------------------------------------------------------------------------------------------
# (a) plain: everything on the GPU


def run_plain(arch: ModelArch, seq_len: int, micro_batch: int, grad_accum: int, steps: int, warmup: int,
              device: str = "cuda", lr: float = 1e-4, checkpoint_blocks: bool = True) -> BaselineResult:
    """fp32 master weights, gradients and AdamW state on the device, bf16 autocast compute, fused
    AdamW on CUDA. Fits up to about 4-5B params on 80 GB (16 bytes/param before activations)."""
    dev = resolve_device(device)

    def run() -> BaselineResult:
        with dev:  # allocate the parameters where they will live
            model = BaselineModel(arch, checkpoint_blocks=checkpoint_blocks)
        init_weights(model, seed=0, init_device=dev)
        optimizer = torch.optim.AdamW(model.param_groups(WEIGHT_DECAY), lr=lr, betas=BETAS, eps=EPS,
                                      fused=dev.type == "cuda")

        step = _accumulate_clip_step(model, optimizer, dev, autocast=True)
        return _timed_steps("plain", step, arch, seq_len, micro_batch, grad_accum, steps, warmup, dev)

    return _guarded("plain", dev, run)


# ---------------------------------------------------------------------------------------------
# (b) FSDP2 with CPU offload, one GPU


def _fsdp2_api():
    """fully_shard and its policies: torch.distributed.fsdp from 2.6, _composable.fsdp in 2.5."""
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def single_process_group(device: torch.device):
    """A world of one. On CUDA the backend is "cpu:gloo,cuda:nccl": with CPU offload the
    gradients are DTensors on the host, and clip_grad_norm_ all-reduces their norm there, which
    NCCL cannot do (pytorch#148532, torchtune#2108)."""
    import torch.distributed as dist

    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def explicit_prefetch(blocks: list, depth: int) -> str:
    """FSDP2's documented explicit prefetching (torchtitan does the same): each block's forward
    starts gathering the next `depth` blocks, each backward the previous `depth`; FSDP2 alone
    prefetches one. Returns what was set, for the result (torch < 2.6 has no such API)."""
    if depth <= 1 or not hasattr(blocks[0], "set_modules_to_forward_prefetch"):
        return "implicit (one block ahead)"
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 1 + depth])
        block.set_modules_to_backward_prefetch(list(reversed(blocks[max(0, i - depth) : i])))
    return f"explicit, {depth} blocks ahead"


def run_fsdp2_offload(arch: ModelArch, seq_len: int, micro_batch: int, grad_accum: int, steps: int, warmup: int,
                      device: str = "cuda", lr: float = 1e-4, checkpoint_blocks: bool = True,
                      offload: bool = True, prefetch_depth: int = 2) -> BaselineResult:
    """fully_shard each decoder block, then the root (embedding, final norm, head); bf16 params
    for compute, fp32 gradient reduction, params/grads/AdamW state on the host when `offload`.
    AdamW is torch's default (for-loop/foreach) on CPU DTensors, as the FSDP2 docs use it with
    CPU offload. `device="cpu", offload=False` runs the same wiring over gloo, for tests."""
    dev = resolve_device(device)
    fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy = _fsdp2_api()
    from torch.distributed.device_mesh import init_device_mesh

    def run() -> BaselineResult:
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        with single_process_group(dev):
            model = BaselineModel(arch, checkpoint_blocks=checkpoint_blocks)
            init_weights(model, seed=0)
            # An explicit mesh: the default one is CUDA whenever a GPU exists, even for a CPU run.
            mesh = init_device_mesh(dev.type, (1,))
            kwargs = {"mesh": mesh,
                      "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
            if offload:
                kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
            for block in model.blocks:
                fully_shard(block, **kwargs)
            fully_shard(model, **kwargs)
            prefetch = explicit_prefetch(list(model.blocks), prefetch_depth)
            optimizer = torch.optim.AdamW(model.param_groups(WEIGHT_DECAY), lr=lr, betas=BETAS, eps=EPS)

            step = _accumulate_clip_step(model, optimizer, dev, autocast=False)  # FSDP2 casts itself
            try:
                result = _timed_steps("fsdp2_offload", step, arch, seq_len, micro_batch, grad_accum, steps, warmup, dev)
                return dataclasses.replace(result, config={**result.config, "prefetch": prefetch})
            finally:
                del step, optimizer, model

    return _guarded("fsdp2_offload", dev, run)


# ---------------------------------------------------------------------------------------------
# (c) DeepSpeed ZeRO-3 with parameter and optimizer offload, one GPU


class _LossModule(nn.Module):
    """The engine's forward must return the loss it will backward: the micro-batch mean."""

    def __init__(self, model: BaselineModel):
        super().__init__()
        self.model = model

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(batch) / (batch["labels"] != IGNORE_INDEX).sum().clamp(min=1)


# DeepSpeed's documented ZeRO-3 knobs for throughput (docs: "ZeRO-3 Offload", config-json
# stage3_*): larger prefetch and reduce buckets and keeping small parameters resident. On the H100
# machine they ran faster than the defaults (qwen2.5-3b, 4 x 4 x 4096; examples/benchmarks/), so
# the comparison is with DeepSpeed at its best.
DEEPSPEED_TUNED = {"stage3_prefetch_bucket_size": int(5e8), "reduce_bucket_size": int(5e8),
                   "stage3_param_persistence_threshold": int(1e6)}


def deepspeed_config(micro_batch: int, grad_accum: int, lr: float, tuned: bool = True) -> dict:
    """ZeRO-3, params and optimizer on pinned host memory, bf16; an AdamW optimizer entry with
    offload_optimizer makes DeepSpeed build DeepSpeedCPUAdam (adamw_mode)."""
    offload = {"device": "cpu", "pin_memory": True}
    zero = {"stage": 3, "offload_param": offload, "offload_optimizer": offload, "overlap_comm": True,
            "contiguous_gradients": True, **(DEEPSPEED_TUNED if tuned else {})}
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": GRAD_CLIP,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW",
                      "params": {"lr": lr, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY}},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def run_deepspeed_offload(arch: ModelArch, seq_len: int, micro_batch: int, grad_accum: int, steps: int,
                          warmup: int, device: str = "cuda", lr: float = 1e-4,
                          checkpoint_blocks: bool = True, tuned: bool = True) -> BaselineResult:
    """deepspeed.initialize in this process as rank 0 of 1 (env:// rendezvous on a free port);
    the engine steps the optimizer at each gradient-accumulation boundary. The first step
    JIT-compiles CPU Adam (ninja + nvcc), which is why warm-up matters here."""
    dev = resolve_device(device)
    try:
        import deepspeed
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken install failing on import
        return BaselineResult("deepspeed_offload", f"unavailable: deepspeed not installed ({type(e).__name__}: {e})")
    if dev.type != "cuda" or not torch.cuda.is_available():
        return BaselineResult("deepspeed_offload", "unavailable: needs a CUDA GPU")

    def run() -> BaselineResult:
        torch.cuda.set_device(dev)
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
        model = BaselineModel(arch, checkpoint_blocks=checkpoint_blocks)
        init_weights(model, seed=0)
        groups = model.param_groups(WEIGHT_DECAY)
        engine, *_ = deepspeed.initialize(model=_LossModule(model), model_parameters=groups,
                                          config=deepspeed_config(micro_batch, grad_accum, lr, tuned))
        del model, groups

        def step(micro_batches, targets: int) -> float:
            total = 0.0
            for mb in micro_batches:
                loss = engine(to_device(mb, dev))
                engine.backward(loss)
                engine.step()  # applies the update only at the accumulation boundary
                total += float(loss) * int((mb["labels"] != IGNORE_INDEX).sum())
            return _loss_scalar(total, targets)

        # No engine or process-group teardown: the baseline's own process ends right after its
        # result (baseline_process), and on the H100 machine a DeepSpeed run sat for minutes after
        # its last step where it used to tear down.
        result = _timed_steps("deepspeed_offload", step, arch, seq_len, micro_batch, grad_accum, steps, warmup, dev)
        return dataclasses.replace(result, config={**result.config, "zero3": DEEPSPEED_TUNED if tuned else "defaults"})

    return _guarded("deepspeed_offload", dev, run)


RUNNERS: dict[str, Callable[..., BaselineResult]] = {
    "plain": run_plain,
    "fsdp2_offload": run_fsdp2_offload,
    "deepspeed_offload": run_deepspeed_offload,
}
