"""Waiting on the cluster without ever hanging: every wait of the driver watches the run's nodes.

A dead node surfaces as a ClusterFault within about POLL_S after Ray marks it dead (or as soon as
a call on it fails), a call slower than train.step_timeout_s as one too. A wait on several calls
(the GPU workers' shares of a step) ends at the first that fails: the others may be blocked in a
collective with the lost worker and would never return. Its peers' calls may also fail first,
with the collective's own error; a lost process is blamed before such errors.
"""

from __future__ import annotations

import time

import ray

from megatrain_ray.runtime.cluster import alive_node_ids
from megatrain_ray.planning.placement import Placement

# Errors that mean a process or node of the run is gone (not a bug in the step itself).
FAULTS = (ray.exceptions.RayActorError, ray.exceptions.NodeDiedError, ray.exceptions.ObjectLostError,
          ray.exceptions.OwnerDiedError, ray.exceptions.WorkerCrashedError, ray.exceptions.LocalRayletDiedError)
POLL_S = 0.5
PEER_GRACE_S = 5.0  # after a call fails, how long the calls beside it get to show that a process was lost
NODE_MARK_S = 10.0  # after an actor's call fails, how long Ray gets to mark its node dead before the process is blamed


class RunStopped(RuntimeError):
    """The run stopped for a reason its message explains; the CLI prints it without a traceback."""


class ClusterFault(RunStopped):
    """A node or an actor of the run was lost; `nodes` are the ids of the nodes that left."""

    def __init__(self, message: str, nodes: tuple[str, ...] = ()):
        super().__init__(message)
        self.nodes = nodes


def describe_node(placement: Placement, node_id: str) -> str:
    """'10.0.0.7 (node 3f2a..., layers 4-9)': what an operator needs to find the machine."""
    ip = placement.gpu.ip if node_id == placement.gpu.node_id else None
    held = []
    for plan in placement.stores:
        if plan.node.node_id == node_id:
            ip = plan.node.ip
            held.append(f"layers {plan.layers[0]}-{plan.layers[-1]}")
    if node_id == placement.gpu.node_id:
        held.append("the executor")
    return f"{ip} (node {node_id}, {', '.join(held)})"


def failed(ref) -> bool:
    """A call that is done and raised."""
    try:
        ray.get(ref, timeout=0)
    except Exception:
        return True
    return False


class Watchdog:
    """ray.get for the run's calls that polls the liveness of the run's nodes while it waits."""

    def __init__(self, placement: Placement, timeout_s: float):
        self.placement = placement
        self.timeout_s = timeout_s
        self.nodes = placement.nodes()

    def get(self, refs, what: str):
        pending = refs if isinstance(refs, list) else [refs]
        start = time.monotonic()
        while True:
            done, waiting = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
            if not waiting or any(failed(ref) for ref in done):
                break
            self.check_nodes(what)
            if self.timeout_s and time.monotonic() - start > self.timeout_s:
                raise ClusterFault(f"{what} took longer than train.step_timeout_s={self.timeout_s:g} s; "
                                   f"a node may hang (check `ray status` and the actor logs)")
        if waiting:  # a call failed: the others get a moment to fail as well, or not
            ray.wait(pending, num_returns=len(pending), timeout=PEER_GRACE_S)
        self.raise_failure(pending, what)
        return ray.get(refs)

    def raise_failure(self, refs: list, what: str) -> None:
        """The first lost process among the calls done (a ClusterFault), else their first error."""
        errors = []
        for ref in ray.wait(refs, num_returns=len(refs), timeout=0)[0]:
            try:
                ray.get(ref, timeout=0)
            except FAULTS as e:
                raise self.fault(what, e) from None
            except ray.exceptions.RayTaskError as e:
                if isinstance(e.cause, ConnectionError):  # the GPU worker lost a store's link (host/transport.py)
                    raise self.fault(what, e) from None
                errors.append(e)
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def dead_nodes(self) -> list[str]:
        return sorted(self.nodes - alive_node_ids())

    def check_nodes(self, what: str) -> None:
        dead = self.dead_nodes()
        if dead:
            raise ClusterFault(self.lost_message(dead, what), tuple(dead))

    def lost_message(self, dead: list[str], what: str) -> str:
        return f"lost node {', '.join(describe_node(self.placement, n) for n in dead)} during {what}"

    def fault(self, what: str, error: Exception) -> ClusterFault:
        """Name the node behind an actor failure: Ray marks a dead node a few seconds after its
        actors' calls fail, so wait a little for that before blaming the process alone."""
        deadline = time.monotonic() + NODE_MARK_S
        while time.monotonic() < deadline:
            dead = self.dead_nodes()
            if dead:
                return ClusterFault(self.lost_message(dead, what), tuple(dead))
            time.sleep(POLL_S)
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return ClusterFault(f"a process of the run died during {what} (its node is still alive): {first_line}")
