"""`megatrain-ray bench` on the CPU: a sweep of step shapes on one set of stores, and its JSON."""

import argparse
import json
import os

import pytest

from megatrain_ray.bench.arguments import add_arguments
from megatrain_ray.bench.run import bench_config, disk_line, disk_summary, shapes_from
from megatrain_ray.cli import main
from megatrain_ray.bench.workload import Shape
from megatrain_ray.streaming.layer_order import layer_order
from megatrain_ray.models.registry import PRESETS, model_layouts
from megatrain_ray.host.window import fetches_per_step, window_bytes
from helpers.runs import command_here


def parse(*argv: str):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_shapes_pair_position_by_position_and_broadcast_single_values():
    shapes = shapes_from(parse("--seq-len", "1024", "4096", "--micro-batch", "4", "1", "--grad-accum", "16"))
    assert shapes == [Shape(1024, 4, 16), Shape(4096, 1, 16)]
    assert [s.tokens for s in shapes] == [65536, 65536]
    kept = shapes_from(parse("--seq-len", "1024", "--grad-accum", "8", "--keep-graphs", "0", "auto"))
    assert kept == [Shape(1024, 1, 8, 0), Shape(1024, 1, 8, None)]
    with pytest.raises(SystemExit):
        parse("--keep-graphs", "some")


def test_the_optimizer_flag_sets_optim_name():
    assert bench_config(parse(), Shape(64, 1, 1)).optim.name == "adamw"
    assert bench_config(parse("--optimizer", "muon"), Shape(64, 1, 1)).optim.name == "muon"


def test_shapes_of_different_lengths_are_refused():
    with pytest.raises(ValueError, match="same number of values"):
        shapes_from(parse("--seq-len", "64", "128", "256", "--micro-batch", "1", "2"))


def steps_rate(timed: list[dict]) -> float:
    """Tokens per second of the timed steps' own seconds: the run's rate, whose clock also holds
    the driver's time between them, cannot be higher."""
    return sum(s["tokens"] for s in timed) / sum(s["seconds"] for s in timed)


@pytest.fixture
def bench(capsys, monkeypatch, ray_head):
    """`megatrain-ray bench ARGS` through the command's entry in this process (a Python started for
    each would import torch and the package again: seconds on 2 cores), joining the test session's
    Ray head (conftest's joining_env says why without token authentication): its exit status and
    what it printed. This process leaves Ray again after each."""
    monkeypatch.setenv("RAY_ADDRESS", ray_head)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    return lambda *args: command_here(["bench", *args], capsys)


