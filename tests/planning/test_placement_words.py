"""What the placement says of the model it placed, in words a person reads at a glance."""

from megatrain_ray.config import config_from_dict
from megatrain_ray.models.registry import PRESETS, num_params, params_text
from megatrain_ray.planning.placement import GiB, NodeInfo, plan_placement


def test_parameter_counts_read_in_their_own_unit():
    assert [params_text(n) for n in (7, 999, 1000, 12_345, 1_234_567, 7_615_616_512, 122_610_000_000)] == [
        "7 params", "999 params", "1 K params", "12.35 K params", "1.235 M params", "7.616 B params",
        "122.6 B params"]


def test_a_tiny_model_is_not_zero_billion_params():
    arch = PRESETS["tiny-llama"]
    node = NodeInfo("n0", "10.0.0.1", gpus=0.0, ram_node=False, free_bytes=8 * GiB)
    text = plan_placement(arch, config_from_dict({"model": {"preset": "tiny-llama"}}), [node], "n0").describe(arch)
    assert num_params(arch) == 106_816 and "model: llama, 2 blocks, 106.8 K params, " in text, text


def test_a_model_run_through_transformers_modules_says_so_and_that_its_check_passed():
    from megatrain_ray.models.registry import model_arch

    node = NodeInfo("n0", "10.0.0.1", gpus=0.0, ram_node=False, free_bytes=8 * GiB)
    for implementation in ("native", "transformers"):
        config = config_from_dict({"model": {"preset": "tiny-llama", "implementation": implementation}})
        arch = model_arch(config.model)  # checked against transformers where it runs through its modules
        line = plan_placement(arch, config, [node], "n0").describe(arch).splitlines()[0]
        through = "model: llama through transformers' own modules (its check against transformers' model passed"
        assert line.startswith(through) == (implementation == "transformers"), line


def test_each_node_is_named_once_with_its_role_and_no_empty_parentheses():
    gpu = NodeInfo("a1b2c3d4e5f60718", "10.0.0.1", gpus=1.0, ram_node=False, free_bytes=64 * GiB)
    ram = NodeInfo("ffee0011aabbccdd", "10.0.0.2", gpus=0.0, ram_node=True, free_bytes=64 * GiB)
    arch = PRESETS["tiny-llama"]
    stores = []
    for on_gpu_node in (True, False):
        config = config_from_dict({"model": {"preset": "tiny-llama"}, "runtime": {"store_on_gpu_node": on_gpu_node}})
        lines = plan_placement(arch, config, [gpu, ram], gpu.node_id).describe(arch).splitlines()
        assert lines[1].startswith("executor on node 10.0.0.1 (a1b2c3d4), GPUs there: 1;"), lines[1]
        stores += [line for line in lines if line.startswith("store on")]
    assert stores[0].startswith("store on 10.0.0.1 (a1b2c3d4, the GPU node): "), stores
    assert stores[-1].startswith("store on 10.0.0.2 (ffee0011, RAM node): "), stores


def what_if(host_gib: float, gbps: float, ram_nodes=()) -> str:
    from megatrain_ray.models.registry import model_arch
    from megatrain_ray.planning.whatif import ClusterSpec, GpuNodeSpec, RamNodeSpec, plan_cluster

    config = config_from_dict({"model": {"preset": "qwen2.5-7b"}, "data": {"seq_len": 4096},
                               "train": {"grad_accum": 4}})
    spec = ClusterSpec(GpuNodeSpec("H100 80GB", 78, host_gib, gbps), tuple(RamNodeSpec(200, gbps) for _ in ram_nodes))
    text, fits = plan_cluster(model_arch(config.model), config, spec, [gbps])
    assert fits, text
    return text


def test_a_described_cluster_names_the_gpu_node_once_and_says_what_hides_its_traffic():
    import re

    alone = what_if(120, 10)
    assert "executor on node gpu-node, GPUs there: 1;" in alone and "()" not in alone
    assert "store on gpu-node (the GPU node): layers 0-29" in alone
    assert "per node and step" not in alone  # nothing crosses a network: no traffic to tell
    for gbps in (1, 400):
        text = what_if(40, gbps, ram_nodes=[200])
        traffic = text[text.index("per node and step"):text.index("device memory")].splitlines()[1:]
        assert [line.split(":")[0] for line in traffic] == [
            "  gpu-node (GPU node; its own store's layers through shared memory)", "  ram-node-1"]
        for line in traffic:
            if gbps == 1:
                need, link = map(float, re.search(r"not hidden: within the step's [\d.]+ s of compute \(the weights "
                                                  r"before the forward within its quarter\) they need ([\d.]+) Gbit/s, "
                                                  r"its link has ([\d.]+) Gbit/s", line).groups())
                assert need > link == 1
            else:
                need, link = map(float, re.search(r"hidden behind the step's [\d.]+ s of compute: that takes "
                                                  r"([\d.]+) Gbit/s of its ([\d.]+) Gbit/s link", line).groups())
                assert need <= link == 400
