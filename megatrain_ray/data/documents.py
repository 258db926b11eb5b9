"""What every stage of the pipeline passes on: where a row came from, documents, rows, positions.

A `Document` is one example in input space with its labels already shifted: `labels[t]` is the
target of position t (the next token), IGNORE_INDEX where no loss is taken.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from megatrain_ray.data.formats import format_hint

IGNORE_INDEX = -100


class DataError(ValueError):
    """Data (or a data setting) the user must fix; the message names the file and row."""


class BadRow(DataError):
    """One row that cannot be trained on (malformed JSON, a missing column, a token outside the
    vocabulary, ...): `data.bad_rows` skips and counts it by `reason`, or stops the run
    (data/bad_rows.py). The message names the file, the row and the line."""

    def __init__(self, origin: "Origin", reason: str, detail: str):
        super().__init__(f"{origin}: {detail}")
        self.origin, self.reason = origin, reason


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
    """Where a document came from. `row` is the row's index in its file (from 0: the held-out hash
    reads it); messages count rows and lines from 1, as editors and `sed -n 3p` count lines."""

    path: str
    row: int
    line: int | None = None

    def __str__(self) -> str:
        line = f"line {self.line}, " if self.line is not None else ""
        return f"{self.path} row {self.row + 1} ({line}counting from 1)"


@dataclass(frozen=True)
class Document:
    """One example in input space: labels are already shifted (labels[t] = target of position t)."""

    input_ids: np.ndarray
    labels: np.ndarray
    origin: Origin
    skip: str | None = None  # why a row gives nothing to train on, when that is known before tokenizing
    bad: BadRow | None = None  # a bad row skipped under data.bad_rows=skip (skip holds its reason)
    images: Any = None  # an image-text row's inputs for the vision side (data/image_text.py, ImageInputs)

    def __len__(self) -> int:
        return len(self.input_ids)

    def has_targets(self) -> bool:
        return bool((self.labels != IGNORE_INDEX).any())

    def piece(self, start: int, stop: int) -> "Document":
        """Positions start..stop; an image-text document only whole (its image tokens cannot be cut)."""
        whole = start == 0 and stop >= len(self)
        return Document(self.input_ids[start:stop], self.labels[start:stop], self.origin,
                        images=self.images if whole else None)

    @classmethod
    def skipped(cls, origin: Origin, reason: str) -> "Document":
        """A row that trains nothing, and why (data/summary.py counts them by reason)."""
        empty = np.zeros(0, dtype=np.int64)
        return cls(empty, empty, origin, reason)

    @classmethod
    def of_bad_row(cls, error: BadRow) -> "Document":
        """A bad row, skipped (data/bad_rows.py counts them against data.max_bad_fraction)."""
        return replace(cls.skipped(error.origin, error.reason), bad=error)


@dataclass(frozen=True)
class Row:
    """One sequence of exactly seq_len positions."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    images: Any = None  # an image-text row's inputs for the vision side (its one document's)


RowBatch = list[tuple[Origin, dict[str, Any]]]  # a reader's rows: a row may be the BadRow it is (malformed JSON)


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
        raise BadRow(origin, f"null {column!r}", f"column {column!r} is null")
    try:
        array = np.asarray(value)
    except (ValueError, TypeError):
        array = np.asarray([], dtype=object)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iub"):
        raise BadRow(origin, f"{column!r} not a list of integers",
                     f"column {column!r} must be a list of integers, got {str(value)[:80]}")
    return array.astype(np.int64, copy=False)


def check_token_ids(ids: np.ndarray, vocab_size: int, origin: Origin, column: str, allow_ignore: bool = False) -> None:
    bad = (ids < 0) | (ids >= vocab_size)
    if allow_ignore:
        bad &= ids != IGNORE_INDEX
    if bad.any():
        at = int(np.argmax(bad))
        raise BadRow(origin, "token id outside the vocabulary",
                     f"{column}[{at}] = {int(ids[at])} is outside [0, {vocab_size}) (the model's vocab_size); "
                     "was the data made with another tokenizer?")


def missing_column(origin: Origin, column: str, row: dict[str, Any], fmt: str) -> BadRow:
    """A row without a column its format needs; the format its columns suggest, if another."""
    has = ", ".join(sorted(row)) or "nothing"
    hint = format_hint(list(row), fmt, column if fmt == "text" else "text", one_row=True)
    return BadRow(origin, f"missing column '{column}'", f"missing column '{column}' (has: {has}){hint}")


def text_of(row: dict[str, Any], column: str, origin: Origin, fmt: str) -> str:
    if column not in row:
        raise missing_column(origin, column, row, fmt)
    value = row[column]
    if not isinstance(value, str):
        raise BadRow(origin, f"{column!r} not a string",
                     f"column {column!r} must be a string, got {type(value).__name__}")
    return value
