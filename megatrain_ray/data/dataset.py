"""The endless, deterministic stream of fixed-shape micro-batches of one data config.

Every stage is a pure function of (seed, epoch), so a checkpoint records only how many rows of
which epoch were consumed (`DataPosition`). Shuffling (`data.shuffle`): file order is permuted per
epoch, then documents pass through a buffer of `data.shuffle_buffer` documents. Files are read one
after another, so documents mix only within that window; shuffle offline if the files are sorted by
topic. Resuming replays the epoch's stream up to the recorded row (reads and tokenizes that prefix
again, then skips it). Documents left without any target (empty text, an SFT example truncated
before its response) are skipped, and so are bad rows under data.bad_rows=skip (bad_rows.py).

Validation data (`eval`): its own source, or a fraction of the training rows held out. A row is
held out by a hash of its file (relative to the data's root) and row number, not by the seed or
the order, so the same rows stay out of training in every epoch, every run and after a resume.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from megatrain_ray.config import DATA_FORMATS, DataConfig, EvalConfig
from megatrain_ray.data.bad_rows import BadRowCount, apply_policy
from megatrain_ray.data.chat_template import ChatTemplate, load_chat_template
from megatrain_ray.data.documents import BadRow, DataError, DataPosition, Document, Origin, Row, RowBatch
from megatrain_ray.data.image_text import (IMAGE_READ_ROWS, RowConverter, image_text_documents, in_order_on_threads,
                                           joined_axes)
from megatrain_ray.data.processor import load_image_text_processor
from megatrain_ray.data.packing import empty_row, fit_length, packed_rows, stack_rows, unpacked_rows
from megatrain_ray.data.readers import column_spec, detect_format, first_row_columns, read_rows, resolve_files
from megatrain_ray.data.sft import sft_documents
from megatrain_ray.data.synthetic import synthetic_documents
from megatrain_ray.data.tokenization import TextEncoder, text_documents, token_document, tokenizer_file

FORMATS = DATA_FORMATS
IMAGE_FORMAT = "sharegpt_images"  # image-text SFT rows, through the model's processor (image_text.py)
SFT_FORMATS = ("alpaca", "sharegpt")
SPLITTABLE_FORMATS = ("tokens", "text", "synthetic")


def shuffled(items: Iterable[Any], buffer_size: int, rng: np.random.Generator) -> Iterator[Any]:
    """A bounded shuffle: memory for buffer_size items, whatever the stream's length."""
    buffer: list[Any] = []
    for item in items:
        if len(buffer) < buffer_size:
            buffer.append(item)
            continue
        j = int(rng.integers(buffer_size))
        yield buffer[j]
        buffer[j] = item
    for j in rng.permutation(len(buffer)):
        yield buffer[j]


def seed_words(seed: int) -> int:
    """numpy seeds must be non-negative; any int seed maps to one."""
    return seed % 2**64


@dataclass(frozen=True)
class Holdout:
    """The rows whose hash falls below `fraction` are the held-out ones; `keep` says which side this is."""

    fraction: float
    keep: str  # "train" | "heldout"
    root: str

    def held_out(self, origin: Origin) -> bool:
        name = os.path.relpath(origin.path, self.root) if self.root else origin.path
        digest = hashlib.blake2b(f"{name}\0{origin.row}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") / 2**64 < self.fraction

    def admits(self, origin: Origin) -> bool:
        return self.held_out(origin) == (self.keep == "heldout")


