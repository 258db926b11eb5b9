"""What every stage of the pipeline passes on: where a row came from, documents, rows, positions.

A `Document` is one example in input space with its labels already shifted: `labels[t]` is the
target of position t (the next token), IGNORE_INDEX where no loss is taken.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

IGNORE_INDEX = -100


class DataError(ValueError):
    """Data (or a data setting) the user must fix; the message names the file and row."""


@dataclass(frozen=True)
class DataPosition:
    """`index` rows (sequences) of epoch `epoch` have been consumed; the next row follows."""

    epoch: int = 0
    index: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DataPosition":
        try:
            epoch, index = d["epoch"], d["index"]
        except (KeyError, TypeError):
            raise DataError(f"a data position needs 'epoch' and 'index', got {d!r}") from None
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (epoch, index)):
            raise DataError(f"a data position holds non-negative integers, got {d!r}")
        return cls(epoch, index)


@dataclass(frozen=True)
class Origin:
    """Where a document came from, for error messages. Rows count from 0; lines from 1."""

    path: str
    row: int
    line: int | None = None

    def __str__(self) -> str:
        line = f" (line {self.line})" if self.line is not None else ""
        return f"{self.path} row {self.row}{line}"


@dataclass(frozen=True)
class Document:
    """One example in input space: labels are already shifted (labels[t] = target of position t)."""

    input_ids: np.ndarray
    labels: np.ndarray
    origin: Origin
    skip: str | None = None  # why a row gives nothing to train on, when that is known before tokenizing

    def __len__(self) -> int:
        return len(self.input_ids)

    def has_targets(self) -> bool:
        return bool((self.labels != IGNORE_INDEX).any())

    def piece(self, start: int, stop: int) -> "Document":
        return Document(self.input_ids[start:stop], self.labels[start:stop], self.origin)

    @classmethod
    def skipped(cls, origin: Origin, reason: str) -> "Document":
        """A row that trains nothing, and why (data/summary.py counts them by reason)."""
        empty = np.zeros(0, dtype=np.int64)
        return cls(empty, empty, origin, reason)


@dataclass(frozen=True)
class Row:
    """One sequence of exactly seq_len positions."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray


RowBatch = list[tuple[Origin, dict[str, Any]]]


def shifted_document(tokens: np.ndarray, targets: np.ndarray, origin: Origin) -> Document:
    """Unshifted targets (target i = train on predicting token i) to per-position labels."""
    labels = np.full(len(tokens), IGNORE_INDEX, dtype=np.int64)
    labels[:-1] = targets[1:]
    return Document(np.asarray(tokens, dtype=np.int64), labels, origin)


def masked_document(tokens: np.ndarray, trained: np.ndarray, origin: Origin) -> Document:
    """Train on predicting exactly the tokens where `trained` is set."""
    tokens = np.asarray(tokens, dtype=np.int64)
    return shifted_document(tokens, np.where(trained, tokens, IGNORE_INDEX), origin)


def as_int_array(value: Any, origin: Origin, column: str) -> np.ndarray:
    if value is None:
        raise DataError(f"{origin}: column {column!r} is null")
    try:
        array = np.asarray(value)
    except (ValueError, TypeError):
        array = np.asarray([], dtype=object)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iub"):
        raise DataError(f"{origin}: column {column!r} must be a list of integers, got {str(value)[:80]}")
    return array.astype(np.int64, copy=False)


def check_token_ids(ids: np.ndarray, vocab_size: int, origin: Origin, column: str, allow_ignore: bool = False) -> None:
    bad = (ids < 0) | (ids >= vocab_size)
    if allow_ignore:
        bad &= ids != IGNORE_INDEX
    if bad.any():
        at = int(np.argmax(bad))
        raise DataError(
            f"{origin}: {column}[{at}] = {int(ids[at])} is outside [0, {vocab_size}) (the model's vocab_size); "
            "was the data made with another tokenizer?"
        )


def text_of(row: dict[str, Any], column: str, origin: Origin) -> str:
    if column not in row:
        raise DataError(f"{origin}: missing column {column!r} (has: {', '.join(sorted(row)) or 'nothing'})")
    value = row[column]
    if not isinstance(value, str):
        raise DataError(f"{origin}: column {column!r} must be a string, got {type(value).__name__}")
    return value
