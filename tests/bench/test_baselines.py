"""The bench baselines: same model and data as the streaming trainer, and failures as results."""

import dataclasses
import json
import statistics

import numpy as np
import pytest
import torch

from megatrain_ray.bench import baseline_process
from megatrain_ray.bench.baseline_model import BaselineModel, init_weights
from megatrain_ray.bench.baseline_process import run_baselines
from megatrain_ray.bench.baselines import BaselineResult, run_fsdp2_offload, run_plain
from megatrain_ray.bench.workload import random_micro_batches, synthetic_micro_batches
from megatrain_ray.models.registry import PRESETS
from helpers.reference_model import ReferenceModel
from megatrain_ray.models.layout import module_key

TINY = PRESETS["tiny-llama"]


def test_synthetic_data_is_the_streaming_bench_data():
    ours = synthetic_micro_batches(TINY, 16, 2, 3, seed=5)
    theirs = random_micro_batches(TINY, 16, 2, 3, seed=5)
    assert len(ours) == 3
    for a, b in zip(ours, theirs, strict=True):
        for k in ("input_ids", "labels", "position_ids"):
            assert a[k].dtype == torch.int64 and a[k].device.type == "cpu"
            np.testing.assert_array_equal(a[k].numpy(), b[k])


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_baseline_model_is_the_reference_model(preset):
    """Same loss and gradients as ReferenceModel on the same weights (checkpointing included)."""
    arch = PRESETS[preset]
    model = BaselineModel(arch, checkpoint_blocks=True, compute_dtype=torch.float32)
    init_weights(model, seed=0, init_device=torch.device("cpu"))
    ref = ReferenceModel(arch)
    ours = dict(model.named_parameters())
    with torch.no_grad():
        for layout, module in zip(ref.layouts, ref.layers, strict=True):
            prefix = f"blocks.{layout.index - 1}." if layout.kind == "block" else ""
            for p in layout.params:
                getattr(module, module_key(p.name)).copy_(ours[prefix + module_key(p.name)])
    batch = synthetic_micro_batches(arch, 32, 2, 1, seed=0)[0]
    a, b = model(batch), ref.loss_sum(batch)
    a.backward()
    b.backward()
    torch.testing.assert_close(a, b)
    assert 4.0 < float(a.detach()) / batch["labels"].numel() < 7.0  # about ln(256): init std is applied
    torch.testing.assert_close(model.blocks[1].mlp__down_proj__weight.grad, ref.layers[2].mlp__down_proj__weight.grad)


def rate_of(result: BaselineResult, tokens: int) -> float:
    """The rate a result must report: the median over its timed steps of a step's tokens per second."""
    return statistics.median(tokens / s for s in result.step_seconds)


def test_plain_runs_on_cpu():
    r = run_plain(TINY, 16, 1, 2, steps=2, warmup=1, device="cpu")
    assert r.status == "ok", r.error
    assert len(r.step_seconds) == 2 and len(r.losses) == 3  # the warm-up step trains, untimed
    assert r.tokens_per_s == pytest.approx(rate_of(r, tokens=16 * 1 * 2))
    assert all(np.isfinite(r.losses))


def test_fsdp2_wiring_on_cpu_over_gloo():
    """The FSDP2 hooks gather what the blocks read: same losses as plain (no offload on CPU)."""
    fsdp = run_fsdp2_offload(TINY, 32, 2, 2, steps=1, warmup=1, device="cpu", offload=False)
    plain = run_plain(TINY, 32, 2, 2, steps=1, warmup=1, device="cpu")
    assert fsdp.status == "ok", fsdp.error
    np.testing.assert_allclose(fsdp.losses, plain.losses, rtol=2e-2)


def test_cli_prints_one_json_line(capfd):
    baseline_process.main(["--name", "plain", "--model", "tiny-llama", "--seq-len", "16", "--micro-batch", "1",
                    "--grad-accum", "2", "--steps", "1", "--warmup", "0", "--device", "cpu"])
    out = capfd.readouterr().out.strip().splitlines()
    assert len(out) == 1
    result = BaselineResult(**json.loads(out[0]))
    assert result.status == "ok" and result.tokens_per_s == pytest.approx(rate_of(result, tokens=16 * 1 * 2))


def test_runner_returns_results_not_exceptions():
    """Each baseline in its own process; deepspeed without a GPU (or not installed) is a status."""
    plain, ds, unknown = run_baselines(["plain", "deepspeed_offload", "nope"], TINY, 16, 1, 1, steps=1, warmup=0,
                                       device="cpu", timeout_s=120)
    assert plain.name == "plain" and plain.status == "ok", plain.error
    assert plain.tokens_per_s == pytest.approx(rate_of(plain, tokens=16 * 1 * 1))
    assert ds.name == "deepspeed_offload" and ds.status.startswith("unavailable"), ds
    assert unknown.status.startswith("unavailable")



