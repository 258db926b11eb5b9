"""Lean optimizer state (optim.master, optim.moments) against references written here from the
definitions: AdamW in float64, blockwise square-root int8 quantization, bf16 rounding to nearest
even and at random in proportion. Each mode's host step, kernel and torch fallback alike; exact
resume through the store in every mode; conversions on resume (fp32 to lean only)."""

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatrain_ray.config import ConfigError, config_from_dict
from megatrain_ray.files import checkpoint as ckpt, shard
from megatrain_ray.host import precision
from megatrain_ray.host.adamw import AdamWStep, adamw_step
from megatrain_ray.host.precision import StateFormat
from megatrain_ray.host.store import ShardStore
from megatrain_ray.models.registry import PRESETS
from megatrain_ray.runtime.local import LocalTrainer
from helpers.kernel import path_of
from helpers.threads import three_threads  # noqa: F401 (a fixture)
from helpers.hf_parity import save
from helpers.reference_training import random_micro_batches
from helpers.runs import as_stood_at, tensors_of, tiny_raw
from megatrain_ray.runtime.training import run_training

LEAN = [("fp32", "bf16"), ("fp32", "int8"), ("bf16", "int8"), ("bf16", "fp32"), ("bf16", "bf16")]
ALL = [("fp32", "fp32"), *LEAN]
NAMED = [("fp32", "bf16"), ("fp32", "int8"), ("bf16", "int8")]  # 10, 8 and 6 bytes a parameter
BETAS, EPS, LR, WD = (0.9, 0.95), 1e-8, 1e-3, 0.1
# Odd sizes: int8 blocks (256) straddle parameters, the kernel's 64 Ki tiles fall inside one, the last block is short.
SEGMENTS = [(37, True), (4099, False), (70_001, True), (300, False)]
# Rounding ties: a code within this of half-way may go either way (fp32 against float64 scales).
TIE_MARGIN = 1e-3
U = 2.0**-24  # fp32's unit roundoff

def segments() -> list[tuple[int, int, bool]]:
    out, at = [], 0
    for n, decays in SEGMENTS:
        out.append((at, at + n, decays))
        at += n
    return out


N = sum(n for n, _ in SEGMENTS)


# ---- the definitions, in float64 -----------------------------------------------------------------

def blocks(x: torch.Tensor) -> list[torch.Tensor]:
    return list(x.split(precision.QUANT_BLOCK))


