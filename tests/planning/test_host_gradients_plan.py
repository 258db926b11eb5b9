"""The vocabulary layers' gradients summed in host memory (executor.host_gradients), as the step plan
decides them: off wherever the step fits otherwise, on where it does not, so that Qwen2.5-7B trains
on a 10 GB-class card (and on an 8 GB one) in the 6-byte mode; what it costs is in the plan's memory
and step time, and a setting no layer can follow is refused."""

import dataclasses
from pathlib import Path

import pytest

from megatrain_ray.config import load_config
from megatrain_ray.models.registry import model_arch, model_layouts
from megatrain_ray.planning.prediction import predict_step
from megatrain_ray.planning.report import describe
from megatrain_ray.planning.memory import HOST_SUMMED_GRADIENT, PlanError, host_gradient_bytes
from megatrain_ray.planning.rates import named_rates
from megatrain_ray.planning.step_plan import DeviceFacts, plan_step

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
GiB = 1024**3
SIX_BYTES = ("optim.master=bf16", "optim.moments=int8")


def qwen7b(*sets: str):
    config = load_config(EXAMPLES / "qwen2.5-7b-10g.yaml", ["executor.gpu_memory_gib=null", *SIX_BYTES, *sets])
    return model_arch(config.model), config


def card(free_gib: float) -> DeviceFacts:
    return DeviceFacts("cuda", "NVIDIA GeForce RTX 3080", int(free_gib * GiB), 100 * GiB)


def with_setting(config, value):
    return config.replace(executor=dataclasses.replace(config.executor, host_gradients=value))


@pytest.mark.parametrize("free_gib", [9.5, 8.0])
def test_qwen2_5_7b_fits_a_10gb_class_card_with_its_vocabulary_gradients_in_host_memory(free_gib):
    arch, config = qwen7b()
    last = len(model_layouts(arch)) - 1
    step = plan_step(arch, config, card(free_gib))
    assert step.refused is None and step.host_gradients == (0, last) and step.memory.total <= free_gib * GiB
    assert "summed in host memory" in step.describe()
    vocab = model_layouts(arch)[last].numel  # 152,064 x 3,584 and the final norm
    assert step.memory.by_use[HOST_SUMMED_GRADIENT] < vocab * 4  # no fp32 accumulator of it on the device
    assert step.headroom > 0 and host_gradient_bytes(arch, step.planned_config(config)) == vocab * (4 + 2 * 2)
    text = describe(arch, config, step, rates=named_rates("rtx3080"))
    assert "the embedding's and the LM head's weight gradient summed in pinned host memory" in text
    assert "gradients summed in host memory" in text and " s (not hidden)" in text
    off = plan_step(arch, with_setting(config, False), card(free_gib), refuse=False)
    if free_gib == 8.0:  # without it the 7B does not fit the 8 GiB at all
        assert off.refused is not None and "gradient (fp32 accumulator" in off.refused


def test_a_step_that_fits_otherwise_keeps_its_gradients_on_the_device():
    arch, config = qwen7b()
    assert plan_step(arch, config, card(12.0)).host_gradients == ()  # a 12 GB card: chunks shrink instead
    forced = plan_step(arch, with_setting(config, True), card(12.0))
    assert forced.host_gradients != () and forced.planned_config(config).executor.host_gradients is True
    slower = predict_step(arch, forced.planned_config(config))
    faster = predict_step(arch, with_setting(forced.planned_config(config), False))
    assert slower.host_summed_s > 0 and slower.step_s > faster.step_s and faster.host_summed_s == 0


def test_a_setting_no_layer_can_follow_is_refused():
    tied = load_config(EXAMPLES / "qwen2.5-7b-10g.yaml", ["model.preset=qwen2.5-1.5b", "executor.host_gradients=true"])
    with pytest.raises(PlanError, match="executor.host_gradients is true but.*untied LM head"):
        plan_step(model_arch(tied.model), tied, card(9.5))


def test_a_capped_step_s_prediction_counts_its_parked_activations_and_its_smaller_loss_chunks():
    """What the plan decided for a 10 GB card costs time in its own prediction: the parked layer
    inputs cross the host link beside the weights (each layer's, each micro-batch's: exactly their
    bytes at the link's rate), and a loss chunk half as long sends the head's summed share twice as
    often (the embedding's stays one a micro-batch)."""
    arch, config = qwen7b("train.grad_accum=8")
    step = plan_step(arch, config, card(9.5))
    planned = step.planned_config(config)
    chunk = planned.executor.loss_chunk_tokens
    assert step.offload and planned.executor.offload_activations == "on" and chunk < 4096
    rates = named_rates("rtx3080")
    parked = predict_step(arch, planned, rates=rates)
    on_device = predict_step(arch, planned.replace(executor=dataclasses.replace(planned.executor, offload_activations="off")),
                             rates=rates)
    inputs = (len(model_layouts(arch)) - 1) * 8 * 4096 * arch.hidden_size * 2  # every layer's input, 8 micro-batches, bf16
    assert parked.h2d_s - on_device.h2d_s == pytest.approx(inputs / rates.h2d_bytes_per_s, rel=1e-12)
    halved = predict_step(arch, planned.replace(executor=dataclasses.replace(planned.executor, loss_chunk_tokens=chunk // 2)),
                          rates=rates)
    layouts = model_layouts(arch)
    embedding, head = layouts[0].numel, layouts[-1].numel
    shares = lambda chunk: 8 * (embedding + 4096 // chunk * head)  # noqa: E731 - params crossing a step
    assert halved.host_summed_s / parked.host_summed_s == pytest.approx(shares(chunk // 2) / shares(chunk), rel=1e-12)
    assert halved.step_s > parked.step_s
