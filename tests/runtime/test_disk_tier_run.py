"""A run with the disk tier (runtime.disk_dir), its stores Ray actors: the plan puts the optimizer
state of the layers RAM cannot hold (runtime.store_memory_gib) on disk, the run's steps are the
in-process trainer's (all in RAM) bit for bit, a resume from its checkpoint continues exactly, and
the tier's files are gone when the run ends.

One end-to-end run, in the 6-byte mode (bf16 master, int8 moments, bf16 compute): every state mode
steps bit for bit on disk as in RAM at the store (tests/host/test_disk_tier.py), and the exact mode
(fp32 master and moments on disk) runs through Ray bit for bit in
tests/runtime/test_multinode.py::test_ram_nodes_with_a_disk_tier_train_like_one_node."""

import dataclasses

import ray
import torch

from megatrain_ray.files import shard
from megatrain_ray.models.registry import PRESETS
from megatrain_ray.runtime.local import LocalTrainer
from megatrain_ray.runtime.session import Session
from helpers.reference_training import random_micro_batches
from helpers.runs import make_config

BLOCKS = 12  # tiny-llama with 12 blocks: enough layers that the tier's window of 3 saves RAM
STORE_BYTES = {"fp32": 5.5e6, "bf16": 2.4e6}  # of the all-RAM run's 7.6 MB (exact), 2.8 MB (6 bytes): about 8 blocks' state go to disk


def configs(tmp_path, mode: tuple[str, str], dtype: str):
    ram = make_config("tiny-llama", model={"overrides": {"num_layers": BLOCKS}, "compute_dtype": dtype},
                      optim={"master": mode[0], "moments": mode[1]}, embedding_step="host")
    tier = ram.replace(runtime=dataclasses.replace(ram.runtime, disk_dir=str(tmp_path / "tier"),
                                                   store_memory_gib=STORE_BYTES[mode[0]] / 2**30),
                       checkpoint=dataclasses.replace(ram.checkpoint, dir=str(tmp_path / "ckpt")))
    return ram, tier


def run_in_ram(config, arch, data):
    local = LocalTrainer(config, arch)
    try:
        losses = [local.train_step(step).loss for step in data]
        local.source.drain()  # every update applied
        return losses, shard.state_tensors(local.stores[0])
    finally:
        local.close()


def test_a_run_with_its_state_on_disk_is_the_ram_run_bit_for_bit_and_resumes_exactly(local_ray, tmp_path):
    ram, tier = configs(tmp_path, ("bf16", "int8"), "bfloat16")
    arch = PRESETS["tiny-llama"].replace(num_layers=BLOCKS)
    data = random_micro_batches(arch, 3, 2, batch=2, seq=12, seed=1)
    expected_losses, (expected, counts) = run_in_ram(ram, arch, data)

    session = Session(tier, arch)
    try:
        on_disk = session.placement.stores[0].disk_layers
        assert 0 < len(on_disk) < BLOCKS + 2, on_disk  # some layers, the embedding among them (stepped on the host)
        session.init_weights()
        session.start_executor()
        losses = [session.train_step(data[0]).loss]
        path = session.save_checkpoint(1, None)
        losses += [session.train_step(step).loss for step in data[1:]]
        session.drain("the last updates")
        state, steps = ray.get(session.stores[0].state_tensors.remote())
        stats = ray.get(session.stores[0].disk_stats.remote())
    finally:
        session.close()
    assert losses == expected_losses
    assert steps == counts
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name
    assert stats["read_bytes"] >= 2 * stats["file_bytes"] > 0  # the updates did read their state from disk
    assert not list((tmp_path / "tier").iterdir())  # the run's files are gone with it

    resumed = Session(tier, arch, updates_done=1)
    try:
        resumed.restore(path)
        resumed.start_executor()
        after = [resumed.train_step(step).loss for step in data[1:]]
        resumed.drain("the last updates")
        state, _ = ray.get(resumed.stores[0].state_tensors.remote())
    finally:
        resumed.close()
    assert after == expected_losses[1:]
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name
