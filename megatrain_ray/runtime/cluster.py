"""The Ray cluster a run uses: joining one (or starting an embedded one) and reading its nodes.

Small remote probes read what only a node itself can say: its free memory, its headroom before
Ray's memory monitor acts, its GPU's free memory. A plan with no cluster to join reads this machine
through the same functions with no Ray at all (ThisMachine), where a run would start an embedded one.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from megatrain_ray.config import Config, ConfigError, RuntimeConfig
from megatrain_ray.host.disk import probe_bytes, free_bytes, probe_disk
from megatrain_ray.host.memory import available_memory, host_headroom
from megatrain_ray.planning.placement import NodeInfo, executor_node


def token_path() -> Path:
    return Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")


def use_token_auth_if_token_available() -> None:
    """Ray's token authentication for a driver that joins a cluster: with RAY_AUTH_MODE unset, a
    token in RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token turns it on. A cluster
    started without authentication then refuses the driver's actors (Ray 2.60: "SchedulingCancelled"):
    RAY_AUTH_MODE=disabled joins one. Ray 2.59 and later turn it on by themselves only for a
    cluster found on the machine, never for one named by address; earlier ones never."""
    if "RAY_AUTH_MODE" in os.environ or not (os.environ.get("RAY_AUTH_TOKEN") or token_path().exists()):
        return
    try:
        from ray._raylet import AuthenticationMode, Config  # noqa: F401 (absent before Ray 2.52)
    except ImportError:
        return
    os.environ["RAY_AUTH_MODE"] = "token"
    Config.initialize("")  # Ray reads its config once; read it again with the mode set


def keep_token_private() -> None:
    """Ray writes the token it generates with the default umask (0644 on most systems); anyone who
    reads it can run code on the cluster."""
    path = token_path()
    try:
        st = path.stat()
        if st.st_uid == os.getuid() and st.st_mode & 0o077:
            path.chmod(0o600)
    except OSError:
        pass


def started_cluster() -> str | None:
    """The cluster `ray start` made on this machine (the address in Ray's temp dir), which a plain
    `ray.init()` joins. Not address='auto': that joins any Ray process it finds running, such as
    another user's embedded one."""
    from ray._private.services import canonicalize_bootstrap_address

    return canonicalize_bootstrap_address(None)


def connect(cfg: RuntimeConfig, say: Callable[[str], None] = lambda text: None) -> None:
    """Join cfg.address, RAY_ADDRESS or the cluster `ray start` made here; else start an embedded
    one (also when the address is `local`: never join whatever runs on the machine), whose session
    directory goes with the process (end_embedded_ray). Token authentication is used whenever a
    token is there (README: Three ways to run). `say` hears which of them it does. The workers'
    lines come without colour codes where the driver's output is not a terminal."""
    if ray.is_initialized():
        return
    if not sys.stdout.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # read by the driver as it prints a worker's line
    try:
        _connect(cfg, {"env_vars": {"PYTHONUNBUFFERED": "1"}}, say)
    finally:
        keep_token_private()


def cluster_to_join(cfg: RuntimeConfig) -> str | None:
    """The address of the cluster `connect` joins: cfg.address, else RAY_ADDRESS, else the cluster
    `ray start` made here; None where it starts an embedded Ray instead (also for the address
    `local`: never join whatever runs on the machine). The one place that decides."""
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    if address:
        return None if address == "local" else address
    return started_cluster()


def embedded_ray_resources(cfg: RuntimeConfig) -> dict:
    """What the embedded Ray is started with: runtime.num_cpus, else all the cores, and its object store."""
    return {"num_cpus": cfg.num_cpus or os.cpu_count(), "object_store_memory": cfg.object_store_memory}


def _connect(cfg: RuntimeConfig, env: dict, say: Callable[[str], None]) -> None:
    address = cluster_to_join(cfg)
    if address is not None and (cfg.address or os.environ.get("RAY_ADDRESS")):
        say(f"joining the Ray cluster at {address}")
        use_token_auth_if_token_available()
        ray.init(address=cfg.address, runtime_env=env, log_to_driver=True)
        return
    if address is not None:
        say(f"joining the Ray cluster that `ray start` made on this machine ({address})")
        use_token_auth_if_token_available()
        ray.init(runtime_env=env)
        return
    resources = embedded_ray_resources(cfg)
    say(f"starting Ray on this machine ({resources['num_cpus']} CPUs)")
    # The embedded Ray's workers inherit this process's environment, so its job needs no runtime
    # env: with one, Ray would leave the workers it starts ahead idle and start the actors in new
    # ones (about 3 CPU-s and 1.5 s more for a tiny run on 2 cores).
    os.environ.update(env["env_vars"])
    ray.init(**resources, include_dashboard=False)
    atexit.register(end_embedded_ray, Path(ray._private.worker._global_node.get_session_dir_path()))


def end_embedded_ray(session: Path) -> None:
    """At the driver's exit (before Ray's own hook, which then has nothing to do): the embedded
    Ray's processes ended, then its session directory (/tmp/ray/session_*: its logs and sockets)
    removed, and Ray's session_latest link where it named it; a run's output is its train.log."""
    ray.shutdown(wait_for_processes=True)
    shutil.rmtree(session, ignore_errors=True)
    latest = session.parent / "session_latest"
    if latest.is_symlink() and Path(os.readlink(latest)) in (session, Path(session.name)):
        latest.unlink(missing_ok=True)


def on_node(node_id: str) -> NodeAffinitySchedulingStrategy:
    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


def alive_node_ids() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def driver_node_id() -> str:
    return ray.get_runtime_context().get_node_id()


# What only a node itself can say, read by the same functions on a node of the cluster (a task
# there) and on this machine where no Ray runs (ThisMachine).

@functools.lru_cache(maxsize=8)
def disk_facts(directory: str) -> tuple[int, float, float]:
    """The disk under runtime.disk_dir on this node: (free bytes, read GB/s, write GB/s), probed once
    per process (host/disk.py, probe_disk: a quarter of a GiB written and read back, less on a disk
    with less than a GiB free)."""
    free = free_bytes(directory)
    read, write = probe_disk(directory, probe_bytes(free))
    return free, read, write


def node_readings(directory: str | None) -> tuple[int, tuple]:
    """This node's free memory and its disk under runtime.disk_dir (disk_facts; three Nones without one)."""
    return available_memory(), (disk_facts(directory) if directory is not None else (None, None, None))


def gpu_free_bytes_here() -> int:
    return torch.cuda.mem_get_info()[0]


def gpu_name_here() -> str:
    return torch.cuda.get_device_name()


def gpu_probe_here() -> tuple[str, float, float]:
    from megatrain_ray.planning.rates import probe_gpu

    return probe_gpu()


_node_readings = ray.remote(num_cpus=0)(node_readings)
_host_headroom = ray.remote(num_cpus=0)(host_headroom)
_gpu_free_bytes = ray.remote(num_cpus=0, num_gpus=1)(gpu_free_bytes_here)
_gpu_name = ray.remote(num_cpus=0, num_gpus=1)(gpu_name_here)
_probe_gpu = ray.remote(num_cpus=0, num_gpus=1)(gpu_probe_here)


@ray.remote(num_cpus=0)
def free_port() -> int:
    """A TCP port free on the node this runs on (schedule it there): the GPU workers' rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def node_info(node_id: str, ip: str, resources: Mapping[str, float], cfg: RuntimeConfig, readings: tuple) -> NodeInfo:
    """A node as the plan sees it: the resources Ray counts there and the node's own readings (node_readings)."""
    free, disk = readings
    return NodeInfo(node_id, ip, float(resources.get("GPU", 0.0)), resources.get(cfg.ram_resource, 0.0) > 0, free,
                    cpus=float(resources.get("CPU", 0.0)), disk_bytes=disk[0], disk_read_gbs=disk[1],
                    disk_write_gbs=disk[2])


def discover_nodes(cfg: RuntimeConfig) -> list[NodeInfo]:
    alive = [n for n in ray.nodes() if n["Alive"]]
    readings = read_nodes([n["NodeID"] for n in alive], cfg.disk_dir)
    return [node_info(n["NodeID"], n["NodeManagerAddress"], n["Resources"], cfg, r) for n, r in zip(alive, readings)]


def read_nodes(node_ids: list[str], directory: str | None) -> list[tuple]:
    """Each node's readings (node_readings), taken on that node; the driver's own node's here: a task
    there would first wait for a worker process to start (about 2 s of every run's start-up)."""
    here = driver_node_id()
    refs = {n: _node_readings.options(scheduling_strategy=on_node(n)).remote(directory) for n in node_ids if n != here}
    return [node_readings(directory) if n == here else ray.get(refs[n]) for n in node_ids]


def node_headroom(node_id: str) -> int:
    """What the node can still give before Ray's memory monitor steps in (host/memory.py), read there."""
    return ray.get(_host_headroom.options(scheduling_strategy=on_node(node_id)).remote())


def gpu_free_bytes(node_id: str) -> int:
    return ray.get(_gpu_free_bytes.options(scheduling_strategy=on_node(node_id)).remote())


def gpu_rates(node_id: str):
    """The step-time rates of the GPU node's GPU model (planning/rates.py: the table's, else probed there)."""
    from megatrain_ray.planning.rates import rates_for_gpu

    where = on_node(node_id)
    name = ray.get(_gpu_name.options(scheduling_strategy=where).remote())
    return rates_for_gpu(name, probe=lambda: ray.get(_probe_gpu.options(scheduling_strategy=where).remote()))


class RayNodes:
    """The facts a plan reads of the cluster Ray is connected to, each read on its node."""

    def nodes(self, cfg: RuntimeConfig) -> list[NodeInfo]:
        return discover_nodes(cfg)

    def driver_node_id(self) -> str:
        return driver_node_id()

    def headroom(self, node_id: str) -> int:
        return node_headroom(node_id)

    def gpu_free_bytes(self, node_id: str) -> int:
        return gpu_free_bytes(node_id)

    def gpu_rates(self, node_id: str):
        return gpu_rates(node_id)


@dataclass(frozen=True)
class ThisMachine:
    """The same facts of this machine, read here with no Ray started, as the embedded Ray that
    `connect` would start here would give them (this_machine): one node, the driver's, every
    reading taken by the function a task on a node of a cluster runs."""

    node_id: str
    ip: str
    resources: Mapping[str, float]

    def nodes(self, cfg: RuntimeConfig) -> list[NodeInfo]:
        return [node_info(self.node_id, self.ip, self.resources, cfg, node_readings(cfg.disk_dir))]

    def driver_node_id(self) -> str:
        return self.node_id

    def headroom(self, node_id: str) -> int:
        return host_headroom()

    def gpu_free_bytes(self, node_id: str) -> int:
        return gpu_free_bytes_here()

    def gpu_rates(self, node_id: str):
        from megatrain_ray.planning.rates import rates_for_gpu

        return rates_for_gpu(gpu_name_here(), probe=gpu_probe_here)


NodeFacts = RayNodes | ThisMachine


def this_machine(cfg: RuntimeConfig) -> ThisMachine:
    """This machine as the embedded Ray would count it: its resources resolved by Ray's own code from
    the settings `connect` starts it with (the GPUs Ray finds, CUDA_VISIBLE_DEVICES and
    RAY_OVERRIDE_RESOURCES heeded), its address as Ray finds it, and a fresh node id, as that Ray's is."""
    from ray._private.resource_and_label_spec import ResourceAndLabelSpec

    ip = ray.util.get_node_ip_address()
    spec = ResourceAndLabelSpec(**embedded_ray_resources(cfg)).resolve(is_head=True, node_ip_address=ip)
    return ThisMachine(ray.NodeID.from_random().hex(), ip, spec.to_resource_dict())


def cluster_facts(cfg: RuntimeConfig) -> NodeFacts:
    """Where a plan reads the cluster: Ray's nodes where this process is connected or `connect`
    would join a cluster (joined here), else this machine read directly, where `connect` would
    start an embedded Ray only for the plan to read this machine through it (seconds of processes)."""
    if ray.is_initialized() or cluster_to_join(cfg) is not None:
        connect(cfg)
        return RayNodes()
    return this_machine(cfg)


def named_gpu_rates(gpu: str):
    """The rates table's rates of the GPU model `gpu` (`--gpu`); a ConfigError naming the table's models
    where it holds no such model."""
    from megatrain_ray.planning.rates import named_rates, table_keys

    rates = named_rates(gpu)
    if rates is None:
        raise ConfigError(f"--gpu {gpu}: the rates table holds {table_keys()} (any case; spaces and dashes "
                          f"ignored); leave --gpu out to use the cluster's own GPU")
    return rates


def step_rates(config: Config, gpu: str | None, cluster: NodeFacts):
    """The rates that predict a step's time (planning/rates.py): the rates table's model `gpu` where
    named, else those of the GPU the workers will run on; None where they run on the CPU."""
    if gpu is not None:
        return named_gpu_rates(gpu)
    nodes = cluster.nodes(config.runtime)
    if config.executor.device == "cpu" or not any(n.gpus >= 1 for n in nodes):
        return None
    return cluster.gpu_rates(executor_node(nodes, True, cluster.driver_node_id(), config.runtime.num_gpus).node_id)
