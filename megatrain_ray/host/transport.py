"""Layers over TCP between a store and a GPU worker on another node.

Ray places both ends and supervises them; the bytes do not go through Ray's object store, where a
put and a get copy a layer through both nodes' object stores on top of the network (the earlier
path: 38% of the shared-memory path's speed on one machine; examples/benchmarks/transport_speed.py measured
0.46-0.59 GB/s for it against 2.5-2.7 GB/s for these sockets between two raylets of the 2-core
test machine). Here a layer moves from the
store's buffer straight into a pinned slot on the GPU node, and a gradient from the GPU node's
pinned outbox straight into the store's buffer: no copy but the kernel's, each layer split over
`streams` connections that run in parallel.

Wire: every connection opens with a hello (kind, stream k, streams). On a weights connection the
GPU worker sends (layer, version) and the store answers with byte chunk k of the layer once it
has applied `version` updates to it. On a gradient connection the GPU worker sends (layer) and
chunk k of the layer's gradient, which lands in the store's buffer of that layer (its weights
were read for the last time this step before the gradient was computed).
"""

from __future__ import annotations

import queue
import socket
import struct
import threading
from typing import Callable

import torch

HELLO = struct.Struct("<cII")  # b"W" or b"G", stream index, streams
REQUEST = struct.Struct("<qq")  # layer, version
GRADIENT = struct.Struct("<q")  # layer


def byte_view(t: torch.Tensor) -> memoryview:
    """A flat tensor's memory as bytes, for recv_into / sendall without a copy."""
    return memoryview(t.view(torch.uint8).numpy())


