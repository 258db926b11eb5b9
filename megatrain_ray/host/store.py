"""Host-memory state of a contiguous range of layers, and their optimizer step.

Per layer, four flat buffers: fp32 master weights and AdamW first and second moments (private
to the store), and the one buffer the executor touches: the compute copy (bf16, or fp32 for exact
tests). It also receives the layer's gradient: by the time a gradient leaves the device, that
layer's weights have been read for the last time in the step, and the optimizer reads the
gradient chunk by chunk before writing the new weights over it. So 12 + 2 = 14 bytes per
parameter with bf16 compute, which is what lets a 7B model with fp32 AdamW fit in 128 GiB.
The shared buffer lives in pinned memory in process, or in a /dev/shm file that a GPU actor on
the same node maps and registers with CUDA.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from megatrain_ray.files import checkpoint
from megatrain_ray.host.memory import element_size, pinned_empty, remove_dead_segments, segment_name, shm_tensor
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.host.adamw_kernel import native_kernel
from megatrain_ray.models.family import ModelFamily
from megatrain_ray.models.layout import LayerLayout
from megatrain_ray.models.registry import family, model_layouts
from megatrain_ray.host.adamw import AdamWStep, adamw_step


def bytes_per_param(compute_dtype: torch.dtype) -> int:
    """Host bytes each parameter costs: master + two moments in fp32, the compute/gradient copy."""
    return 3 * 4 + element_size(compute_dtype)


@dataclass
class LayerState:
    layout: LayerLayout
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    compute: torch.Tensor  # weights the executor reads, then the gradient it writes back
    updates: int = 0  # AdamW updates applied: this layer's bias correction, and what a checkpoint keeps


def init_layer_weights(fam: ModelFamily, layout: LayerLayout, flat: torch.Tensor, seed: int, std: float) -> None:
    """Random init that depends only on (seed, layer), so any split across stores agrees."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + layout.index)
    for p in layout.params:
        fam.init_param(p, flat[p.offset : p.offset + p.numel], gen, std)


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
    ):
        self.arch = arch
        self.compute_dtype = compute_dtype
        self.shm_paths: dict[int, str] = {}
        self.extra_shm_paths: list[str] = []  # state shared with a GPU worker (share_state)
        self._shm_dir = Path(shm_dir) if shm_dir else None
        self._run_id = run_id
        if self._shm_dir is not None:
            files, nbytes = remove_dead_segments(self._shm_dir)
            if files:
                print(f"removed {files} shared-memory segment(s) ({nbytes / 2**30:.2f} GiB) of runs that died "
                      f"without cleaning up, from {self._shm_dir}", flush=True)
        layouts = model_layouts(arch)
        self.layers: dict[int, LayerState] = {i: self._allocate(layouts[i]) for i in layers}
        self.optimizer_seconds = 0.0  # summed over steps, for the benchmark's time split
        native_kernel()  # a first build on this node (tens of seconds) while the run starts, not in its first step

    def _allocate(self, layout: LayerLayout) -> LayerState:
        n = layout.numel
        if self._shm_dir is not None:
            path = self._shm_dir / segment_name(self._run_id, layout.index)
            compute = shm_tensor(path, n, self.compute_dtype, create=True)
            self.shm_paths[layout.index] = str(path)
        else:
            compute = pinned_empty(n, self.compute_dtype)
        return LayerState(
            layout,
            master=torch.empty(n, dtype=torch.float32),
            exp_avg=torch.zeros(n, dtype=torch.float32),
            exp_avg_sq=torch.zeros(n, dtype=torch.float32),
            compute=compute,
        )

    # ---- initial weights -------------------------------------------------------------------
    def init_random(self, seed: int, std: float) -> None:
        for state in self.layers.values():
            init_layer_weights(family(self.arch), state.layout, state.master, seed, std)
            state.compute.copy_(state.master)

    def load_hf(self, model_dir: str) -> None:
        """This store's layers from a Hugging Face directory, tensor by tensor (every tensor checked)."""
        from megatrain_ray.files.hf import load_hf_weights

        load_hf_weights(model_dir, self.arch, lambda i: self.layers[i].master, layers=list(self.layers))
        for state in self.layers.values():
            state.compute.copy_(state.master)

    def master(self, index: int) -> torch.Tensor:
        return self.layers[index].master

    def share_state(self, index: int) -> dict[str, str]:
        """Move the layer's master and moments into shared memory, for a GPU worker on this node that
        steps the layer itself (streaming/device_step.py); their paths by name. The store then only counts
        that layer's updates (`set_update_count`) and saves what the worker wrote back."""
        if self._shm_dir is None:
            raise ValueError("share_state needs the store's shared-memory directory (runtime.shm_dir)")
        state = self.layers[index]
        paths = {}
        for key in ("master", "exp_avg", "exp_avg_sq"):
            path = self._shm_dir / segment_name(self._run_id, index, key)
            if not path.exists():
                shared = shm_tensor(path, state.layout.numel, torch.float32, create=True)
                shared.copy_(getattr(state, key))
                setattr(state, key, shared)
                self.extra_shm_paths.append(str(path))
            paths[key] = str(path)
        return paths

    def set_update_count(self, index: int, count: int) -> None:
        """Updates a GPU worker applied to a layer whose state it steps (`share_state`)."""
        self.layers[index].updates = count

    # ---- the step ----------------------------------------------------------------------------
    def step_layer(self, index: int, hp: AdamWStep | None) -> int:
        """AdamW on one layer from the gradient the executor wrote; publishes new compute weights.

        hp None skips the update (a non-finite step) and only puts the weights back.
        """
        t0 = time.perf_counter()
        state = self.layers[index]
        if hp is None:
            state.compute.copy_(state.master)
            return index
        state.updates += 1
        adamw_step(
            state.master, state.exp_avg, state.exp_avg_sq, state.compute, state.layout.segments(), hp, state.updates
        )
        self.optimizer_seconds += time.perf_counter() - t0
        return index

    # ---- checkpoints ---------------------------------------------------------------------------
    def update_counts(self) -> dict[int, int]:
        """Updates applied to each layer: Adam's bias correction, saved with a checkpoint."""
        return {i: state.updates for i, state in self.layers.items()}

    def state_tensors(self) -> tuple[dict[str, torch.Tensor], dict[int, int]]:
        tensors = {}
        for i, state in self.layers.items():
            for key in checkpoint.STATE_KEYS:
                tensors[checkpoint.tensor_name(i, key)] = getattr(state, key)
        return tensors, self.update_counts()

    def save_shard(self, directory: str, name: str) -> dict:
        """Write this store's layers into a (shared) checkpoint directory."""
        tensors, steps = self.state_tensors()
        return checkpoint.write_shard(Path(directory), name, tensors, steps)

    def load_layers(self, files_by_layer: dict[int, str]) -> None:
        for i, state in self.layers.items():
            if i not in files_by_layer:
                raise checkpoint.CheckpointError(f"the checkpoint has no state for layer {i}")
            tensors, updates = checkpoint.read_layer_state(files_by_layer[i], i)
            for key in checkpoint.STATE_KEYS:
                target = getattr(state, key)
                if tensors[key].shape != target.shape:
                    raise checkpoint.CheckpointError(
                        f"layer {i} {key} has {tensors[key].numel()} elements in the checkpoint but the model "
                        f"needs {target.numel()}: the checkpoint is from another model"
                    )
                target.copy_(tensors[key])
            state.compute.copy_(state.master)
            state.updates = updates

    def close(self) -> None:
        for path in [*self.shm_paths.values(), *self.extra_shm_paths]:
            Path(path).unlink(missing_ok=True)
        self.shm_paths.clear()
        self.extra_shm_paths.clear()

