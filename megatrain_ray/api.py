"""The Python entry points, for a notebook or a script: the CLI's `train` and `plan`, same checks.

    import megatrain_ray
    summary = megatrain_ray.train("examples/finetune-sft.yaml", train={"steps": 100}, optim={"lr": 1e-5})
    megatrain_ray.plan("examples/tiny.yaml", model={"preset": "qwen2.5-7b"})

A config is a YAML path, a mapping with the YAML's sections, or a `Config`; overrides are sections
given as keyword mappings (merged key by key into the config's) or `--set`-style strings
(`sets=["train.steps=100"]`). Mistakes raise what the CLI reports with exit status 2
(ConfigError, DataError, CheckpointError, PlanError); a run that stops raises RunStopped.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from megatrain_ray.config import Config, ConfigError, apply_overrides, config_from_dict, read_config_file


def merged(raw: Mapping[str, Any], sections: Mapping[str, Any]) -> dict[str, Any]:
    """`sections` merged into `raw` one key deep: model={"path": ...} changes model.path only."""
    out = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in raw.items()}
    for name, values in sections.items():
        if not isinstance(values, Mapping):
            raise ConfigError(f"override {name}= must be a mapping of {name}'s keys, e.g. "
                              f"{name}={{...}}; got {values!r}")
        out[name] = {**(out.get(name) or {}), **values}
    return out


def to_config(config: str | Path | Mapping[str, Any] | Config, sets: Iterable[str] = (),
              **sections: Mapping[str, Any]) -> Config:
    """Any accepted form of a config plus overrides, validated as the CLI validates its YAML."""
    if isinstance(config, (str, Path)):
        base = read_config_file(config)
    elif isinstance(config, Config):
        base = dataclasses.asdict(config)
    elif isinstance(config, Mapping):
        base = dict(config)
    else:
        raise ConfigError(f"a config is a YAML path, a mapping or a Config, got {type(config).__name__}")
    return config_from_dict(apply_overrides(merged(base, sections), list(sets)))


def prepare(config: Config) -> Config:
    """What a run needs settled before it starts: Hub names as local paths (run_training checks the
    rest before it joins the cluster)."""
    from megatrain_ray.files.hub import resolve_names

    return resolve_names(config)


def train(config: str | Path | Mapping[str, Any] | Config, *, resume: str | None = None,
          auto_resume: bool | None = None, overwrite: bool = False, sets: Iterable[str] = (),
          **sections: Mapping[str, Any]) -> dict[str, Any]:
    """Train as `megatrain-ray train` does; returns the run's summary (final loss, last validation
    loss, checkpoint, metrics file). `resume`: a checkpoint path or "latest"; `overwrite`: delete
    an earlier run in the output directory first (else such a directory is refused)."""
    from megatrain_ray.runtime.training import run_training

    return run_training(prepare(to_config(config, sets, **sections)), resume=resume, auto_resume=auto_resume,
                        overwrite=overwrite)


@dataclass(frozen=True)
class PlanResult:
    """What `plan` found: whether the run fits, why not where it does not (the plan's own refusal),
    and the plan as printed. True when the run fits."""

    fits: bool
    reason: str | None
    text: str

    def __bool__(self) -> bool:
        return self.fits


def plan(config: str | Path | Mapping[str, Any] | Config, *, sets: Iterable[str] = (), cluster: str | Path | None = None,
         network_gbps: list[float] | None = None, gpu: str | None = None, **sections: Mapping[str, Any]) -> PlanResult:
    """Read the cluster and the model and print where memory goes, as `megatrain-ray plan` does;
    a PlanResult, true when the run fits, with the reason when it does not. With `cluster` (a
    description, see examples/cluster-4x512.yaml) plan for that cluster instead, without Ray, at
    each link speed of `network_gbps`. Step times use the rates of the cluster's GPU
    (planning/rates.py), or of `gpu`, a model of the rates table."""
    config = prepare(to_config(config, sets, **sections))
    if cluster is not None:
        return plan_described(config, cluster, network_gbps)
    return plan_live(config, gpu)


def plan_described(config: Config, cluster: str | Path, speeds: list[float] | None) -> PlanResult:
    from megatrain_ray.models.registry import model_arch
    from megatrain_ray.planning.whatif import load_cluster, plan_cluster

    spec = load_cluster(cluster)
    speeds = speeds or sorted({r.network_gbps for r in spec.ram_nodes} | {spec.gpu_node.network_gbps})
    text, fits = plan_cluster(model_arch(config.model), config, spec, speeds)
    print(text)
    return PlanResult(fits, None if fits else text.splitlines()[-1], text)


def measured(arch, config: Config, say=print):
    """A model run through transformers' modules with its layers' working set measured on this
    machine's GPU (planning/probe.py) where it has one; the plan prints which figures it used."""
    from megatrain_ray.models.generic import TransformersArch

    if not isinstance(arch, TransformersArch):
        return arch
    import torch

    from megatrain_ray.planning.probe import with_measured_working_set

    if not torch.cuda.is_available():
        say("working set: an estimate (the Llama family's fit); no GPU here to measure this model's layers on")
        return arch
    dtype = getattr(torch, config.model.compute_dtype)
    arch, text = with_measured_working_set(arch, config.train.micro_batch_size, config.data.seq_len, dtype,
                                           torch.device("cuda"))
    say(text)
    return arch


def step_rates(placement, gpu: str | None):
    """(rates, None), or (None, why no step time is predicted): the named table model's rates, else
    the cluster's GPU's, else none."""
    from megatrain_ray.planning.rates import NO_GPU, TABLE
    from megatrain_ray.runtime.cluster import gpu_rates

    if gpu is not None:
        if gpu not in TABLE:
            raise ConfigError(f"--gpu {gpu}: the rates table holds {', '.join(TABLE)}")
        return TABLE[gpu], None
    if placement.use_cuda:
        return gpu_rates(placement.gpu.node_id), None
    return None, NO_GPU


def plan_live(config: Config, gpu: str | None = None) -> PlanResult:
    import ray

    from megatrain_ray.planning import plan as planner
    from megatrain_ray.planning.step_plan import DeviceFacts, embedding_step_decided, plan_step
    from megatrain_ray.runtime.cluster import connect, gpu_free_bytes, gpu_node_headroom
    from megatrain_ray.models.registry import model_arch
    from megatrain_ray.runtime.session import largest_models_here, place
    from megatrain_ray.planning.traffic import describe_traffic, step_traffic

    shown: list[str] = []

    def say(text: str) -> None:
        print(text)
        shown.append(text)

    def result(reason: str | None) -> PlanResult:
        say(reason or "fits")
        return PlanResult(reason is None, reason, "\n".join(shown))

    arch = measured(model_arch(config.model), config, say)
    joined = ray.is_initialized()
    connect(config.runtime)
    try:
        try:
            say(largest_models_here(arch, config))
            placement = place(arch, config)
        except ConfigError as e:
            return result(f"does not fit in host memory: {e}")
        free = gpu_free_bytes(placement.gpu.node_id) if placement.use_cuda else None
        n = placement.num_gpus
        try:  # the run's own decisions (planning/step_plan.py), from what the driver can see
            facts = DeviceFacts("cuda", "the GPU", free, 0) if free is not None else DeviceFacts("cpu", "cpu", None, 0)
            step = plan_step(arch, config, facts, gpu_node_headroom(placement), n, 0 not in placement.remote_layers())
            refused = None
        except planner.PlanError as e:
            step, refused = None, e
        if step is not None:
            config = embedding_step_decided(config, step.embedding_on_device)
        kept = step.kept if step is not None else planner.choose_kept(arch, config, free, n)
        traffic = step_traffic(arch, config, placement, kept)
        network, optimizer_s = traffic.times(), traffic.optimizer_seconds()
        say(placement.describe(arch))
        rates, no_prediction = step_rates(placement, gpu)
        if placement.remote_layers():
            compute_s = planner.predict_step(arch, config, network, optimizer_s, n, rates=rates).compute_s if rates else None
            say(describe_traffic(traffic, compute_s))
        say(planner.describe(arch, config, free, network, optimizer_s, n, kept, rates=rates,
                              no_prediction=no_prediction))
        return result(None if refused is None else f"does not fit: {refused}")
    finally:
        if not joined:  # leave a cluster the caller had connected to as it was
            ray.shutdown()
