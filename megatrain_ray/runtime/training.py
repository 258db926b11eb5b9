"""The training loop on the driver: batches in, metrics out, checkpoints when due, faults caught.

Data path: the dataset yields a step's micro-batches (small int arrays) -> the GPU actor streams
the layers through them and sends each layer's gradient to its store -> the stores step their
layers -> the driver logs the step's metrics and, when due, asks every store for its shard.

Faults: every wait on the cluster goes through a Watchdog (runtime/watchdog.py) that also watches the
nodes the run uses, so a lost RAM node stops the run within seconds with a message naming it and
the last good checkpoint. With auto-resume the driver then waits for the cluster to have room
again, places a new session and continues from that checkpoint: resumption is exact, so the
result is the same as an uninterrupted run's.
"""

from __future__ import annotations

import errno
import json
import os
import random
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatrain_ray.files import checkpoint as ckpt
from megatrain_ray.host.disk import LayerLost
from megatrain_ray.runtime.cluster import RayNodes, alive_node_ids, connect
from megatrain_ray.config import Config, ConfigError
from megatrain_ray.data.bad_rows import BadRowCount
from megatrain_ray.data.documents import DataError
from megatrain_ray.streaming.step_result import EvalResult
from megatrain_ray.runtime.metrics import MetricsLog
from megatrain_ray.runtime.job_paths import for_this_run, in_job_copy, resume_moved, where
from megatrain_ray.runtime.output_dir import FileSystemError, claim, describe_os_error
from megatrain_ray.runtime.progress import StartupPhases
from megatrain_ray.runtime.run_log import LOG_NAME, RunLog, run_output
from megatrain_ray.runtime.signals import RunInterrupted, StopRequest, hangup_kept_from_children
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.registry import family, model_arch, num_params
from megatrain_ray.objective import objective_of
from megatrain_ray.planning.placement import Placement
from megatrain_ray.runtime.session import Session, StoresNotAtStep, place
from megatrain_ray.runtime.trackers import check_trackers, open_trackers
from megatrain_ray.runtime.watchdog import FAULTS, ClusterFault, RunStopped, Watchdog


class TrainingDiverged(RunStopped):
    """Too many steps in a row had a non-finite loss or gradient."""


STOPS_THAT_KEEP_THE_STEPS = (DataError, TrainingDiverged)  # the stores still hold the last finished step


def keep_finished_steps(error: Exception, session: Session, step: int, position, progress: Progress,
                        saved: int | None) -> None:
    """A run that stops mid-way (bad data, a diverging loss) first writes the checkpoint of its last
    finished step, as a signal's stop does (unless that step's checkpoint exists); the error then
    names it, and carries it as `checkpoint` for the CLI's resume command."""
    if step != saved and step > 0:
        progress.checkpoint = session.save_checkpoint(step, position.to_dict() if position else None)
    checkpoint = progress.checkpoint
    kept = (f"checkpoint of step {step}: {checkpoint}" if checkpoint is not None
            else "it stopped before its first step; nothing to save")
    error.args = (f"{error}. The run stopped after step {step}; {kept}",)
    error.checkpoint = checkpoint


def keep_steps_after_fault(fault: ClusterFault, session: Session, step: int, position, progress: Progress,
                           saved: int | None) -> None:
    """A GPU worker that died or hung (or its node) leaves the last finished step's state in the
    stores, where each layer's update count says so: that checkpoint is written from the stores
    (runtime/session.py, save_from_stores) and named in the fault, whose `checkpoint` the CLI's
    resume command uses; where they do not hold it, the fault says why, and the run's last
    checkpoint (train_with_restarts names it) is where it continues."""
    if step != saved and step > 0:
        try:
            progress.checkpoint = session.save_from_stores(step, position.to_dict() if position else None,
                                                           fault.nodes)
            kept = f"checkpoint of step {step}, the last finished step, from the stores: {progress.checkpoint}"
        except Exception as why:  # StoresNotAtStep, or a store lost too: the fault still comes first
            kept = f"no checkpoint of step {step}, the last finished step: {str(why).strip().splitlines()[0]}"
        fault.args = (f"{fault}; {kept}",)


class DiskFull(FileSystemError):
    """A file system of the run filled mid-run (the disk tier's, the checkpoints'); the message says
    which checkpoint the run stopped with, and `checkpoint` is where a resume continues."""


def causes(error: BaseException | None):
    """`error` and the errors behind it (a store's comes through Ray's wrappers)."""
    while error is not None:
        yield error
        error = getattr(error, "cause", None) or error.__cause__


