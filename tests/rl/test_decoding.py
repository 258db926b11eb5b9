"""The rollout's decoding (rl/decoding.py) against transformers' own forward without a cache: the
prompts' forward, a few columns at a time, and each decode step give the logits that one forward
of the whole left-padded batch gives, for every family the static decoding serves (its KV cache of
the full length and its own 4D mask) and for some it does not (transformers' DynamicCache: sliding
windows, ALiBi, linear attention), in transformers' default proportions and in others."""

import warnings

import numpy as np
import pytest
import torch

from megatrain_ray.models.transformers import modules as hm
from megatrain_ray.rl.decoding import STATIC_MODEL_TYPES, DynamicDecoding, StaticDecoding, decoding_for, static_applies
from megatrain_ray.rl.rollout import left_padded
from helpers.hf_parity import flat_weights, small_config_of, small_random_model
from helpers.threads import one_thread  # noqa: F401 (a fixture)

DYNAMIC = ("gemma2", "bloom", "opt", "qwen3_next")
STEPS = 3


def small_model(model_type: str, sizes: dict):
    return small_random_model(small_config_of(model_type, sizes=sizes)).eval()


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("sizes", [hm.SMALL, hm.OTHER_PROPORTIONS], ids=["small", "other"])
@pytest.mark.parametrize("model_type", STATIC_MODEL_TYPES + DYNAMIC)
def test_the_decoding_gives_the_logits_of_one_forward_without_a_cache(model_type, sizes):
    model = small_model(model_type, sizes)
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(1, vocab, (n,), generator=gen).numpy() for n in (4, 7, 1)]
    ids, mask, positions = left_padded(rows, torch.device("cpu"))
    fed = torch.randint(1, vocab, (len(rows), STEPS), generator=gen)
    decoding = decoding_for(model, mask, STEPS + 1, None, prefill_tokens=6)  # two columns a forward
    assert isinstance(decoding, StaticDecoding) == static_applies(model.config)
    assert isinstance(decoding, DynamicDecoding) or model_type in STATIC_MODEL_TYPES
    with torch.no_grad():
        got = [decoding.prefill(ids, positions)] + [decoding.step(fed[:, k]).clone() for k in range(STEPS)]
        width = ids.shape[1]
        expected = model(input_ids=torch.cat([ids, fed], dim=1),
                         attention_mask=torch.cat([mask, torch.ones_like(fed)], dim=1),
                         position_ids=torch.cat([positions, positions[:, -1:] + torch.arange(1, STEPS + 1)], dim=1),
                         use_cache=False).logits[:, width - 1:width + STEPS]
    got = torch.stack(got, dim=1)
    # fp32, the same sums in another order (a cache of the full length masks the slots not yet written)
    scale = expected.abs().max()
    assert ((got - expected).abs().max() / scale) < 1e-5, (got - expected).abs().max() / scale


def tiny_rollouts(model_type: str, **kinds):
    """Rollouts in bf16 on the GPU of one small model of `model_type`, the same weights, one for each
    keyword's `graphs`."""
    from megatrain_ray.models.registry import arch_from_hf_config
    from megatrain_ray.rl.rollout import Rollout

    model = small_model(model_type, hm.SMALL)
    arch = arch_from_hf_config(model.config.to_dict())
    rollouts = {}
    for name, graphs in kinds.items():
        rollouts[name] = Rollout(arch, torch.bfloat16, torch.device("cuda"), seed=0, graphs=graphs)
        rollouts[name].load(flat_weights(model, arch))
    return rollouts


def sampled(rollout):
    from megatrain_ray.rl.rollout import Sampling

    prompts = [np.arange(3, 3 + n) for n in (4, 9, 1)]
    completions, logprobs, _ = rollout.sample_scored(prompts, 4, Sampling(max_new_tokens=12, temperature=0.9,
                                                                          top_p=0.95))
    return completions, logprobs


def assert_same(ours, theirs):
    for what in range(2):  # the completions, then their log-probabilities
        assert all(np.array_equal(a, b) for a, b in zip(ours[what], theirs[what], strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", STATIC_MODEL_TYPES)
def test_a_decode_step_replayed_as_a_cuda_graph_samples_what_the_eager_step_samples(model_type):
    """On a GPU the static decoding's step is captured at a sampling's first step and replayed: the
    same kernels on the same values, so the same tokens and log-probabilities, bit for bit, as the
    step run eagerly; and again at the next sampling (a graph a sampling: the KV cache is the
    sampling's)."""
    rollouts = tiny_rollouts(model_type, graph=True, eager=False)
    assert "each decode step one CUDA graph" in rollouts["graph"].describe()
    assert "CUDA graph" not in rollouts["eager"].describe()
    for _ in range(2):
        assert_same(sampled(rollouts["graph"]), sampled(rollouts["eager"]))
    assert rollouts["graph"].graphs  # nothing refused the capture


@pytest.mark.gpu
def test_a_decode_step_that_cannot_be_captured_runs_eagerly_said_once():
    """A forward that reads a value back to the host (as a router may) cannot be captured: the
    rollout says so once and decodes eagerly from then on, the same completions."""
    rollouts = tiny_rollouts("qwen2", eager=False, refused=True)
    refused = rollouts["refused"]
    refused.model.model.norm.register_forward_hook(lambda module, args, out: None if out.float().sum().item() else None)
    with pytest.warns(UserWarning, match="could not be captured as a CUDA graph"):
        assert_same(sampled(refused), sampled(rollouts["eager"]))
    assert not refused.graphs and "CUDA graph" not in refused.describe()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same(sampled(refused), sampled(rollouts["eager"]))  # eager from then on, said once
