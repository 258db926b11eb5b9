"""A vocabulary-sized layer's gradient summed in host memory (StepPlan.host_gradients,
streaming/host_gradients.py) against the same step summing it on the device: the same compute-dtype
addends added in the same order in fp32, so the gradients the stores receive, and with clipping
off the weights after three AdamW steps, are bit for bit the device path's; with clipping on only
the global norm's summation order differs (fp64 pieces of fp32 dot products against the device's
fp32 sum), which moves the clip factor by rounding only."""

import dataclasses

import pytest
import torch

from megatrain_ray.models.registry import PRESETS, model_layouts
from megatrain_ray.runtime.local import LocalTrainer
from helpers.reference_training import random_micro_batches
from helpers.runs import make_config


def run(config, arch, steps, host: bool = False):
    """Losses, norms and weights after the steps; `host`: with executor.host_gradients on."""
    config = config.replace(executor=dataclasses.replace(config.executor, host_gradients=host))
    trainer = LocalTrainer(config, arch)
    last = len(model_layouts(arch)) - 1  # the embedding's gradient stays where a device steps it (a GPU's default)
    assert trainer.plan.host_gradients == (((last,) if trainer.plan.embedding_on_device else (0, last)) if host else ())
    results = [trainer.train_step(step) for step in steps]
    weights = trainer.layer_weights()
    trainer.close()
    return results, weights


def test_the_embedding_and_head_summed_in_host_memory_give_the_device_paths_update(dtype="bfloat16"):
    arch = PRESETS["tiny-qwen2"]  # untied: the embedding and the LM head each vocabulary-sized
    steps = random_micro_batches(arch, 3, 3, batch=2, seq=12, seed=4)  # 3 micro-batches, 5 loss chunks each
    config = make_config("tiny-qwen2", model={"compute_dtype": dtype}, optim={"grad_clip": 0.0})
    (device, wa), (host, wb) = run(config, arch, steps), run(config, arch, steps, host=True)
    assert host[0].d2h_bytes > device[0].d2h_bytes  # each chunk's and micro-batch's share crossed
    for ra, rb in zip(device, host, strict=True):
        assert ra.loss == rb.loss and rb.grad_norm == pytest.approx(ra.grad_norm, rel=1e-6)
        assert rb.host_add_wait_s > 0 == ra.host_add_wait_s  # the step says how long it waited for the host's adds
    for x, y in zip(wa, wb, strict=True):
        assert torch.equal(x, y)  # unclipped, the same gradients make the same weights, bit for bit


def test_with_clipping_only_the_norm_s_rounding_differs():
    arch = PRESETS["tiny-qwen2"]
    steps = random_micro_batches(arch, 3, 3, batch=2, seq=12, seed=4)
    clipped = make_config("tiny-qwen2", model={"compute_dtype": "bfloat16"})  # grad_clip 0.5: active every step
    (_, wa), (_, wb) = run(clipped, arch, steps), run(clipped, arch, steps, host=True)
    for x, y in zip(wa, wb, strict=True):
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
def test_on_the_gpu_the_vocabulary_accumulator_leaves_the_device():
    """CUDA streams, bf16 compute, a vocabulary large enough to see: the peak drops by at least the
    head's fp32 accumulator, and the weights stay the device path's bit for bit (the GPU's fp32 adds
    and rounding to bf16 are the CPU's)."""
    arch = PRESETS["tiny-qwen2"].replace(vocab_size=131072)
    steps = random_micro_batches(arch, 2, 3, batch=2, seq=64, seed=4)
    config = make_config("tiny-qwen2", model={"compute_dtype": "bfloat16"}, optim={"grad_clip": 0.0},
                         device="cuda", loss_chunk_tokens=32, compile=False,
                         embedding_step="host")  # both vocabulary layers summed on the host: the device holds neither
    (device, wa), (host, wb) = run(config, arch, steps), run(config, arch, steps, host=True)
    head = model_layouts(arch)[-1].numel
    assert device[-1].peak_device_bytes - host[-1].peak_device_bytes >= 4 * head
    for ra, rb in zip(device, host, strict=True):
        assert ra.loss == rb.loss and rb.grad_norm == pytest.approx(ra.grad_norm, rel=1e-6)
    for x, y in zip(wa, wb, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_add_in_widened_pieces_is_torchs_mixed_add_bit_for_bit(dtype, monkeypatch):
    """The staged share added a piece at a time, widened to fp32 first (host_gradients.add_widened),
    against torch's own add of the compute-dtype tensor into the fp32 sum: the same bits, over
    pieces that do not divide the length."""
    from megatrain_ray.streaming import host_gradients

    monkeypatch.setattr(host_gradients, "ADD_PIECE", 1000)
    g = torch.Generator().manual_seed(0)
    total = torch.randn(4321, generator=g)
    part = (torch.randn(4321, generator=g) * 1e-3).to(dtype)
    expected = total.clone().add_(part)
    host_gradients.add_widened(total, part)
    assert torch.equal(total, expected)
