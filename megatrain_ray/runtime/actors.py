"""The Ray actors of a run: a ShardStore on each store node, and the GPU workers (one per GPU, data
parallel) that host the streaming executor and reach each store through shared memory (same node)
or its TCP link (other nodes, through one bounded window of pinned slots per worker)."""

from __future__ import annotations

import os
from pathlib import Path

import ray
import torch

from megatrain_ray.config import Config
from megatrain_ray.streaming.data_parallel import Group
from megatrain_ray.streaming.device_step import DeviceStepSource
from megatrain_ray.streaming.executor import StreamingExecutor, pick_device
from megatrain_ray.streaming.step_result import EvalResult, StepResult
from megatrain_ray.host.memory import (available_memory, dtype_of, element_size, host_headroom, major_faults,
                                resident_bytes)
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.registry import model_layouts
from megatrain_ray.host.adamw import AdamWStep, LrSchedule
from megatrain_ray.host.precision import format_of
from megatrain_ray.planning.plan import (check_gpu_fit, check_host_fit, check_parked_fit, embedding_step_as_placed,
                                   embedding_step_on_device)
from megatrain_ray.host.remote_sources import RoutedSource, SharedMemorySource, WindowSource
from megatrain_ray.host.store import ShardStore
from megatrain_ray.host.transport import LayerLink, LayerServer
from megatrain_ray.host.window import window_bytes

GiB = 1024**3


class ShardStoreActor(ShardStore):
    """A ShardStore living in a Ray actor on its node; optimizer threads sized to that node."""

    def __init__(self, *args, threads: int | None = None, reserved_cores: int = 2, **kwargs):
        torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) - reserved_cores))
        super().__init__(*args, **kwargs)
        self.server: LayerServer | None = None

    def layer_ids(self) -> list[int]:
        return list(self.layers)

    def shared_paths(self) -> dict[int, str]:
        return dict(self.shm_paths)

    def take_optimizer_seconds(self) -> float:
        seconds, self.optimizer_seconds = self.optimizer_seconds, 0.0
        return seconds

    def memory_status(self) -> dict:
        """This process's resident memory and the node's, to spot a host that runs out."""
        return {"rss_bytes": resident_bytes(), "node_available_bytes": available_memory(), "major_faults": major_faults()}

    def ready(self) -> bool:
        return True

    # ---- serving a GPU worker on another node (host/transport.py) ----------------------------------
    def open_link(self) -> tuple[str, int]:
        """Where a GPU worker on another node connects to stream this store's layers."""
        if self.server is None:
            self.server = LayerServer({i: s.compute for i, s in self.layers.items()}, ray.util.get_node_ip_address(),
                                      grads={i: s.grad for i, s in self.layers.items()})
        return self.server.address

    def step_streamed(self, index: int, hp: AdamWStep | None) -> int:
        """A layer's update whose gradient comes over the link: waits for it to land, then lets the
        new weights leave."""
        self.server.step(index, lambda: self.step_layer(index, hp))
        return index

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        super().close()


