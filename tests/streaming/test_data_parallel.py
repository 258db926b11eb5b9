"""Several GPU workers, data parallel, on a real Ray cluster: the CPU path, over gloo, is the code
that runs over NCCL on GPUs. Two workers, each taking half of a step's micro-batches, train like
one worker taking all of them; each layer's gradient leaves once and each layer is updated once."""

import dataclasses
from pathlib import Path

import pytest
import ray
import torch

from megatrain_ray.files import checkpoint as ckpt
from megatrain_ray.config import ConfigError, config_from_dict
from megatrain_ray.streaming.data_parallel import layer_owners, split_micro_batches
from megatrain_ray.runtime.local import LocalTrainer
from megatrain_ray.models.registry import PRESETS, model_layouts
from megatrain_ray.runtime.session import Session
from megatrain_ray.runtime.training import run_training
from helpers.reference_training import random_micro_batches
from helpers.runs import as_stood_at, tensors_of, tiny_raw
from helpers.reference_training import relative_error
from helpers.runs import make_config
from helpers.sessions import layer_weights

STEPS, GRAD_ACCUM = 3, 4


def workers_config(preset: str, num_gpus: int, **executor):
    """One CPU thread per worker whatever their number: the CPU matmuls' blocking, and so their
    rounding, changes with the thread count, which is not what these tests compare."""
    config = make_config(preset, **executor)
    return config.replace(train=dataclasses.replace(config.train, grad_accum=GRAD_ACCUM),
                          runtime=dataclasses.replace(config.runtime, num_gpus=num_gpus, worker_threads=1))


def train(config, arch, data, wait=None):
    """Steps through a Session; returns the results, a validation loss after them, the final weights and
    each layer's update count."""
    session = Session(config, arch) if wait is None else Session(config, arch, wait=wait)
    try:
        session.init_weights()
        session.start_executor()
        results = [session.train_step(step) for step in data]
        evaluation = session.eval_loss(data[0][:3])  # three micro-batches: shares of 2 and 1
        weights = layer_weights(session)
        counts = {i: n for c in ray.get([s.update_counts.remote() for s in session.stores])
                  for i, n in c.items()}
    finally:
        session.close()
    return results, evaluation, weights, counts


def train_one(config, arch, data, order=None):
    """One worker in this process, on one thread like each Ray worker (workers_config): the executor
    a one-worker run builds (tests/runtime/test_ray_runtime.py: the two agree bit for bit). `order`
    sums each step's micro-batches in another order. Returns what `train` does, without the counts."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    trainer = LocalTrainer(config, arch)
    try:
        results = [trainer.train_step(step if order is None else [step[i] for i in order]) for step in data]
        return results, trainer.eval_loss(data[0][:3]), trainer.layer_weights()
    finally:
        trainer.close()
        torch.set_num_threads(threads)


def reordering_error(preset: str, arch, data, weights: list[torch.Tensor]) -> float:
    """How far one worker's weights (`weights`, summed in order) move when it sums the same
    micro-batches' gradients in other orders: the fp32 rounding the model amplifies. Three orders, the
    worst: each is one sample of that rounding, and two workers group the sum in a third way
    ((0 + 1) + (2 + 3)), which the one order [2, 3, 0, 1] alone bounded too tightly (two workers 1.08e-6
    off in layer 0 over a bound of 1e-6, on this code before and after)."""
    return max(relative_error(a, b) for order in ([2, 3, 0, 1], [1, 0, 3, 2], [3, 2, 1, 0])
               for a, b in zip(train_one(workers_config(preset, 1), arch, data, order=order)[2], weights, strict=True))


# qwen3: the head tied to the embedding, read twice a step, and stepped on a device (what a GPU does
# by default; here the CPU path of it); mixtral: routed experts and the auxiliary loss
@pytest.mark.parametrize("preset,embedding_step", [("tiny-llama", "host"), ("tiny-qwen3", "device"),
                                                   ("tiny-mixtral", "host")])
def test_two_workers_train_like_one_over_the_same_global_batch(local_ray, preset, embedding_step):
    """Within 1e-6 relative after 3 steps; for a mixture of experts, whose top-k routing turns
    rounding into other choices, within what one worker moves when it reorders its micro-batches.

    With the embedding stepped on a device, the worker that owns its summed gradient steps it there
    and sends the other its new weights over the group, against one worker stepping it on its device:
    its gradient never leaves a device, from the second step on no worker reads it from the host, and
    its store still receives its state and update count (what `train` reads back is the store's)."""
    arch = PRESETS[preset]
    layouts = model_layouts(arch)
    data = random_micro_batches(arch, STEPS, GRAD_ACCUM, batch=2, seq=12, seed=1)
    one, one_eval, one_weights = train_one(workers_config(preset, 1, embedding_step=embedding_step), arch, data)
    bound = max(1e-6, reordering_error(preset, arch, data, one_weights)) if preset == "tiny-mixtral" else 1e-6
    two, two_eval, two_weights, counts = train(workers_config(preset, 2, embedding_step=embedding_step), arch, data)

    assert [r.num_gpus for r in one + two] == [1] * STEPS + [2] * STEPS
    assert all(r.grad_norm > 0.5 for r in one), "clipping must be active (optim.grad_clip 0.5)"
    fp32 = 4  # bytes: the compute dtype of these runs
    leaving = layouts[1:] if embedding_step == "device" else layouts
    for a, b in zip(two, one, strict=True):
        assert a.loss == pytest.approx(b.loss, rel=1e-6, abs=0)
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-6, abs=0)
        assert (a.tokens, a.target_tokens) == (b.tokens, b.target_tokens)
        assert a.d2h_bytes == b.d2h_bytes == sum(layout.numel for layout in leaving) * fp32, \
            "each layer's gradient leaves one worker, once"
        assert a.h2d_bytes == 2 * b.h2d_bytes, "every worker reads every layer (but an embedding it was sent)"
    embedding_reads = one[0].h2d_bytes - one[1].h2d_bytes  # after the first step, not from the host
    assert embedding_reads % (layouts[0].numel * fp32) == 0 and (embedding_reads > 0) == (embedding_step == "device")
    assert two_eval.target_tokens == one_eval.target_tokens and two_eval.tokens == one_eval.tokens
    assert two_eval.loss == pytest.approx(one_eval.loss, rel=1e-6, abs=0)
    for i, (a, b) in enumerate(zip(two_weights, one_weights, strict=True)):
        assert relative_error(a, b) < bound, f"layer {i}: {relative_error(a, b)}"
    assert counts == {i: STEPS for i in range(len(layouts))}, "each layer updated once per step"


