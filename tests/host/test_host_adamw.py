"""The host AdamW step against torch.optim.AdamW, bf16 gradient rounding included.

torch gets the same bf16-rounded gradient upcast to fp32, torch.nn.utils.clip_grad_norm_ clips
it, and two parameter groups carry the weight decay (matrices) and none (norms, biases).
"""

import shutil
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch

from megatrain_ray.host import adamw_kernel as host_adamw
from megatrain_ray.host.adamw import AdamWStep, adamw_step, clip_coefficient
from helpers.kernel import path_of
from helpers.threads import three_threads  # noqa: F401 (a fixture)

# Odd sizes (no multiple of a vector width or of the kernel's 64 Ki-element tiles), 205,254
# elements in all: four tiles for three threads, whose bounds (65,536, 131,072, 196,608) fall
# inside the 3rd and 5th segments, and a last tile shorter than the others.
SEGMENTS = [(37, True), (4099, False), (70_001, True), (5, False), (131_111, True), (1, False)]
LR, BETAS, EPS, STEPS = 3e-3, (0.9, 0.95), 1e-8, 4


def flat_segments() -> list[tuple[int, int, bool]]:
    out, at = [], 0
    for n, decays in SEGMENTS:
        out.append((at, at + n, decays))
        at += n
    return out


