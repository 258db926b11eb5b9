"""The planner's predictions against what the stores and the GPU really take."""

import dataclasses
import subprocess
import sys

import pytest
import torch

from megatrain_ray.config import config_from_dict
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.registry import PRESETS, family, model_layouts, num_params, resolve_arch
from megatrain_ray.planning.decisions import check_gpu_fit, choose_kept, choose_offload, gpu_memory
from megatrain_ray.planning.memory import (KEPT, KEPT_GRAPH_PER_WORKING_SET, KEPT_GRAPH_PER_WORKING_SET_BUDGETED,
                                           PlanError, gpu_plan, kept_graph_bytes)
from megatrain_ray.planning.prediction import LAYER_TFLOPS, predict_step
from megatrain_ray.host.memory import DTYPES
from megatrain_ray.host.store import bytes_per_param

ARCH = ModelArch("llama", 16000, 256, 768, 4, 4, 2, 64)  # about 13M parameters


def config(**executor):
    return config_from_dict({
        "model": {"preset": "tiny-llama"},
        "data": {"seq_len": 1024},
        "train": {"micro_batch_size": 2, "grad_accum": 4},
        "executor": executor,
    })


def fit(cfg, free: int):
    """The GPU memory the plan decides for `free` bytes (offloading, then kept blocks), refused where
    it does not fit."""
    memory = gpu_memory(ARCH, cfg, free)
    check_gpu_fit(memory, free, "a test GPU")
    return memory


