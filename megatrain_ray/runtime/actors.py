"""The Ray actors of a run: a ShardStore on each store node, and the GPU workers (one per GPU, data
parallel) that host the streaming executor and reach each store through shared memory (same node)
or its TCP link (other nodes, through one bounded window of pinned slots per worker); with
a GRPO run, the rollout (rl/rollout.py) on the GPU node."""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator

import ray
import torch

from megatrain_ray.config import Config
from megatrain_ray.files import shard
from megatrain_ray.host.adamw import AdamWStep
from megatrain_ray.host.adamw_kernel import start_native_kernel
from megatrain_ray.host.disk import DiskTierError
from megatrain_ray.host.memory import cuda_host_register, dtype_of, shm_tensor
from megatrain_ray.host.precision import format_of
from megatrain_ray.host.remote_sources import RoutedSource, SharedMemorySource, StoreReach, WindowSource
from megatrain_ray.host.store import ShardStore
from megatrain_ray.host.transport import LayerLink, LayerServer, turn_pieces
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.registry import model_layouts
from megatrain_ray.planning.step_plan import DeviceFacts, StepPlan, measured_facts
from megatrain_ray.rl.rollout import Rollout, rollout_device
from megatrain_ray.runtime.worker import Rendezvous, Worker, assemble_worker
from megatrain_ray.streaming.executor import pick_device
from megatrain_ray.streaming.step_result import EvalResult, StepResult

GiB = 1024**3


class ShardStoreActor(ShardStore):
    """A ShardStore living in a Ray actor on its node; optimizer threads sized to that node.

    It starts in two steps: the actor's process (seconds of importing torch) starts beside the GPU
    workers', and its host memory is taken in `allocate` only once the driver's plan of the step fits.
    The host AdamW kernel's load or build (host/adamw_kernel.py; tens of seconds on a machine that
    never built it) begins with the process, in the background: it overlaps the workers' start, the
    plan, the allocation and the first weights, and the first update waits for it only if it is still
    building.
    """

    def __init__(self, threads: int | None = None):
        """`threads`: the placement's for this store (planning/placement.py, store_threads); None (a
        node whose CPUs Ray does not count): this machine's cores less two."""
        torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) - 2))
        start_native_kernel()
        self.server: LayerServer | None = None
        self.update_calls: Counter = Counter()  # each layer's update calls, skipped ones too (settle_disk)
        self.shm_paths, self.grad_shm_paths, self.extra_shm_paths = {}, {}, []  # what `close` releases

    def allocate(self, *args, serve: bool = False, **kwargs) -> StoreReach:
        """ShardStore's construction: its layers' buffers in host memory (arguments as ShardStore);
        `serve`: a GPU worker on another node streams them (its link opens here; it opens too where
        compute copies are on disk, which every worker streams). Returns how a worker reaches them."""
        ShardStore.__init__(self, *args, **kwargs)
        return StoreReach(tuple(self.layers), dict(self.shm_paths), dict(self.grad_shm_paths), self.shared_states(),
                          self.open_link() if serve or self.hot is not None else None, self.shared_momenta())

    def layer_ids(self) -> list[int]:
        return list(self.layers)

    # ---- files (files/shard.py) ---------------------------------------------------------------
    def load_hf(self, model_dir: str, layers: list[int] | None = None, checked: bool = False) -> None:
        shard.load_hf(self, model_dir, layers, checked)

    def check_hf(self, model_dir: str) -> None:
        shard.check_hf(self, model_dir)

    def load_layers(self, files_by_layer: dict[int, str]) -> None:
        shard.load_layers(self, files_by_layer)

    def save_shard(self, directory: str, name: str) -> dict:
        return shard.save_shard(self, directory, name)

    def state_tensors(self) -> tuple[dict[str, torch.Tensor], dict[int, int]]:
        return shard.state_tensors(self)

    def shared_paths(self) -> dict[int, str]:
        return dict(self.shm_paths)

    # ---- serving a GPU worker on another node (host/transport.py) ----------------------------------
    def open_link(self) -> tuple[str, int]:
        """Where a GPU worker on another node connects to stream this store's layers."""
        if self.server is None:
            in_ram = {i: s for i, s in self.layers.items() if not s.compute_on_disk}
            self.server = LayerServer({i: s.compute for i, s in in_ram.items()}, ray.util.get_node_ip_address(),
                                      grads={i: s.grad for i, s in in_ram.items()}, held=self.hot)
        return self.server.address

    def settle_disk(self, index: int) -> None:
        """ShardStore.settle_disk; before a step's first update, a store whose compute copies are on
        disk first waits for the step's gradients of those (its link lands them, and the tier writes
        them to their files, which settle_disk waits for): a disk that refused one refuses the step
        before any layer takes it. Their last write is one the update of its layer waits for anyway.
        Every update call passes here once: `update_calls` counts them, skipped ones too (the steps)."""
        self.update_calls[index] += 1
        if self.hot is not None and self.server is not None and self.first_of_step(index):
            self.server.wait_held_gradients(self.update_calls[index])
        super().settle_disk(index)

    def step_streamed(self, index: int, hp: AdamWStep | None) -> int:
        """A layer's update whose gradient comes over the link, piece by piece as it lands; each
        updated piece's new weights may leave at once. A disk-tier error (a full disk) stops the link
        server too: the worker's requests for weights are answered with it (host/transport.py)."""
        try:
            self.settle_disk(index)
            with self.resident(index):  # a layer in the disk tier (host/disk.py) in memory for its pieces
                self.server.step(index, lambda: self.begin_update(index, hp),
                                 lambda lo, hi: self.update_piece(index, hp, lo, hi))
        except DiskTierError as e:
            self.server.fail(e)
            raise
        return index

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        super().close()


