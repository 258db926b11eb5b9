"""GPU checks of the streaming trainer (run on the GPU machine: pytest -m gpu)."""

import pytest
import torch

from megatrain_ray.config import config_from_dict
from megatrain_ray.host.sources import HostLayerState
from megatrain_ray.streaming.device_step import DeviceStepSource
from megatrain_ray.streaming.executor import Prefetcher
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.runtime.local import LocalTrainer
from helpers.reference_training import random_micro_batches, train_reference

pytestmark = pytest.mark.gpu

SMALL = ModelArch("qwen2", 2048, 512, 1536, 4, 8, 2, 64, qkv_bias=True, rope_theta=1e6)


def gpu_config(dtype: str, steps: int, grad_accum: int = 2, keep_graphs: int | None = None, **optim):
    return config_from_dict({
        "model": {"preset": "tiny-llama", "compute_dtype": dtype},
        "optim": {"lr": 1e-3, "warmup_steps": 2, "grad_clip": 1.0, **optim},
        "train": {"steps": steps, "grad_accum": grad_accum},
        "executor": {"device": "cuda", "loss_chunk_tokens": 1024, "keep_graphs": keep_graphs},
    })


def test_bf16_loss_tracks_the_autocast_reference():
    config = gpu_config("bfloat16", steps=20)
    data = random_micro_batches(SMALL, 20, 2, batch=2, seq=256, seed=0, distinct=4)
    trainer = LocalTrainer(config, SMALL)
    init = [w.clone() for w in trainer.layer_weights()]
    ours = [trainer.train_step(step).loss for step in data]
    trainer.close()
    ref, _, _ = train_reference(config, SMALL, init, data, device="cuda", autocast_dtype=torch.bfloat16)
    print("ours", ours, "\nreference", ref)
    assert ours[-1] < ours[0] - 1.0, "the loss must go down"
    for a, b in zip(ours, ref, strict=True):
        assert a == pytest.approx(b, rel=0.02)


def peak_bytes(num_layers: int) -> int:
    arch = SMALL.replace(num_layers=num_layers, hidden_size=1024, intermediate_size=4096, num_heads=16, vocab_size=8192)
    trainer = LocalTrainer(gpu_config("bfloat16", steps=2, grad_accum=1, keep_graphs=0), arch)
    data = random_micro_batches(arch, 2, 1, batch=1, seq=512, seed=0)
    peaks = [trainer.train_step(step).peak_device_bytes for step in data]
    trainer.close()
    del trainer
    torch.cuda.empty_cache()
    return max(peaks)


def test_device_memory_is_a_window_not_the_model():
    """With every block recomputing (executor.keep_graphs 0); by default the GPU's spare memory
    holds the last blocks' forward graphs, by design."""
    p8, p32 = peak_bytes(8), peak_bytes(32)
    print(f"peak GPU memory: 8 layers {p8 / 2**20:.1f} MiB, 32 layers {p32 / 2**20:.1f} MiB")
    assert p32 <= 1.15 * p8


class SlowComputePrefetcher(Prefetcher):
    """Every compute starts with a long GPU sleep: a refill that did not wait would corrupt it."""

    def acquire(self, pos):
        slot = super().acquire(pos)
        torch.cuda._sleep(2_000_000)
        return slot


def test_a_slow_compute_never_reads_a_refilled_slot():
    def train(slow: bool):
        config = gpu_config("float32", steps=2)
        trainer = LocalTrainer(config, SMALL)
        if slow:
            trainer.executor.prefetcher.__class__ = SlowComputePrefetcher
        for step in random_micro_batches(SMALL, 2, 2, batch=1, seq=128, seed=0):
            trainer.train_step(step)
        weights = [w.clone() for w in trainer.layer_weights()]
        trainer.close()
        return weights

    for fast, slow in zip(train(False), train(True), strict=True):
        assert torch.allclose(fast, slow, rtol=1e-5, atol=1e-6)


