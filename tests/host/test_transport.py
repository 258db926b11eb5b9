"""The TCP link between a store and a GPU worker, in one process over loopback: versions, chunks
over several connections, and a lost store failing loudly instead of hanging."""

import threading

import pytest
import torch

from megatrain_ray.host.transport import LayerLink, LayerServer

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
    server.step(1, lambda: None)  # returns only once the whole gradient has landed
    assert torch.equal(buffers[1], grad)


def test_a_version_is_served_only_after_that_many_updates(link):
    server, link, buffers = link
    dest = torch.zeros(1001)
    transfer = link.fetch(0, 1, dest, [])
    assert not transfer.done.wait(0.3), "version 1 was served before the update"
    link.send(0, torch.full((1001,), 2.0), []).wait()
    updater = threading.Thread(target=server.step, args=(0, lambda: buffers[0].mul_(3)))
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
            server.step(0, lambda: buffers[0].add_(1))
        except ConnectionError as e:
            errors.append(e)

    updater = threading.Thread(target=update, daemon=True)
    updater.start()
    link.close()  # what the worker's death does to its sockets
    updater.join(timeout=5)
    assert not updater.is_alive(), "the update still waits for a gradient that cannot come"
    assert len(errors) == 1 and "never came" in str(errors[0])
    assert torch.equal(buffers[0], before) and server.applied[0] == 0
