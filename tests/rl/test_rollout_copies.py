"""Several copies of the rollout in Ray actors (runtime/grpo_steps.py, RemoteRollout), a step's prompts split
between them in order: every copy draws the step's random numbers and takes its rows', so they
sample what one copy samples from all the prompts (the same tokens; log-probabilities within fp32's
rounding, each copy's batch padded to its own longest prompt), step after step, and their
generators stay in the one copy's state."""

import numpy as np
import pytest
import ray
import torch

from megatrain_ray.rl.rollout import CopyTiming, Rollout, Sampling, overlap, prompt_parts
from megatrain_ray.runtime.grpo_steps import RemoteRollout
from helpers.threads import one_thread  # noqa: F401 (a fixture)

transformers = pytest.importorskip("transformers")


class Copies:
    """What RemoteRollout asks of a run's session: its rollout actors, a wait and their weights' load."""

    def __init__(self, actors, weights):
        self.rollouts, self.weights = actors, weights

    def wait(self, refs, what):
        return ray.get(refs)

    def refresh_rollouts(self):
        ray.get([actor.load.remote(self.weights) for actor in self.rollouts])


def tiny_weights():
    from megatrain_ray.models.registry import arch_from_hf_config, model_layouts

    config = transformers.Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    arch = arch_from_hf_config(model.config.to_dict())
    state = model.state_dict()
    return arch, [(layout.index, torch.cat([state[layout.hf_name(p.name)].reshape(-1) for p in layout.params]))
                  for layout in model_layouts(arch)]


@pytest.fixture(scope="module")
def rollouts(local_ray):
    """The tiny model's weights and three copies of its rollout in actors, for the module: each actor
    is a process that imports torch (seconds on 2 cores). Each test loads the weights and sets what it
    compares (the sampler's state) itself."""
    arch, weights = tiny_weights()
    actors = [ray.remote(num_cpus=0)(Rollout).remote(arch, torch.float32, torch.device("cpu"), 11) for _ in range(3)]
    try:
        yield arch, weights, actors
    finally:
        for actor in actors:
            ray.kill(actor)


def test_prompt_parts_split_in_order_as_even_as_they_go():
    assert prompt_parts(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert prompt_parts(4, 2) == [(0, 2), (2, 4)]
    assert prompt_parts(2, 1) == [(0, 2)]


@pytest.mark.usefixtures("one_thread")
def test_three_copies_sample_what_one_samples(rollouts):
    """Fresh copies: their generators are seeded as the one copy's (seed 11) and not drawn from yet."""
    arch, weights, actors = rollouts
    gen = np.random.default_rng(0)
    steps = [[gen.integers(0, 96, n) for n in lengths] for lengths in ((3, 7, 5, 2, 6), (4, 4, 9, 1, 5))]
    sampling = Sampling(max_new_tokens=8, temperature=0.9, top_p=0.95, eos_id=7)
    one = Rollout(arch, torch.float32, torch.device("cpu"), seed=11)
    one.load(weights)
    expected = [one.sample_scored(prompts, 3, sampling) for prompts in steps]
    copies = RemoteRollout(Copies(actors, weights))
    copies.refresh(None)
    for prompts, (completions, logprobs, _) in zip(steps, expected, strict=True):
        got, scores, times = copies.sample_scored(prompts, 3, sampling)
        assert [c.tolist() for c in got] == [c.tolist() for c in completions]
        assert all(np.abs(a - b).max() < 1e-5 for a, b in zip(scores, logprobs, strict=True))
        # each copy's timing, in the copies' order: its share's tokens, decode steps within the longest
        shares = [got[3 * start:3 * end] for start, end in prompt_parts(len(prompts), 3)]
        assert [t.tokens for t in times] == [sum(map(len, share)) for share in shares]
        assert all(t.seconds > t.prefill_seconds > 0 and 1 <= t.decode_steps <= 7 and 0 < t.cpu_share for t in times)
    assert any(len(c) < 8 for c in got) and any(len(c) == 8 for c in got)  # some ended at the EOS
    assert copies.sampler_state() == one.sampler_state()
    assert len({ray.get(a.sampler_state.remote()) for a in actors}) == 1
    # unscored, and two copies of three prompts: the same again
    again = Rollout(arch, torch.float32, torch.device("cpu"), seed=5)
    again.load(weights)
    copies.set_sampler_state(again.sampler_state())
    copies.actors = actors[:2]
    got, _, times = copies.sample_scored(steps[0][:3], 2, sampling, scored=False)
    assert len(times) == 2
    assert [c.tolist() for c in got] == [c.tolist() for c in again.sample(steps[0][:3], 2, sampling)[0]]


def test_overlap_is_the_share_of_the_longest_copy_they_all_sampled():
    assert overlap([CopyTiming(0.0, 4.0, 1, 0.0, 1, 0.0)]) == 1.0
    assert overlap([CopyTiming(0.0, 4.0, 1, 0.0, 1, 0.0), CopyTiming(1.0, 3.0, 1, 0.0, 1, 0.0)]) == 0.5
    assert overlap([CopyTiming(0.0, 2.0, 1, 0.0, 1, 0.0), CopyTiming(2.0, 4.0, 1, 0.0, 1, 0.0)]) == 0.0  # one after the other
    assert CopyTiming(0.0, 2.5, 1, 0.5, 4, 2.0).ms_per_decode_step == 500.0
    assert CopyTiming(0.0, 2.5, 1, 0.5, 4, 2.0).cpu_share == 0.8


@pytest.mark.usefixtures("one_thread")
def test_copies_in_actors_sample_side_by_side(rollouts):
    """Two copies' shares of a step sample at the same time, each in its own process, not one after
    the other (RemoteRollout submits every copy's call, then waits for them all). Two of the module's
    copies: what they sampled before does not matter here."""
    _, weights, actors = rollouts
    copies = RemoteRollout(Copies(actors[:2], weights))
    copies.refresh(None)
    prompts = [np.random.default_rng(i).integers(0, 96, 6) for i in range(8)]
    _, _, times = copies.sample_scored(prompts, 8, Sampling(max_new_tokens=96))
    assert overlap(times) > 0.5, times
