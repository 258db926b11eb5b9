"""The turn of a step with the first layer on a RAM node: its gradient out, its store's AdamW, its
new weights back, timed between two raylets of this machine, whole and in pieces
(runtime.transport_piece_mib).

    python examples/benchmarks/turn_speed.py [--vocab 16384] [--pieces-mib 0 64 16 8] [--repeats 4]

A head (the "GPU node") and one raylet offering megatrain_ram (the "store") start here through
ray.cluster_utils.Cluster and stop at the end. The layer is Qwen2.5-7B's embedding with a vocabulary
of --vocab (16,384: 58.7 M parameters, bf16 on the wire, fp32 AdamW state), held by a real
ShardStoreActor; the GPU side sends the gradient over a LayerLink and, at the same moment, the update
(step_streamed) and the request for the new weights, as the executor does at the turn. Each line:
the best and median seconds from the gradient's first byte to the new weights' last, and, once, each
stage alone (gradient out, AdamW, weights in).
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray
import torch
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from megatrain_ray.host.adamw import AdamWStep
from megatrain_ray.host.transport import LayerLink, piece_elements, turn_pieces
from megatrain_ray.models.registry import PRESETS
from megatrain_ray.runtime.actors import ShardStoreActor

HP = AdamWStep(1, 1e-4, 1.0, (0.9, 0.95), 1e-8, 0.1)


@ray.remote(num_cpus=0)
class Gpu:
    def __init__(self, numel: int):
        self.grad = torch.randn(numel).to(torch.bfloat16)
        self.dest = torch.empty(numel, dtype=torch.bfloat16)

    def turns(self, store, address, streams: int, piece_mib: float, repeats: int) -> tuple[list[float], list[float]]:
        """Seconds of each turn, then the stages alone: gradient out, AdamW, weights in."""
        link = LayerLink(address, streams, "the store", turn_pieces(piece_mib, 2))
        try:
            version, times = 0, []
            for _ in range(repeats + 1):  # the first warms the kernel and the pages
                t0 = time.perf_counter()
                sent = link.send(0, self.grad, [])
                update = store.step_streamed.remote(0, HP)
                version += 1
                link.fetch(0, version, self.dest, []).wait()
                times.append(time.perf_counter() - t0)
                sent.wait()
                ray.get(update)
            t0 = time.perf_counter()
            link.send(0, self.grad, []).wait()
            t1 = time.perf_counter()
            ray.get(store.step_streamed.remote(0, HP))
            t2 = time.perf_counter()
            link.fetch(0, version + 1, self.dest, []).wait()
            t3 = time.perf_counter()
            return times[1:], [t1 - t0, t2 - t1, t3 - t2]
        finally:
            link.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--pieces-mib", type=float, nargs="+", default=[0, 64, 16, 8], help="0: whole layers")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--threads", type=int, default=2, help="the store's AdamW threads")
    p.add_argument("--repeats", type=int, default=4)
    args = p.parse_args()
    arch = PRESETS["qwen2.5-7b"].replace(vocab_size=args.vocab)
    numel = arch.vocab_size * arch.hidden_size
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1, resources={"megatrain_ram": 1})
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        head = ray.get_runtime_context().get_node_id()
        gpu = Gpu.options(scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=False)).remote(numel)
        print(f"the turn of a {numel / 1e6:.1f} M-parameter layer (bf16 on the wire) between two raylets of this "
              f"machine, {args.streams} streams, AdamW on {args.threads} threads; seconds:")
        for mib in args.pieces_mib:
            store = ray.remote(ShardStoreActor).options(num_cpus=0, resources={"megatrain_ram": 1}).remote(args.threads)
            ray.get(store.allocate.remote(arch, [0], torch.bfloat16, serve=True))
            ray.get(store.init_random.remote(0, 0.02))
            address = ray.get(store.open_link.remote())
            turns, (out, adamw, back) = ray.get(gpu.turns.remote(store, address, args.streams, mib, args.repeats))
            pieces = -(-numel // piece_elements(mib, 2)) if mib else 1
            what = f"pieces of {mib:g} MiB ({pieces})" if mib else "whole layer"
            print(f"  {what:24s} turn best {min(turns):.3f}, median {statistics.median(turns):.3f}; "
                  f"alone: gradient {out:.3f}, AdamW {adamw:.3f}, weights {back:.3f}", flush=True)
            ray.get(store.close.remote())
            ray.kill(store)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
