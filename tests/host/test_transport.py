"""The TCP link between a store and a GPU worker, in one process over loopback: versions, chunks
over several connections, layers in pieces whose updates overlap their transfers, and a lost store
failing loudly instead of hanging."""

import socket
import threading
import time

import pytest
import torch

from megatrain_ray.host.transport import GRADIENT, HELLO, LayerLink, LayerServer, byte_view, piece_bounds

STREAMS = 3


@pytest.fixture
def link():
    # odd sizes: chunks of unequal length over the three connections
    buffers = {0: torch.arange(1001, dtype=torch.float32), 1: torch.arange(77, dtype=torch.bfloat16)}
    server = LayerServer(buffers, "127.0.0.1")
    link = LayerLink(server.address, STREAMS, "test store")
    yield server, link, buffers
    link.close()
    server.close()


def test_weights_arrive_whole_and_a_gradient_lands_in_the_store_buffer(link):
    server, link, buffers = link
    dest = torch.empty(1001, dtype=torch.float32)
    link.fetch(0, 0, dest, []).wait()
    assert torch.equal(dest, buffers[0])
    grad = torch.randn(77).to(torch.bfloat16)
    link.send(1, grad, []).wait()
    server.step(1, lambda: None, lambda lo, hi: None)  # returns only once the whole gradient has landed
    assert torch.equal(buffers[1], grad)


def test_a_version_is_served_only_after_that_many_updates(link):
    server, link, buffers = link
    dest = torch.zeros(1001)
    transfer = link.fetch(0, 1, dest, [])
    assert not transfer.done.wait(0.3), "version 1 was served before the update"
    link.send(0, torch.full((1001,), 2.0), []).wait()
    updater = threading.Thread(target=server.step, args=(0, lambda: None, lambda lo, hi: buffers[0][lo:hi].mul_(3)))
    updater.start()
    transfer.wait()
    updater.join()
    assert torch.equal(dest, torch.full((1001,), 6.0))  # the gradient landed, then the update ran on it


def test_a_lost_store_fails_the_transfer_instead_of_hanging(link):
    server, link, _ = link
    transfer = link.fetch(0, 5, torch.empty(1001), [])  # a version that never comes
    server.close()
    with pytest.raises(ConnectionError, match="test store"):
        transfer.wait()
    with pytest.raises(ConnectionError):
        link.fetch(0, 0, torch.empty(1001), [])


def test_an_update_waiting_for_a_gradient_gives_up_when_the_worker_link_closes(link):
    """A GPU worker that dies before its gradient landed must not leave the store's actor blocked
    (a checkpoint from the stores waits behind it): the update raises and leaves the layer as it was."""
    server, link, buffers = link
    before = buffers[0].clone()
    errors = []

    def update():
        try:
            server.step(0, lambda: None, lambda lo, hi: buffers[0][lo:hi].add_(1))
        except ConnectionError as e:
            errors.append(e)

    updater = threading.Thread(target=update, daemon=True)
    updater.start()
    link.close()  # what the worker's death does to its sockets
    updater.join(timeout=5)
    assert not updater.is_alive(), "the update still waits for a gradient that cannot come"
    assert len(errors) == 1 and "never came" in str(errors[0])
    assert torch.equal(buffers[0], before) and server.applied[0] == 0


# ---- layers in pieces -------------------------------------------------------------------------------

PIECE = 256  # elements: layer 0 (1,001 fp32) in four pieces, the last of 233


@pytest.fixture
def pieced():
    buffers = {0: torch.arange(1001, dtype=torch.float32)}
    server = LayerServer(buffers, "127.0.0.1")
    yield server, buffers
    server.close()


def gradient_connection(server: LayerServer, layer: int) -> socket.socket:
    """A GPU worker's one gradient connection, spoken by hand: its hello and the layer's header."""
    sock = socket.create_connection(server.address)
    sock.sendall(HELLO.pack(b"G", 0, 1))
    sock.sendall(GRADIENT.pack(layer, PIECE))
    return sock


