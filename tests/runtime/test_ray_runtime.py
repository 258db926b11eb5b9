"""The real Ray path: stores and the executor in separate actor processes."""

import pytest
import ray
import torch

from megatrain_ray.files import shard
from megatrain_ray.models.registry import PRESETS
from megatrain_ray.bench.telemetry import Probe
from megatrain_ray.runtime.local import LocalTrainer
from helpers.reference_training import random_micro_batches
from helpers.runs import make_config
from helpers.sessions import layer_weights, probed_session
from megatrain_ray.bench.telemetry import ProbedStore, ProbedWorker
from megatrain_ray.runtime.actors import GpuWorker, ShardStoreActor
from megatrain_ray.runtime.session import Session


@pytest.mark.parametrize("preset,embedding_step", [("tiny-llama", "host"), ("tiny-qwen3", "host"),
                                                    ("tiny-qwen3", "device")])
def test_ray_session_equals_in_process_trainer(local_ray, preset, embedding_step):
    """With embedding_step device, the GPU worker (here on the CPU) maps the store's state of the
    embedding, steps it and writes it back; the checkpointed state and update counts are the
    in-process trainer's."""
    config = make_config(preset, embedding_step=embedding_step)
    arch = PRESETS[preset]
    data = random_micro_batches(arch, 3, 2, batch=2, seq=12, seed=1)

    local = LocalTrainer(config, arch)
    local_results = [local.train_step(step) for step in data]
    expected = local.layer_weights()
    expected_state = shard.state_tensors(local.stores[0])
    local.close()

    session = probed_session(config, arch)
    try:
        session.init_weights()
        described = session.start_executor()
        assert ("the embedding's AdamW step runs here" in described) == (embedding_step == "device")
        assert Probe(session).transports() == ["shm"]
        results = [session.train_step(step) for step in data]
        weights = layer_weights(session)
        state = ray.get(session.stores[0].state_tensors.remote())
    finally:
        session.close()

    assert [r.loss for r in results] == [r.loss for r in local_results]
    for a, b in zip(weights, expected, strict=True):
        assert torch.equal(a, b)
    assert state[1] == expected_state[1] == dict.fromkeys(state[1], 3)  # each layer's update count
    for name, tensor in expected_state[0].items():
        assert torch.equal(state[0][name], tensor), name


def test_the_workers_build_and_the_first_step_begins_while_the_stores_fill_their_first_weights(local_ray):
    """The GPU worker (here on the CPU, its embedding stepped on its device) builds from what the
    stores said at allocation, asking them nothing, and the store on its node fills a layer per call:
    the run starts while the last layer (the head) still takes seconds to draw, and the first step
    reads each layer once its own call is done (the in-process trainer's loss)."""
    import time

    config = make_config("tiny-qwen3", embedding_step="device")
    arch = PRESETS["tiny-qwen3"]
    head = arch.num_layers + 1
    data = random_micro_batches(arch, 1, 2, batch=2, seq=12, seed=1)
    local = LocalTrainer(config, arch)
    expected = local.train_step(data[0]).loss
    local.close()

    class SlowHeadStore(ProbedStore):  # a head that takes seconds, as 7B's layers do (defined here: sent by value)
        def init_random(self, seed: int, std: float, layers=None) -> None:
            if layers is None or head in layers:
                time.sleep(2.0)
            super().init_random(seed, std, layers)

    session = Session(config, arch, worker_class=ProbedWorker, store_class=SlowHeadStore)
    try:
        t0 = time.perf_counter()
        session.init_weights(wait=False)
        session.start_executor()
        assert time.perf_counter() - t0 < 1.5, "the start waited for the last layer's weights"
        assert session.train_step(data[0]).loss == expected
    finally:
        session.close()


