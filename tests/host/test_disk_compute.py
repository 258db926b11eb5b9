"""Layers fully on disk (host/disk.py, compute_parts and HeldWindow): a store whose layers keep their
compute copy and gradient in files too, beside their optimizer state, steps bit for bit as the same
store in RAM, in every state mode, over steps that cycle its layers through windows smaller than
them; its shard is the same checkpoint and loads back; RAM drops by their copies (and gradients) less
the window's buffers."""

import errno
import os
import socket
import threading
import time
from concurrent.futures import wait

import pytest
import torch

from megatrain_ray.files import shard
from megatrain_ray.host import disk as disk_module
from megatrain_ray.host.adamw import AdamWStep
from megatrain_ray.host.disk import DiskTierError, LayerLost
from megatrain_ray.host.precision import StateFormat
from megatrain_ray.host.store import ShardStore
from megatrain_ray.models.registry import model_layouts
from test_disk_tier import ARCH, LAYERS, MODES, every_tensor, saved_state, train, trained_alike
from test_transport import wait_until  # polled: a hold taken notifies nobody

FULLY = (1, 2, 3)  # the blocks and the head: through a window of 2 buffers


def full_disk_under(fds, real):
    """os.pwritev as a full disk under these files makes it: ENOSPC for them, `real` for the others."""
    fds = set(fds)

    def pwritev(fd, buffers, offset):
        if fd in fds:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, buffers, offset)

    return pwritev


def ended(call, seconds: float = 30):
    """`call()` in a thread: (its result, None) or (None, what it raised); the test fails if it has not
    ended within `seconds` (a wait for a buffer that never frees)."""
    out = {}

    def run() -> None:
        try:
            out["value"] = call()
        except Exception as e:
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{call} still waits after {seconds} s"
    return out.get("value"), out.get("error")


def store_of(fmt: StateFormat, disk_dir=None, disk_layers=(), fully=()) -> ShardStore:
    store = ShardStore(ARCH, LAYERS, torch.bfloat16 if fmt.master == "bf16" else torch.float32, state_format=fmt,
                       seed=3, disk_dir=str(disk_dir) if disk_dir else None, disk_layers=tuple(disk_layers),
                       disk_compute_layers=tuple(fully))
    store.init_random(seed=5, std=0.02)
    store.fault_in_moments()
    return store


@pytest.mark.parametrize("master,moments", MODES)
def test_a_store_with_layers_fully_on_disk_steps_bit_for_bit_as_in_ram(master, moments, tmp_path, monkeypatch):
    monkeypatch.setattr(disk_module, "WINDOW", 2)
    fmt = StateFormat(master, moments)
    ram = store_of(fmt)
    on_disk = store_of(fmt, tmp_path / "tier", disk_layers=LAYERS[1:], fully=FULLY)
    assert len(on_disk.hot.tier.slots) == 2 < len(FULLY)
    trained_alike(ram, on_disk)
    assert on_disk.hot.tier.bytes_written >= 4 * sum(disk_module.file_bytes(on_disk.hot.tier.parts[i]) for i in FULLY)
    in_ram = {id(t): t.numel() * t.element_size() for i in FULLY for t in (ram.layers[i].compute, ram.layers[i].grad)}
    cold_only = store_of(fmt, tmp_path / "cold", disk_layers=LAYERS[1:])
    assert (cold_only.host_bytes() - cold_only.disk.resident_bytes()
            - (on_disk.host_bytes() - on_disk.disk.resident_bytes() - on_disk.hot.resident_bytes())) == sum(in_ram.values())
    assert on_disk.hot.resident_bytes() == 2 * max(disk_module.file_bytes(on_disk.hot.tier.parts[i]) for i in FULLY)

    shard.save_shard(ram, str(tmp_path), "ram.safetensors")  # the same checkpoint, which loads back
    shard.save_shard(on_disk, str(tmp_path), "disk.safetensors")
    x, y = saved_state(tmp_path / "ram.safetensors"), saved_state(tmp_path / "disk.safetensors")
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    back = store_of(fmt, tmp_path / "back", disk_layers=LAYERS[1:], fully=FULLY[1:])
    shard.load_layers(back, {i: str(tmp_path / "disk.safetensors") for i in LAYERS})
    train(back, 2)
    train(ram, 2)
    a, b = every_tensor(ram), every_tensor(back)
    assert all(torch.equal(a[k], b[k]) for k in a)
    for store in (ram, on_disk, cold_only, back):
        store.close()
    assert not list((tmp_path / "tier").iterdir())


