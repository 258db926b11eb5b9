"""A disk-tier bench run's step with its update, from `megatrain-ray bench --json` (one shape, steps
timed without warm-up or with it): the step's forward and backward, the update that ran after its
backward (the final drain: with the disk tier, the disk's reads and writes of the layers on disk
beside AdamW), the step as a long run pays it and its tokens/s, beside `plan`'s prediction, and
how long the stores waited for the disk's reads.

The step a long run pays: a step after another one (a warm-up) already waited in its forward for the
update of the step before, layer by layer (the plan's "host optimizer ... not hidden"), so its own
seconds are the steady state, and its own update (the drain) is the next step's wait, not a second
cost. Only a run of one step alone has no wait in it: its seconds and its drain together.

Usage: python3 examples/benchmarks/disk_step_summary.py BENCH_JSON
"""

import json
import sys


def summary(results: dict) -> str:
    lines = []
    for run in results["runs"]:
        steps, median = run.get("steps"), run.get("median")
        if not steps or not median:
            lines.append(f"{run.get('shape')}: no timed step ({run.get('error') or 'the run did not finish'})")
            continue
        last = steps[-1]
        drain = median["final_drain_s"]
        full = last["seconds"] if len(steps) > 1 else last["seconds"] + drain
        disk = median.get("disk") or {}
        plan = median.get("predicted") or {}
        lines.append(
            f"last step: forward and backward {last['seconds']:.1f} s (compute {last['compute_s']:.1f} s), its update "
            f"{drain:.1f} s more after the backward; a step of a long run {full:.1f} s "
            f"({'the update of the step before waited for in it' if len(steps) > 1 else 'the step alone, with its update'}), "
            f"{last['tokens'] / full:.0f} tokens/s ({last['tokens']} tokens)")
        if last.get("host_add_wait_s"):
            lines.append(f"the host's adds of the gradients summed in host memory held the step {last['host_add_wait_s']:.1f} s "
                         f"(in its compute; plan: {plan.get('host_summed_s', 0.0):.1f} s with their copies out)")
        if plan:
            lines.append(
                f"plan: {plan['step_s']:.1f} s a step ({plan['tokens'] / plan['step_s']:.0f} tokens/s), compute "
                f"{plan['compute_s']:.1f} s, host update with the disk {plan['optimizer_s']:.1f} s (exposed "
                f"{plan['optimizer_exposed_s']:.1f} s); measured / plan: {plan['step_s'] / full:.2f} of plan's tokens/s")
        if disk:
            lines.append(
                f"disk: {disk['read_gb_per_step']:.1f} GB read and {disk['written_gb_per_step']:.1f} GB written a step"
                + (f" (plan: {disk['plan_read_gb_per_step']:.1f} and {disk['plan_written_gb_per_step']:.1f} GB)"
                   if "plan_read_gb_per_step" in disk else "") + "; the "
                f"stores waited {disk['read_wait_s_per_step']:.1f} s a step for reads; exposed beyond the compute: "
                f"{max(0.0, full - last['compute_s']):.1f} s of the {full:.1f} s step "
                f"({max(0.0, full - last['compute_s']) / full:.0%})")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(json.loads(open(sys.argv[1]).read())))
