"""megatrain-ray train | plan | bench | export | config."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
from contextlib import nullcontext
from pathlib import Path

from megatrain_ray.config import ConfigError


def _train(args) -> int:
    from megatrain_ray import api

    from megatrain_ray.runtime.signals import RunInterrupted

    try:
        summary = api.train(args.config, sets=args.set, resume=args.resume, auto_resume=args.auto_resume,
                            overwrite=args.overwrite)
    except RunInterrupted as e:
        print(f"megatrain-ray: {e}", file=sys.stderr)
        if e.checkpoint is not None:
            print(f"continue with: {resume_command(args, e.checkpoint)}", file=sys.stderr)
        return e.exit_code
    if summary.get("finished_already"):
        return 0
    val = f", validation loss {summary['eval_loss']}" if summary.get("eval_loss") is not None else ""
    done = rewards_text(summary["rewards"]) if summary.get("rewards") else f"final loss {summary['final_loss']}{val}"
    print(f"done: {done}, checkpoint {summary['checkpoint']}, metrics {summary['metrics']}")
    return 0


def rewards_text(trend: dict) -> str:
    """A GRPO run's rewards, first steps to last (runtime/metrics.py, reward_trend): its loss says nothing."""
    steps = trend["steps"]
    over = "at the first step and the last" if steps == 1 else f"mean of the first {steps} steps and of the last {steps}"
    rewards = [f"{name} {means[0]:.3f} -> {means[1]:.3f}" for name, means in trend.items() if name != "steps"]
    return f"{rewards[0]} ({over}; {', '.join(rewards[1:])})" if len(rewards) > 1 else f"{rewards[0]} ({over})"


def resume_command(args, checkpoint: Path) -> str:
    """The command that continues this run from `checkpoint`: this one's config and --set, and --resume."""
    words = ["megatrain-ray", "train", args.config]
    for setting in args.set:
        words += ["--set", setting]
    return shlex.join(words + ["--resume", str(checkpoint)])


def print_resume_command(args, error: Exception) -> None:
    """After a run that stopped mid-way with the checkpoint of its last finished step (bad data, a
    diverging loss: runtime/training.py), the command that continues from it."""
    checkpoint = getattr(error, "checkpoint", None)
    if args.command == "train" and checkpoint is not None:
        print(f"continue with: {resume_command(args, checkpoint)}", file=sys.stderr)


def _plan(args) -> int:
    from megatrain_ray import api

    return 0 if api.plan(args.config, sets=args.set, cluster=args.cluster, network_gbps=args.network_gbps,
                         gpu=args.gpu) else 1


def _bench(args) -> int:
    from megatrain_ray.bench.run import main as bench_main

    return bench_main(args)


def _export(args) -> int:
    from megatrain_ray.files.export import export_checkpoint

    out, copied, mismatch = export_checkpoint(Path(args.checkpoint), Path(args.out_dir), args.dtype)
    print(f"exported {args.checkpoint} to {out}" + (f" with the tokenizer's {', '.join(copied)}" if copied else ""))
    if mismatch:
        print(f"warning: {mismatch}")
    return 0