@pytest.mark.parametrize("master", ["fp32", "bf16"])
def test_a_failed_write_of_a_compute_copy_stops_the_next_update_and_keeps_the_state(master, tmp_path, monkeypatch):
    """A compute copy's file that cannot be written (a full disk) as a gradient lands: the layer's
    update raises the disk's error before it changes anything, so does any other layer's, and the
    layer's state (a bf16 master: the copy itself) is still read for a checkpoint, from its buffer."""
    fmt = StateFormat(master, "int8")
    on_disk = store_of(fmt, tmp_path, disk_layers=LAYERS[1:], fully=FULLY)
    train(on_disk, 2)
    expected = shard.layer_tensors(on_disk, 1, copy=True)
    real = os.pwritev
    monkeypatch.setattr(os, "pwritev", full_disk_under(on_disk.hot.tier.fds.values(), real))
    with on_disk.landing_gradient(1) as grad:
        grad.zero_()  # written behind, and failing
    monkeypatch.setattr(os, "pwritev", real)
    updates = on_disk.update_counts()
    for layer in (1, 2):
        with pytest.raises(DiskTierError, match="No space left on device.*while writing"):
            on_disk.step_layer(layer, AdamWStep(9, 1e-3, 1.0, (0.9, 0.95), 1e-8, 0.0))
    assert on_disk.update_counts() == updates
    got = shard.layer_tensors(on_disk, 1, copy=True)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    on_disk.close()


SHORT = {("bf16", "int8"): 0.6, ("fp32", "fp32"): 0.3}  # RAM the store may take, of what it needs all in RAM


def landed(store, layer: int, count: int) -> None:
    """Until the layer's `count`-th gradient has landed in the store and, held, let go (its write issued)."""
    with store.server.cond:
        store.server.cond.wait_for(lambda: store.server.received(layer) >= count)
    with store.hot.cond:
        store.hot.cond.wait_for(lambda: not store.hot.holders[layer])