def test_two_workers_train_muon_like_one(local_ray):
    """optim.name muon: two workers, each block's Muon step sent by its owner, train like one worker;
    within 1e-5 (two workers sum the gradient in another order, and a last-bit difference now and then
    rounds to another bf16 input of Newton-Schulz: muon_lr 5e-5 keeps that below 1e-5, as in
    tests/models/test_muon_parity.py)."""
    arch = PRESETS["tiny-llama"]
    data = random_micro_batches(arch, STEPS, GRAD_ACCUM, batch=2, seq=12, seed=1)
    one_config, two_config = (workers_config("tiny-llama", n) for n in (1, 2))
    one_config, two_config = (c.replace(optim=dataclasses.replace(c.optim, name="muon", muon_lr=5e-5))
                              for c in (one_config, two_config))
    one, _, one_weights = train_one(one_config, arch, data)
    two, _, two_weights, counts = train(two_config, arch, data)
    for a, b in zip(two, one, strict=True):
        assert a.loss == pytest.approx(b.loss, rel=1e-6, abs=0)
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-6, abs=0)
    initial = LocalTrainer(one_config, arch)
    for i, (a, b, c) in enumerate(zip(two_weights, one_weights, initial.layer_weights(), strict=True)):
        assert relative_error(a, b) < 1e-5, f"layer {i}: {relative_error(a, b)}"
        assert not torch.equal(b, c), f"layer {i} did not train"
    initial.close()
    assert counts == {i: STEPS for i in range(len(model_layouts(arch)))}, "each layer updated once per step"


