"""The random draws of a layer's forward, replayed in its recompute: a model with dropout (or a
router's jitter) draws random numbers in a training forward, and backward recomputes each layer
from its saved input, which must draw the same ones. As torch.utils.checkpoint does: the CPU
generator's state and the device's are saved before the forward, and set again, in a forked
stream that leaves the step's own untouched, around the recompute."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RngState:
    cpu: torch.Tensor
    device: torch.Tensor | None  # the CUDA generator's, on a CUDA device


def capture(device: torch.device) -> RngState:
    return RngState(torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


@contextlib.contextmanager
def replayed(state: RngState | None, device: torch.device):
    """Within: the generators as `state` left them (nothing to replay: None); after: as before."""
    if state is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if state.device is not None else []):
        torch.set_rng_state(state.cpu)
        if state.device is not None:
            torch.cuda.set_rng_state(state.device, device)
        yield
