"""The rollout's side: transformers' copy of the policy loaded from the stores, the streamed forward
and the streamed reference (model.path, from host memory) score every completion token as
transformers' own model does; sampling (top-p, EOS, the generator's state) does what it says."""

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from megatrain_ray.config import config_from_dict
from megatrain_ray.files import shard
from megatrain_ray.models.registry import arch_from_hf_config, load_hf_arch, model_layouts
from megatrain_ray.rl.batch import policy_micro_batches
from megatrain_ray.rl.decoding import DynamicDecoding, StaticDecoding
from megatrain_ray.rl.rollout import Rollout, Sampling, completion, label_logprobs_of, left_padded, sample_tokens
from megatrain_ray.runtime.local import LocalTrainer
from helpers.hf_parity import flat_weights
from helpers.reference_training import random_micro_batches
from helpers.threads import one_thread  # noqa: F401 (a fixture)

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    config = transformers.Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    directory = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.mark.usefixtures("one_thread")
def test_the_rollout_copy_and_the_streamed_reference_score_like_transformers(tiny_qwen2):
    """The rollout's copy, loaded from the stores, and the streamed forward score every completion
    token as transformers' own model read from model.path does; after an update moves the policy,
    the reference, streamed from its copy of model.path in host memory, still does."""
    arch = load_hf_arch(tiny_qwen2)
    config = config_from_dict({"model": {"path": str(tiny_qwen2), "compute_dtype": "float32"},
                               "optim": {"lr": 1e-2}, "executor": {"device": "cpu", "loss_chunk_tokens": 7}})
    trainer = LocalTrainer(config, arch)
    try:
        for store in trainer.stores:
            shard.load_hf(store, str(tiny_qwen2))
        rollout = Rollout(arch, torch.float32, torch.device("cpu"), seed=0)
        rollout.load(trainer.rollout_weights())
        prompts = [np.array([5, 9, 2]), np.array([7, 1, 4, 8, 3])]
        completions, _ = rollout.sample(prompts, 3, Sampling(max_new_tokens=5))
        mbs = policy_micro_batches([p for p in prompts for _ in range(3)], completions, [0.0] * 6, "token", 5, 4)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
        expected = label_logprobs_of(hf, mbs, torch.device("cpu"))

        def assert_scores_like_transformers(scores, what):
            for mb, ours, theirs in zip(mbs, scores, expected, strict=True):
                at = mb["labels"] >= 0
                assert np.abs(ours[at] - theirs[at]).max() < 1e-5, what  # fp32 rounding: 5e-7 measured
                assert (ours[~at] == 0).all(), what

        assert_scores_like_transformers(trainer.token_logprobs(mbs), "streamed policy")
        assert_scores_like_transformers(rollout.policy_logprobs(mbs), "rollout copy")
        trainer.train_step(random_micro_batches(arch, 1, 1, batch=2, seq=8, seed=0)[0])
        moved = trainer.token_logprobs(mbs)
        assert max(np.abs(a - b).max() for a, b in zip(moved, expected, strict=True)) > 1e-3, "the update moved the policy"
        assert_scores_like_transformers(trainer.reference_logprobs(mbs), "streamed reference")
    finally:
        trainer.close()
    assert [len(c) for c in completions] == [5] * 6  # no EOS given: every completion runs to max_new_tokens


def sampled_and_scored(arch, weights, resident_layers, device=torch.device("cpu"), dtype=torch.float32):
    rollout = Rollout(arch, dtype, device, seed=0, resident_layers=resident_layers)
    rollout.load(weights)
    prompts = [np.array([5, 9, 2]), np.array([7, 1, 4, 8, 3]), np.array([11])]
    completions, _ = rollout.sample(prompts, 3, Sampling(max_new_tokens=6, temperature=0.9, top_p=0.95))
    mbs = policy_micro_batches([p for p in prompts for _ in range(3)], completions, [0.0] * 9, "token", 6, 4)
    return rollout, completions, rollout.policy_logprobs(mbs)


