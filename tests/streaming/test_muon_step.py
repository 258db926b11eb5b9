"""Muon's momentum update and Newton-Schulz iteration on the worker's device (streaming/muon_step.py),
run here with the device the CPU: the blocks' momenta, the weights and the losses after 4 steps equal
the stores' own Muon step bit for bit in each state mode, with the clip factor below 1 (the step's
arithmetic is the host's own function on copies; what is checked is the trip: the gradient and
momentum read, the momentum and update written back, the store told to apply only)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatrain_ray.config import config_from_dict
from megatrain_ray.host.precision import StateFormat
from megatrain_ray.host.remote_sources import SharedMemorySource
from megatrain_ray.host.store import IN_FLUX, ShardStore
from megatrain_ray.models.registry import PRESETS
from megatrain_ray.planning.step_plan import muon_on_device
from megatrain_ray.runtime.local import LocalTrainer
from megatrain_ray.runtime.worker import assemble_worker
from megatrain_ray.streaming.muon_step import MuonStepSource
from helpers.reference_training import random_micro_batches

STEPS = 4


def config(master: str, moments: str):
    dtype = "float32" if master == moments == "fp32" else "bfloat16"
    return config_from_dict({
        "model": {"preset": "tiny-llama", "compute_dtype": dtype, "init_std": 0.2},
        "optim": {"lr": 3e-3, "warmup_steps": 2, "master": master, "moments": moments, "name": "muon",
                  "muon_lr": 0.02, "grad_clip": 0.05},
        "train": {"steps": STEPS, "grad_accum": 2, "micro_batch_size": 1, "seed": 5},
        "executor": {"device": "cpu", "compile": False, "loss_chunk_tokens": 16},
    })


def on_device(trainer: LocalTrainer) -> MuonStepSource:
    """The trainer's worker rebuilt with every Muon block's step on its (CPU) device, as the plan has it on a GPU."""
    arch = trainer.arch
    blocks = muon_on_device(arch, trainer.config, "cuda", None)
    plan = dataclasses.replace(trainer.plan, muon_on_device=blocks)
    trainer.worker = assemble_worker(arch, trainer.config, plan, trainer.worker.layers, trainer.executor.device)
    trainer.source, trainer.executor = trainer.worker.source, trainer.worker.executor
    assert isinstance(trainer.source, MuonStepSource) and sorted(trainer.source.momenta) == list(blocks)
    return trainer.source


@pytest.mark.parametrize("master,moments", [("fp32", "fp32"), ("fp32", "bf16"), ("bf16", "bf16")])
def test_the_device_path_equals_the_stores_step(master, moments):
    arch = PRESETS["tiny-llama"]
    data = random_micro_batches(arch, STEPS, 2, batch=1, seq=8, seed=3)
    host, device = LocalTrainer(config(master, moments), arch), LocalTrainer(config(master, moments), arch)
    source = on_device(device)
    for step in data:
        a, b = host.train_step(step), device.train_step(step)
        assert a.grad_norm > 0.05, "the clip factor is below 1"
        assert (a.loss, a.grad_norm) == (b.loss, b.grad_norm)
    assert source.orthogonalized == STEPS * len(source.momenta)
    host.source.drain()
    device.source.drain()
    for ours, theirs in zip(host.stores, device.stores, strict=True):
        for i, state in ours.layers.items():
            other = theirs.layers[i]
            for key in ("master", "exp_avg", "exp_avg_sq", "compute"):
                assert torch.equal(getattr(state, key), getattr(other, key)), (i, key)
            if i in source.momenta:
                assert state.exp_avg.abs().sum() > 0
                assert int(other.held) == other.updates == STEPS != IN_FLUX  # the marker back at the step
    host.close()
    device.close()


def test_the_plan_puts_newton_schulz_on_a_gpu_only():
    arch = PRESETS["tiny-llama"]
    cfg = config("fp32", "fp32")
    assert muon_on_device(arch, cfg, "cpu", None) == ()
    assert muon_on_device(arch, cfg, "cuda", None) == tuple(range(1, arch.num_layers + 1))
    adamw = cfg.replace(optim=dataclasses.replace(cfg.optim, name="adamw"))
    assert muon_on_device(arch, adamw, "cuda", None) == ()


def test_a_worker_maps_the_momentum_the_store_shares(tmp_path):
    """On a GPU node the store holds a Muon block's momentum in shared memory from the start, zeros,
    and the worker's source maps the same bytes (and the layer's marker)."""
    arch = PRESETS["tiny-llama"]
    store = ShardStore(arch, [0, 1, 2], torch.bfloat16, shm_dir=str(tmp_path), run_id="t",
                       state_format=StateFormat("fp32", "bf16", "muon"), shared_momentum=(1,))
    try:
        assert set(store.shared_momenta()) == {1}
        momentum, held = store.layers[1].exp_avg, store.layers[1].held
        assert momentum.dtype == torch.bfloat16 and not momentum.any()
        store.fault_in_moments()
        source = SharedMemorySource(None, store.shm_paths, {i: s.layout.numel for i, s in store.layers.items()},
                                    torch.bfloat16, register=False, momenta=store.shared_momenta(),
                                    momentum_dtype=torch.bfloat16)
        mapped, marker = source.momentum(1)
        mapped.fill_(0.5)
        marker.fill_(IN_FLUX)
        assert mapped.numel() == momentum.numel() and bool((momentum == 0.5).all()) and int(held) == IN_FLUX
    finally:
        store.close()


@pytest.mark.gpu
def test_on_a_gpu_newton_schulz_runs_there_and_trains_as_on_the_host():
    """On a GPU the plan puts every block's Muon step on the device; after 3 steps its weights are
    within 1e-5 of the same GPU run with the stores' own step (the bf16 products of the two devices
    round apart now and then: the small muon_lr keeps that below the tolerance, as in
    tests/models/test_muon_parity.py)."""
    arch = PRESETS["tiny-llama"]
    cfg = config("fp32", "fp32")
    cfg = cfg.replace(optim=dataclasses.replace(cfg.optim, muon_lr=5e-5),
                      executor=dataclasses.replace(cfg.executor, device="cuda"))
    data = random_micro_batches(arch, 3, 2, batch=1, seq=8, seed=3)
    gpu, host = LocalTrainer(cfg, arch), LocalTrainer(cfg, arch)
    assert isinstance(gpu.source, MuonStepSource) and len(gpu.plan.muon_on_device) == arch.num_layers
    host.worker = assemble_worker(arch, cfg, dataclasses.replace(host.plan, muon_on_device=()), host.worker.layers,
                                  host.executor.device)
    host.source, host.executor = host.worker.source, host.worker.executor
    for step in data:
        gpu.train_step(step)
        host.train_step(step)
    assert gpu.source.orthogonalized == 3 * arch.num_layers
    for ours, theirs in zip(gpu.layer_weights(), host.layer_weights(), strict=True):
        assert float((ours - theirs).norm() / theirs.norm()) <= 1e-5
    gpu.close()
    host.close()
