"""Rows from files: which files a source names, their kind, their columns, and rows in batches.

A source is a file, a directory (every data file under it) or a glob. Parquet and Arrow files are
read in record batches, JSONL line by line: never a whole file in memory. `data.format: auto` is
decided from the columns of the first row that has any (formats.py). A line that is not a JSON
object is passed on as a BadRow in place of the row, for data.bad_rows to skip or stop on.
"""

from __future__ import annotations

import glob as globlib
import gzip
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from megatrain_ray.data.documents import BadRow, DataError, Origin, RowBatch
from megatrain_ray.data.formats import format_hint, guess_format

FILE_KINDS = {
    "parquet": (".parquet", ".pq"),
    "arrow": (".arrow", ".feather", ".ipc"),
    "jsonl": (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".ndjson"),
}


@dataclass(frozen=True)
class ColumnSpec:
    required: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    any_of: tuple[str, ...] = ()
    fmt: str = ""  # the format these columns are of (for the hint of a column error)
    text_column: str = "text"

    def all(self) -> tuple[str, ...]:
        return self.required + self.optional + self.any_of


def column_spec(fmt: str, text_column: str) -> ColumnSpec:
    return {
        "tokens": ColumnSpec(("input_ids",), ("labels", "loss_mask"), fmt="tokens"),
        "text": ColumnSpec((text_column,), fmt="text", text_column=text_column),
        "alpaca": ColumnSpec(("instruction", "output"), ("input", "system"), fmt="alpaca"),
        "sharegpt": ColumnSpec(any_of=("conversations", "messages"), fmt="sharegpt"),
        "sharegpt_images": ColumnSpec(("images",), any_of=("conversations", "messages"), fmt="sharegpt_images"),
    }[fmt]


def file_kind(path: Path) -> str | None:
    name = path.name.lower()
    for kind, suffixes in FILE_KINDS.items():
        if name.endswith(suffixes):
            return kind
    return None


def known_files(paths: Iterable[Path]) -> list[Path]:
    """Data files among paths; hidden and marker files (.crc, _SUCCESS) are not data."""
    return [p for p in paths if p.is_file() and not p.name.startswith((".", "_")) and file_kind(p)]


def resolve_files(source: str) -> list[Path]:
    path = Path(source).expanduser()
    kinds = ", ".join(s for suffixes in FILE_KINDS.values() for s in suffixes)
    if path.is_dir():
        files = known_files(sorted(path.rglob("*")))
        if not files:
            raise DataError(f"data.source {source!r}: the directory holds no data files ({kinds})")
        return files
    if path.is_file():
        if file_kind(path) is None:
            raise DataError(f"data file {path}: unknown format (known extensions: {kinds})")
        return [path]
    if globlib.has_magic(source):
        matches = [Path(p) for p in sorted(globlib.glob(os.path.expanduser(source), recursive=True))]
        files = known_files(matches)
        if not files:
            seen = f" (matched only: {', '.join(p.name for p in matches[:5])})" if matches else ""
            raise DataError(f"data.source {source!r}: no data files match{seen}; known extensions: {kinds}")
        return files
    raise DataError(f"data.source {source!r}: no such file or directory")


def integer_lists(column: pa.Array) -> list[np.ndarray | None] | None:
    """A list<int> column as one numpy array per row, without a Python object per token; None if not one."""
    kind = column.type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)):
        return None
    value_type = kind.value_type
    if not (pa.types.is_integer(value_type) or pa.types.is_boolean(value_type)):
        return None
    flat = column.flatten()
    if flat.null_count:
        return None
    values = flat.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    lengths = pc.list_value_length(column).fill_null(0).to_numpy(zero_copy_only=False)
    arrays: list[np.ndarray | None] = list(np.split(values, np.cumsum(lengths)[:-1]))
    if column.null_count:
        for i in np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False)):
            arrays[i] = None
    return arrays


def record_batch_rows(batch: pa.RecordBatch, path: Path, first_row: int) -> RowBatch:
    columns = {}
    for name, column in zip(batch.schema.names, batch.columns):
        arrays = integer_lists(column)
        columns[name] = arrays if arrays is not None else column.to_pylist()
    return [(Origin(str(path), first_row + i), {k: v[i] for k, v in columns.items()}) for i in range(batch.num_rows)]


def check_columns(path: Path, names: list[str], columns: ColumnSpec) -> list[str]:
    """The columns to read; a missing required column is an error that names the file (and the
    format its columns are in, when that is another)."""
    missing = [c for c in columns.required if c not in names]
    if columns.any_of and not any(c in names for c in columns.any_of):
        missing.append(" or ".join(columns.any_of))
    if missing:
        raise DataError(f"data file {path}: missing column {missing[0]!r} (has: {', '.join(names) or 'nothing'})"
                        f"{format_hint(names, columns.fmt, columns.text_column)}")
    return [c for c in names if c in columns.all()]


def read_parquet(path: Path, columns: ColumnSpec, batch_rows: int) -> Iterator[RowBatch]:
    file = pq.ParquetFile(str(path))
    names = check_columns(path, file.schema_arrow.names, columns)
    row = 0
    for batch in file.iter_batches(batch_size=batch_rows, columns=names):
        yield record_batch_rows(batch, path, row)
        row += batch.num_rows


