"""Page-locking memory we did not allocate (the stores' shared-memory buffers a GPU worker maps) on a
thread of its own, so that the worker's start waits for none of it.

cudaHostRegister page-locks 2.5 to 3 GB a second (6 s for a 7B model's bf16 weights, a minute at
32B). The buffers are registered in the order they are handed over (`add`: the order a step first
uses them) and each use waits for its own buffers only (`wait`), so the first step reads layer 0
while later layers are still being registered. A copy from or to memory not yet registered would
still be correct (CUDA stages it, and a copy into it returns only once done), but slow and
synchronous: nothing copies before its wait."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Hashable

import torch

GiB = 1024**3


class BackgroundRegistration:
    """`register` and `unregister` page-lock a tensor's memory and release it (host/memory.py,
    cuda_host_register; a test's own); `device`: the CUDA device current on the thread (CUDA
    registers memory for the current device's context); `say`: where to tell, once the thread has
    registered all it was handed, how long that took and how long the uses waited for it."""

    def __init__(self, register: Callable[[torch.Tensor], None], unregister: Callable[[torch.Tensor], None],
                 device: torch.device | None = None, say: Callable[[str], None] | None = None):
        self._register, self._unregister = register, unregister
        self._cuda_index = None  # the device to make current on the thread: the caller's where unnamed
        if device is not None and device.type == "cuda":
            self._cuda_index = torch.cuda.current_device() if device.index is None else device.index
        self._say = say
        self._lock = threading.Lock()
        self._queue: deque[tuple[Hashable, list[torch.Tensor]]] = deque()
        self._ready: dict[Hashable, threading.Event] = {}
        self._thread: threading.Thread | None = None
        self._closed = False
        self.error: BaseException | None = None
        self.registered: list[torch.Tensor] = []  # in order; what `close` releases
        self.waited_s = 0.0  # how long the uses waited for their buffers

    def add(self, key: Hashable, tensors: list[torch.Tensor]) -> None:
        """Register these after everything added before; `wait(key)` returns once they are."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the registration was closed")
            self._ready[key] = threading.Event()
            if self.error is not None:  # registering stopped there: `wait` raises it
                self._ready[key].set()
                return
            self._queue.append((key, list(tensors)))
            if self._thread is None:  # none running: start one (it ends when it has emptied the queue)
                self._thread = threading.Thread(target=self._run, name="cuda-host-register", daemon=True)
                self._thread.start()

    def wait(self, key: Hashable) -> None:
        """Until the buffers added under `key` are registered; raises what the thread raised."""
        ready = self._ready[key]
        if not ready.is_set():
            t0 = time.perf_counter()
            ready.wait()
            self.waited_s += time.perf_counter() - t0
        if self.error is not None:
            raise RuntimeError(f"page-locking the stores' buffers with CUDA failed: {self.error}") from self.error

    def close(self) -> None:
        """Stop registering (after the buffer in hand), then release every buffer registered, once."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None:
            thread.join()
        for t in self.registered:
            self._unregister(t)
        self.registered.clear()

    def _run(self) -> None:
        t0, nbytes = time.perf_counter(), 0
        try:
            if self._cuda_index is not None:
                torch.cuda.set_device(self._cuda_index)
            while (item := self._next()) is not None:
                key, tensors = item
                for t in tensors:
                    self._register(t)
                    self.registered.append(t)
                    nbytes += t.numel() * t.element_size()
                self._ready[key].set()
        except BaseException as e:  # raised at the next wait, never swallowed
            self.error = e
        finally:
            self._end()
        if self.error is None and not self._closed and self._say is not None:
            self._say(f"the stores' buffers registered with CUDA in the background: {nbytes / GiB:.1f} GiB in "
                      f"{time.perf_counter() - t0:.1f} s; the reads so far waited {self.waited_s:.1f} s for it")

    def _next(self) -> tuple[Hashable, list[torch.Tensor]] | None:
        with self._lock:
            if self._closed or not self._queue:
                return None
            return self._queue.popleft()

    def _end(self) -> None:
        """Wake whoever waits for what is left (closed, or after an error: `wait` then raises), and let
        the next `add` start a thread."""
        with self._lock:
            for ready in self._ready.values():
                ready.set()
            self._queue.clear()
            self._thread = None