@pytest.mark.usefixtures("one_thread")
def test_a_streamed_rollout_samples_and_scores_as_the_resident_one():
    """With 1 of its 3 decoder layers resident, or none, the rollout streams the others through
    two slots at every forward and samples the same tokens from the same generator, with the same
    log-probabilities, bit for bit: on the CPU in fp32 the arithmetic is the same. Its prompts'
    forward in chunks of a few columns (left-padded rows) gives transformers' own logits."""
    config = transformers.Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    arch = arch_from_hf_config(model.config.to_dict())
    weights = flat_weights(model, arch)
    _, resident, resident_scores = sampled_and_scored(arch, weights, None)
    for kept in (1, 0):
        rollout, streamed, scores = sampled_and_scored(arch, weights, kept)
        assert rollout.streamed_layers() == list(range(1 + kept, 4))
        slots = {slot.untyped_storage().data_ptr() for slot in rollout.stream.slots}
        for layer in rollout.streamed_layers():  # no memory of their own: views into the two slots
            module = rollout.model.get_submodule(f"model.layers.{layer - 1}")
            assert {p.untyped_storage().data_ptr() for p in module.parameters()} <= slots
        assert all((a == b).all() for a, b in zip(streamed, resident, strict=True)), kept
        assert all(np.array_equal(a, b) for a, b in zip(scores, resident_scores, strict=True)), kept
    assert len({len(c) for c in resident}) == 1 and len(resident) == 9
    # the prompts' forward 1 or 2 columns at a time (9 rows: 9 or 18 tokens a forward) as in one:
    # the next token's logits as transformers' own forward of the padded batch gives them, within
    # fp32's rounding (the same sums blocked otherwise)
    rows = [np.array(p) for p in ([5, 9, 2], [7, 1, 4, 8, 3], [11])]
    ids, mask, positions = left_padded(rows, torch.device("cpu"))
    expected = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1]
    rollout = Rollout(arch, torch.float32, torch.device("cpu"), seed=0, resident_layers=1)
    rollout.load(weights)
    for tokens in (3, 6):
        for decoding in (StaticDecoding(rollout.model, mask, 1, None, prefill_tokens=tokens),
                         DynamicDecoding(rollout.model, mask, tokens)):
            logits = decoding.prefill(ids, positions)
            assert (logits - expected).abs().max() < 1e-5, (tokens, type(decoding).__name__)


def test_top_p_keeps_the_nucleus_and_each_row_draws_from_its_own_number():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9], [5.0, 0.0, 0.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_tokens(logits, 1.0, 0.5, torch.rand(2, generator=gen)) for _ in range(200)])
    assert set(draws[:, 0].tolist()) == {1, 3} and set(draws[:, 1].tolist()) == {0}  # 1 and 3 hold half the mass
    assert set(torch.stack([sample_tokens(logits, 1.0, 1e-6, torch.rand(2, generator=gen))
                            for _ in range(20)])[:, 0].tolist()) == {1}
    # the token where the row's cumulative probability passes its number, and the last possible one at the top
    probs = torch.softmax(logits, dim=-1)
    assert sample_tokens(logits, 1.0, 1.0, torch.tensor([0.0, 0.0])).tolist() == [0, 0]
    just_past = probs[0, :2].sum().item() + 1e-6
    assert sample_tokens(logits, 1.0, 1.0, torch.tensor([just_past, 0.999999])).tolist() == [2, 3]
    assert sample_tokens(logits, 1.0, 0.5, torch.tensor([1.0, 1.0])).tolist() == [3, 0]  # past the top: the last kept
    # as often as its probability, as torch.multinomial draws
    many = sample_tokens(logits[:1].expand(20000, 4), 1.0, 1.0, torch.rand(20000, generator=gen))
    assert (torch.bincount(many, minlength=4) / 20000 - probs[0]).abs().max() < 0.015
    # a row's token is its own: the same with the other rows gone
    one = sample_tokens(logits[1:], 1.0, 1.0, torch.tensor([0.3]))
    assert sample_tokens(logits, 1.0, 1.0, torch.tensor([0.7, 0.3]))[1:].tolist() == one.tolist()


def test_a_completion_ends_with_its_first_eos():
    assert completion(np.array([4, 2, 9, 2, 0]), eos_id=2).tolist() == [4, 2]
    assert completion(np.array([4, 5, 6]), eos_id=2).tolist() == [4, 5, 6]


