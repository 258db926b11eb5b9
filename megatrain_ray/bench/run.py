"""`megatrain-ray bench`: throughput of the streaming trainer through the real Ray path, one step
shape or a sweep of them on one set of stores, on one GPU or several (--num-gpus, data parallel),
and (--parts) the two ceilings a step is built from."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
import time
from pathlib import Path

from megatrain_ray.bench.parts import bench_parts
from megatrain_ray.bench.ram_nodes import local_ram_nodes
from megatrain_ray.bench.workload import Shape, matmul_params, model_flops_per_token, random_micro_batches
from megatrain_ray.config import ConfigError, config_from_dict
from megatrain_ray.host.memory import process_age
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.registry import model_arch, num_params
from megatrain_ray.planning.memory import PlanError
from megatrain_ray.planning.prediction import HOST_ADAMW_PARAMS_PER_S, predict_step
from megatrain_ray.planning.report import describe

NO_GPU = ("the executor runs on the CPU (no GPU, or --device cpu): bench is timing the CPU, the same schedule; "
          "no GPU figure is quoted: no MFU (unless --peak-tflops), no step time on a GPU's rates")


def shapes_from(args) -> list[Shape]:
    """Pair the lists position by position; a list of one applies to every position."""
    lists = [args.seq_len, args.micro_batch, args.grad_accum, args.keep_graphs]
    n = max(len(v) for v in lists)
    if any(len(v) not in (1, n) for v in lists):
        raise ValueError("--seq-len, --micro-batch, --grad-accum and --keep-graphs take one value each, or the same "
                         "number of values")
    shapes = [Shape(*(v[i] if len(v) > 1 else v[0] for v in lists)) for i in range(n)]
    if any(min(s.seq_len, s.micro_batch, s.grad_accum) < 1 for s in shapes):
        raise ValueError("bench needs positive --seq-len, --micro-batch and --grad-accum")
    return shapes


def baseline_splits(spec: str, shape: Shape) -> list[tuple[int, int]]:
    """--baseline-splits as (micro_batch, grad_accum) pairs of the shape's tokens per step."""
    from megatrain_ray.bench.baseline_process import splits_for

    if spec == "same":
        return [(shape.micro_batch, shape.grad_accum)]
    if spec == "best":
        return splits_for(shape.tokens, shape.seq_len)
    try:
        pairs = [tuple(int(v) for v in item.lower().split("x")) for item in spec.split(",")]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 or p[0] * p[1] * shape.seq_len != shape.tokens for p in pairs):
        raise ValueError(f"--baseline-splits {spec!r}: give same, best or MBxGA pairs whose product times "
                         f"--seq-len is the step's {shape.tokens} tokens")
    return pairs


def loss_chunk(args) -> int | None:
    """--loss-chunk-tokens, or the benchmark's (as its baselines'); with --gpu-memory-gib the plan's choice (null)."""
    from megatrain_ray.bench.baselines import LOSS_CHUNK_TOKENS

    if args.loss_chunk_tokens is not None or args.gpu_memory_gib is not None:
        return args.loss_chunk_tokens
    return LOSS_CHUNK_TOKENS


def bench_config(args, shape: Shape):
    """The run's config, the model it trains included (--model, --layers)."""
    overrides = {"num_layers": args.layers} if args.layers else {}
    master, moments = (args.optim_modes or ["fp32/fp32"])[0].split("/")
    return config_from_dict({
        "model": {"preset": args.model, "path": getattr(args, "weights", None), "compute_dtype": args.compute_dtype,
                  "overrides": overrides,
                  "implementation": getattr(args, "implementation", "auto")},
        "optim": {"lr": 1e-5, "warmup_steps": 0, "master": master, "moments": moments,
                  "name": getattr(args, "optimizer", "adamw")},
        "train": {"steps": args.warmup + args.steps, "micro_batch_size": shape.micro_batch,
                  "grad_accum": shape.grad_accum},
        "executor": {"device": args.device, "num_slots": args.num_slots, "loss_chunk_tokens": loss_chunk(args),
                     "gpu_memory_gib": args.gpu_memory_gib,
                     "offload_activations": args.offload_activations, "compile": not args.no_compile,
                     "keep_graphs": shape.keep_graphs, "embedding_step": args.embedding_step},
        "runtime": {"object_store_memory": 2 * 1024**3,
                    "optimizer_threads": args.optimizer_threads[0] if args.optimizer_threads else None,
                    "store_on_gpu_node": not args.ram_nodes, "remote_window": args.remote_window,
                    "transport_streams": args.transport_streams, "transport_piece_mib": args.transport_piece_mib,
                    "num_gpus": args.num_gpus, "store_memory_gib": args.store_memory_gib,
                    "disk_dir": getattr(args, "disk_dir", None)},
        "data": {"seq_len": shape.seq_len},
    })