def test_two_workers_keeping_forward_graphs_train_like_one_recomputing(local_ray):
    """executor.keep_graphs reaches the Ray workers: two of them keeping every block's graph read
    each layer once a step (two slots: a recomputing block is read twice), and train like one
    worker that recomputes."""
    arch = PRESETS["tiny-llama"].replace(num_layers=5)
    data = random_micro_batches(arch, STEPS, GRAD_ACCUM, batch=2, seq=12, seed=2)
    recomputing, keeping = workers_config("tiny-llama", 1), workers_config("tiny-llama", 2)
    recomputing = recomputing.replace(executor=dataclasses.replace(recomputing.executor, num_slots=2))
    keeping = keeping.replace(executor=dataclasses.replace(keeping.executor, num_slots=2, keep_graphs=99))
    one, _, one_weights = train_one(recomputing, arch, data)
    two, _, two_weights, _ = train(keeping, arch, data)
    layers = len(model_layouts(arch))
    for a, b in zip(two, one, strict=True):
        assert a.loss == pytest.approx(b.loss, rel=1e-6, abs=0)
        assert b.weight_copies > layers and a.weight_copies == 2 * layers
    for i, (a, b) in enumerate(zip(two_weights, one_weights, strict=True)):  # two workers' sums round otherwise
        assert relative_error(a, b) < 1e-5, f"layer {i}: {relative_error(a, b)}"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_every_visible_gpu_over_nccl_trains_like_one(local_ray):
    """The same comparison on every visible GPU, 2, 3, 4 or more (NCCL; fp32 compute, no compile):
    run it on the GPU machine before timing anything there. Both step the embedding on a GPU
    (executor.embedding_step auto, streaming/device_step.py): one GPU its own, N GPUs on the one that
    owns its summed gradient, which broadcasts the new weights to the others. So in both the
    embedding's gradient (the tiny table's 64 KiB) never leaves a device, and from the second step
    on no GPU reads it from the host."""
    arch = PRESETS["tiny-qwen3"]
    layouts = model_layouts(arch)
    gpus = torch.cuda.device_count()
    data = random_micro_batches(arch, STEPS, 2 * gpus, batch=2, seq=12, seed=1)  # two micro-batches a GPU

    def on_cuda(num_gpus):
        config = workers_config("tiny-qwen3", num_gpus)
        return config.replace(train=dataclasses.replace(config.train, grad_accum=2 * gpus),
                              executor=dataclasses.replace(config.executor, device="cuda", compile=False))

    one, one_eval, one_weights, _ = train(on_cuda(1), arch, data)
    every, every_eval, every_weights, counts = train(on_cuda(gpus), arch, data)
    fp32 = 4  # bytes: the compute dtype of these runs
    for a, b in zip(every, one, strict=True):
        assert a.loss == pytest.approx(b.loss, rel=1e-5) and a.grad_norm == pytest.approx(b.grad_norm, rel=1e-5)
        assert a.d2h_bytes == b.d2h_bytes == sum(layout.numel for layout in layouts[1:]) * fp32
        assert a.h2d_bytes == gpus * b.h2d_bytes and a.num_gpus == gpus
    assert one[0].h2d_bytes > one[1].h2d_bytes == one[2].h2d_bytes  # the embedding read from the host once
    assert every_eval.loss == pytest.approx(one_eval.loss, rel=1e-5)
    for i, (a, b) in enumerate(zip(every_weights, one_weights, strict=True)):
        assert relative_error(a, b) < 1e-5, f"layer {i}: {relative_error(a, b)}"
    assert counts == {i: STEPS for i in range(len(layouts))}


def test_layer_owners_split_the_bytes_and_alternate():
    numels = [500, 100, 100, 100, 100, 100, 100, 500]  # embedding, 6 blocks, head
    owners = layer_owners(numels, 2)
    assert [sum(n for n, o in zip(numels, owners, strict=True) if o == r) for r in (0, 1)] == [800, 800]
    assert owners == [1, 1, 0, 1, 0, 1, 0, 0]  # head and embedding apart; blocks alternate, last first
    assert layer_owners([1] * 5, 1) == [0] * 5
    assert sorted(layer_owners([3] * 8, 4)) == [0, 0, 1, 1, 2, 2, 3, 3]
    shares = split_micro_batches(list(range(8)), 4)
    assert shares == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_micro_batches_that_do_not_split_evenly_are_refused_or_split_over_fewer_gpus():
    """runtime.num_gpus that does not divide the step's micro-batches is refused with the nearest
    multiples; by default the workers are as many of the node's GPUs as split them evenly, and the
    placement says which GPUs stay idle and why."""
    from megatrain_ray.objective import objective_of
    from megatrain_ray.planning.placement import NodeInfo, plan_placement

    raw = {"model": {"preset": "tiny-llama"}, "train": {"grad_accum": 6}}
    with pytest.raises(ConfigError, match=r"train.grad_accum=6 .* 4 GPU workers .* multiple of 4 \(4, 8\)"):
        objective_of(config_from_dict({**raw, "runtime": {"num_gpus": 4}})).check()
    # by default the node's GPUs, found only when the cluster is read: 3 of its 4 split 6
    config = config_from_dict(raw)
    node = NodeInfo("n0", "10.0.0.1", gpus=4.0, ram_node=False, free_bytes=64 * 1024**3)
    three = plan_placement(PRESETS["tiny-llama"], config, [node], "n0")
    assert three.num_gpus == 3 and three.idle_gpus == 1
    assert "3 GPU worker(s), data parallel (1 GPU(s) left idle" in three.describe(PRESETS["tiny-llama"])
    assert plan_placement(PRESETS["tiny-llama"], config_from_dict({**raw, "runtime": {"num_gpus": 2}}),
                          [node], "n0").num_gpus == 2
    assert plan_placement(PRESETS["tiny-llama"], config_from_dict({**raw, "train": {"grad_accum": 8}}),
                          [node], "n0").num_gpus == 4