def arrow_record_batches(path: Path) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """Arrow IPC file (random access, "feather v2") or stream format (what HF datasets writes)."""
    source = pa.memory_map(str(path))
    try:
        reader = ipc.open_file(source)
        return reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches))
    except pa.ArrowInvalid:
        source.seek(0)
        stream = ipc.open_stream(source)
        return stream.schema, iter(stream)


def read_arrow(path: Path, columns: ColumnSpec, batch_rows: int) -> Iterator[RowBatch]:
    schema, batches = arrow_record_batches(path)
    names = check_columns(path, schema.names, columns)
    row = 0
    for batch in batches:
        batch = batch.select(names)
        for start in range(0, batch.num_rows, batch_rows):
            piece = batch.slice(start, batch_rows)
            yield record_batch_rows(piece, path, row)
            row += piece.num_rows


def open_text(path: Path) -> io.TextIOBase:
    return gzip.open(path, "rt", encoding="utf-8") if path.name.lower().endswith(".gz") else open(path, encoding="utf-8")


def read_jsonl(path: Path, columns: ColumnSpec, batch_rows: int) -> Iterator[RowBatch]:
    """One JSON object per line (blank lines skipped); a .json file holding one array is read whole."""
    with open_text(path) as f:
        head = f.read(4096).lstrip()
        f.seek(0)
        if path.name.lower().endswith((".json", ".json.gz")) and head.startswith("["):
            lines: Iterable[tuple[int | None, Any]] = ((None, obj) for obj in load_json_array(f, path))
        else:
            lines = enumerate(f, start=1)
        batch: RowBatch = []
        row = 0
        for line_no, text in lines:
            if line_no is not None and not text.strip():
                continue
            origin = Origin(str(path), row, line_no)
            batch.append((origin, json_row(text, origin) if line_no is not None else json_object(text, origin)))
            row += 1
            if len(batch) == batch_rows:
                yield batch
                batch = []
        if batch:
            yield batch


def json_row(text: str, origin: Origin) -> dict[str, Any] | BadRow:
    """One JSONL line: its object, or the BadRow it is."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return BadRow(origin, "malformed JSON", f"malformed JSON: {json_error_at(e, text)}")
    return json_object(obj, origin)


def json_object(obj: Any, origin: Origin) -> dict[str, Any] | BadRow:
    if not isinstance(obj, dict):
        return BadRow(origin, "not a JSON object", f"expected a JSON object, got {type(obj).__name__}")
    return obj


def json_error_at(e: json.JSONDecodeError, line: str) -> str:
    """The decoder's message and its column in the line; an error past the line's last character (a
    row cut short: the decoder reads on into the newline and names the next line's column 1) is at its end."""
    text = line.rstrip("\r\n")
    if e.pos >= len(text):
        return f"{e.msg} at the end of the line (column {len(text) + 1}): the row is cut short"
    return f"{e.msg} at column {e.colno}"


def load_json_array(f: io.TextIOBase, path: Path) -> list[Any]:
    try:
        return json.load(f)
    except json.JSONDecodeError as e:
        raise DataError(f"data file {path}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None


READERS = {"parquet": read_parquet, "arrow": read_arrow, "jsonl": read_jsonl}


def read_rows(path: Path, columns: ColumnSpec, batch_rows: int) -> Iterator[RowBatch]:
    """Rows of one file in batches; low-level read failures become DataErrors naming the file."""
    try:
        yield from READERS[file_kind(path)](path, columns, batch_rows)
    except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
        raise DataError(f"data file {path}: cannot read: {e}") from None


def first_row_columns(files: list[Path]) -> tuple[Path, list[str]]:
    """Column names of the first file that has a row (of JSON: the first row that has any columns,
    past empty objects and bad lines); no rows anywhere is an error."""
    for path in files:
        try:
            kind = file_kind(path)
            if kind == "parquet":
                file = pq.ParquetFile(str(path))
                if file.metadata.num_rows:
                    return path, file.schema_arrow.names
            elif kind == "arrow":
                schema, batches = arrow_record_batches(path)
                if any(b.num_rows for b in batches):
                    return path, schema.names
            else:
                for batch in read_jsonl(path, ColumnSpec(), 1):
                    row = batch[0][1]
                    if isinstance(row, dict) and row:
                        return path, list(row)
        except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
            raise DataError(f"data file {path}: cannot read: {e}") from None
    shown = ", ".join(str(p) for p in files[:3]) + (" ..." if len(files) > 3 else "")
    raise DataError(f"empty dataset: no rows in {len(files)} file(s): {shown}")


def detect_format(path: Path, names: list[str], text_column: str) -> str:
    guessed = guess_format(names, text_column)
    if guessed is not None:
        return guessed
    raise DataError(
        f"data file {path}: cannot tell the format from columns {', '.join(names)}; expected input_ids (tokens), "
        f"{text_column!r} (text, see data.text_column), instruction+output (alpaca) or conversations/messages "
        "(sharegpt); or set data.format"
    )
