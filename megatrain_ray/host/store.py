"""Host-memory state of a contiguous range of layers, and their optimizer step.

Per layer, by default, four flat buffers: fp32 master weights and AdamW first and second moments
(private to the store), and the one buffer the executor touches: the compute copy (bf16, or fp32
for exact tests). It also receives the layer's gradient: by the time a gradient leaves the device,
that layer's weights have been read for the last time in the step, and the optimizer reads the
gradient chunk by chunk before writing the new weights over it. So 12 + 2 = 14 bytes per
parameter with bf16 compute, which is what lets a 7B model with fp32 AdamW fit in 128 GiB.
Lean modes (optim.master, optim.moments; host/precision.py) hold the moments in bf16 or int8 and
the master in bf16, which is then the compute copy itself, with a bf16 gradient buffer beside it.
The shared buffers live in pinned memory in process, or in /dev/shm files that a GPU actor on the
same node maps and registers with CUDA.
"""

from __future__ import annotations

import hashlib
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from megatrain_ray.host import precision
from megatrain_ray.host.disk import DiskTier, HeldWindow, compute_parts
from megatrain_ray.host.memory import element_size, pinned_empty, remove_dead_segments, segment_name, shm_tensor, zeroed
from megatrain_ray.host.precision import StateFormat
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.host.adamw_kernel import start_native_kernel
from megatrain_ray.models.family import ModelFamily
from megatrain_ray.models.layout import LayerLayout, ParamSlot
from megatrain_ray.models.registry import family, model_layouts
from megatrain_ray.host.adamw import AdamWStep, adamw_step, segments_within
from megatrain_ray.host.muon import muon_slots, second_moment_numel
from megatrain_ray.host.muon_layer import muon_layer_update


IN_FLUX = -1  # a held marker's value while a GPU worker writes the layer's state (ShardStore.held_marker)
ABSENT = torch.empty(0)  # a tensor of a layer's state that is in the disk tier, not in memory (ShardStore.resident)


def bytes_per_param(compute_dtype: torch.dtype, state: StateFormat = StateFormat()) -> float:
    """Host bytes each parameter costs: master, two moments (their int8 scales), the compute/gradient copy."""
    return state.bytes_per_param(element_size(compute_dtype))


def layer_bytes(layout: LayerLayout, compute_dtype: torch.dtype, state: StateFormat = StateFormat()) -> float:
    """Host bytes of a layer's state: its frozen parameters (LayerLayout.trained_numel) hold no moments."""
    frozen = layout.numel - layout.trained_numel
    if state.optimizer == "muon":  # a block's second moment covers its AdamW tensors only (host/muon.py)
        compute = element_size(compute_dtype) if state.master == "fp32" else 2
        return (state.held_bytes(layout.numel, layout.trained_numel, second_moment_numel(layout, state.optimizer))
                + layout.numel * compute)
    return layout.numel * bytes_per_param(compute_dtype, state) - frozen * state.moment_bytes()


