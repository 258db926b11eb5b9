"""The order in which streaming/muon_step.py queues a step's matrices and what waits for them,
recorded on the CPU: the matrices take IN_FLIGHT staging buffers in turn, each upload waiting on the
copy-in stream (not on the host) for the last copy out of its buffer; the iterations run on a stream
of their own, not the executor's compute stream; train_step returns before any block's results have
landed, and the next read of a block's weights waits until its store has applied them."""

from __future__ import annotations

import contextlib
import threading
import time

import torch

from megatrain_ray.models.registry import PRESETS
from megatrain_ray.runtime.local import LocalTrainer
from megatrain_ray.streaming.muon_step import IN_FLIGHT
from megatrain_ray.streaming.streams import CpuEvent, Streams
from helpers.reference_training import random_micro_batches
from test_muon_step import config, on_device


class RecordedEvent(CpuEvent):
    """A host wait for it is logged; off the main thread it first waits for the test's `gate`
    (the results have not landed yet)."""

    def __init__(self, streams: "RecordedStreams"):
        super().__init__()
        self.streams = streams

    def synchronize(self) -> None:
        main = threading.current_thread() is threading.main_thread()
        self.streams.log.append(("sync", self.id, main))
        if not main:
            assert self.streams.gate.wait(timeout=30), "the gate was never opened"


class RecordedStreams(Streams):
    """The CPU's streams (no-ops), each event recorded, each stream's wait and each host wait logged."""

    def __init__(self):
        super().__init__(torch.device("cpu"))
        self.h2d, self.compute, self.d2h = "h2d", "compute", "d2h"
        self.log: list = []
        self.gate = threading.Event()

    def on(self, stream):
        return contextlib.nullcontext()

    def record(self, stream, timing: bool = False):
        event = RecordedEvent(self)
        self.log.append((stream, event.id, True))
        return event

    def wait(self, stream, event) -> None:
        self.log.append(("wait", stream, event.id))


def test_the_update_phase_waits_on_streams_and_the_next_read_on_the_store():
    arch = PRESETS["tiny-llama"]
    trainer = LocalTrainer(config("fp32", "fp32"), arch)
    source = on_device(trainer)
    streams = source.streams = RecordedStreams()
    source.iterating = "iterate"
    trainer.train_step(random_micro_batches(arch, 1, 2, batch=1, seq=8, seed=3)[0])

    log = streams.log
    landing = [i for kind, i, _ in log if kind == "d2h"]  # matrix k's landing event, k over the step
    assert len(landing) == len(source.momenta) * 7 > 2 * IN_FLIGHT  # q k v o gate up down, every block
    assert [kind for kind, _, _ in log if kind in ("iterate", "compute")] == ["iterate"] * len(landing)
    assert not [e for e in log if e[0] == "sync" and e[2]], "the host waited for a matrix in train_step"
    store_of = {i: store for store in trainer.stores for i in store.layers}
    assert all(store_of[i].layers[i].updates == 0 for i in source.momenta), "a store was told before its results landed"
    queued, h2d_waits = 0, set()  # matrices whose upload is queued; the copy-in stream's waits since the last
    for kind, i, j in log:
        if kind == "wait" and i == "h2d":
            h2d_waits.add(j)
        elif kind == "h2d":
            assert queued < IN_FLIGHT or landing[queued - IN_FLIGHT] in h2d_waits, \
                f"matrix {queued} uploads into the buffer of matrix {queued - IN_FLIGHT} before its copy out"
            queued, h2d_waits = queued + 1, set()
    assert queued == len(landing)

    first = min(source.momenta)
    read: list[int] = []
    reader = threading.Thread(target=lambda: (source.weights(first), read.append(store_of[first].layers[first].updates)))
    reader.start()
    time.sleep(0.3)
    assert reader.is_alive() and not read, "the block's weights were read before its results had landed"
    streams.gate.set()
    reader.join(timeout=30)
    assert read == [1], "the read returned before the store had applied the block's update"
    trainer.source.drain()
    assert all(store_of[i].layers[i].updates == 1 for i in source.momenta)
    trainer.close()
