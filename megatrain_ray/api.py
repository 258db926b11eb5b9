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
    loss, checkpoint, metrics file; a GRPO run's `rewards`, from its first steps to its last).
    `resume`: a checkpoint path or "latest"; `overwrite`: delete
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
    from megatrain_ray.objective import objective_of

    objective_of(config).check()  # before Ray (the step plan asks it the rest)
    if cluster is not None:
        return plan_described(config, cluster, network_gbps, gpu)
    return plan_live(config, gpu)


def plan_described(config: Config, cluster: str | Path, speeds: list[float] | None, gpu: str | None = None) -> PlanResult:
    from megatrain_ray.models.registry import model_arch
    from megatrain_ray.planning.whatif import load_cluster, plan_cluster

    spec = load_cluster(cluster)
    speeds = speeds or sorted({r.network_gbps for r in spec.ram_nodes} | {spec.gpu_node.network_gbps})
    if gpu is not None:  # refused as the live plan refuses it
        from megatrain_ray.runtime.cluster import named_gpu_rates

        named_gpu_rates(gpu)
    text, fits = plan_cluster(model_arch(config.model), config, spec, speeds, gpu)
    print(text)
    return PlanResult(fits, None if fits else text.splitlines()[-1], text)


def driver_facts(arch, config: Config, placement, cluster):
    """What the plan needs of the workers' device where no worker runs: the GPU node's free GPU
    memory and host headroom, read there (`cluster`: runtime/cluster.py's facts), and a model's
    working set measured on this machine's GPU where it has one (planning/step_plan.py:
    measured_working_set, as a worker measures it)."""
    import torch

    from megatrain_ray.planning.step_plan import DeviceFacts, measured_working_set

    headroom = cluster.headroom(placement.gpu.node_id)
    if not placement.use_cuda:
        return DeviceFacts("cpu", "cpu", None, headroom)
    units = measured_working_set(torch.device("cuda"), arch, config) if torch.cuda.is_available() else 0.0
    return DeviceFacts("cuda", "GPU", cluster.gpu_free_bytes(placement.gpu.node_id), headroom, units)


def planned_for_named_gpu(placement, facts, gpu: str, say):
    """Where no GPU is in reach, `--gpu` names the one the plan is for: its workers on the GPU node as
    one GPU worker, its memory the datasheet's less an allowance (planning/rates.py)."""
    import dataclasses

    from megatrain_ray.planning.memory import GiB
    from megatrain_ray.planning.rates import FREE_ALLOWANCE_GIB, named_spec
    from megatrain_ray.planning.step_plan import DeviceFacts

    spec = named_spec(gpu)
    if spec is None:
        return placement, facts  # step_rates refuses it, with the names the table holds
    free = spec.memory_gib - FREE_ALLOWANCE_GIB
    say(f"no GPU here: the step is planned for the {spec.name} that --gpu names, with {free:g} GiB free of its "
        f"{spec.memory_gib:g} GiB (its datasheet's, less {FREE_ALLOWANCE_GIB:g} GiB for the CUDA context and a display: "
        f"an allowance; executor.gpu_memory_gib states what yours has)")
    return (dataclasses.replace(placement, use_cuda=True),
            DeviceFacts("cuda", spec.name, int(free * GiB), facts.host_headroom))


def plan_live(config: Config, gpu: str | None = None) -> PlanResult:
    import ray

    from megatrain_ray.models.registry import model_arch
    from megatrain_ray.planning.memory import PlanError
    from megatrain_ray.planning.prediction import predict_step
    from megatrain_ray.planning.report import describe
    from megatrain_ray.planning.rates import NO_GPU
    from megatrain_ray.planning.scaling import scaling_text
    from megatrain_ray.planning.step_plan import plan_step
    from megatrain_ray.planning.traffic import describe_traffic, step_traffic
    from megatrain_ray.planning.largest import largest_trainable
    from megatrain_ray.runtime.cluster import cluster_facts, step_rates
    from megatrain_ray.runtime.session import largest_models_here, place

    shown: list[str] = []

    def say(text: str) -> None:
        print(text)
        shown.append(text)

    def result(reason: str | None) -> PlanResult:
        say(reason or "fits")
        return PlanResult(reason is None, reason, "\n".join(shown))

    arch = model_arch(config.model)
    joined = ray.is_initialized()
    cluster = cluster_facts(config.runtime)  # Ray's nodes, or this machine without Ray where none is to join
    try:
        try:
            say(largest_models_here(arch, config, cluster))
            placement = place(arch, config, cluster)
            facts = driver_facts(arch, config, placement, cluster)
            if gpu is not None and not placement.use_cuda and config.executor.device != "cpu":
                placement, facts = planned_for_named_gpu(placement, facts, gpu, say)
            if facts.kind == "cuda":
                say(largest_trainable(config, facts, cluster.nodes(config.runtime), cluster.driver_node_id()))
            # the run's own decisions (planning/step_plan.py), from what the driver can see
            step = plan_step(arch, config, facts, placement, stores_allocated=False, refuse=False)
        except ConfigError as e:
            return result(f"does not fit in host memory: {e}")
        except PlanError as e:
            return result(f"does not fit: {e}")
        planned, placement, n = arch, step.placement, step.workers
        traffic = step_traffic(planned, config, placement, step.kept)
        network, optimizer_s = traffic.times(), traffic.optimizer_seconds()
        say(placement.describe(arch))
        rates = step_rates(config, gpu, cluster)
        if placement.remote_layers():
            compute_s = (predict_step(planned, step.planned_config(config), network, optimizer_s, n,
                                              rates=rates).compute_s if rates else None)
            say(describe_traffic(traffic, compute_s))
        say(describe(planned, config, step, network, optimizer_s, rates=rates,
                             no_prediction=None if rates else NO_GPU))
        if rates and step.refused is None:
            say(scaling_text(planned, config, step, network, optimizer_s, rates))
        return result(None if step.refused is None else f"does not fit: {step.refused}")
    finally:
        if not joined and ray.is_initialized():  # leave a cluster the caller had connected to as it was
            ray.shutdown()
