"""The disk tier (host/disk.py): a store whose layers keep their optimizer state in files steps bit
for bit as the same store in RAM, in every state mode, over steps that cycle through its layers
through a window smaller than them; its shard is the same checkpoint; a disk too small is refused
at the start with the figure, and a write that fails stops the next update with the disk's error
while the layer's state stays readable for a checkpoint."""

import errno
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megatrain_ray.files import checkpoint as ckpt
from megatrain_ray.files import shard
from megatrain_ray.host import disk as disk_module
from megatrain_ray.host.adamw import AdamWStep
from megatrain_ray.host.disk import ALIGN, DiskTierError, layer_parts
from megatrain_ray.host.memory import SEGMENT
from megatrain_ray.host.precision import StateFormat
from megatrain_ray.host.store import ShardStore, layer_bytes
from megatrain_ray.models.registry import PRESETS, model_layouts

MODES = [("fp32", "fp32"), ("fp32", "bf16"), ("fp32", "int8"), ("bf16", "int8"), ("bf16", "fp32"), ("bf16", "bf16")]
ARCH = PRESETS["tiny-llama"]
LAYERS = list(range(ARCH.num_layers + 2))  # the embedding, the blocks, the head
BETAS, EPS = (0.9, 0.95), 1e-8


def store_of(fmt: StateFormat, disk_dir: Path | None, disk_layers=()) -> ShardStore:
    store = ShardStore(ARCH, LAYERS, torch.bfloat16, state_format=fmt, seed=3, disk_dir=str(disk_dir) if disk_dir else None,
                       disk_layers=tuple(disk_layers))
    store.init_random(seed=5, std=0.02)
    store.fault_in_moments()
    return store


def train(store: ShardStore, steps: int) -> None:
    """`steps` updates of every layer in layer order (the order a step's updates come), from
    gradients drawn from (step, layer); the last step skipped (a non-finite one: weights put back)."""
    for step in range(steps):
        hp = AdamWStep(step + 1, 3e-3, 0.7, BETAS, EPS, 0.1) if step < steps - 1 else None
        for i in LAYERS:
            with store.landing_gradient(i) as grad:  # a layer fully on disk: a buffer of its window
                grad.copy_(torch.randn(grad.numel(), generator=torch.Generator().manual_seed(100 * step + i)))
            store.step_layer(i, hp)


def every_tensor(store: ShardStore) -> dict[str, torch.Tensor]:
    tensors, _ = shard.state_tensors(store)
    for i in store.layers:
        with store.resident(i, dirty=False) as state:
            tensors[f"compute{i}"] = state.compute.clone()
    return tensors


def saved_state(path: Path) -> dict[str, torch.Tensor]:
    """Every layer's state a shard holds, as a resume reads it (in the shard or the tier's files linked
    beside it: files/shard.py, link_tier_files)."""
    return {f"{i}.{key}": t for i in LAYERS for key, t in ckpt.read_layer_state(str(path), i)[0].items()}


def trained_alike(ram: ShardStore, on_disk: ShardStore, steps: int = 4) -> None:
    """Both stores `train`ed; every tensor of theirs equal."""
    train(ram, steps)
    train(on_disk, steps)
    a, b = every_tensor(ram), every_tensor(on_disk)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("master,moments", MODES)
def test_a_store_with_its_state_on_disk_steps_bit_for_bit_as_in_ram(master, moments, tmp_path, monkeypatch):
    monkeypatch.setattr(disk_module, "WINDOW", 2)
    fmt = StateFormat(master, moments)
    ram = store_of(fmt, None)
    on_disk = store_of(fmt, tmp_path, disk_layers=LAYERS[1:])  # 3 layers through a window of 2 buffers
    assert len(on_disk.disk.slots) == 2 < len(LAYERS) - 1
    trained_alike(ram, on_disk)
    assert ram.update_counts() == on_disk.update_counts()
    stats = on_disk.disk_stats()
    one_cycle = sum(p for p in (disk_module.file_bytes(on_disk.disk.parts[i]) for i in LAYERS[1:]))
    assert stats["written_bytes"] >= 4 * one_cycle and stats["read_bytes"] >= 3 * one_cycle  # it did go to disk
    cold = sum(t.numel() * t.element_size() for i in LAYERS[1:] for t in ram.layers[i].tensors().values()
               if not (master == "bf16" and t is ram.layers[i].compute))
    assert ram.host_bytes() - (on_disk.host_bytes() - on_disk.disk.resident_bytes()) == cold
    paths = list(on_disk.disk.paths.values())
    assert all(SEGMENT.match(p.name) for p in paths)
    on_disk.close()
    assert not any(p.exists() for p in paths)


