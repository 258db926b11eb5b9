"""Model shape: one frozen dataclass, read from a Hugging Face config.json or a named preset.

The fields here are the ones every family shares; a family whose models need more declares a
subclass with its own fields (models/family.py says how). Which family runs a shape is decided
by `model_type`, in models/registry.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (rope_type 'llama3'); None on the arch means plain RoPE."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelArch:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    # Fields that change the loss but not the tensors: a checkpoint or Hugging Face directory is
    # of the same model whatever their values (a router's auxiliary-loss settings).
    loss_fields: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "head_dim",
                     "num_kv_heads", "rms_norm_eps", "rope_theta", "max_position_embeddings"):
            if not getattr(self, name) > 0:
                raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    @property
    def stream_width(self) -> int:
        """The width of what flows from one layer to the next, per token: the hidden states (a
        family whose layers take more from the embedding widens it: models/transformers/)."""
        return self.hidden_size

    def replace(self, **changes: Any) -> "ModelArch":
        return dataclasses.replace(self, **changes)

    def model_fields(self) -> list[str]:
        """The fields that must agree for weights to be this model's."""
        return [f.name for f in dataclasses.fields(self) if f.name not in self.loss_fields]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields, as checkpoints record them."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> "ModelArch":
        fields = dict(fields)
        if fields.get("rope_scaling"):
            fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
        return cls(**fields)
