"""The plan with a disk tier (runtime.disk_dir), without a cluster: which layers' optimizer state go
to disk when RAM is short and what RAM then holds, the refusals with their figures, the disk's term
in the predicted step and the tokens that hide it, the largest model per mode, and
`megatrain-ray plan --cluster` with a node's disk_gib and disk_gbps."""

import subprocess
import sys

import pytest

from megatrain_ray.config import ConfigError, config_from_dict
import torch

from megatrain_ray.host.disk import aligned, compute_bytes, compute_window_bytes, disk_bytes, layer_parts, window_bytes
from megatrain_ray.host.memory import dtype_of
from megatrain_ray.host.precision import format_of
from megatrain_ray.host.store import layer_bytes
from megatrain_ray.models.registry import PRESETS, model_layouts
from megatrain_ray.planning.placement import NodeInfo, largest_models, plan_placement, store_room
from megatrain_ray.planning.prediction import predict_step
from megatrain_ray.planning.report import describe
from megatrain_ray.planning.step_plan import DeviceFacts, plan_step
from megatrain_ray.planning.traffic import step_traffic

GiB = 1024**3
SEVEN_B = PRESETS["qwen2.5-7b"]


def config(optim=None, **runtime):
    return config_from_dict({
        "model": {"preset": "qwen2.5-7b"}, "data": {"seq_len": 4096},
        "optim": optim or {}, "train": {"micro_batch_size": 1, "grad_accum": 8},
        "runtime": {"disk_dir": "/nvme/tier", **runtime},
    })


def node(ram_gib: float, disk_gib: float | None = 1000.0, gbs: float | None = 3.0) -> NodeInfo:
    return NodeInfo("gpu", "10.0.0.1", 1.0, False, int(ram_gib * GiB), disk_bytes=None if disk_gib is None else int(disk_gib * GiB),
                    disk_read_gbs=gbs, disk_write_gbs=gbs)


def ram_of(plan, cfg) -> float:
    """What the store's RAM holds, counted from the layouts: all its layers' state, less what is on disk, plus the window."""
    layouts, fmt = model_layouts(SEVEN_B), format_of(cfg.optim)
    held = sum(layer_bytes(layouts[i], dtype_of(cfg.model.compute_dtype), fmt) for i in plan.layers)
    cold = sum(p.nbytes for i in plan.disk_layers for p in layer_parts(layouts[i], fmt))
    return held - cold + window_bytes([layouts[i] for i in plan.disk_layers], fmt)


@pytest.mark.parametrize("optim", [{}, {"master": "bf16", "moments": "int8"}])
def test_the_state_ram_cannot_hold_goes_to_disk_and_no_more(optim):
    """The 7B (7.6 B params): 106 GiB at 14 bytes, 43 GiB at 6; a store that may take 60 (exact) or
    36 GiB (6 bytes) keeps the rest of the optimizer state on disk, the fewest layers that fit."""
    cap = 60 if not optim else 36
    cfg = config(optim, store_memory_gib=cap)
    store, = plan_placement(SEVEN_B, cfg, [node(512)], "gpu").stores
    assert store.disk_layers and len(store.disk_layers) < len(store.layers)
    assert store.host_bytes == pytest.approx(ram_of(store, cfg), abs=1) and store.host_bytes <= cap * GiB
    layouts, fmt = model_layouts(SEVEN_B), format_of(cfg.optim)
    one_less = store.disk_layers[1:]  # a layer fewer on disk would not fit
    assert ram_of(store.__class__(store.node, store.layers, 0, disk_layers=one_less), cfg) > cap * GiB
    assert store.disk_bytes == sum(disk_bytes(layouts[i], fmt) for i in store.disk_layers)
    if not optim:
        assert 0 not in store.disk_layers  # the exact mode's embedding may step on the GPU
    roomy, = plan_placement(SEVEN_B, config(optim, store_memory_gib=200), [node(512)], "gpu").stores
    assert roomy.disk_layers == ()  # RAM holds it all: nothing on disk


