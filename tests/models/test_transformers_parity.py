"""The project's model against transformers' own: forward, loss, gradients, and 5 training steps.

Tiny random LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM (tied
embeddings), fp32 on the CPU, saved with save_pretrained and read back through the project's
Hugging Face import. The training comparison runs the streaming LocalTrainer (stores loaded with
files/shard.py: load_hf) beside a plain loop over the transformers model with torch.optim.AdamW, and
compares the project's export, loaded with from_pretrained, with the transformers model's state.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

from megatrain_ray.files import shard  # noqa: E402
from megatrain_ray.files.hf import export_hf  # noqa: E402
from megatrain_ray.models.registry import load_hf_arch  # noqa: E402
from helpers.reference_model import ReferenceModel  # noqa: E402
from megatrain_ray.runtime.local import LocalTrainer  # noqa: E402
from helpers.hf_parity import (RTOL, assert_bf16_tracks, assert_gradients_match, grads_by_hf_name, hf_flats,  # noqa: E402
                       bf16_cuda_config, hf_batch, local_steps, on_cuda, parity_config, rel, saved,
                               shifted, tiny_hf_model, train_transformers)
from helpers.reference_training import assert_within_fp32_noise, random_micro_batches  # noqa: E402

TINY = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=256, intermediate_size=128,
)
# family -> (config class, extra config, attention implementation): both of transformers' CPU
# attention paths are covered.
FAMILIES = {
    "llama": (transformers.LlamaConfig, dict(rms_norm_eps=1e-5), "eager"),
    "mistral": (transformers.MistralConfig, dict(sliding_window=None), "sdpa"),
    "qwen2": (transformers.Qwen2Config, dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}), "eager"),
    "qwen3": (transformers.Qwen3Config, dict(tie_word_embeddings=True), "sdpa"),
}
STEPS, GRAD_ACCUM, BATCH, SEQ = 5, 2, 2, 12


# ---------------------------------------------------------------------------------------------- a


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_loss_and_gradients_match_transformers(tmp_path, family):
    model = tiny_hf_model(FAMILIES, TINY, family)
    model_dir = saved(model, tmp_path / "hf")
    arch = load_hf_arch(model_dir)
    flats = hf_flats(model_dir, arch)
    ids, hf_labels = hf_batch()
    mb = shifted(ids, hf_labels)
    targets = int((mb["labels"] != -100).sum())

    # transformers: labels unshifted, shifted inside, mean over the target tokens
    model.train()  # dropout is 0 in these configs; train() only to be the mode one trains in
    out = model(input_ids=ids, labels=hf_labels)
    out.loss.backward()
    hf_grads = {name: p.grad for name, p in model.named_parameters()}

    ref = ReferenceModel(arch, flats)
    logits = ref(mb["input_ids"], mb["position_ids"])
    assert rel(logits.detach(), out.logits.detach()) < RTOL
    ref_loss = ref.loss_sum(mb) / targets
    assert float(ref_loss.detach()) == pytest.approx(float(out.loss.detach()), rel=RTOL)
    ref_loss.backward()

    assert_gradients_match(grads_by_hf_name(ref), hf_grads)  # the k_proj bias's true gradient is 0

    # the streaming executor on the same weights and batch: same loss, same gradient norm
    total = torch.sqrt(sum(g.double().pow(2).sum() for g in hf_grads.values()))
    result, = local_steps(parity_config(model_dir), arch, model_dir, [[mb]])
    assert result.loss == pytest.approx(float(out.loss.detach()), rel=RTOL)
    assert result.grad_norm == pytest.approx(float(total), rel=RTOL)


# ---------------------------------------------------------------------------------------------- b


@pytest.mark.parametrize("family", FAMILIES)
def test_five_steps_export_equals_transformers_adamw(tmp_path, family):
    model = tiny_hf_model(FAMILIES, TINY, family)
    model_dir = saved(model, tmp_path / "hf")
    arch = load_hf_arch(model_dir)
    config = parity_config(model_dir)
    data = random_micro_batches(arch, STEPS, GRAD_ACCUM, batch=BATCH, seq=SEQ, seed=2)
    initial = {k: v.clone() for k, v in model.state_dict().items()}

    trainer = LocalTrainer(config, arch, num_stores=2 if family == "qwen2" else 1)
    try:
        for store in trainer.stores:
            shard.load_hf(store, str(model_dir))
        results = [trainer.train_step(step) for step in data]
        export = export_hf(tmp_path / "export", arch, enumerate(trainer.layer_weights()))
    finally:
        trainer.close()

    # transformers' model trains in fp32 (what we compare with) and in fp64 (the exact result both round)
    exact_model = copy.deepcopy(model).double()
    ref_losses = train_transformers(model, config, data)
    exact_losses = train_transformers(exact_model, config, data)
    assert all(r.grad_norm > config.optim.grad_clip for r in results), "clipping must be active"
    for step, (r, plain, exact) in enumerate(zip(results, ref_losses, exact_losses, strict=True)):
        assert_within_fp32_noise(r.loss, plain, exact, f"loss of step {step}")

    exported = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    ours, theirs, exact = exported.state_dict(), model.state_dict(), exact_model.state_dict()
    assert set(ours) == set(theirs)
    for name, expected in theirs.items():
        assert_within_fp32_noise(ours[name], expected, exact[name], name)
        assert not torch.equal(ours[name], initial[name]), f"{name} did not train"
    if arch.tie_word_embeddings:
        assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()


# ---------------------------------------------------------------------------------------------- c


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bf16_on_the_gpu_tracks_transformers_autocast(tmp_path, family):
    steps = 6
    model = tiny_hf_model(FAMILIES, TINY, family)
    model_dir = saved(model, tmp_path / "hf")
    arch = load_hf_arch(model_dir)
    config = bf16_cuda_config(model_dir, steps, GRAD_ACCUM)
    data = random_micro_batches(arch, steps, GRAD_ACCUM, batch=2, seq=128, seed=0, distinct=4)

    ours = [r.loss for r in local_steps(config, arch, model_dir, data)]
    theirs = train_transformers(model.to("cuda"), config, on_cuda(data), autocast_dtype=torch.bfloat16)
    assert_bf16_tracks(family, ours, theirs)
