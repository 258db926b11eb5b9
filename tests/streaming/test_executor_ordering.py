"""The executor's ordering rules, read off what it tells its hooks: copies, computes, releases
and gradients."""

from collections import Counter

import pytest

from megatrain_ray.config import config_from_dict
from megatrain_ray.models.registry import PRESETS
from megatrain_ray.models.registry import model_layouts
from megatrain_ray.runtime.local import LocalTrainer
from megatrain_ray.streaming.hooks import StepHooks
from helpers.reference_training import random_micro_batches

ARCH = PRESETS["tiny-llama"].replace(num_layers=5)


class Recorder(StepHooks):
    """Each event as (kind, slot, layer, the id of the event it names)."""

    def __init__(self):
        self.trace: list[tuple] = []

    def copy(self, slot, layer, waited_for):
        self.trace.append(("copy", slot, layer, getattr(waited_for, "id", None)))

    def compute(self, slot, layer):
        self.trace.append(("compute", slot, layer, None))

    def free(self, slot, layer, freed):
        self.trace.append(("free", slot, layer, getattr(freed, "id", None)))

    def gradient(self, layer):
        self.trace.append(("grad", None, layer, None))


def run_traced(grad_accum: int, steps: int = 2, num_slots: int = 2, arch=ARCH, keep_graphs: int = 0):
    config = config_from_dict({
        "model": {"preset": "tiny-llama", "compute_dtype": "float32"},
        "train": {"steps": steps, "grad_accum": grad_accum},
        "executor": {"device": "cpu", "num_slots": num_slots, "keep_graphs": keep_graphs},
    })
    hooks = Recorder()
    trace = hooks.trace
    trainer = LocalTrainer(config, arch, hooks=hooks)
    updates = Counter()
    update = trainer.source.update

    def counting_update(layer, hp, landed):
        updates[(hp.lr_position, layer)] += 1
        update(layer, hp, landed)

    trainer.source.update = counting_update
    steps_trace = []
    for micro_batches in random_micro_batches(arch, steps, grad_accum, batch=1, seq=8, seed=0):
        trace.clear()
        trainer.train_step(micro_batches)
        steps_trace.append(list(trace))
    trainer.close()
    return steps_trace, updates


@pytest.mark.parametrize("num_slots", [2, 3, 4])
def test_a_slot_is_refilled_only_after_the_compute_that_read_it_released_it(num_slots):
    traces, _ = run_traced(grad_accum=3, num_slots=num_slots, steps=3)
    last_free: dict[int, int] = {}  # across steps: a new step's copy waits on the last step's release
    reading: set[int] = set()  # slots acquired by a compute and not yet released
    copies = 0
    for trace in traces:
        for op, slot, layer, event in trace:
            if op == "compute":
                reading.add(slot)
            elif op == "free":
                reading.discard(slot)
                last_free[slot] = event
            elif op == "copy":
                copies += 1
                assert slot not in reading, f"slot {slot} refilled with layer {layer} while a compute reads it"
                assert event == last_free.get(slot), f"copy into slot {slot} did not wait for its last release"
    assert copies > 3 * len(model_layouts(ARCH)), "slots were reused"


@pytest.mark.parametrize("grad_accum", [1, 4])
def test_each_gradient_leaves_once_per_step_whatever_the_micro_batches(grad_accum):
    traces, updates = run_traced(grad_accum=grad_accum)
    layers = range(len(model_layouts(ARCH)))
    for trace in traces:
        sent = Counter(layer for op, _, layer, _ in trace if op == "grad")
        assert sent == Counter(layers)
    assert updates == Counter({(step, layer): 1 for step in (1, 2) for layer in layers})


def test_weights_cross_to_the_device_at_most_twice_per_step_whatever_the_micro_batches():
    copies = {}
    for grad_accum in (1, 4):
        traces, _ = run_traced(grad_accum=grad_accum, num_slots=3)
        copies[grad_accum] = [Counter(layer for op, _, layer, _ in t if op == "copy") for t in traces]
    assert copies[1] == copies[4]
    per_layer = copies[1][0]
    assert max(per_layer.values()) <= 2
    # the head and the last block stay resident across the turn from forward into backward
    last_block = ARCH.num_layers
    assert per_layer[last_block] == 1 and per_layer[last_block + 1] == 1


