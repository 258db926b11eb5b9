"""What the benchmark and the tests measure of a running session, in one place: time the host
optimizer took, bytes to and from other nodes, host and process memory, how each worker reaches
the stores, a profiled step, and a new step shape on the same stores (a sweep).

The benchmark's actors are the run's own, extended here (`ProbedStore`, `ProbedWorker`: the run's
classes inherit nothing from the benchmark); `Probe` reaches them for the driver. Training itself
never calls any of it.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from megatrain_ray.config import check_divisible
from megatrain_ray.host.memory import available_memory, major_faults, resident_bytes
from megatrain_ray.planning.step_plan import DeviceFacts, device_facts, plan_step
from megatrain_ray.runtime.actors import GpuWorker, ShardStoreActor
from megatrain_ray.runtime.worker import assemble_worker


class ProbedStore(ShardStoreActor):
    """A store that also reports its measurements (beside ShardStore.host_bytes, the size of its state)."""

    fill_seconds = 0.0  # spent drawing or loading its first weights

    def init_random(self, *args, **kwargs) -> None:
        t0 = time.perf_counter()
        super().init_random(*args, **kwargs)
        self.fill_seconds += time.perf_counter() - t0

    def load_hf(self, *args, **kwargs) -> None:
        t0 = time.perf_counter()
        super().load_hf(*args, **kwargs)
        self.fill_seconds += time.perf_counter() - t0

    def filled_seconds(self) -> float:
        """Seconds its first weights took, all its fill calls together (they run one after another)."""
        return self.fill_seconds

    def take_optimizer_seconds(self) -> float:
        """Seconds of AdamW since the last call."""
        seconds, self.optimizer_seconds = self.optimizer_seconds, 0.0
        return seconds

    def optimizer_threads(self) -> int:
        """The threads its AdamW runs on (the placement's count for it: planning/placement.py)."""
        return torch.get_num_threads()

    def memory_status(self) -> dict:
        """This process's resident memory and the node's, to spot a host that runs out."""
        return {"rss_bytes": resident_bytes(), "node_available_bytes": available_memory(), "major_faults": major_faults()}


class ProbedWorker(GpuWorker):
    """A GPU worker that also reports its measurements, and is reassembled for a new step shape."""

    def drop_executor(self) -> DeviceFacts:
        """Wait for the last updates, free the executor's device memory; returns the device's facts
        for the next step shape's plan."""
        self.worker.source.drain()
        self.worker.executor = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return device_facts(self.device, self.facts.measured_working_set)

    def rebuild(self, config, plan) -> None:
        """The worker for a new step shape on the same stores, their ways in and the process group
        (which keeps the host state and its CUDA registration instead of rebuilding them)."""
        self.config, self.plan = config, plan
        old = self.worker
        self.worker = assemble_worker(self.arch, config, plan, old.layers, self.device, group=old.group,
                                      updates_done=old.lr_schedule.updates_done)

    def built(self) -> tuple:
        """The plan this worker was handed, and what its executor holds of it: the blocks keeping
        their graphs and whether it parks activations."""
        executor = self.worker.executor
        return self.plan, len(executor.kept), executor.offload_activations

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

    def probe_gpu(self) -> tuple[str, float, float]:
        """planning/rates.py's probes on this worker's GPU (a GPU the rates table lacks)."""
        from megatrain_ray.planning.rates import probe_gpu

        return probe_gpu()

    def transports(self) -> list[str]:
        """How this worker reaches each store: "shm" (same node) or "stream" (TCP)."""
        return self.kinds

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
    """The driver's side: one session's measurements, summed over its actors where that makes
    sense. The session's actors are `ProbedStore` and `ProbedWorker` (Session's store_class and
    worker_class)."""

    def __init__(self, session):
        self.session = session

    def _all(self, actors, method: str, *args, what: str):
        return self.session.wait([getattr(a, method).remote(*args) for a in actors], what)

    def rates(self):
        """The rates that predict the step (planning/rates.py): the table's for the workers' GPU, else
        probed on rank 0's; None on the CPU. From the workers' own devices: no task needs a GPU of
        its own before the run starts."""
        from megatrain_ray.planning.rates import rates_for_gpu

        facts = self.session.facts[0]
        if facts.kind != "cuda":
            return None
        return rates_for_gpu(facts.name, probe=lambda: self.session.wait(self.session.gpus[0].probe_gpu.remote(),
                                                                          "probing the GPU"))

    def optimizer_seconds(self) -> list[float]:
        """Seconds each store spent in AdamW since the last call, in the placement's order (stores run
        side by side: the step waits for the slowest, not for their sum)."""
        return self._all(self.session.stores, "take_optimizer_seconds", what="reading the optimizer's time")

    def fill_seconds(self) -> list[float]:
        """Each store's seconds drawing or loading its first weights."""
        return self._all(self.session.stores, "filled_seconds", what="reading the stores' fill time")

    def disk_stats(self) -> list[dict]:
        """Each store's disk tier (ShardStore.disk_stats; {} where it has none)."""
        return self._all(self.session.stores, "disk_stats", what="reading the stores' disk tiers")

    def host_state_bytes(self) -> int:
        return sum(self._all(self.session.stores, "host_bytes", what="reading the stores' size"))

    def store_memory(self) -> list[dict]:
        return self._all(self.session.stores, "memory_status", what="reading the stores' memory")

    def traffic(self) -> tuple[int, int]:
        """Bytes the workers received from and sent to other nodes' stores since the last call."""
        traffic = self._all(self.session.gpus, "take_traffic", what="reading the workers' traffic")
        return sum(t[0] for t in traffic), sum(t[1] for t in traffic)

    def remote_host_bytes(self) -> int:
        """Host bytes the workers hold for layers on other nodes (their windows and outboxes)."""
        return sum(self._all(self.session.gpus, "remote_host_bytes", what="reading the workers' windows"))

    def transports(self) -> list[str]:
        """How the workers reach each store ("shm" or "stream"); every worker alike."""
        return self._all(self.session.gpus[:1], "transports", what="reading the transports")[0]

    def built(self) -> list[tuple]:
        """Each worker's plan and what its executor holds of it (ProbedWorker.built)."""
        return self._all(self.session.gpus, "built", what="reading the workers' plans")

    def profile_step(self, micro_batches: list[dict], out_dir: str):
        """A step under torch.profiler, one trace per worker under out_dir/rank-R."""
        return self.session.run_step("profile_step", micro_batches, "a profiled step", out_dir)

    def reconfigure(self, config) -> None:
        """A new step shape on the same stores and workers (the benchmark's sweep): planned as a
        run's step is (planning/step_plan.py: a PlanError where it cannot fit), from the devices
        as the last executor left them, then each worker reassembled."""
        session = self.session
        check_divisible(config.train.grad_accum, len(session.gpus))
        facts = self._all(session.gpus, "drop_executor", what="reconfiguring the GPU workers")
        plan = plan_step(session.arch, config, facts, session.placement, stores_allocated=True)
        self._all(session.gpus, "rebuild", config, plan, what="reconfiguring the GPU workers")
        session.config, session.plan, session.placement = config, plan, plan.placement