def test_a_run_the_disk_cannot_hold_is_refused_with_the_figure():
    with pytest.raises(ConfigError, match=r"the disk tier needs 4\d\.\d GiB under runtime.disk_dir=/nvme/tier .* but "
                                          r"10\.0 GiB is free there: short by"):
        plan_placement(SEVEN_B, config(store_memory_gib=60), [node(512, disk_gib=10)], "gpu")
    with pytest.raises(ConfigError, match=r"needs 2\d\.\d GiB of RAM even with the optimizer state of every layer "
                                          r"but the embedding on disk, and the compute copy of every layer but the "
                                          r"embedding .* may take 10\.0 GiB"):
        plan_placement(SEVEN_B, config(store_memory_gib=10), [node(512)], "gpu")
    with pytest.raises(ConfigError, match=r"the model needs 99.3 GiB .* keep the optimizer state of some layers on a local SSD \(runtime.disk_dir\)"):  # no tier: refused as before
        plan_placement(SEVEN_B, config(store_memory_gib=60, disk_dir=None), [node(512)], "gpu")


def test_where_ram_is_still_short_some_layers_go_fully_to_disk_and_no_more():
    """The 7B in the 6-byte mode under 20 GiB: 4 bytes a parameter stay in RAM with only the optimizer
    state on disk (28 GiB: refused before); the compute copies (and gradient buffers) of the fewest
    layers go to disk too, and the disk's bytes a step count their reads for the forward and the
    backward. A disk too small for it all is refused with the figure."""
    cfg = config({"master": "bf16", "moments": "int8"}, store_memory_gib=20)
    store, = plan_placement(SEVEN_B, cfg, [node(512)], "gpu").stores
    layouts, fmt, dtype = model_layouts(SEVEN_B), format_of(cfg.optim), torch.bfloat16
    fully = store.disk_compute_layers
    assert fully and set(fully) < set(store.disk_layers) and 0 not in fully
    compute_ram = sum(compute_bytes(layouts[i], fmt, dtype) for i in fully)
    window = compute_window_bytes([layouts[i] for i in fully], fmt, dtype)
    assert store.host_bytes == pytest.approx(ram_of(store, cfg) - compute_ram + window, abs=1)
    assert store.host_bytes <= 20 * GiB < ram_of(store, cfg) - compute_ram + window + compute_bytes(layouts[fully[0]], fmt, dtype)
    hot = sum(layouts[i].numel * 4 for i in fully)  # a bf16 copy and its gradient buffer on disk
    assert store.disk_compute_bytes == pytest.approx(hot, rel=1e-3)
    assert store.disk_bytes == sum(disk_bytes(layouts[i], fmt) for i in store.disk_layers) + store.disk_compute_bytes
    sends = sum(aligned(layouts[i].numel * 2) for i in fully)  # a send reads the bf16 copy alone
    assert store.disk_send_bytes == sends
    # where the disk binds: the updates' bytes, the copies read once more and the files written once more
    assert store.disk_step_bytes() == (store.disk_bytes + sends, store.disk_bytes + store.disk_compute_bytes)
    placed = plan_placement(SEVEN_B, cfg, [node(512)], "gpu")
    assert placed.remote_layers() == list(fully)  # streamed over the store's link
    text = placed.describe(SEVEN_B)
    assert f"{len(fully)} layers streamed over its link" in text and "keep their compute copy there too" in text
    read, written = store.disk_step_bytes()
    assert f"{read / 1e9:.1f} GB read and {written / 1e9:.1f} GB written a step" in text
    need = store.disk_bytes / GiB
    with pytest.raises(ConfigError, match=rf"the disk tier needs {need:.1f} GiB under runtime.disk_dir=/nvme/tier .* "
                                          r"but 20\.0 GiB is free there"):
        plan_placement(SEVEN_B, cfg, [node(512, disk_gib=20)], "gpu")