def test_blocks_that_keep_their_graphs_are_fetched_once_and_every_gradient_still_leaves_once():
    """Blocks 3-5 of 5 keep their forward graphs: their backward reads no slot, so they cross to the
    device once a step; blocks 1-2 are fetched again for their recompute (the embedding, alone in
    its size, keeps its own slot)."""
    traces, updates = run_traced(grad_accum=3, num_slots=2, keep_graphs=3)
    layers = range(len(model_layouts(ARCH)))
    for trace in traces:
        copies = Counter(layer for op, _, layer, _ in trace if op == "copy")
        assert [copies[layer] for layer in layers] == [1, 2, 2, 1, 1, 1, 1]
        computes = [layer for op, _, layer, _ in trace if op == "compute"]
        assert computes == [0, 1, 2, 3, 4, 5, 6, 2, 1, 0], "kept blocks acquire no slot in backward"
        assert Counter(layer for op, _, layer, _ in trace if op == "grad") == Counter(layers)
    assert updates == Counter({(step, layer): 1 for step in (1, 2) for layer in layers})


def test_a_layer_computes_before_the_host_waits_for_the_layers_after_it():
    """A copy ahead (which first waits for that layer's optimizer update) is issued only after the
    current compute is queued and released; the one exception is a copy of the very layer about to
    compute. So the device never idles while the host waits on a later layer."""
    traces, _ = run_traced(grad_accum=2, num_slots=3)
    for trace in traces:
        released_since_compute = False
        for i, (op, _, layer, _) in enumerate(trace):
            if op == "compute":
                released_since_compute = False
            elif op == "free":
                released_since_compute = True
            elif op == "copy":
                nxt = trace[i + 1]
                needed_now = nxt[0] == "compute" and nxt[2] == layer
                assert needed_now or released_since_compute, f"layer {layer} copied ahead before a compute was queued"
        first_compute = next(i for i, t in enumerate(trace) if t[0] == "compute")
        assert [t[2] for t in trace[:first_compute] if t[0] == "copy"] == [0]


def test_the_exposed_wait_is_split_where_it_happened():
    """Before the first layer computed, between layers and after the last: the three add up to the
    step's time outside compute, and a step does take time before its first layer (the batch)."""
    config = config_from_dict({
        "model": {"preset": "tiny-llama", "compute_dtype": "float32"},
        "train": {"steps": 2, "grad_accum": 2},
        "executor": {"device": "cpu"},
    })
    trainer = LocalTrainer(config, ARCH)
    results = [trainer.train_step(mbs) for mbs in random_micro_batches(ARCH, 2, 2, batch=1, seq=8, seed=0)]
    trainer.close()
    for r in results:
        waits = (r.wait_before_s, r.wait_between_s, r.wait_after_s)
        assert all(w >= 0 for w in waits) and r.wait_before_s > 0
        assert sum(waits) == pytest.approx(r.seconds - r.compute_s, abs=1e-6)


def test_the_host_messages_go_before_the_steps_on_a_device():
    """The host's updates leave in forward order, and a layer stepped on the device (the embedding)
    comes after them: its launches would let other workers' messages reach a store ahead of this
    worker's first layers (a store takes them as they come)."""
    config = config_from_dict({
        "model": {"preset": "tiny-llama", "compute_dtype": "float32"},
        "train": {"steps": 1, "grad_accum": 1},
        "executor": {"device": "cpu", "embedding_step": "device"},
    })
    trainer = LocalTrainer(config, ARCH)
    order = []
    update = trainer.source.update

    def recording_update(layer, hp, landed):
        order.append(layer)
        update(layer, hp, landed)

    trainer.source.update = recording_update
    try:
        trainer.train_step(random_micro_batches(ARCH, 1, 1, batch=1, seq=8, seed=0)[0])
    finally:
        trainer.close()
    layers = len(model_layouts(ARCH))
    assert order == [*range(1, layers), 0]
