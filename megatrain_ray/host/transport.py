"""Layers over TCP between a store and a GPU worker on another node.

Ray places both ends and supervises them; the bytes do not go through Ray's object store, where a
put and a get copy a layer through both nodes' object stores on top of the network (the earlier
path: 38% of the shared-memory path's speed on one machine; examples/benchmarks/transport_speed.py measured
0.46-0.59 GB/s for it against 2.5-2.7 GB/s for these sockets between two raylets of the 2-core
test machine). Here a layer moves from the
store's buffer straight into a pinned slot on the GPU node, and a gradient from the GPU node's
pinned outbox straight into the store's buffer: no copy but the kernel's, each layer split over
`streams` connections that run in parallel.

Wire: every connection opens with a hello (kind, stream k, streams). A layer travels in pieces of
`piece` elements (the last one shorter; 0: the whole layer as one piece), each piece split over the
`streams` connections, chunk k on connection k; a layer always travels in the same pieces. On a
weights connection the GPU worker sends (layer, version, piece) and the store answers with chunk k
of each piece in order, each once it has applied `version` updates to that piece and after a status
saying so; or, once its disk tier failed (host/disk.py: a full disk under a compute copy's file, as a
gradient lands or an update reads or writes it), a status with the disk's error, which the worker
raises as the store's DiskTierError (the run then stops as a full disk stops it, not as a lost link;
the store takes no update after it, and its gradient connections drop what comes). On a gradient
connection the GPU worker sends (layer, piece) and chunk k of each piece of the layer's gradient, in
order, which land in the store's buffer of that layer (its weights were read for the last time this
step before the gradient was computed). The store updates each piece as soon as it has landed, and
each new piece leaves as soon as it is updated: the three stages overlap.

That pays at the turn of a step, where the first layer's gradient goes out last and its new weights
must come straight back for the next forward: the turn then costs about the slowest stage and a
piece of the others instead of their sum (`turn_pieces`: only that layer travels in pieces). Any
other layer's gradient has long landed when its update runs, and a piece is one more call of the
multi-threaded AdamW kernel, whose threads meet at its end.
"""

from __future__ import annotations

import queue
import socket
import struct
import threading
from collections import Counter
from contextlib import contextmanager, nullcontext
from typing import Callable

import torch

from megatrain_ray.host.disk import DiskTierError
from megatrain_ray.host.precision import QUANT_BLOCK

HELLO = struct.Struct("<cII")  # b"W" or b"G", stream index, streams
REQUEST = struct.Struct("<qqQ")  # layer, version, piece elements (0: whole)
GRADIENT = struct.Struct("<qQ")  # layer, piece elements (0: whole)
STATUS = struct.Struct("<?iI")  # before each piece of weights: failed, the disk's errno, message bytes
SERVED = STATUS.pack(False, 0, 0)
MiB = 1024**2
TURN_LAYER = 0  # the step's first layer forward and last backward (the embedding)