def wait_until(condition, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_a_piece_is_updated_as_soon_as_it_lands_and_leaves_as_soon_as_it_is_updated(pieced):
    """The turn of a step overlapped: the first piece's update runs while the rest of the gradient is
    still to come, and its new weights reach the worker while later pieces wait for their update."""
    server, buffers = pieced
    bounds = piece_bounds(1001, PIECE)
    grad = torch.full((1001,), 2.0)
    updated, release = [], threading.Event()

    def update(lo, hi):
        if lo > 0:
            release.wait(5)  # later pieces held back: the first one's weights must leave without them
        buffers[0][lo:hi].mul_(3)
        updated.append((lo, hi))

    begun = []
    updater = threading.Thread(target=server.step, args=(0, lambda: begun.append(True), update), daemon=True)
    updater.start()
    sock = gradient_connection(server, 0)
    sock.sendall(byte_view(grad)[: PIECE * 4])  # the first piece only
    wait_until(lambda: updated == bounds[:1], "the first piece was not updated once it had landed")
    assert begun == [True] and server.applied[0] == 0 and server.received(0) == 0

    link = LayerLink(server.address, 1, "test store", {0: PIECE})  # one stream, as the hand-spoken hello said
    dest = torch.zeros(1001)
    transfer = link.fetch(0, 1, dest, [])
    sock.sendall(byte_view(grad)[PIECE * 4 :])  # the rest of the gradient lands
    wait_until(lambda: server.received(0) == 1, "the rest of the gradient did not land")
    wait_until(lambda: torch.equal(dest[:PIECE], torch.full((PIECE,), 6.0)),
               "the first piece's new weights did not leave before the last piece's update")
    assert not transfer.done.is_set() and updated == bounds[:1]
    release.set()
    transfer.wait()
    updater.join(5)
    assert updated == bounds and server.applied[0] == 1
    assert torch.equal(dest, torch.full((1001,), 6.0))
    link.close()
    sock.close()


def test_a_gradient_cut_after_its_first_piece_stops_the_update_there(pieced):
    """The worker dies part-way through sending a gradient: the update stops at the last piece that
    landed and says so, and the layer does not count as applied (no weights of that version leave)."""
    server, buffers = pieced
    errors, updated = [], []

    def step():
        try:
            server.step(0, lambda: None, lambda lo, hi: updated.append((lo, hi)))
        except ConnectionError as e:
            errors.append(e)

    updater = threading.Thread(target=step, daemon=True)
    updater.start()
    sock = gradient_connection(server, 0)
    sock.sendall(byte_view(torch.ones(1001))[: 2 * PIECE * 4])  # two of the four pieces
    wait_until(lambda: len(updated) == 2, "the pieces that landed were not updated")
    sock.close()
    updater.join(timeout=5)
    assert not updater.is_alive(), "the update still waits for pieces that cannot come"
    assert len(errors) == 1 and "cut after 2 of its 4 pieces" in str(errors[0])
    assert updated == piece_bounds(1001, PIECE)[:2] and server.applied[0] == 0


@pytest.mark.parametrize("streams", [1, 3])
def test_pieced_layers_cross_whole_in_both_directions(streams):
    """Pieces split over the streams as whole layers are: odd sizes, a bf16 layer, two updates; a
    layer not named travels whole beside one that travels in pieces."""
    buffers = {0: torch.arange(1001, dtype=torch.float32), 1: torch.arange(700, dtype=torch.bfloat16)}
    server = LayerServer(buffers, "127.0.0.1")
    link = LayerLink(server.address, streams, "test store", {1: PIECE})
    try:
        for version in (1, 2):
            for layer, t in buffers.items():
                assert len(server.bounds[layer]) == (3 if layer == 1 and version == 2 else 1)  # once sent in them
                grad = torch.randn(t.numel()).to(t.dtype)
                link.send(layer, grad, []).wait()
                server.step(layer, lambda: None, lambda lo, hi: None)  # the new weights are the gradient here
                dest = torch.empty_like(t)
                link.fetch(layer, version, dest, []).wait()
                assert torch.equal(dest, grad) and server.applied[layer] == server.received(layer) == version
    finally:
        link.close()
        server.close()



def test_a_closed_server_and_link_leave_no_thread_behind():
    """A store's server and a worker's link, closed (the run ended), end every thread they started: the
    server's listener and its connections', one still waiting for an update that will not come among
    them, and the link's streams. None outlives them in the process."""
    before = set(threading.enumerate())
    server = LayerServer({0: torch.arange(1001, dtype=torch.float32)}, "127.0.0.1")
    link = LayerLink(server.address, STREAMS, "test store")
    dest = torch.empty(1001, dtype=torch.float32)
    link.fetch(0, 0, dest, []).wait()
    assert torch.equal(dest, torch.arange(1001, dtype=torch.float32))
    link.fetch(0, 1, torch.empty(1001), [])  # a version that no update makes
    time.sleep(0.1)  # the server's threads wait for it
    link.close()
    server.close()
    deadline = time.monotonic() + 10
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not [t.name for t in set(threading.enumerate()) - before]