MEASURE_STORE = """
import sys, torch
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.host.memory import resident_bytes as _resident_bytes
from megatrain_ray.host.memory import DTYPES
from megatrain_ray.host.store import ShardStore
arch = ModelArch("llama", 16000, 256, 768, 4, 4, 2, 64)
before = _resident_bytes()
store = ShardStore(arch, list(range(arch.num_layers + 2)), DTYPES[sys.argv[1]])
for state in store.layers.values():  # touch every page, as training does
    for t in (state.master, state.exp_avg, state.exp_avg_sq, state.compute):
        t.fill_(1)
print(_resident_bytes() - before)
"""


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_host_memory_of_a_store_is_what_the_plan_says(dtype):
    """In a fresh process: the resident memory a store adds is the plan's bytes per parameter."""
    out = subprocess.run([sys.executable, "-c", MEASURE_STORE, dtype], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    grown = int(out.stdout.split()[-1])
    predicted = num_params(ARCH) * bytes_per_param(DTYPES[dtype])
    assert predicted == pytest.approx(grown, rel=0.15), f"predicted {predicted}, grew {grown}"


def test_a_step_too_large_for_the_gpu_is_refused_with_what_to_change():
    kept = config(offload_activations="off")
    plan = gpu_plan(ARCH, kept)
    with pytest.raises(PlanError, match="train.grad_accum"):
        fit(kept, int(plan.total * 0.9))
    assert fit(kept, int(plan.total * 1.1)).total == plan.total


def test_auto_offloads_activations_only_when_the_step_comes_close_to_the_free_memory():
    plan = gpu_plan(ARCH, config())
    assert not choose_offload(ARCH, config(), plan.total * 2)
    assert choose_offload(ARCH, config(), int(plan.total * 1.1))
    offloaded = fit(config(), int(plan.total * 1.1))
    assert offloaded.total < plan.total


def test_activations_grow_with_micro_batches_and_mlp_chunks_bound_the_working_set():
    small, large = gpu_plan(ARCH, config()), gpu_plan(ARCH, config().replace(
        train=config().train.__class__(micro_batch_size=2, grad_accum=8)))
    key = "boundary activations (input of every layer, every micro-batch)"
    assert large.by_use[key] == 2 * small.by_use[key]
    unchunked = gpu_plan(ARCH, config(mlp_chunk_tokens=0)).by_use["one layer's working set"]
    chunked = gpu_plan(ARCH, config(mlp_chunk_tokens=256)).by_use["one layer's working set"]
    assert chunked < unchunked


def test_auto_keeps_as_many_forward_graphs_as_the_memory_left_over_holds():
    """The plan without kept graphs takes a share of the margin; each kept block adds its graphs and
    weights; auto keeps the most that stay under the margin, none without a GPU, at most every block."""
    on_device = config(offload_activations="off")
    base = gpu_plan(ARCH, on_device).total
    each = kept_graph_bytes(ARCH, on_device)
    assert each > 0 and gpu_plan(ARCH, on_device, kept=3).by_use[KEPT] == 3 * each
    free = int((base + 2.5 * each) / 0.85)  # room for two and a half
    assert choose_kept(ARCH, on_device, free) == 2
    assert choose_kept(ARCH, on_device, int(base / 0.85) + 1) == 0
    assert choose_kept(ARCH, on_device, 100 * free) == ARCH.num_layers
    assert choose_kept(ARCH, config(), None) == 0
    assert choose_kept(ARCH, config(keep_graphs=1), 100 * free) == 1
    assert choose_kept(ARCH, config(keep_graphs=99), None) == ARCH.num_layers
    assert fit(config(), free).by_use[KEPT] == 2 * each


def test_a_kept_graph_is_sized_for_how_it_is_compiled():
    """Compiled within the activation budget: the _BUDGETED share of the block's working set per
    micro-batch; eager, or a family that keeps the default partition (GPT-OSS): the default share;
    plus the block's weights either way."""
    def graph_per_working_set(arch, **executor):
        cfg = config(**executor)
        working_set = family(arch).working_set_bytes(arch, 2 * 1024, 2 * 1024, 2)
        weights = max(layout.numel for layout in model_layouts(arch)[1:-1]) * 2
        return (kept_graph_bytes(arch, cfg) - weights) / 4 / working_set

    gpt_oss = resolve_arch("tiny-gpt-oss")
    assert graph_per_working_set(ARCH) == pytest.approx(KEPT_GRAPH_PER_WORKING_SET_BUDGETED, rel=1e-6)
    assert graph_per_working_set(ARCH, compile=False) == pytest.approx(KEPT_GRAPH_PER_WORKING_SET, rel=1e-6)
    assert graph_per_working_set(gpt_oss) == pytest.approx(KEPT_GRAPH_PER_WORKING_SET, rel=1e-6)
    assert KEPT_GRAPH_PER_WORKING_SET_BUDGETED < KEPT_GRAPH_PER_WORKING_SET


def test_kept_graphs_that_do_not_fit_are_refused_and_named():
    cfg = config(keep_graphs=4, offload_activations="off")
    need = gpu_plan(ARCH, cfg, kept=4).total
    with pytest.raises(PlanError, match="executor.keep_graphs"):
        fit(cfg, need - 1)
    assert fit(cfg, need).total == need


def test_auto_offload_makes_room_for_the_graphs_asked_for():
    """With executor.keep_graphs set, offloading is decided on the plan that holds them: a GPU
    where they fit only beside parked activations parks them instead of refusing the step."""
    cfg = config(keep_graphs=3)
    parked = gpu_plan(ARCH, cfg, offload=True, kept=3).total
    assert choose_offload(ARCH, cfg, parked) and not choose_offload(ARCH, config(), parked)
    assert fit(cfg, parked).total == parked


def test_predicted_compute_counts_the_recompute_of_blocks_and_none_of_the_head():
    """8 FLOP per block parameter and token (2 forward, 2 recompute, 4 backward), the LM head 6
    (differentiated as it goes); attention's forward (a third of the usual fwd+bwd count) once, again
    in the recompute, and 2.5 times in its backward (flash attention's recomputes the scores), at 0.8
    of the layer's rate; every block keeping its graph takes the recompute out, the forward stays;
    none saved where the MLP runs in checkpointed chunks."""
    cfg = config()
    tokens = 2 * 4 * 1024
    head = ARCH.vocab_size * ARCH.hidden_size
    blocks = num_params(ARCH) - 2 * head  # untied: the embedding is a lookup, no matmul
    attention_forward = 2 * ARCH.num_layers * 1024 * ARCH.num_heads * ARCH.head_dim  # causal: seq/2 keys, 2 matmuls
    at_its_rate = attention_forward / 0.8
    flops = lambda p: p.compute_s * LAYER_TFLOPS / tokens  # noqa: E731
    recompute = predict_step(ARCH, cfg)
    kept_all = predict_step(ARCH, cfg, kept=ARCH.num_layers)
    assert flops(recompute) == pytest.approx(8 * blocks + 6 * head + 4.5 * at_its_rate)
    assert flops(kept_all) == pytest.approx(6 * blocks + 6 * head + 3.5 * at_its_rate)
    forward = (2 * (blocks + head) + at_its_rate) * tokens / LAYER_TFLOPS
    assert recompute.forward_s == pytest.approx(forward) and kept_all.forward_s == pytest.approx(forward)
    assert flops(predict_step(ARCH, cfg, kept=2)) == pytest.approx(7 * blocks + 6 * head + 4 * at_its_rate)
    chunked = config(mlp_chunk_tokens=256)
    assert predict_step(ARCH, chunked, kept=4).compute_s == pytest.approx(predict_step(ARCH, chunked).compute_s)


@pytest.mark.parametrize("preset, seq_len, measured_s", [
    ("qwen2.5-1.5b", 524288, 524288 / 2319),  # nearly all of it attention
    ("qwen2.5-7b", 131072, 131072 / 2687),  # its window held the host optimizer's drain too (1.6 s)
])
def test_long_context_steps_are_predicted_as_the_h100_measured_them(preset, seq_len, measured_s):
    """One sequence a step, measured on the H100 machine (examples/benchmarks/2026-11-22-h100.md:
    2,319 and 2,687 tokens/s); the plan within 15%. Counting attention's backward as 2 forwards at
    the layer's rate, it took them for 161 s and 34 s (29% and 30% short), and Qwen2.5-7B at 524,288
    tokens for 403 s where its step had not ended after 505."""
    c = config_from_dict({"model": {"preset": preset}, "data": {"seq_len": seq_len, "pack": False},
                          "train": {"grad_accum": 1, "micro_batch_size": 1},
                          "executor": {"loss_chunk_tokens": 2048, "offload_activations": "on"}})
    assert predict_step(PRESETS[preset], c).step_s == pytest.approx(measured_s, rel=0.15)


def test_kept_blocks_beyond_those_resident_across_the_turn_cross_once():
    """3 slots: the last two blocks are not fetched again anyway; keeping all four spares the
    first two their second crossing (2-byte weights)."""
    blocks = [layout.numel for layout in model_layouts(ARCH)[1:-1]]
    read = lambda kept: predict_step(ARCH, config(), kept=kept).host_read_bytes  # noqa: E731
    assert read(2) == read(0)
    assert read(0) - read(99) == 2 * (blocks[0] + blocks[1])


def with_tokens(grad_accum: int, seq_len: int = 1024):
    c = config()
    return c.replace(train=dataclasses.replace(c.train, grad_accum=grad_accum),
                     data=dataclasses.replace(c.data, seq_len=seq_len))


def test_the_step_takes_its_slowest_part_and_names_it():
    """Many tokens: the compute, which doubles with them. Few tokens and no optimizer time: the
    weights' two crossings of PCIe, whatever the tokens. A slow host optimizer: each second more of
    it is a second more of step."""
    many, twice = predict_step(ARCH, with_tokens(64)), predict_step(ARCH, with_tokens(128))
    assert many.bound == twice.bound == "compute"
    assert many.step_s == pytest.approx(many.compute_s) and twice.step_s == pytest.approx(2 * many.step_s)
    few, fewer = (predict_step(ARCH, with_tokens(1, seq), optimizer_s=0.0) for seq in (64, 16))
    assert few.bound == fewer.bound == "PCIe"
    assert few.step_s == pytest.approx(few.h2d_s) and fewer.step_s == pytest.approx(few.step_s)
    slow, slower = (predict_step(ARCH, config(), optimizer_s=s) for s in (1.0, 2.0))
    assert slow.bound == slower.bound == "host optimizer"
    assert slower.step_s - slow.step_s == pytest.approx(1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("keep", [0, None])
def test_gpu_peak_is_within_15_percent_of_the_plan(keep):
    """With every block recomputing (0), and with as many kept graphs as fit (None: all 8 here),
    whose estimate must stay on the safe side."""
    from megatrain_ray.runtime.local import LocalTrainer
    from helpers.reference_training import random_micro_batches

    arch = ModelArch("qwen2", 8192, 1024, 4096, 8, 16, 2, 64, qkv_bias=True)
    for seq, accum in [(512, 1), (2048, 4)]:
        cfg = config_from_dict({
            "model": {"preset": "tiny-llama", "compute_dtype": "bfloat16"},
            "data": {"seq_len": seq}, "train": {"micro_batch_size": 1, "grad_accum": accum, "steps": 2},
            "executor": {"device": "cuda", "loss_chunk_tokens": 1024, "keep_graphs": keep},
        })
        trainer = LocalTrainer(cfg, arch)
        kept = len(trainer.executor.kept)
        peak = max(trainer.train_step(s).peak_device_bytes
                   for s in random_micro_batches(arch, 2, accum, batch=1, seq=seq, seed=0))
        trainer.close()
        predicted = trainer.plan.memory.total
        print(f"seq {seq} x {accum}, {kept} kept: predicted {predicted / 2**20:.0f} MiB, measured {peak / 2**20:.0f} MiB")
        assert kept == (0 if keep == 0 else arch.num_layers)
        assert predicted == pytest.approx(peak, rel=0.15)
        torch.cuda.empty_cache()


def test_parked_activations_that_the_host_cannot_hold_are_refused_before_the_run():
    """On the H100 machine, 7B steps of 16 and of 32 x 4096 tokens with activations parked on the
    host were killed by Ray's memory monitor (about 14 GiB of headroom beside the 99 GiB of
    state); both are refused now, and 8 micro-batches pass."""
    from megatrain_ray.models.registry import PRESETS
    from megatrain_ray.planning.decisions import check_parked_fit
    from megatrain_ray.planning.memory import GiB, parked_bytes

    def cfg(preset, seq, accum):
        return config_from_dict({
            "model": {"preset": preset}, "data": {"seq_len": seq},
            "train": {"micro_batch_size": 1, "grad_accum": accum}, "executor": {"offload_activations": "on"},
        })

    seven_b, headroom = PRESETS["qwen2.5-7b"], int(13.9 * GiB)
    # embedding + 28 blocks, each one's input per micro-batch: 28 MiB, held in 32 MiB pinned blocks
    assert parked_bytes(seven_b, cfg("qwen2.5-7b", 4096, 16)) == 29 * 16 * 32 * 2**20
    for accum in (16, 32):
        with pytest.raises(PlanError, match="train.grad_accum"):
            check_parked_fit(seven_b, cfg("qwen2.5-7b", 4096, accum), headroom, "the GPU node")
    check_parked_fit(seven_b, cfg("qwen2.5-7b", 4096, 8), headroom, "the GPU node")
    # the 1.5B run at 512k tokens that did fit, beside 20 GiB of state
    check_parked_fit(PRESETS["qwen2.5-1.5b"], cfg("qwen2.5-1.5b", 524288, 1), int(96 * GiB), "the GPU node")


def test_several_gpus_split_the_activations_and_multiply_the_host_reads():
    """Per device: the boundary activations of its share of the micro-batches, one more fp32 layer
    in flight while it is summed across the GPUs; per step: every GPU reads every layer."""
    from megatrain_ray.models.registry import PRESETS

    one, two = gpu_plan(ARCH, config(), num_gpus=1), gpu_plan(ARCH, config(), num_gpus=2)
    key = "boundary activations (input of every layer, every micro-batch)"
    assert two.by_use[key] * 2 == one.by_use[key]
    assert two.by_use["weight slots"] == one.by_use["weight slots"]
    assert "gradient being summed across the GPUs (fp32, one layer)" in two.by_use
    assert "gradient being summed across the GPUs (fp32, one layer)" not in one.by_use

    seven_b = PRESETS["qwen2.5-7b"]

    def cfg(accum):
        return config_from_dict({"model": {"preset": "qwen2.5-7b"}, "data": {"seq_len": 4096},
                                 "train": {"micro_batch_size": 4, "grad_accum": accum}})

    alone, pair = predict_step(seven_b, cfg(8), num_gpus=1), predict_step(seven_b, cfg(16), num_gpus=2)
    assert pair.tokens == 2 * alone.tokens == 2 * 131072
    assert pair.compute_s == pytest.approx(alone.compute_s)  # the same tokens per GPU
    assert pair.host_read_bytes == 2 * alone.host_read_bytes == 4 * 2 * num_params(seven_b)
    assert pair.busy_tokens == pytest.approx(2 * alone.busy_tokens, abs=2)
    assert alone.bound == pair.bound == "compute" and pair.step_s == pytest.approx(alone.step_s)
    # 65,536 tokens a step over two GPUs: half the compute each, the optimizer no longer hidden
    short = predict_step(seven_b, cfg(4), num_gpus=1)
    halved = predict_step(seven_b, cfg(4), num_gpus=2)
    assert halved.compute_s == pytest.approx(short.compute_s / 2) and halved.bound == "host optimizer"
    assert halved.tokens / halved.step_s < 1.9 * short.tokens / short.step_s
