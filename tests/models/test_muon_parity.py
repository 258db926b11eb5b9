"""optim.name muon against transformers' own models trained by torch.optim.Muon (the decoder blocks'
matrices) beside torch.optim.AdamW (everything else): a dense model, a mixture of experts with
stacked experts, and a model run through transformers' own modules (the generic family), 3 steps in
fp32 on the CPU, every tensor within 1e-5 of the reference's.

Why the learning rate is small: Muon's Newton-Schulz iteration runs in bf16 (torch's), and a
gradient that differs from the reference's in its last fp32 bits (other summation orders) now and
then rounds to another bf16 value, which changes that matrix's orthogonalized update by about 1%
(measured: 0.7 to 1.2% for one flipped input element). muon_lr 5e-5 keeps such flips' share of a
weight below 1e-5; a real error (a wrong momentum, Nesterov, scale or matrix split) moves the
weights by a good part of the whole update, 1e-4 of them and more.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

from megatrain_ray.models.registry import load_hf_arch  # noqa: E402
from helpers.hf_parity import (parity_config, rel, saved, steps_and_export, tiny_hf_model,  # noqa: E402
                               train_transformers)
from helpers.reference_training import random_micro_batches  # noqa: E402

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, intermediate_size=128)
DENSE = {
    "qwen2": (transformers.Qwen2Config, dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}), "eager"),
    "llama": (transformers.LlamaConfig, dict(rms_norm_eps=1e-5), "sdpa"),
}
STEPS = 3
MUON = dict(name="muon", muon_lr=5e-5, muon_weight_decay=0.1)
TOLERANCE = 1e-5
SEQ = 12
# Mixtral: the routers are compared without their mean over experts (`centred`), and within 3e-5 (measured
# worst 1.3e-5, the head's): see test_mixture_of_experts_muon_equals_torch_muon_per_expert
MOE_TOLERANCE = 3e-5


def train_both(tmp_path, model, implementation="auto", data_seed=2, **optim):
    """Our export after STEPS steps of optim.name muon, the transformers model after the reference's, the initial state."""
    model_dir = saved(model, tmp_path / "hf")
    arch = load_hf_arch(model_dir, implementation)
    config = parity_config(model_dir, steps=STEPS, **{**MUON, **optim})
    data = random_micro_batches(arch, STEPS, 2, batch=2, seq=SEQ, seed=data_seed)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    our_losses, export = steps_and_export(config, arch, model_dir, data, tmp_path / "export")
    losses = train_transformers(model, config, data)
    ours = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).state_dict()
    return our_losses, losses, ours, model.state_dict(), initial


def assert_same(ours, theirs, initial, tolerance=TOLERANCE, view=lambda name, t: t):
    """Every tensor within `tolerance` (relative, as `view(name, tensor)`), and every one trained."""
    assert set(ours) == set(theirs)
    for name, expected in theirs.items():
        error = rel(view(name, ours[name]), view(name, expected))
        assert error <= tolerance, f"{name}: {error:.3g} from torch.optim.Muon + AdamW's"
        assert not torch.equal(ours[name], initial[name]), f"{name} did not train"


def centred(name: str, t: torch.Tensor) -> torch.Tensor:
    """A router's weights less their mean over the experts, which its softmax ignores (adding one
    vector to every expert's row changes no logit difference): every row of a softmax router's
    gradient sums to zero over the experts, so that direction of Muon's update is the Newton-Schulz
    iteration's amplified bf16 rounding (measured: a quarter of the router's movement differs
    between two fp32 runs that differ in their last bits), in ours and in torch.optim.Muon alike."""
    return t - t.mean(0, keepdim=True) if name.endswith("mlp.gate.weight") else t


@pytest.mark.parametrize("family", DENSE)
def test_dense_muon_equals_torch_muon(tmp_path, family):
    our_losses, losses, ours, theirs, initial = train_both(tmp_path, tiny_hf_model(DENSE, TINY, family))
    for ours_loss, loss in zip(our_losses, losses, strict=True):
        assert ours_loss == pytest.approx(loss, rel=TOLERANCE)
    assert_same(ours, theirs, initial)


def test_mixture_of_experts_muon_equals_torch_muon_per_expert(tmp_path):
    """Mixtral's experts are stacked ([experts, rows, cols]): each expert's matrix is orthogonalized on
    its own. Top-k routing turns rounding into other choices, and Muon's normalised update makes each
    one count: 3e-5 (the dense models' last-bit flips of the Newton-Schulz input move the tokens'
    routing too), with the routers compared as their softmax reads them (`centred`)."""
    from test_moe_parity import tiny_moe

    model = tiny_moe("mixtral")
    assert any(p.dim() == 3 for p in model.parameters()), "the experts must be stacked"
    our_losses, losses, ours, theirs, initial = train_both(tmp_path, model)
    for ours_loss, loss in zip(our_losses, losses, strict=True):
        assert ours_loss == pytest.approx(loss, rel=TOLERANCE)
    assert_same(ours, theirs, initial, MOE_TOLERANCE, centred)


def test_transformers_modules_muon_equals_torch_muon(tmp_path):
    """The generic family (model.implementation transformers) lays its tensors out from transformers' modules."""
    our_losses, losses, ours, theirs, initial = train_both(tmp_path, tiny_hf_model(DENSE, TINY, "llama"), "transformers")
    for ours_loss, loss in zip(our_losses, losses, strict=True):
        assert ours_loss == pytest.approx(loss, rel=TOLERANCE)
    assert_same(ours, theirs, initial)