def torch_reference(init: torch.Tensor, grads: list[torch.Tensor], weight_decay: float, max_norm: float):
    """torch.optim.AdamW over one tensor per segment; returns master, moments and clip scales per step."""
    params = [torch.nn.Parameter(init[a:b].clone()) for a, b, _ in flat_segments()]
    groups = [
        {"params": [p for p, (_, _, d) in zip(params, flat_segments(), strict=True) if d], "weight_decay": weight_decay},
        {"params": [p for p, (_, _, d) in zip(params, flat_segments(), strict=True) if not d], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, foreach=False, fused=False)
    scales = []
    for g in grads:
        for p, (a, b, _) in zip(params, flat_segments(), strict=True):
            p.grad = g[a:b].to(torch.float32, copy=True)  # the bf16 gradient, upcast (clipping scales it)
        if max_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            scales.append(clip_coefficient(float(norm), max_norm))
        else:
            scales.append(1.0)
        opt.step()
    state = [opt.state[p] for p in params]
    return (
        torch.cat([p.detach() for p in params]),
        torch.cat([s["exp_avg"] for s in state]),
        torch.cat([s["exp_avg_sq"] for s in state]),
        scales,
    )


def assert_relative(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """1e-6 relative, element by element; elements near zero (a moment that cancels, a weight that
    crosses zero) are held to 1e-6 of the tensor's mean magnitude instead. torch's CPU sqrt is not
    IEEE's correctly rounded one (MKL's), so the two sides may differ in a last bit."""
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6 * float(ref.abs().mean()), msg=lambda m: f"{what}: {m}")


@pytest.mark.usefixtures("three_threads")
@pytest.mark.parametrize("one_pass", [True, False], ids=["kernel", "torch-fallback"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("weight_decay,max_norm", [(0.0, 0.0), (0.1, 0.0), (0.1, 1.0)], ids=["plain", "wd", "wd-clip"])
def test_step_matches_torch_adamw(one_pass, dtype, weight_decay, max_norm):
    gen = torch.Generator().manual_seed(0)
    n = sum(n for n, _ in SEGMENTS)
    init = torch.randn(n, generator=gen) * 0.05
    grads = [(torch.randn(n, generator=gen) * 0.01).to(dtype) for _ in range(STEPS)]
    ref_master, ref_m, ref_v, scales = torch_reference(init, grads, weight_decay, max_norm)
    if max_norm > 0:
        assert all(s < 1.0 for s in scales), "clipping must be active"

    path = path_of(one_pass)
    master, m, v = init.clone(), torch.zeros(n), torch.zeros(n)
    compute = init.to(dtype, copy=True)
    for step, (g, scale) in enumerate(zip(grads, scales, strict=True), start=1):
        compute.copy_(g)  # the executor writes the gradient over the weights
        hp = AdamWStep(step, LR, scale, BETAS, EPS, weight_decay)
        assert adamw_step(master, m, v, compute, flat_segments(), hp, step, one_pass=one_pass) == path

    assert_relative(master, ref_master, "master")
    assert_relative(m, ref_m, "exp_avg")
    assert_relative(v, ref_v, "exp_avg_sq")
    assert torch.equal(compute, master.to(dtype)), "the compute weights are the master rounded as torch rounds"
    assert not torch.equal(master, init)


@pytest.mark.usefixtures("three_threads")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_late_step_matches_torchs_fused_adamw(dtype):
    """Past a few hundred updates Adam's second bias correction is 1.0 in fp32 and the kernel skips
    dividing by it: a step there against torch's fused AdamW (the fallback) from the same state."""
    import numpy as np

    step = 2000
    assert np.float32((1 - BETAS[1] ** step) ** 0.5) == 1.0
    gen = torch.Generator().manual_seed(4)
    n = sum(n for n, _ in SEGMENTS)
    init = torch.randn(n, generator=gen) * 0.05
    m0, v0 = torch.randn(n, generator=gen) * 1e-3, (torch.randn(n, generator=gen) * 1e-3) ** 2
    g = (torch.randn(n, generator=gen) * 0.01).to(dtype)
    hp = AdamWStep(step, LR, 0.7, BETAS, EPS, 0.1)
    out = []
    for one_pass in (True, False):
        path = path_of(one_pass)  # the kernel against the fallback, each really run
        master, m, v, compute = init.clone(), m0.clone(), v0.clone(), g.clone()
        assert adamw_step(master, m, v, compute, flat_segments(), hp, step, one_pass=one_pass) == path
        out.append((master, m, v))
    for ours, ref, what in zip(out[0], out[1], ("master", "exp_avg", "exp_avg_sq"), strict=True):
        assert_relative(ours, ref, what)


def test_bf16_rounding_is_torchs():
    """Ties to even, halfway cases, subnormals and infinities bit for bit what .to(bfloat16) gives; NaN stays NaN."""
    special = torch.tensor([0.0, -0.0, 1.0, 1.00390625, 1.01171875, 3.4e38, -3.4e38, 1e-40, -1e-40, float("inf"),
                            float("-inf"), float("nan")])
    values = torch.cat([special, torch.randn(100_003) * 10.0 ** torch.randint(-30, 30, (100_003,)).float()])
    n = values.numel()
    master, m, v = values.clone(), torch.zeros(n), torch.zeros(n)
    compute = torch.zeros(n, dtype=torch.bfloat16)  # a zero gradient and lr 0: the step only publishes
    assert adamw_step(master, m, v, compute, [(0, n, False)], AdamWStep(1, 0.0, 1.0, BETAS, EPS, 0.0), 1) == path_of(True)
    expected = values.to(torch.bfloat16)
    nan = values.isnan()
    assert torch.equal(compute[~nan].view(torch.int16), expected[~nan].view(torch.int16))
    assert compute[nan].isnan().all()


@pytest.mark.parametrize("segments", [[(0, 4, True), (5, 10, False)], [(0, 4, True), (4, 9, False)]])
def test_segments_must_tile_the_buffer(segments):
    t = torch.zeros(10)
    with pytest.raises(ValueError, match="tile the buffer"):
        adamw_step(t, t.clone(), t.clone(), t.clone(), segments, AdamWStep(1, 1e-3, 1.0, BETAS, EPS, 0.0), 1)


def test_unbuildable_kernel_warns_once_and_falls_back_for_every_caller(tmp_path):
    """Three threads ask for a kernel that cannot build, at once: one build on its own thread, one
    warning, the same answer (none: torch's three passes) for each."""
    build = host_adamw.KernelBuild(tmp_path, extra_cflags=("--no-such-compiler-flag",))
    answers = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        threads = [threading.Thread(target=lambda: answers.append(build.result())) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert answers == [None, None, None]
    assert len(caught) == 1 and "three passes" in str(caught[0].message)


HOLD_LOCK = """
import fcntl, sys, time
f = open(sys.argv[1], "a")
fcntl.flock(f, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(120)
"""

BUILD = """
import sys
from pathlib import Path
import megatrain_ray.host.adamw_kernel as kernel
compile_and_publish = kernel._compile_and_publish
kernel._compile_and_publish = lambda *args: print("compiled", flush=True) or compile_and_publish(*args)
ops = kernel.build_kernel(Path(sys.argv[1]))
print("loaded", hasattr(ops, "adamw_step"), flush=True)
"""


def waits_for_a_lock(proc: subprocess.Popen, timeout: float = 60) -> bool:
    """Whether `proc` comes to wait on an flock (the kernel lists it in /proc/locks with "->") while it runs."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        with open("/proc/locks") as locks:
            if any(line.split()[1:5] == ["->", "FLOCK", "ADVISORY", "WRITE"] and line.split()[5] == str(proc.pid)
                   for line in locks):
                return True
        time.sleep(0.05)
    return False


def test_a_process_waits_for_the_build_another_holds_and_loads_it_without_compiling(tmp_path):
    """The node's processes compile the kernel once between them: one that finds another's build under
    way waits for it, and then loads what it published; a holder killed mid-build holds nothing."""
    built = host_adamw.native_kernel() and host_adamw._cache_dir() / f"{host_adamw._build_name()}.so"
    if not built:
        pytest.skip("no compiler here to build the kernel")
    name = host_adamw._build_name()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(tmp_path / f"{name}.lock")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        waiter = subprocess.Popen([sys.executable, "-c", BUILD, str(tmp_path)], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        assert waits_for_a_lock(waiter)  # rather than compile beside the holder
        shutil.copy(built, tmp_path / f"{name}.so")  # what the holder's build would publish
    finally:
        holder.kill()  # killed, not ended: the kernel drops its lock
        holder.wait()
    out, _ = waiter.communicate(timeout=60)
    assert waiter.returncode == 0, out
    assert out.splitlines()[-1] == "loaded True" and "compiled" not in out, out


@pytest.mark.parametrize("warmup, total, min_ratio", [(0, 7, 0.1), (2, 9, 0.0), (3, 12, 0.25), (1, 1, 0.5)])
def test_the_lr_schedule_is_warmup_then_transformers_cosine(warmup, total, min_ratio):
    """The LR of every update, the stores' messages (LrSchedule) and the metrics' learning_rate,
    against the schedule written in the test helper, and that one, after the warm-up, against
    transformers' get_cosine_with_min_lr_schedule_with_warmup run through torch's LambdaLR (its
    warm-up starts from 0, the project's reaches the full LR at the warm-up's last update)."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    from helpers.reference_training import reference_lr
    from megatrain_ray.config import OptimConfig
    from megatrain_ray.host.adamw import LrSchedule, learning_rate

    cfg = OptimConfig(lr=1e-3, warmup_steps=warmup, min_lr_ratio=min_ratio)
    updates = range(total + 4)  # past the end too: the floor
    want = [reference_lr(cfg, k, total) for k in updates]
    schedule = LrSchedule(cfg, total)
    assert [schedule.next(0.0).lr for _ in updates] == pytest.approx(want, rel=1e-12)
    assert [learning_rate(cfg, k, total) for k in updates] == pytest.approx(want, rel=1e-12)

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    theirs = get_cosine_with_min_lr_schedule_with_warmup(opt, warmup, total, min_lr_rate=min_ratio)
    transformers_lr = []
    for _ in updates:
        transformers_lr.append(opt.param_groups[0]["lr"])
        opt.step()
        theirs.step()
    assert want[warmup:total + 1] == pytest.approx(transformers_lr[warmup:total + 1], rel=1e-12)
    assert want[:warmup] == pytest.approx([cfg.lr * (k + 1) / warmup for k in range(warmup)], rel=1e-12)
    floor_from = warmup + max(1, total - warmup)  # a decay of at least one update
    assert want[floor_from:] == pytest.approx([cfg.lr * min_ratio] * len(want[floor_from:]), rel=1e-12)


def test_ci_fails_where_the_kernel_does_not_build(tmp_path):
    """.ci/run's check (.ci/check_kernel.py) with no compiler and an empty cache exits 1, saying so;
    where this machine has the kernel built, it passes."""
    import os
    from pathlib import Path

    check = Path(__file__).resolve().parents[2] / ".ci" / "check_kernel.py"
    env = {**os.environ, "CXX": "/bin/false", "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    failed = subprocess.run([sys.executable, str(check)], env=env, capture_output=True, text=True, timeout=120)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "FAILED: the host AdamW kernel did not build" in failed.stderr
    assert "could not be built (Command '['/bin/false'" in failed.stderr  # the build's own reason, above it
    if host_adamw.native_kernel() is not None:  # built in this machine's cache: loaded, not compiled
        built = subprocess.run([sys.executable, str(check)], capture_output=True, text=True, timeout=120)
        assert built.returncode == 0 and built.stdout.startswith("host AdamW kernel: "), built.stdout + built.stderr
