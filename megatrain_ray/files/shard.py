"""A store's layers to and from files: its checkpoint shard (files/checkpoint.py's format) and a
Hugging Face model directory (files/hf.py). The store (host/store.py) holds the buffers and knows
no file; these functions read and write them, for a store in process or in its Ray actor
(runtime/actors.py)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from megatrain_ray.files import checkpoint
from megatrain_ray.files.hf import check_hf_dir, load_hf_weights
from megatrain_ray.host import disk, precision
from megatrain_ray.host.store import ShardStore


def state_tensors(store: ShardStore) -> tuple[dict[str, torch.Tensor], dict[int, int]]:
    """Every layer's state as a checkpoint names it, and each layer's update count (a layer in the
    disk tier copied out of it: checkpoint.transport=driver holds the whole shard in memory)."""
    tensors = {}
    for i in store.layers:
        tensors.update(layer_tensors(store, i, copy=store.layers[i].on_disk))
    return tensors, store.update_counts()


def layer_tensors(store: ShardStore, index: int, copy: bool = False, linked: frozenset = frozenset()
                  ) -> dict[str, torch.Tensor]:
    """One layer's state as a checkpoint names it (`copy`: copied, as a layer in the disk tier must be
    to outlive its turn in the window), but for the keys of `linked` (in files linked beside the shard:
    `link_tier_files`); a layer whose state on disk is all linked is not read."""
    if linked:
        return {checkpoint.tensor_name(index, key): t for key, t in store.layers[index].tensors().items()
                if key not in linked}
    with store.resident(index, dirty=False) as state:
        return {checkpoint.tensor_name(index, key): t.clone() if copy else t for key, t in state.tensors().items()}


def save_shard(store: ShardStore, directory: str, name: str) -> dict:
    """Write the store's layers into a (shared) checkpoint directory; returns its manifest entry. A
    store with a disk tier hard-links the tier's files beside the shard where the directory is on their
    file system (`link_tier_files`), and writes the rest a layer at a time
    (checkpoint.write_shard_streamed): its state never all in memory at once."""
    directory = Path(directory)
    if store.disk is None:
        tensors, steps = state_tensors(store)
        return checkpoint.write_shard(directory, name, tensors, steps)
    linked = link_tier_files(store, directory, name)
    keys = {i: frozenset(part[0] for f in files for part in f["parts"]) for i, files in linked.items()}
    return checkpoint.write_shard_streamed(
        directory, name, shard_entries(store, keys),
        (lambda i=i: layer_tensors(store, i, linked=keys.get(i, frozenset())) for i in store.layers),
        store.update_counts(), linked)


def link_tier_files(store: ShardStore, directory: Path, name: str) -> dict[int, list[dict]]:
    """Each layer's files of the disk tier that hold checkpoint state (its cold state; a bf16 master's
    compute copy, which is the master), hard-linked into `directory` beside the shard `name`
    (host/disk.py, DiskTier.link: written, on disk, and never written in place again), with the parts
    each holds (checkpoint.LINKED). A layer has all its files linked or none (its state copied into the
    shard then: a layer whose write failed, its state in a buffer only); none has on another file system."""
    if os.stat(directory).st_dev != os.stat(store.disk.directory).st_dev:
        return {}
    out = {}
    for i, state in store.layers.items():
        if not state.on_disk:
            continue
        files = [(store.disk, store.disk.parts[i], "disk", {p.name: p.name for p in store.disk.parts[i]}, None)]
        if state.compute_on_disk and store.format.master == "bf16":  # the master is the copy; its gradient is spent
            parts = store.hot.tier.parts[i]
            grad = next(p.offset for p in parts if p.name == "grad")
            files.append((store.hot, parts, "diskcompute", {"compute": "master"},
                          (grad, disk.file_bytes(parts) - grad)))
        made = []
        for tier, parts, key, names, punch in files:
            target = directory / f"{Path(name).stem}.layer{i}.{key}"
            if not tier.link(i, target, punch):
                break
            made.append({"file": target.name, "parts": [
                [names[p.name], checkpoint.SAFETENSORS_DTYPES[p.dtype], p.numel, p.offset]
                for p in parts if p.name in names]})
        if len(made) == len(files):
            out[i] = made
        else:
            for f in made:
                (directory / f["file"]).unlink()
    return out


def shard_entries(store: ShardStore, linked: dict[int, frozenset] | None = None) -> list[tuple[str, torch.dtype, int]]:
    """Each tensor a store's shard holds, in order: its name, dtype and length (host/disk.py's parts
    say those of a layer in the tier without reading it), but for the keys `linked` says are in files
    beside it."""
    out = []
    for i, state in store.layers.items():
        shapes = {key: (t.dtype, t.numel()) for key, t in state.tensors().items()}
        if state.on_disk:
            shapes.update({p.name: (p.dtype, p.numel) for p in store.disk.parts[i]})
        if state.compute_on_disk and store.format.master == "bf16":  # the master is the copy, in its own file
            shapes["master"] = (store.compute_dtype, state.layout.numel)
        out += [(checkpoint.tensor_name(i, key), dtype, n) for key, (dtype, n) in shapes.items()
                if key not in (linked or {}).get(i, ())]
    return out


def load_layers(store: ShardStore, files_by_layer: dict[int, str]) -> None:
    """Each layer's state as the checkpoint holds it, or converted to the store's narrower format
    (host/precision.py); a wider one is refused (checkpoint.check_state_format says why)."""
    for i in store.layers:
        if i not in files_by_layer:
            raise checkpoint.CheckpointError(f"the checkpoint has no state for layer {i}")
        with store.resident(i) as state:
            load_layer(store, state, files_by_layer[i])


def load_layer(store: ShardStore, state, file: str) -> None:
    """One layer's state from its checkpoint file (load_layers)."""
    i = state.layout.index
    tensors, updates = checkpoint.read_layer_state(file, i)
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
    in_memory = [i for i in layers if not store.layers[i].on_disk
                 or (store.format.master == "bf16" and not store.layers[i].compute_on_disk)]
    if in_memory or not checked:
        load_hf_weights(model_dir, store.arch, store.master, layers=in_memory, threads=torch.get_num_threads(),
                        checked=checked)
    for i in layers:
        if i in in_memory:
            store.publish(store.layers[i])
            continue
        with store.resident(i) as state:  # a master in the disk tier: read into its buffer, then written back
            load_hf_weights(model_dir, store.arch, lambda _: state.master, layers=[i],
                            threads=torch.get_num_threads(), checked=True)
            store.publish(state)


def check_hf(store: ShardStore, model_dir: str) -> None:
    """The directory fits the store's model (files/hf.py, check_hf_dir): before a load a layer at a time."""
    check_hf_dir(Path(model_dir), store.arch)