class Dataset:
    """The micro-batch stream of one data config; see the module docstring."""

    def __init__(self, cfg: DataConfig, vocab_size: int, seed: int, files: list[Path], fmt: str,
                 encoder: TextEncoder | None, template: ChatTemplate | None = None, holdout: Holdout | None = None,
                 processor=None):
        self.cfg, self.vocab_size, self.seed = cfg, vocab_size, seed_words(seed)
        self.files, self.format, self.encoder = files, fmt, encoder
        self.template, self.holdout, self.processor = template, holdout, processor
        # how a micro-batch joins its rows' images (image_text.joined_axes): a probe of the processor, once
        self.image_joins = joined_axes(processor) if processor is not None else {}

    def describe(self) -> str:
        if self.format == "synthetic":
            return f"synthetic data, {self.cfg.synthetic_docs} documents per epoch"
        tok = f", tokenizer {self.encoder.path}" if self.encoder else ""
        if self.format == IMAGE_FORMAT:
            tok = f", the processor {type(self.processor).__name__} of {self.cfg.tokenizer}"
        if self.format in SFT_FORMATS:
            tok += f", {self.chat_template_text()}"
        if self.holdout is not None:
            side = "held out" if self.holdout.keep == "heldout" else "kept"
            tok += f", the {side} rows ({self.holdout.fraction:g} held out)"
        return f"{len(self.files)} {self.format} file(s) from {self.cfg.source}{tok}"

    def chat_template_text(self) -> str | None:
        """The chat template the rows are rendered with, in words (None: rows without one)."""
        if self.format == IMAGE_FORMAT:
            return f"the processor's chat template ({self.template.source})"
        if self.format in SFT_FORMATS:
            return f"chat template {self.template.source}" if self.template else "the fallback chat template"
        return None

    def documents(self, epoch: int, count: BadRowCount | None = None) -> Iterator[Document]:
        """This epoch's documents, in this epoch's order; `count` counts the rows read and the bad ones."""
        if self.format == "synthetic":
            yield from synthetic_documents(self.cfg, self.vocab_size, self.seed, epoch)
            return
        files = list(self.files)
        if self.cfg.shuffle:
            order = np.random.default_rng([self.seed, epoch, 0]).permutation(len(files))
            files = [files[i] for i in order]
        if self.format == IMAGE_FORMAT:
            docs = self.image_text_documents(files, epoch)
        else:
            docs = (doc for path in files for doc in self.file_documents(path))
        if count is not None:
            docs = counted(docs, count)
        if self.cfg.shuffle and self.format != IMAGE_FORMAT:
            docs = shuffled(docs, max(1, self.cfg.shuffle_buffer), np.random.default_rng([self.seed, epoch, 1]))
        yield from docs

    def image_text_documents(self, files: list[Path], epoch: int) -> Iterator[Document]:
        """Image-text rows shuffled as rows (a document holds its images' pixel tensors: the buffer
        holds rows instead), then made into documents a few at a time on several threads, in order."""
        rows = ((origin, row) for path in files for batch in read_rows(path, column_spec(self.format, ""), IMAGE_READ_ROWS)
                for origin, row in batch if self.holdout is None or self.holdout.admits(origin))
        if self.cfg.shuffle:
            rows = shuffled(rows, max(1, self.cfg.shuffle_buffer), np.random.default_rng([self.seed, epoch, 1]))
        convert = RowConverter(self.processor, self.template, self.vocab_size, self.cfg.seq_len, self.cfg.bad_rows,
                               self.image_joins)
        yield from in_order_on_threads(convert, rows)

    def file_documents(self, path: Path) -> Iterator[Document]:
        columns = column_spec(self.format, self.cfg.text_column)
        for batch in read_rows(path, columns, max(1, self.cfg.read_batch_rows)):
            if self.holdout is not None:
                batch = [(origin, row) for origin, row in batch if self.holdout.admits(origin)]
            if batch:
                yield from self.to_documents(batch)

    def to_documents(self, batch: RowBatch) -> list[Document]:
        """One document per row; a bad row (BadRow) as data.bad_rows says: skipped, or it stops."""
        try:
            docs = iter(self.convert([(origin, row) for origin, row in batch if not isinstance(row, BadRow)]))
        except BadRow:  # which of the batch's rows: one at a time
            docs = None
        return [apply_policy(row, self.cfg.bad_rows) if isinstance(row, BadRow)
                else next(docs) if docs is not None else self.convert_row(origin, row) for origin, row in batch]

    def convert_row(self, origin: Origin, row: dict[str, Any]) -> Document:
        try:
            return self.convert([(origin, row)])[0]
        except BadRow as e:
            return apply_policy(e, self.cfg.bad_rows)

    def convert(self, batch: RowBatch) -> list[Document]:
        if not batch:
            return []
        if self.format == "tokens":
            return [token_document(row, origin, self.vocab_size) for origin, row in batch]
        if self.format == IMAGE_FORMAT:
            return image_text_documents(batch, self.processor, self.template, self.vocab_size, self.cfg.seq_len,
                                        self.image_joins)
        assert self.encoder is not None
        if self.format == "text":
            return text_documents(batch, self.cfg.text_column, self.encoder, self.vocab_size)
        return sft_documents(batch, self.format, self.encoder, self.template, self.vocab_size)

    def rows(self, epoch: int, count: BadRowCount | None = None) -> Iterator[Row]:
        """This epoch's rows of exactly seq_len positions."""
        cfg = self.cfg
        splittable = self.format in SPLITTABLE_FORMATS
        docs = (fit_length(d, cfg.seq_len, cfg.truncate, splittable) for d in self.documents(epoch, count))
        docs = (d for d in docs if d.has_targets())
        if cfg.pack and self.format != IMAGE_FORMAT:  # an image-text row's positions are its model's own
            return packed_rows(docs, cfg.seq_len, splittable)
        return unpacked_rows(docs, cfg.seq_len)

    def positioned_rows(self, start: DataPosition, bad: BadRowCount | None = None
                        ) -> Iterator[tuple[Row, DataPosition]]:
        """Rows from `start` on, each with the position after it; epochs follow one another forever."""
        epoch, skip = start.epoch, start.index
        while True:
            count = 0
            for row in self.rows(epoch, bad):
                count += 1
                if count > skip:
                    yield row, DataPosition(epoch, count)
            if count == 0:
                raise DataError(f"empty dataset: {self.describe()} gave no training rows (all documents empty?)")
            if skip > count:
                raise DataError(
                    f"cannot resume at {start}: epoch {epoch} has only {count} rows; did the data change since the checkpoint?"
                )
            epoch, skip = epoch + 1, 0

    def batches(self, micro_batch_size: int, grad_accum: int, start: DataPosition | None = None,
                bad: BadRowCount | None = None) -> Iterator[tuple[list[dict[str, np.ndarray]], DataPosition]]:
        """Per optimizer step: `grad_accum` micro-batches of [micro_batch_size, seq_len] arrays and the
        position after the step (resuming there yields the next step's batches). `bad` counts the
        rows read and the bad rows skipped, and stops past data.max_bad_fraction."""
        if micro_batch_size < 1 or grad_accum < 1:
            raise ValueError("micro_batch_size and grad_accum must be >= 1")
        rows = self.positioned_rows(start or DataPosition(), bad)
        while True:
            taken = [next(rows) for _ in range(micro_batch_size * grad_accum)]
            micro = [
                stack_rows([row for row, _ in taken[i * micro_batch_size:(i + 1) * micro_batch_size]])
                for i in range(grad_accum)
            ]
            yield micro, taken[-1][1]

    def fixed_batches(self, micro_batch_size: int, count: int) -> list[dict[str, np.ndarray]]:
        """The first `count` micro-batches of epoch 0, no wrapping (validation: the same every time).
        When the data runs out, the last is filled with rows of padding (no target, so the loss is
        the same): every micro-batch has the training step's shape, for which the compiled blocks
        have their graphs already (streaming/compiled.py); a shape of its own would add one graph
        per layer structure."""
        rows: list[Row] = []
        for row in self.rows(0):
            rows.append(row)
            if len(rows) == micro_batch_size * count:
                break
        if not rows:
            raise DataError(f"empty validation set: {self.describe()} gave no rows")
        rows += [empty_row(len(rows[0].input_ids))] * (-len(rows) % micro_batch_size)
        return [stack_rows(rows[i:i + micro_batch_size]) for i in range(0, len(rows), micro_batch_size)]