@pytest.mark.parametrize("master,moments", SHORT)
def test_a_step_moves_the_plans_bytes_and_a_send_reads_the_copy_alone(master, moments, tmp_path):
    """The plan's layers on disk, some fully, for a store short of RAM, and its disk bytes a step
    (StorePlan.disk_step_bytes); that store stepped as it serves a GPU worker whose step the disk
    binds, over its link (host/transport.py), in a step's order: each layer updated
    (ShardStoreActor.step_streamed) and, fully on disk, fetched for the next forward right after (the
    worker's request waits for the update); in the backward, in reverse, each such layer fetched and
    its gradient landed right after. A send reads the compute copy alone (a bf16 master's gradient
    buffer stays on disk), the landing after it reads nothing (it overwrites its part whole), the
    forward's send after an update reads nothing; the tiers read and write exactly the plan's bytes a step, while
    every weight sent and every state equal a store's all in RAM."""
    from megatrain_ray.config import config_from_dict
    from megatrain_ray.config import config_from_dict
    from megatrain_ray.host.disk import file_bytes
    from megatrain_ray.host.store import layer_bytes
    from megatrain_ray.host.transport import LayerLink
    from megatrain_ray.models.registry import model_layouts
    from megatrain_ray.planning.placement import NodeInfo, plan_placement
    from megatrain_ray.runtime.actors import ShardStoreActor
    from test_disk_tier import BETAS, EPS

    fmt, arch, dtype = StateFormat(master, moments), ARCH.replace(num_layers=12), torch.bfloat16
    layers, layouts = list(range(arch.num_layers + 2)), model_layouts(arch)
    all_in_ram = sum(layer_bytes(layout, dtype, fmt) for layout in layouts)
    config = config_from_dict({"model": {"preset": "tiny-llama", "overrides": {"num_layers": 12}, "compute_dtype": "bfloat16"},
                               "optim": {"master": master, "moments": moments},
                               "runtime": {"disk_dir": str(tmp_path), "store_memory_gib": SHORT[master, moments] * all_in_ram / 2**30}})
    node = NodeInfo("gpu", "10.0.0.1", 1.0, False, 2**40, disk_bytes=2**40, disk_read_gbs=1.0, disk_write_gbs=1.0)
    plan, = plan_placement(arch, config, [node], "gpu").stores
    fully = plan.disk_compute_layers
    assert len(fully) > disk_module.WINDOW and len(plan.disk_layers) > disk_module.WINDOW, plan
    copies = sum(disk_module.aligned(layouts[i].numel * dtype.itemsize) for i in fully)  # what a send needs: the copy
    assert plan.disk_compute_bytes == copies * (2 if master == "bf16" else 1)  # a bf16 master's gradient buffer too
    assert plan.disk_send_bytes == copies
    assert plan.disk_step_bytes() == (plan.disk_bytes + copies, plan.disk_bytes + plan.disk_compute_bytes)

    ram = ShardStore(arch, layers, dtype, state_format=fmt, seed=3)
    store = ShardStoreActor(threads=1)
    reach = store.allocate(arch, layers, dtype, state_format=fmt, seed=3, disk_dir=str(tmp_path),
                           disk_layers=plan.disk_layers, disk_compute_layers=fully)
    link = LayerLink(reach.link, 3, "the store")  # a layer in chunks over 3 connections, as a worker sends it

    def fetched(i: int, step: int) -> None:
        sent = torch.empty(layouts[i].numel, dtype=dtype)
        link.fetch(i, store.server.applied[i], sent, []).wait()
        assert torch.equal(sent, ram.layers[i].compute), (step, i)

    def landed_gradient(i: int, step: int) -> None:
        grad = ram.layers[i].grad
        grad.copy_(torch.randn(grad.numel(), generator=torch.Generator().manual_seed(100 * step + i)))
        link.send(i, grad, []).wait()
        landed(store, i, step + 1)

    def updated(i: int, step: int) -> None:
        hp = AdamWStep(step, 3e-3, 0.7, BETAS, EPS, 0.1)
        ram.step_layer(i, hp)
        store.step_streamed(i, hp)

    try:
        for s in (ram, store):
            s.init_random(seed=5, std=0.02)
            s.fault_in_moments()
        moved = []
        for step in range(5):
            before = store.disk_stats()
            for i in layers:  # the step before's updates, each layer's next forward send after its own
                if step:
                    updated(i, step)
                if i in fully:
                    fetched(i, step)
            for i in reversed(layers):
                if i in fully:
                    fetched(i, step)
                landed_gradient(i, step)
            after = store.disk_stats()
            moved.append((after["read_bytes"] - before["read_bytes"], after["written_bytes"] - before["written_bytes"]))
        for i in layers:
            updated(i, 5)
        # steps 0 and 1 met new files (read as zeros); from step 2 a step writes the plan's bytes and reads
        # them less what the window's buffers spare where the step turns: the backward's sends of the
        # layers the forward fetched last, the updates of those the backward landed last (at most a
        # window's whole files at each turn)
        read, written = plan.disk_step_bytes()
        turns = 2 * disk_module.WINDOW * max(file_bytes(store.hot.tier.parts[i]) for i in fully)
        assert all(w == written and read - turns <= r <= read for r, w in moved[2:]), (moved, read, written, turns)
        stats = store.disk_stats()
        assert stats["file_bytes"] == plan.disk_bytes
        # the counters' last whole step (host/disk.py, step_bytes): step 4's updates, step 5's sends and gradients
        assert (stats["step_read_bytes"], stats["step_written_bytes"]) == moved[-1]
        a, b = every_tensor(ram), every_tensor(store)
        assert all(torch.equal(a[k], b[k]) for k in a)
        print(f"{master}/{moments}: a step read {moved[-1][0]} and wrote {moved[-1][1]} bytes; plan {plan.disk_step_bytes()}")
    finally:
        link.close()
        store.close()
        ram.close()


