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
