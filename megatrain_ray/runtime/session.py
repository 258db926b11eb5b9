"""A run's actors on the cluster, and the one API for their lifecycle: place the stores, give
them their first weights (random, a Hugging Face model, or a checkpoint), start the GPU workers
(one per GPU, data parallel), step, checkpoint, export, close.

Every wait goes through `wait(refs, what)`: plain ray.get, or the driver's Watchdog, which turns
a lost node into a ClusterFault instead of a hang.
"""

from __future__ import annotations

import errno
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import ray

from megatrain_ray.files import checkpoint as ckpt
from megatrain_ray.files.carried import carried_tensors, carry_into
from megatrain_ray.runtime.actors import GpuWorker, RolloutActor, ShardStoreActor, store_weights
from megatrain_ray.runtime.cluster import NodeFacts, RayNodes, driver_node_id, free_port, on_node
from megatrain_ray.runtime.grpo_steps import GrpoSteps
from megatrain_ray.planning.step_plan import DeviceFacts, StepPlan, plan_step
from megatrain_ray.config import Config
from megatrain_ray.objective import objective_of
from megatrain_ray.streaming.data_parallel import split_micro_batches, split_unevenly
from megatrain_ray.streaming.executor import target_tokens
from megatrain_ray.streaming.step_result import EvalResult, StepResult, combine_results
from megatrain_ray.host.memory import dtype_of, new_run_id
from megatrain_ray.host.store import IN_FLUX
from megatrain_ray.host.precision import format_of
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.planning.placement import Placement, largest_models, plan_placement, store_room

Wait = Callable[[Any, str], Any]


class StoresNotAtStep(RuntimeError):
    """After a lost GPU worker or node, the stores do not hold one step's state; the message says why."""


def plain_wait(refs, what: str):
    return ray.get(refs)


def place(arch: ModelArch, config: Config, cluster: NodeFacts) -> Placement:
    """The stores' placement on the cluster whose facts `cluster` reads (runtime/cluster.py: the one
    Ray is connected to, or this machine without Ray, for a plan); the step plan sizes the window
    of remote layers, once it knows whether activations are parked beside it."""
    return plan_placement(arch, config, cluster.nodes(config.runtime), cluster.driver_node_id())


def largest_models_here(arch: ModelArch, config: Config, cluster: NodeFacts) -> str:
    """The largest model per optimizer state mode the cluster holds (placement.largest_models)."""
    return largest_models(store_room(arch, config, cluster.nodes(config.runtime), cluster.driver_node_id()), config)