@pytest.mark.parametrize("master,moments", [("fp32", "fp32"), ("bf16", "int8")])
def test_its_shard_is_the_same_checkpoint_and_loads_back(master, moments, tmp_path):
    fmt = StateFormat(master, moments)
    ram, on_disk = store_of(fmt, None), store_of(fmt, tmp_path / "tier", disk_layers=LAYERS[1:])
    train(ram, 2)
    train(on_disk, 2)
    shard.save_shard(ram, str(tmp_path), "ram.safetensors")
    entry = shard.save_shard(on_disk, str(tmp_path), "disk.safetensors")
    a, b = saved_state(tmp_path / "ram.safetensors"), saved_state(tmp_path / "disk.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert entry["layers"] == LAYERS
    back = store_of(fmt, tmp_path / "tier2", disk_layers=LAYERS[2:])
    shard.load_layers(back, {i: str(tmp_path / "disk.safetensors") for i in LAYERS})
    train(back, 2)
    train(ram, 2)
    a, b = every_tensor(ram), every_tensor(back)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_parts_lie_on_aligned_offsets():
    layout = model_layouts(ARCH)[1]
    for fmt in (StateFormat("fp32", "fp32"), StateFormat("bf16", "int8")):
        parts = layer_parts(layout, fmt)
        assert all(p.offset % ALIGN == 0 for p in parts)
        assert all(a.offset + a.nbytes <= b.offset for a, b in zip(parts, parts[1:]))
    assert [p.name for p in layer_parts(layout, StateFormat("bf16", "int8"))] == [
        "exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"]  # a bf16 master is the compute copy, in RAM


def test_a_disk_too_small_is_refused_at_the_start_with_the_figure(tmp_path):
    """A file-size limit stands for a full disk: the tier allocates its files whole as the store starts."""
    code = textwrap.dedent(f"""
        import resource, signal, torch
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
        from megatrain_ray.host.store import ShardStore, layer_bytes
        from megatrain_ray.models.registry import PRESETS
        ShardStore(PRESETS["tiny-llama"], list(range(4)), torch.bfloat16, disk_dir={str(tmp_path)!r}, disk_layers=(1, 2, 3))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
    assert out.returncode != 0
    assert "DiskTierError" in out.stderr and "while allocating" in out.stderr and "runtime.disk_dir" in out.stderr, out.stderr
    assert not list(tmp_path.iterdir())  # the files it made are gone


def test_a_failed_write_stops_the_next_update_and_keeps_the_state(tmp_path, monkeypatch):
    fmt = StateFormat("fp32", "fp32")
    on_disk = store_of(fmt, tmp_path, disk_layers=LAYERS[1:])
    real = os.pwritev

    def full(fd, buffers, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    hp = AdamWStep(9, 1e-3, 1.0, BETAS, EPS, 0.0)
    train(on_disk, 2)
    monkeypatch.setattr(os, "pwritev", full)
    before = on_disk.layers[1].updates
    on_disk.layers[1].grad.zero_()
    on_disk.step_layer(1, hp)  # its write fails behind it
    with pytest.raises(DiskTierError, match="No space left on device.*while writing"):
        on_disk.disk.flush()
    monkeypatch.setattr(os, "pwritev", real)
    with pytest.raises(DiskTierError, match="No space left"):
        on_disk.step_layer(2, hp)
    assert on_disk.layers[1].updates == before + 1
    assert on_disk.disk.slots[[s.layer for s in on_disk.disk.slots].index(1)].failed
    tensors = shard.layer_tensors(on_disk, 1, copy=True)  # still readable, from its buffer
    assert tensors["layers.1.master"].numel() == on_disk.layers[1].layout.numel


def test_a_killed_runs_files_are_removed_by_the_next_store_and_never_read(tmp_path):
    """A store killed mid-write leaves its files; they hold nothing a resume reads (a checkpoint is
    its own directory, published by rename), and the next store on the machine removes them, as it
    removes a dead run's shared-memory segments."""
    code = textwrap.dedent(f"""
        import os, torch
        from megatrain_ray.host.store import ShardStore, layer_bytes
        from megatrain_ray.models.registry import PRESETS
        s = ShardStore(PRESETS["tiny-llama"], list(range(4)), torch.bfloat16, disk_dir={str(tmp_path)!r},
                       disk_layers=(1, 2, 3), run_id="dead")
        os._exit(0)  # killed: close never runs
    """)
    subprocess.run([sys.executable, "-c", code], check=True, env=os.environ)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert len(left) == 3 and all(name.startswith("megatrain-dead-") and name.endswith("-disk") for name in left)
    store = store_of(StateFormat(), tmp_path, disk_layers=(2,))
    assert sorted(p.name for p in tmp_path.iterdir()) == [store.disk.paths[2].name]
    store.close()


def test_a_write_that_fails_at_a_steps_end_stops_the_next_step_before_any_layer_changes(tmp_path, monkeypatch):
    """The last write of a step fails (a full disk): the next step's first update raises before any
    layer takes that step, even one in RAM, so the store holds the finished step whole, the failed
    layer in its buffer, and its shard is the all-RAM store's after that step, bit for bit."""
    fmt = StateFormat("fp32", "fp32")
    in_ram, on_disk = store_of(fmt, None), store_of(fmt, tmp_path, disk_layers=LAYERS[1:])
    real = os.pwritev
    hp = AdamWStep(1, 3e-3, 1.0, BETAS, EPS, 0.1)
    order = [0, *LAYERS[:0:-1]]  # the embedding (in RAM) first, then the head down to block 0 (on disk) last

    def full(fd, buffers, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    for store in (in_ram, on_disk):
        for i in order:
            if store is on_disk and i == order[-1]:
                monkeypatch.setattr(os, "pwritev", full)  # the step's last write
            state = store.layers[i]
            state.grad.copy_(torch.randn(state.layout.numel, generator=torch.Generator().manual_seed(i)))
            store.step_layer(i, hp)
    monkeypatch.setattr(os, "pwritev", real)
    with pytest.raises(DiskTierError, match="No space left on device.*while writing"):
        on_disk.step_layer(order[0], hp)  # the next step's first update, a layer in RAM
    assert set(on_disk.update_counts().values()) == {1}
    expected, _ = shard.state_tensors(in_ram)
    got, counts = shard.state_tensors(on_disk)
    assert counts == in_ram.update_counts()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_a_store_killed_while_writing_its_checkpoint_leaves_only_the_last_complete_one(tmp_path):
    """A store with the tier killed in the middle of its streamed shard: the half-written checkpoint has
    no manifest, so nothing takes it for one (`latest` is the one before, whose files still verify),
    and naming it is refused."""
    root = tmp_path / "ckpt"
    code = textwrap.dedent(f"""
        import os, torch
        from pathlib import Path
        from megatrain_ray.files import checkpoint as ckpt, shard
        from megatrain_ray.host.store import ShardStore, layer_bytes
        from megatrain_ray.models.registry import PRESETS
        store = ShardStore(PRESETS["tiny-llama"], list(range(4)), torch.bfloat16, disk_dir={str(tmp_path / "tier")!r},
                           disk_layers=(1, 2, 3))
        store.init_random(seed=5, std=0.02)
        root = Path({str(root)!r})
        for step in (1, 2):
            staging = ckpt.new_staging_dir(root, step)
            if step == 2:
                real, done = shard.layer_tensors, []
                def layer_tensors(store, i, copy=False, **linked):
                    done.append(i)
                    if len(done) == 3:
                        os._exit(9)  # killed mid-write: two layers of the shard on disk, no manifest
                    return real(store, i, copy, **linked)
                shard.layer_tensors = layer_tensors
            entry = shard.save_shard(store, str(staging), "shard-000.safetensors")
            ckpt.commit(staging, root, step, [entry], {{"step": step}}, keep=5)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
    assert out.returncode == 9, out.stderr
    first = root / "step-00000001"
    assert ckpt.list_checkpoints(root) == [first]
    assert ckpt.resolve("latest", root) == first
    ckpt.read_manifest(first, verify=True)  # every file's hash as its manifest says
    (half,) = root.glob(".step-00000002.tmp-*")
    assert (half / "shard-000.safetensors").stat().st_size > 0 and not (half / ckpt.MANIFEST).exists()
    with pytest.raises(ckpt.CheckpointError, match="not a complete checkpoint"):
        ckpt.resolve(str(half), root)


@pytest.mark.parametrize("master", ["fp32", "bf16"])
def test_a_step_moves_the_bytes_the_plan_counts_and_a_new_file_is_never_read(master, tmp_path):
    """The plan's layers on disk and its bytes a step (planning/placement.py); a store with those
    layers on disk, its first weights drawn, then three steps: the first weights read nothing but the
    first step's first layers ahead (a new file reads as zeros: cleared, not read), and each step reads and writes exactly the plan's bytes
    (the tier's own counters, from each step's first update to the next's: none before a second)."""
    from megatrain_ray.config import config_from_dict
    from megatrain_ray.planning.placement import NodeInfo, plan_placement

    fmt, arch = StateFormat(master, "int8"), ARCH.replace(num_layers=12)  # 14 layers: a window of 3 saves RAM
    layers = list(range(arch.num_layers + 2))
    all_in_ram = sum(layer_bytes(layout, torch.bfloat16, fmt) for layout in model_layouts(arch))
    config = config_from_dict({"model": {"preset": "tiny-llama", "overrides": {"num_layers": 12}, "compute_dtype": "bfloat16"},
                               "optim": {"master": master, "moments": "int8"},
                               "runtime": {"disk_dir": str(tmp_path), "store_memory_gib": 0.8 * all_in_ram / 2**30}})
    node = NodeInfo("gpu", "10.0.0.1", 1.0, False, 2**40, disk_bytes=2**40, disk_read_gbs=1.0, disk_write_gbs=1.0)
    plan, = plan_placement(arch, config, [node], "gpu").stores
    assert 0 < len(plan.disk_layers) < len(layers), plan.disk_layers
    store = ShardStore(arch, layers, torch.bfloat16, state_format=fmt, seed=3, disk_dir=str(tmp_path),
                       disk_layers=plan.disk_layers)
    try:
        store.init_random(seed=5, std=0.02)
        ahead = sum(disk_module.disk_bytes(model_layouts(arch)[i], fmt) for i in plan.disk_layers[:disk_module.WINDOW - 1])
        assert store.disk.bytes_read == (ahead if master == "fp32" else 0)  # only the first step's first layers, read ahead
        assert store.disk.bytes_written == (plan.disk_bytes if master == "fp32" else 0)
        moved = []  # after each step: the counters' last whole step, from one step's first update to the next's
        for step in range(4):
            hp = AdamWStep(step + 1, 3e-3, 0.7, BETAS, EPS, 0.1)
            for i in layers:
                store.layers[i].grad.normal_(generator=torch.Generator().manual_seed(10 * step + i))
                store.step_layer(i, hp)
            moved.append(store.disk.step_bytes())
        # a bf16 master's first step reads nothing of its own (its files never written) but the next step's first layers
        first_read = plan.disk_bytes if master == "fp32" else ahead
        assert moved == [(0, 0), (first_read, plan.disk_bytes)] + [(plan.disk_bytes, plan.disk_bytes)] * 2
        assert store.disk_stats()["step_read_bytes"] == plan.disk_bytes
    finally:
        store.close()
