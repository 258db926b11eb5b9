"""Planning RAM nodes without a cluster: the window, the refusals, the traffic and the step model
with the network, and `megatrain-ray plan --cluster`."""

import dataclasses
import re

import pytest

from megatrain_ray.config import ConfigError, config_from_dict
from megatrain_ray.streaming.layer_order import layer_order
from megatrain_ray.models.registry import PRESETS, model_layouts, num_params
from megatrain_ray.planning.placement import GPU_NODE_RESERVE, USABLE, NodeInfo, plan_placement, with_window
from megatrain_ray.planning.memory import EMBEDDING_STEP, PlanError
from megatrain_ray.planning.prediction import HOST_ADAMW_PARAMS_PER_S, predict_step
from megatrain_ray.planning.report import describe
from megatrain_ray.planning.step_plan import DeviceFacts, plan_step
from megatrain_ray.planning.traffic import step_traffic
from megatrain_ray.host.window import WindowPolicy, fetches_per_step, window_bytes
from helpers.runs import command_here

GiB = 1024**3
SEVEN_B = PRESETS["qwen2.5-7b"]


def config(**runtime):
    return config_from_dict({
        "model": {"preset": "qwen2.5-7b"}, "data": {"seq_len": 4096},
        "train": {"micro_batch_size": 4, "grad_accum": 8},
        "runtime": {"store_on_gpu_node": False, **runtime},
    })


def gpu_node(free_gib: float, ip: str = "10.0.0.1", gbps: float | None = None) -> NodeInfo:
    return NodeInfo("gpu", ip, 1.0, False, int(free_gib * GiB), gbps)


def ram_node(k: int, free_gib: float, ip: str | None = None, gbps: float | None = None) -> NodeInfo:
    return NodeInfo(f"ram{k}", ip or f"10.0.1.{k}", 0.0, True, int(free_gib * GiB), gbps)


def placed(arch, cfg, nodes):
    """The placement with its window as a step plan sizes it with no activations parked."""
    return with_window(plan_placement(arch, cfg, nodes, "gpu"), arch, cfg)


def mirror_bytes(arch) -> int:
    return num_params(arch) * 2


def test_a_gpu_node_that_cannot_hold_a_mirror_streams_through_a_window_of_the_same_size_at_any_depth():
    """16 GiB on the GPU node: a mirror of the 7B's bf16 weights (14.2 GiB) plus the GPU actor does
    not fit, the window does; a model twice as deep needs the same window, and more RAM."""
    plans = {}
    for layers in (28, 56):
        arch = SEVEN_B.replace(num_layers=layers)
        plan = placed(arch, config(), [gpu_node(16), ram_node(1, 400), ram_node(2, 400)])
        assert plan.remote_layers() == list(range(layers + 2))
        assert plan.window_slots < layers and plan.window_bytes < USABLE * 16 * GiB - GPU_NODE_RESERVE
        plans[layers] = plan
    assert mirror_bytes(SEVEN_B) > USABLE * 16 * GiB - GPU_NODE_RESERVE
    assert plans[28].window_bytes == plans[56].window_bytes
    assert sum(s.host_bytes for s in plans[56].stores) > 1.8 * sum(s.host_bytes for s in plans[28].stores)


def test_ram_nodes_that_cannot_hold_the_state_are_refused_naming_the_shortfall():
    need = num_params(SEVEN_B) * 14
    have = 2 * USABLE * 40 * GiB
    with pytest.raises(ConfigError) as refused:
        placed(SEVEN_B, config(), [gpu_node(120), ram_node(1, 40), ram_node(2, 40)])
    message = str(refused.value)
    assert f"short by {(need - have) / GiB:.1f} GiB" in message and "add ram nodes" in message.lower(), message
    assert "for the GPU actor" not in message  # the GPU machine holds no state here: nothing to subtract


def test_a_gpu_node_too_small_for_the_least_window_is_refused_naming_the_window():
    with pytest.raises(ConfigError, match="pinned host memory for its window"):
        placed(SEVEN_B, config(), [gpu_node(6), ram_node(1, 400)])


