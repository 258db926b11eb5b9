"""`megatrain-ray bench --ram-nodes N`: the benchmark with every layer on RAM-node raylets of this machine.

A head (with this machine's GPUs) and N raylets offering `megatrain_ram` start here through
ray.cluster_utils.Cluster: real raylets with their own object stores, as `ray start` makes them,
without the dashboard (whose packages GPU machines often lack). The bench joins that cluster with
runtime.store_on_gpu_node false, so every store lives on a raylet and reaches the GPU worker over
the TCP transport exactly as it would from another machine, only without a network in between.
Afterwards exactly those processes end; a Ray already running on the machine is not touched.

Each raylet offers its share of the machine's cores as its CPUs (`raylet_cpus`), as a RAM node of
its own would offer all of its cores, and its store sizes its optimizer threads from them
(planning/placement.py, store_threads): the raylets' stores together take the cores a store on the
GPU node would take, never the same cores twice.
"""

from __future__ import annotations

import contextlib
import os

from megatrain_ray.config import ConfigError
from megatrain_ray.planning.prediction import TRANSPORT_CORES

GiB = 1024**3


def raylet_cpus(cores: int, gpus: int, count: int) -> tuple[int, int]:
    """(the head's CPUs, each raylet's) on a machine of `cores`: the head keeps what a GPU node keeps
    beside its store (one, and one per GPU), the rest is shared evenly among the raylets, each of
    which keeps one of its share for its transport. So the raylets' optimizer threads sum to the
    threads one store on the GPU node would run."""
    head = 1 + gpus
    share = max(0, cores - head) // count
    return head, share + TRANSPORT_CORES


@contextlib.contextmanager
def local_ram_nodes(count: int, object_store_bytes: int = GiB // 2):  # holds only a step's token ids
    import ray
    import torch
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        raise ConfigError("--ram-nodes starts a cluster of its own; run it from a process not yet connected to Ray")
    head_cpus, cpus = raylet_cpus(os.cpu_count() or 1, torch.cuda.device_count(), count)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": head_cpus, "num_gpus": torch.cuda.device_count(),
        "object_store_memory": object_store_bytes, "include_dashboard": False,
    })
    try:
        for _ in range(count):
            cluster.add_node(num_cpus=cpus, num_gpus=0, object_store_memory=object_store_bytes,
                             resources={"megatrain_ram": 1})
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        print(f"local cluster: a head ({head_cpus} CPUs) and {count} RAM-node raylet(s) of {cpus} CPUs each on this "
              f"machine at {cluster.address}", flush=True)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