@pytest.mark.gpu
def test_the_rollout_samples_on_cuda_in_bf16_and_frees_its_cache(tiny_qwen2):
    """On a GPU: the bf16 copy decodes there, its generator's state replays the same completions,
    the decoding's memory goes back after each sampling (the weights stay), and it scores the
    completions as the streamed forward does within bf16's rounding."""
    arch = load_hf_arch(tiny_qwen2)
    config = config_from_dict({"model": {"path": str(tiny_qwen2), "compute_dtype": "float32"},
                               "executor": {"device": "cpu"}})
    trainer = LocalTrainer(config, arch)
    try:
        for store in trainer.stores:
            shard.load_hf(store, str(tiny_qwen2))
        device = torch.device("cuda")
        rollout = Rollout(arch, torch.bfloat16, device, seed=0)
        rollout.load(trainer.rollout_weights())
        prompts = [np.arange(3, 3 + n) for n in (4, 7, 2)]
        # a first sampling leaves what stays for the process's life: cuBLAS's workspace (32 MiB on an
        # H200, from torch's allocator), which the H200 run of 2026-11-26 counted against the bound
        rollout.sample(prompts, 1, Sampling(max_new_tokens=2))
        before = torch.cuda.memory_allocated(device)
        state = rollout.sampler_state()
        completions, seconds = rollout.sample(prompts, 4, Sampling(max_new_tokens=16, temperature=0.8, top_p=0.9))
        assert torch.cuda.memory_allocated(device) <= before  # the KV cache and the sampler's tensors are gone
        assert [len(c) for c in completions] == [16] * 12 and seconds > 0
        rollout.set_sampler_state(state)
        again, _ = rollout.sample(prompts, 4, Sampling(max_new_tokens=16, temperature=0.8, top_p=0.9))
        assert all((a == b).all() for a, b in zip(completions, again, strict=True))
        mbs = policy_micro_batches([p for p in prompts for _ in range(4)], completions, [0.0] * 12, "token", 16, 6)
        for mb, ours, theirs in zip(mbs, trainer.token_logprobs(mbs), rollout.policy_logprobs(mbs), strict=True):
            at = mb["labels"] >= 0
            assert np.abs(ours[at] - theirs[at]).max() < 0.1  # bf16 logits against fp32
    finally:
        trainer.close()


@pytest.mark.gpu
def test_a_streamed_rollout_on_cuda_in_bf16_samples_as_the_resident_one():
    """On a GPU in bf16: with 1 of 3 decoder layers resident the others stream through two slots
    on a side stream, read in place from page-locked shared memory (as the rollout's actor maps
    the stores' compute copies), and the copy samples the same tokens with the same
    log-probabilities as the resident one: the same kernels on the same values (the slots' views
    are as aligned as the tiny shapes' own tensors). Its device memory is the resident copy's less
    the streamed layers, plus the two slots."""
    from megatrain_ray.host.memory import cuda_host_register, cuda_host_unregister, shm_tensor

    config = transformers.Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    arch = arch_from_hf_config(model.config.to_dict())
    weights = []
    # in /dev/shm, as the stores' segments are (a file on another file system may not page-lock:
    # cudaHostRegister refused one in the pytest temporary directory of the GPU machine)
    segments = Path(tempfile.mkdtemp(prefix="mr-test-", dir="/dev/shm"))
    for layer, flat in flat_weights(model, arch):  # bf16 in shared memory, page-locked: read in place
        shared = shm_tensor(segments / f"layer{layer}", flat.numel(), torch.bfloat16, create=True)
        shared.copy_(flat)
        cuda_host_register(shared)
        weights.append((layer, shared))
    device = torch.device("cuda")
    try:
        # the first sampling leaves what stays for the process's life (cuBLAS's workspace): not counted
        _, tokens, scores = sampled_and_scored(arch, weights, None, device, torch.bfloat16)
        used = {}
        for kept in (None, 1, 0):
            before = torch.cuda.memory_allocated(device)
            rollout, sampled, sampled_scores = sampled_and_scored(arch, weights, kept, device, torch.bfloat16)
            used[kept] = torch.cuda.memory_allocated(device) - before
            assert all((a == b).all() for a, b in zip(sampled, tokens, strict=True)), kept
            assert all(np.array_equal(a, b) for a, b in zip(sampled_scores, scores, strict=True)), kept
            if kept is not None:
                assert rollout.streamed_layers() == list(range(1 + kept, 4)) and rollout.stream.owned == {}  # in place
                assert [host.data_ptr() for host in rollout.stream.host] == \
                    [weights[i][1].data_ptr() for i in rollout.streamed_layers()]
            del rollout
        # none resident: three layers out, two slots in (the allocator rounds each resident tensor up to 512 bytes)
        assert used[None] - used[0] >= model_layouts(arch)[1].numel * 2
    finally:
        for _, shared in weights:
            cuda_host_unregister(shared)
        shutil.rmtree(segments)
