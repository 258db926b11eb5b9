"""The streaming trainer against plain PyTorch: same weights, data and optimizer, fp32 on the CPU."""

import pytest
import torch

from megatrain_ray.streaming.device_step import DeviceStepSource
from megatrain_ray.planning.plan import PlanError, embedding_step_on_device
from megatrain_ray.models.registry import PRESETS
from helpers.reference_training import random_micro_batches, relative_error, train_both
from helpers.runs import GRAD_ACCUM, STEPS, make_config


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3", "tiny-phi3", "tiny-mixtral",
                                    "tiny-qwen3-moe", "tiny-gpt-oss"])
@pytest.mark.parametrize("num_stores", [1, 2])
def test_streaming_matches_plain_pytorch(preset, num_stores):
    torch.manual_seed(0)
    config = make_config(preset)
    arch = PRESETS[preset]
    data = random_micro_batches(arch, STEPS, GRAD_ACCUM, batch=2, seq=12, seed=1)
    results, init, ours, ref_losses, ref_weights = train_both(config, arch, data, num_stores)

    assert all(r.grad_norm > config.optim.grad_clip for r in results), "clipping must be active"
    for r, ref in zip(results, ref_losses):
        assert r.loss == pytest.approx(ref, rel=1e-5)
    for i, (a, b) in enumerate(zip(ours, ref_weights)):
        assert relative_error(a, b) < 1e-5, f"layer {i}"
        assert not torch.equal(a, init[i]), f"layer {i} did not train"


@pytest.mark.parametrize("preset,keep", [("tiny-qwen2", 1), ("tiny-qwen2", 99), ("tiny-gemma3", 99),
                                         ("tiny-gpt-oss", 99)])
def test_blocks_that_keep_their_forward_graphs_train_like_plain_pytorch(preset, keep):
    """The last `keep` blocks (99: all of them) differentiate the graph of their forward instead of
    a recompute; Gemma 3 mixes sliding-window and global layers, so each keeps its own context."""
    config = make_config(preset, keep_graphs=keep)
    arch = PRESETS[preset]
    data = random_micro_batches(arch, STEPS, GRAD_ACCUM, batch=2, seq=12, seed=5)

    def keeps(trainer):
        assert len(trainer.executor.kept) == min(keep, arch.num_layers)

    results, _, ours, ref_losses, ref_weights = train_both(config, arch, data, check=keeps)
    assert [r.loss for r in results] == pytest.approx(ref_losses, rel=1e-5)
    for i, (a, b) in enumerate(zip(ours, ref_weights)):
        assert relative_error(a, b) < 1e-5, f"layer {i}"


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gemma3"])
def test_the_embedding_stepped_on_the_device_trains_like_plain_pytorch(preset):
    """executor.embedding_step: device (streaming/device_step.py) on the CPU executor: the embedding's state
    goes in, its AdamW step runs there, state and weights come back; untied (Llama) and tied to
    the head (Gemma 3), with clipping and weight decay. The store counts the updates it did not run."""
    config = make_config(preset, embedding_step="device")
    arch = PRESETS[preset]
    data = random_micro_batches(arch, STEPS, GRAD_ACCUM, batch=2, seq=12, seed=7)
    trainers = []

    def on_device(trainer):
        assert isinstance(trainer.source, DeviceStepSource) and trainer.source.steps_on_device(0)
        assert not trainer.source.steps_on_device(1)
        trainers.append(trainer)

    results, init, ours, ref_losses, ref_weights = train_both(config, arch, data, check=on_device)
    assert [r.loss for r in results] == pytest.approx(ref_losses, rel=1e-5)
    for i, (a, b) in enumerate(zip(ours, ref_weights)):
        assert relative_error(a, b) < 1e-5, f"layer {i}"
        assert not torch.equal(a, init[i]), f"layer {i} did not train"
    assert trainers[0].stores[0].update_counts()[0] == STEPS


def test_where_the_embedding_steps():
    """auto: on a GPU, with one worker that reaches the store's memory; device where it cannot run
    is refused with the reason, not quietly run on the host."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert embedding_step_on_device("auto", cuda, 1, in_reach=True)
    assert not embedding_step_on_device("auto", cpu, 1, in_reach=True)
    assert not embedding_step_on_device("auto", cuda, 2, in_reach=True)
    assert not embedding_step_on_device("auto", cuda, 1, in_reach=False)
    assert not embedding_step_on_device("host", cuda, 1, in_reach=True)
    assert embedding_step_on_device("device", cpu, 1, in_reach=True)
    with pytest.raises(PlanError, match="several data-parallel workers"):
        embedding_step_on_device("device", cuda, 2, in_reach=True)
    with pytest.raises(PlanError, match="another node"):
        embedding_step_on_device("device", cuda, 1, in_reach=False)


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-gemma3", "tiny-phi3"])
def test_chunked_mlp_trains_like_plain_pytorch(preset):
    """Micro-batches of 24 tokens, MLP chunks of 7: the checkpointed chunks change nothing."""
    config = make_config(preset, mlp_chunk_tokens=7)
    arch = PRESETS[preset]
    data = random_micro_batches(arch, STEPS, GRAD_ACCUM, batch=2, seq=12, seed=4)
    results, _, ours, ref_losses, ref_weights = train_both(config, arch, data)
    assert [r.loss for r in results] == pytest.approx(ref_losses, rel=1e-5)
    for a, b in zip(ours, ref_weights):
        assert relative_error(a, b) < 1e-5
