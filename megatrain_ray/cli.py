"""megatrain-ray train | plan | bench | export | config."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatrain_ray.config import ConfigError


def _train(args) -> int:
    from megatrain_ray import api

    summary = api.train(args.config, sets=args.set, resume=args.resume, auto_resume=args.auto_resume)
    val = f", validation loss {summary['eval_loss']}" if summary.get("eval_loss") is not None else ""
    print(f"done: final loss {summary['final_loss']}{val}, checkpoint {summary['checkpoint']}, "
          f"metrics {summary['metrics']}")
    return 0


def _plan(args) -> int:
    from megatrain_ray import api

    return 0 if api.plan(args.config, sets=args.set, cluster=args.cluster, network_gbps=args.network_gbps) else 1


def _bench(args) -> int:
    from megatrain_ray.bench.run import main as bench_main

    return bench_main(args)


def _export(args) -> int:
    from megatrain_ray.files.export import export_checkpoint

    out = export_checkpoint(Path(args.checkpoint), Path(args.out_dir), args.dtype)
    print(f"exported {args.checkpoint} to {out}")
    return 0


def _config(args) -> int:
    from megatrain_ray.config_reference import reference_table

    print(reference_table(), end="")
    return 0


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The commands; the bench command's options only when `argv` runs it (the benchmark is loaded
    for that command alone)."""
    parser = argparse.ArgumentParser(prog="megatrain-ray", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p):
        p.add_argument("config", help="YAML config file")
        p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override a setting (repeatable), e.g. --set train.steps=100")
        return p

    train = with_config(sub.add_parser("train", help="train a model"))
    train.add_argument("--resume", nargs="?", const="latest", default=None, metavar="PATH|latest",
                       help="continue from a checkpoint (default: the latest under the run's checkpoint dir)")
    train.add_argument("--auto-resume", action=argparse.BooleanOptionalAction, default=None,
                       help="when a node is lost, wait for the cluster to have room and continue from the last "
                            "checkpoint (default: train.auto_resume, else on under `ray job submit`)")
    train.set_defaults(func=_train)

    plan = with_config(sub.add_parser("plan", help="print where memory goes and whether the run fits"))
    plan.add_argument("--cluster", default=None, metavar="CLUSTER.yaml",
                      help="plan for a described cluster instead of the running one (no Ray needed); "
                           "see examples/cluster-4x512.yaml")
    plan.add_argument("--network-gbps", type=float, nargs="+", default=None, metavar="GBIT",
                      help="with --cluster: the step time with every link at each of these speeds")
    plan.set_defaults(func=_plan)

    bench = sub.add_parser("bench", help="throughput benchmark, optionally beside baselines")
    if argv and argv[0] == "bench":
        from megatrain_ray.bench.run import add_arguments

        add_arguments(bench)
    bench.set_defaults(func=_bench)

    export = sub.add_parser("export", help="write a checkpoint as a Hugging Face model directory")
    export.add_argument("checkpoint")
    export.add_argument("out_dir")
    export.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    export.set_defaults(func=_export)

    reference = sub.add_parser("config", help="print every config key, its default and what it does (Markdown)")
    reference.set_defaults(func=_config)
    return parser


def input_errors() -> tuple[type[Exception], ...]:
    """Mistakes in what the user gave us (config, data, checkpoint, a plan that cannot fit): exit 2."""
    from megatrain_ray.files.checkpoint import CheckpointError
    from megatrain_ray.data import DataError
    from megatrain_ray.planning.plan import PlanError

    return CheckpointError, DataError, PlanError


def main(argv: list[str] | None = None) -> int:
    """Exit 0 on success, 2 for bad input, 3 for a run that stopped (a lost node, a diverging loss):
    each with one paragraph on stderr, never a traceback."""
    from megatrain_ray.runtime.watchdog import RunStopped

    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"megatrain-ray: configuration error: {e}", file=sys.stderr)
        return 2
    except input_errors() as e:
        print(f"megatrain-ray: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except RunStopped as e:
        print(f"megatrain-ray: {type(e).__name__}: {e}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