def run_streaming(arch: ModelArch, args, shapes: list[Shape], on_shape=lambda runs: None) -> list[dict]:
    """Every shape on one set of stores: the host state is built (and registered) once. `on_shape`
    sees the results so far after each shape, so a sweep cut short keeps what it measured."""
    from megatrain_ray.bench.telemetry import ProbedStore, ProbedWorker
    from megatrain_ray.runtime.cluster import connect
    from megatrain_ray.runtime.session import Session

    config = bench_config(args, shapes[0])
    timeline = {"imports": process_age()}
    with contextlib.ExitStack() as stack:
        if args.ram_nodes:
            stack.enter_context(local_ram_nodes(args.ram_nodes))
        connect(config.runtime)
        timeline["Ray"] = process_age()
        session = Session(config, arch, worker_class=ProbedWorker, store_class=ProbedStore)
        return run_shapes(arch, args, shapes, session, on_shape, timeline)


def run_shapes(arch: ModelArch, args, shapes: list[Shape], session, on_shape,
               timeline: dict[str, float] | None = None) -> list[dict]:
    import ray

    from megatrain_ray.bench.telemetry import Probe

    probe = Probe(session)
    print(session.placement.describe(arch), flush=True)
    try:
        rates = probe.rates()
        print(f"step-time rates: {rates.describe()}" if rates else NO_GPU, flush=True)
        t0 = time.perf_counter()
        session.init_weights(wait=False)  # the stores fill their layers while the workers build
        device = session.start_executor()  # a first shape that cannot fit raised its PlanError in Session
        t2 = time.perf_counter()
        weights = (f"{session.marks['weights'] - t0:.1f} s" if "weights" in session.marks
                   else "still filling: the first step reads each layer as it lands")
        print(f"executor device: {device}; init {t2 - t0:.1f} s (side by side: the stores' weights {weights}, "
              f"the workers' build {session.marks['workers built'] - t0:.1f} s)", flush=True)
        results = []
        for i, shape in enumerate(shapes):
            print(f"-- {shape}", flush=True)
            row = {"shape": dataclasses.asdict(shape), "device": device, "num_gpus": session.placement.num_gpus}
            try:
                if i > 0:
                    probe.reconfigure(bench_config(args, shape))
            except (ray.exceptions.RayTaskError, ConfigError, PlanError) as e:
                cause = getattr(e, "cause", e)
                if not isinstance(cause, (PlanError, ConfigError)):
                    raise
                print(f"refused: {cause}", flush=True)  # a sweep goes on past a shape that does not fit
                results.append({**row, "refused": str(cause)})
                continue
            results.append({**row, **time_shape(session, probe, arch, args, shape, rates,
                                                None if i else {**(timeline or {}), **session.start_timeline(process_age())})})
            on_shape(results)
        return results
    finally:
        session.close()