def test_raylets_of_one_machine_share_its_memory():
    """The GPU machine of the benchmark: a head and a RAM-node raylet on one 123 GiB host. The 7B's
    99 GiB of state fits beside the least window; a 14B (193 GiB) would only 'fit' if the two
    raylets' views of the same memory were added up."""
    same = [gpu_node(123, ip="10.0.0.1"), ram_node(1, 123, ip="10.0.0.1")]
    plan = placed(SEVEN_B, config(), same)
    assert plan.window_slots == 4  # the least: executor.num_slots + 1
    assert plan.gpu_machine_state() + plan.window_bytes + GPU_NODE_RESERVE <= USABLE * 123 * GiB
    with pytest.raises(ConfigError, match="short by"):
        placed(PRESETS["qwen2.5-14b"], config(), same)


def test_a_roomy_gpu_node_holds_every_remote_layer_and_each_crosses_once():
    plan = placed(PRESETS["qwen2.5-1.5b"], config(), [gpu_node(120), ram_node(1, 400)])
    numels = {layout.index: layout.numel for layout in model_layouts(PRESETS["qwen2.5-1.5b"])}
    fetched = fetches_per_step(numels, layer_order(PRESETS["qwen2.5-1.5b"]), plan.window_slots)
    assert set(fetched.values()) == {1}
    assert plan.window_bytes < 2.5 * mirror_bytes(PRESETS["qwen2.5-1.5b"])  # a mirror plus the outbox


@pytest.mark.parametrize("slots", [1, 2, 3, 4, 7, 30])
def test_the_window_policy_serves_every_use_and_refetches_only_what_it_could_not_hold(slots):
    arch = SEVEN_B
    numels = {layout.index: layout.numel for layout in model_layouts(arch)}
    order = layer_order(arch)
    policy = WindowPolicy(numels, slots)
    policy.begin_step(order)
    policy.plan()
    held_now = set()
    for layer in order:
        policy.use(layer)
        policy.plan()
        assert layer in policy.where, f"layer {layer} not held at its use"
        held_now = {held for pool in policy.pools.values() for held in pool if held is not None}
        assert len(held_now) <= sum(len(pool) for pool in policy.pools.values())
    blocks = arch.num_layers
    assert sum(fetches_per_step(numels, order, slots).values()) == 2 + blocks + max(0, blocks - slots)
    deeper = [[layout.numel for layout in model_layouts(arch.replace(num_layers=k * blocks))] for k in (2, 3)]
    assert window_bytes(deeper[0], slots, 2) == window_bytes(deeper[1], slots, 2)


def test_the_step_model_with_the_network():
    arch, cfg = SEVEN_B, config()
    nodes = [gpu_node(16, gbps=100), ram_node(1, 400, gbps=100), ram_node(2, 400, gbps=100)]
    plan = placed(arch, cfg, nodes)
    traffic = step_traffic(arch, cfg, plan)
    esize = 2
    assert traffic.gpu.forward_bytes == num_params(arch) * esize == traffic.gpu.gradient_bytes
    assert traffic.gpu.weight_bytes == sum(s.weight_bytes for s in traffic.stores)
    steps = {g: predict_step(arch, cfg, traffic.times(g), traffic.optimizer_seconds()) for g in (10, 25, 100, 400)}
    assert steps[10].step_s > steps[25].step_s > steps[100].step_s >= steps[400].step_s
    assert steps[10].bound == "network" and steps[400].bound == "compute"
    # at the speed the plan says hides the GPU node's transfers, only the first layer's round trip shows
    hide = traffic.gpu.hiding_gbps(steps[10].compute_s)
    at_hide = predict_step(arch, cfg, traffic.times(hide * 1.0001), traffic.optimizer_seconds())
    assert at_hide.network_exposed_s == pytest.approx(traffic.times(hide * 1.0001).boundary_s, abs=1e-6)
    # stores on the GPU node: nothing crosses a network, and the model is the one without it
    local = plan_placement(arch, dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, store_on_gpu_node=True)),
                           [gpu_node(123)], "gpu")
    no_net = step_traffic(arch, cfg, local)
    assert predict_step(arch, cfg, no_net.times(), no_net.optimizer_seconds()) == predict_step(arch, cfg)


