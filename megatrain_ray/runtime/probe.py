"""What the benchmark and the tests measure of a running session, in one place: time the host
optimizer took, bytes to and from other nodes, host and process memory, a profiled step, and a new
step shape on the same stores (a sweep).

The actors carry their side as mixins (`StoreProbe`, `WorkerProbe`); `Probe` reaches them for the
driver. Training itself never calls any of it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatrain_ray.host.memory import available_memory, major_faults, resident_bytes
from megatrain_ray.planning.step_plan import DeviceFacts, device_facts
from megatrain_ray.runtime.worker import build_executor


class StoreProbe:
    """A ShardStoreActor's measurements (beside ShardStore.host_bytes, the size of its state)."""

    def take_optimizer_seconds(self) -> float:
        """Seconds of AdamW since the last call."""
        seconds, self.optimizer_seconds = self.optimizer_seconds, 0.0
        return seconds

    def memory_status(self) -> dict:
        """This process's resident memory and the node's, to spot a host that runs out."""
        return {"rss_bytes": resident_bytes(), "node_available_bytes": available_memory(), "major_faults": major_faults()}


class WorkerProbe:
    """A GpuWorker's measurements, and its executor rebuilt for a new step shape."""

    def drop_executor(self) -> DeviceFacts:
        """Wait for the last updates, free the executor's device memory; returns the device's facts
        for the next step shape's plan."""
        self.source.drain()
        self.executor = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return device_facts(self.device, self.measured_working_set)

    def rebuild(self, config, plan) -> None:
        """The executor for a new step shape on the same stores, sources and process group (which
        keeps the host state and its CUDA registration instead of rebuilding them)."""
        self.config, self.plan = config, plan
        self.executor = build_executor(self.arch, config, plan, self.source, self.device, self.group)

    def built(self) -> tuple:
        """The plan this worker was handed, and what its executor holds of it: the blocks keeping
        their graphs and whether it parks activations."""
        return self.plan, len(self.executor.kept), self.executor.offload_activations

    def profile_step(self, out_dir: str, *step_args):
        """One step under torch.profiler: a trace for Perfetto and the top kernels as text."""
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            out = self.train_step(*step_args)
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(Path(out_dir) / "trace.json"))
        sort = "cuda_time_total" if self.device.type == "cuda" else "cpu_time_total"
        (Path(out_dir) / "top.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=40))
        return out

    def memory_status(self) -> dict:
        return {"rss_bytes": resident_bytes(), "node_available_bytes": available_memory()}

    def remote_host_bytes(self) -> int:
        """Host bytes this worker holds for layers on other nodes (the window and the outbox)."""
        return self.window.host_bytes() if self.window is not None else 0

    def remote_versions(self) -> dict[int, int]:
        """Per layer on another node, the updates this worker knows of: the version it asks for next."""
        return dict(self.window.versions) if self.window is not None else {}

    def take_traffic(self) -> tuple[int, int]:
        """Bytes received from and sent to other nodes' stores since the last call."""
        return self.window.take_traffic() if self.window is not None else (0, 0)


class Probe:
    """The driver's side: one session's measurements, summed over its actors where that makes sense."""

    def __init__(self, session):
        self.session = session

    def _all(self, actors, method: str, *args, what: str):
        return self.session.wait([getattr(a, method).remote(*args) for a in actors], what)

    def optimizer_seconds(self) -> float:
        """Seconds every store spent in AdamW since the last call, summed."""
        return sum(self._all(self.session.stores, "take_optimizer_seconds", what="reading the optimizer's time"))

    def host_state_bytes(self) -> int:
        return sum(self._all(self.session.stores, "host_bytes", what="reading the stores' size"))

    def store_memory(self) -> list[dict]:
        return self._all(self.session.stores, "memory_status", what="reading the stores' memory")

    def worker_memory(self) -> list[dict]:
        return self._all(self.session.gpus, "memory_status", what="reading the workers' memory")

    def traffic(self) -> tuple[int, int]:
        """Bytes the workers received from and sent to other nodes' stores since the last call."""
        traffic = self._all(self.session.gpus, "take_traffic", what="reading the workers' traffic")
        return sum(t[0] for t in traffic), sum(t[1] for t in traffic)

    def remote_host_bytes(self) -> int:
        """Host bytes the workers hold for layers on other nodes (their windows and outboxes)."""
        return sum(self._all(self.session.gpus, "remote_host_bytes", what="reading the workers' windows"))

    def remote_versions(self) -> list[dict[int, int]]:
        return self._all(self.session.gpus, "remote_versions", what="reading the workers' windows")

    def built(self) -> list[tuple]:
        """Each worker's plan and what its executor holds of it (WorkerProbe.built)."""
        return self._all(self.session.gpus, "built", what="reading the workers' plans")

    def profile_step(self, micro_batches: list[dict], out_dir: str):
        """A step under torch.profiler, one trace per worker under out_dir/rank-R."""
        return self.session.run_step("profile_step", micro_batches, "a profiled step", out_dir)

    def reconfigure(self, config) -> None:
        """A new step shape on the same stores and workers (the benchmark's sweep): planned as a
        run's step is (a PlanError where it cannot fit), then each worker's executor rebuilt."""
        self.session.replan(config)
