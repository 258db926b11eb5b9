"""A run through megatrain_ray.train with validation, TensorBoard and W&B (offline) on: every step's
learning rate, gradient norm, tokens/s and loss in metrics.jsonl, the validation loss on the steps
that validate, and the same numbers read back by tensorboard's own reader and from W&B's run file."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import megatrain_ray
from megatrain_ray.config import config_from_dict
from helpers.reference_training import reference_lr

STEPS, EVERY = 5, 2


pytestmark = pytest.mark.usefixtures("local_ray")  # one Ray cluster for the module (conftest.py)


def token_file(path: Path, seed: int, rows: int) -> str:
    rng = np.random.default_rng(seed)
    docs = [np.resize(rng.integers(0, 64, rng.integers(2, 6)), rng.integers(8, 17)).tolist() for _ in range(rows)]
    pq.write_table(pa.table({"input_ids": docs}), path)
    return str(path)


def wandb_history(run_file: Path) -> dict[int, dict[str, float]]:
    """Each step's logged scalars in a W&B run file, read record by record: the file is a LevelDB log
    (a 7-byte file header, then 32 KiB blocks of records, each with a 7-byte header of checksum,
    length and type, a record split across blocks as first, middle and last pieces) of W&B's
    protobuf records. Not a search of the file's bytes: a value that a block's header splits, where
    the run's own timing put more records before it, would not be found."""
    from wandb.proto import wandb_internal_pb2

    data, block, header = run_file.read_bytes(), 32768, 7
    assert data[:4] == b":W&B"
    history, pieces, pos = {}, [], header
    while pos + header <= len(data):
        if block - pos % block < header:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + header])
        pieces.append(data[pos + header:pos + header + length])
        pos += header + length
        if kind in (1, 4):  # a whole record, or a split one's last piece
            record = wandb_internal_pb2.Record.FromString(b"".join(pieces))
            pieces = []
            if record.WhichOneof("record_type") == "history":
                items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
                history[items.pop("_step")] = items
    return history


def test_metrics_reach_jsonl_tensorboard_and_wandb(tmp_path, monkeypatch, capsys):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    wandb_installed = __import__("importlib.util").util.find_spec("wandb") is not None
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    # The run's W&B service neither samples the machine nor gives up on its start under a loaded box:
    # its system records are no part of the check, and its 90 s start timeout is a slow machine's
    # failure, not the run's.
    monkeypatch.setenv("WANDB_X_DISABLE_STATS", "true")
    monkeypatch.setenv("WANDB_X_DISABLE_MACHINE_INFO", "true")
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "600")
    out = tmp_path / "run"
    summary = megatrain_ray.train(
        {"model": {"preset": "tiny-llama", "compute_dtype": "float32"},
         "data": {"source": token_file(tmp_path / "train.parquet", 0, 64), "seq_len": 16},
         "train": {"steps": STEPS, "micro_batch_size": 2, "grad_accum": 2, "output_dir": str(out)},
         "executor": {"device": "cpu", "compile": False},
         "checkpoint": {"export_hf": False}},
        optim={"lr": 1e-2, "warmup_steps": 2},
        eval={"source": token_file(tmp_path / "val.parquet", 1, 8), "every": EVERY, "batches": 3},
        metrics={"tensorboard": True, "wandb": wandb_installed},
    )
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    optim = config_from_dict({"model": {"preset": "tiny-llama"}, "optim": {"lr": 1e-2, "warmup_steps": 2}}).optim
    assert [r["lr"] for r in records] == pytest.approx([reference_lr(optim, k, STEPS) for k in range(STEPS)])
    assert records[0]["lr"] < records[1]["lr"] > records[-1]["lr"]  # warmup, then decay
    for r in records:
        assert 0 < r["target_tokens"] <= r["tokens"] <= 2 * 2 * 16  # micro-batches x rows x seq_len
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"])
        assert np.isfinite(r["grad_norm"]) and np.isfinite(r["loss"])
    validated = [r["step"] for r in records if "eval_loss" in r]
    assert validated == [2, 4, 5]  # every 2 steps and after the last
    assert summary["eval_loss"] == records[-1]["eval_loss"]
    assert "val_loss" in capsys.readouterr().out

    board = event_accumulator.EventAccumulator(str(out / "tensorboard"))
    board.Reload()
    for tag, key in (("train/loss", "loss"), ("train/lr", "lr"), ("train/grad_norm", "grad_norm")):
        events = board.Scalars(tag)
        assert [e.step for e in events] == list(range(1, STEPS + 1))
        assert [e.value for e in events] == [np.float32(r[key]) for r in records]  # stored as float32
    assert [(e.step, e.value) for e in board.Scalars("eval/loss")] == [
        (r["step"], np.float32(r["eval_loss"])) for r in records if "eval_loss" in r]

    if wandb_installed:
        [run_file] = (out / "wandb").glob("offline-run-*/run-*.wandb")
        history = wandb_history(run_file)
        assert sorted(history) == list(range(1, STEPS + 1))
        for r in records:  # W&B's history records hold each value as JSON text: the same float
            logged = history[r["step"]]
            assert (logged["train/loss"], logged["train/lr"], logged["train/grad_norm"]) == (r["loss"], r["lr"], r["grad_norm"])
            assert logged.get("eval/loss") == r.get("eval_loss")