def test_kept_blocks_cross_the_network_once():
    """A block that keeps its forward graph is not read again in backward: the traffic model
    follows the executor's layer order (layer_order.step_order), as the window itself does."""
    arch, cfg = SEVEN_B, config()
    plan = placed(arch, cfg, [gpu_node(16), ram_node(1, 400)])
    blocks = arch.num_layers
    traffic = {kept: step_traffic(arch, cfg, plan, kept).gpu for kept in (0, 8, blocks)}
    assert len({t.forward_bytes for t in traffic.values()}) == 1
    assert len({t.gradient_bytes for t in traffic.values()}) == 1
    embedding = model_layouts(arch)[0].numel * 2
    block = model_layouts(arch)[1].numel * 2
    assert traffic[0].backward_bytes - traffic[8].backward_bytes >= 8 * block - plan.window_slots * block
    assert traffic[8].backward_bytes < traffic[0].backward_bytes
    assert traffic[blocks].backward_bytes <= embedding  # only the embedding's backward reads weights


def test_an_embedding_on_a_ram_node_is_planned_with_its_step_on_the_host():
    """streaming/device_step.py needs the store's memory: with the embedding streamed in, auto steps it on
    the host, and the plan neither counts its device memory nor says it runs on the GPU; in reach
    (in process), it runs on the GPU, and the plan counts and says so."""
    arch = SEVEN_B
    cfg = config().replace(executor=dataclasses.replace(config().executor, device="cuda"))
    plan = plan_placement(arch, cfg, [gpu_node(16), ram_node(1, 400)], "gpu")
    assert 0 in plan.remote_layers()
    gpu = DeviceFacts("cuda", "a GPU", 2**50, 2**50)  # room for anything: only the embedding's place is asked
    streamed, in_reach = plan_step(arch, cfg, gpu, plan), plan_step(arch, cfg, gpu)
    assert not streamed.embedding_on_device and EMBEDDING_STEP not in streamed.memory.by_use
    assert in_reach.embedding_on_device and EMBEDDING_STEP in in_reach.memory.by_use
    assert "AdamW step runs on the GPU" in describe(arch, cfg, in_reach)
    assert "AdamW step runs on the GPU" not in describe(arch, cfg, streamed)
    forced = cfg.replace(executor=dataclasses.replace(cfg.executor, embedding_step="device"))
    with pytest.raises(PlanError, match="its store on another node"):
        plan_step(arch, forced, gpu, plan)


@pytest.fixture
def run_plan(capsys):
    """`megatrain-ray plan ARGS` in this process (a plan of a described cluster starts no Ray):
    its exit status and what it printed."""
    return lambda *args: command_here(["plan", *args], capsys)


def test_whatif_plan_for_the_120b_example(run_plan):
    out = run_plan("examples/dense-120b.yaml", "--cluster", "examples/cluster-4x512.yaml", "--network-gbps", "10", "25", "100")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert out.stdout.strip().endswith("fits") and "122.6 B params" in out.stdout
    rows = {float(m[0]): float(m[1]) for m in re.findall(r"^\| (\d+) \|.*?\| ([\d.]+) \| [\d,]+ \| \w+ \|$", out.stdout, re.M)}
    assert set(rows) == {10, 25, 100} and rows[10] > rows[25] > rows[100], out.stdout