def time_shape(session, probe, arch: ModelArch, args, shape: Shape, rates=None, timeline: dict | None = None) -> dict:
    """Steady state: each timed step starts while the previous step's optimizer still runs, as in
    a long run; the window closes when the last step returns (its optimizer would overlap the next
    step), and the drain that follows is reported on its own. `rates`: the GPU's (planning/rates.py);
    None on the CPU: no prediction, no MFU unless --peak-tflops."""
    from megatrain_ray.host.memory import available_memory

    flops_tok = model_flops_per_token(arch, shape.seq_len)
    gpus = session.placement.num_gpus
    one = args.peak_tflops or (rates.matmul_flops_per_s / 1e12 if rates else None)
    peak = one * gpus if one else None
    kept, planned = session.plan.kept, session.arch
    planned_config = session.plan.planned_config(session.config)
    disk_s = session.placement.disk_seconds()  # the disk tier's reads and writes beside the host optimizer
    planned_optimizer_s = max(num_params(planned) / HOST_ADAMW_PARAMS_PER_S, disk_s) if disk_s else None
    predicted = (predict_step(planned, planned_config, optimizer_s=planned_optimizer_s, num_gpus=gpus, kept=kept, rates=rates)
                 if rates else None)
    print(f"plan:\n{describe(planned, session.config, session.plan, optimizer_s=planned_optimizer_s, rates=rates, no_prediction=None if rates else NO_GPU)}",
          flush=True)
    rows = []
    if timeline is None:  # a later shape: the last one's updates land and its counts go; the first has none,
        session.drain()  # and waiting now would wait for the layers still filling, and a store call for
        probe.optimizer_seconds()  # its moments' pages (ShardStore.fault_in_moments)
    probe.traffic()
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            t_timed = time.perf_counter()
        batch = random_micro_batches(arch, shape.seq_len, shape.micro_batch, shape.grad_accum, seed=step)
        if args.profile and step == args.warmup:
            r = probe.profile_step(batch, f"{args.profile}/seq{shape.seq_len}-mb{shape.micro_batch}")
        else:
            r = session.train_step(batch)
        row = step_row(r, flops_tok, peak)
        row["warmup"] = step < args.warmup
        row["driver_node_available_gib"] = available_memory() / 2**30  # no actor call: it would wait for the optimizer
        rows.append(row)
        print(format_row(step, row), flush=True)
        if timeline is not None and step == 0:
            timeline["first step"] = process_age()
            print(start_line(timeline), flush=True)
    wall = time.perf_counter() - t_timed
    t_drain = time.perf_counter()
    session.drain()
    drain_s = time.perf_counter() - t_drain
    per_store = probe.optimizer_seconds()
    optimizer_s = max(per_store)  # the stores step side by side
    timed = [r for r in rows if not r["warmup"]]
    summary = {k: statistics.median(r[k] for r in timed) for k in timed[0] if isinstance(timed[0][k], (int, float))}
    tokens = sum(r["tokens"] for r in timed)
    summary["tokens_per_s"] = tokens / wall
    summary["model_tflops"] = summary["tokens_per_s"] * flops_tok / 1e12
    summary["mfu"] = summary["model_tflops"] / peak if peak else None
    summary["num_gpus"] = gpus
    summary["kept_graphs"] = kept
    summary["predicted"] = dataclasses.asdict(predicted) if predicted else None
    summary["rates"] = rates.describe() if rates else "none: the CPU"
    summary["optimizer_s_per_step"] = optimizer_s / len(rows)
    summary["optimizer_gparams_per_s"] = num_params(arch) / summary["optimizer_s_per_step"] / 1e9
    summary["optimizer_per_store"] = store_rates(session, arch, [s / len(rows) for s in per_store])
    summary["bound"] = bound_by(summary)
    summary["start_timeline_s"] = timeline
    if timeline is not None:  # asked only now: a store call would wait behind the updates in its queue
        summary["first_weights_s"] = fills = probe.fill_seconds()
        print(fill_line(fills, session.config.model.path, arch), flush=True)
    summary["final_drain_s"] = drain_s
    summary["host_state_bytes"] = probe.host_state_bytes()
    summary["store_memory"] = probe.store_memory()
    bytes_in, bytes_out = probe.traffic()  # from other nodes' stores, all workers
    summary["remote_gb_in_per_step"] = bytes_in / len(rows) / 1e9
    summary["remote_gb_out_per_step"] = bytes_out / len(rows) / 1e9
    summary["remote_window_gib"] = probe.remote_host_bytes() / 2**30
    print(f"timed: {len(timed)} steps, {tokens} tokens in {wall:.2f} s; host optimizer {optimizer_s / len(rows):.2f} s "
          f"per step{' (the slowest store: they step side by side)' if len(per_store) > 1 else ''} ({summary['optimizer_gparams_per_s']:.2f} G params/s), overlapped with the next step where it "
          f"can be (the last step's took {drain_s:.2f} s more to drain, outside the window)", flush=True)
    if len(per_store) > 1 or bytes_in:
        print("host optimizer per store: " + "; ".join(describe_store_rate(r) for r in summary["optimizer_per_store"]),
              flush=True)
    disk = [d for d in probe.disk_stats() if d]
    if disk:
        stores = session.placement.stores
        planned = [store.disk_step_bytes() for store in stores]
        summary["disk"] = disk_summary(disk, len(rows), wall / len(timed),
                                       (sum(r for r, _ in planned), sum(w for _, w in planned)))
        print(disk_line(summary["disk"]), flush=True)
    if bytes_in:
        print(f"from RAM nodes: {summary['remote_gb_in_per_step']:.2f} GB of weights in and "
              f"{summary['remote_gb_out_per_step']:.2f} GB of gradients out per step, through a window of "
              f"{summary['remote_window_gib']:.2f} GiB on the GPU node", flush=True)
    return {"steps": rows, "median": summary}