def test_stated_host_memory_replaces_what_the_node_reads_free():
    """A machine whose memory grows as it is used reads little free at start: a model that does not
    fit in that is refused, and placed once the user states what a store may take."""
    from megatrain_ray.planning.placement import GiB, NodeInfo, plan_placement

    arch = PRESETS["qwen2.5-7b"]  # 14 bytes x 7.6 B params: about 99 GiB
    gpu = NodeInfo("gpu", "10.0.0.1", gpus=2.0, ram_node=False, free_bytes=28 * GiB)
    ram = NodeInfo("ram", "10.0.0.2", gpus=0.0, ram_node=True, free_bytes=1 * GiB)
    raw = {"model": {"preset": "qwen2.5-7b"}, "train": {"grad_accum": 2}}
    with pytest.raises(ConfigError, match="runtime.store_memory_gib"):
        plan_placement(arch, config_from_dict(raw), [gpu], "gpu")
    stated = config_from_dict({**raw, "runtime": {"store_memory_gib": 200}})
    placement = plan_placement(arch, stated, [gpu], "gpu")
    assert [s.capacity for s in placement.stores] == [200 * GiB] and placement.num_gpus == 2
    assert "200.0 GiB stated (runtime.store_memory_gib)" in placement.describe(arch)
    # the same for every store node: layers split evenly, whatever each node reads free
    both = plan_placement(arch, stated, [gpu, ram], "gpu")
    sizes = [s.host_bytes for s in both.stores]
    assert len(sizes) == 2 and abs(sizes[0] - sizes[1]) < 0.1 * sum(sizes)
    with pytest.raises(ConfigError, match="may take 50.0 GiB as stated"):
        plan_placement(arch, config_from_dict({**raw, "runtime": {"store_memory_gib": 50}}), [gpu], "gpu")
    with pytest.raises(ConfigError, match="store_memory_gib must be a finite number > 0"):
        config_from_dict({**raw, "runtime": {"store_memory_gib": 0}})


# A worker that dies leaves the others blocked in a collective, and the wait ends at its death ("a
# process of the run died during step 2"): tests/runtime/test_stops_keep_steps.py
# (test_the_stores_are_saved_only_when_every_layer_holds_the_last_finished_step) kills one of two
# such workers between steps and checks that, then what the stores save.


def test_two_workers_resume_exactly(local_ray, tmp_path):
    """Checkpoints and resume with two workers: 4 steps in one go equal 2 + resume + 2, bit for bit
    (the resume from the one-go run's checkpoint of step 2; a run stopped at a step and resumed from
    its own checkpoint: tests/files/test_checkpoint_resume.py);
    the embedding stepped on its owner's device (its state copied back to its store), every other
    layer on the host."""
    def raw(out):
        return tiny_raw(out, steps=4, train={"grad_accum": 4}, runtime={"num_gpus": 2},
                        checkpoint={"every": 2, "keep": 5}, executor={"embedding_step": "device"})

    whole = run_training(config_from_dict(raw(tmp_path / "whole")))
    as_stood_at(tmp_path / "whole", tmp_path / "split", 2)  # its checkpoint of step 2: two runs, not three
    resumed = run_training(config_from_dict(raw(tmp_path / "split")), resume="latest")
    a, b = Path(whole["checkpoint"]), Path(resumed["checkpoint"])
    assert a.name == b.name == "step-00000004"
    ta, tb = tensors_of(a), tensors_of(b)
    assert ta.keys() == tb.keys()
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name
    assert ckpt.list_checkpoints(tmp_path / "split" / "checkpoints")[0].name == "step-00000002"
    assert whole["final_loss"] == resumed["final_loss"]