def test_the_disk_is_a_term_of_the_predicted_step_with_the_tokens_that_hide_it():
    cfg = config(store_memory_gib=60)
    facts = DeviceFacts("cuda", "H100", 80 * GiB, 400 * GiB)
    step = plan_step(SEVEN_B, cfg, facts, plan_placement(SEVEN_B, cfg, [node(512, gbs=1.0)], "gpu"),
                     stores_allocated=False, refuse=False)
    store, = step.placement.stores
    disk_s = store.disk_bytes / 1e9 * 2  # read once and written once a step at 1 GB/s
    assert step.placement.disk_seconds() == pytest.approx(disk_s)
    traffic = step_traffic(SEVEN_B, cfg, step.placement, step.kept)
    assert traffic.optimizer_seconds() == pytest.approx(disk_s)  # slower than the AdamW: it bounds the term
    planned = step.planned_config(cfg)
    p = predict_step(SEVEN_B, planned, traffic.times(), traffic.optimizer_seconds(), kept=step.kept)
    assert p.bound == "host optimizer" and p.optimizer_s == pytest.approx(disk_s)
    text = describe(SEVEN_B, cfg, step, traffic.times(), traffic.optimizer_seconds())
    tokens = int(text.split("hidden from ")[1].split(" tokens")[0])
    assert tokens == pytest.approx(p.tokens * disk_s / p.forward_s, abs=1)
    hidden = planned.replace(train=planned.train.__class__(**{**planned.train.__dict__, "grad_accum": -(-tokens // 4096)}))
    q = predict_step(SEVEN_B, hidden, traffic.times(), traffic.optimizer_seconds(), kept=step.kept)
    assert q.optimizer_exposed_s == pytest.approx(0.0, abs=1e-6)  # at those tokens the disk is hidden
    placed = step.placement.describe(SEVEN_B)
    assert "disk tier (runtime.disk_dir):" in placed and "3.00 GB/s" not in placed and "1.00 GB/s read" in placed
    assert "a parameter there holds 2 bytes in RAM and 12 on disk" in placed


def test_the_largest_model_per_mode_counts_the_disk():
    cfg = config(store_memory_gib=64)
    text = largest_models(store_room(SEVEN_B, cfg, [node(512, disk_gib=200)], "gpu"), cfg)
    six = next(line for line in text.splitlines() if "master=bf16 optim.moments=int8" in line)
    # RAM and 200 GiB of disk hold the 6.03 bytes of all (the compute copies on disk too where RAM is short)
    assert six.endswith(f", {264 * GiB / 6.03125 / 1e9:.1f} B with the disk tier (200 GiB free)")
    without = largest_models(store_room(SEVEN_B, config(store_memory_gib=64, disk_dir=None), [node(512)], "gpu"),
                             config(store_memory_gib=64, disk_dir=None))
    assert "disk tier" not in without


def test_plan_cluster_reads_a_nodes_disk(tmp_path):
    (tmp_path / "home.yaml").write_text("gpu_node:\n  gpu: H200\n  gpu_memory_gib: 80\n  host_memory_gib: 64\n"
                                        "  disk_gib: 10\n  disk_gbps: 2.5\n")
    (tmp_path / "run.yaml").write_text("model: {preset: qwen2.5-7b}\ndata: {seq_len: 4096}\n"
                                       "train: {micro_batch_size: 1, grad_accum: 8}\n"
                                       f"runtime: {{disk_dir: {tmp_path / 'tier'}}}\n")
    out = subprocess.run([sys.executable, "-m", "megatrain_ray.cli", "plan", str(tmp_path / "run.yaml"), "--cluster",
                          str(tmp_path / "home.yaml")], capture_output=True, text=True)
    assert "with the disk tier (10 GiB free)" in out.stdout, out.stdout + out.stderr
    assert "the disk tier needs" in out.stdout and "but 10.0 GiB is free there" in out.stdout, out.stdout


def test_a_store_on_the_gpu_machine_leaves_room_for_parked_activations():
    """The 10 GB / 64 GiB desktop (examples/cluster-10g-64g.yaml) with the tier: the 7B in the 8-byte
    mode parks its activations in host memory, and the tier takes enough layers to leave it that room."""
    from pathlib import Path

    from megatrain_ray.config import load_config
    from megatrain_ray.planning.whatif import load_cluster, plan_cluster

    examples = Path(__file__).resolve().parents[2] / "examples"
    cfg = load_config(examples / "qwen2.5-7b-10g.yaml", ["runtime.disk_dir=/nvme/megatrain", "optim.master=fp32",
                                                          "optim.moments=int8"])
    text, fits = plan_cluster(PRESETS["qwen2.5-7b"], cfg, load_cluster(examples / "cluster-10g-64g.yaml"), [10.0])
    assert fits, text[-1500:]
    assert "boundary activations offloaded to host memory" in text and "disk tier (runtime.disk_dir):" in text