def disk_summary(stats: list[dict], steps: int, step_s: float, planned: tuple[int, int]) -> dict:
    """The stores' disk tiers: the bytes each way of the last whole step (the counters' last two
    marks, host/disk.py `step_bytes`: one step's updates and the next step's sends and gradients), and
    the plan's for a whole step, `planned` (read, written: StorePlan.disk_step_bytes, as a step the
    disk binds moves them). Also the seconds a step the stores
    waited for reads over the steps run (the most any could add to a step), and the rate the tier
    moved a step's bytes at over the timed steps' wall time."""
    read = sum(d["step_read_bytes"] for d in stats)
    written = sum(d["step_written_bytes"] for d in stats)
    return {"read_gb_per_step": read / 1e9, "written_gb_per_step": written / 1e9,
            "plan_read_gb_per_step": planned[0] / 1e9, "plan_written_gb_per_step": planned[1] / 1e9,
            "read_wait_s_per_step": max(d["read_wait_s"] for d in stats) / steps,
            "file_gib": sum(d["file_bytes"] for d in stats) / 2**30,
            "window_gib": sum(d["window_bytes"] for d in stats) / 2**30,
            "direct_io": all(d["direct_io"] for d in stats), "gb_per_s_over_step": (read + written) / step_s / 1e9}


def disk_line(d: dict) -> str:
    return (f"disk tier: {d['file_gib']:.1f} GiB of files ({'O_DIRECT' if d['direct_io'] else 'buffered'}), a window "
            f"of {d['window_gib']:.2f} GiB; {d['read_gb_per_step']:.1f} GB read and {d['written_gb_per_step']:.1f} GB "
            f"written a step (plan: {d['plan_read_gb_per_step']:.1f} and {d['plan_written_gb_per_step']:.1f} GB; "
            f"{d['gb_per_s_over_step']:.2f} GB/s over the step's time); the stores waited "
            f"{d['read_wait_s_per_step']:.2f} s a step for reads")


def store_rates(session, arch: ModelArch, seconds_per_step: list[float]) -> list[dict]:
    """Each store's AdamW per step: its parameters, seconds, rate and threads (the placement's)."""
    from megatrain_ray.models.registry import model_layouts

    numels = [layout.numel for layout in model_layouts(arch)]
    rows = []
    for plan, seconds in zip(session.placement.stores, seconds_per_step):
        params = sum(numels[i] for i in plan.layers)
        rate = params / seconds if seconds > 0 else 0.0
        rows.append({"node": plan.node.ip, "ram_node": plan.node.ram_node, "params": params, "seconds": seconds,
                     "gparams_per_s": rate / 1e9, "threads": plan.threads,
                     "gparams_per_s_per_thread": rate / 1e9 / plan.threads if plan.threads else None})
    return rows


def describe_store_rate(row: dict) -> str:
    per = (f" on {row['threads']} thread{'s' if row['threads'] > 1 else ''} ({row['gparams_per_s_per_thread']:.3f} a thread)"
           if row["threads"] else "")
    return (f"{row['node']}{' (RAM node)' if row['ram_node'] else ''} {row['params'] / 1e9:.2f} B params in "
            f"{row['seconds']:.2f} s, {row['gparams_per_s']:.2f} G params/s{per}")


def start_line(timeline: dict[str, float]) -> str:
    """The run's start, each part with its own seconds, and the end of the first step counted from
    the command's start."""
    names = list(timeline)
    parts = [f"{names[0]} {timeline[names[0]]:.1f}"] + [f"{b} {max(0.0, timeline[b] - timeline[a]):.1f}"
                                                          for a, b in zip(names, names[1:])]
    began = max(t for what, t in timeline.items() if what != "first step")
    return (f"start-up: the first step began {began:.1f} s and ended {timeline['first step']:.1f} s after the command "
            f"started (seconds: {', '.join(parts)})")


