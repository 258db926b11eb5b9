"""What the benchmark and its baselines run: step shapes, random tokens, and the FLOPs they count.

Model FLOPs are the usual count: 6 x (parameters doing matmuls) x tokens, plus causal attention
(the family says how much); recomputation is not counted as model work, so MFU is against useful
FLOPs only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.registry import family


@dataclass(frozen=True)
class Shape:
    """One step's shape: micro_batch sequences of seq_len tokens, grad_accum times."""

    seq_len: int
    micro_batch: int
    grad_accum: int
    keep_graphs: int | None = None  # executor.keep_graphs; None: as many as fit

    @property
    def tokens(self) -> int:
        return self.seq_len * self.micro_batch * self.grad_accum

    def __str__(self) -> str:
        kept = "" if self.keep_graphs is None else f", executor.keep_graphs {self.keep_graphs}"
        return f"seq {self.seq_len}, micro-batch {self.micro_batch} x {self.grad_accum} = {self.tokens} tokens/step{kept}"


def matmul_params(arch: ModelArch) -> int:
    """Parameters that take part in a matmul per token: all but the input embedding lookup."""
    return family(arch).matmul_params(arch)


def model_flops_per_token(arch: ModelArch, seq_len: int) -> float:
    return 6 * matmul_params(arch) + family(arch).attention_flops_per_token(arch, seq_len)


def random_micro_batches(arch: ModelArch, seq_len: int, micro_batch: int, grad_accum: int, seed: int):
    """One optimizer step of random tokens (numpy int64, unpacked rows), the same for every system
    a comparison runs: the streaming trainer gets them as they are, the baselines as tensors."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(grad_accum):
        ids = rng.integers(0, arch.vocab_size, size=(micro_batch, seq_len + 1), dtype=np.int64)
        out.append({
            "input_ids": ids[:, :-1].copy(),
            "labels": ids[:, 1:].copy(),
            "position_ids": np.broadcast_to(np.arange(seq_len, dtype=np.int64), (micro_batch, seq_len)).copy(),
        })
    return out


def synthetic_micro_batches(arch: ModelArch, seq_len: int, micro_batch: int, grad_accum: int,
                            seed: int) -> list[dict[str, torch.Tensor]]:
    """The same tokens as CPU int64 tensors, for the baselines."""
    return [{k: torch.from_numpy(v) for k, v in mb.items()}
            for mb in random_micro_batches(arch, seq_len, micro_batch, grad_accum, seed)]