def test_whatif_plans_for_the_large_mixtures_of_experts(run_plan):
    """The README's plans: gpt-oss-120b on four RAM nodes; qwen3-235b-a22b refused on four
    (naming the shortfall), spread over eight."""
    moe = ("examples/dense-120b.yaml", "--set", "train.grad_accum=16", "--set")
    gpt = run_plan(*moe, "model.preset=gpt-oss-120b", "--cluster", "examples/cluster-4x512.yaml")
    assert gpt.returncode == 0 and gpt.stdout.strip().endswith("fits"), gpt.stdout[-3000:] + gpt.stderr[-2000:]
    assert len(re.findall(r"^store on ram-node-\d \(RAM node\)", gpt.stdout, re.M)) == 4
    assert "116.83 B parameters stream and are updated" in gpt.stdout
    short = run_plan(*moe, "model.preset=qwen3-235b-a22b", "--cluster", "examples/cluster-4x512.yaml")
    assert short.returncode == 1 and "short by 1265.3 GiB" in short.stdout, short.stdout[-2000:]
    qwen = run_plan(*moe, "model.preset=qwen3-235b-a22b", "--cluster", "examples/cluster-8x512.yaml")
    assert qwen.returncode == 0 and qwen.stdout.strip().endswith("fits"), qwen.stdout[-3000:]
    assert len(re.findall(r"^store on ram-node-\d \(RAM node\)", qwen.stdout, re.M)) == 8


def test_whatif_refuses_ram_nodes_too_small_for_the_state(tmp_path, run_plan):
    cluster = tmp_path / "small.yaml"
    cluster.write_text("gpu_node: {host_memory_gib: 120}\nram_nodes:\n  - {memory_gib: 256, count: 4}\n")
    out = run_plan("examples/dense-120b.yaml", "--cluster", str(cluster))
    assert out.returncode == 1 and "short by" in out.stdout, out.stdout[-2000:]
    cluster.write_text("gpu_node: {host_memory_gib: 120}\nram_nodes:\n  - {memory_gib: 256, cuont: 4}\n")
    out = run_plan("examples/dense-120b.yaml", "--cluster", str(cluster))
    assert out.returncode == 2 and "did you mean 'count'" in out.stderr, out.stderr


def test_a_window_smaller_than_the_device_slots_is_refused():
    with pytest.raises(ConfigError, match="runtime.remote_window"):
        config(remote_window=2)
    assert config(remote_window=3).runtime.remote_window == 3