def fill_line(seconds: list[float], path: str | None, arch: ModelArch) -> str:
    """How long the stores took to fill their first weights (side by side), and from model.path the
    rate of its files."""
    slowest = max(seconds)
    what = f"loaded from {path}" if path else "drawn at random"
    line = f"first weights {what}: {slowest:.1f} s (the slowest of {len(seconds)} store(s))"
    if path:
        files = list(Path(path).glob("*.safetensors"))
        nbytes = sum(f.stat().st_size for f in files)
        line += f", {nbytes / 1e9:.1f} GB in {len(files)} files: {nbytes / 1e9 / max(slowest, 1e-9):.2f} GB/s"
    return line + f"; {num_params(arch) / 1e9 / max(slowest, 1e-9):.2f} G params/s"


def bound_by(summary: dict) -> str:
    """The planner's rule (prediction.predict_step), on measured times: a step whose GPU waits more
    than a tenth of it is bound by what it waits for, the host optimizer or the copies (PCIe)."""
    exposed = summary["seconds"] - summary["compute_s"]
    if exposed <= 0.1 * summary["seconds"]:
        return "compute"
    return "PCIe" if summary["h2d_s"] > summary["optimizer_s_per_step"] else "host optimizer"


def step_row(r, flops_per_token: float, peak_tflops: float | None) -> dict:
    row = dataclasses.asdict(r)
    tps = r.tokens / r.seconds
    row["tokens_per_s"] = tps
    row["model_tflops"] = tps * flops_per_token / 1e12
    row["mfu"] = row["model_tflops"] / peak_tflops if peak_tflops else None
    row["exposed_wait_s"] = max(0.0, r.seconds - r.compute_s)
    row["h2d_s"] = r.h2d_bytes / (r.h2d_gbps * 1e9) if r.h2d_gbps else 0.0
    row["peak_gpu_gib"] = r.peak_device_bytes / 2**30
    return row


def format_row(step: int, row: dict) -> str:
    return (f"step {step}{' (warm-up)' if row['warmup'] else ''}: {row['seconds']:.2f} s, "
            f"{row['tokens_per_s']:.0f} tok/s, {row['model_tflops']:.0f} TFLOP/s{mfu_text(row['mfu'], ' (MFU {})')}, "
            f"loss {row['loss']:.3f}, h2d {row['h2d_gbps']:.1f} GB/s, d2h {row['d2h_gbps']:.1f} GB/s, "
            f"compute {row['compute_s']:.2f} s, exposed wait {row['exposed_wait_s']:.2f} s "
            f"(before the first layer {row['wait_before_s']:.2f}, between layers {row['wait_between_s']:.2f}, after "
            f"the last {row['wait_after_s']:.2f}; the host blocked on the optimizer {row['prefetch_wait_s']:.2f} s), "
            + (f"blocked on the host's adds of the gradients summed there {row['host_add_wait_s']:.2f} s, "
               if row.get("host_add_wait_s") else "")
            + f"peak GPU {row['peak_gpu_gib']:.1f} GiB, "
            f"host available {row['driver_node_available_gib']:.1f} GiB")


def mfu_text(mfu: float | None, form: str = "{}") -> str:
    return form.format(f"{mfu:.1%}") if mfu is not None else ""


