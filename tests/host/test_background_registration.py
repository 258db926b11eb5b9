"""A GPU worker's mapping of the stores' shared memory is page-locked with CUDA on a thread of its own
(host/registration.py): the worker's start maps only, each use of a buffer waits for its own
registration, an error there surfaces at the next use, and closing releases exactly what was
registered. On the CPU a recording function stands in for cudaHostRegister; the real one runs on
a GPU (pytest -m gpu)."""

from __future__ import annotations

import threading

import pytest
import torch

from megatrain_ray.host.precision import StateFormat
from megatrain_ray.host.registration import BackgroundRegistration
from megatrain_ray.host.remote_sources import SharedMemorySource
from megatrain_ray.host.store import ShardStore
from megatrain_ray.models.registry import PRESETS, model_layouts

ARCH = PRESETS["tiny-llama"]
LAYERS = list(range(ARCH.num_layers + 2))  # the embedding, the blocks, the head


class Recorder:
    """Stands in for cudaHostRegister: records the buffers it page-locks, in order, and can stop
    before its n-th until released (`hold_at`, `go`), or fail there (`fail_at`)."""

    def __init__(self, hold_at: int | None = None, fail_at: int | None = None):
        self.hold_at, self.fail_at = hold_at, fail_at
        self.go = threading.Event()
        self.registered: list[int] = []
        self.unregistered: list[int] = []

    def register(self, t: torch.Tensor) -> None:
        n = len(self.registered)
        if n == self.hold_at:
            assert self.go.wait(10), "the test never released the registration"
        if n == self.fail_at:
            raise OSError("cannot page-lock more memory")
        self.registered.append(t.data_ptr())

    def unregister(self, t: torch.Tensor) -> None:
        self.unregistered.append(t.data_ptr())


@pytest.fixture
def fp32_store(tmp_path):
    """A store whose embedding state a GPU worker steps (shared memory from the start)."""
    store = ShardStore(ARCH, LAYERS, torch.float32, shm_dir=str(tmp_path), run_id="reg", shared_state=(0,))
    yield store
    store.close()


def source_of(store: ShardStore, recorder: Recorder) -> SharedMemorySource:
    """What a GPU worker maps of a store on its node (GpuWorker._route_layers), from what the store
    answers at allocation (StoreReach): it asks the store nothing."""
    numels = {i: layout.numel for i, layout in enumerate(model_layouts(ARCH))}
    return SharedMemorySource(None, dict(store.shm_paths), numels, store.compute_dtype,
                              BackgroundRegistration(recorder.register, recorder.unregister),
                              grad_paths=dict(store.grad_shm_paths), states=store.shared_states())


def ptrs(tensors) -> list[int]:
    return [t.data_ptr() for t in tensors]


def test_the_start_maps_only_and_registers_in_the_order_a_step_first_uses_the_buffers(tmp_path):
    """A bf16 master's store: gradient buffers of their own. The source is built while the
    registration is held at its first buffer; then weights register in layer order (the forward),
    the gradient buffers from the last layer back (the backward)."""
    store = ShardStore(ARCH, LAYERS, torch.bfloat16, shm_dir=str(tmp_path), run_id="order",
                       state_format=StateFormat(master="bf16", moments="bf16"))
    recorder = Recorder(hold_at=0)
    source = source_of(store, recorder)
    try:
        assert recorder.registered == [], "the start waited for a registration"
        recorder.go.set()
        assert source.grad_buffer(0).data_ptr() == source.g[0].data_ptr()  # the last in the order: waits for all
        assert recorder.registered == ptrs([source.w[i] for i in LAYERS] + [source.g[i] for i in reversed(LAYERS)])
    finally:
        source.close()
        store.close()


def test_a_read_waits_for_its_own_layer_only(fp32_store):
    """Held before layer 2's weights: layers 0 and 1 read at once, layer 2's read waits until it is
    registered; the embedding's state, mapped when the worker builds its step on the device, comes
    after the layers, and its first copy (`ready`) waits for it."""
    recorder = Recorder(hold_at=2)
    source = source_of(fp32_store, recorder)
    try:
        source.weights(0)
        source.weights(1)
        assert recorder.registered == ptrs([source.w[0], source.w[1]]), "a read waited for a later layer"
        read = threading.Thread(target=source.weights, args=(2,))
        read.start()
        read.join(0.3)
        assert read.is_alive(), "layer 2 was read before it was registered"
        recorder.go.set()
        read.join(5)
        assert not read.is_alive() and ptrs([source.w[2]])[0] in recorder.registered
        state = source.shared_state(0, [])
        state.ready()
        assert recorder.registered[-4:] == ptrs([state.master, state.exp_avg, state.exp_avg_sq, state.held])
        assert recorder.registered[:len(LAYERS)] == ptrs(source.w[i] for i in LAYERS)
    finally:
        recorder.go.set()
        source.close()


