"""Layer-sized transfers between two raylets of this machine: Ray objects (the earlier RAM-node
path) against the TCP link of host/transport.py and a torch.distributed gloo pair.

    python examples/benchmarks/transport_speed.py [--mib 64] [--repeats 12] [--streams 1 4]

A head (the "GPU node", where a pinned slot receives) and one raylet offering megatrain_ram (the
"store") start here through ray.cluster_utils.Cluster and stop at the end. Each line is GB/s of
layer bytes delivered, weights in (store -> slot) and gradients out (slot -> store buffer).
"""

from __future__ import annotations

import argparse
import socket
import time
import warnings

import ray
import torch
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

MiB = 2**20


def as_tensor(array) -> torch.Tensor:
    """A read-only view into the object store, as the earlier path read it (no copy)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable": we only read it
        return torch.from_numpy(array)


@ray.remote(num_cpus=0)
class Store:
    def __init__(self, nbytes: int):
        self.buffer = torch.ones(nbytes, dtype=torch.uint8)

    def weights(self):  # the earlier path: the layer leaves as an object (one copy into the object store)
        return self.buffer.numpy()

    def take_gradient(self, grad) -> None:  # and the gradient arrives as one (one copy out of it)
        self.buffer.copy_(as_tensor(grad))

    def open_link(self):
        from megatrain_ray.host.transport import LayerServer

        self.server = LayerServer({0: self.buffer}, ray.util.get_node_ip_address())
        return self.server.address

    def gloo_send(self, address, repeats: int) -> None:
        import torch.distributed as dist

        group = dist.ProcessGroupGloo(dist.TCPStore(address[0], address[1], 2, False), 1, 2)
        for tag in range(repeats):
            group.send([self.buffer], 0, tag).wait()


@ray.remote(num_cpus=0)
class Gpu:
    def __init__(self, nbytes: int):
        self.slot = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        self.nbytes = nbytes

    def rate(self, run, repeats: int) -> float:
        run()
        t0 = time.perf_counter()
        for _ in range(repeats):
            run()
        return self.nbytes * repeats / (time.perf_counter() - t0) / 1e9

    def ray_objects(self, store, repeats: int) -> tuple[float, float]:
        def fetch():
            self.slot.copy_(as_tensor(ray.get(store.weights.remote())))

        def send():
            ray.get(store.take_gradient.remote(ray.put(self.slot.numpy())))

        return self.rate(fetch, repeats), self.rate(send, repeats)

    def link(self, address, streams: int, repeats: int) -> tuple[float, float]:
        from megatrain_ray.host.transport import LayerLink

        link = LayerLink(address, streams, "the store")
        try:
            return (self.rate(lambda: link.fetch(0, 0, self.slot, []).wait(), repeats),
                    self.rate(lambda: link.send(0, self.slot, []).wait(), repeats))
        finally:
            link.close()

    def gloo(self, store, repeats: int) -> float:
        import torch.distributed as dist

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        address = (ray.util.get_node_ip_address(), port)
        tcp = dist.TCPStore(address[0], port, 2, True, wait_for_workers=False)
        sending = store.gloo_send.remote(address, repeats + 1)
        group = dist.ProcessGroupGloo(tcp, 0, 2)
        tags = iter(range(repeats + 1))
        rate = self.rate(lambda: group.recv([self.slot], 1, next(tags)).wait(), repeats)
        ray.get(sending)
        return rate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=64, help="layer size")
    p.add_argument("--repeats", type=int, default=12)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    args = p.parse_args()
    nbytes = args.mib * MiB
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                            "object_store_memory": 4 * nbytes})
    try:
        cluster.add_node(num_cpus=1, object_store_memory=4 * nbytes, resources={"megatrain_ram": 1})
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        head = ray.get_runtime_context().get_node_id()
        store = Store.options(resources={"megatrain_ram": 1}).remote(nbytes)
        gpu = Gpu.options(scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=False)).remote(nbytes)
        print(f"{args.mib} MiB layers between two raylets of this machine, GB/s (weights in, gradients out):")
        print("  Ray objects:         %.2f, %.2f" % ray.get(gpu.ray_objects.remote(store, args.repeats)))
        address = ray.get(store.open_link.remote())
        for streams in args.streams:
            print(f"  TCP link x{streams}:{' ' * (9 - len(str(streams)))}%.2f, %.2f"
                  % ray.get(gpu.link.remote(address, streams, args.repeats)))
        print("  gloo pair (in only): %.2f" % ray.get(gpu.gloo.remote(store, args.repeats)))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