class GpuWorker:
    """One data-parallel worker: hosts the streaming executor on its GPU (or the CPU) and owns a
    copy of the LR schedule's position (the stores own their per-layer update counts).

    It decides nothing about the step: the driver plans it (planning/step_plan.py) from what
    `take_device` reports, and `start` assembles what the plan says (runtime/worker.py). The
    constructor only records what to build: by then Ray has chosen the actor's GPU (`gpu_ids`),
    and CUDA has not started.
    """

    def __init__(self, arch: ModelArch, config: Config, rank: int = 0, world: int = 1):
        self.arch = arch
        self.config = config
        self.rank = rank
        self.world = world
        self.device = torch.device("cpu")
        self.plan: StepPlan | None = None
        self.layers: RoutedSource | None = None  # every layer's way to its store
        self.worker: Worker | None = None
        self.window: WindowSource | None = None
        self.kinds: list[str] = []  # how it reaches each store: "shm" or "stream"
        self.facts: DeviceFacts | None = None

    def gpu_ids(self) -> list[str]:
        """The GPU Ray gave this actor (none on the CPU path)."""
        return [str(i) for i in ray.get_gpu_ids()]

    def take_device(self, visible_gpus: list[str] = ()) -> DeviceFacts:
        """Sets this process's devices and threads, which starts CUDA; returns what the step's plan
        needs of the device (planning/step_plan.py: with the layers' working set measured where the
        plan needs it). `visible_gpus`: every worker's GPU, in rank order: each worker sees all
        of them, as NCCL copies directly between GPUs only when a process sees both (Ray would show
        each worker its own GPU alone)."""
        own = self.gpu_ids()
        if visible_gpus:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible_gpus)
        torch.set_num_threads(self.config.runtime.worker_threads or max(1, (os.cpu_count() or 1) // self.world))
        self.device = pick_device(self.config.executor.device,
                                  list(visible_gpus).index(own[0]) if own and visible_gpus else None)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        say = (lambda text: print(text, flush=True)) if self.rank == 0 else (lambda text: None)
        self.facts = measured_facts(self.device, self.arch, self.config, say)
        return self.facts

    def start(self, plan: StepPlan, stores: list, store_nodes: list[str], reach: list[StoreReach],
              updates_done: int = 0, master_address: str = "", master_port: int = 0) -> str:
        """Maps the stores' buffers and assembles the worker the plan describes (runtime/worker.py),
        joining the workers' process group (the master address/port: where rank 0 holds its
        rendezvous, unused by a worker alone); returns the device's description. `reach`: each
        store's (ShardStoreActor.allocate): nothing here waits for a store, which may still be
        filling its layers; the first step's reads come after."""
        self.plan = plan
        t0 = time.perf_counter()
        self.layers = self._route_layers(stores, store_nodes, reach, updates_done)
        t1 = time.perf_counter()
        self.worker = assemble_worker(self.arch, self.config, plan, self.layers, self.device,
                                      Rendezvous(self.rank, self.world, master_address, master_port),
                                      updates_done=updates_done)
        if self.rank == 0:  # where a start's seconds go (the benchmark's start-up line has the sum)
            parts = ", ".join(f"{what} {s:.1f} s" for what, s in self.worker.seconds.items())
            print(f"GPU worker built in {time.perf_counter() - t0:.1f} s: the stores' buffers mapped"
                  f"{' and registered with CUDA' if self.device.type == 'cuda' else ''} {t1 - t0:.1f} s, {parts}",
                  flush=True)
        return self.describe_device()

    def _route_layers(self, stores: list, store_nodes: list[str], reach: list[StoreReach],
                      updates_done: int) -> RoutedSource:
        """Each layer through the way that reaches its store: shared memory on this node, the window
        (with a link to each store) for the others."""
        here = ray.get_runtime_context().get_node_id()
        dtype = dtype_of(self.config.model.compute_dtype)
        numels = [layout.numel for layout in model_layouts(self.arch)]
        sources, routes, owners = [], [], []
        for store, node, r in zip(stores, store_nodes, reach):
            streamed = [i for i in r.layers if node != here or i not in r.weights]  # compute copies on disk: streamed
            if streamed:
                owners.append((store, r.link, streamed))
            if node == here:
                sources.append(SharedMemorySource(store, r.weights, {i: numels[i] for i in r.layers}, dtype,
                                                  register=self.device.type == "cuda", grad_paths=r.gradients,
                                                  states=r.states, updates_done=updates_done, momenta=r.momenta,
                                                  momentum_dtype=format_of(self.config.optim).moment_dtypes()[0]))
                routes.append([i for i in r.layers if i not in streamed])
        self.window = self._window_source(owners, numels, dtype)
        if self.window is not None:
            sources.append(self.window)
            routes.append([i for _, _, layers in owners for i in layers])
        self.kinds = ["shm" if node == here else "stream" for node in store_nodes]
        return RoutedSource(sources, routes)

    def _window_source(self, owners: list[tuple], numels: list[int], dtype: torch.dtype) -> WindowSource | None:
        """One window of the plan's slots for every layer on other nodes (and every compute copy on
        disk), with a link to each of their stores: (store, its link's address, those layers)."""
        if not owners:
            return None
        store_of, link_of, remote = {}, {}, {}
        for store, address, layers in owners:
            link = LayerLink(address, self.config.runtime.transport_streams, f"{address[0]}",
                             turn_pieces(self.config.runtime.transport_piece_mib, dtype.itemsize))
            for i in layers:
                store_of[i], link_of[i], remote[i] = store, link, numels[i]
        return WindowSource(store_of, link_of, remote, dtype, self.plan.window_slots)

    def expect_first_weights(self, fills: dict) -> None:
        """Each layer's first weights, still landing (a store's fill call per layer): the first
        read of a layer waits for its own (Session.init_weights, wait=False)."""
        self.layers.expect(fills)

    def _expect(self, updates_elsewhere: dict | None) -> None:
        """The other workers' updates since this worker's last step: its reads wait for them."""
        if updates_elsewhere:
            group = self.worker.group
            self.worker.source.expect({layer: ref for layer, ref in updates_elsewhere.items() if not group.owns(layer)})

    def train_step(self, micro_batches: list[dict], step_target_tokens: int | None = None,
                   updates_elsewhere: dict | None = None) -> tuple[StepResult, dict]:
        """This worker's share of a step. `updates_elsewhere`: the other workers' references to their
        layer updates since this worker last ran. Returns the step's result and the references to
        the updates this worker sent (for the others; none when alone)."""
        self._expect(updates_elsewhere)
        worker = self.worker
        result = worker.train_step(micro_batches, step_target_tokens)
        if self.world == 1:
            return result, {}
        return result, worker.source.updates_in_flight(i for i in range(len(worker.group.owners)) if worker.group.owns(i))

    def eval_loss(self, micro_batches: list[dict], updates_elsewhere: dict | None = None) -> EvalResult:
        """Validation on this worker's share, with every update so far (the others' too)."""
        self._expect(updates_elsewhere)
        return self.worker.eval_loss(micro_batches)

    def token_logprobs(self, micro_batches: list[dict], updates_elsewhere: dict | None = None) -> list:
        """Each label's log-probability on this worker's share, with every update so far."""
        self._expect(updates_elsewhere)
        return self.worker.token_logprobs(micro_batches)

    def reference_logprobs(self, micro_batches: list[dict]) -> list:
        """Each label's log-probability under the reference policy (model.path): Worker.reference_logprobs."""
        return self.worker.reference_logprobs(micro_batches)

    def drain(self) -> int:
        """Wait until every optimizer step this worker sent or expects has landed; returns the LR
        schedule's position."""
        self.worker.source.drain()
        return self.worker.lr_schedule.updates_done

    def describe_device(self) -> str:
        what = self.plan.describe() if self.plan is not None else ""
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            return f"{torch.cuda.get_device_name(self.device)} ({props.total_memory / GiB:.0f} GiB){what}"
        return f"cpu ({torch.get_num_threads()} threads){what}"

    def close(self) -> None:
        if self.worker is not None:
            self.worker.source.close()
            self.worker.group.close()
        elif self.layers is not None:  # the assembly failed (a process group that never formed)
            self.layers.close()


def store_weights(stores: list, store_nodes: list[str], here: str, arch: ModelArch, dtype: torch.dtype,
                  embedding_master: bool, get: Callable, mapped: dict | None = None) -> Iterator[tuple[int, torch.Tensor]]:
    """(layer, weights) of every store once its updates have landed, read in place through shared
    memory where the store lives on this process's node (`here`: `weights_in_place`); else its
    master sent over Ray. `embedding_master`: the embedding's master (a worker steps it on its
    device, and the store's compute copy of it is not refreshed then). `get`: how to wait for an
    actor's answer (ray.get, or the driver's watchdog). `mapped`: the mappings of earlier calls, by
    path, kept there and reused (None: each call maps anew)."""
    numels = [layout.numel for layout in model_layouts(arch)]
    for store, node in zip(stores, store_nodes):
        in_place = weights_in_place(store, dtype, embedding_master, get) if node == here else {}
        for i in get(store.layer_ids.remote(), "mapping the stores"):
            if i not in in_place:
                yield i, get(store.master.remote(i), f"reading layer {i}")
                continue
            path, kind = in_place[i]
            if mapped is None:
                yield i, shm_tensor(Path(path), numels[i], kind, create=False)
                continue
            if path not in mapped:
                mapped[path] = shm_tensor(Path(path), numels[i], kind, create=False)
            yield i, mapped[path]


def weights_in_place(store, dtype: torch.dtype, embedding_master: bool, get: Callable) -> dict[int, tuple[str, torch.dtype]]:
    """The shared-memory file and dtype of each layer's weights that a store shares: its compute
    copies (the weights the workers compute with), and, where a worker steps the embedding on its
    device, the embedding's fp32 master, which the store keeps in shared memory for that worker
    (so 2 GB at 7B need not cross Ray's object store at every read)."""
    shared = {i: (path, dtype) for i, path in get(store.shared_paths.remote(), "mapping the stores").items()}
    if embedding_master:
        shared.pop(0, None)
        states = get(store.shared_states.remote(), "mapping the stores")
        if 0 in states:
            shared[0] = (states[0]["master"], torch.float32)
    return shared


class RolloutActor(Rollout):
    """The rollout (rl/rollout.py) in a Ray actor on the GPU node, seeing the GPU it is given (rank
    0's, which it shares with the trainer: the step is planned within what its copy leaves), or
    holding one of its own (grpo.rollout_gpu=own: the GPU Ray gave it), and
    reading the stores' weights from there itself: none of them passes through the driver. The
    layers it streams (those the step plan does not keep resident: planning/gpu_share.py) are read in place
    from the stores' compute copies, mapped once and page-locked in this process."""

    def __init__(self, arch: ModelArch, config: Config, visible_gpus: list[str] = (), resident_layers: int | None = None):
        """`resident_layers`: the decoder layers the step plan keeps on its GPU (planning/gpu_share.py; None: all)."""
        if visible_gpus:  # an actor that asked Ray for no GPU sees none, unless told
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible_gpus)
        if config.runtime.worker_threads:  # as a GPU worker's (it runs while they wait)
            torch.set_num_threads(config.runtime.worker_threads)
        g = config.grpo
        self.compute_dtype = dtype_of(config.model.compute_dtype)
        super().__init__(arch, dtype_of(g.rollout_dtype), rollout_device(g.rollout_device), config.train.seed,
                         resident_layers)
        self.mapped: dict[str, torch.Tensor] = {}  # the stores' compute copies, by path
        self.registered: set[int] = set()  # the addresses of those page-locked here

    def load_from_stores(self, stores: list, store_nodes: list[str], embedding_master: bool) -> None:
        here = ray.get_runtime_context().get_node_id()
        self.load(self._page_locked(store_weights(stores, store_nodes, here, self.arch, self.compute_dtype,
                                                  embedding_master, lambda refs, what: ray.get(refs), self.mapped)))

    def _page_locked(self, layer_weights: Iterator[tuple[int, torch.Tensor]]) -> Iterator[tuple[int, torch.Tensor]]:
        """The stores' shared compute copies page-locked here (once, on a GPU), so they copy to it at
        full speed, every step for the layers it streams (rl/layer_stream.py reads them in place)."""
        for layer, flat in layer_weights:  # self.mapped grows as store_weights maps: read it per layer
            if self.device.type == "cuda" and flat.data_ptr() not in self.registered and \
                    any(flat.data_ptr() == t.data_ptr() for t in self.mapped.values()):
                cuda_host_register(flat)
                self.registered.add(flat.data_ptr())
            yield layer, flat

    def close(self) -> None:
        """Nothing to release: its memory goes with its process."""
