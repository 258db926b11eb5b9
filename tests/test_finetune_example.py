"""examples/finetune-sft.yaml end to end: a Hugging Face directory and SFT JSONL in, through
`megatrain-ray train` (embedded Ray, store and executor actors), a model transformers loads out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

from megatrain_ray.config import load_config  # noqa: E402
from megatrain_ray.data import build_dataset  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "finetune-sft.yaml"


def mean_loss(model, batches) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for mb in batches:
            logits = model(input_ids=torch.as_tensor(mb["input_ids"]),
                           position_ids=torch.as_tensor(mb["position_ids"])).logits
            labels = torch.as_tensor(mb["labels"]).reshape(-1)
            total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels, ignore_index=-100,
                                           reduction="sum"))
            count += int((labels != -100).sum())
    return total / count


def test_finetune_example_trains_and_exports_a_transformers_model(tmp_path):
    made = tmp_path / "tiny-hf"
    subprocess.run([sys.executable, str(ROOT / "examples" / "make_tiny_hf_model.py"), str(made)],
                   check=True, capture_output=True, text=True, timeout=120)
    model_dir, data, tokenizer = made / "model", made / "sft.jsonl", made / "model" / "tokenizer.json"
    out = tmp_path / "run"
    overrides = [f"model.path={model_dir}", f"data.source={data}", f"data.tokenizer={tokenizer}",
                 f"train.output_dir={out}", "runtime.num_cpus=2", "runtime.object_store_memory=150000000"]
    env = {**os.environ, "RAY_ADDRESS": "", "RAY_USAGE_STATS_ENABLED": "0"}
    script = Path(sys.executable).parent / "megatrain-ray"  # this environment's entry point
    cli = [str(script)] if script.exists() else [sys.executable, "-m", "megatrain_ray.cli"]
    args = [arg for item in overrides for arg in ("--set", item)]
    run = subprocess.run(cli + ["train", str(CONFIG), *args], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    config = load_config(CONFIG, overrides)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, config.train.steps + 1))
    losses = [r["loss"] for r in records]
    assert losses[-1] < losses[0] - 0.5, losses

    exports = sorted((out / "checkpoints").glob("step-*/hf"))
    assert [e.parent.name for e in exports] == [f"step-{config.train.steps:08d}"]
    tuned = AutoModelForCausalLM.from_pretrained(exports[0], dtype=torch.float32).eval()
    initial = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tuned_sd, initial_sd = tuned.state_dict(), initial.state_dict()
    assert set(tuned_sd) == set(initial_sd)
    for name, before in initial_sd.items():
        assert not torch.equal(tuned_sd[name], before), f"{name} did not change"
    # The run started from the Hugging Face weights, not from a random init: embedding rows of ids
    # the tokenizer never produces get no gradient and (weight_decay 0) stay exactly as loaded.
    assert config.optim.weight_decay == 0.0
    used = json.loads(tokenizer.read_text())["model"]["vocab"]
    unused = slice(max(used.values()) + 1, None)
    embed = "model.embed_tokens.weight"
    assert torch.equal(tuned_sd[embed][unused], initial_sd[embed][unused])

    # transformers itself sees the fine-tuned model predict the SFT responses better.
    dataset = build_dataset(config.data, tuned.config.vocab_size, seed=1)
    steps = dataset.batches(config.train.micro_batch_size, 1)
    batches = [next(steps)[0][0] for _ in range(3)]
    assert mean_loss(tuned, batches) < mean_loss(initial, batches) - 0.5