def test_a_send_reads_the_copy_alone_a_holder_that_wants_more_gets_the_rest_and_a_landing_reads_nothing_it_overwrites(
        tmp_path):
    """Two layers fully on disk (a bf16 master: the copy and its gradient buffer) through a window
    of one buffer: a send reads the copy alone; a whole hold that meets it on the same layer
    (HeldWindow's holders) gets the gradient buffer read, not the other layer's bytes the buffer held;
    a gradient's landing reads nothing it overwrites (its gradient buffer), and its write keeps the
    copy it found and the gradient it wrote."""
    fmt, dtype = StateFormat("bf16", "int8"), torch.bfloat16
    layouts = {i: model_layouts(ARCH)[i] for i in (1, 2)}
    tier = disk_module.DiskTier(tmp_path, "t", layouts, fmt, window=1, key="diskcompute", read_ahead=False,
                                parts_of=lambda l: disk_module.compute_parts(l, fmt, dtype))
    held = disk_module.HeldWindow(tier)
    try:
        for i in (1, 2):  # each layer's copy and gradient, written to its file; layer 2 left in the buffer
            with held.held(i, dirty=True) as views:
                views["compute"].fill_(i)
                views["grad"].fill_(10 * i)
        part = {p.name: disk_module.aligned(p.nbytes) for p in tier.parts[1]}
        before = tier.bytes_read
        with held.sending(1) as copy:
            assert torch.equal(copy, torch.full_like(copy, 1)) and tier.bytes_read - before == part["compute"]
            with held.held(1) as views:  # wants the whole layer while the send holds it
                assert torch.equal(views["grad"], torch.full_like(views["grad"], 10)), "the gradient buffer was not read"
                assert tier.bytes_read - before == part["compute"] + part["grad"]
        with held.sending(2):  # layer 1 leaves the buffer
            pass
        before = tier.bytes_read
        with held.sending(1):
            with held.gradient(1) as grad:  # lands while the send holds the layer: nothing more read
                assert tier.bytes_read - before == part["compute"]
                grad.fill_(7)
        with held.sending(2):
            pass
        before = tier.bytes_read
        with held.gradient(1) as grad:  # lands alone: the copy read, for the write back, the gradient not
            assert tier.bytes_read - before == part["compute"]
            grad.fill_(8)
        with held.sending(2):
            pass
        with held.held(1) as views:  # back from the file, whole: the last landed gradient and the copy
            assert torch.equal(views["grad"], torch.full_like(views["grad"], 8))
            assert torch.equal(views["compute"], torch.full_like(views["compute"], 1))
    finally:
        tier.close()


def test_a_checkpoint_reads_every_layer_when_each_buffer_holds_a_failed_write(tmp_path, monkeypatch):
    """Both buffers of a window of 2 hold a gradient whose write failed (a full disk): the layers in
    them are read from there, and a third layer from its file into a spare buffer, which then goes;
    none is read into a buffer whose failed write holds the only copy of another layer."""
    monkeypatch.setattr(disk_module, "WINDOW", 2)
    on_disk = store_of(StateFormat("bf16", "int8"), tmp_path, disk_layers=LAYERS[1:], fully=FULLY)
    train(on_disk, 2)
    expected = {i: shard.layer_tensors(on_disk, i, copy=True) for i in FULLY}
    real = os.pwritev
    monkeypatch.setattr(os, "pwritev", full_disk_under(on_disk.hot.tier.fds.values(), real))
    with on_disk.landing_gradient(1), on_disk.landing_gradient(2):
        pass  # both written behind as they are let go, and failing
    slots = on_disk.hot.tier.slots
    wait([f for s in slots for f in s.writes])
    monkeypatch.setattr(os, "pwritev", real)
    assert len(slots) == 2 and all(any(f.exception() is not None for f in s.writes) for s in slots)

    got, error = ended(lambda: {i: shard.layer_tensors(on_disk, i, copy=True) for i in FULLY})
    assert error is None, error
    for i in FULLY:
        assert got[i].keys() == expected[i].keys() and all(torch.equal(got[i][k], expected[i][k]) for k in got[i]), i
    assert len(on_disk.hot.tier.slots) == 2  # the spare buffer went with its read
    on_disk.close()


class StoresOnly:
    """The driver's Session as runtime/training.py's stop on a full disk uses it: the checkpoint of a
    step from the store alone (its shard, beside the tier's files: a layer's files linked where it can)."""

    def __init__(self, store, directory):
        self.store, self.directory = store, directory

    def save_from_stores(self, step: int, data_position, updates_done=None):
        path = self.directory / f"step-{step}"
        path.mkdir()
        shard.save_shard(self.store, str(path), "shard.safetensors")
        return path