def no_room(error: BaseException | None) -> OSError | None:
    """The file system's "no room" error behind `error`, or None."""
    return next((e for e in causes(error) if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)), None)


def lost_layer(error: BaseException | None) -> LayerLost | None:
    """The disk tier's error for a layer whose state is gone (host/disk.py, DiskTier.lost) behind `error`, or None."""
    return next((e for e in causes(error) if isinstance(e, LayerLost)), None)


def keep_steps_on_full_disk(full: OSError, session: Session, finished: list[tuple[int, Any, int]],
                            progress: Progress, saved: int | None, while_saving: int | None) -> DiskFull:
    """A disk that filled mid-run: the checkpoint of the last finished step the stores hold whole, if
    there is room for it (a disk-tier write that failed stops the stores before the next step's first
    update, host/store.py `settle_disk`, so they hold the step before the one whose updates it
    refused: `finished` has the last two, each with its data position and update count), else the
    last complete checkpoint, named in the error. A checkpoint that itself found no room is not tried
    again (its staging directory is gone: session.save_checkpoint). A layer whose state the tier lost
    (a write that failed after its buffer was taken) leaves no step to save from the stores: the error
    says which layer and file, and names the last complete checkpoint."""
    kept, why, lost = None, None, lost_layer(full)
    for step, position, updates in reversed(finished):
        if step == saved:
            kept = progress.checkpoint
            break
        if lost is not None:
            break
        if step == while_saving or step == 0:
            if step == while_saving:
                why = f"no room for the checkpoint of step {step}"
            break  # step 0: nothing to save, and why the step after it could not be saved stands
        try:
            kept = progress.checkpoint = session.save_from_stores(step, position.to_dict() if position else None,
                                                                  updates_done=updates)
            break
        except StoresNotAtStep as e:
            why = f"the stores do not hold step {step} whole ({e})"
        except Exception as e:
            if no_room(e) is None:
                raise
            lost = lost_layer(e)
            why = f"no room for the checkpoint of step {step} either ({describe_os_error(no_room(e))})"
            break
    if lost is not None and kept is None and step > 0:
        why = f"no checkpoint of step {step} can be written: that layer's state could not be kept"
    if kept is not None:
        stopped = f"The run stopped with the checkpoint of step {step}: {kept}"
    else:
        last = progress.checkpoint
        stopped = (f"The run stopped without a new checkpoint ({why or 'nothing finished to save'}); "
                   + (f"its last complete checkpoint is {last}" if last else "it has no checkpoint"))
    what = describe_os_error(full)
    if lost is not None:  # the layer whose state is gone first, found by the step or by the checkpoint after it
        what = describe_os_error(lost) if lost_layer(full) is not None else f"{what}; then {describe_os_error(lost)}"
    error = DiskFull(f"the disk filled mid-run: {what}. {stopped}, to resume from once there "
                     "is room (runtime.disk_dir's and checkpoint.dir's disks)")
    error.checkpoint = kept or progress.checkpoint
    return error


def under_ray_job() -> bool:
    """`ray job submit` starts the entrypoint with the job's config (holding its submission id) in this
    variable; a plain `python`/`megatrain-ray` driver has no such thing."""
    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not raw:
        return False
    try:
        return "job_submission_id" in (json.loads(raw).get("metadata") or {})
    except (ValueError, AttributeError):
        return False


def auto_resume_enabled(config: Config, flag: bool | None) -> bool:
    """The --auto-resume/--no-auto-resume flag, else train.auto_resume, else on under `ray job submit`."""
    if flag is not None:
        return flag
    if config.train.auto_resume is not None:
        return config.train.auto_resume
    return under_ray_job()


@dataclass
class Progress:
    """What survives a lost session: the checkpoint to come back to and where to place the next one."""

    checkpoint: Path | None
    placement: Placement | None = None
    data_summary: dict | None = None  # data/summary.py's counts, for metrics.jsonl
    schedule_steps: int | None = None  # a resumed run's LR schedule length (None: the objective's)
    phase: StartupPhases = field(default_factory=StartupPhases)  # says what the start-up is doing


