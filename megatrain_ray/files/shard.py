"""A store's layers to and from files: its checkpoint shard (files/checkpoint.py's format) and a
Hugging Face model directory (files/hf.py). The store (host/store.py) holds the buffers and knows
no file; these functions read and write them, for a store in process or in its Ray actor
(runtime/actors.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from megatrain_ray.files import checkpoint
from megatrain_ray.files.hf import check_hf_dir, load_hf_weights
from megatrain_ray.host import precision
from megatrain_ray.host.store import ShardStore


def state_tensors(store: ShardStore) -> tuple[dict[str, torch.Tensor], dict[int, int]]:
    """Every layer's state as a checkpoint names it, and each layer's update count."""
    tensors = {}
    for i, state in store.layers.items():
        for key, t in state.tensors().items():
            tensors[checkpoint.tensor_name(i, key)] = t
    return tensors, store.update_counts()


def save_shard(store: ShardStore, directory: str, name: str) -> dict:
    """Write the store's layers into a (shared) checkpoint directory; returns its manifest entry."""
    tensors, steps = state_tensors(store)
    return checkpoint.write_shard(Path(directory), name, tensors, steps)


def load_layers(store: ShardStore, files_by_layer: dict[int, str]) -> None:
    """Each layer's state as the checkpoint holds it, or converted to the store's narrower format
    (host/precision.py); a wider one is refused (checkpoint.check_state_format says why)."""
    for i, state in store.layers.items():
        if i not in files_by_layer:
            raise checkpoint.CheckpointError(f"the checkpoint has no state for layer {i}")
        tensors, updates = checkpoint.read_layer_state(files_by_layer[i], i)
        held = precision.held_format(tensors)
        checkpoint.check_convertible(held, store.format, f"layer {i}")
        if held.moments != store.format.moments:
            tensors.update(precision.convert_moments(*precision.moments_as_fp32(tensors), store.format))
        for key, target in state.tensors().items():
            if key != "master" and tensors[key].shape != target.shape and tensors["master"].shape == state.master.shape:
                raise checkpoint.CheckpointError(
                    f"layer {i}'s optimizer state covers {tensors[key].numel()} of its {state.master.numel()} "
                    f"parameters in the checkpoint and {target.numel()} here: it was saved with another "
                    "model.train_vision (a frozen vision tower has none); resume with the setting it was saved with")
            if tensors[key].shape != target.shape:
                raise checkpoint.CheckpointError(
                    f"layer {i} {key} has {tensors[key].numel()} elements in the checkpoint but the model "
                    f"needs {target.numel()}: the checkpoint is from another model"
                )
            target.copy_(tensors[key])  # an fp32 master into a bf16 one: rounded as the compute copy was
        store.publish(state)
        state.updates = updates
        if state.held is not None:
            state.held.fill_(updates)


def load_hf(store: ShardStore, model_dir: str, layers: list[int] | None = None, checked: bool = False) -> None:
    """The store's layers (or those of `layers`) from a Hugging Face directory, read over the store's
    threads (every tensor checked; `checked`: the directory passed check_hf already)."""
    layers = list(store.layers) if layers is None else layers
    load_hf_weights(model_dir, store.arch, store.master, layers=layers, threads=torch.get_num_threads(),
                    checked=checked)
    for i in layers:
        store.publish(store.layers[i])


def check_hf(store: ShardStore, model_dir: str) -> None:
    """The directory fits the store's model (files/hf.py, check_hf_dir): before a load a layer at a time."""
    check_hf_dir(Path(model_dir), store.arch)
