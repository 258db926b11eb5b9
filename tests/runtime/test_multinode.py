"""Several Ray nodes on one machine (ray.cluster_utils.Cluster): layers spread over RAM nodes, and
every layer on RAM nodes, streamed to the GPU worker through its bounded window."""

import dataclasses

import pytest
import ray
import torch
from ray.cluster_utils import Cluster

from megatrain_ray.streaming.layer_order import layer_order
from megatrain_ray.runtime.local import LocalTrainer
from megatrain_ray.models.registry import PRESETS, model_layouts
from megatrain_ray.bench.telemetry import Probe
from megatrain_ray.planning.traffic import step_traffic
from megatrain_ray.host.window import fetches_per_step, window_bytes
from helpers.reference_training import random_micro_batches
from helpers.runs import make_config
from helpers.sessions import layer_weights, probed_session

MiB = 1024**2


@pytest.fixture(scope="module")
def three_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 100 * MiB,
                                                            "include_dashboard": False})  # no test reads it
    for _ in range(2):
        cluster.add_node(num_cpus=3, object_store_memory=100 * MiB, resources={"megatrain_ram": 1})
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.mark.parametrize("optim", [None, {"name": "muon", "muon_lr": 0.02}])
def test_layers_spread_over_all_nodes_and_train_like_one(three_nodes, optim):
    """With optim.name muon the RAM nodes' stores run its step on their own cores (the step plan
    puts Newton-Schulz on a GPU only for the GPU node's stores), bit for bit as one node."""
    arch = PRESETS["tiny-llama"].replace(num_layers=4)
    config = make_config("tiny-llama", optim=optim)
    data = random_micro_batches(arch, 3, 2, batch=2, seq=12, seed=1)

    session = probed_session(config, arch)
    try:
        nodes = {plan.node.node_id for plan in session.placement.stores}
        assert len(nodes) == 3, session.placement.describe(arch)
        assert sorted(i for plan in session.placement.stores for i in plan.layers) == list(range(arch.num_layers + 2))
        threads = ray.get([store.optimizer_threads.remote() for store in session.stores])
        assert threads == [1, 2, 2], "a store's AdamW threads: its node's CPUs less one (less two on the GPU node)"
        session.init_weights()
        session.start_executor()
        assert sorted(Probe(session).transports()) == ["shm", "stream", "stream"]
        results = [session.train_step(step) for step in data]
        weights = layer_weights(session)
    finally:
        session.close()

    single = LocalTrainer(config, arch)
    expected_losses = [single.train_step(step).loss for step in data]
    expected = single.layer_weights()
    single.close()
    assert [r.loss for r in results] == expected_losses
    for a, b in zip(weights, expected, strict=True):
        assert torch.equal(a, b)


# Wider than tiny-llama so that a mirror of 64 layers (63 MB in fp32) would stand out of the noise.
WIDE = PRESETS["tiny-llama"].replace(hidden_size=128, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=32)


def streamed_run(layers: int, steps: int = 2):
    """Every layer on the two RAM nodes, the GPU worker on the head: weights, losses and what the
    GPU worker held and moved. The embedding, at the turn of each step, travels and is updated in
    five pieces (runtime.transport_piece_mib)."""
    arch = WIDE.replace(num_layers=layers)
    base = make_config("tiny-llama")
    config = base.replace(runtime=dataclasses.replace(base.runtime, store_on_gpu_node=False, remote_window=4,
                                                      transport_streams=2, transport_piece_mib=0.03))
    data = random_micro_batches(arch, steps, 2, batch=2, seq=12, seed=5)
    session = probed_session(config, arch)
    try:
        session.init_weights()
        session.start_executor()
        gpu = session.gpus[0]
        kinds = ray.get(gpu.transports.remote())
        held = ray.get(gpu.remote_host_bytes.remote())
        losses, traffic = [], []
        for step in data:
            losses.append(session.train_step(step).loss)
            traffic.append(ray.get(gpu.take_traffic.remote()))
        rss = ray.get(gpu.memory_status.remote())["rss_bytes"]
        weights = layer_weights(session)
        placement = session.placement
    finally:
        session.close()
    return dict(arch=arch, config=config, data=data, kinds=kinds, held=held, losses=losses, traffic=traffic,
                rss=rss, weights=weights, placement=placement)


def test_every_layer_on_ram_nodes_streams_through_a_bounded_window_and_trains_like_one_node(three_nodes):
    runs = {layers: streamed_run(layers) for layers in (8, 64)}
    for layers, run in runs.items():
        arch, placement = run["arch"], run["placement"]
        assert run["kinds"] == ["stream", "stream"], placement.describe(arch)
        assert placement.remote_layers() == list(range(layers + 2))
        numels = {layout.index: layout.numel for layout in model_layouts(arch)}
        # what the GPU worker holds for remote layers is the window the plan counted, whatever the depth
        assert run["held"] == window_bytes(list(numels.values()), 4, 4) == placement.window_bytes
        # bytes moved per step: each layer's gradient once; weights once, or twice where the window
        # did not hold them from forward to backward, as the plan's traffic says
        plan = step_traffic(arch, run["config"], placement)
        fetched = fetches_per_step(numels, layer_order(arch), 4)
        for bytes_in, bytes_out in run["traffic"]:
            assert bytes_in == sum(fetched[i] * numels[i] * 4 for i in numels) == sum(s.weight_bytes for s in plan.stores)
            assert bytes_out == sum(numels.values()) * 4 == sum(s.gradient_bytes for s in plan.stores)
        assert sum(fetched.values()) == 2 * (layers + 2) - 4 - 2  # blocks outside the window cross twice
        # the same weights as the single-node run, bit for bit (fp32)
        single = LocalTrainer(run["config"], arch)
        expected_losses = [single.train_step(step).loss for step in run["data"]]
        expected = single.layer_weights()
        single.close()
        assert run["losses"] == expected_losses
        for a, b in zip(run["weights"], expected, strict=True):
            assert torch.equal(a, b)
    assert runs[8]["held"] == runs[64]["held"]
    mirror_growth = sum(layout.numel for layout in model_layouts(runs[64]["arch"])[9:65]) * 4  # 56 more blocks
    grew = runs[64]["rss"] - runs[8]["rss"]
    assert grew < mirror_growth / 3, f"the GPU worker grew by {grew / MiB:.1f} MiB from 8 to 64 layers"


