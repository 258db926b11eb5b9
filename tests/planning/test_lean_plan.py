"""The placement and the what-if plan count the optimizer state mode's bytes per parameter, and the
plan says how large a model each mode holds on the machine at hand."""

import re
from pathlib import Path

import pytest

from megatrain_ray.config import ConfigError, load_config
from megatrain_ray.host import precision
from megatrain_ray.models.registry import model_arch, num_params
from megatrain_ray.planning.whatif import GPU_NODE, cluster_nodes, load_cluster, plan_cluster
from megatrain_ray.planning.placement import plan_placement

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
GiB = 1024**3
MODES = {"14": ("fp32", "fp32"), "10": ("fp32", "bf16"), "8": ("fp32", "int8"), "6": ("bf16", "int8")}


def config_in(mode: str, path: str = "qwen2.5-14b-lean.yaml"):
    master, moments = MODES[mode]
    return load_config(EXAMPLES / path, [f"optim.master={master}", f"optim.moments={moments}"])


@pytest.mark.parametrize("mode", MODES)
def test_placement_counts_the_modes_bytes(mode):
    config = config_in(mode)
    arch = model_arch(config.model)
    nodes = cluster_nodes(load_cluster(EXAMPLES / "cluster-h100-128g.yaml"))
    bpp = int(mode) + (8 / precision.QUANT_BLOCK if MODES[mode][1] == "int8" else 0)
    if mode != "6":  # Qwen2.5-14B's 14.8 B params: 193, 138 and 110 GiB against 106 usable; 6 bytes: 83
        with pytest.raises(ConfigError, match=r"short by \d+\.\d GiB"):
            plan_placement(arch, config, nodes, GPU_NODE)
        return
    placement = plan_placement(arch, config, nodes, GPU_NODE)
    assert placement.bytes_per_param == bpp
    held = sum(s.host_bytes for s in placement.stores)
    assert abs(held - num_params(arch) * bpp) <= len(placement.stores)  # each store's bytes rounded down


def test_the_plan_prints_the_largest_model_per_mode_on_one_h200_with_1_5_tb():
    spec = load_cluster(EXAMPLES / "cluster-h200-1.5tb.yaml")
    config = load_config(EXAMPLES / "dense-220b.yaml")
    text, fits = plan_cluster(model_arch(config.model), config, spec, [100.0])
    modes = re.findall(r"^  (optim\.name=muon )?optim\.master=\S+ optim\.moments=\S+: (\d+(?:\.\d+)?) bytes/param "
                       r"-> (\d+\.\d) B params", text, re.M)
    largest = {float(bpp): float(b) for muon, bpp, b in modes if not muon}
    assert sorted(largest) == [6.031, 8.031, 10.0, 14.0]  # with the int8 scales, printed to 4 digits
    muon = {float(bpp): float(b) for muon, bpp, b in modes if muon}  # a block matrix's bytes: 10, 8, 6
    assert largest[6.031] >= 200 and largest[14.0] < 100  # the 1,390 GiB free: 90% of it, less the worker's 2 GiB
    usable = (0.9 * 1390 - 2) * GiB
    for bpp, b in zip((6.03125, 8.03125, 10.0, 14.0), (largest[k] for k in sorted(largest)), strict=True):
        assert b == pytest.approx(usable / bpp / 1e9, abs=0.05)
    assert sorted(muon) == [6.0, 8.0, 10.0]
    for bpp, b in muon.items():
        assert b == pytest.approx(usable / bpp / 1e9, abs=0.05)
    assert fits, text
    exact = config_in("14", "dense-220b.yaml")
    text, fits = plan_cluster(model_arch(exact.model), exact, spec, [100.0])
    assert not fits and "short by" in text and "optim.moments: int8" in text
