"""Where a run's outputs go, and what a relative input path means, under `ray job submit`.

Ray starts a job's entrypoint in its own temporary copy of --working-dir
(.../runtime_resources/working_dir_files/_ray_pkg_<hash>/), which it deletes once no job uses it,
and which holds only what Ray uploaded: the directory's files less those git ignores and the
runtime_env's excludes. So, under a job:

- a relative train.output_dir or checkpoint.dir is taken relative to the run home,
  `$MEGATRAIN_RAY_HOME` (default `~/megatrain-ray`) on the node that runs the job's driver (the
  head, for `ray job submit`): `runs/tiny` writes `~/megatrain-ray/runs/tiny`. Absolute paths are
  used as given (storage every node sees, for checkpoint.transport=shared).
- a relative data, validation, tokenizer or model path that the copy does not hold is refused
  with what Ray uploads and how to name the file instead.

Outside a job, relative paths are the current directory's, as everywhere: the driver makes them
absolute before the actors read or write them, since an actor of a Ray cluster the run joins works in
another directory (its raylet's). An input named relative that is not here (a Hub name such as
`Qwen/Qwen2.5-7B`) is left as written. Every run prints its output directory's absolute path at its
start and at its end.
"""

from __future__ import annotations

import glob
import os
import socket
from dataclasses import replace
from pathlib import Path

from megatrain_ray.config import Config, ConfigError

HOME_VARIABLE = "MEGATRAIN_RAY_HOME"


def run_home() -> Path:
    return Path(os.environ.get(HOME_VARIABLE) or Path.home() / "megatrain-ray").expanduser()


def in_job_copy(cwd: Path) -> bool:
    """Ray's copy of a job's working directory (the path Ray gives it)."""
    return "working_dir_files" in cwd.parts or any(part.startswith("_ray_pkg_") for part in cwd.parts)


def relative(value: str | None) -> bool:
    return bool(value) and not Path(value).expanduser().is_absolute()


def outputs_under(config: Config, base: Path) -> Config:
    """The config with a relative output and checkpoint directory under `base`."""
    train, checkpoint = config.train, config.checkpoint
    if relative(train.output_dir):
        train = replace(train, output_dir=str(base / train.output_dir))
    if relative(checkpoint.dir):
        checkpoint = replace(checkpoint, dir=str(base / checkpoint.dir))
    return replace(config, train=train, checkpoint=checkpoint)


def input_paths(config: Config) -> dict[str, str]:
    """The config's paths a run reads, by setting name."""
    named = {"data.source": config.data.source, "eval.source": config.eval.source,
             "data.tokenizer": config.data.tokenizer, "model.path": config.model.path}
    return {key: value for key, value in named.items() if value and value != "synthetic"}


def check_job_inputs(config: Config, cwd: Path) -> None:
    """Refuse a relative input path that Ray's copy of the working directory does not hold."""
    for key, value in input_paths(config).items():
        if not relative(value) or found_under(value, cwd):
            continue
        raise ConfigError(
            f"{key} {value!r} is not in the job's working directory ({cwd}). Under `ray job submit` a relative "
            f"path is read from Ray's copy of --working-dir, which holds the directory's files except those git "
            f"ignores (.gitignore: runs/ and data files often are) and runtime_env excludes. Give an absolute "
            f"path on the node that runs the job (or on storage every node sees), or keep the file in the "
            f"working directory and out of .gitignore"
        )


def found_under(value: str, cwd: Path) -> bool:
    """A relative input path (or glob) that names something under `cwd`."""
    return (cwd / value).exists() or bool(glob.glob(str(cwd / value)))


def absolute_here(config: Config, cwd: Path) -> Config:
    """The config with its relative output directories, and the relative inputs found here, under `cwd`."""
    found = {key for key, value in input_paths(config).items() if relative(value) and found_under(value, cwd)}

    def here(key: str, value: str | None) -> str | None:
        return str(cwd / value) if key in found else value

    data = replace(config.data, source=here("data.source", config.data.source),
                   tokenizer=here("data.tokenizer", config.data.tokenizer))
    evaluation = replace(config.eval, source=here("eval.source", config.eval.source))
    model = replace(config.model, path=here("model.path", config.model.path))
    return outputs_under(replace(config, data=data, model=model, eval=evaluation), cwd)


def for_this_run(config: Config, in_job: bool) -> Config:
    """The config with its paths resolved for where the run's actors work (see the module docstring):
    outputs under the run home and inputs checked in a job, paths made absolute outside one."""
    if in_job:
        check_job_inputs(config, Path.cwd())
        return outputs_under(config, run_home())
    return absolute_here(config, Path.cwd())


def where(out: Path) -> str:
    """An output directory as a person finds it again: its absolute path and the machine."""
    return f"{out.resolve()} on {socket.gethostname()}"


def resume_moved(resume: str | None, in_job: bool) -> str | None:
    """--resume PATH, relative: under a job, a checkpoint of an earlier job's run, under the run home;
    outside one, the current directory's, made absolute like the config's paths (the stores that read
    it work in another directory)."""
    if resume in (None, "latest") or not relative(resume):
        return resume
    return str((run_home() if in_job else Path.cwd()) / resume)