def test_a_sweep_reuses_the_stores_and_reports_every_shape(tmp_path, bench):
    out = tmp_path / "bench.json"
    proc = bench("--model", "tiny-qwen2", "--device", "cpu", "--seq-len", "32", "64", "--micro-batch", "2", "1",
                 "--grad-accum", "2", "3", "--steps", "2", "--warmup", "1", "--optimizer-threads", "1",
                 "--keep-graphs", "1", "auto", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count("init ") == 1, "the host state was built more than once"
    written = json.loads(out.read_text())
    assert "incomplete" not in written, "the JSON written after each shape was not replaced at the end"
    runs = written["runs"]
    assert [r["shape"] for r in runs] == [{"seq_len": 32, "micro_batch": 2, "grad_accum": 2, "keep_graphs": 1},
                                          {"seq_len": 64, "micro_batch": 1, "grad_accum": 3, "keep_graphs": None}]
    assert "kept forward graphs: the last 1 of 2 blocks" in proc.stdout, "the first shape's plan"
    assert proc.stdout.count("every layer recomputes its forward") == 1, "auto keeps none on the CPU"
    for run, tokens in zip(runs, (128, 192), strict=True):
        timed = [s for s in run["steps"] if not s["warmup"]]
        assert len(timed) == 2 and all(s["tokens"] == tokens and s["finite"] for s in timed)
        assert run["median"]["tokens_per_s"] <= steps_rate(timed), "the rate's window holds every timed step"
        assert run["median"]["optimizer_gparams_per_s"] > 0, "the stores' optimizer time reached the report"
    assert "| megatrain-ray | 1 | 64 | 1 x 3 |" in proc.stdout
    assert "| megatrain-ray, 1 kept | 1 | 32 | 2 x 2 |" in proc.stdout
    assert [r["median"]["kept_graphs"] for r in runs] == [1, 0]
    assert all(r["median"]["bound"] in ("compute", "PCIe", "host optimizer") for r in runs)
    # on the CPU: said, and no GPU's figure (MFU against a GPU's peak, a prediction on its rates)
    assert "bench is timing the CPU" in proc.stdout
    assert "MFU" not in "".join(line for line in proc.stdout.splitlines() if line.startswith("step "))
    assert all(r["median"]["mfu"] is None and r["median"]["predicted"] is None for r in runs)
    assert "predicted step on" not in proc.stdout and "- (no GPU) |" in proc.stdout


def test_baselines_run_once_per_split_and_serve_shapes_that_differ_only_in_kept_graphs(tmp_path, bench):
    """--keep-graphs 0 1 on one step shape: the plain baseline runs at each of its two splits once,
    and both of our rows are compared with the same best."""
    out = tmp_path / "bench.json"
    proc = bench("--model", "tiny-qwen2", "--device", "cpu", "--seq-len", "32", "--micro-batch", "1",
                 "--grad-accum", "2", "--keep-graphs", "0", "1", "--steps", "1", "--warmup", "0",
                 "--optimizer-threads", "1", "--baseline", "plain", "--baseline-splits", "1x2,2x1", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.count("baseline plain: starting a fresh process") == 2
    runs = json.loads(out.read_text())["runs"]
    assert runs[0]["baselines"] == runs[1]["baselines"] and runs[0]["baselines"][0]["status"] == "ok"
    tried = runs[0]["baselines"][0]["config"]["tried"]
    assert [(t["micro_batch"], t["grad_accum"]) for t in tried] == [(1, 2), (2, 1)]
    assert all("baseline_splits_done" not in r for r in runs)


@pytest.mark.parametrize("model, layers", [("tiny-gemma3", ["1", "2"]), ("tiny-phi3", ["2"])])
def test_parts_times_each_named_layer_of_a_family(model, layers):
    """--parts runs the family's block with the layer's own context (Gemma 3: a sliding-window
    layer, then a global one) and the host AdamW."""
    from megatrain_ray.bench.parts import bench_parts
    from megatrain_ray.models.registry import PRESETS

    args = parse("--model", model, "--device", "cpu", "--compute-dtype", "float32", "--parts",
                 "--seq-len", "32", "--parts-layers", *layers, "--optimizer-threads", "1")
    out = bench_parts(PRESETS[model], args, shapes_from(args)[0])
    assert sorted(out["layers"]) == sorted(map(int, layers))
    assert out["layer_fwd_bwd_eager_tflops"] == out["layers"][int(layers[0])]["layer_fwd_bwd_eager_tflops"]
    rates = out["host_adamw_one_pass_gparams_per_s"]
    assert out["host_adamw_one_pass_best"] == {"gparams_per_s": max(rates.values()), "threads": max(rates, key=rates.get)}


def test_parts_times_the_host_adamw_both_ways_per_thread_count(tmp_path, bench):
    out = tmp_path / "parts.json"
    proc = bench("--model", "tiny-qwen2", "--device", "cpu", "--parts", "--seq-len", "16", "--optimizer-threads", "1",
                 "2", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    parts = json.loads(out.read_text())
    assert parts["host_adamw_kernel"] == "one pass"
    threads = {str(t) for t in (1, 2) if t <= (os.cpu_count() or 1)}
    for way in ("one_pass", "torch_three_pass"):
        rates = parts[f"host_adamw_{way}_gparams_per_s"]
        assert set(rates) == threads
        best = parts[f"host_adamw_{way}_best"]
        assert rates[str(best["threads"])] == best["gparams_per_s"] == max(rates.values())
    modes = parts["host_adamw_modes"]  # the one pass in each optimizer state mode (--optim-modes)
    assert {m: round(modes[m]["bytes_per_param"]) for m in modes} == {"fp32/fp32": 14, "fp32/bf16": 10,
                                                                      "fp32/int8": 8, "bf16/int8": 6}
    assert all(modes[m]["gparams_per_s"] > 0 and str(modes[m]["threads"]) in threads for m in modes)


def test_several_optimizer_thread_counts_need_parts(capsys):
    code = main(["bench", "--model", "tiny-qwen2", "--device", "cpu", "--optimizer-threads", "1", "2"])
    assert code == 2 and "several only with --parts" in capsys.readouterr().err


def test_baseline_splits_keep_the_tokens_of_the_step():
    from megatrain_ray.bench.run import baseline_splits

    shape = Shape(4096, 1, 16)
    assert baseline_splits("same", shape) == [(1, 16)]
    assert baseline_splits("best", shape) == [(1, 16), (2, 8), (4, 4), (8, 2), (16, 1)]
    assert baseline_splits("1x16,4x4", shape) == [(1, 16), (4, 4)]
    with pytest.raises(ValueError, match="65536 tokens"):
        baseline_splits("2x16", shape)


def test_bench_with_every_layer_on_a_ram_node_raylet(tmp_path, capsys, monkeypatch):
    """--ram-nodes 1: a head and a RAM-node raylet of this machine, the stores on the raylet, the
    layers over the TCP transport; the cluster is gone afterwards. Through the command's entry in
    this process, as the fixture above (a cluster of its own, not the session's head: this process
    is not connected to Ray between tests)."""
    out = tmp_path / "bench.json"
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    args = ["bench", "--model", "tiny-qwen2", "--layers", "6", "--device", "cpu", "--seq-len", "32", "--micro-batch",
            "2", "--grad-accum", "2", "--steps", "2", "--warmup", "1", "--optimizer-threads", "1", "--ram-nodes", "1",
            "--remote-window", "3", "--json", str(out)]
    proc = command_here(args, capsys)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "streamed over TCP" in proc.stdout and "shared memory" not in proc.stdout, proc.stdout[-3000:]
    run = json.loads(out.read_text())["runs"][0]
    median = run["median"]
    arch = PRESETS["tiny-qwen2"].replace(num_layers=6)
    numels = {layout.index: layout.numel for layout in model_layouts(arch)}
    fetched = fetches_per_step(numels, layer_order(arch), 3)  # 3 of the 6 blocks stay over the turn
    assert median["remote_gb_in_per_step"] * 1e9 == pytest.approx(sum(2 * numels[i] * fetched[i] for i in numels))
    assert median["remote_gb_out_per_step"] * 1e9 == pytest.approx(2 * sum(numels.values()))
    assert median["remote_window_gib"] * 2**30 == window_bytes(list(numels.values()), 3, 2)
    assert median["tokens_per_s"] <= steps_rate([s for s in run["steps"] if not s["warmup"]])
    [store] = median["optimizer_per_store"]
    assert store["ram_node"] and store["threads"] == 1 and store["params"] == sum(numels.values())
    assert store["gparams_per_s"] * 1e9 * store["seconds"] == pytest.approx(store["params"])


def test_raylets_of_the_benchmark_share_the_cores_a_store_on_the_gpu_node_would_take():
    """--ram-nodes N: the head keeps one core and one per GPU, each raylet an even share of the rest
    and one core for its links, so the raylets' stores run as many AdamW threads as one local store."""
    from megatrain_ray.bench.ram_nodes import raylet_cpus

    assert raylet_cpus(32, 1, 2) == (2, 16)  # two stores of 15 threads: the local store's 30
    assert raylet_cpus(16, 1, 2) == (2, 8)
    assert raylet_cpus(16, 1, 1) == (2, 15)
    assert raylet_cpus(2, 0, 1) == (1, 2)


def test_two_workers_and_stated_host_memory_and_a_shape_that_does_not_split(tmp_path, bench):
    """--num-gpus 2 on the CPU path (gloo); a shape whose micro-batches do not split over the two
    workers is refused and the sweep goes on; --store-memory-gib sizes the placement."""
    out = tmp_path / "bench.json"
    proc = bench("--model", "tiny-qwen2", "--device", "cpu", "--num-gpus", "2", "--store-memory-gib", "1.5",
                 "--seq-len", "32", "--grad-accum", "4", "3", "2", "--steps", "1", "--warmup", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "of 1.5 GiB stated (runtime.store_memory_gib)" in proc.stdout
    assert "2 CPU worker(s), data parallel" in proc.stdout
    runs = json.loads(out.read_text())["runs"]
    assert [r["median"]["num_gpus"] for r in (runs[0], runs[2])] == [2, 2]
    assert "train.grad_accum=3" in runs[1]["refused"]
    assert [s["tokens"] for s in runs[0]["steps"]] == [128, 128]
    assert runs[0]["median"]["predicted"] is None  # the CPU path: no GPU's rates to predict with


def test_bench_with_a_disk_tier_reports_what_it_moved(tmp_path, bench):
    """--disk-dir with a stated store memory that the model does not fit: the plan's disk line, and
    the tier's bytes a step and the stores' wait for its reads in the report."""
    out = tmp_path / "bench.json"
    proc = bench("--model", "tiny-llama", "--layers", "12", "--device", "cpu", "--compute-dtype", "float32",
                 "--embedding-step", "host", "--store-memory-gib", str(5.5e6 / 2**30), "--disk-dir", str(tmp_path / "tier"),
                 "--seq-len", "16", "--grad-accum", "2", "--steps", "2", "--warmup", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "disk tier (runtime.disk_dir):" in proc.stdout and "GB/s read" in proc.stdout
    disk = json.loads(out.read_text())["runs"][0]["median"]["disk"]
    assert disk["file_gib"] > 0
    # the last step's reads and writes (the first weights' left out) are the plan's bytes, exactly
    assert disk["read_gb_per_step"] == disk["written_gb_per_step"] == disk["plan_read_gb_per_step"] > 0
    # none fully on disk: a step's disk traffic is its updates', once each way
    assert disk["plan_written_gb_per_step"] == disk["plan_read_gb_per_step"]
    assert "disk tier: " in proc.stdout and " a step for reads" in proc.stdout


def test_the_disk_line_sets_a_whole_steps_bytes_beside_the_plans_whole_step():
    """The stores' per-step counters cover a whole step (host/disk.py, step_bytes: one step's updates
    and the next step's sends and gradients), which the line sets beside the plan's whole step, each way."""
    stats = [{"step_read_bytes": 80.1e9, "step_written_bytes": 54.0e9, "read_wait_s": 123.6, "file_bytes": 35e9,
              "window_bytes": 6e9, "direct_io": True}]
    d = disk_summary(stats, 2, 67.2, (93.8e9, 54.6e9))
    assert (d["read_gb_per_step"], d["written_gb_per_step"]) == pytest.approx((80.1, 54.0))
    assert (d["plan_read_gb_per_step"], d["plan_written_gb_per_step"]) == pytest.approx((93.8, 54.6))
    assert d["read_wait_s_per_step"] == 61.8
    line = disk_line(d)
    assert "80.1 GB read and 54.0 GB written a step (plan: 93.8 and 54.6 GB; 2.00 GB/s over the step's time)" in line
    assert "updates" not in line