class Session:
    """Stores and the GPU workers of one run, placed on the cluster Ray is connected to.

    The GPU workers' and the stores' processes start side by side (each spends seconds importing
    torch); the workers report their devices and the step is planned from that, once
    (planning/step_plan.py: refused in seconds, not after the stores fill host memory, 90 s at
    7B); then the stores take their host memory. The workers build what the plan says when
    `start_executor` comes."""

    def __init__(self, config: Config, arch: ModelArch, updates_done: int = 0, placement: Placement | None = None,
                 wait: Wait = plain_wait, worker_class: type | None = None, store_class: type | None = None,
                 schedule_steps: int | None = None):
        """`worker_class`, `store_class`: the actors' classes (GpuWorker, ShardStoreActor, or the
        benchmark's extensions of them: bench/telemetry.py); `schedule_steps`: a resumed run's LR
        schedule length (files/checkpoint.py, schedule_on_resume; None: the objective's)."""
        self.config = config
        self.schedule_steps = schedule_steps
        self.worker_class = worker_class or GpuWorker
        self.store_class = store_class or ShardStoreActor
        self.arch = arch
        self.wait = wait
        self.placement = placement or place(arch, config, RayNodes())
        self.marks: dict[str, float] = {"placement": time.perf_counter()}  # when each part of the start ended
        self._updates_done = updates_done  # the LR position, and each layer's update count, after the last step
        self.gpus: list = []
        self.stores: list = []
        self.rollouts: list = []  # a GRPO run's rollout actors (_launch_rollouts)
        self.gpu_ids: list[list[str]] = []  # each worker's GPUs, as Ray gave them
        self._unseen: list[dict] = []  # per worker: the others' layer updates it has not been told of (layer -> ref)
        self.carried_from: str | None = None  # where the carried tensors are (files/carried.py)
        self._filling: list = []  # stores filling their first weights in one call each (init_weights, restore)
        self._filling_what = "initialising the weights"  # what a wait for them says
        self._first_reads: dict = {}  # layer -> the call filling it, for the first step's reads to wait on
        try:
            self.gpus = self._launch_workers()
            self.stores = self._launch_stores()  # their processes start beside the workers'
            self.facts = facts = self._device_facts()  # each worker's device, as the plan saw it
            self._mark("workers' devices")
            self.plan: StepPlan = self._plan(config, facts, stores_allocated=False)
            if objective_of(config).samples:  # its process starts while the stores fill, its share planned
                self.rollouts = self._launch_rollouts()
            self._allocate_stores()
            self._mark("stores' memory")
        except BaseException:
            self.close()
            raise

    def _mark(self, what: str) -> None:
        self.marks[what] = time.perf_counter()

    def start_timeline(self, now_age: float) -> dict[str, float]:
        """When each part of the start ended so far, in seconds after this process started, given
        its age now (host/memory.py, process_age): the benchmark's start-up line."""
        now = time.perf_counter()
        return {what: now_age - (now - t) for what, t in self.marks.items()}

    def _launch_workers(self) -> list:
        """One worker per GPU of the GPU node, each holding one GPU through Ray, rank order."""
        p = self.placement
        options: dict[str, Any] = {"num_cpus": 0, "scheduling_strategy": on_node(p.gpu.node_id)}
        if p.use_cuda:
            options["num_gpus"] = 1
        return [ray.remote(self.worker_class).options(**options).remote(self.arch, self.config, rank, p.num_gpus)
                for rank in range(p.num_gpus)]

    def _device_facts(self) -> list[DeviceFacts]:
        """Each worker's device, shown all the workers' GPUs (NCCL copies directly between GPUs only
        when a process sees both; Ray would show each worker its own GPU alone)."""
        ids = self.wait([w.gpu_ids.remote() for w in self.gpus], "starting the GPU workers")
        self.gpu_ids = ids
        visible = [i for worker_ids in ids for i in worker_ids]
        return self.wait([w.take_device.remote(visible) for w in self.gpus], "starting the GPU workers")

    def _plan(self, config: Config, facts: list[DeviceFacts], stores_allocated: bool) -> StepPlan:
        """The step's plan for every worker (planning/step_plan.py); the placement from here on is
        the plan's, with its window of remote layers."""
        plan = plan_step(self.arch, config, facts, self.placement, stores_allocated, schedule_steps=self.schedule_steps)
        self.placement = plan.placement
        return plan

    def _launch_stores(self) -> list:
        p = self.placement
        return [ray.remote(self.store_class)
                .options(num_cpus=0, scheduling_strategy=on_node(plan.node.node_id))
                .remote(threads=plan.threads)
                for plan in p.stores]

    def _allocate_stores(self) -> None:
        """Each store takes its memory (the embedding's state in shared memory from the start where the
        plan steps it on a device, and its link open where it serves another node); `reach`: how the
        workers reach each store, for them to build without asking it anything."""
        config, p = self.config, self.placement
        run_id = new_run_id()  # names the driver: host/memory.py sweeps a dead driver's segments
        self.reach = self.wait([
            store.allocate.remote(self.arch, list(plan.layers), dtype_of(config.model.compute_dtype),
                                  config.runtime.shm_dir, run_id, format_of(config.optim), config.train.seed,
                                  shared_state=(0,) if self.plan.embedding_on_device and 0 in plan.layers else (),
                                  disk_dir=config.runtime.disk_dir, disk_layers=plan.disk_layers,
                                  disk_compute_layers=plan.disk_compute_layers,
                                  shared_momentum=tuple(i for i in self.plan.muon_on_device if i in plan.layers),
                                  train_vision=config.model.train_vision, serve=plan.node.node_id != p.gpu.node_id)
            for store, plan in zip(self.stores, p.stores)], "starting the stores")

    # -- the first weights -------------------------------------------------------------------------
    def init_weights(self, wait: bool = True) -> None:
        """From model.path (a Hugging Face directory) when given, else random from train.seed.
        wait=False: the stores fill their layers while the GPU workers build (`start_executor`), and a
        store the workers reach through shared memory fills one layer per call, in layer order: the
        first step reads each layer as soon as its own call is done, while later layers still fill
        (`_first_reads`). A store on another node fills in one call, which `start_executor` waits for."""
        path = self.config.model.path
        if path:
            self.carried_from = path
        if path and not wait:  # a directory that does not fit fails here, not in the first step
            self.wait([store.check_hf.remote(path) for store in self.stores], f"checking {path}")
        here = self.placement.gpu.node_id
        for store, plan in zip(self.stores, self.placement.stores):
            if wait or plan.node.node_id != here or plan.disk_compute_layers:  # streamed layers: filled in one call
                self._filling.append(self._fill(store, None, checked=False))
            else:
                self._first_reads.update({i: self._fill(store, [i], checked=True) for i in plan.layers})
        for store in self.stores:  # queued behind the fill, never waited for: the first step's updates follow it
            store.fault_in_moments.remote()
        if wait:
            self._wait_filled()

    def _fill(self, store, layers: list[int] | None, checked: bool):
        """One call filling a store's layers (`layers`, default all): model.path, else random."""
        path = self.config.model.path
        if path:
            return store.load_hf.remote(path, layers, checked)
        return store.init_random.remote(self.config.train.seed, self.config.model.init_std, layers)

    def _wait_filled(self) -> None:
        if self._filling:
            try:
                self.wait(self._filling, self._filling_what)
            except ray.exceptions.RayTaskError as e:
                if isinstance(e.cause, ckpt.CheckpointError):  # a store's own message, without the remote traceback
                    raise e.cause from None
                raise
            self._filling = []
            self._mark("weights")

    def restore(self, path: Path, verify: bool = True, wait: bool = True) -> dict:
        """Every store loads its layers from the checkpoint, whatever split wrote it; returns its meta.
        verify=False: its files were hashed already (a run verifies a checkpoint once: 91 GB at 7B).
        wait=False: the stores load while the GPU workers build (`start_executor`, which waits for
        the loads before it returns: the first step reads the checkpoint's state whole)."""
        manifest, meta = ckpt.read_manifest(path, verify=verify)
        ckpt.check_compatible(meta, self.arch, path, manifest)
        ckpt.check_state_format(meta, self.config, path)
        files = ckpt.shard_files_by_layer(path, manifest)
        self._filling = [store.load_layers.remote(files) for store in self.stores]
        self._filling_what = f"loading {path}"
        self._updates_done = meta["updates_done"]
        ckpt.restore_rng_state(meta.get("rng"))
        self.carried_from = str(path)
        if wait:
            self._wait_filled()
        return meta

    def start_executor(self) -> str:
        """The GPU workers build the planned step, while the stores fill their first weights where
        `init_weights(wait=False)` left them filling; returns once they are built and told which of
        the GPU node's layers are still landing (their first step waits for each), and the stores on
        other nodes are filled, with the devices' description. Rank 0's node holds the process
        group's rendezvous."""
        p = self.placement
        nodes = [plan.node.node_id for plan in p.stores]
        self._unseen = [{} for _ in range(p.num_gpus)]
        port = self.wait(free_port.options(scheduling_strategy=on_node(p.gpu.node_id)).remote(),
                         "starting the GPU workers") if p.num_gpus > 1 else 0
        names = self.wait([w.start.remote(self.plan, self.stores, nodes, self.reach, self._updates_done, p.gpu.ip,
                                          port) for w in self.gpus], "starting the GPU workers")
        self._mark("workers built")
        if self._first_reads:
            self.wait([w.expect_first_weights.remote(self._first_reads) for w in self.gpus], "starting the GPU workers")
            self._first_reads = {}
        self._wait_filled()
        return names[0] if len(names) == 1 else f"{len(names)} x {names[0]}" if len(set(names)) == 1 else ", ".join(names)

    # -- running -----------------------------------------------------------------------------------
    def train_step(self, micro_batches: list[dict], what: str = "a step") -> StepResult:
        result = self.run_step("train_step", micro_batches, what)
        if result.finite:  # a non-finite step updates no layer
            self._updates_done += 1
        return result

    def run_step(self, method: str, micro_batches: list[dict], what: str, out_dir: str | None = None) -> StepResult:
        """Each worker its share of the micro-batches, the step's target count for the loss, and the
        other workers' references to the updates it has not been told of; the result is the step's,
        combined. Each worker's reads of a layer then wait for that layer's update only."""
        shares = split_micro_batches(micro_batches, len(self.gpus))
        target = sum(target_tokens(mb) for mb in micro_batches)
        refs = []
        for rank, (worker, share) in enumerate(zip(self.gpus, shares)):
            args = (share, target, self._tell(rank))
            call = getattr(worker, method)
            refs.append(call.remote(f"{out_dir}/rank-{rank}", *args) if out_dir else call.remote(*args))
        outs = self.wait(refs, what)
        for rank, unseen in enumerate(self._unseen):
            for sender, (_, sent) in enumerate(outs):
                if sender != rank:
                    unseen.update(sent)
        return combine_results([result for result, _ in outs])

    def _tell(self, rank: int) -> dict:
        """What worker `rank` has not been told of, once: a window counts each update it is told of."""
        told, self._unseen[rank] = self._unseen[rank], {}
        return told

    def eval_loss(self, micro_batches: list[dict], what: str = "a validation") -> EvalResult:
        """Forward only over the micro-batches with the current weights; the stores are not touched.
        Each worker takes a share (none, when there are fewer micro-batches than workers)."""
        shares = split_unevenly(micro_batches, len(self.gpus))
        parts = self.wait([w.eval_loss.remote(share, self._tell(rank))
                           for rank, (w, share) in enumerate(zip(self.gpus, shares)) if share], what)
        return EvalResult(sum(p.loss_sum for p in parts), sum(p.target_tokens for p in parts),
                          sum(p.tokens for p in parts), max(p.seconds for p in parts))

    def token_logprobs(self, micro_batches: list[dict], what: str = "the old policy's log-probabilities") -> list:
        """Each label's log-probability under the current weights, through the streamed forward
        (the workers' shares, in order): the policy loss's old log-probabilities (rl/step.py)."""
        shares = split_unevenly(micro_batches, len(self.gpus))
        parts = self.wait([w.token_logprobs.remote(share, self._tell(rank))
                           for rank, (w, share) in enumerate(zip(self.gpus, shares)) if share], what)
        return [lp for part in parts for lp in part]

    def reference_logprobs(self, micro_batches: list[dict]) -> list:
        """Each label's log-probability under the reference policy, streamed by rank 0's worker from
        the one copy of its weights in host memory (GpuWorker.reference_logprobs)."""
        return self.wait(self.gpus[0].reference_logprobs.remote(micro_batches), "the reference's log-probabilities")

    def drain(self, what: str = "the optimizer's last updates") -> int:
        """Every update issued has landed; returns the number of updates done."""
        return self.wait([w.drain.remote() for w in self.gpus], what)[0]

    def rollout_weights(self):
        """(layer, weights) for a rollout's copy of the policy in the driver (rl/rollout.py), once
        every update has landed (runtime/actors.py, store_weights: in place where the driver shares
        a store's node)."""
        self.drain("the updates before the rollout")
        yield from store_weights(self.stores, self._store_nodes(), driver_node_id(), self.arch,
                                 dtype_of(self.config.model.compute_dtype), self.plan.embedding_on_device, self.wait)

    def _store_nodes(self) -> list[str]:
        return [plan.node.node_id for plan in self.placement.stores]

    def _launch_rollouts(self) -> list:
        """A GRPO run's rollout actors (runtime/actors.py, RolloutActor), as many as the step plan
        says (planning/gpu_share.py, `samplers`), on the GPU node: each shown a worker's GPU, which
        it shares (rank order), or holding one of its own (grpo.rollout_gpu=own, where the
        placement left them), with the decoder layers the plan keeps resident there; they end with
        the session."""
        options: dict[str, Any] = {"num_cpus": 0, "scheduling_strategy": on_node(self.placement.gpu.node_id)}
        share = self.plan.rollout
        if self.config.grpo.rollout_gpu == "own":
            options["num_gpus"] = int(self.placement.use_cuda)
            shown = [[] for _ in range(share.samplers)]  # each sees the GPU Ray gives it
        else:
            shown = [self.gpu_ids[rank % len(self.gpu_ids)] for rank in range(share.samplers)]
        return [ray.remote(RolloutActor).options(**options).remote(self.arch, self.config, gpus, share.resident_layers)
                for gpus in shown]

    def grpo_steps(self, config: Config, data, position: dict | None) -> GrpoSteps:
        """A GRPO run's steps for the training loop, on this session's rollout actors and workers."""
        return GrpoSteps(self, config, data, position)

    def refresh_rollouts(self) -> None:
        """The rollout actors load the weights of every update so far, from the stores themselves."""
        self.drain("the updates before the rollout")
        self.wait([actor.load_from_stores.remote(self.stores, self._store_nodes(), self.plan.embedding_on_device)
                   for actor in self.rollouts], "loading the rollout's weights")

    def iter_layer_weights(self):
        """(layer, fp32 master weights) in layer order, one layer in memory at a time."""
        self.drain()
        for store, plan in zip(self.stores, self.placement.stores):
            for i in plan.layers:
                yield i, self.wait(store.master.remote(i), f"reading layer {i}")

    # -- checkpoints and export --------------------------------------------------------------------
    def save_checkpoint(self, step: int, data_position: dict | None) -> Path:
        updates_done = self.drain(f"the checkpoint of step {step}")
        root = ckpt.checkpoint_root(self.config)
        staging = ckpt.new_staging_dir(root, step)
        try:
            shards = self._write_shards(staging, step)
        except BaseException:  # a full disk: the half-written shards would hold the room a resume needs
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return self._commit(staging, root, step, shards, updates_done, data_position)

    @property
    def updates_done(self) -> int:
        """Each layer's update count after the last finished step (a non-finite step updates none)."""
        return self._updates_done

    def save_from_stores(self, step: int, data_position: dict | None, lost_nodes: tuple[str, ...] = (),
                         updates_done: int | None = None) -> Path:
        """The checkpoint of finished step `step` after a GPU worker died or hung (or its node left),
        from the stores alone: the workers are stopped first (no drain: a dead one answers nothing;
        their links close, so a store waiting for a gradient gives up that update), then every store
        writes its shard, and the checkpoint is kept only if every layer's update count is that
        step's; a layer a worker stepped on its device (the embedding: streaming/device_step.py)
        counts as its store's marker says, read before and after the write (a worker not dead yet
        that began writing it in between changed it). Raises StoresNotAtStep, saying why, where the
        stores cannot hold it: a lost node took layers with it, the embedding's state was being
        written back, or the step's updates had begun to land (or had not all landed). `updates_done`:
        the update count of `step` where it is not the last finished one (a full disk refused the
        updates of the step after it: runtime/training.py)."""
        if updates_done is not None:
            self._updates_done = updates_done
        lost = [i for plan in self.placement.stores if plan.node.node_id in lost_nodes for i in plan.layers]
        if lost:
            raise StoresNotAtStep(f"layers {lost[0]}-{lost[-1]} were on the lost node, and their weights and "
                                  f"optimizer state went with it")
        self.stop_workers()
        held = self._held_at_step(step)
        root = ckpt.checkpoint_root(self.config)
        staging = ckpt.new_staging_dir(root, step)
        try:
            shards = self._write_shards(staging, step)
            if self._held_counts() != held:
                raise StoresNotAtStep(f"the embedding's optimizer state changed while the checkpoint of step {step} "
                                      f"was written: the worker that steps it on its device had not stopped yet")
            counts = ckpt.shard_update_counts(staging, shards)
            off = sorted(layer for layer, count in counts.items() if count != self._updates_done)
            if off:
                raise StoresNotAtStep(
                    f"layers {off} hold {sorted({counts[i] for i in off})} updates, not the {self._updates_done} of "
                    f"step {step}: the worker stopped while a step's updates were landing")
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return self._commit(staging, root, step, shards, self._updates_done, data_position)

    def _commit(self, staging: Path, root: Path, step: int, shards: list, updates_done: int,
                data_position: dict | None) -> Path:
        """The staged shards published as step `step`'s checkpoint, with the tensors carried unchanged
        beside the model (files/carried.py)."""
        carry_into(staging, self.carried_from, self.arch)
        meta = ckpt.checkpoint_meta(self.config, self.arch, step, updates_done, data_position, self.plan.schedule_steps)
        final = ckpt.commit(staging, root, step, shards, meta, self.config.checkpoint.keep)
        self.carried_from = str(final)  # the one it came from may be pruned
        return final

    def _held_counts(self) -> dict[int, int]:
        """The stores' markers of the layers workers step on their devices (host/store.py, held_marker)."""
        return {i: n for counts in self.wait([s.held_counts.remote() for s in self.stores], "reading the stores")
                for i, n in counts.items()}

    def _held_at_step(self, step: int) -> dict[int, int]:
        """The markers, each the last finished step's count, which the stores then count as theirs;
        else StoresNotAtStep."""
        held = self._held_counts()
        for layer, count in held.items():
            if count == IN_FLUX:
                raise StoresNotAtStep(f"layer {layer}'s optimizer state was being copied back from the worker's device "
                                      f"(the embedding's step or Muon's momentum there) when the worker stopped")
            if count != self._updates_done:
                raise StoresNotAtStep(f"layer {layer}'s optimizer state, stepped on a worker's device, holds {count} "
                                      f"updates, not the {self._updates_done} of step {step}")
        owner = {i: store for store, plan in zip(self.stores, self.placement.stores) for i in plan.layers}
        self.wait([owner[i].set_update_count.remote(i, n) for i, n in held.items()], "reading the stores")
        return held

    def stop_workers(self) -> None:
        """Kill the GPU workers (a dead one stays dead; a hung or blocked one ends, and its links close)."""
        for worker in self.gpus:
            try:
                ray.kill(worker)
            except Exception:
                pass

    def _write_shards(self, staging: Path, step: int) -> list[dict]:
        """Every store's layers into `staging`; returns the manifest's entries."""
        config = self.config
        names = [f"shard-{k:03d}.safetensors" for k in range(len(self.stores))]
        what = f"writing the checkpoint of step {step}"
        if config.checkpoint.transport == "shared":
            try:
                shards = self.wait([s.save_shard.remote(str(staging), n) for s, n in zip(self.stores, names)], what)
            except ray.exceptions.RayTaskError as e:
                if isinstance(e.cause, OSError) and e.cause.errno not in (None, errno.ENOENT):
                    raise e.cause from None  # the disk's own error (full, read-only), whatever the transport
                raise ckpt.CheckpointError(f"a store could not write its shard into {staging} ({e.cause!r}); with "
                                           f"checkpoint.transport=shared the checkpoint dir must be storage every "
                                           f"node sees, else set checkpoint.transport=driver") from None
            ckpt.check_shards_visible(staging, shards)
        else:
            shards = []
            for store, name in zip(self.stores, names):
                tensors, steps = self.wait(store.state_tensors.remote(), what)
                shards.append(ckpt.write_shard(staging, name, tensors, steps))
        return shards

    def export(self, out_dir: Path) -> None:
        """The master weights as a Hugging Face model directory, one layer at a time."""
        from megatrain_ray.files.hf import export_hf

        export_hf(out_dir, self.arch, self.iter_layer_weights(), dtype=dtype_of(self.config.checkpoint.export_dtype),
                  carried=carried_tensors(self.carried_from, self.arch))

    # -- the end -----------------------------------------------------------------------------------
    def close(self, timeout_s: float = 10.0) -> None:
        """For a run that may have lost actors too: ask the living ones to release their shared
        memory (a bounded wait), then kill them all."""
        actors = list(self.gpus) + list(self.stores) + list(self.rollouts)
        refs = []
        for actor in actors:
            try:
                refs.append(actor.close.remote())
            except Exception:
                pass
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for actor in actors:
            try:
                ray.kill(actor)
            except Exception:
                pass
