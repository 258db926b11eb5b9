"""A run's Session as the tests look into it: with the benchmark's probed actors (bench/telemetry.py),
and every layer's weights read back."""

from __future__ import annotations

from megatrain_ray.bench.telemetry import ProbedStore, ProbedWorker
from megatrain_ray.runtime.session import Session


def probed_session(config, arch, **kwargs) -> Session:
    """A Session whose actors also report what they measure (Probe(session) reads it)."""
    return Session(config, arch, worker_class=ProbedWorker, store_class=ProbedStore, **kwargs)


def layer_weights(session: Session) -> list:
    """Every layer's fp32 master weights, in layer order."""
    return [weights for _, weights in session.iter_layer_weights()]