def chunk(view: memoryview, k: int, streams: int) -> memoryview:
    n = len(view)
    return view[k * n // streams:(k + 1) * n // streams]


def recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill `view` from the socket; False on a clean end of stream before any byte."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
        if n == 0:
            if got == 0:
                return False
            raise ConnectionError(f"connection closed after {got} of {len(view)} bytes")
        got += n
    return True


def recv_struct(sock: socket.socket, fmt: struct.Struct) -> tuple | None:
    buf = bytearray(fmt.size)
    return fmt.unpack(buf) if recv_exact(sock, memoryview(buf)) else None


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # requests are tiny: never wait for Nagle
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


class LayerServer:
    """The store's end: serves a layer's weights once they are current, receives gradients.

    `applied[i]` counts the updates the store has finished on layer i (skipped ones included),
    `received[i]` the gradients that have fully landed; an update waits for its gradient, and a
    request for version v waits until v updates are applied. Once a gradient connection closes (the
    GPU worker died, or its links were closed), an update still waiting for its gradient gives up
    without touching the layer: the store is free again, for a checkpoint from its state.
    """

    def __init__(self, buffers: dict[int, torch.Tensor], host: str, grads: dict[int, torch.Tensor] | None = None):
        """`buffers`: each layer's weights; `grads`: where its gradient lands (default: over the weights)."""
        self.views = {i: byte_view(t) for i, t in buffers.items()}
        self.grad_views = {i: byte_view(t) for i, t in (grads or buffers).items()}
        self.applied = {i: 0 for i in buffers}
        self.arrived = {i: 0 for i in buffers}  # gradient chunks landed, over all streams
        self.streams = 1
        self.gradients_cut = False  # a gradient connection closed: no gradient still missing will come
        self.cond = threading.Condition()
        self.listener = socket.create_server((host, 0))
        self.address = (host, self.listener.getsockname()[1])
        self.connections: list[socket.socket] = []
        threading.Thread(target=self._accept, name="layer-server", daemon=True).start()

    def received(self, layer: int) -> int:
        return self.arrived[layer] // self.streams

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            _tune(conn)
            self.connections.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            hello = recv_struct(conn, HELLO)
            if hello is None:
                return
            kind, k, streams = hello
            self.streams = streams
            if kind == b"W":
                self._serve_weights(conn, k, streams)
            else:
                self._receive_gradients(conn, k)
        except OSError:
            pass  # the GPU worker went away; Ray tells the driver, which ends the run
        finally:
            conn.close()

    def _serve_weights(self, conn: socket.socket, k: int, streams: int) -> None:
        while (request := recv_struct(conn, REQUEST)) is not None:
            layer, version = request
            with self.cond:
                self.cond.wait_for(lambda: self.applied[layer] >= version)
            conn.sendall(chunk(self.views[layer], k, streams))

    def _receive_gradients(self, conn: socket.socket, k: int) -> None:
        try:
            while (header := recv_struct(conn, GRADIENT)) is not None:
                (layer,) = header
                if not recv_exact(conn, chunk(self.grad_views[layer], k, self.streams)):
                    raise ConnectionError("gradient cut short")
                with self.cond:
                    self.arrived[layer] += 1
                    self.cond.notify_all()
        finally:
            with self.cond:
                self.gradients_cut = True
                self.cond.notify_all()

    def step(self, layer: int, update: Callable[[], None]) -> None:
        """Run a layer's update once its gradient has landed; then its new weights may leave. A
        gradient that can no longer come (its connection closed) raises, the layer untouched."""
        with self.cond:
            self.cond.wait_for(lambda: self.received(layer) > self.applied[layer] or self.gradients_cut)
            if self.received(layer) <= self.applied[layer]:
                raise ConnectionError(f"layer {layer}'s gradient never came: the GPU worker's link closed; "
                                      f"the layer keeps its state")
        update()
        with self.cond:
            self.applied[layer] += 1
            self.cond.notify_all()

    def close(self) -> None:
        self.listener.close()
        for conn in self.connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class Transfer:
    """One layer on its way, in `parts` chunks; `wait()` raises if its link failed."""

    def __init__(self, parts: int):
        self.left = parts
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.lock = threading.Lock()

    def part_done(self) -> None:
        with self.lock:
            self.left -= 1
            if self.left == 0:
                self.done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.set()

    def wait(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise ConnectionError(str(self.error))


class _Stream:
    """One connection and the thread that works through its queue of chunks, in order."""

    def __init__(self, link: "LayerLink", kind: bytes, k: int):
        self.link = link
        self.k = k
        self.sock = socket.create_connection(link.address)
        _tune(self.sock)
        self.sock.sendall(HELLO.pack(kind, k, link.streams))
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        work = self._fetch if kind == b"W" else self._send
        self.thread = threading.Thread(target=self._run, args=(work,), name=f"link-{kind.decode()}{k}", daemon=True)
        self.thread.start()

    def _run(self, work) -> None:
        while (job := self.jobs.get()) is not None:
            transfer, after = job[0], job[-1]
            if self.link.error is not None:  # a lost store: fail everything queued, loudly
                transfer.fail(self.link.error)
                continue
            try:
                for wait in after:
                    wait()
                work(*job[1:-1])
                transfer.part_done()
            except BaseException as e:
                self.link.fail(e)
                transfer.fail(self.link.error)

    def _fetch(self, layer: int, version: int, dest: memoryview) -> None:
        self.sock.sendall(REQUEST.pack(layer, version))
        if not recv_exact(self.sock, chunk(dest, self.k, self.link.streams)):
            raise ConnectionError("the store closed the connection")

    def _send(self, layer: int, src: memoryview) -> None:
        self.sock.sendall(GRADIENT.pack(layer))
        self.sock.sendall(chunk(src, self.k, self.link.streams))


class LayerLink:
    """The GPU worker's end of one store's connections: `streams` for weights, as many for gradients."""

    def __init__(self, address: tuple[str, int], streams: int, name: str):
        self.address = tuple(address)
        self.streams = streams
        self.name = name
        self.error: ConnectionError | None = None
        self.transfers: list[Transfer] = []
        self.weights = [_Stream(self, b"W", k) for k in range(streams)]
        self.gradients = [_Stream(self, b"G", k) for k in range(streams)]

    def _queue(self, streams: list[_Stream], args: tuple, after: list[Callable[[], None]]) -> Transfer:
        if self.error is not None:
            raise self.error
        transfer = Transfer(self.streams)
        self.transfers = [t for t in self.transfers if not t.done.is_set()] + [transfer]
        for stream in streams:
            stream.jobs.put((transfer, *args, after))
        return transfer

    def fetch(self, layer: int, version: int, dest: torch.Tensor, after: list[Callable[[], None]]) -> Transfer:
        """The layer's weights after `version` updates, into `dest`, once every `after` has returned."""
        return self._queue(self.weights, (layer, version, byte_view(dest)), after)

    def send(self, layer: int, src: torch.Tensor, after: list[Callable[[], None]]) -> Transfer:
        """The layer's gradient from `src` into the store's buffer, once every `after` has returned."""
        return self._queue(self.gradients, (layer, byte_view(src)), after)

    def fail(self, error: BaseException) -> None:
        self.error = self.error or ConnectionError(f"lost the connection to the store on {self.name}: {error}")
        for transfer in list(self.transfers):
            if not transfer.done.is_set():
                transfer.fail(self.error)

    def close(self) -> None:
        for stream in self.weights + self.gradients:
            stream.jobs.put(None)
            try:
                stream.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            stream.sock.close()
