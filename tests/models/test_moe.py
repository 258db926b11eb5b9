"""Mixture-of-experts pieces that need no transformers model: the presets' shapes, the grouped
matmul's calling convention, chunked experts, the planner's memory and FLOPs, the config knob."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatrain_ray.config import ConfigError, config_from_dict
from megatrain_ray.models import moe
from megatrain_ray.models.registry import PRESETS, family, model_arch, model_layouts, num_params
from megatrain_ray.planning.memory import gpu_plan, num_slots_setting
from megatrain_ray.planning.prediction import predict_step
from helpers.reference_training import random_micro_batches, train_both
from helpers.runs import make_config


# Published sizes (model cards): total parameters, active ones per token, and whether that count
# includes the input embedding (Mistral's and Qwen's do, OpenAI's does not).
PUBLISHED = {
    "mixtral-8x7b": (46.7e9, 12.9e9, True),
    "qwen3-30b-a3b": (30.5e9, 3.3e9, True),
    "qwen3-235b-a22b": (235e9, 22e9, True),
    "gpt-oss-20b": (20.91e9, 3.61e9, False),
    "gpt-oss-120b": (116.83e9, 5.13e9, False),
}


@pytest.mark.parametrize("preset", PUBLISHED)
def test_presets_have_the_published_sizes(preset):
    arch = PRESETS[preset]
    total, active, with_embedding = PUBLISHED[preset]
    embed = arch.vocab_size * arch.hidden_size if with_embedding else 0
    assert num_params(arch) == pytest.approx(total, rel=0.01)
    assert family(arch).matmul_params(arch) + embed == pytest.approx(active, rel=0.03)


def test_the_benchmark_moe_fits_the_gpu_machine_host_memory():
    """14 bytes a parameter (bf16 compute): below the 7B dense preset, which fits 128 GiB."""
    arch = PRESETS["qwen3-moe-7b"]
    assert 6.5e9 < num_params(arch) < num_params(PRESETS["qwen2.5-7b"])
    assert 14 * num_params(arch) < 100 * 2**30


def dispatch_for(experts_per_row: torch.Tensor, num_experts: int) -> moe.Dispatch:
    return moe.dispatch(experts_per_row, num_experts)


def test_grouped_mm_convention_matches_the_loop_over_experts():
    """torch's grouped_mm (the CUDA bf16 path) and the per-expert loop agree on the same sorted
    rows, offsets and a transposed (nn.Linear-layout) weight view; one expert gets no token."""
    torch.manual_seed(0)
    n, k, e, h, i = 24, 2, 4, 32, 16
    chosen = torch.randint(0, e - 1, (n, k))  # expert e-1 unused
    d = dispatch_for(chosen, e)
    assert int(d.counts[-1]) == 0 and int(d.counts.sum()) == n * k
    x = torch.randn(n, h)[d.token].bfloat16()
    weight = torch.randn(e, i, h).bfloat16()  # [E, out, in]
    looped = moe.grouped_mm(x, weight.transpose(1, 2), d)  # on the CPU: the loop
    grouped = F.grouped_mm(x, weight.transpose(1, 2), offs=d.offsets)
    assert torch.allclose(looped.float(), grouped.float(), rtol=2e-2, atol=2e-2)
    reference = torch.stack([x[r].float() @ weight[d.expert[r]].float().T for r in range(n * k)])
    assert torch.allclose(looped.float(), reference, rtol=2e-2, atol=5e-2)


def test_combine_puts_each_tokens_experts_back_in_place():
    torch.manual_seed(1)
    n, k, e, h = 10, 3, 5, 4
    chosen = torch.stack([torch.randperm(e)[:k] for _ in range(n)])
    weights = torch.rand(n, k)
    d = dispatch_for(chosen, e)
    rows = torch.randn(n * k, h)  # row r: expert d.expert[r]'s output for token d.token[r]
    out = moe.combine(rows, weights, d, n, torch.float32)
    expected = torch.zeros(n, h)
    for r in range(n * k):
        expected[d.token[r]] += weights.reshape(-1)[d.slot[r]] * rows[r]
    assert torch.allclose(out, expected, atol=1e-6)


def moe_config(preset: str, coef: float | None, **executor):
    """helpers.runs.make_config with the auxiliary loss's coefficient and a gentler LR."""
    return make_config(preset, model={"router_aux_loss_coef": coef}, optim={"lr": 3e-3}, **executor)


@pytest.mark.parametrize("preset,keep", [("tiny-mixtral", 0), ("tiny-qwen3-moe", 0), ("tiny-gpt-oss", 0),
                                         ("tiny-mixtral", 1)])
