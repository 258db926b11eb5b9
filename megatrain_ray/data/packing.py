"""Documents into rows of exactly seq_len positions, rows into micro-batches.

- `position_ids` restart at 0 at each document packed into a row (and at each chunk of a split
  document); the executor builds its block-diagonal mask from those restarts, so each document
  attends only to itself. Padding (token 0) continues the positions of the row's last document,
  so an unpacked row needs no mask at all.
- Documents longer than seq_len: with `truncate=False` they are a `DataError` naming the file
  and row. With `truncate=True`, pretraining documents (formats tokens, text, synthetic) are split
  into seq_len chunks, nothing lost (when packing, a document flows over into the next row);
  SFT examples (alpaca, sharegpt) keep their first seq_len positions, the rest is dropped.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np

from megatrain_ray.data.documents import IGNORE_INDEX, DataError, Document, Row
from megatrain_ray.data.image_text import stack_image_inputs


def fit_length(doc: Document, seq_len: int, truncate: bool, splittable: bool) -> Document:
    """Refuse, keep (to be split later) or cut a document longer than seq_len, as the module docstring says."""
    if len(doc) <= seq_len or (truncate and splittable):
        return doc
    if not truncate:
        raise DataError(
            f"{doc.origin}: {len(doc)} tokens, longer than data.seq_len={seq_len}; "
            "raise seq_len, or set data.truncate=true to split (pretraining) or cut (SFT) long documents"
        )
    return doc.piece(0, seq_len)


def make_row(pieces: list[Document], seq_len: int) -> Row:
    """Pieces side by side, positions restarting at each; padding continues the last piece's positions."""
    fill = sum(len(p) for p in pieces)
    positions = [np.arange(len(p), dtype=np.int64) for p in pieces[:-1]]
    positions.append(np.arange(seq_len - fill + len(pieces[-1]), dtype=np.int64))
    pad = seq_len - fill
    return Row(
        np.concatenate([p.input_ids for p in pieces] + [np.zeros(pad, dtype=np.int64)]),
        np.concatenate([p.labels for p in pieces] + [np.full(pad, IGNORE_INDEX, dtype=np.int64)]),
        np.concatenate(positions),
        pieces[0].images if len(pieces) == 1 else None,
    )


def empty_row(seq_len: int) -> Row:
    """A row of padding only: no target, positions as an unpacked row's (it fills a micro-batch)."""
    return Row(np.zeros(seq_len, dtype=np.int64), np.full(seq_len, IGNORE_INDEX, dtype=np.int64),
               np.arange(seq_len, dtype=np.int64))


def packed_rows(docs: Iterable[Document], seq_len: int, splittable: bool) -> Iterator[Row]:
    """Fill rows with documents. Splittable documents flow over into the next row (no padding);
    others (SFT, at most seq_len long) start a new row when they do not fit."""
    pieces: list[Document] = []
    fill = 0
    for doc in docs:
        if not splittable and pieces and len(doc) > seq_len - fill:
            yield make_row(pieces, seq_len)
            pieces, fill = [], 0
        start = 0
        while start < len(doc):
            take = min(len(doc) - start, seq_len - fill)
            pieces.append(doc.piece(start, start + take))
            fill, start = fill + take, start + take
            if fill == seq_len:
                yield make_row(pieces, seq_len)
                pieces, fill = [], 0
    if pieces:
        yield make_row(pieces, seq_len)


def unpacked_rows(docs: Iterable[Document], seq_len: int) -> Iterator[Row]:
    """One document (or one seq_len chunk of a split document) per row, padded."""
    for doc in docs:
        for start in range(0, len(doc), seq_len):
            chunk = doc.piece(start, start + seq_len)
            if chunk.has_targets():
                yield make_row([chunk], seq_len)


def stack_rows(rows: list[Row]) -> dict[str, np.ndarray]:
    """The rows as one micro-batch; image-text rows add their image inputs (data/image_text.py)."""
    return {
        "input_ids": np.stack([r.input_ids for r in rows]),
        "labels": np.stack([r.labels for r in rows]),
        "position_ids": np.stack([r.position_ids for r in rows]),
        **stack_image_inputs(rows, len(rows[0].input_ids)),
    }
