"""CUDA streams and events that vanish on the CPU, so one scheduler runs (and is tested) on both."""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field

import torch

_event_ids = itertools.count()


class CpuEvent:
    """Stands in for a CUDA event: work on the CPU is done when it is issued."""

    def __init__(self) -> None:
        self.id = next(_event_ids)

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class Streams:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.compute = torch.cuda.current_stream(device)
            self.h2d = torch.cuda.Stream(device)
            self.d2h = torch.cuda.Stream(device)
        else:
            self.compute = self.h2d = self.d2h = None

    def side(self):
        """One more stream on the device, none of the three (None on the CPU)."""
        return torch.cuda.Stream(self.device) if self.cuda else None

    def event(self, timing: bool = False):
        if self.cuda:
            return torch.cuda.Event(enable_timing=timing)
        return CpuEvent()

    def on(self, stream):
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def record(self, stream, timing: bool = False):
        event = self.event(timing)
        if self.cuda:
            event.record(stream)
        return event

    def wait(self, stream, event) -> None:
        if self.cuda:
            stream.wait_event(event)

    def synchronize(self) -> None:
        """Until this scheduler's streams are done; others' (streaming/device_step.py's copy back) go on."""
        if self.cuda:
            for stream in (self.compute, self.h2d, self.d2h):
                stream.synchronize()


@dataclass
class TransferStats:
    """What one step's streams did: bytes and times of the copies and of the compute."""

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    h2d_events: list = field(default_factory=list)  # (start, end) pairs on CUDA
    d2h_events: list = field(default_factory=list)
    h2d_seconds: float = 0.0  # measured directly on the CPU
    d2h_seconds: float = 0.0
    prefetch_wait_s: float = 0.0
    copies: int = 0
    compute_events: list = field(default_factory=list)  # (start, end) of each unit's compute on CUDA
    step_start: object = None  # when the step began: an event on CUDA, perf_counter on the CPU
    first_compute: object = None  # when the first unit's compute began, likewise
    last_compute: object = None  # when the last unit's compute ended, likewise
    compute_seconds: float = 0.0  # measured directly on the CPU
    host_add_wait_s: float = 0.0  # the executor blocked on the host's adds of gradients summed there (host_gradients.py)