def test_chunked_experts_with_the_auxiliary_loss_train_like_plain_pytorch(preset, keep):
    """Micro-batches of 24 tokens, expert chunks of 7 (each under a checkpoint, the load statistics
    summed over chunks), the auxiliary loss on, two stores: the same 3 steps as plain autograd. With
    `keep`, the last block differentiates its forward's graph, its statistics' included."""
    config = moe_config(preset, 0.1, mlp_chunk_tokens=7, keep_graphs=keep)
    arch = model_arch(config.model)
    assert family(arch).aux_loss_on(arch)
    data = random_micro_batches(arch, 3, 2, batch=2, seq=12, seed=4)
    train_both(config, arch, data, num_stores=2).assert_trains_like_plain_pytorch()


def test_router_aux_loss_coef_turns_the_loss_on_and_off_and_is_refused_for_dense_models():
    base = PRESETS["tiny-qwen3-moe"]
    assert base.aux_loss_coef == 0.0, "transformers' default: output_router_logits false"
    on = model_arch(moe_config("tiny-qwen3-moe", 0.25).model)
    assert on.aux_loss_coef == 0.25 and on.output_router_logits
    off = model_arch(moe_config("tiny-qwen3-moe", 0.0).model)
    assert off.aux_loss_coef == 0.0 and off.model_fields() == base.model_fields()
    with pytest.raises(ConfigError, match="mixture-of-experts models only"):
        model_arch(moe_config("tiny-qwen3", 0.1).model)
    with pytest.raises(ConfigError, match="router_aux_loss_coef must be a finite number >= 0"):
        moe_config("tiny-qwen3-moe", -1.0)


def test_a_layers_slot_holds_all_its_experts_and_compute_counts_the_routed_ones():
    config = config_from_dict({"model": {"preset": "qwen3-30b-a3b"}, "data": {"seq_len": 4096},
                               "train": {"micro_batch_size": 1, "grad_accum": 16}})
    arch = model_arch(config.model)
    block = model_layouts(arch)[1]
    experts = 3 * arch.num_experts * arch.expert_size * arch.hidden_size
    assert block.numel > experts
    plan = gpu_plan(arch, config)
    assert plan.by_use["weight slots"] >= num_slots_setting(config) * block.numel * 2
    # compute: the same as a dense model of the same active parameters, not of all of them
    dense = arch.dense_equivalent()
    mixed, twin = predict_step(arch, config), predict_step(dense, config.replace())
    assert mixed.compute_s == pytest.approx(twin.compute_s, rel=0.01)
    assert mixed.optimizer_s > 5 * twin.optimizer_s, "the host optimizer updates every expert"


@pytest.mark.parametrize("preset", ["tiny-mixtral", "tiny-qwen3-moe", "tiny-gpt-oss"])
def test_export_then_import_is_exact_across_shards_with_per_expert_names(tmp_path, preset):
    """Stacked experts leave as the released checkpoints store them (one tensor per expert for
    Mixtral and Qwen3-MoE), over several shards, and come back bit for bit."""
    from safetensors import safe_open

    from megatrain_ray.files.hf import CheckpointMismatch, export_hf, load_hf_weights
    from megatrain_ray.host.store import init_layer_weights

    arch = PRESETS[preset]
    layouts = model_layouts(arch)
    flats = []
    for layout in layouts:
        flat = torch.empty(layout.numel)
        init_layer_weights(family(arch), layout, flat, seed=5, std=0.3)
        flats.append(flat)
    out = export_hf(tmp_path / "hf", arch, enumerate(flats), max_shard_bytes=40_000)
    files = sorted(out.glob("*.safetensors"))
    assert len(files) > 2
    names = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names |= set(f.keys())
    per_expert = {"tiny-mixtral": "model.layers.0.block_sparse_moe.experts.3.w3.weight",
                  "tiny-qwen3-moe": "model.layers.0.mlp.experts.3.up_proj.weight",
                  "tiny-gpt-oss": "model.layers.0.mlp.experts.gate_up_proj"}[preset]
    assert per_expert in names and not any(n.endswith("experts.gate_up_proj") for n in names if preset != "tiny-gpt-oss")
    back = [torch.full((layout.numel,), float("nan")) for layout in layouts]
    load_hf_weights(out, arch, back.__getitem__)
    for a, b in zip(flats, back, strict=True):
        assert torch.equal(a, b)
    # a checkpoint of the model with another number of experts is refused before anything is copied
    with pytest.raises(CheckpointMismatch, match="num_experts"):
        load_hf_weights(out, arch.replace(num_experts=8), lambda i: torch.empty(0))


def test_a_checkpoint_resumes_under_another_auxiliary_loss_but_not_another_model(tmp_path):
    from megatrain_ray.files.checkpoint import CheckpointError, check_compatible

    arch = PRESETS["tiny-qwen3-moe"]
    meta = {"arch": arch.to_dict()}
    check_compatible(meta, arch.replace(router_aux_loss_coef=0.5, output_router_logits=True), tmp_path)
    with pytest.raises(CheckpointError, match="num_experts_per_tok is 2 there but 3 here"):
        check_compatible(meta, arch.replace(num_experts_per_tok=3), tmp_path)
