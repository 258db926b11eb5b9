"""Validation through the streaming executor: forward only, the loss of the whole model in one forward
(helpers/reference_model.py, the project's layer code), and no
trace left on the training (weights, moments, schedule) - in one process, fp32 on the CPU."""

import pytest
import torch

from megatrain_ray.config import config_from_dict
from megatrain_ray.models.registry import PRESETS
from helpers.reference_model import ReferenceModel
from helpers.reference_training import reference_lr
from megatrain_ray.runtime.local import LocalTrainer
from helpers.reference_training import random_micro_batches
from helpers.runs import make_config


def reference_loss(arch, weights, batches) -> float:
    model = ReferenceModel(arch, [w.clone() for w in weights])
    with torch.no_grad():
        total = sum(float(model.loss_sum(mb)) for mb in batches)
    return total / sum(int((mb["labels"] != -100).sum()) for mb in batches)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])  # untied and tied LM head
def test_eval_loss_is_the_plain_pytorch_loss_and_leaves_training_untouched(preset):
    arch = PRESETS[preset]
    train = random_micro_batches(arch, 3, 2, batch=2, seq=12, seed=1)
    held_out = [mb for step in random_micro_batches(arch, 2, 3, batch=2, seq=12, seed=9) for mb in step]

    plain = LocalTrainer(make_config(preset, num_slots=2), arch, num_stores=2)
    for step in train:
        plain.train_step(step)
    expected = plain.layer_weights()
    plain.close()

    trainer = LocalTrainer(make_config(preset, num_slots=2), arch, num_stores=2)
    before = reference_loss(arch, trainer.layer_weights(), held_out)
    first = trainer.eval_loss(held_out)
    assert first.loss == pytest.approx(before, rel=1e-5)
    assert first.target_tokens == sum(int((mb["labels"] != -100).sum()) for mb in held_out)
    assert first.tokens == 6 * 2 * 12
    results = []
    for step in train:  # an evaluation after every step, each right behind the step's pending updates
        results.append(trainer.train_step(step))
        evaluation = trainer.eval_loss(held_out)
        assert evaluation.loss == pytest.approx(reference_loss(arch, trainer.layer_weights(), held_out), rel=1e-5)
    after = trainer.layer_weights()
    trainer.close()
    # it saw the trained weights: its loss is farther from the first evaluation's than the 1e-5 it
    # matches the reference by (three small steps move a random tiny model's loss by about 1e-4)
    assert evaluation.loss != pytest.approx(first.loss, rel=1e-5)
    config = make_config(preset, num_slots=2)
    assert [r.lr for r in results] == pytest.approx([reference_lr(config.optim, k, config.train.steps) for k in range(3)], rel=1e-12)
    for a, b in zip(after, expected, strict=True):  # bit for bit the weights of the run without evaluations
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_eval_loss_on_the_gpu_matches_plain_pytorch(dtype):
    """CUDA streams, compiled blocks and bf16 compute: the validation loss is the whole model's (under
    autocast for bf16) and the training after it is the training without it."""
    arch = PRESETS["tiny-qwen2"]
    config = config_from_dict({**make_config("tiny-qwen2", num_slots=2).to_dict(),
                               "model": {"preset": "tiny-qwen2", "compute_dtype": dtype, "init_std": 0.2},
                               "executor": {"device": "cuda", "loss_chunk_tokens": 5, "compile": True}})
    train = random_micro_batches(arch, 3, 2, batch=2, seq=12, seed=1)
    held_out = [mb for step in random_micro_batches(arch, 2, 3, batch=2, seq=12, seed=9) for mb in step]
    plain = LocalTrainer(config, arch)
    for step in train:
        plain.train_step(step)
    expected = plain.layer_weights()
    plain.close()

    trainer = LocalTrainer(config, arch)
    for step in train:
        trainer.train_step(step)
        evaluation = trainer.eval_loss(held_out)
    weights = trainer.layer_weights()
    trainer.close()
    model = ReferenceModel(arch, [w.clone() for w in weights]).cuda()
    autocast = torch.bfloat16 if dtype == "bfloat16" else None
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast is not None):
        total = sum(float(model.loss_sum({k: v.cuda() for k, v in mb.items()}, compute_dtype=autocast))
                    for mb in held_out)
    reference = total / sum(int((mb["labels"] != -100).sum()) for mb in held_out)
    assert evaluation.loss == pytest.approx(reference, rel=1e-4 if dtype == "float32" else 2e-2)
    for a, b in zip(weights, expected, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)  # GPU kernels may differ run to run in the last bits