def test_the_plan_says_how_many_optimizer_cores_keep_up():
    """The step's update hidden behind the forward: the model's parameters over the forward's
    seconds, at the measured rate per optimizer thread, in all and as a RAM node's share; twice the
    tokens a step, about half the cores."""
    import math

    from megatrain_ray.planning.prediction import HOST_ADAMW_PARAMS_PER_S, HOST_ADAMW_THREADS

    def cores_said(cfg) -> tuple[int, int]:
        step = plan_step(SEVEN_B, cfg, DeviceFacts("cuda", "a GPU", 2**50, 2**50))
        line = next(l for l in describe(SEVEN_B, cfg, step).splitlines() if l.startswith("host AdamW cores that keep up"))
        said = int(re.search(r": (\d+) over all the stores", line).group(1))
        per_core = HOST_ADAMW_PARAMS_PER_S / HOST_ADAMW_THREADS
        assert f"needs f x {said} optimizer threads" in line
        forward_s = predict_step(SEVEN_B, cfg, kept=step.kept).forward_s
        return said, math.ceil(num_params(SEVEN_B) / forward_s / per_core)

    cfg = config(store_on_gpu_node=True)
    said, expected = cores_said(cfg)
    assert said == expected and 4 < said < 20  # 7.6 B parameters, a forward of about 3 s
    doubled, _ = cores_said(cfg.replace(train=dataclasses.replace(cfg.train, grad_accum=2 * cfg.train.grad_accum)))
    assert doubled in (said // 2, -(-said // 2))


def test_each_store_runs_the_optimizer_threads_its_node_offers_less_its_other_work():
    """The CPUs Ray counts on a node (`ray start --num-cpus`, default all its cores) size its store's
    AdamW: the GPU node keeps one core and one per GPU worker, a RAM node one for its links;
    runtime.optimizer_threads overrides both; a node whose CPUs are not known gets no count."""
    nodes = [dataclasses.replace(gpu_node(200), cpus=32.0), dataclasses.replace(ram_node(1, 400), cpus=16.0),
             dataclasses.replace(ram_node(2, 400), cpus=1.0), ram_node(3, 400)]
    on_gpu_node = config(store_on_gpu_node=True)
    threads = {s.node.node_id: s.threads for s in plan_placement(SEVEN_B, on_gpu_node, nodes, "gpu").stores}
    assert threads == {"gpu": 30, "ram1": 15, "ram2": 1, "ram3": None}
    two_gpus = config(store_on_gpu_node=True, num_gpus=2)
    nodes[0] = dataclasses.replace(nodes[0], gpus=2.0)
    assert plan_placement(SEVEN_B, two_gpus, nodes, "gpu").stores[0].threads == 29
    stated = config(store_on_gpu_node=True, optimizer_threads=4)
    assert {s.threads for s in plan_placement(SEVEN_B, stated, nodes, "gpu").stores} == {4}


def test_plan_says_how_many_cores_each_ram_node_needs_to_keep_up():
    """One formula: a RAM node's AdamW over its parameters within the forward, at the measured rate a
    core, and a core for its links; the plan names each RAM node's count and whether its store has it."""
    from megatrain_ray.planning.prediction import (HOST_ADAMW_PARAMS_PER_S, HOST_ADAMW_THREADS, TRANSPORT_CORES,
                                                   ram_node_cores)

    per_core = HOST_ADAMW_PARAMS_PER_S / HOST_ADAMW_THREADS
    assert ram_node_cores(int(5 * per_core * 2.0), 2.0) == 5 + TRANSPORT_CORES  # exactly five cores' work
    assert ram_node_cores(int(5 * per_core * 2.0) + 1000, 2.0) == 6 + TRANSPORT_CORES
    nodes = [gpu_node(16), dataclasses.replace(ram_node(1, 400), cpus=64.0), dataclasses.replace(ram_node(2, 400), cpus=2.0)]
    cfg = config()
    step = plan_step(SEVEN_B, cfg, DeviceFacts("cuda", "H100", 79 * GiB, 14 * GiB), placed(SEVEN_B, cfg, nodes),
                     stores_allocated=False)
    text = describe(SEVEN_B, cfg, step)
    forward = predict_step(SEVEN_B, step.planned_config(cfg), kept=step.kept).forward_s
    numels = [layout.numel for layout in model_layouts(SEVEN_B)]
    for store, verdict in zip(step.placement.stores, ["63 optimizer threads (enough)", "1 optimizer thread: "], strict=True):
        params = sum(numels[i] for i in store.layers)
        need = ram_node_cores(params, forward)
        assert 1 < need < 63
        assert f"RAM node {store.node.ip} ({params / 1e9:.2f} B parameters): {need} cores keep up" in text, text
        assert verdict in text


def test_the_turn_of_the_step_is_planned_as_the_link_carries_it():
    """The embedding on a RAM node: its gradient out, its store's AdamW and its new weights back sit
    between steps. Whole, the three add up; in the link's pieces (runtime.transport_piece_mib) they
    overlap, and the turn is the slowest stage and a piece of the others."""
    arch = SEVEN_B
    nodes = [gpu_node(16, gbps=100), ram_node(1, 400, gbps=100), ram_node(2, 400, gbps=100)]
    turns = {}
    for mib in (0, 64):
        cfg = config(transport_piece_mib=mib)
        traffic = step_traffic(arch, cfg, placed(arch, cfg, nodes))
        embedding = model_layouts(arch)[0].numel
        wire = embedding * 2 * 8 / 100e9
        adamw = traffic.first_layer_adamw_s
        assert adamw == pytest.approx(embedding / HOST_ADAMW_PARAMS_PER_S)
        turns[mib] = traffic.times().boundary_s
        if mib == 0:
            assert traffic.first_layer_pieces == 1 and turns[mib] == pytest.approx(2 * wire + adamw)
        else:  # 545 M elements in pieces of 32 Mi (64 MiB of bf16): 17
            assert traffic.first_layer_pieces == 17
            assert turns[mib] == pytest.approx(max(wire, adamw) + (wire + adamw + wire - max(wire, adamw)) / 17)
    assert max(wire, adamw) < turns[64] < 0.6 * turns[0]