def test_two_workers_over_shared_memory_and_ram_nodes_train_like_one(three_nodes):
    """Two data-parallel workers, each with its own window and links to the RAM nodes: a layer's
    update sent by its owner is a version the other asks its store for (layers on RAM nodes) or a
    reference it waits on (shared memory). Equal to one worker over the same batches, validation too."""
    arch = PRESETS["tiny-llama"].replace(num_layers=4)
    data = random_micro_batches(arch, 3, 4, batch=2, seq=12, seed=2)

    def config_of(num_gpus: int):
        base = make_config("tiny-llama")
        return base.replace(train=dataclasses.replace(base.train, grad_accum=4),
                            runtime=dataclasses.replace(base.runtime, num_gpus=num_gpus, worker_threads=1,
                                                        transport_streams=2))

    def steps(trainer):
        """Two steps, the validation loss, the third step: what each worker's view must survive."""
        results = [trainer.train_step(step) for step in data[:2]]
        evaluation = trainer.eval_loss(data[2][:3])
        return [*results, trainer.train_step(data[2])], evaluation

    def one_worker():
        """In this process, on one thread like each Ray worker: what one Ray worker over these nodes
        computes, bit for bit (test_layers_spread_over_all_nodes_and_train_like_one)."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        trainer = LocalTrainer(config_of(1), arch)
        try:
            return *steps(trainer), trainer.layer_weights()
        finally:
            trainer.close()
            torch.set_num_threads(threads)

    def two_workers():
        session = probed_session(config_of(2), arch)
        try:
            session.init_weights()
            session.start_executor()
            assert sorted(Probe(session).transports()) == ["shm", "stream", "stream"]
            results, evaluation = steps(session)
            session.drain()
            versions = ray.get([w.remote_versions.remote() for w in session.gpus])
            weights = layer_weights(session)
            counts = {i: n for c in ray.get([s.update_counts.remote() for s in session.stores])
                      for i, n in c.items()}
        finally:
            session.close()
        return results, evaluation, weights, counts, versions

    one, one_eval, one_weights = one_worker()
    two, two_eval, two_weights, counts, versions = two_workers()
    for a, b in zip(two, one, strict=True):
        assert a.loss == pytest.approx(b.loss, rel=1e-6) and a.grad_norm == pytest.approx(b.grad_norm, rel=1e-6)
    assert two_eval.loss == pytest.approx(one_eval.loss, rel=1e-6)
    # Two workers sum each gradient in another order than one: rounding, which AdamW's first steps
    # (nearly sign(g) x lr) turn into a full step where an element's gradient is near zero. The
    # blocks differ by about 1e-7, the embedding by 2e-6 (6.5e-7 before the head went chunk by chunk).
    for i, (a, b) in enumerate(zip(two_weights, one_weights, strict=True)):
        assert float((a - b).norm() / b.norm()) < 5e-6, f"layer {i}: {float((a - b).norm() / b.norm())}"
    assert counts == {i: 3 for i in range(arch.num_layers + 2)}
    # each worker counts the updates of every streamed layer, its own and the other's (told once,
    # with its next call): after 3 steps a layer's owner has sent 3, the other worker knows of 2
    layers = set(versions[0])
    assert layers and all(sorted(v[i] for v in versions) == [2, 3] for i in layers), versions


def test_ram_nodes_with_a_disk_tier_train_like_one_node(three_nodes, tmp_path):
    """Every layer on the two RAM nodes, each store with a disk tier for the optimizer state its
    stated memory cannot hold (runtime.disk_dir, runtime.store_memory_gib), the embedding travelling
    in pieces at the turn: the single-node all-RAM run's losses and weights, bit for bit (fp32)."""
    arch = PRESETS["tiny-llama"].replace(num_layers=12)
    base = make_config("tiny-llama")
    config = base.replace(runtime=dataclasses.replace(
        base.runtime, store_on_gpu_node=False, transport_streams=2, transport_piece_mib=0.03,
        disk_dir=str(tmp_path), store_memory_gib=3.0e6 / 2**30))
    data = random_micro_batches(arch, 3, 2, batch=2, seq=12, seed=5)
    session = probed_session(config, arch)
    try:
        on_disk = [plan.disk_layers for plan in session.placement.stores]
        assert len(on_disk) == 2 and all(on_disk), session.placement.describe(arch)
        session.init_weights()
        session.start_executor()
        assert ray.get(session.gpus[0].transports.remote()) == ["stream", "stream"]
        losses = [session.train_step(step).loss for step in data]
        weights = layer_weights(session)
        read = [ray.get(store.disk_stats.remote())["read_bytes"] for store in session.stores]
    finally:
        session.close()
    assert all(read)
    single = LocalTrainer(base, arch)
    expected_losses = [single.train_step(step).loss for step in data]
    expected = single.layer_weights()
    single.close()
    assert losses == expected_losses
    for a, b in zip(weights, expected):
        assert torch.equal(a, b)