@dataclass
class LayerState:
    layout: LayerLayout
    master: torch.Tensor  # fp32; or bf16, and then the same tensor as `compute`
    exp_avg: torch.Tensor  # fp32, bf16 or int8 codes
    exp_avg_sq: torch.Tensor  # fp32, bf16 or uint8 codes of its square root
    compute: torch.Tensor  # weights the executor reads (with an fp32 master, then the gradient it writes back)
    grad: torch.Tensor  # where the gradient lands: `compute` itself, or (bf16 master) a buffer of its own
    scales: tuple[torch.Tensor, torch.Tensor] | None = None  # int8 moments: a scale per block of each
    updates: int = 0  # AdamW updates applied: this layer's bias correction, and what a checkpoint keeps
    held: torch.Tensor | None = None  # stepped by a GPU worker: the update count its state holds (`held_marker`)
    on_disk: bool = False  # its cold state (host/disk.py, cold_keys) lives in the disk tier: empty here but while resident
    compute_on_disk: bool = False  # its compute copy and gradient too (host/disk.py, compute_parts; HeldWindow)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The state a checkpoint holds, as it is held (no compute copy: it follows the master)."""
        out = {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        if self.scales is not None:
            out.update(zip(precision.SCALE_KEYS, self.scales))
        return out


INIT_PIECE = 1 << 20  # elements of a parameter drawn from one generator: a thread's unit of random init


@dataclass(frozen=True)
class InitPiece:
    slot: ParamSlot
    start: int  # in the layer's flat buffer
    end: int
    seed: int  # its generator's (32 bits: all that torch's CPU generator keeps)


def init_pieces(layout: LayerLayout, seed: int) -> list[InitPiece]:
    """A layer's random init cut into pieces of at most INIT_PIECE elements of one parameter, each
    drawn from a generator of its own, seeded from (seed, layer, piece) only: the weights are the
    same in any split of the model across stores and of the pieces across threads."""
    out = []
    for slot in layout.params:
        for start in range(slot.offset, slot.offset + slot.numel, INIT_PIECE):
            key = hashlib.blake2b(f"{seed}/{layout.index}/{len(out)}".encode(), digest_size=4).digest()
            out.append(InitPiece(slot, start, min(slot.offset + slot.numel, start + INIT_PIECE),
                                 int.from_bytes(key, "little")))
    return out


def init_layer_weights(fam: ModelFamily, layout: LayerLayout, flat: torch.Tensor, seed: int, std: float,
                       pool: ThreadPoolExecutor | None = None) -> None:
    """Random init of one layer's flat fp32 buffer that depends only on (seed, layer), piece by
    piece (`init_pieces`), on the threads of `pool` when given. The pieces run torch's serial
    random kernels, so threads of a pool never start threads of their own."""
    def draw(piece: InitPiece) -> None:
        fam.init_param(piece.slot, flat[piece.start : piece.end], torch.Generator().manual_seed(piece.seed), std)

    pieces = init_pieces(layout, seed)
    for _ in (pool.map(draw, pieces) if pool is not None else map(draw, pieces)):
        pass


class ShardStore:
    """Owns layers [first, last] of a model: their master weights, moments and optimizer step.

    Plain Python so that it runs in process for tests and inside a Ray actor (runtime/actors.py) alike.
    """

    def __init__(
        self,
        arch: ModelArch,
        layers: list[int],
        compute_dtype: torch.dtype,
        shm_dir: str | None = None,
        run_id: str = "local",
        state_format: StateFormat = StateFormat(),
        seed: int = 0,
        shared_state: tuple[int, ...] = (),
        disk_dir: str | None = None,
        disk_layers: tuple[int, ...] = (),
        shared_momentum: tuple[int, ...] = (),
        disk_compute_layers: tuple[int, ...] = (),
        train_vision: bool = False,
    ):
        """`seed`: train.seed, the stochastic rounding's (a bf16 master's) stream. `shared_state`: layers
        whose master and moments a GPU worker on this node steps (the step plan's embedding on the
        device), in shared memory from the start (`share_state`, with nothing to copy). `disk_layers`:
        layers whose optimizer state lives in files under `disk_dir` (the plan's: host/disk.py);
        `disk_compute_layers`, some of them, whose compute copy does too (a GPU worker reaches them
        through the store's link, `open_link` in runtime/actors.py, as a RAM node's).
        `shared_momentum`: Muon blocks whose momentum a GPU worker on this node updates and
        orthogonalizes (the plan's, streaming/muon_step.py): that buffer in shared memory, with the
        layer's marker (`held_marker`). `train_vision`: model.train_vision (an image-text model's
        frozen vision tower holds no moments: registry.model_layouts)."""
        start_native_kernel()  # a first build on this node (tens of seconds) beside the run's start, not in its first step
        self.arch = arch
        self.compute_dtype = compute_dtype
        self.format = state_format
        self.seed = seed
        if state_format.master == "bf16" and compute_dtype != torch.bfloat16:
            raise ValueError("a bf16 master is the compute copy: it needs a bf16 compute dtype")
        self.shm_paths: dict[int, str] = {}
        self.grad_shm_paths: dict[int, str] = {}  # a bf16 master's gradient buffers
        self.extra_shm_paths: list[str] = []  # state shared with a GPU worker (share_state)
        self.state_shm_paths: dict[int, dict[str, str]] = {}  # those paths by layer and name
        self.shared_momentum = frozenset(shared_momentum)
        self.momentum_shm_paths: dict[int, str] = {}  # their momenta (shared_momenta)
        self._shm_dir = Path(shm_dir) if shm_dir else None
        self._run_id = run_id
        if self._shm_dir is not None:
            files, nbytes = remove_dead_segments(self._shm_dir)
            if files:
                print(f"removed {files} shared-memory segment(s) ({nbytes / 2**30:.2f} GiB) of runs that died "
                      f"without cleaning up, from {self._shm_dir}", flush=True)
        layouts = model_layouts(arch, train_vision)
        if set(disk_layers) & set(shared_state):
            raise ValueError(f"layers {sorted(set(disk_layers) & set(shared_state))} cannot be both on disk and "
                             "stepped by a GPU worker")
        if not set(disk_compute_layers) <= set(disk_layers):
            raise ValueError(f"layers {sorted(set(disk_compute_layers) - set(disk_layers))} would have their compute "
                             "copy on disk but not their optimizer state")
        self.disk: DiskTier | None = None
        self.hot: HeldWindow | None = None  # the compute copies on disk (disk_compute_layers)
        self._disk_step: int | None = None  # the update count at the disk tier's last step mark
        if disk_layers:
            self.disk = DiskTier(disk_dir, run_id, {i: layouts[i] for i in disk_layers}, state_format)
        if disk_compute_layers:
            self.hot = HeldWindow(DiskTier(disk_dir, run_id, {i: layouts[i] for i in disk_compute_layers},
                                           state_format, parts_of=lambda l: compute_parts(l, state_format, compute_dtype),
                                           key="diskcompute", read_ahead=False))
        self.layers: dict[int, LayerState] = {i: self._allocate(layouts[i], i in disk_layers, i in disk_compute_layers)
                                              for i in layers}
        for i in shared_state:
            self._share(i, copy=False)
        for i in self.shared_momentum & set(layers):
            self.held_marker(i)
        self.optimizer_seconds = 0.0  # summed over steps, for the benchmark's time split

    def _shared(self, index: int, n: int, dtype: torch.dtype, key: str | None, paths: dict[int, str]) -> torch.Tensor:
        """A buffer the executor reaches: a /dev/shm segment, or pinned memory in process."""
        if self._shm_dir is None:
            return pinned_empty(n, dtype)
        path = self._shm_dir / segment_name(self._run_id, index, key)
        paths[index] = str(path)
        return shm_tensor(path, n, dtype, create=True)

    def _allocate(self, layout: LayerLayout, on_disk: bool = False, compute_on_disk: bool = False) -> LayerState:
        n, fmt = layout.numel, self.format
        if compute_on_disk:
            return LayerState(layout, master=ABSENT, exp_avg=ABSENT, exp_avg_sq=ABSENT, compute=ABSENT, grad=ABSENT,
                              scales=(ABSENT, ABSENT) if fmt.quantized else None, on_disk=True, compute_on_disk=True)
        compute = self._shared(layout.index, n, self.compute_dtype, None, self.shm_paths)
        if fmt.master == "bf16":
            master, grad = compute, self._shared(layout.index, n, torch.bfloat16, "grad", self.grad_shm_paths)
        else:
            master, grad = (ABSENT if on_disk else torch.empty(n, dtype=torch.float32)), compute
        m_dtype, v_dtype = fmt.moment_dtypes()
        k = layout.trained_numel  # moments for the trained parameters only (a frozen tail holds none)
        scales = ((torch.zeros(precision.num_blocks(k)), torch.zeros(precision.num_blocks(k)))
                  if fmt.quantized else None)
        second = second_moment_numel(layout, fmt.optimizer)  # a Muon block's: its AdamW tensors' (host/muon.py)
        if on_disk:
            return LayerState(layout, master=master, exp_avg=ABSENT, exp_avg_sq=ABSENT, compute=compute, grad=grad,
                              scales=(ABSENT, ABSENT) if fmt.quantized else None, on_disk=True)
        if layout.index in self.shared_momentum:  # zeros: a new segment reads zeros, pinned memory is cleared
            momentum = self._shared(layout.index, k, m_dtype, "momentum", self.momentum_shm_paths)
            if self._shm_dir is None:
                momentum.zero_()
        else:
            momentum = zeroed(k, m_dtype)
        return LayerState(layout, master=master, exp_avg=momentum, exp_avg_sq=zeroed(second, v_dtype),
                          compute=compute, grad=grad, scales=scales)

    @contextmanager
    def resident(self, index: int, dirty: bool = True):
        """The layer's state, all of it in memory while the block runs: a layer in the disk tier
        (host/disk.py) is read into a buffer of its window (ahead of time, where it came in the
        order), and written back after unless `dirty` is False; so is a compute copy on disk."""
        state = self.layers[index]
        if not state.on_disk:
            yield state
            return
        with self._compute_resident(state, dirty) if state.compute_on_disk else nullcontext():
            with self._cold_resident(state, dirty):
                yield state

    @contextmanager
    def _compute_resident(self, state: LayerState, dirty: bool):
        index = state.layout.index
        views = self.hot.hold(index, to_change=dirty)
        state.compute = views["compute"]
        state.grad = views.get("grad", state.compute)
        if self.format.master == "bf16":
            state.master = state.compute
        try:
            yield
        finally:
            state.compute = state.grad = ABSENT
            if self.format.master == "bf16":
                state.master = ABSENT
            self.hot.let_go(index, dirty)

    @contextmanager
    def _cold_resident(self, state: LayerState, dirty: bool):
        index = state.layout.index
        views = self.disk.acquire(index, to_change=dirty)
        for key, t in views.items():
            if key in precision.SCALE_KEYS:
                continue
            setattr(state, key, t)
        if state.scales is not None:
            state.scales = tuple(views[key] for key in precision.SCALE_KEYS)
        try:
            yield
        finally:
            for key in views:
                if key not in precision.SCALE_KEYS:
                    setattr(state, key, ABSENT)
            if state.scales is not None:
                state.scales = (ABSENT, ABSENT)
            self.disk.release(index, dirty)

    def host_bytes(self) -> int:
        """Bytes of every buffer this store holds in RAM (a bf16 master is counted once: it is the compute
        copy), the disk tier's window included."""
        seen = {}
        for s in self.layers.values():
            for t in (*s.tensors().values(), s.compute, s.grad):
                seen[t.data_ptr()] = t.numel() * t.element_size()
        return (sum(seen.values()) + (self.disk.resident_bytes() if self.disk is not None else 0)
                + (self.hot.resident_bytes() if self.hot is not None else 0))

    def disk_stats(self) -> dict[str, float]:
        """The disk tier's bytes moved and the seconds the store waited for its reads (none: no tier)."""
        if self.disk is None:
            return {}
        tiers = [self.disk] + ([self.hot.tier] if self.hot is not None else [])
        steps = [tier.step_bytes() for tier in tiers]
        return {"read_bytes": sum(t.bytes_read for t in tiers), "written_bytes": sum(t.bytes_written for t in tiers),
                "step_read_bytes": sum(r for r, _ in steps), "step_written_bytes": sum(w for _, w in steps),
                "read_wait_s": sum(t.read_seconds for t in tiers), "file_bytes": sum(t.file_bytes() for t in tiers),
                "window_bytes": sum(t.resident_bytes() for t in tiers), "direct_io": all(t.direct for t in tiers),
                "compute_file_bytes": self.hot.tier.file_bytes() if self.hot is not None else 0}

    # ---- initial weights -------------------------------------------------------------------
    def init_random(self, seed: int, std: float, layers: list[int] | None = None) -> None:
        """Each layer (of `layers`, default all) drawn by as many threads as torch's (the store's
        optimizer threads), then published by torch's own."""
        with ThreadPoolExecutor(torch.get_num_threads(), thread_name_prefix="init") as pool:
            for i in (self.layers if layers is None else layers):
                with self.resident(i, dirty=self.format.master == "fp32" or self.layers[i].compute_on_disk) as state:
                    if state.master.dtype == torch.float32:
                        init_layer_weights(family(self.arch), state.layout, state.master, seed, std, pool)
                    else:  # drawn in fp32 as an exact run draws them, then rounded as its compute copy is
                        full = torch.empty(state.layout.numel, dtype=torch.float32)
                        init_layer_weights(family(self.arch), state.layout, full, seed, std, pool)
                        state.master.copy_(full)
                    self.publish(state)

    def fault_in_moments(self) -> None:
        """Fresh moments (zeros the kernel hands out page by page at their first write: host/memory.py,
        `zeroed`) written now, in torch's threads: their pages are taken here, in the idle time while
        the first step computes, and not inside the first update, whose layers the next forward waits
        for. Only on moments nothing has written yet (after init_random or a Hugging Face load). Never on
        a layer a GPU worker steps (share_state): the worker writes those moments, maybe by now."""
        for index, state in self.layers.items():
            worker_writes = index in self.state_shm_paths or (state.held is not None and index not in self.shared_momentum)
            if worker_writes or state.on_disk:  # a file reads zeros
                continue
            if index not in self.shared_momentum:  # a worker's to write (a new segment reads zeros)
                state.exp_avg.zero_()
            state.exp_avg_sq.zero_()

    @staticmethod
    def publish(state: LayerState) -> None:
        """The compute copy from the master (a bf16 master is the copy already)."""
        if state.compute is not state.master:
            state.compute.copy_(state.master)

    def master(self, index: int) -> torch.Tensor:
        """The layer's master weights (a copy, of a master in the disk tier)."""
        state = self.layers[index]
        if not state.on_disk or (self.format.master == "bf16" and not state.compute_on_disk):
            return state.master
        with self.resident(index, dirty=False) as state:
            return state.master.clone()

    def landing_gradient(self, index: int):
        """Where the layer's gradient lands for its update (`step_layer`), while it lands: its grad
        buffer, or for a compute copy on disk a buffer of the window, written to the file after."""
        state = self.layers[index]
        return self.hot.gradient(index) if state.compute_on_disk else nullcontext(state.grad)

    def gradient_paths(self) -> dict[int, str]:
        """Shared-memory gradient buffers of their own (a bf16 master's), by layer; else none."""
        return dict(self.grad_shm_paths)

    def share_state(self, index: int) -> dict[str, str]:
        """Move the layer's master and moments into shared memory, for a GPU worker on this node that
        steps the layer itself (streaming/device_step.py); their paths by name. The store then only counts
        that layer's updates (`set_update_count`) and saves what the worker wrote back; the paths
        include "held", the layer's marker (`held_marker`)."""
        return self._share(index, copy=True)

    def _share(self, index: int, copy: bool) -> dict[str, str]:
        """share_state; `copy` False: the state holds nothing yet (zeros, as a new segment reads)."""
        if self._shm_dir is None:
            raise ValueError("share_state needs the store's shared-memory directory (runtime.shm_dir)")
        if not self.format.exact:
            raise ValueError("the embedding's step on the device needs the exact (fp32) optimizer state")
        state = self.layers[index]
        if state.on_disk:
            raise ValueError(f"layer {index}'s state is in the disk tier: a GPU worker cannot step it")
        paths = {}
        for key in ("master", "exp_avg", "exp_avg_sq"):
            path = self._shm_dir / segment_name(self._run_id, index, key)
            if not path.exists():
                shared = shm_tensor(path, getattr(state, key).numel(), torch.float32, create=True)
                if copy:
                    shared.copy_(getattr(state, key))
                setattr(state, key, shared)
                self.extra_shm_paths.append(str(path))
            paths[key] = str(path)
        self.held_marker(index)
        paths["held"] = str(self._shm_dir / segment_name(self._run_id, index, "held"))
        self.state_shm_paths[index] = paths
        return dict(paths)

    def shared_momenta(self) -> dict[int, dict[str, str]]:
        """The Muon blocks whose momentum a GPU worker updates (`shared_momentum`): the paths of their
        momentum and marker."""
        return {i: {"momentum": path, "held": str(self._shm_dir / segment_name(self._run_id, i, "held"))}
                for i, path in self.momentum_shm_paths.items()}

    def shared_states(self) -> dict[int, dict[str, str]]:
        """The layers whose state is in shared memory (`share_state`), with its paths by name."""
        return dict(self.state_shm_paths)

    def held_marker(self, index: int) -> torch.Tensor:
        """The marker of a layer a GPU worker steps (streaming/device_step.py), one int64 beside its
        state, in shared memory where the store has it: the update count of the state its buffers
        hold, IN_FLUX while the worker writes into them. Runtime state: no checkpoint holds it."""
        state = self.layers[index]
        if state.held is None:
            if self._shm_dir is None:
                state.held = pinned_empty(1, torch.int64)
            else:
                path = self._shm_dir / segment_name(self._run_id, index, "held")
                state.held = shm_tensor(path, 1, torch.int64, create=True)
                self.extra_shm_paths.append(str(path))
            state.held.fill_(state.updates)
        return state.held

    def held_counts(self) -> dict[int, int]:
        """The markers of the layers GPU workers step: the update count their buffers hold, or IN_FLUX."""
        return {i: int(state.held.item()) for i, state in self.layers.items() if state.held is not None}

    def set_update_count(self, index: int, count: int) -> None:
        """Updates a GPU worker applied to a layer whose state it steps (`share_state`)."""
        self.layers[index].updates = count

    # ---- the step ----------------------------------------------------------------------------
    def step_layer(self, index: int, hp: AdamWStep | None) -> int:
        """AdamW on one layer from the gradient the executor wrote; publishes new compute weights.

        hp None skips the update (a non-finite step) and only puts the weights back.
        """
        self.settle_disk(index)
        with self.resident(index):
            self.begin_update(index, hp)
            self.update_piece(index, hp, 0, self.layers[index].layout.numel)
        return index

    def settle_disk(self, index: int) -> None:
        """Before the first update of a step (no other layer of the store has more updates than this
        one), every disk-tier write of the step before has finished: one that failed (a full disk)
        raises here, before any layer takes the new step, so that the store still holds the last
        finished step whole (the failed layer in its buffer) for the checkpoint the run stops with.
        The writes have long finished by then (the next step's forward ran in between); those of the
        compute copies on disk (a gradient that landed in the backward just ended) are waited for. It
        is also where the tiers' counters mark a step (host/disk.py, `mark_step`): each layer's next
        sends follow its update, so from one mark to the next a whole step's disk traffic goes by."""
        if self.disk is None:
            return
        own = self.layers[index].updates
        if self.first_of_step(index):
            self.disk.flush()
            if self.hot is not None:
                self.hot.flush()
            if self._disk_step != own:  # a step's first update (a skipped step's count with the one before)
                self._disk_step = own
                self.disk.mark_step()
                if self.hot is not None:
                    self.hot.mark_step()

    def first_of_step(self, index: int) -> bool:
        """Whether the layer's update would be its step's first on this store: no other layer has more."""
        own = self.layers[index].updates
        return all(state.updates <= own for i, state in self.layers.items() if i != index)

    def begin_update(self, index: int, hp: AdamWStep | None) -> None:
        """Count the layer's update (not a skipped one): its bias correction and rounding key. Its
        pieces follow (`update_piece`), all of them, in any order."""
        if hp is not None:
            self.layers[index].updates += 1

    def update_piece(self, index: int, hp: AdamWStep | None, lo: int, hi: int) -> None:
        """The counted update (`begin_update`) on elements [lo, hi) of the layer, `lo` a multiple of
        precision.QUANT_BLOCK: AdamW is elementwise, so a layer updated piece by piece (its gradient
        arriving in pieces over a link, host/transport.py) ends bit for bit as in one call."""
        t0 = time.perf_counter()
        state = self.layers[index]
        if hp is None:
            if state.compute is not state.master:
                state.compute[lo:hi].copy_(state.master[lo:hi])
            return
        if hp.muon is not None and muon_slots(state.layout, self.format.optimizer):
            self._muon_update(index, hp, lo, hi)
            self.optimizer_seconds += time.perf_counter() - t0
            return
        k = state.exp_avg.numel()  # the trained parameters; a frozen tail after them is not stepped
        a, b = lo, min(hi, k)
        if a < b:
            master = state.master[a:b]
            compute = master if state.compute is state.master else state.compute[a:b]  # a bf16 master is the copy
            segments = segments_within(state.layout.segments(), a, b)
            scales = None if state.scales is None else tuple(
                t[a // precision.QUANT_BLOCK : precision.num_blocks(b)] for t in state.scales)
            adamw_step(
                master, state.exp_avg[a:b], state.exp_avg_sq[a:b], compute, segments, hp, state.updates,
                grad=None if state.grad is state.compute else state.grad[a:b], scales=scales,
                rounding_key=precision.rounding_key(self.seed, index, state.updates), offset=a,
            )
        if max(lo, k) < hi and state.grad is state.compute:  # the frozen tail's (zero) gradient over its weights
            state.compute[max(lo, k):hi].copy_(state.master[max(lo, k):hi])
        self.optimizer_seconds += time.perf_counter() - t0

    def _muon_update(self, index: int, hp: AdamWStep, lo: int, hi: int) -> None:
        """A Muon block's step (host/muon_layer.py): its matrices are whole, so the layer is too."""
        state = self.layers[index]
        if (lo, hi) != (0, state.layout.numel):
            raise ValueError(f"layer {index} takes Muon's step, which needs each matrix whole: it cannot be "
                             "updated piece by piece")
        muon_layer_update(state, hp, precision.rounding_key(self.seed, index, state.updates))
        if hp.muon.orthogonalized and state.held is not None:  # the worker's momentum is now this update's
            state.held.fill_(state.updates)
        k = state.layout.trained_numel
        if k < state.layout.numel and state.grad is state.compute:  # a frozen tail's (zero) gradient over its weights
            state.compute[k:].copy_(state.master[k:])

    # ---- checkpoints ---------------------------------------------------------------------------
    def update_counts(self) -> dict[int, int]:
        """Updates applied to each layer: Adam's bias correction, saved with a checkpoint."""
        return {i: state.updates for i, state in self.layers.items()}

    def close(self) -> None:
        """Release this store's segments and disk-tier files, and sweep again: a killed run's store that
        was still being stopped when this one started has exited since (or its driver has)."""
        if getattr(self, "disk", None) is not None:
            self.disk.close()
            self.disk = None
        if getattr(self, "hot", None) is not None:
            self.hot.tier.close()
            self.hot = None
        for path in [*self.shm_paths.values(), *self.grad_shm_paths.values(), *self.extra_shm_paths,
                     *getattr(self, "momentum_shm_paths", {}).values()]:
            Path(path).unlink(missing_ok=True)
        self.shm_paths.clear()
        self.grad_shm_paths.clear()
        self.extra_shm_paths.clear()
        if getattr(self, "_shm_dir", None) is not None:
            remove_dead_segments(self._shm_dir)

