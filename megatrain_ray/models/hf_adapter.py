"""Hugging Face names in and out: config.json keys to arch fields and back, by the tables the
families declare.

A family says which of its arch's fields config.json holds, under which key, with what default
(`HfField`); `read_fields` and `write_fields` apply that table both ways, and `overridable_keys`
says which config.json key a shared field name in model.overrides stands for. What a table cannot
say (checks that refuse a config, RoPE's scaling, a value computed from several keys) stays in the
family's `arch_from_hf` / `hf_config`, beside the table's fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

REQUIRED = object()  # a field without a default: config.json must hold it


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class HfField:
    """One arch field and its config.json key. Read: `config[hf]`, or `default` where the key is
    absent; with a `fallback` (a function of the fields read before it) or other spellings (`also`),
    the first of them that is set (not None, not 0) counts. `read` converts what config.json holds,
    `write` what the arch holds."""

    arch: str
    hf: str
    read: Callable[[Any], Any] = _same
    default: Any = REQUIRED
    fallback: Callable[[dict[str, Any]], Any] | None = None
    also: tuple[str, ...] = ()
    write: Callable[[Any], Any] = _same

    def value_in(self, config: dict[str, Any], read_so_far: dict[str, Any]) -> Any:
        if self.fallback is None and not self.also:
            return self.read(config[self.hf] if self.default is REQUIRED else config.get(self.hf, self.default))
        value = next((config[key] for key in (self.hf, *self.also) if config.get(key)), None)
        if value is None and self.fallback is not None:
            value = self.fallback(read_so_far)
        return self.read(value)


# The shape every decoder's config.json spells alike (Llama's defaults).
DECODER_FIELDS: tuple[HfField, ...] = (
    HfField("vocab_size", "vocab_size"),
    HfField("hidden_size", "hidden_size"),
    HfField("intermediate_size", "intermediate_size"),
    HfField("num_layers", "num_hidden_layers"),
    HfField("num_heads", "num_attention_heads"),
    HfField("num_kv_heads", "num_key_value_heads", fallback=lambda read: read["num_heads"]),
    HfField("head_dim", "head_dim", fallback=lambda read: read["hidden_size"] // read["num_heads"]),
    HfField("rms_norm_eps", "rms_norm_eps", float, 1e-6),
    HfField("tie_word_embeddings", "tie_word_embeddings", bool, False),
    HfField("max_position_embeddings", "max_position_embeddings", int, 4096),
)


def with_defaults(fields: tuple[HfField, ...], **defaults: Any) -> tuple[HfField, ...]:
    """The table with other defaults for the named fields (a family whose config class defaults differ)."""
    return tuple(dataclasses.replace(f, default=defaults[f.arch]) if f.arch in defaults else f for f in fields)


def without(fields: tuple[HfField, ...], *names: str) -> tuple[HfField, ...]:
    """The table less the named arch fields (a family that computes them, or does not write them)."""
    return tuple(f for f in fields if f.arch not in names)


def read_fields(config: dict[str, Any], fields: tuple[HfField, ...]) -> dict[str, Any]:
    """The arch fields that a config.json holds, by the table, in the table's order."""
    read: dict[str, Any] = {}
    for field in fields:
        read[field.arch] = field.value_in(config, read)
    return read


def write_fields(arch: Any, fields: tuple[HfField, ...]) -> dict[str, Any]:
    """The config.json keys of the arch's fields, by the table."""
    return {field.hf: field.write(getattr(arch, field.arch)) for field in fields}


def overridable_keys(fields: tuple[HfField, ...] = DECODER_FIELDS) -> dict[str, str]:
    """Arch field -> the config.json key it stands for, where they are spelled differently."""
    return {field.arch: field.hf for field in fields if field.arch != field.hf}