def test_a_failed_registration_surfaces_at_the_next_read_and_close_releases_what_was_registered(fp32_store):
    recorder = Recorder(hold_at=1, fail_at=1)
    source = source_of(fp32_store, recorder)
    try:
        source.weights(0)  # registered before the failure
        recorder.go.set()
        with pytest.raises(RuntimeError, match="page-locking") as failed:
            source.weights(2)
        assert isinstance(failed.value.__cause__, OSError)
        with pytest.raises(RuntimeError, match="page-locking"):
            source.grad_buffer(1)  # not swallowed after its first report
    finally:
        source.close()
    assert recorder.registered == recorder.unregistered == ptrs([source.w[0]])


def test_closing_while_registering_waits_for_the_buffer_in_hand_and_releases_exactly_what_was_registered(fp32_store):
    recorder = Recorder(hold_at=2)
    source = source_of(fp32_store, recorder)
    source.weights(1)
    closing = threading.Thread(target=source.close)
    closing.start()
    closing.join(0.3)
    assert closing.is_alive(), "close returned while a buffer was being registered"
    recorder.go.set()
    closing.join(5)
    assert not closing.is_alive()
    assert recorder.registered == ptrs(source.w[i] for i in (0, 1, 2)), "registering went on after close"
    assert recorder.unregistered == recorder.registered


@pytest.mark.gpu
def test_on_a_gpu_a_step_reading_while_the_buffers_register_is_the_in_process_trainers(local_ray, tmp_path):
    """cudaHostRegister itself, slowed so that the first step reads while later layers are still being
    registered: a store in its actor on this node, mapped and stepped from this process as a GPU
    worker does. The step is bit-equal to the in-process trainer's (whose buffers are pinned when
    made); once the thread is done every buffer is page-locked, and closing releases them all."""
    import time

    import ray

    from helpers.reference_training import random_micro_batches
    from helpers.runs import make_config
    from megatrain_ray.host.memory import cuda_host_register, cuda_host_unregister
    from megatrain_ray.host.remote_sources import RoutedSource
    from megatrain_ray.planning.step_plan import measured_facts, plan_step
    from megatrain_ray.runtime.actors import ShardStoreActor
    from megatrain_ray.runtime.local import LocalTrainer
    from megatrain_ray.runtime.worker import assemble_worker

    config = make_config("tiny-llama", device="cuda", compile=False, embedding_step="device")
    device = torch.device("cuda")
    data = random_micro_batches(ARCH, 2, 2, batch=2, seq=12, seed=1)
    local = LocalTrainer(config, ARCH)
    expected = [local.train_step(step).loss for step in data]
    expected_weights = local.layer_weights()
    local.close()

    store = ray.remote(ShardStoreActor).options(num_cpus=0).remote(threads=1)
    reach = ray.get(store.allocate.remote(ARCH, LAYERS, torch.float32, str(tmp_path), "gpu-reg",
                                          seed=config.train.seed, shared_state=(0,)))
    ray.get(store.init_random.remote(config.train.seed, config.model.init_std))

    def slow_register(t: torch.Tensor) -> None:
        time.sleep(1.0)  # slow enough that the step starts before the last buffer is registered
        cuda_host_register(t)

    registration = BackgroundRegistration(slow_register, cuda_host_unregister, device)
    numels = {i: layout.numel for i, layout in enumerate(model_layouts(ARCH))}
    source = SharedMemorySource(store, reach.weights, numels, torch.float32, registration,
                                grad_paths=reach.gradients, states=reach.states)
    plan = plan_step(ARCH, config, measured_facts(device, ARCH, config))
    assert plan.embedding_on_device
    worker = assemble_worker(ARCH, config, plan, RoutedSource([source], [LAYERS]), device)
    try:
        assert len(registration.registered) < len(LAYERS), "the registration was done before the step"
        losses = [worker.executor.train_step(step, worker.lr_schedule.next).loss for step in data]
        worker.source.drain()
        weights = [ray.get(store.master.remote(i)) for i in LAYERS]
        buffers = [*source.w.values(), *source.g.values()]
        assert registration.waited_s > 0, "the step never waited for a registration"
        assert {t.data_ptr() for t in buffers} <= {t.data_ptr() for t in registration.registered}
        assert len(registration.registered) == len(buffers) + 4  # and the embedding's state, with its marker
        assert all(t.is_pinned() for t in registration.registered)
    finally:
        worker.source.close()
        ray.get(store.close.remote())
    assert not any(t.is_pinned() for t in buffers), "closing left buffers page-locked"
    assert losses == expected
    for a, b in zip(weights, expected_weights):
        assert torch.equal(a, b)