class GpuWorker:
    """One data-parallel worker: hosts the streaming executor on its GPU (or the CPU) and owns a
    copy of the LR schedule's position (the stores own their per-layer update counts).

    The constructor only records what to build: by then Ray has chosen the actor's GPU (`gpu_ids`),
    and CUDA has not started. `start` makes every worker see all of the run's GPUs (NCCL copies
    directly between GPUs only when a process sees both: Ray would show each worker its own GPU
    alone), checks that the step fits, builds it and joins the workers' process group. A PlanError
    raised in a constructor reaches the driver as the actor's death (a cluster fault, retried by
    auto-resume); raised in a method, it arrives as itself: bad input, exit status 2.
    """

    def __init__(self, arch: ModelArch, config: Config, stores: list, store_nodes: list[str], updates_done: int = 0,
                 window_slots: int = 0, rank: int = 0, world: int = 1):
        self.arch = arch
        self.rank = rank
        self.world = world
        self.device = torch.device("cpu")
        self._build = (config, stores, store_nodes, updates_done, window_slots)
        self.source = self.window = self.group = None

    def gpu_ids(self) -> list[str]:
        """The GPU Ray gave this actor (none on the CPU path)."""
        return [str(i) for i in ray.get_gpu_ids()]

    def start(self, visible_gpus: list[str] = (), master_address: str = "", master_port: int = 0) -> str:
        """`visible_gpus`: every worker's GPU, in rank order; the master address/port: where rank 0
        holds the process group's rendezvous (unused by a worker alone). Refuses a step that cannot
        fit, then maps the stores' buffers and builds the executor; returns the device's description."""
        config, stores, store_nodes, updates_done, window_slots = self._build
        own = self.gpu_ids()
        if visible_gpus:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible_gpus)
        torch.set_num_threads(config.runtime.worker_threads or max(1, (os.cpu_count() or 1) // self.world))
        self.device = pick_device(config.executor.device,
                                  list(visible_gpus).index(own[0]) if own and visible_gpus else None)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        arch = self.arch
        dtype = dtype_of(config.model.compute_dtype)
        here = ray.get_runtime_context().get_node_id()
        numels = [layout.numel for layout in model_layouts(arch)]
        layer_lists = ray.get([s.layer_ids.remote() for s in stores])
        remote = {i: numels[i] for node, layers in zip(store_nodes, layer_lists) if node != here for i in layers}
        slots = window_slots or config.runtime.remote_window or config.executor.num_slots + 1
        window = window_bytes(list(remote.values()), slots, element_size(dtype))
        config = embedding_step_as_placed(config, on_host=0 in remote)
        fit = self._check_fit(config, window)
        sources, routes = [], []
        for store, node, layers in zip(stores, store_nodes, layer_lists):
            if node == here:
                paths, grad_paths = ray.get([store.shared_paths.remote(), store.gradient_paths.remote()])
                sources.append(SharedMemorySource(store, paths, {i: numels[i] for i in layers}, dtype,
                                                  register=self.device.type == "cuda", grad_paths=grad_paths))
                routes.append(layers)
        self.window = self._window_source(stores, store_nodes, layer_lists, here, remote, dtype, slots, config)
        if self.window is not None:
            sources.append(self.window)
            routes.append(list(remote))
        self.source = RoutedSource(sources, routes)
        shared = self.source.route.get(0)
        if embedding_step_on_device(config.executor.embedding_step, self.device, self.world,
                                    isinstance(shared, SharedMemorySource), format_of(config.optim).exact):
            state = shared.shared_state(0, model_layouts(arch)[0].segments())
            self.source = DeviceStepSource(self.source, {0: state}, self.device, dtype, shared.report_updates)
        self.kinds = ["shm" if node == here else "stream" for node in store_nodes]
        self.lr_schedule = LrSchedule(config.optim, config.train.steps, updates_done)
        if self.world > 1:
            self.group = Group.join(self.rank, self.world, master_address, master_port, self.device, numels,
                                    config.train.step_timeout_s or 1800.0)
        else:
            self.group = Group.solo(len(numels))
        self.executor = self._executor(config, *fit)
        return self.describe_device()

    @staticmethod
    def _window_source(stores, store_nodes, layer_lists, here, remote, dtype, slots, config) -> WindowSource | None:
        """One window for every layer on other nodes, with a link to each of their stores."""
        if not remote:
            return None
        owners = [(s, layers) for s, node, layers in zip(stores, store_nodes, layer_lists) if node != here]
        addresses = ray.get([s.open_link.remote() for s, _ in owners])
        store_of, link_of = {}, {}
        for (store, layers), address in zip(owners, addresses):
            link = LayerLink(address, config.runtime.transport_streams, f"{address[0]}")
            for i in layers:
                store_of[i], link_of[i] = store, link
        return WindowSource(store_of, link_of, remote, dtype, slots)

    def _check_fit(self, config: Config, window: int = 0) -> tuple[bool, int]:
        """Refuse a step that cannot fit before allocating anything; else whether to park activations
        on the host and how many blocks keep their forward graphs. `window`: pinned bytes the window
        for remote layers will take beside them."""
        if self.device.type != "cuda":  # the executor's tensors live beside the stores' state
            plan = check_host_fit(self.arch, config, host_headroom() - self.world * window, "the executor's node",
                                  self.world)
            return False, plan.kept
        free = torch.cuda.mem_get_info(self.device)[0]
        plan = check_gpu_fit(self.arch, config, free, torch.cuda.get_device_name(self.device), self.world)
        if plan.offload:  # the stores on this node have allocated their state by now; all workers park there
            check_parked_fit(self.arch, config, host_headroom() - self.world * window, "the GPU node")
        return plan.offload, plan.kept

    def _executor(self, config: Config, offload: bool, kept: int) -> StreamingExecutor:
        ex = config.executor
        return StreamingExecutor(
            self.arch, self.source, self.device, dtype_of(config.model.compute_dtype), ex.num_slots,
            ex.loss_chunk_tokens, compile_blocks=ex.compile, mlp_chunk_tokens=ex.mlp_chunk_tokens,
            offload_activations=offload, group=self.group, keep_graphs=kept,
        )

    def reconfigure(self, config: Config) -> None:
        """A new step shape (sequence length, micro-batches) on the same stores: the benchmark's
        sweep, which keeps the host state and its CUDA registration instead of rebuilding them."""
        self.source.drain()
        self.executor = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        window = self.window.host_bytes() if self.window is not None else 0
        config = embedding_step_as_placed(config, on_host=not isinstance(self.source, DeviceStepSource))
        self.executor = self._executor(config, *self._check_fit(config, window))

    def _expect(self, updates_elsewhere: dict | None) -> None:
        """The other workers' updates since this worker's last step: its reads wait for them."""
        if updates_elsewhere:
            self.source.expect({layer: ref for layer, ref in updates_elsewhere.items() if not self.group.owns(layer)})

    def train_step(self, micro_batches: list[dict], step_target_tokens: int | None = None,
                   updates_elsewhere: dict | None = None) -> tuple[StepResult, dict]:
        """This worker's share of a step. `updates_elsewhere`: the other workers' references to their
        layer updates since this worker last ran. Returns the step's result and the references to
        the updates this worker sent (for the others; none when alone)."""
        self._expect(updates_elsewhere)
        result = self.executor.train_step(micro_batches, self.lr_schedule.next, step_target_tokens)
        if self.world == 1:
            return result, {}
        return result, self.source.updates_in_flight(i for i in range(len(self.group.owners)) if self.group.owns(i))

    def eval_loss(self, micro_batches: list[dict], updates_elsewhere: dict | None = None) -> EvalResult:
        """Validation on this worker's share, with every update so far (the others' too)."""
        self._expect(updates_elsewhere)
        return self.executor.eval_loss(micro_batches)

    def profile_step(self, out_dir: str, *step_args) -> tuple[StepResult, dict]:
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

    def transports(self) -> list[str]:
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

    def drain(self) -> int:
        """Wait until every optimizer step this worker sent or expects has landed; returns the LR
        schedule's position."""
        self.source.drain()
        return self.lr_schedule.updates_done

    def kept_graphs(self) -> int:
        return len(self.executor.kept)

    def describe_device(self) -> str:
        kept = f"; the last {self.kept_graphs()} blocks keep their forward graphs" if self.kept_graphs() else ""
        if isinstance(self.source, DeviceStepSource):
            kept += "; the embedding's AdamW step runs here"
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            return f"{torch.cuda.get_device_name(self.device)} ({props.total_memory / GiB:.0f} GiB){kept}"
        return f"cpu ({torch.get_num_threads()} threads){kept}"

    def close(self) -> None:
        if self.source is not None:
            self.source.close()
        if self.group is not None:
            self.group.close()