def _config(args) -> int:
    from megatrain_ray.config_reference import reference_table

    print(reference_table(), end="")
    return 0


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The commands; the bench command's options only when `argv` runs it (the benchmark is loaded
    for that command alone)."""
    parser = argparse.ArgumentParser(prog="megatrain-ray", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p):
        p.add_argument("config", help="YAML config file")
        p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override a setting (repeatable), e.g. --set train.steps=100")
        return p

    train = with_config(sub.add_parser(
        "train", help="train a model",
        description="Train the model the config names, on its data, writing metrics.jsonl, train.log and checkpoints "
                    "into train.output_dir; Ctrl-C, SIGTERM or SIGHUP stop after the step under way with a "
                    "checkpoint and print the command that continues."))
    train.add_argument("--resume", nargs="?", const="latest", default=None, metavar="PATH|latest",
                       help="continue from a checkpoint (default: the latest under the run's checkpoint dir)")
    train.add_argument("--overwrite", action="store_true",
                       help="delete an earlier run in train.output_dir (its metrics.jsonl and checkpoints) and start "
                            "again; without it such a directory is refused")
    train.add_argument("--auto-resume", action=argparse.BooleanOptionalAction, default=None,
                       help="when a node is lost, wait for the cluster to have room and continue from the last "
                            "checkpoint (default: train.auto_resume, else on under `ray job submit`)")
    train.set_defaults(func=_train)

    plan = with_config(sub.add_parser(
        "plan", help="print where memory goes and whether the run fits",
        description="Print where the run's host and GPU memory go, the predicted step time and whether the run "
                    "fits, on the running cluster or a described one, before anything is allocated (exit 1 where "
                    "it does not fit)."))
    plan.add_argument("--cluster", default=None, metavar="CLUSTER.yaml",
                      help="plan for a described cluster instead of the running one (no Ray needed); "
                           "see examples/cluster-4x512.yaml")
    plan.add_argument("--network-gbps", type=float, nargs="+", default=None, metavar="GBIT",
                      help="with --cluster: the step time with every link at each of these speeds")
    plan.add_argument("--gpu", default=None, metavar="MODEL",
                      help="predict the step on this GPU model's rates from the rates table (the H100 SXM's "
                           "measured; rtx3060 to rtx5090, a100-40, a100-80, l40s, h100-pcie, h200, b200, gh200 "
                           "estimated from their datasheets); on a machine without a GPU the step is also planned for its "
                           "memory; default: the cluster's GPU (the table's rates, else probed there)")
    plan.set_defaults(func=_plan)

    bench = sub.add_parser("bench", help="throughput benchmark, optionally beside baselines")
    if argv and argv[0] == "bench":
        from megatrain_ray.bench.arguments import add_arguments

        add_arguments(bench)
    bench.set_defaults(func=_bench)

    export = sub.add_parser(
        "export", help="write a checkpoint as a Hugging Face model directory",
        description="Write a checkpoint's weights as a Hugging Face model directory (config.json and safetensors) "
                    "that transformers loads with from_pretrained.")
    export.add_argument("checkpoint", help="a checkpoint directory, e.g. runs/tiny/checkpoints/step-00000040")
    export.add_argument("out_dir", help="the directory to write (made if missing)")
    export.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the weights' dtype in the export (default: float32, the master weights as trained)")
    export.set_defaults(func=_export)

    reference = sub.add_parser(
        "config", help="print every config key, its default and what it does (Markdown)",
        description="Print every config key, its default and what it does, as a Markdown table (the README's "
                    "configuration reference).")
    reference.set_defaults(func=_config)
    return parser


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatrain-ray")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def input_errors() -> tuple[type[Exception], ...]:
    """Mistakes in what the user gave us (config, data, checkpoint, output directory, a plan that
    cannot fit): exit 2."""
    from megatrain_ray.files.checkpoint import CheckpointError
    from megatrain_ray.data import DataError
    from megatrain_ray.planning.memory import PlanError
    from megatrain_ray.runtime.output_dir import OutputDirError

    return CheckpointError, DataError, PlanError, OutputDirError


def main(argv: list[str] | None = None) -> int:
    """Exit 0 on success, 2 for bad input or a file-system error, 3 for a run that stopped (a lost
    node, a diverging loss), 130 / 143 / 129 for a run stopped by SIGINT / SIGTERM / SIGHUP: each with one
    paragraph on stderr, never a traceback. `--version` and `--help` answer before torch or Ray is
    imported (seconds). As the program (no `argv`), a signal once the command is done ends the
    process at once."""
    if argv is not None:
        return run_command(argv)
    try:
        return run_command(sys.argv[1:])
    finally:
        exit_at_once_on_signals()


def exit_at_once_on_signals() -> None:
    """For the rest of the process: Ctrl-C, SIGTERM or SIGHUP ends it at once (exit 128 + the signal), where
    Python would print a traceback for a KeyboardInterrupt in an atexit callback, such as Ray's
    shutdown of an embedded cluster, which takes seconds after a run's end."""
    def stop(signum: int, frame) -> None:
        try:
            sys.stdout.flush()  # what the command printed is kept
            print(f"megatrain-ray: {signal.Signals(signum).name}: exiting at once", file=sys.stderr, flush=True)
        except (OSError, ValueError):  # a closed pipe
            pass
        os._exit(128 + signum)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)


def run_command(argv: list[str]) -> int:
    """main's work: the command of `argv`, its failures as exit statuses. What `train` prints, to its
    last words, goes to the run's train.log too, and a reader of its output that is gone does not
    stop it (runtime/run_log.py)."""
    args = build_parser(argv).parse_args(argv)
    from megatrain_ray.runtime.run_log import run_output

    with run_output() if args.command == "train" else nullcontext():
        return outcome(args)


def outcome(args) -> int:
    """The command's exit status, its failures in one paragraph on stderr."""
    from megatrain_ray.runtime.output_dir import FileSystemError, describe_os_error
    from megatrain_ray.runtime.signals import StoppedAtOnce
    from megatrain_ray.runtime.watchdog import RunStopped

    try:
        return args.func(args)
    except ConfigError as e:
        print(f"megatrain-ray: configuration error: {e}", file=sys.stderr)
        return 2
    except input_errors() as e:
        print(f"megatrain-ray: {type(e).__name__}: {e}", file=sys.stderr)
        print_resume_command(args, e)
        return 2
    except RunStopped as e:
        print(f"megatrain-ray: {type(e).__name__}: {e}", file=sys.stderr)
        print_resume_command(args, e)
        return 3
    except FileSystemError as e:
        print(f"megatrain-ray: file-system error: {e}", file=sys.stderr)
        print_resume_command(args, e)  # a disk that filled mid-run: the checkpoint it stopped with
        return 2
    except OSError as e:
        if e.errno is None:  # not the file system's (a socket, a library's own OSError): keep its traceback
            raise
        print(f"megatrain-ray: file-system error: {describe_os_error(e)}", file=sys.stderr)
        return 2
    except StoppedAtOnce as e:
        print(f"megatrain-ray: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:  # Ctrl-C outside a run's own handler (its start-up, plan, bench, export)
        print("megatrain-ray: interrupted (SIGINT)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
