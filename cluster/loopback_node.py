"""One Ray node joining a head on 127.0.0.1, every server of it on the loopback: what
`ray start --address=127.0.0.1:PORT --block` would do for cluster/local-cluster.sh's RAM nodes,
had Ray's command line not refused it.

Ray binds its servers (the raylet, the object manager, the workers' gRPC servers, the agents) to
127.0.0.1 only where the node's IP is 127.0.0.1, which it keeps only with
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (else `ray start` replaces a loopback --node-ip-address by the
machine's address); and under that setting `ray start` refuses to start a node that joins a head
("Multi-node Ray clusters are not supported on Windows and OSX"). Ray's own node class, the one
`ray start` and ray.cluster_utils.Cluster use, starts such a node; this script starts it, as
`ray start --block` does, and stays until a signal or until one of the node's processes dies.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 python cluster/loopback_node.py --address 127.0.0.1:PORT \\
        --temp-dir DIR --num-cpus 1 --resources '{"megatrain_ram": 1}' --object-store-memory BYTES \\
        --ports NODE_MANAGER OBJECT_MANAGER AGENT_HTTP AGENT_GRPC RUNTIME_ENV_AGENT METRICS_EXPORT
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

LOOPBACK = "127.0.0.1"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", required=True, help="the head's GCS, 127.0.0.1:PORT")
    parser.add_argument("--temp-dir", required=True)
    parser.add_argument("--num-cpus", type=int, required=True)
    parser.add_argument("--num-gpus", type=int, default=0)
    parser.add_argument("--resources", default="{}", help="custom resources, JSON")
    parser.add_argument("--object-store-memory", type=int, required=True)
    parser.add_argument("--memory", type=int, default=None, help="Ray's logical memory resource, bytes")
    parser.add_argument("--ports", type=int, nargs=6, required=True,
                        metavar=("NODE_MANAGER", "OBJECT_MANAGER", "AGENT_HTTP", "AGENT_GRPC", "RUNTIME_ENV_AGENT",
                                 "METRICS_EXPORT"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.address.rsplit(":", 1)[0] != LOOPBACK or os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "0":
        sys.exit("loopback_node.py joins a head on 127.0.0.1 under RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 only")
    from ray._private.node import Node
    from ray._private.parameter import RayParams

    node_manager, object_manager, agent_http, agent_grpc, runtime_env_agent, metrics_export = args.ports
    params = RayParams(gcs_address=args.address, node_ip_address=LOOPBACK, node_name=LOOPBACK,
                       temp_dir=args.temp_dir, num_cpus=args.num_cpus, num_gpus=args.num_gpus,
                       resources=json.loads(args.resources), object_store_memory=args.object_store_memory,
                       memory=args.memory, node_manager_port=node_manager, object_manager_port=object_manager,
                       dashboard_agent_listen_port=agent_http, metrics_agent_port=agent_grpc,
                       runtime_env_agent_port=runtime_env_agent, metrics_export_port=metrics_export)
    node = Node(params, head=False, shutdown_at_exit=True, spawn_reaper=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # ends the node's processes (shutdown_at_exit)
    print(f"Ray node up on {LOOPBACK} (--block: until a signal)", flush=True)  # local-cluster.sh waits for this
    while True:
        time.sleep(1)
        dead = [kind for kind, process in node.dead_processes() if process.returncode not in (0, -15, 15, 143)]
        if dead:
            print(f"Ray processes exited: {', '.join(dead)}; ending the node", flush=True)
            node.kill_all_processes(check_alive=False, allow_graceful=False)
            return 1


if __name__ == "__main__":
    sys.exit(main())
