"""The streaming trainer against whole-model autograd with torch.optim.AdamW (plain PyTorch around
the project's own layer code: helpers/reference_model.py): same weights, data and optimizer, fp32 on
the CPU, each within that run's own fp32 rounding of the fp64 result (helpers/reference_training.py)."""

import pytest
import torch

from megatrain_ray.streaming.device_step import DeviceStepSource
from megatrain_ray.planning.decisions import embedding_step_on_device
from megatrain_ray.planning.memory import PlanError
from megatrain_ray.models.registry import PRESETS
from helpers.reference_training import random_micro_batches, train_both
from helpers.runs import GRAD_ACCUM, STEPS, make_config


# Every family on one store; two stores (the layers split between them, the step's gradients and
# updates spread) where the split matters: a head tied to the embedding (Qwen3) and experts (Mixtral).
@pytest.mark.parametrize("preset,num_stores", [
    ("tiny-llama", 1), ("tiny-qwen2", 1), ("tiny-qwen3", 1), ("tiny-gemma3", 1), ("tiny-phi3", 1), ("tiny-mixtral", 1),
    ("tiny-qwen3-moe", 1), ("tiny-gpt-oss", 1), ("tiny-qwen3", 2), ("tiny-mixtral", 2)])
def test_streaming_matches_plain_pytorch(preset, num_stores):
    torch.manual_seed(0)
    config = make_config(preset)
    arch = PRESETS[preset]
    data = random_micro_batches(arch, STEPS, GRAD_ACCUM, batch=2, seq=12, seed=1)
    both = train_both(config, arch, data, num_stores)

    assert all(r.grad_norm > config.optim.grad_clip for r in both.results), "clipping must be active"
    both.assert_trains_like_plain_pytorch()


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

    train_both(config, arch, data, check=keeps).assert_trains_like_plain_pytorch()


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gemma3"])
def test_the_embedding_stepped_on_the_device_trains_like_plain_pytorch(preset):
    """executor.embedding_step: device (streaming/device_step.py) on the CPU executor: the embedding's state
    goes in, its AdamW step runs there, state and weights come back; untied (Llama) and tied to
    the head (Gemma 3), with clipping and weight decay. The store counts the updates it did not run,
    and its marker says its memory holds the last."""
    config = make_config(preset, embedding_step="device")
    arch = PRESETS[preset]
    data = random_micro_batches(arch, STEPS, GRAD_ACCUM, batch=2, seq=12, seed=7)
    trainers = []

    def on_device(trainer):
        assert isinstance(trainer.source, DeviceStepSource) and trainer.source.steps_on_device(0)
        assert not trainer.source.steps_on_device(1)
        trainers.append(trainer)

    train_both(config, arch, data, check=on_device).assert_trains_like_plain_pytorch()
    assert trainers[0].stores[0].update_counts()[0] == STEPS
    assert trainers[0].stores[0].held_counts() == {0: STEPS}  # its marker: the state its memory holds


def test_where_the_embedding_steps():
    """auto: on a GPU, where the worker that owns the embedding's gradient reaches the store's memory,
    however many data-parallel workers; device where it cannot run is refused with the reason, not
    quietly run on the host."""
    cuda, cpu = "cuda", "cpu"  # the device kind a worker reports
    assert embedding_step_on_device("auto", cuda, 1, in_reach=True)
    assert not embedding_step_on_device("auto", cpu, 1, in_reach=True)
    assert embedding_step_on_device("auto", cuda, 2, in_reach=True)
    assert not embedding_step_on_device("auto", cuda, 1, in_reach=False)
    assert not embedding_step_on_device("host", cuda, 1, in_reach=True)
    assert not embedding_step_on_device("host", cuda, 2, in_reach=True)
    assert embedding_step_on_device("device", cpu, 1, in_reach=True)
    assert embedding_step_on_device("device", cuda, 2, in_reach=True)
    with pytest.raises(PlanError, match="another node"):
        embedding_step_on_device("device", cuda, 2, in_reach=False)


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-gemma3", "tiny-phi3"])
def test_chunked_mlp_trains_like_plain_pytorch(preset):
    """Micro-batches of 24 tokens, MLP chunks of 7: the checkpointed chunks change nothing."""
    config = make_config(preset, mlp_chunk_tokens=7)
    arch = PRESETS[preset]
    data = random_micro_batches(arch, STEPS, GRAD_ACCUM, batch=2, seq=12, seed=4)
    train_both(config, arch, data).assert_trains_like_plain_pytorch()