def piece_elements(mib: float, element_size: int) -> int:
    """runtime.transport_piece_mib in elements, whole int8 blocks of them (host/precision.py) so that
    a piece's update is the layer's bit for bit (host/adamw.py, `adamw_step`); 0: whole layers."""
    if mib <= 0:
        return 0
    return max(1, int(mib * MiB / element_size) // QUANT_BLOCK) * QUANT_BLOCK


def turn_pieces(mib: float, element_size: int) -> dict[int, int]:
    """The layers that travel in pieces, and their piece elements: the turn's layer only (above)."""
    piece = piece_elements(mib, element_size)
    return {TURN_LAYER: piece} if piece else {}


def piece_bounds(numel: int, piece: int) -> list[tuple[int, int]]:
    """A layer's pieces on the wire, as element ranges: of `piece` elements each, the last shorter."""
    if piece <= 0 or numel <= piece:
        return [(0, numel)]
    return [(lo, min(numel, lo + piece)) for lo in range(0, numel, piece)]


def byte_view(t: torch.Tensor) -> memoryview:
    """A flat tensor's memory as bytes, for recv_into / sendall without a copy."""
    return memoryview(t.view(torch.uint8).numpy())


def piece_views(t: torch.Tensor, bounds: list[tuple[int, int]]) -> list[memoryview]:
    view, size = byte_view(t), t.element_size()
    return [view[lo * size : hi * size] for lo, hi in bounds]


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


def failure_status(error: DiskTierError) -> bytes:
    """The status that stands for a piece of weights when the store's disk tier failed: its error."""
    message = (error.strerror or str(error)).encode()
    return STATUS.pack(True, error.errno or 0, len(message)) + message


def recv_status(sock: socket.socket) -> None:
    """A piece's status from the store: returns if the piece follows, raises the store's disk error if not."""
    status = recv_struct(sock, STATUS)
    if status is None:
        raise ConnectionError("the store closed the connection")
    failed, code, size = status
    if failed:
        message = bytearray(size)
        recv_exact(sock, memoryview(message))
        raise DiskTierError(code, message.decode())


def drop_the_rest(sock: socket.socket) -> None:
    """Read and drop what the connection brings until it closes."""
    scratch = bytearray(MiB)
    while sock.recv_into(scratch):
        pass


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # requests are tiny: never wait for Nagle
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


class StreamsHold:
    """A held layer's buffer (host/disk.py, HeldWindow) held once for all the streams a layer travels
    over, from the first of them to begin to the last to end: its file is read once for a send, and
    written once for a gradient's landing, not once a stream. Each stream holds the layer on its own
    too, around what it moves, so this hold is taken while that one holds the buffer: it waits for
    none under its lock, which `cut` needs. `cut`: a connection closed, so the streams still to come
    may never come: every such hold is let go, and none is taken after it."""

    def __init__(self, take: Callable[[int], None], let_go: Callable[[int], None]):
        self.take, self.let_go = take, let_go
        self.ends: dict[int, int] = {}  # held layers: the count their streams reach at the hold's end
        self.cut_off = False
        self.lock = threading.Lock()

    def begin(self, layer: int, end: Callable[[], int]) -> None:
        """The first stream of the layer's transfer takes the hold, until every stream reaches `end()`."""
        with self.lock:
            if layer not in self.ends and not self.cut_off:
                self.take(layer)
                self.ends[layer] = end()

    def end(self, layer: int, reached: int) -> None:
        """A stream of the layer's transfer is done; the hold ends once every stream has `reached` its end."""
        with self.lock:
            if layer in self.ends and reached >= self.ends[layer]:
                del self.ends[layer]
                self.let_go(layer)

    def cut(self) -> None:
        with self.lock:
            self.cut_off = True
            held, self.ends = list(self.ends), {}
            for layer in held:
                self.let_go(layer)


class LayerServer:
    """The store's end: serves a layer's weights once they are current, receives gradients.

    `applied[i]` counts the updates the store has finished on layer i (skipped ones included),
    `received(i)` the gradients that have fully landed. An update runs piece by piece (`step`), each
    piece once it has landed, and a request for version v is served piece by piece, each once its
    v-th update is applied. Once a gradient connection closes (the GPU worker died, or its links were
    closed), an update still waiting for its gradient gives up without touching the layer: the store is
    free again, for a checkpoint from its state. (One cut after its first piece leaves the layer part-way
    through the update, which it counts: a checkpoint from the stores then refuses that step.) A held
    layer's gradient cut as it lands lets its buffer go (`landings.cut`); what landed of it
    is never counted, so no update takes it. A held layer is read once a send and written once a
    landing, whatever the streams' timing (`StreamsHold`).

    Once its disk tier fails (`fail`: a held layer that cannot be read or written, or an update that
    raised DiskTierError), the server lands no more gradients and applies no more updates; each
    request for weights still waiting, and each after, is answered with that error.
    """

    def __init__(self, buffers: dict[int, torch.Tensor], host: str, grads: dict[int, torch.Tensor] | None = None,
                 held=None):
        """`buffers`: each layer's weights; `grads`: where its gradient lands (default: over the weights).
        `held`: a store's compute copies on disk (host/disk.py, HeldWindow): each such layer is sent from
        a buffer of its window, held while it is sent, and its gradient lands in one, written to its file after."""
        self.buffers = buffers
        self.grads = grads or buffers
        self.held = held
        numels = {i: t.numel() for i, t in buffers.items()}
        numels.update({i: held.numel(i) for i in held.tier.parts} if held is not None else {})
        self.numels = numels
        self.applied = {i: 0 for i in numels}
        self.done = {i: 0 for i in numels}  # pieces updated, over all updates
        self.arrived: Counter = Counter()  # (layer, stream): gradient pieces landed on that stream, over all
        self.piece: dict[int, int] = {}  # each layer's piece elements, from the first message naming it
        self.bounds = {i: piece_bounds(n, 0) for i, n in numels.items()}
        self.streams = 1
        self.gradients_cut = False  # a gradient connection closed: no gradient still missing will come
        self.sent: Counter = Counter()  # (layer, stream): sends of a held layer served on that stream, over all
        self.sends = StreamsHold(lambda i: held.hold_for_send(i), lambda i: held.let_go(i))
        self.landings = StreamsHold(lambda i: held.hold_for_gradient(i), lambda i: held.let_go(i, dirty=True))
        self.closed = False  # close(): a request still waiting for its version is given up
        self.failure: DiskTierError | None = None  # the disk tier's error that stopped the server (`fail`)
        self.cond = threading.Condition()
        self.listener = socket.create_server((host, 0))
        self.address = (host, self.listener.getsockname()[1])
        self.connections: list[socket.socket] = []
        threading.Thread(target=self._accept, name="layer-server", daemon=True).start()

    def _pieces(self, layer: int, piece: int) -> list[tuple[int, int]]:
        """The layer's pieces, as the first message naming it set them; a message in others is refused."""
        with self.cond:
            if self.piece.setdefault(layer, piece) != piece:
                raise ConnectionError(f"layer {layer} asked for in pieces of {piece} elements, not the "
                                      f"{self.piece[layer]} it travels in")
            self.bounds[layer] = piece_bounds(self.numels[layer], piece)
            return self.bounds[layer]

    def _landed(self, layer: int) -> int:
        """Gradient pieces of the layer landed on every stream, over all its gradients."""
        return min(self.arrived[layer, k] for k in range(self.streams))

    def received(self, layer: int) -> int:
        return self._landed(layer) // len(self.bounds[layer])

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
            kind, k, self.streams = hello
            if kind == b"W":
                try:
                    self._serve_weights(conn, k)
                finally:  # this stream's part of a send still held may never come
                    self.sends.cut()
            else:
                self._receive_gradients(conn, k)
        except OSError:
            pass  # the GPU worker went away; Ray tells the driver, which ends the run
        finally:
            conn.close()

    def _serve_weights(self, conn: socket.socket, k: int) -> None:
        while (request := recv_struct(conn, REQUEST)) is not None:
            try:
                if not self._send_weights(conn, k, *request):
                    break
            except DiskTierError as e:  # the held layer's file could not be read, or the tier's writes failed
                self.fail(e)
                break
        if request is not None and self.failure is not None:
            conn.sendall(failure_status(self.failure))

    def _send_weights(self, conn: socket.socket, k: int, layer: int, version: int, piece: int) -> bool:
        """Chunk k of each piece of the layer's weights after `version` updates, each after its status;
        False: the server closed or failed first."""
        bounds = self._pieces(layer, piece)
        before = (version - 1) * len(bounds)  # pieces updated before this version's
        if not self._wait_updated(layer, before):  # the first piece's update, before a held buffer is taken
            return False
        with self._weights(layer, k) as weights:
            for p, view in enumerate(piece_views(weights, bounds)):
                if not self._wait_updated(layer, before + p):
                    return False
                conn.sendall(SERVED)
                conn.sendall(chunk(view, k, self.streams))
        return True

    def _wait_updated(self, layer: int, pieces: int) -> bool:
        """Until more than `pieces` pieces of the layer are updated; False: the server closed or failed first."""
        with self.cond:
            self.cond.wait_for(lambda: self.done[layer] > pieces or self.closed or self.failure is not None)
            return self.done[layer] > pieces and not self.closed

    def wait_held_gradients(self, count: int) -> None:
        """Until every held layer has received `count` gradients (a step's: each layer gets one a step,
        sent before the step's first update), or a gradient connection closed; raises the disk tier's
        error once it failed (`fail`)."""
        held = self.held.tier.parts if self.held is not None else ()
        with self.cond:
            self.cond.wait_for(lambda: self.gradients_cut or self.failure is not None
                               or all(self.received(i) >= count for i in held))
            if self.failure is not None:
                raise DiskTierError(self.failure.errno, self.failure.strerror)

    def fail(self, error: DiskTierError) -> None:
        """The store's disk tier failed (the first error is kept): no gradient lands and no update runs
        after it, and the requests for weights are answered with it."""
        with self.cond:
            self.failure = self.failure or error
            self.cond.notify_all()

    def _weights(self, layer: int, k: int):
        """The layer's weights while stream k sends them: its buffer, or a held one of the window (its copy only read)."""
        if layer in self.buffers:
            return nullcontext(self.buffers[layer])
        return self._held_weights(layer, k)

    @contextmanager
    def _held_weights(self, layer: int, k: int):
        """A held layer's copy while stream k sends its chunks; the send holds the layer from its first
        stream to its last, so its copy is read once (`StreamsHold`)."""
        with self.held.sending(layer) as weights:
            self.sends.begin(layer, lambda: self.sent[layer, k] + 1)
            yield weights
        with self.cond:
            self.sent[layer, k] += 1
            sent = min(self.sent[layer, s] for s in range(self.streams))
        self.sends.end(layer, sent)

    def _gradient(self, layer: int):
        """Where the layer's gradient lands, while it lands: its buffer, or a held one of the window."""
        return nullcontext(self.grads[layer]) if layer in self.grads else self._held_gradient(layer)

    @contextmanager
    def _held_gradient(self, layer: int):
        """A held layer's gradient buffer while a stream lands its chunk. The gradient holds the layer
        from its first chunk, on any stream, to its last: its file is written once, not once a stream
        (`StreamsHold`), and never after a cut."""
        with self.held.gradient(layer) as grad:
            self.landings.begin(layer, lambda: self._received_now(layer) + 1)
            yield grad
        self.landings.end(layer, self._received_now(layer))

    def _received_now(self, layer: int) -> int:
        with self.cond:
            return self.received(layer)

    def _receive_gradients(self, conn: socket.socket, k: int) -> None:
        try:
            while (self.failure is None and not self.gradients_cut
                   and (header := recv_struct(conn, GRADIENT)) is not None):
                try:
                    self._land(conn, k, *header)
                except DiskTierError as e:  # the held layer's file failed: nothing after it lands
                    self.fail(e)
            if self.failure is not None or self.gradients_cut:  # the worker's sends go on; its step fails
                drop_the_rest(conn)
        finally:
            with self.cond:
                self.gradients_cut = True
                self.cond.notify_all()
            # no gradient still landing will land whole (each comes over every connection): each held
            # layer lets its gradient's hold go, and a hold waiting for a buffer goes on. What landed
            # of such a gradient is written to the layer's file as any landed gradient is, but never
            # counted (`received`): no update takes it (`step` raises), and the state it would have
            # changed (the master, the moments; a fp32 master's copy is remade from it) is as it was,
            # for the checkpoint the run stops with
            self.landings.cut()

    def _land(self, conn: socket.socket, k: int, layer: int, piece: int) -> None:
        """Chunk k of each piece of the layer's gradient, into where it lands."""
        with self._gradient(layer) as grad:
            for view in piece_views(grad, self._pieces(layer, piece)):
                if not recv_exact(conn, chunk(view, k, self.streams)):
                    raise ConnectionError("gradient cut short")
                with self.cond:
                    self.arrived[layer, k] += 1
                    self.cond.notify_all()

    def step(self, layer: int, begin: Callable[[], None], update: Callable[[int, int], None]) -> None:
        """Run a layer's update piece by piece, each `update(lo, hi)` (its elements) once that piece
        of the gradient has landed, after `begin()` once the first has; each new piece may leave as
        soon as it is updated. A gradient that can no longer come (its connection closed) raises: the
        layer untouched if no piece had landed; so does the disk tier's failure (`fail`), as DiskTierError."""
        p = 0
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self._landed(layer) > self.done[layer] or self.gradients_cut
                                   or self.failure is not None)
                pieces = len(self.bounds[layer])  # read once a piece landed: its message set them
                if self.failure is not None:
                    raise DiskTierError(self.failure.errno, self.failure.strerror)
                if self._landed(layer) <= self.done[layer]:
                    if p == 0:
                        raise ConnectionError(f"layer {layer}'s gradient never came: the GPU worker's link closed; "
                                              f"the layer keeps its state")
                    raise ConnectionError(f"layer {layer}'s gradient was cut after {p} of its {pieces} pieces: the GPU "
                                          f"worker's link closed part-way through the layer's update")
            if p == 0:
                begin()
            update(*self.bounds[layer][p])
            p += 1
            with self.cond:
                self.done[layer] += 1
                if p == pieces:
                    self.applied[layer] += 1
                self.cond.notify_all()
            if p == pieces:
                return

    def close(self) -> None:
        """Ends its threads: the listener's (a shut-down socket wakes its accept, which closing alone
        does not) and each connection's, one waiting for an update that will not come too."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
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
        if isinstance(self.error, DiskTierError):  # the store's disk, as the store said it
            raise DiskTierError(self.error.errno, self.error.strerror)
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

    def _fetch(self, layer: int, version: int, piece: int, dest: list[memoryview]) -> None:
        self.sock.sendall(REQUEST.pack(layer, version, piece))
        for view in dest:
            recv_status(self.sock)
            if not recv_exact(self.sock, chunk(view, self.k, self.link.streams)):
                raise ConnectionError("the store closed the connection")

    def _send(self, layer: int, piece: int, src: list[memoryview]) -> None:
        self.sock.sendall(GRADIENT.pack(layer, piece))
        for view in src:
            self.sock.sendall(chunk(view, self.k, self.link.streams))


class LayerLink:
    """The GPU worker's end of one store's connections: `streams` for weights, as many for gradients;
    the layers of `pieces` travel in pieces of so many elements (`turn_pieces`), the others whole."""

    def __init__(self, address: tuple[str, int], streams: int, name: str, pieces: dict[int, int] | None = None):
        self.address = tuple(address)
        self.streams = streams
        self.pieces = pieces or {}
        self.name = name
        self.error: OSError | None = None  # a lost connection, or the store's disk tier's error
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
        return self._queue(self.weights, (layer, version, *self._in_pieces(layer, dest)), after)

    def send(self, layer: int, src: torch.Tensor, after: list[Callable[[], None]]) -> Transfer:
        """The layer's gradient from `src` into the store's buffer, once every `after` has returned."""
        return self._queue(self.gradients, (layer, *self._in_pieces(layer, src)), after)

    def _in_pieces(self, layer: int, t: torch.Tensor) -> tuple[int, list[memoryview]]:
        """The layer's piece elements (0: whole) and `t`'s bytes cut into those pieces."""
        piece = self.pieces.get(layer, 0)
        return piece, piece_views(t, piece_bounds(t.numel(), piece))

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = (error if isinstance(error, DiskTierError)
                          else ConnectionError(f"lost the connection to the store on {self.name}: {error}"))
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