def counted(docs: Iterable[Document], count: BadRowCount) -> Iterator[Document]:
    for doc in docs:
        count.count(doc)
        yield doc


def check_settings(cfg: DataConfig, vocab_size: int) -> None:
    if cfg.format not in FORMATS:
        raise DataError(f"unknown data.format {cfg.format!r}; expected one of {', '.join(FORMATS)}")
    if cfg.seq_len < 2:
        raise DataError(f"data.seq_len must be >= 2, got {cfg.seq_len}")
    if vocab_size < 2:
        raise DataError(f"vocab_size must be >= 2, got {vocab_size}")
    if cfg.source == "synthetic" and cfg.synthetic_docs < 1:
        raise DataError("data.synthetic_docs must be >= 1")


def data_root(files: list[Path]) -> str:
    """The directory the held-out hash names files relative to."""
    return os.path.commonpath([str(p.parent) for p in files]) if files else ""


def build_dataset(cfg: DataConfig, vocab_size: int, seed: int, holdout: tuple[float, str] | None = None) -> Dataset:
    """Check the settings, find the files and their format (reading one row), load the tokenizer and
    chat template: errors surface here, before training starts, where they can. `holdout`:
    (fraction, "train" | "heldout"), which side of a held-out split this dataset is."""
    check_settings(cfg, vocab_size)
    if cfg.source == "synthetic":
        if holdout is not None:
            raise DataError("eval.holdout_fraction needs data files; synthetic data has no rows to hold out")
        return Dataset(cfg, vocab_size, seed, [], "synthetic", None)
    files = resolve_files(cfg.source)
    first, names = first_row_columns(files)
    fmt = detect_format(first, names, cfg.text_column) if cfg.format == "auto" else cfg.format
    if fmt == IMAGE_FORMAT:
        processor, template = load_image_text_processor(cfg.tokenizer)
        split = Holdout(holdout[0], holdout[1], data_root(files)) if holdout else None
        return Dataset(cfg, vocab_size, seed, files, fmt, None, template, split, processor)
    template = None
    if fmt in SFT_FORMATS:
        template = load_chat_template(cfg.chat_template, tokenizer_file(cfg.tokenizer))
    # A chat template writes its own end-of-turn tokens: only text and the fallback need an EOS.
    encoder = None if fmt == "tokens" else TextEncoder.load(cfg.tokenizer, replace(cfg, add_eos=cfg.add_eos and not template))
    split = Holdout(holdout[0], holdout[1], data_root(files)) if holdout else None
    return Dataset(cfg, vocab_size, seed, files, fmt, encoder, template, split)


def build_datasets(cfg: DataConfig, eval_cfg: EvalConfig, vocab_size: int, seed: int) -> tuple[Dataset, Dataset | None]:
    """The training data and the validation data (None when `eval` is off)."""
    if eval_cfg.source is not None:
        eval_data = replace(cfg, source=eval_cfg.source, shuffle=False)
        return build_dataset(cfg, vocab_size, seed), build_dataset(eval_data, vocab_size, seed)
    if eval_cfg.holdout_fraction > 0:
        f = eval_cfg.holdout_fraction
        train = build_dataset(cfg, vocab_size, seed, (f, "train"))
        return train, build_dataset(replace(cfg, shuffle=False), vocab_size, seed, (f, "heldout"))
    return build_dataset(cfg, vocab_size, seed), None

