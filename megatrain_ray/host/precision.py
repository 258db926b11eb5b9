"""How a layer's optimizer state is held: fp32 (exact, the default) or lean (optim.master, optim.moments).

Per parameter, on the host:
- master weights: fp32 (4 bytes), or bf16 (2) updated with stochastic rounding, in which case the
  master is itself the compute copy the executor streams;
- AdamW's two moments: fp32 (4 + 4), bf16 (2 + 2, rounded to nearest even), or int8 (1 + 1, and a
  fp32 scale per block of QUANT_BLOCK elements of each);
- the compute copy (the compute dtype), which the gradient reuses while the master is fp32; a bf16
  master cannot be overwritten by its gradient, so the gradient gets its own bf16 buffer.
So 14, 10, 8 (+ scales) and, bf16 master with int8 moments, 6 (+ scales) bytes per parameter.

int8 moments are quantized block by block to the block's largest magnitude, on a square-root map
(a code q stands for scale * (q / Q)^2): small values keep relative precision where a linear map of
8 bits would flush them to zero. The first moment is signed (codes -127..127). The second moment is
held as its square root (codes 0..255, so v = (scale * (q / 255)^2)^2), rounded to nearest but never
to code 0 where it was not zero: a second moment that became zero would make Adam's step m / sqrt(v)
explode.

Stochastic rounding of the bf16 master draws its noise from a counter-based hash of (train.seed,
layer, the layer's update count, element index): the same in any thread split, and the same again
after a resume. The C++ kernel (host/adamw_kernel.py) and the torch functions here compute the same
codes and the same noise; these are the fallback path's and the conversions'.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QUANT_BLOCK = 256  # elements per int8 block: each block's scale costs 4 bytes, 1/64 byte a parameter
SIGNED_LEVELS = 127  # first moment: codes -127..127
SQRT_LEVELS = 255  # second moment's square root: codes 0..255
MASTERS = ("fp32", "bf16")
MOMENTS = ("fp32", "bf16", "int8")  # widest first
OPTIMIZERS = ("adamw", "muon")  # optim.name: muon holds one moment (its momentum) for the blocks' matrices
SCALE_KEYS = ("exp_avg_scale", "exp_avg_sq_scale")  # int8 moments' block scales, by the moment they scale
MASK32 = 0xFFFFFFFF
# The kernel multiplies by these fp32 reciprocals (1.0f / 127.0f, 1.0f / 255.0f), exact in a Python float.
INV_SIGNED = float(np.float32(1.0) / np.float32(SIGNED_LEVELS))
INV_SQRT = float(np.float32(1.0) / np.float32(SQRT_LEVELS))


@dataclass(frozen=True)
class StateFormat:
    """optim.master and optim.moments: the dtypes of a layer's optimizer state; optim.name: which
    optimizer's (Muon's block matrices hold one moment, its momentum: host/muon.py)."""

    master: str = "fp32"
    moments: str = "fp32"
    optimizer: str = "adamw"

    def __post_init__(self):
        if self.master not in MASTERS or self.moments not in MOMENTS or self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optim.master must be one of {MASTERS}, optim.moments one of {MOMENTS} and optim.name "
                             f"one of {OPTIMIZERS}, got {self.master!r}, {self.moments!r} and {self.optimizer!r}")
        if self.optimizer == "muon" and self.quantized:
            raise ValueError("optim.name=muon holds its momentum in fp32 or bf16, not int8")

    @property
    def exact(self) -> bool:
        return self.master == "fp32" and self.moments == "fp32"

    @property
    def quantized(self) -> bool:
        return self.moments == "int8"

    def moment_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        return {"fp32": (torch.float32, torch.float32), "bf16": (torch.bfloat16, torch.bfloat16),
                "int8": (torch.int8, torch.uint8)}[self.moments]

    def bytes_per_param(self, compute_bytes: int) -> float:
        """Host bytes per parameter: master, moments (and their int8 scales), compute copy or gradient."""
        master = self.master_dtype().itemsize
        return master + self.moment_bytes() + (compute_bytes if self.master == "fp32" else 2)

    def master_dtype(self) -> torch.dtype:
        return torch.float32 if self.master == "fp32" else torch.bfloat16

    def held_bytes(self, numel: int, trained: int, second: int | None = None) -> int:
        """Bytes of a layer's optimizer state as held and as a checkpoint writes it (host/store.py,
        LayerState.tensors; no compute copy): the master of its `numel` parameters, the two moments
        (and their int8 block scales, fp32) of its `trained` ones; `second`: the elements of the
        second moment where fewer (a Muon block's: its AdamW tensors only, host/muon.py)."""
        m, v = self.moment_dtypes()
        second = trained if second is None else second
        scales = 2 * num_blocks(trained) * torch.float32.itemsize if self.quantized else 0
        return numel * self.master_dtype().itemsize + trained * m.itemsize + second * v.itemsize + scales

    def moment_bytes(self) -> float:
        """Host bytes per parameter of its moments (and their int8 scales): none for a frozen one; with
        Muon, a block matrix's one (its momentum)."""
        if self.optimizer == "muon":
            return {"fp32": 4, "bf16": 2}[self.moments]
        return {"fp32": 8, "bf16": 4, "int8": 2 + 2 * 4 / QUANT_BLOCK}[self.moments]

    def describe(self) -> str:
        master = "fp32 master" if self.master == "fp32" else "bf16 master (stochastic rounding, the compute copy)"
        moments = {"fp32": "2 fp32 AdamW moments", "bf16": "2 bf16 AdamW moments",
                   "int8": f"2 int8 AdamW moments (a scale per {QUANT_BLOCK})"}[self.moments]
        if self.optimizer == "muon":
            moments = f"1 {self.moments} Muon momentum (the blocks' matrices; AdamW's 2 moments for the rest)"
        grad = "compute copy, which the gradient reuses" if self.master == "fp32" else "a bf16 gradient buffer"
        return f"{master} + {moments} + {grad}"

    def narrower_or_same(self, other: "StateFormat") -> bool:
        """Whether state held as `other` can be converted to this format (precision only dropped)."""
        return (MASTERS.index(self.master) >= MASTERS.index(other.master)
                and MOMENTS.index(self.moments) >= MOMENTS.index(other.moments))


def format_of(optim) -> StateFormat:
    """The state format an OptimConfig asks for (optim.master, optim.moments)."""
    return StateFormat(optim.master, optim.moments, optim.name)


def num_blocks(numel: int) -> int:
    return (numel + QUANT_BLOCK - 1) // QUANT_BLOCK


# ---------------------------------------------------------------------------------------------
# int8 blocks, in torch (the kernel's arithmetic, op by op)
# ---------------------------------------------------------------------------------------------


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """x as rows of QUANT_BLOCK (the last row padded with zeros, which change no block's maximum)."""
    pad = (-x.numel()) % QUANT_BLOCK
    return torch.nn.functional.pad(x, (0, pad)).view(-1, QUANT_BLOCK)


def quantize_signed(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 -> (int8 codes, fp32 scale per block): q = round(127 * sqrt(|x| / absmax)) with x's sign."""
    rows = _blocks(x)
    scale = rows.abs().amax(dim=1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(torch.sqrt(rows.abs() * (1.0 / safe)[:, None]) * float(SIGNED_LEVELS))
    q = torch.where(rows < 0, -q, q)
    return q.to(torch.int8).flatten()[: x.numel()], scale


def dequantize_signed(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    t = _blocks(q.to(torch.float32)) * INV_SIGNED
    return (scale[:, None] * (t * t.abs())).flatten()[: q.numel()]


def quantize_sqrt(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A non-negative second moment -> (uint8 codes of sqrt(v), fp32 scale = the block's largest sqrt(v));
    nearest code, but at least 1 where v > 0."""
    s = torch.sqrt(_blocks(v))
    scale = s.amax(dim=1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(torch.sqrt(s * (1.0 / safe)[:, None]) * float(SQRT_LEVELS))
    q = torch.where((s > 0) & (q < 1), torch.ones_like(q), q)
    return q.to(torch.uint8).flatten()[: v.numel()], scale


def dequantize_sqrt(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    t = _blocks(q.to(torch.float32)) * INV_SQRT
    s = scale[:, None] * (t * t)
    return (s * s).flatten()[: q.numel()]


# ---------------------------------------------------------------------------------------------
# Stochastic rounding to bf16, from a counter-based stream
# ---------------------------------------------------------------------------------------------


def rounding_key(seed: int, layer: int, update: int) -> int:
    """The 32-bit key of one layer's one update: its noise differs from every other's, and a resume
    (which restores the update count) draws the same again."""
    x = (seed * 0x9E3779B97F4A7C15 + layer * 0xBF58476D1CE4E5B9 + update * 0x94D049BB133111EB) & (2**64 - 1)
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & (2**64 - 1)
    x ^= x >> 32
    return x & MASK32


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) held in int64, without overflowing int64."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + ((x * hi) & 0xFFFF) * 65536) & MASK32


def noise16(key: int, start: int, count: int, device=None) -> torch.Tensor:
    """16 random bits (int64) for elements start..start+count-1:
    lowbias32(low32(i) * 0x9E3779B9 + key + high32(i) * 0x85EBCA6B) mod 2**16."""
    i = torch.arange(start, start + count, dtype=torch.int64, device=device)
    x = (_mul32(i & MASK32, 0x9E3779B9) + key + _mul32(i >> 32, 0x85EBCA6B)) & MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    x = x ^ (x >> 16)
    return x & 0xFFFF


def stochastic_round_bf16(x: torch.Tensor, key: int, start: int = 0) -> torch.Tensor:
    """fp32 -> bf16, rounded up with probability (the part below bf16's last bit) / (its step):
    add 16 random bits under bf16's mantissa, then truncate. NaN stays NaN."""
    bits = x.contiguous().view(torch.int32).to(torch.int64) & MASK32
    bits = ((bits + noise16(key, start, x.numel(), x.device)) >> 16) & 0xFFFF
    bits = torch.where(bits >= 0x8000, bits - 0x10000, bits)  # the same 16 bits, as int16 holds them
    out = bits.to(torch.int16).view(torch.bfloat16)
    return torch.where(x.isnan(), torch.full_like(out, float("nan")), out)


# ---------------------------------------------------------------------------------------------
# Converting an fp32 state (a checkpoint of an exact run) into a lean one
# ---------------------------------------------------------------------------------------------


def convert_moments(m: torch.Tensor, v: torch.Tensor, fmt: StateFormat) -> dict[str, torch.Tensor]:
    """Moments (any float dtype) as `fmt` holds them: exp_avg, exp_avg_sq and, for int8, their scales."""
    m, v = m.to(torch.float32), v.to(torch.float32)
    if fmt.moments == "fp32":
        return {"exp_avg": m, "exp_avg_sq": v}
    if fmt.moments == "bf16":
        return {"exp_avg": m.to(torch.bfloat16), "exp_avg_sq": v.to(torch.bfloat16)}
    qm, sm = quantize_signed(m)
    qv, sv = quantize_sqrt(v)
    return {"exp_avg": qm, "exp_avg_sq": qv, "exp_avg_scale": sm, "exp_avg_sq_scale": sv}


def moments_as_fp32(state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A state dict's moments in fp32, whatever format holds them."""
    m, v = state["exp_avg"], state["exp_avg_sq"]
    if m.dtype == torch.int8:
        return dequantize_signed(m, state["exp_avg_scale"]), dequantize_sqrt(v, state["exp_avg_sq_scale"])
    return m.to(torch.float32), v.to(torch.float32)


def held_format(tensors: dict[str, torch.Tensor]) -> StateFormat:
    """The format a layer's saved state is in, told from its dtypes."""
    master = "bf16" if tensors["master"].dtype == torch.bfloat16 else "fp32"
    moments = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.int8: "int8"}[tensors["exp_avg"].dtype]
    return StateFormat(master, moments)