def test_offloaded_activations_train_like_kept_ones():
    def train(offload: str):
        config = gpu_config("float32", steps=2).replace(
            executor=gpu_config("float32", steps=2).executor.__class__(device="cuda", offload_activations=offload))
        trainer = LocalTrainer(config, SMALL)
        losses = [trainer.train_step(s).loss for s in random_micro_batches(SMALL, 2, 3, batch=1, seq=128, seed=0)]
        weights = [w.clone() for w in trainer.layer_weights()]
        trainer.close()
        return losses, weights

    (kept_losses, kept), (off_losses, off) = train("off"), train("on")
    assert kept_losses == pytest.approx(off_losses, rel=1e-5)
    for a, b in zip(kept, off, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype,steps", [("float32", 3), ("bfloat16", 1)])
def test_the_embedding_stepped_on_the_gpu_trains_like_on_the_host(dtype, steps):
    """streaming/device_step.py on CUDA: the state crosses in, steps on the GPU and comes back; the weights
    match the host's one-pass AdamW (bf16: its rounding of the gradient, as the host reads it). Both are
    fp32 AdamW on the same gradient, so they differ by fp32 rounding (1e-5 relative). bf16 compares one
    step: past it, the two masters' last-ulp differences flip the next forward's bf16 roundings, and the
    runs part by bf16 noise through Adam's normalisation (measured 1.3e-3 after 3 steps on the H100)."""
    rtol = 1e-5

    def train(where: str):
        base = gpu_config(dtype, steps=steps, eps=1e-6)  # see helpers/runs.py's make_config
        config = base.replace(executor=base.executor.__class__(device="cuda", embedding_step=where))
        trainer = LocalTrainer(config, SMALL)
        data = random_micro_batches(SMALL, steps, 2, batch=2, seq=128, seed=2)
        losses = [trainer.train_step(s).loss for s in data]
        weights = [w.clone() for w in trainer.layer_weights()]
        updates = trainer.stores[0].update_counts()[0]
        trainer.close()
        return losses, weights, updates

    (host_losses, host, _), (device_losses, device, updates) = train("host"), train("device")
    print([float((a - b).norm() / b.norm()) for a, b in zip(device, host, strict=True)])
    assert updates == steps
    assert device_losses == pytest.approx(host_losses, rel=rtol)
    for i, (a, b) in enumerate(zip(device, host, strict=True)):
        assert float((a - b).norm() / b.norm()) < rtol, f"layer {i}"



def test_the_state_upload_never_writes_memory_that_queued_compute_still_reads():
    """The embedding's fp32 state is uploaded on the copy stream while the compute stream may still
    have queued work reading memory Python has already freed. Allocated from the compute stream's
    pool, the upload would be handed exactly those blocks (the caching allocator reuses a stream's
    freed blocks at once: safe for that stream's own later work, not for another stream's copy),
    and the copy would land before the queued reads. Here the compute stream sleeps ~0.1 s, then
    reads three freed tensors of the state's size; the upload is issued in between."""
    device = torch.device("cuda")
    n = 1 << 20  # 4 MiB fp32 tensors: the allocator's large pool, as an embedding's state is
    state = HostLayerState(*(torch.full((n,), float(v)).pin_memory() for v in (1, 2, 3)),
                           compute=torch.empty(n).pin_memory(), segments=[(0, n, True)], updates=0,
                           held=torch.zeros(1, dtype=torch.int64))
    source = DeviceStepSource(None, {0: state}, device, torch.float32, report_updates=lambda layer, count: None)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # no other free blocks of the compute stream's to hand out instead
    with torch.cuda.stream(source.streams.compute):
        freed = [torch.full((n,), 7.0, device=device) for _ in range(3)]
        torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU cycles before the reads below run
        reads = [t.clone() for t in freed]  # queued behind the sleep
        del freed  # back to the compute stream's pool while the clones have yet to read them
        source._upload(0)
    torch.cuda.synchronize()
    assert all(torch.equal(r, torch.full_like(r, 7.0)) for r in reads), \
        "the upload wrote into memory queued compute work was still reading"
    flight = source.in_flight[0]
    assert [float(t[0]) for t in (flight.master, flight.exp_avg, flight.exp_avg_sq)] == [1.0, 2.0, 3.0]  # it crossed