def main(args) -> int:
    if args.warmup < 0 or args.steps < 1:
        raise ValueError("bench needs --warmup >= 0 and --steps >= 1")
    threads = args.optimizer_threads or []
    if threads and (min(threads) < 1 or (len(threads) > 1 and not args.parts)):
        raise ConfigError("--optimizer-threads takes one positive count (several only with --parts)")
    shapes = shapes_from(args)
    arch = model_arch(bench_config(args, shapes[0]).model)
    print(f"bench: {args.model} ({num_params(arch) / 1e9:.2f} B params), {'; '.join(map(str, shapes))}; "
          f"model FLOPs = 6 x {matmul_params(arch) / 1e9:.2f} B params x tokens + causal attention "
          f"6 x layers x seq x heads x head_dim per token (a sliding-window layer: its window's keys only); MFU against the GPU's bf16 matmul peak", flush=True)
    if args.parts:
        parts = bench_parts(arch, args, shapes[0])
        print(json.dumps(parts, indent=2))
        _write_json(args.json, parts)
        return 0
    runs = run_streaming(arch, args, shapes, on_shape=lambda runs: _write_json(
        args.json, _results(args, arch, runs, incomplete="written after each shape; the run had not ended")))
    if args.baseline is not None:
        from megatrain_ray.bench.baseline_process import run_baselines_at_best

        names = args.baseline or ["plain", "fsdp2_offload", "deepspeed_offload"]
        measured: dict[tuple, list[dict]] = {}  # shapes that differ only in --keep-graphs share them
        for run in (r for r in runs if "refused" not in r):
            shape = Shape(**run["shape"])
            key = (shape.seq_len, shape.micro_batch, shape.grad_accum)
            if key not in measured:
                done = run["baseline_splits_done"] = []  # on disk after each split: a cut run keeps them

                def record(result, done=done):
                    done.append(dataclasses.asdict(result))
                    _write_json(args.json, _results(args, arch, runs, incomplete="written after each baseline split"))

                measured[key] = [dataclasses.asdict(b) for b in run_baselines_at_best(
                    names, arch, shape.seq_len, baseline_splits(args.baseline_splits, shape), args.steps,
                    args.warmup, on_split=record)]
                del run["baseline_splits_done"]  # each baseline's `config.tried` holds them now
            run["baselines"] = measured[key]
    results = _results(args, arch, runs)
    print_table(results)
    _write_json(args.json, results)
    return 0


def _results(args, arch: ModelArch, runs: list[dict], **extra) -> dict:
    """What --json holds: the command's arguments, the model and every shape's run."""
    return {"args": vars(args), "model": args.model, "params": num_params(arch), "runs": runs, **extra}


def _write_json(path: str | None, results: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(results, indent=2, default=str))


def print_table(results: dict) -> None:
    print("\n| run | GPUs | seq | tokens/step | tokens/s | model TFLOP/s | MFU | step s | compute s | h2d s | optimizer s | "
          "bound by | h2d GB/s | peak GPU GiB | plan: tokens/s, bound | ours / it |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for run in results["runs"]:
        shape = Shape(**run["shape"])
        if "refused" in run:
            print(f"| megatrain-ray | {run.get('num_gpus', 1)} | {shape.seq_len} | {shape.micro_batch} x {shape.grad_accum} "
                  f"| refused | | | | | | | | | | | |")
            continue
        m = run["median"]
        ours = m["tokens_per_s"]
        p = m["predicted"]
        plan_cell = f"{p['tokens'] / p['step_s']:.0f}, {p['bound']}" if p else "- (no GPU)"
        kept = f", {m['kept_graphs']} kept" if m.get("kept_graphs") else ""
        print(f"| megatrain-ray{kept} | {m['num_gpus']} | {shape.seq_len} | {shape.micro_batch} x {shape.grad_accum} | {ours:.0f} | "
              f"{m['model_tflops']:.0f} | {mfu_text(m['mfu']) or '-'} | {m['seconds']:.2f} | {m['compute_s']:.2f} | {m['h2d_s']:.2f} | "
              f"{m['optimizer_s_per_step']:.2f} | {m['bound']} | {m['h2d_gbps']:.1f} | {m['peak_gpu_gib']:.1f} | "
              f"{plan_cell} | 1.00 |")
        for b in run.get("baselines", []):
            tps = b.get("tokens_per_s") or 0.0
            ratio = f"{ours / tps:.2f}" if tps else "-"
            peak = (b.get("peak_gpu_bytes") or 0) / 2**30
            cfg = b.get("config") or {}
            split = f"{cfg.get('micro_batch', shape.micro_batch)} x {cfg.get('grad_accum', shape.grad_accum)}"
            tuning = "; ".join(f"{k} {v}" for k, v in cfg.items() if k not in ("micro_batch", "grad_accum", "tried"))
            print(f"| {b['name']} ({b['status']}{', ' + tuning if tuning else ''}) | 1 | {shape.seq_len} | {split} | "
                  f"{tps:.0f} | | | | | | | | | {peak:.1f} | | {ratio} |")