def test_a_result_printed_before_a_hang_still_counts():
    """A child killed at its timeout after printing its result line: the result, not an error."""
    done = BaselineResult("deepspeed_offload", "ok", tokens_per_s=123.0, step_seconds=[1.0])
    out = "ninja: no work to do\n" + json.dumps(dataclasses.asdict(done)) + "\n\n"
    assert baseline_process._result_line(out) == done
    assert baseline_process._result_line("a traceback, no result\n") is None
    assert baseline_process._result_line("") is None

@pytest.mark.gpu
def test_gpu_baselines_small():
    """plain and FSDP2-offload on the GPU, a two-block Qwen2.5-1.5B shape: both train, and their
    first losses (same weights, same data, bf16 compute) agree."""
    arch = PRESETS["qwen2.5-1.5b"].replace(num_layers=2)
    plain, fsdp = run_baselines(["plain", "fsdp2_offload"], arch, 256, 1, 2, steps=2, warmup=1, device="cuda",
                                timeout_s=600)
    for r in (plain, fsdp):
        assert r.status == "ok", (r.name, r.error)
        assert len(r.step_seconds) == 2 and r.tokens_per_s == pytest.approx(rate_of(r, tokens=256 * 1 * 2))
        assert r.peak_gpu_bytes > 0
    assert abs(plain.losses[0] - fsdp.losses[0]) < 0.05
    # Offload keeps the fp32 master and AdamW state off the GPU.
    assert fsdp.peak_gpu_bytes < plain.peak_gpu_bytes


@pytest.mark.gpu
def test_gpu_deepspeed_small():
    pytest.importorskip("deepspeed")
    arch = PRESETS["qwen2.5-1.5b"].replace(num_layers=2)
    (ds,) = run_baselines(["deepspeed_offload"], arch, 256, 1, 2, steps=2, warmup=1, device="cuda", timeout_s=900)
    assert ds.status == "ok", ds.error
    assert ds.tokens_per_s == pytest.approx(rate_of(ds, tokens=256 * 1 * 2)) and ds.peak_gpu_bytes > 0


def test_every_split_of_the_same_tokens_is_tried_and_the_fastest_kept():
    from megatrain_ray.bench.baseline_process import run_baselines_at_best, splits_for

    assert splits_for(4 * 16, 16) == [(1, 4), (2, 2), (4, 1)]
    assert splits_for(3 * 16, 16) == [(1, 3)]
    seen = []  # two splits run (each in a fresh process: seconds of imports), every one of them
    (plain,) = run_baselines_at_best(["plain"], TINY, 16, splits_for(2 * 16, 16), steps=1, warmup=0, device="cpu",
                                     on_split=seen.append)
    assert plain.status == "ok", plain.error
    assert [(r.config["micro_batch"], r.config["grad_accum"]) for r in seen] == [(1, 2), (2, 1)]
    tried = plain.config["tried"]
    assert [(t["micro_batch"], t["grad_accum"]) for t in tried] == [(1, 2), (2, 1)]
    assert plain.tokens_per_s == pytest.approx(max(t["tokens_per_s"] for t in tried), abs=0.1)
    assert (plain.config["micro_batch"], plain.config["grad_accum"]) in [(1, 2), (2, 1)]


def test_the_fastest_split_that_finished_is_kept_with_every_split_tried():
    """What the run above keeps, on made-up results: the fastest finished split, whichever place
    it came in (else the first failure), with every split's status and rate recorded."""
    from megatrain_ray.bench.baseline_process import best_of
    from megatrain_ray.bench.baselines import BaselineResult

    def result(mb, status, rate):
        return BaselineResult("plain", status, tokens_per_s=rate, config={"micro_batch": mb, "grad_accum": 8 // mb})

    tried = [result(1, "ok", 10.0), result(2, "ok", 30.0), result(4, "oom", 0.0), result(8, "ok", 20.0)]
    best = best_of(tried)
    assert (best.status, best.tokens_per_s, best.config["micro_batch"]) == ("ok", 30.0, 2)
    assert [(t["micro_batch"], t["status"], t["tokens_per_s"]) for t in best.config["tried"]] == [
        (1, "ok", 10.0), (2, "ok", 30.0), (4, "oom", 0.0), (8, "ok", 20.0)]
    failed = best_of([result(1, "oom", 0.0), result(2, "error", 0.0)])
    assert failed.status == "oom" and [t["status"] for t in failed.config["tried"]] == ["oom", "error"]


def test_fsdp2_prefetches_explicitly_and_says_so():
    r = run_fsdp2_offload(TINY.replace(num_layers=3), 16, 1, 1, steps=1, warmup=0, device="cpu", offload=False)
    assert r.status == "ok", r.error
    assert r.config["prefetch"] == "explicit, 2 blocks ahead"


def test_deepspeed_runs_with_its_documented_throughput_settings():
    from megatrain_ray.bench.baselines import DEEPSPEED_TUNED, deepspeed_config

    zero = deepspeed_config(4, 4, 1e-4)["zero_optimization"]
    assert all(zero[k] == v for k, v in DEEPSPEED_TUNED.items()) and zero["stage"] == 3
    assert "stage3_prefetch_bucket_size" not in deepspeed_config(4, 4, 1e-4, tuned=False)["zero_optimization"]