def wait_for_room(arch: ModelArch, config: Config, lost: tuple[str, ...]) -> Placement:
    """Poll until the lost nodes are marked dead and the living ones can hold the model, up to
    train.resume_wait_s; the placement plan is the judge of 'room'."""
    deadline = time.monotonic() + config.train.resume_wait_s
    reason = "the lost node is not yet marked dead"
    while True:
        if not set(lost) & alive_node_ids():
            try:
                return place(arch, config, RayNodes())
            except ConfigError as e:
                reason = str(e)
        if time.monotonic() > deadline:
            raise ClusterFault(f"auto-resume gave up after train.resume_wait_s={config.train.resume_wait_s:g} s: {reason}")
        time.sleep(1.0)


def run_training(config: Config, resume: str | None = None, auto_resume: bool | None = None,
                 until_step: int | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Train as the config says; returns a summary (final loss, checkpoint path, metrics path).
    What it prints goes to its output directory's train.log too (runtime/run_log.py)."""
    with run_output() as log:
        return train_logged(config, resume, auto_resume, until_step, overwrite, log)


def train_logged(config: Config, resume: str | None, auto_resume: bool | None, until_step: int | None,
                 overwrite: bool, log: RunLog) -> dict[str, Any]:
    """run_training's work, printing into `log`, which it attaches to the output directory's train.log.

    `until_step` stops (with a checkpoint) before train.steps, without changing the LR schedule:
    the run continues later with --resume exactly as if it had not stopped.

    Everything that can be checked without the cluster (model, data, the checkpoint to resume,
    the output directory: runtime/output_dir.py) is checked first, so a mistake costs seconds, not
    a cluster start. SIGINT and SIGTERM stop it at a step boundary (runtime/signals.py).
    """
    in_job = under_ray_job() or in_job_copy(Path.cwd())  # outputs outside Ray's copy of the working dir
    config, resume = for_this_run(config, in_job), resume_moved(resume, in_job)
    arch = model_arch(config.model)
    objective = objective_of(config).check()
    counted, data = objective.read_data(arch)  # a DataError before Ray; the validation batches too
    check_trackers(config.metrics)
    resume_path = ckpt.resolve(resume, ckpt.checkpoint_root(config)) if resume else None
    horizon = None  # the LR schedule's length, where a resume keeps its checkpoint's
    if resume_path is not None:  # the one verification of its files (hashes) in this run
        manifest, meta = ckpt.read_manifest(resume_path)
        ckpt.check_compatible(meta, arch, resume_path, manifest)
        ckpt.check_state_format(meta, config, resume_path)
        last_step = config.train.steps if until_step is None else min(config.train.steps, until_step)
        if meta["step"] >= last_step:
            return finished_already(config, resume_path, meta["step"], last_step)
        horizon, schedule = ckpt.schedule_on_resume(config, meta, objective.schedule_steps)
        if schedule:
            print(schedule, flush=True)
    out = claim(config, resume, overwrite, arch)
    log.attach(out / LOG_NAME)
    print(f"output directory: {where(out)}", flush=True)
    seed_driver(config.train.seed)
    progress = Progress(resume_path, data_summary=counted, schedule_steps=horizon)
    with StopRequest() as stop:
        with hangup_kept_from_children():  # an embedded Ray's processes outlive a closing terminal
            connect(config.runtime, progress.phase)
        stop.install()  # ray.init sets its own SIGTERM handler
        summary = train_with_restarts(config, arch, data, progress, out, auto_resume, until_step, stop)
    print(f"outputs in {where(out)}", flush=True)
    return summary


def finished_already(config: Config, checkpoint: Path, step: int, last_step: int) -> dict[str, Any]:
    """--resume of a run that has trained all its steps: say so, write nothing."""
    print(f"the run in {config.train.output_dir} is finished: {checkpoint} is step {step} of {last_step}; "
          f"nothing to train (to train further, raise train.steps, e.g. --set train.steps={2 * last_step})", flush=True)
    return {"final_loss": None, "eval_loss": None, "checkpoint": str(checkpoint),
            "metrics": str(Path(config.train.output_dir) / "metrics.jsonl"), "finished_already": True}


def train_with_restarts(config: Config, arch: ModelArch, data: tuple, progress: Progress, out: Path,
                        auto_resume: bool | None, until_step: int | None, stop: StopRequest) -> dict[str, Any]:
    """Sessions one after another: after a lost node, with auto-resume, from the last checkpoint."""
    auto = auto_resume_enabled(config, auto_resume)
    restarts = 0
    while True:
        try:
            return train_session(config, arch, data, progress, out, until_step, stop)
        except ClusterFault as fault:
            last = progress.checkpoint
            where = f"last good checkpoint: {last}" if last else "no checkpoint yet (a restart begins at step 0)"
            if not auto or restarts >= config.train.max_restarts:
                hint = (f"continue with `megatrain-ray train CONFIG --resume {last}`" if last else "start the run again")
                why = "" if not auto else f" (after {restarts} auto-resume(s), train.max_restarts={config.train.max_restarts})"
                more = "" if auto else ", or pass --auto-resume to wait for the cluster and continue"
                stopped = ClusterFault(f"{fault}; stopped{why}; {where}; {hint}{more}", fault.nodes)
                stopped.checkpoint = last  # the CLI prints the command that continues from it
                raise stopped from None
            restarts += 1
            print(f"{fault}; {where}; auto-resume {restarts}/{config.train.max_restarts}: waiting up to "
                  f"{config.train.resume_wait_s:g} s for the cluster to have room", flush=True)
            progress.placement = wait_for_room(arch, config, fault.nodes)


def seed_driver(seed: int) -> None:
    """The driver's generators start from train.seed (a resume then restores their checkpointed state)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def train_session(config: Config, arch: ModelArch, data: tuple, progress: Progress, out: Path,
                  until_step: int | None = None, stop: StopRequest | None = None) -> dict[str, Any]:
    """Place stores and the executor, load the starting state, run the loop; always releases the actors."""
    say = progress.phase
    say("reading the cluster's nodes and placing the model")
    placement = progress.placement or place(arch, config, RayNodes())
    progress.placement = None
    watch = Watchdog(placement, config.train.step_timeout_s)
    say(f"starting {len(placement.stores)} store(s)" + ("" if host_kernel_built() else
        " (they build the host AdamW kernel meanwhile: once per machine, 1-2 minutes on a small one, "
        "which the first step waits for if the rest of the start is shorter)"))
    try:
        session = Session(config, arch, placement=placement, wait=watch.get, schedule_steps=progress.schedule_steps)
    except FAULTS as e:  # a node left between the plan and the actors' start
        raise ClusterFault(f"placing the run's actors failed: {str(e).strip().splitlines()[0]}") from None
    print(session.placement.describe(arch), flush=True)  # with the window the step plan sized
    if family(arch).carried_note(arch):
        print(family(arch).carried_note(arch), flush=True)
    meta = None
    try:
        if progress.checkpoint is not None:
            say(f"loading {checkpoint_gb(progress.checkpoint):.1f} GB of weights and optimizer state from "
                f"{progress.checkpoint}")
            # run_training verified it, or this run wrote it; the stores load while the workers build
            meta = session.restore(progress.checkpoint, verify=False, wait=False)
            print(f"resumed from {progress.checkpoint} at step {meta['step']}", flush=True)
        else:
            gb = num_params(arch) * 4 / 1e9
            say(f"loading {gb:.1f} GB of weights (fp32) from {config.model.path}" if config.model.path
                else f"initialising {gb:.1f} GB of weights (fp32, random)")
            session.init_weights(wait=False)  # the stores fill their layers while the workers build
        say("starting the executor")
        print(f"executor device: {session.start_executor()}", flush=True)
        if session.plan.compile:
            say("the first step compiles the decoder blocks (torch.compile): it takes longer than the others")
        return _loop(session, config, data, meta, progress, out, until_step, stop)
    finally:
        release(session, stop)


def release(session: Session, stop: StopRequest | None) -> None:
    """Close the session's actors; a signal meanwhile waits (runtime/signals.py): an interrupted
    close would leave their shared memory behind."""
    with stop.held() if stop is not None else nullcontext():
        session.close()


def host_kernel_built() -> bool:
    """Whether this machine's cache holds the host AdamW kernel's build (a store on another machine may not)."""
    from megatrain_ray.host.adamw_kernel import _build_name, _cache_dir

    return (_cache_dir() / f"{_build_name()}.so").exists()


def checkpoint_gb(path: Path) -> float:
    manifest, _ = ckpt.read_manifest(path, verify=False)
    return sum(s["bytes"] for s in manifest["shards"]) / 1e9


def validate(session: Session, batches: list[dict], group: int, step: int) -> EvalResult:
    """The mean loss over the validation batches, streamed `group` micro-batches at a time (the
    training step's shape, which is known to fit)."""
    parts = [session.eval_loss(batches[i:i + group], f"validation after step {step}")
             for i in range(0, len(batches), group)]
    return EvalResult(sum(p.loss_sum for p in parts), sum(p.target_tokens for p in parts),
                      sum(p.tokens for p in parts), sum(p.seconds for p in parts))


def _loop(session: Session, config: Config, data: tuple, meta: dict | None, progress: Progress, out: Path,
          until_step: int | None = None, stop: StopRequest | None = None) -> dict[str, Any]:
    t = config.train
    dataset, eval_batches = data  # Objective.read_data: a pure function of the config, reread from any position
    start_step = meta["step"] if meta else 0
    log = MetricsLog(out / "metrics.jsonl", t.steps, open_trackers(config.metrics, out, config.to_dict()), start_step,
                     progress.data_summary)
    bad_in_a_row, last, position, step, evaluation = 0, None, None, start_step, None
    counted_whole = (progress.data_summary or {}).get("train", {}).get("complete", False)
    bad_rows = BadRowCount(None if counted_whole else config.data.max_bad_fraction)  # the summary judged a whole source
    steps = objective_of(config).steps(session, dataset, meta, bad_rows)
    finished = start_step  # the last step whose update the stores hold, and the data position after it
    saved = start_step if progress.checkpoint is not None else None
    history = [(start_step, None, session.updates_done)]  # the last two finished steps: step, position, updates
    while_saving = None  # the step whose checkpoint is being written

    def save(step: int, position) -> Path:
        nonlocal while_saving
        while_saving = step
        path = session.save_checkpoint(step, position.to_dict() if position else None)
        while_saving = None
        return path
    try:
        last_step = t.steps if until_step is None else min(t.steps, until_step)
        if stop is not None and stop.requested:  # during the start-up: nothing new to save
            raise RunInterrupted(stop.signum, start_step, progress.checkpoint)
        for step in range(start_step + 1, last_step + 1):
            last, upcoming, extra = steps(step)
            finished, position = step, upcoming  # `position`: the data position after step `finished`
            history = [*history[-1:], (step, position, session.updates_done)]
            due = eval_batches is not None and (step == last_step or (config.eval.every and step % config.eval.every == 0))
            if due:
                evaluation = validate(session, eval_batches, t.grad_accum, step)
            log.step(step, last, evaluation if due else None, bad_rows.by_reason, extra)
            bad_in_a_row = 0 if last.finite else bad_in_a_row + 1
            if not last.finite:
                print(f"warning: step {step} had a non-finite loss or gradient (loss {last.loss}, grad_norm "
                      f"{last.grad_norm}); its update was skipped, the weights are unchanged", file=sys.stderr, flush=True)
            if bad_in_a_row >= t.max_bad_steps:
                raise TrainingDiverged(
                    f"{bad_in_a_row} steps in a row had a non-finite loss or gradient (last: step {step}, "
                    f"train.max_bad_steps={t.max_bad_steps}); stopping. Lower optim.lr or model.init_std, or check "
                    f"the data"
                )
            if config.checkpoint.every and step % config.checkpoint.every == 0 and step < last_step:
                progress.checkpoint, saved = save(step, position), step
            if stop is not None and stop.requested and step < last_step:
                if saved != step:
                    progress.checkpoint = save(step, position)
                raise RunInterrupted(stop.signum, step, progress.checkpoint)
        if step == start_step and progress.checkpoint is not None:
            final = progress.checkpoint  # nothing ran: the checkpoint we resumed from is the final one
        else:
            final = save(step, position)
            progress.checkpoint = final
    except RunInterrupted as stopped:
        log.stopped(stopped.signum, stopped.step, stopped.checkpoint)
        raise
    except STOPS_THAT_KEEP_THE_STEPS as error:
        keep_finished_steps(error, session, finished, position, progress, saved)
        raise
    except ClusterFault as fault:
        keep_steps_after_fault(fault, session, finished, position, progress, saved)
        raise
    except Exception as error:
        full = no_room(error)
        if full is None:
            raise
        raise keep_steps_on_full_disk(full, session, history, progress, saved, while_saving) from None
    finally:
        log.close()
    print(f"checkpoint: {final}", flush=True)
    if config.checkpoint.export_hf:
        from megatrain_ray.files.hf import export_tokenizer

        session.export(final / "hf")
        copied, mismatch = export_tokenizer(config.data.tokenizer, final / "hf")
        print(f"Hugging Face export: {final / 'hf'}" + (" (with the tokenizer)" if copied else ""), flush=True)
        if mismatch:
            print(f"warning: {mismatch}", flush=True)
    return {"final_loss": last.loss if last else None, "eval_loss": evaluation.loss if evaluation else None,
            "checkpoint": str(final), "metrics": str(out / "metrics.jsonl"), "rewards": log.reward_trend()}