def test_a_resume_loads_the_checkpoint_while_the_workers_build_and_continues_exactly(local_ray, tmp_path):
    """restore(wait=False), as a run's resume does: the stores load the checkpoint while the GPU
    workers build (each takes half a second more here, and the two overlap), start_executor returns once
    the load is done, and the next step is the uninterrupted run's."""
    import dataclasses
    import time

    config = make_config("tiny-qwen3", embedding_step="device")
    config = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, dir=str(tmp_path)))
    arch = PRESETS["tiny-qwen3"]
    data = random_micro_batches(arch, 2, 2, batch=2, seq=12, seed=1)
    session = Session(config, arch)
    try:
        session.init_weights()
        session.start_executor()
        session.train_step(data[0])
        path = session.save_checkpoint(1, None)
        expected = session.train_step(data[1]).loss
    finally:
        session.close()

    class SlowLoadStore(ShardStoreActor):  # defined here: sent by value
        def load_layers(self, files_by_layer):
            begun = time.time()
            time.sleep(0.5)
            super().load_layers(files_by_layer)
            self.loading = (begun, time.time())

        def load_interval(self):
            return self.loading

    class SlowStartWorker(GpuWorker):
        def start(self, *args, **kwargs):
            begun = time.time()
            time.sleep(0.5)
            described = super().start(*args, **kwargs)
            self.building = (begun, time.time())
            return described

        def build_interval(self):
            return self.building

    session = Session(config, arch, worker_class=SlowStartWorker, store_class=SlowLoadStore)
    try:
        session.restore(path, wait=False)
        session.start_executor()
        (load_begun, loaded), = ray.get([store.load_interval.remote() for store in session.stores])
        (build_begun, built), = ray.get([worker.build_interval.remote() for worker in session.gpus])
        assert load_begun < built and build_begun < loaded, "the load and the workers' build did not overlap"
        assert session.train_step(data[1]).loss == expected
    finally:
        session.close()


GATE = """#!/bin/sh
# A compiler held shut: it says it started, then fails once told to (or after two minutes).
touch "{dir}/started"
for i in $(seq 1200); do
  [ -e "{dir}/fail" ] && exit 1
  sleep 0.1
done
exit 1
"""


def test_a_store_takes_its_memory_while_its_host_adamw_kernel_builds(local_ray, tmp_path):
    """A store on a machine whose kernel cache is empty begins the build with its process and takes
    its memory without waiting for it; its first update waits for the build. The build's compiler is
    a gate held shut, then let fail, so that the test takes seconds and not the build's 40 (the kernel's
    own arithmetic is tests/host/test_host_adamw.py's): the update then runs torch's three passes,
    and equals torch.optim.AdamW."""
    import time
    from pathlib import Path

    from megatrain_ray.host.adamw import AdamWStep
    from megatrain_ray.host.memory import shm_tensor
    from megatrain_ray.models.registry import model_layouts

    gate, cache, shm = tmp_path / "g++-gate", tmp_path / "kernels", tmp_path / "shm"
    gate.write_text(GATE.format(dir=tmp_path))
    gate.chmod(0o755)
    shm.mkdir()
    arch, index = PRESETS["tiny-llama"], 1
    layout = model_layouts(arch)[index]
    env = {"TORCH_EXTENSIONS_DIR": str(cache), "CXX": str(gate), "TORCH_DONT_CHECK_COMPILER_ABI": "1"}
    store = ray.remote(ShardStoreActor).options(num_cpus=0, runtime_env={"env_vars": env}).remote(threads=1)
    try:
        reach = ray.get(store.allocate.remote(arch, [index], torch.float32, str(shm), "gate"), timeout=60)
        for _ in range(300):  # the build began on its own, before any update asked for it
            if (tmp_path / "started").exists():
                break
            time.sleep(0.1)
        assert (tmp_path / "started").exists() and not list(cache.rglob("*.so"))
        ray.get(store.init_random.remote(0, 0.05))
        init = ray.get(store.master.remote(index)).clone()
        grad = torch.randn(layout.numel, generator=torch.Generator().manual_seed(1)) * 0.01
        shm_tensor(Path(reach.weights[index]), layout.numel, torch.float32, create=False).copy_(grad)
        hp = AdamWStep(1, 1e-2, 1.0, (0.9, 0.95), 1e-8, 0.1)
        update = store.step_layer.remote(index, hp)
        assert ray.wait([update], timeout=1.0)[0] == [], "the first update did not wait for the build"
        (tmp_path / "fail").touch()
        ray.get(update, timeout=60)
        master = ray.get(store.master.remote(index))
        compute = shm_tensor(Path(reach.weights[index]), layout.numel, torch.float32, create=False).clone()
        ray.get(store.close.remote())
    finally:
        ray.kill(store)
        (tmp_path / "fail").touch()

    params = [torch.nn.Parameter(init[a:b].clone()) for a, b, _ in layout.segments()]
    for p, (a, b, _) in zip(params, layout.segments(), strict=True):
        p.grad = grad[a:b].clone()
    decays = [d for _, _, d in layout.segments()]
    torch.optim.AdamW([{"params": [p for p, d in zip(params, decays, strict=True) if d], "weight_decay": 0.1},
                       {"params": [p for p, d in zip(params, decays, strict=True) if not d], "weight_decay": 0.0}],
                      lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False, fused=False).step()
    expected = torch.cat([p.detach() for p in params])
    torch.testing.assert_close(master, expected, rtol=1e-6, atol=1e-6 * float(expected.abs().mean()))
    assert torch.equal(compute, master), "the compute copy is the new master (fp32)"
