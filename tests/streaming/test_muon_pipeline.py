"""The order in which streaming/muon_step.py queues a step's matrices and waits for them, recorded on
the CPU: three matrices in flight (one uploading, one iterating, one coming back), counted across
the blocks, so that on a GPU the copies of one matrix overlap another's iterations and the host never
waits for a matrix whose successors are not queued yet."""

from __future__ import annotations

import contextlib
import threading

import torch

from megatrain_ray.models.registry import PRESETS
from megatrain_ray.runtime.local import LocalTrainer
from megatrain_ray.streaming.muon_step import IN_FLIGHT
from megatrain_ray.streaming.streams import CpuEvent, Streams
from helpers.reference_training import random_micro_batches
from test_muon_step import config, on_device


class RecordedEvent(CpuEvent):
    def __init__(self, log: list, stream: str):
        super().__init__()
        self.log, self.stream = log, stream

    def synchronize(self) -> None:
        self.log.append(("wait", self.id, threading.current_thread() is threading.main_thread()))


class RecordedStreams(Streams):
    """The CPU's streams (no-ops), each event recorded and each host wait for one logged."""

    def __init__(self):
        super().__init__(torch.device("cpu"))
        self.h2d, self.compute, self.d2h = "h2d", "compute", "d2h"
        self.log: list = []

    def on(self, stream):
        return contextlib.nullcontext()

    def record(self, stream, timing: bool = False):
        event = RecordedEvent(self.log, stream)
        self.log.append((stream, event.id, True))
        return event


def test_three_matrices_are_in_flight_across_the_blocks():
    arch = PRESETS["tiny-llama"]
    trainer = LocalTrainer(config("fp32", "fp32"), arch)
    source = on_device(trainer)
    streams = source.streams = RecordedStreams()
    trainer.train_step(random_micro_batches(arch, 1, 2, batch=1, seq=8, seed=3)[0])
    trainer.source.drain()

    landing = [i for kind, i, _ in streams.log if kind == "d2h"]  # matrix k's landing event, k over the step
    assert len(landing) == len(source.momenta) * 7 > 2 * IN_FLIGHT  # q k v o gate up down, every block
    queued = 0  # matrices whose upload the host has queued
    waited = set()
    for kind, i, main in streams.log:
        if kind == "h2d":
            assert queued < IN_FLIGHT or landing[queued - IN_FLIGHT] in waited, \
                f"matrix {queued} uploads before matrix {queued - IN_FLIGHT} has landed"
            queued += 1
        elif kind == "wait" and main and i in landing:
            waited.add(i)
            k = landing.index(i)
            assert queued == len(landing) or queued >= k + IN_FLIGHT, \
                f"the host waits for matrix {k} with only {queued} queued"
    assert IN_FLIGHT >= 3  # an upload, an iteration and a landing at once
    trainer.close()