def test_a_layer_whose_failed_write_lost_its_buffer_is_refused_even_to_a_checkpoint(tmp_path, monkeypatch):
    """A gradient's write still running when another layer's read is queued into its buffer, then
    failing (a full disk): that read fails naming that layer and its file, and the layer, whose file
    is not whole and whose buffer is gone, is refused to a checkpoint instead of read back or linked
    from its file. The run's stop says so (not "no room for the checkpoint"), whether the step or the
    checkpoint after it found the layer lost, and names the last complete checkpoint."""
    from megatrain_ray.runtime.training import Progress, keep_steps_on_full_disk

    monkeypatch.setattr(disk_module, "WINDOW", 2)
    on_disk = store_of(StateFormat("bf16", "int8"), tmp_path, disk_layers=LAYERS[1:], fully=FULLY)
    train(on_disk, 2)
    hot, real = on_disk.hot, os.pwritev
    full, go = full_disk_under(hot.tier.fds.values(), real), threading.Event()

    def late_and_full(fd, buffers, offset):
        go.wait()
        return full(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", late_and_full)
    with on_disk.landing_gradient(1):
        pass  # written behind as it is let go: the write waits for `go`
    other = next(s.layer for s in hot.tier.slots if s.layer != 1)
    target = next(i for i in FULLY if hot.tier._slot_of(i) is None)
    hot.hold(other)  # the only buffer free is layer 1's, still writing

    def queued_then_full() -> None:
        while hot.tier._slot_of(target) is None:
            time.sleep(0.01)  # until the read is queued behind layer 1's write
        go.set()

    threading.Thread(target=queued_then_full, daemon=True).start()
    _, error = ended(lambda: hot.hold(target))
    lost = f"layer 1's state is lost: its write to {hot.tier.paths[1]} failed (No space left on device)"
    assert isinstance(error, LayerLost) and lost in str(error), error
    monkeypatch.setattr(os, "pwritev", real)
    _, refused = ended(lambda: shard.layer_tensors(on_disk, 1, copy=True))
    assert isinstance(refused, LayerLost) and lost in str(refused), refused

    last = tmp_path / "checkpoints" / "step-1"
    another = DiskTierError(errno.ENOSPC, "No space left on device while writing another layer's file")
    for found_by, full in (("the step", error), ("the checkpoint", another)):
        (tmp_path / "checkpoints").mkdir(exist_ok=True)
        stop = keep_steps_on_full_disk(full, StoresOnly(on_disk, tmp_path / "checkpoints"),
                                       [(1, None, 1), (2, None, 2)], Progress(last), saved=1, while_saving=None)
        message = str(stop)
        assert lost in message and "runtime.disk_dir" in message and "runtime.store_memory_gib" in message, message
        assert ("no checkpoint of step 2 can be written: that layer's state could not be kept); its last complete "
                f"checkpoint is {last}") in message, message
        assert "no room" not in message and stop.checkpoint == last, message
        then = f"the disk filled mid-run: {another.strerror}; then"  # the step's own error first, where it was another
        assert (found_by == "the checkpoint") == message.startswith(then), message
        assert not (tmp_path / "checkpoints" / "step-2").exists() or not any(
            (tmp_path / "checkpoints" / "step-2").glob("*.layer1.*")), "the lost layer's file was linked"
    hot.let_go(other)
    on_disk.close()


def linked_store(master: str, tmp_path, monkeypatch):
    """A store with layers FULLY on disk through a window of 2 buffers, random weights, its link's server
    open, and two connections to it, as a worker's two streams."""
    from megatrain_ray.runtime.actors import ShardStoreActor

    monkeypatch.setattr(disk_module, "WINDOW", 2)
    store = ShardStoreActor(threads=1)
    store.allocate(ARCH, LAYERS, torch.bfloat16 if master == "bf16" else torch.float32,
                   state_format=StateFormat(master, "int8"), seed=3, disk_dir=str(tmp_path), disk_layers=LAYERS[1:],
                   disk_compute_layers=FULLY)
    streams = [socket.create_connection(store.server.address) for _ in range(2)]
    store.init_random(seed=5, std=0.02)
    return store, streams


@pytest.mark.parametrize("master", ["fp32", "bf16"])
def test_a_gradient_cut_as_it_lands_lets_its_buffers_go_and_is_never_applied(master, tmp_path, monkeypatch):
    """The GPU worker's link drops part-way through the gradients of layers fully on disk, which it
    sends over two connections: one has landed its chunks of layers 3 and 2, the other is cut inside
    its chunk of layer 3. Each layer held for its landing lets its buffer go (a window of 2, both
    held: any hold of another layer would wait for ever), though the first connection stays open.
    Every update of the step then raises, none applied, and the checkpoint the run stops with reads
    every layer as it was before the step: nothing of the gradients that landed in part is taken."""
    from megatrain_ray.host.transport import GRADIENT, HELLO

    store, streams = linked_store(master, tmp_path, monkeypatch)
    hot, server = store.hot, store.server
    try:
        store.fault_in_moments()
        before = {i: shard.layer_tensors(store, i, copy=True) for i in LAYERS}
        counts = store.update_counts()

        def gradient_chunk(layer: int, k: int) -> bytes:
            """The header and chunk k (of 2) of the layer's gradient, as a worker's stream k sends it."""
            nbytes = next(p.nbytes for p in hot.tier.parts[layer] if p.name == hot.landing_part(layer))
            return GRADIENT.pack(layer, 0) + os.urandom(nbytes * (k + 1) // 2 - nbytes * k // 2)

        for k, sock in enumerate(streams):
            sock.sendall(HELLO.pack(b"G", k, 2))
        streams[0].sendall(gradient_chunk(3, 0) + gradient_chunk(2, 0))
        cut = gradient_chunk(3, 1)
        streams[1].sendall(cut[: len(cut) // 2])
        with server.cond:  # stream 0's chunks landed; stream 1 holds layer 3 as its chunk lands
            assert server.cond.wait_for(lambda: server.arrived[3, 0] == server.arrived[2, 0] == 1, 10)
        wait_until(lambda: hot.holders[3] == 2 and hot.holders[2] == 1, "the landings' holds", timeout=10)
        streams[1].close()  # the link drops mid-chunk

        hp = AdamWStep(1, 1e-3, 1.0, (0.9, 0.95), 1e-8, 0.0)
        for i in LAYERS:  # the step's updates, in order: each gives up, none waits for a buffer
            _, error = ended(lambda: store.step_streamed(i, hp), seconds=10)
            assert isinstance(error, ConnectionError) and "never came" in str(error), (i, error)
        with hot.cond:
            assert not hot.holders, dict(hot.holders)
        assert store.update_counts() == counts and not any(server.applied.values())
        assert all(server.received(i) == 0 for i in LAYERS)
        got, error = ended(lambda: {i: shard.layer_tensors(store, i, copy=True) for i in LAYERS}, seconds=10)
        assert error is None, error
        for i in LAYERS:
            assert got[i].keys() == before[i].keys() and all(torch.equal(got[i][k], before[i][k]) for k in got[i]), i
    finally:
        for sock in streams:
            sock.close()
        store.close()


def test_a_send_over_several_connections_reads_the_copy_once_however_far_apart_they_come(tmp_path, monkeypatch):
    """A worker asks for a layer fully on disk over two connections, the second long after the first
    has its chunk, and other layers pass through the window (of 2) in between: the send holds the
    layer from its first connection to its last, so its copy is read once. A send whose other
    connection closes instead lets its buffer go."""
    from megatrain_ray.host.transport import HELLO, REQUEST, STATUS, recv_exact

    store, streams = linked_store("bf16", tmp_path, monkeypatch)
    hot = store.hot
    try:
        hot.flush()
        copy = shard.layer_tensors(store, 3, copy=True)["layers.3.master"].view(torch.uint8)  # a bf16 master is the copy
        for k, sock in enumerate(streams):
            sock.sendall(HELLO.pack(b"W", k, 2))

        def chunk_of(k: int) -> torch.Tensor:
            """Stream k's status and chunk (of 2) of layer 3's copy, as the store sends it."""
            streams[k].sendall(REQUEST.pack(3, 0, 0))
            status, got = bytearray(STATUS.size), bytearray(len(copy) * (k + 1) // 2 - len(copy) * k // 2)
            assert recv_exact(streams[k], memoryview(status)) and not STATUS.unpack(status)[0]
            assert recv_exact(streams[k], memoryview(got))
            return torch.frombuffer(got, dtype=torch.uint8)

        for other in (1, 2):  # the window's two buffers: layer 3 in neither
            hot.hold(other)
        for other in (1, 2):
            hot.let_go(other)
        read = hot.tier.bytes_read
        first = chunk_of(0)
        sent_once = hot.tier.bytes_read - read
        wait_until(lambda: hot.holders[3] == 1, "the send's hold, for the connection to come", timeout=10)
        for other in (1, 2):  # through the window's other buffer, one after the other
            passed = hot.tier.bytes_read
            hot.hold(other)
            hot.let_go(other)
            read += hot.tier.bytes_read - passed
        second = chunk_of(1)
        assert hot.tier.bytes_read - read == sent_once == disk_module.part_bytes(hot.tier.parts[3], ("compute",))
        assert torch.equal(torch.cat([first, second]), copy)
        wait_until(lambda: not hot.holders, "every hold let go", timeout=10)

        chunk_of(0)  # the layer's next send, whose second connection closes before it asks
        streams[1].close()
        wait_until(lambda: not hot.holders, "every hold let go", timeout=10)
    finally:
        for sock in streams:
            sock.close()
        store.close()