def ref_codes_signed(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block: r = 127 sqrt(|x| / max|x|) with x's sign, before rounding; and the block's max."""
    rs, scales = [], []
    for b in blocks(x.double()):
        a = b.abs().max()
        rs.append(torch.sign(b) * 127 * torch.sqrt(b.abs() / a) if a > 0 else torch.zeros_like(b))
        scales.append(a)
    return torch.cat(rs), torch.stack(scales)


def ref_codes_sqrt(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block: r = 255 sqrt(sqrt(v) / max sqrt(v)) before rounding; and that max."""
    rs, scales = [], []
    for b in blocks(v.double()):
        s = torch.sqrt(b)
        c = s.max()
        rs.append(255 * torch.sqrt(s / c) if c > 0 else torch.zeros_like(s))
        scales.append(c)
    return torch.cat(rs), torch.stack(scales)


def ref_dequant_signed(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    t = q.double() / 127
    return torch.cat([scale[k].double() * t_ * t_.abs() for k, t_ in enumerate(blocks(t))])


def ref_dequant_sqrt(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    t = q.double() / 255
    return torch.cat([(scale[k].double() * t_ * t_) ** 2 for k, t_ in enumerate(blocks(t))])


def signed_r(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """127 sqrt(|x| / a) with x's sign, per element; `a` per element (its block's max)."""
    return torch.sign(x) * 127 * torch.sqrt(x.abs() / a)


def sqrt_r(v: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return 255 * torch.sqrt(torch.sqrt(v.clamp_min(0)) / c)


def per_element(scale: torch.Tensor, n: int) -> torch.Tensor:
    return scale.double().repeat_interleave(precision.QUANT_BLOCK)[:n].clamp_min(1e-300)


def assert_codes(ours: torch.Tensor, r_lo: torch.Tensor, r_hi: torch.Tensor, what: str,
                 at_least_one: torch.Tensor | None = None) -> None:
    """Each code is the rounding of some value in [r_lo, r_hi] (the exact value's r, widened by the
    fp32 arithmetic's error bound), give or take TIE_MARGIN; `at_least_one`: where code 0 is forbidden."""
    lo = torch.ceil(r_lo - 0.5 - TIE_MARGIN)
    hi = torch.floor(r_hi + 0.5 + TIE_MARGIN)
    if at_least_one is not None:
        lo = torch.where(at_least_one, lo.clamp_min(1), lo)
        hi = torch.where(at_least_one, hi.clamp_min(1), hi)
    ours = ours.double()
    bad = (ours < lo) | (ours > hi)
    assert not bad.any(), f"{what}: {int(bad.sum())} codes outside their bounds, e.g. {ours[bad][:5]} vs {lo[bad][:5]}"


def ref_adamw(p, m, v, g, step: int, grad_scale: float):
    """torch.optim.AdamW's update, in float64, decay on the matrices only; and the error bounds of
    an fp32 computation of m, v and p (a few units of roundoff of each sum's terms, carried through)."""
    p, m, v, g = (t.double() for t in (p, m, v, g))
    g = g * grad_scale
    decay = torch.cat([torch.full((b - a,), 1 - LR * WD if d else 1.0, dtype=torch.float64) for a, b, d in segments()])
    m1 = BETAS[0] * m + (1 - BETAS[0]) * g
    v1 = BETAS[1] * v + (1 - BETAS[1]) * g * g
    denom = torch.sqrt(v1) / math.sqrt(1 - BETAS[1] ** step) + EPS
    update = LR / (1 - BETAS[0] ** step) * m1 / denom
    dm = 8 * U * (m.abs() + g.abs())
    dv = 8 * U * (v + g * g)
    dp = 8 * U * (p.abs() + update.abs()) + LR / (1 - BETAS[0] ** step) * dm / denom \
        + update.abs() * dv / (2 * v1).clamp_min(1e-300)
    return (p * decay - update, m1, v1), (dp, dm, dv)


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |x| (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 7)


# ---- a layer's state in each mode ---------------------------------------------------------------

def make_state(fmt: StateFormat, gen: torch.Generator):
    """A layer after some updates: random master, moments of the right signs and spread, the gradient."""
    p = torch.randn(N, generator=gen) * 0.05
    m = torch.randn(N, generator=gen) * 1e-3 * torch.exp(torch.randn(N, generator=gen))
    v = (torch.randn(N, generator=gen) * 1e-3) ** 2 * torch.exp(2 * torch.randn(N, generator=gen))
    v[::97] = 0.0  # never updated elements
    v[5] = 1e-30  # far below its block's largest: its code must not be 0
    g = (torch.randn(N, generator=gen) * 1e-3).to(torch.bfloat16)
    held = precision.convert_moments(m, v, fmt)
    state = {"exp_avg": held["exp_avg"], "exp_avg_sq": held["exp_avg_sq"],
             "scales": (held["exp_avg_scale"], held["exp_avg_sq_scale"]) if fmt.quantized else None}
    if fmt.master == "bf16":
        state["master"] = p.to(torch.bfloat16)
        state["compute"] = state["master"]
        state["grad"] = g.clone()
    else:
        state["master"] = p
        state["compute"] = g.clone()  # the gradient lands in the compute copy
        state["grad"] = None
    return state


def widened(state) -> tuple[torch.Tensor, torch.Tensor]:
    if state["scales"] is not None:
        return (ref_dequant_signed(state["exp_avg"], state["scales"][0]),
                ref_dequant_sqrt(state["exp_avg_sq"], state["scales"][1]))
    return state["exp_avg"].double(), state["exp_avg_sq"].double()


def run_step(state, step: int, grad_scale: float, one_pass: bool, key: int) -> None:
    """One step on the path `one_pass` names, checked to be the one that ran (helpers/kernel.py)."""
    path = path_of(one_pass)
    assert path == adamw_step(state["master"], state["exp_avg"], state["exp_avg_sq"], state["compute"], segments(),
               AdamWStep(step, LR, grad_scale, BETAS, EPS, WD), step, one_pass, grad=state["grad"],
               scales=state["scales"], rounding_key=key)


@pytest.mark.usefixtures("three_threads")
@pytest.mark.parametrize("one_pass", [True, False], ids=["kernel", "torch-fallback"])
@pytest.mark.parametrize("master,moments", LEAN)
def test_update_matches_the_definitions(master, moments, one_pass):
    fmt = StateFormat(master, moments)
    state = make_state(fmt, torch.Generator().manual_seed(1))
    p0 = state["master"].double()
    m0, v0 = widened(state)
    g = (state["grad"] if state["grad"] is not None else state["compute"]).clone()
    step, grad_scale = 7, 0.8
    (ref_p, ref_m, ref_v), (dp, dm, dv) = ref_adamw(p0, m0, v0, g, step, grad_scale)

    run_step(state, step, grad_scale, one_pass, key=precision.rounding_key(0, 1, step))

    if moments == "int8":
        sm, sv = state["scales"]
        torch.testing.assert_close(sm.double(), ref_codes_signed(ref_m)[1], rtol=1e-6, atol=0)
        torch.testing.assert_close(sv.double(), ref_codes_sqrt(ref_v)[1], rtol=1e-6, atol=0)
        a, c = per_element(sm, N), per_element(sv, N)
        assert_codes(state["exp_avg"], signed_r(ref_m - dm, a), signed_r(ref_m + dm, a), "exp_avg")
        assert_codes(state["exp_avg_sq"], sqrt_r(ref_v - dv, c), sqrt_r(ref_v + dv, c), "exp_avg_sq",
                     at_least_one=ref_v > 0)
        assert ((state["exp_avg_sq"] > 0) == (ref_v > 0)).all(), "a second moment became zero, or stopped being"
    elif moments == "bf16":  # the fp32 result rounded to nearest: half a bf16 step from it
        for ours, ref, d, what in ((state["exp_avg"], ref_m, dm, "exp_avg"), (state["exp_avg_sq"], ref_v, dv, "exp_avg_sq")):
            assert ((ours.double() - ref).abs() <= 0.5 * bf16_ulp(ref.abs() + d) + d).all(), what
    else:
        assert ((state["exp_avg"].double() - ref_m).abs() <= dm).all()
        assert ((state["exp_avg_sq"].double() - ref_v).abs() <= dv).all()

    ours_p = state["master"].double()
    if master == "fp32":
        assert ((ours_p - ref_p).abs() <= dp).all()
        assert torch.equal(state["compute"], state["master"].to(torch.bfloat16)), "compute copy: the master, rounded"
    else:  # rounded down or up: one of the two bf16 neighbours of the fp32 result
        assert ((ours_p - ref_p).abs() <= bf16_ulp(ref_p.abs() + dp) + dp).all()
        assert state["compute"] is state["master"]


def test_quantization_round_trip_and_zero_second_moments():
    """Dequantized codes are the definitions' values; a zero stays zero and nothing else becomes zero."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(10_000, generator=gen) * torch.exp(3 * torch.randn(10_000, generator=gen))
    v = x * x
    v[::7] = 0.0
    qm, sm = precision.quantize_signed(x)
    qv, sv = precision.quantize_sqrt(v)
    r_m, r_v = ref_codes_signed(x)[0], ref_codes_sqrt(v)[0]
    assert_codes(qm, r_m, r_m, "signed")
    assert_codes(qv, r_v, r_v, "sqrt", at_least_one=v > 0)
    assert ((qv > 0) == (v > 0)).all()
    torch.testing.assert_close(precision.dequantize_signed(qm, sm).double(), ref_dequant_signed(qm, sm), rtol=1e-6, atol=0)
    torch.testing.assert_close(precision.dequantize_sqrt(qv, sv).double(), ref_dequant_sqrt(qv, sv), rtol=1e-6, atol=0)
    # The square-root map's worst rounding error, half a code's step: |x| (1 / q) near code q.
    back = precision.dequantize_signed(qm, sm)
    big = qm.abs() >= 64
    assert ((back[big] - x[big]).abs() <= x[big].abs() / 63).all()


@pytest.mark.parametrize("one_pass", [True, False], ids=["kernel", "torch-fallback"])
def test_stochastic_rounding_keeps_small_updates_in_expectation(one_pass):
    """Many elements with the same weight and gradient: each lands on one of the two bf16 neighbours
    of the fp32 result, and their mean is the fp32 result within 5 standard deviations of a mean of
    n draws (a draw's deviation is at most half the neighbours' gap: gap / (2 sqrt(n)))."""
    n = 1 << 18
    fmt = StateFormat("bf16", "int8")
    master = torch.full((n,), 1.0, dtype=torch.bfloat16)
    m, v = torch.zeros(n, dtype=torch.int8), torch.zeros(n, dtype=torch.uint8)
    scales = (torch.zeros(precision.num_blocks(n)), torch.zeros(precision.num_blocks(n)))
    grad = torch.full((n,), 1e-3, dtype=torch.bfloat16)
    lr = 1e-3  # the first step moves each weight by lr: an eighth of bf16's step at 1.0 (2**-7)
    hp = AdamWStep(1, lr, 1.0, BETAS, EPS, 0.0)
    path = path_of(one_pass)
    assert path == adamw_step(master, m, v, master, [(0, n, False)], hp, 1, one_pass, grad=grad, scales=scales,
                              rounding_key=precision.rounding_key(0, 0, 1))
    g = float(torch.tensor(1e-3).to(torch.bfloat16))
    x = 1.0 - lr * g / (abs(g) + EPS)  # Adam's first step: -lr * sign(g), less eps's share
    lo, hi = 1.0 - 2**-8, 1.0  # bf16 neighbours below 1.0 are 2**-8 apart
    out = master.double()
    assert set(out.unique().tolist()) <= {lo, hi}
    bound = 5 * (hi - lo) / (2 * math.sqrt(n)) + 1e-7  # plus the fp32 arithmetic's rounding of x
    assert abs(float(out.mean()) - x) < bound, (float(out.mean()), x, bound)
    assert (out == lo).any(), "round to nearest would have lost every update"


def test_rounding_noise_is_a_function_of_seed_layer_and_update():
    x = torch.full((100_000,), 1.0 + 2**-8, dtype=torch.float32)  # halfway between bf16 values (2**-7 apart): a fair coin
    a = precision.stochastic_round_bf16(x, precision.rounding_key(0, 3, 5))
    assert torch.equal(a.view(torch.int16), precision.stochastic_round_bf16(x, precision.rounding_key(0, 3, 5)).view(torch.int16))
    for key in (precision.rounding_key(0, 3, 6), precision.rounding_key(0, 4, 5), precision.rounding_key(1, 3, 5)):
        assert not torch.equal(a, precision.stochastic_round_bf16(x, key))
    # a chunk of the stream is the same as the whole stream's slice: chunking and threads do not change it
    part = precision.stochastic_round_bf16(x[40_000:], precision.rounding_key(0, 3, 5), start=40_000)
    assert torch.equal(part.view(torch.int16), a[40_000:].view(torch.int16))
    assert 0.48 < float((a.float() > 1.0).double().mean()) < 0.52


def test_kernel_and_fallback_draw_the_same_noise():
    """A zero update (lr 0) leaves the fp32 result exactly the master's: both paths then round the
    same fp32 values with their own code for the noise, which must agree bit for bit."""
    n = 50_001
    x = torch.randn(n, generator=torch.Generator().manual_seed(4))
    results = []
    for one_pass in (True, False):
        path = path_of(one_pass)
        master = x.to(torch.bfloat16)
        assert path == adamw_step(master, torch.zeros(n), torch.zeros(n), master, [(0, n, False)],
                   AdamWStep(1, 0.0, 1.0, BETAS, EPS, 0.0), 1, one_pass, grad=torch.zeros(n, dtype=torch.bfloat16),
                   rounding_key=12345)
        results.append(master)
    assert torch.equal(results[0].view(torch.int16), results[1].view(torch.int16))


@pytest.mark.parametrize("master,moments", ALL)
def test_bytes_per_param(master, moments):
    expected = {("fp32", "fp32"): 14, ("fp32", "bf16"): 10, ("fp32", "int8"): 8, ("bf16", "int8"): 6,
                ("bf16", "fp32"): 12, ("bf16", "bf16"): 8}[(master, moments)]
    scales = 8 / precision.QUANT_BLOCK if moments == "int8" else 0
    fmt = StateFormat(master, moments)
    assert fmt.bytes_per_param(2) == expected + scales
    store = ShardStore(PRESETS["tiny-llama"], [1], torch.bfloat16, state_format=fmt)
    n = store.layers[1].layout.numel
    assert store.host_bytes() == n * expected + (8 * precision.num_blocks(n) if scales else 0)


# ---- through the trainer: exact resume, conversion, refusals --------------------------------------

def trainer_config(master: str, moments: str, steps: int = 10):
    return config_from_dict({
        "model": {"preset": "tiny-llama", "compute_dtype": "bfloat16", "init_std": 0.2},
        "optim": {"lr": 3e-3, "warmup_steps": 2, "master": master, "moments": moments},
        "train": {"steps": steps, "grad_accum": 1, "micro_batch_size": 1, "seed": 5},
        "executor": {"device": "cpu", "compile": False, "loss_chunk_tokens": 16},
    })


@pytest.mark.parametrize("master,moments", NAMED)
def test_ten_steps_equal_five_then_resume_five(tmp_path, master, moments):
    """Through the stores and the streaming trainer: a checkpoint holds the state as it is (bf16, int8
    and scales), the update counts key the rounding noise, so the resumed steps are the same bits."""
    arch = PRESETS["tiny-llama"]
    data = random_micro_batches(arch, 10, 1, batch=1, seq=8, seed=1)
    losses, split, final, resumed = whole_and_resumed(trainer_config(master, moments), arch, data, 5, tmp_path)
    assert split == losses
    for layer in final:
        a, _ = ckpt.read_layer_state(final[layer], layer)
        b, steps = ckpt.read_layer_state(resumed[layer], layer)
        assert steps == 10 and a.keys() == b.keys()
        assert precision.held_format(a) == StateFormat(master, moments)
        for key in a:
            assert torch.equal(a[key].view(torch.uint8), b[key].view(torch.uint8)), (layer, key)


def whole_and_resumed(config, arch, data, half: int, tmp_path: Path):
    """Every step of `data` in one run, and the same steps as `half` of them, a checkpoint (under
    tmp_path/half) and the rest resumed from it into another split of the layers across stores: each
    run's losses and final checkpoint files (layer to file)."""
    whole = LocalTrainer(config, arch, num_stores=2)
    losses = [whole.train_step(batches).loss for batches in data]
    (tmp_path / "whole").mkdir()
    final = save(whole, tmp_path / "whole")
    whole.close()

    first = LocalTrainer(config, arch, num_stores=2)
    split = [first.train_step(batches).loss for batches in data[:half]]
    (tmp_path / "half").mkdir()
    files = save(first, tmp_path / "half")
    first.close()
    second = LocalTrainer(config, arch, num_stores=1)  # another split of the layers across stores
    for store in second.stores:
        shard.load_layers(store, files)
    second.lr_schedule.updates_done = half
    split += [second.train_step(batches).loss for batches in data[half:]]
    (tmp_path / "split").mkdir()
    resumed = save(second, tmp_path / "split")
    second.close()
    return losses, split, final, resumed


def tensor_bytes(directory: Path) -> int:
    """The bytes of the tensors in a directory's safetensors files: each file's size less its header
    (an 8-byte length, then that many bytes of JSON)."""
    total = 0
    for file in directory.glob("*.safetensors"):
        with open(file, "rb") as f:
            total += file.stat().st_size - 8 - int.from_bytes(f.read(8), "little")
    return total


@pytest.mark.parametrize("master,moments", [("fp32", "fp32"), *NAMED])
def test_the_size_the_disk_check_expects_is_what_a_checkpoint_writes(tmp_path, master, moments):
    """The room the start checks for (checkpoint_bytes: a warning when the disk has less) is the
    bytes of the tensors the stores write, in each state format: 12 bytes a parameter in fp32,
    down to 4 and the int8 scales."""
    arch = PRESETS["tiny-llama"]
    config = trainer_config(master, moments, steps=1)
    trainer = LocalTrainer(config, arch, num_stores=2)
    trainer.train_step(random_micro_batches(arch, 1, 1, batch=1, seq=8, seed=1)[0])
    save(trainer, tmp_path)
    trainer.close()
    assert tensor_bytes(tmp_path) == ckpt.checkpoint_bytes(config, arch)


def test_an_exact_checkpoint_resumes_lean_converted(tmp_path):
    arch = PRESETS["tiny-llama"]
    data = random_micro_batches(arch, 3, 2, batch=2, seq=16, seed=1)
    exact = LocalTrainer(trainer_config("fp32", "fp32"), arch)
    for batches in data:
        exact.train_step(batches)
    files = save(exact, tmp_path)
    exact.close()
    lean = ShardStore(arch, list(range(len(files))), torch.bfloat16, state_format=StateFormat("bf16", "int8"))
    shard.load_layers(lean, files)
    for layer, state in lean.layers.items():
        saved, step = ckpt.read_layer_state(files[layer], layer)
        assert state.updates == step == 3
        assert torch.equal(state.master, saved["master"].to(torch.bfloat16))  # the exact run's compute copy
        qm, sm = precision.quantize_signed(saved["exp_avg"])
        qv, sv = precision.quantize_sqrt(saved["exp_avg_sq"])
        assert torch.equal(state.exp_avg, qm) and torch.equal(state.exp_avg_sq, qv)
        assert torch.equal(state.scales[0], sm) and torch.equal(state.scales[1], sv)


@pytest.mark.parametrize("saved,wanted", [(("bf16", "int8"), ("fp32", "int8")), (("fp32", "int8"), ("fp32", "bf16")),
                                          (("fp32", "bf16"), ("fp32", "fp32"))])
def test_widening_the_state_on_resume_is_refused_with_the_reason(saved, wanted):
    meta = {"config": {"optim": {"master": saved[0], "moments": saved[1]}}}
    with pytest.raises(ckpt.CheckpointError, match="can narrow the state, not widen"):
        ckpt.check_state_format(meta, trainer_config(*wanted), Path("ck"))
    ckpt.check_state_format({"config": {"optim": {}}}, trainer_config(*saved), Path("ck"))  # an exact run's: any


def test_lean_settings_are_checked():
    with pytest.raises(ConfigError, match="needs model.compute_dtype=bfloat16"):
        config_from_dict({"model": {"preset": "tiny-llama", "compute_dtype": "float32"}, "optim": {"master": "bf16"}})
    with pytest.raises(ConfigError, match="optim.moments must be fp32, bf16 or int8"):
        config_from_dict({"model": {"preset": "tiny-llama"}, "optim": {"moments": "int4"}})
    with pytest.raises(ConfigError, match="embedding_step"):
        config_from_dict({"model": {"preset": "tiny-llama"}, "optim": {"moments": "int8"},
                          "executor": {"embedding_step": "device"}})


def test_six_bytes_a_parameter_resume_exactly_through_the_driver(local_ray, tmp_path):
    """The Ray path: stores in actors, the bf16 master and its gradient buffer in shared memory, the
    checkpoint written by the stores; 4 steps equal 2 + resume + 2 (from the 4 steps' checkpoint of
    step 2: the resumed steps past the LR's warmup), bit for bit. Resuming it as an fp32 run is refused
    before anything starts."""
    lean = {"model": {"compute_dtype": "bfloat16"}, "optim": {"master": "bf16", "moments": "int8"}}

    def config(run: str, export: bool = False, **optim):
        raw = tiny_raw(tmp_path / run, steps=4, **lean)
        raw["optim"].update(optim)
        raw["checkpoint"]["every"] = 2
        raw["checkpoint"]["export_hf"] = export
        return config_from_dict(raw)

    whole = run_training(config("whole", export=True))
    as_stood_at(tmp_path / "whole", tmp_path / "split", 2)  # its checkpoint of step 2: two runs, not three
    resumed = run_training(config("split"), resume="latest")
    a, b = Path(whole["checkpoint"]), Path(resumed["checkpoint"])
    assert a.name == b.name == "step-00000004"
    ta, tb = tensors_of(a), tensors_of(b)
    assert ta.keys() == tb.keys() and any(k.endswith("exp_avg_sq_scale") for k in ta)
    assert {t.dtype for k, t in ta.items() if k.endswith(".master")} == {torch.bfloat16}
    for name in ta:
        assert torch.equal(ta[name].view(torch.uint8), tb[name].view(torch.uint8)), name
    assert whole["final_loss"] == resumed["final_loss"]
    # the room the start checked for is what the run's checkpoint holds, less kilobytes of headers and metadata
    assert tensor_bytes(b) == ckpt.checkpoint_bytes(config("split"), PRESETS["tiny-llama"])
    assert sum(f.stat().st_size for f in b.iterdir()) - tensor_bytes(b) < 64 * 1024, sorted(b.iterdir())
    exported = {}  # the Hugging Face export: the bf16 master, in checkpoint.export_dtype (float32)
    for file in (a / "hf").glob("*.safetensors"):
        exported.update(load_file(str(file)))
    embed = exported["model.embed_tokens.weight"]
    assert embed.dtype == torch.float32 and torch.equal(embed.flatten(), ta["layers.0.master"].float())
    with pytest.raises(ckpt.CheckpointError, match="not widen"):
        run_training(config("split", master="fp32", moments="fp32", lr=1e-3), resume="latest")


@pytest.mark.gpu
@pytest.mark.parametrize("master,moments", NAMED)
def test_lean_modes_train_on_the_gpu_like_fp32(master, moments):
    """The executor on CUDA with its gradients landing in the store's (pinned) buffers, its own for
    a bf16 master: ten steps' losses stay within 2% of the exact mode's on the same batches (bf16
    compute both ways). The same comparison on the CPU differs by 0.34%, 0.18% and 0.68% at most
    (10, 8 and 6 bytes): 2% leaves the GPU's other reduction orders three times that room."""
    arch = PRESETS["tiny-llama"]
    data = random_micro_batches(arch, 10, 2, batch=2, seq=32, seed=3, distinct=4)

    def losses(master, moments):
        raw = {"model": {"preset": "tiny-llama", "compute_dtype": "bfloat16", "init_std": 0.2},
               "optim": {"lr": 3e-3, "warmup_steps": 2, "master": master, "moments": moments},
               "train": {"steps": 10, "grad_accum": 2, "micro_batch_size": 2, "seed": 5},
               "executor": {"device": "cuda", "compile": False}}
        trainer = LocalTrainer(config_from_dict(raw), arch)
        try:
            return [trainer.train_step(batches).loss for batches in data]
        finally:
            trainer.close()

    exact, lean = losses("fp32", "fp32"), losses(master, moments)
    assert all(math.isfinite(x) for x in lean) and lean[-1] < lean[0]
    assert lean == pytest.approx(exact, rel=0.02)
