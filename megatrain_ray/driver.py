"""The training loop on the driver: batches in, metrics out, checkpoints when due.

Data path: the dataset yields a step's micro-batches (small int arrays) -> the GPU actor streams
the layers through them and sends each layer's gradient to its store -> the stores step their
layers -> the driver logs the step's metrics and, when due, asks every store for its shard.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import ray

from megatrain_ray import checkpoint as ckpt
from megatrain_ray.config import Config
from megatrain_ray.executor import StepResult
from megatrain_ray.models.arch import ModelArch, resolve_arch
from megatrain_ray.runtime import Session, connect


def model_arch(config: Config) -> ModelArch:
    arch = resolve_arch(config.model.preset, config.model.path)
    return arch.replace(**config.model.overrides) if config.model.overrides else arch


def config_hash(config: Config) -> str:
    return hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:16]


def checkpoint_root(config: Config) -> Path:
    return Path(config.checkpoint.dir or Path(config.train.output_dir) / "checkpoints")


class MetricsLog:
    """One JSON line per step to metrics.jsonl; a live line on a terminal, plain lines otherwise."""

    def __init__(self, path: Path, total_steps: int):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a")
        self.total = total_steps
        self.live = sys.stdout.isatty()

    def step(self, step: int, r: StepResult, lr: float | None = None) -> dict:
        record = {"step": step, "time": time.time(), **dataclasses.asdict(r),
                  "tokens_per_s": r.tokens / r.seconds if r.seconds else 0.0}
        if lr is not None:
            record["lr"] = lr
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        line = (f"step {step}/{self.total} loss {r.loss:.4f} grad_norm {r.grad_norm:.3f} "
                f"{record['tokens_per_s']:.0f} tok/s {r.seconds:.2f} s/step h2d {r.h2d_gbps:.1f} GB/s")
        if not r.finite:
            line += " (non-finite: update skipped)"
        print(("\r" + line) if self.live else line, end="" if self.live else "\n", flush=True)
        return record

    def close(self) -> None:
        if self.live:
            print()
        self.file.close()


def save_checkpoint(session: Session, config: Config, step: int, data_position: dict | None) -> Path:
    updates_done = session.drain()
    root = checkpoint_root(config)
    staging = ckpt.new_staging_dir(root, step)
    names = [f"shard-{k:03d}.safetensors" for k in range(len(session.stores))]
    if config.checkpoint.transport == "shared":
        shards = ray.get([s.save_shard.remote(str(staging), n) for s, n in zip(session.stores, names)])
    else:
        shards = []
        for store, name in zip(session.stores, names):
            tensors, steps = ray.get(store.state_tensors.remote())
            shards.append(ckpt.write_shard(staging, name, tensors, steps))
    meta = {
        "step": step,
        "updates_done": updates_done,
        "data_position": data_position,
        "arch": dataclasses.asdict(session.arch),
        "config": config.to_dict(),
        "config_hash": config_hash(config),
    }
    return ckpt.commit(staging, root, step, shards, meta, config.checkpoint.keep)


def check_compatible(meta: dict, arch: ModelArch, path: Path) -> None:
    if meta["arch"] != json.loads(json.dumps(dataclasses.asdict(arch))):
        diff = {k: (meta["arch"].get(k), v) for k, v in json.loads(json.dumps(dataclasses.asdict(arch))).items()
                if meta["arch"].get(k) != v}
        raise ckpt.CheckpointError(
            f"checkpoint {path} is from another model: " + ", ".join(f"{k} is {a} there but {b} here" for k, (a, b) in diff.items())
        )


def restore(session: Session, path: Path) -> dict:
    manifest, meta = ckpt.read_manifest(path)
    check_compatible(meta, session.arch, path)
    files = ckpt.shard_files_by_layer(path, manifest)
    ray.get([store.load_layers.remote(files) for store in session.stores])
    return meta


def initial_weights(session: Session, config: Config) -> None:
    if config.model.path:
        ray.get([store.load_hf.remote(config.model.path) for store in session.stores])
    else:
        session.init_random()


def export_final(session: Session, config: Config, out_dir: Path) -> None:
    from megatrain_ray.hf import export_hf
    import torch

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.checkpoint.export_dtype]
    session.drain()

    def layers():
        for store, plan in zip(session.stores, session.placement.stores):
            for i in plan.layers:
                yield i, ray.get(store.master.remote(i))

    export_hf(out_dir, session.arch, layers(), dtype=dtype)


def run_training(config: Config, resume: str | None = None) -> dict[str, Any]:
    """Train as the config says; returns a summary (final loss, checkpoint path, metrics path)."""
    from megatrain_ray.data import DataPosition, build_dataset

    arch = model_arch(config)
    connect(config.runtime)
    out = Path(config.train.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    resume_path = ckpt.resolve(resume, checkpoint_root(config)) if resume else None
    meta = None
    if resume_path is not None:
        _, meta = ckpt.read_manifest(resume_path)
        check_compatible(meta, arch, resume_path)
    session = Session(config, arch, updates_done=meta["updates_done"] if meta else 0)
    print(session.placement.describe(arch), flush=True)
    try:
        if resume_path is not None:
            restore(session, resume_path)
            print(f"resumed from {resume_path} at step {meta['step']}", flush=True)
        else:
            initial_weights(session, config)
        session.start_executor()
        print(f"executor device: {ray.get(session.gpu.describe_device.remote())}", flush=True)
        return _loop(session, config, meta, build_dataset, DataPosition, out)
    finally:
        session.close()


def _loop(session: Session, config: Config, meta, build_dataset, DataPosition, out: Path) -> dict[str, Any]:
    t = config.train
    dataset = build_dataset(config.data, session.arch.vocab_size, t.seed)
    start_step = meta["step"] if meta else 0
    start_pos = DataPosition.from_dict(meta["data_position"]) if meta and meta.get("data_position") else None
    log = MetricsLog(out / "metrics.jsonl", t.steps)
    bad_in_a_row, last, position, step = 0, None, start_pos, start_step
    batches = dataset.batches(t.micro_batch_size, t.grad_accum, start_pos)
    last_ckpt = None
    try:
        for step in range(start_step + 1, t.steps + 1):
            micro_batches, position = next(batches)
            last = session.train_step(micro_batches)
            log.step(step, last)
            bad_in_a_row = 0 if last.finite else bad_in_a_row + 1
            if bad_in_a_row >= t.max_bad_steps:
                raise FloatingPointError(
                    f"{bad_in_a_row} steps in a row had a non-finite loss or gradient (last: step {step}); "
                    f"stopping. Last good checkpoint: {last_ckpt or 'none'}. Lower optim.lr or check the data."
                )
            if config.checkpoint.every and step % config.checkpoint.every == 0 and step < t.steps:
                last_ckpt = save_checkpoint(session, config, step, position.to_dict())
    finally:
        log.close()
    final = save_checkpoint(session, config, step, position.to_dict() if position else None)
    print(f"checkpoint: {final}", flush=True)
    if config.checkpoint.export_hf:
        export_final(session, config, final / "hf")
        print(f"Hugging Face export: {final / 'hf'}", flush=True)
    return {"final_loss": last.loss if last else None, "checkpoint": str(final), "metrics": str(out / "metrics.jsonl")}
