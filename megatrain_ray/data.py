"""Training data as an endless, deterministic stream of fixed-shape micro-batches.

One epoch, every stage a pure function of (seed, epoch), so that a checkpoint needs to record
only how many rows of which epoch were consumed (`DataPosition`):

    files (order shuffled) -> rows read in record batches (never a whole file in memory)
      -> documents: tokens + targets, already shifted -> bounded shuffle buffer
      -> rows of exactly seq_len positions (packed, or one document per row and padded)
      -> micro-batches of B rows -> optimizer steps of `grad_accum` micro-batches

Conventions every micro-batch follows:
- `labels[b, t]` is the target of input position t (the next token), -100 where no loss is
  taken: padding, SFT prompt tokens, masked tokens and the last position of every document.
- `position_ids` restart at 0 at each document packed into a row (and at each chunk of a split
  document); the executor builds its block-diagonal mask from those restarts. Padding (token 0)
  continues the positions of the row's last document, so an unpacked row needs no mask at all.
- Documents longer than seq_len: with `truncate=False` they are a `DataError` naming the file
  and row. With `truncate=True`, pretraining documents (formats tokens, text, synthetic) are split
  into seq_len chunks, nothing lost (when packing, a document flows over into the next row);
  SFT examples (alpaca, sharegpt) keep their first seq_len positions, the rest is dropped.
- Documents left without any target (empty text, an SFT example truncated before its response)
  are skipped.

Formats (`data.format`, or `auto`: from the columns of the first row):
- tokens: an `input_ids` list column (Parquet, Arrow IPC file or stream, JSONL); optional
  `labels` (unshifted, Hugging Face style, -100 = no loss; wins over loss_mask) or `loss_mask`
  (1 = train on predicting this token). Used as given: no EOS is added.
- text: column `data.text_column`, tokenized with `data.tokenizer` (a tokenizer.json, or a
  directory holding one); the tokenizer's special prefix (e.g. BOS) goes first and EOS last when
  `data.add_eos`.
- alpaca: instruction / input (optional) / output.
- sharegpt: `conversations` [{from: system|human|gpt, value}] or `messages` [{role, content}].

SFT template (plain text, each piece tokenized on its own so that masks fall on token
boundaries; loss only on the assistant's text and the EOS after it):

    ### System:\\n{system}\\n\\n              (when there is a system turn)
    ### User:\\n{user}\\n\\n
    ### Assistant:\\n{assistant}<EOS>      (the response; "\\n\\n" follows before a next turn)

An alpaca example is one user turn, `{instruction}\\n\\n{input}` (or just the instruction), and
one assistant turn, `{output}`.

Shuffling (`data.shuffle`): file order is permuted per epoch, then documents pass through a
buffer of `data.shuffle_buffer` documents. Files are read one after another, so documents mix
only within that window; shuffle offline if the files are sorted by topic. Resuming replays the
epoch's stream up to the recorded row (reads and tokenizes that prefix again, then skips it).
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

from megatrain_ray.config import DataConfig

IGNORE_INDEX = -100
FORMATS = ("auto", "tokens", "text", "alpaca", "sharegpt")
SPLITTABLE_FORMATS = ("tokens", "text", "synthetic")
FILE_KINDS = {
    "parquet": (".parquet", ".pq"),
    "arrow": (".arrow", ".feather", ".ipc"),
    "jsonl": (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".ndjson"),
}
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<|im_end|>", "<eos>", "<|eot_id|>")
ROLES = {
    "system": "System",
    "human": "User", "user": "User",
    "gpt": "Assistant", "assistant": "Assistant", "model": "Assistant", "chatgpt": "Assistant", "bing": "Assistant",
}


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

    def __len__(self) -> int:
        return len(self.input_ids)

    def has_targets(self) -> bool:
        return bool((self.labels != IGNORE_INDEX).any())

    def piece(self, start: int, stop: int) -> "Document":
        return Document(self.input_ids[start:stop], self.labels[start:stop], self.origin)


@dataclass(frozen=True)
class Row:
    """One sequence of exactly seq_len positions."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray


RowBatch = list[tuple[Origin, dict[str, Any]]]


# ---------------------------------------------------------------- documents from tokens


def shifted_document(tokens: np.ndarray, targets: np.ndarray, origin: Origin) -> Document:
    """Unshifted targets (target i = train on predicting token i) to per-position labels."""
    labels = np.full(len(tokens), IGNORE_INDEX, dtype=np.int64)
    labels[:-1] = targets[1:]
    return Document(np.asarray(tokens, dtype=np.int64), labels, origin)


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


def token_document(row: dict[str, Any], origin: Origin, vocab_size: int) -> Document:
    """Pre-tokenized row; `labels` (HF style, unshifted) wins over `loss_mask` when both are set."""
    if "input_ids" not in row:
        raise DataError(f"{origin}: missing column 'input_ids' (has: {', '.join(sorted(row)) or 'nothing'})")
    ids = as_int_array(row["input_ids"], origin, "input_ids")
    check_token_ids(ids, vocab_size, origin, "input_ids")
    targets = ids
    for column in ("labels", "loss_mask"):
        if row.get(column) is None:
            continue
        values = as_int_array(row[column], origin, column)
        if len(values) != len(ids):
            raise DataError(f"{origin}: {column} has {len(values)} entries, input_ids has {len(ids)}")
        if column == "labels":
            check_token_ids(values, vocab_size, origin, "labels", allow_ignore=True)
            targets = values
        else:
            targets = np.where(values != 0, ids, IGNORE_INDEX)
        break
    return shifted_document(ids, targets, origin)


# ---------------------------------------------------------------- documents from text


@dataclass(frozen=True)
class TextEncoder:
    """A `tokenizers` tokenizer plus what the documents need around it: special prefix and EOS."""

    tokenizer: Any
    path: str
    prefix: tuple[int, ...]
    eos_id: int | None

    @classmethod
    def load(cls, path: str | None, cfg: DataConfig) -> "TextEncoder":
        from tokenizers import Tokenizer

        if path is None:
            raise DataError("text and SFT data need data.tokenizer: a tokenizer.json (or a directory holding one)")
        file = Path(path).expanduser()
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise DataError(f"data.tokenizer {path!r}: no tokenizer.json there")
        try:
            tokenizer = Tokenizer.from_file(str(file))
        except Exception as e:  # the Rust side raises its own exception type
            raise DataError(f"data.tokenizer {file}: cannot load: {e}") from None
        eos = cfg.eos_token_id if cfg.eos_token_id is not None else find_eos(tokenizer)
        if cfg.add_eos and eos is None:
            raise DataError(
                f"data.tokenizer {file}: no EOS token found (tried {', '.join(EOS_CANDIDATES)}); "
                "set data.eos_token_id or data.add_eos=false"
            )
        return cls(tokenizer, str(file), special_prefix(tokenizer), eos if cfg.add_eos else None)

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        """Plain text to ids, without special tokens (the caller places prefix and EOS)."""
        if not texts:
            return []
        return [np.asarray(e.ids, dtype=np.int64) for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]


def find_eos(tokenizer: Any) -> int | None:
    for token in EOS_CANDIDATES:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token_id
    return None


def special_prefix(tokenizer: Any) -> tuple[int, ...]:
    """What the post-processor puts before the text (a BOS, usually); suffixes (EOS, SEP) are ours to add."""
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    full = tokenizer.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return tuple(full[:start])
    return ()


def text_of(row: dict[str, Any], column: str, origin: Origin) -> str:
    if column not in row:
        raise DataError(f"{origin}: missing column {column!r} (has: {', '.join(sorted(row)) or 'nothing'})")
    value = row[column]
    if not isinstance(value, str):
        raise DataError(f"{origin}: column {column!r} must be a string, got {type(value).__name__}")
    return value


def text_documents(batch: RowBatch, column: str, encoder: TextEncoder, vocab_size: int) -> list[Document]:
    texts = [text_of(row, column, origin) for origin, row in batch]
    docs = []
    for (origin, _), ids in zip(batch, encoder.encode(texts)):
        pieces = [np.asarray(encoder.prefix, dtype=np.int64), ids]
        if encoder.eos_id is not None:
            pieces.append(np.asarray([encoder.eos_id], dtype=np.int64))
        tokens = np.concatenate(pieces)
        check_token_ids(tokens, vocab_size, origin, "tokens")
        docs.append(shifted_document(tokens, tokens, origin))
    return docs


# ---------------------------------------------------------------- SFT


@dataclass(frozen=True)
class Turn:
    role: str  # System | User | Assistant
    text: str


def alpaca_turns(row: dict[str, Any], origin: Origin) -> list[Turn]:
    instruction = text_of(row, "instruction", origin)
    extra = row.get("input") or ""
    if not isinstance(extra, str):
        raise DataError(f"{origin}: column 'input' must be a string, got {type(extra).__name__}")
    user = f"{instruction}\n\n{extra}" if extra else instruction
    return [Turn("User", user), Turn("Assistant", text_of(row, "output", origin))]


def sharegpt_turns(row: dict[str, Any], origin: Origin) -> list[Turn]:
    """`conversations` [{from, value}] or `messages` [{role, content}]."""
    if row.get("conversations") is not None:
        column, role_key, text_key = "conversations", "from", "value"
    elif row.get("messages") is not None:
        column, role_key, text_key = "messages", "role", "content"
    else:
        raise DataError(f"{origin}: missing column 'conversations' or 'messages' (has: {', '.join(sorted(row))})")
    turns = row[column]
    if not isinstance(turns, list):
        raise DataError(f"{origin}: {column} must be a list of turns, got {type(turns).__name__}")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or not isinstance(turn.get(role_key), str) or not isinstance(turn.get(text_key), str):
            raise DataError(f"{origin}: {column}[{i}] must be {{{role_key!r}: str, {text_key!r}: str}}, got {str(turn)[:80]}")
        role = ROLES.get(turn[role_key].lower())
        if role is None:
            raise DataError(f"{origin}: {column}[{i}] has unknown role {turn[role_key]!r} (known: {', '.join(ROLES)})")
        out.append(Turn(role, turn[text_key]))
    return out


def template_pieces(turns: list[Turn]) -> list[tuple[str, bool]]:
    """The SFT template (see the module docstring) as (text, trained) pieces; "" + True is the EOS."""
    pieces: list[tuple[str, bool]] = []
    for i, turn in enumerate(turns):
        if turn.role == "Assistant":
            pieces += [("### Assistant:\n", False), (turn.text, True), ("", True)]
            if i + 1 < len(turns):
                pieces.append(("\n\n", False))
        else:
            pieces.append((f"### {turn.role}:\n{turn.text}\n\n", False))
    return pieces


def sft_documents(batch: RowBatch, fmt: str, encoder: TextEncoder, vocab_size: int) -> list[Document]:
    turns_of = alpaca_turns if fmt == "alpaca" else sharegpt_turns
    examples = [template_pieces(turns_of(row, origin)) for origin, row in batch]
    texts = [text for pieces in examples for text, _ in pieces if text]
    encoded = iter(encoder.encode(texts))
    eos = [] if encoder.eos_id is None else [encoder.eos_id]
    docs = []
    for (origin, _), pieces in zip(batch, examples):
        tokens, trained = [list(encoder.prefix)], [[False] * len(encoder.prefix)]
        for text, train in pieces:
            ids = list(next(encoded)) if text else (eos if train else [])
            tokens.append(ids)
            trained.append([train] * len(ids))
        ids = np.asarray([t for part in tokens for t in part], dtype=np.int64)
        mask = np.asarray([m for part in trained for m in part], dtype=bool)
        check_token_ids(ids, vocab_size, origin, "tokens")
        docs.append(shifted_document(ids, np.where(mask, ids, IGNORE_INDEX), origin))
    return docs


# ---------------------------------------------------------------- synthetic


def synthetic_documents(cfg: DataConfig, vocab_size: int, seed: int, epoch: int) -> Iterator[Document]:
    """Counting sequences (step 1 or 2) and repeated short patterns (period 2-8) over the first 64 token
    ids: a tiny model learns them in a few steps (unigrams at once, bigrams and copying soon after).
    Lengths vary so that packing matters. Without data.shuffle every epoch holds the same documents."""
    rng = np.random.default_rng([seed, epoch if cfg.shuffle else 0, 2])
    alphabet = min(vocab_size, 64)
    low = max(2, cfg.seq_len // 4)
    for i in range(cfg.synthetic_docs):
        n = int(rng.integers(low, cfg.seq_len + 1))
        if rng.random() < 0.5:
            start, step = rng.integers(alphabet), rng.integers(1, 3)
            tokens = (start + step * np.arange(n)) % alphabet
        else:
            pattern = rng.integers(0, alphabet, int(rng.integers(2, 9)))
            tokens = np.resize(pattern, n)
        tokens = tokens.astype(np.int64)
        yield shifted_document(tokens, tokens, Origin("synthetic", i))


# ---------------------------------------------------------------- files


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


def check_columns(path: Path, names: list[str], columns: "ColumnSpec") -> list[str]:
    """The columns to read; a missing required column is an error that names the file."""
    missing = [c for c in columns.required if c not in names]
    if columns.any_of and not any(c in names for c in columns.any_of):
        missing.append(" or ".join(columns.any_of))
    if missing:
        raise DataError(f"data file {path}: missing column {missing[0]!r} (has: {', '.join(names) or 'nothing'})")
    return [c for c in names if c in columns.all()]


def read_parquet(path: Path, columns: "ColumnSpec", batch_rows: int) -> Iterator[RowBatch]:
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


def read_arrow(path: Path, columns: "ColumnSpec", batch_rows: int) -> Iterator[RowBatch]:
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


def read_jsonl(path: Path, columns: "ColumnSpec", batch_rows: int) -> Iterator[RowBatch]:
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
            if line_no is not None:
                if not text.strip():
                    continue
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as e:
                    raise DataError(f"{Origin(str(path), row, line_no)}: malformed JSON: {e.msg} at column {e.colno}") from None
            else:
                obj = text
            origin = Origin(str(path), row, line_no)
            if not isinstance(obj, dict):
                raise DataError(f"{origin}: expected a JSON object, got {type(obj).__name__}")
            batch.append((origin, obj))
            row += 1
            if len(batch) == batch_rows:
                yield batch
                batch = []
        if batch:
            yield batch


def load_json_array(f: io.TextIOBase, path: Path) -> list[Any]:
    try:
        return json.load(f)
    except json.JSONDecodeError as e:
        raise DataError(f"data file {path}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None


READERS = {"parquet": read_parquet, "arrow": read_arrow, "jsonl": read_jsonl}


def read_rows(path: Path, columns: "ColumnSpec", batch_rows: int) -> Iterator[RowBatch]:
    """Rows of one file in batches; low-level read failures become DataErrors naming the file."""
    try:
        yield from READERS[file_kind(path)](path, columns, batch_rows)
    except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
        raise DataError(f"data file {path}: cannot read: {e}") from None


def first_row_columns(files: list[Path]) -> tuple[Path, list[str]]:
    """Column names of the first file that has a row; no rows anywhere is an error."""
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
                    return path, list(batch[0][1])
        except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
            raise DataError(f"data file {path}: cannot read: {e}") from None
    shown = ", ".join(str(p) for p in files[:3]) + (" ..." if len(files) > 3 else "")
    raise DataError(f"empty dataset: no rows in {len(files)} file(s): {shown}")


@dataclass(frozen=True)
class ColumnSpec:
    required: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    any_of: tuple[str, ...] = ()

    def all(self) -> tuple[str, ...]:
        return self.required + self.optional + self.any_of


def column_spec(fmt: str, text_column: str) -> ColumnSpec:
    return {
        "tokens": ColumnSpec(("input_ids",), ("labels", "loss_mask")),
        "text": ColumnSpec((text_column,)),
        "alpaca": ColumnSpec(("instruction", "output"), ("input",)),
        "sharegpt": ColumnSpec(any_of=("conversations", "messages")),
    }[fmt]


def detect_format(path: Path, names: list[str], text_column: str) -> str:
    if "input_ids" in names:
        return "tokens"
    if "conversations" in names or "messages" in names:
        return "sharegpt"
    if "instruction" in names and "output" in names:
        return "alpaca"
    if text_column in names:
        return "text"
    raise DataError(
        f"data file {path}: cannot tell the format from columns {', '.join(names)}; expected input_ids (tokens), "
        f"{text_column!r} (text, see data.text_column), instruction+output (alpaca) or conversations/messages "
        "(sharegpt); or set data.format"
    )


# ---------------------------------------------------------------- shuffling, packing, batching


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
    )


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
    return {
        "input_ids": np.stack([r.input_ids for r in rows]),
        "labels": np.stack([r.labels for r in rows]),
        "position_ids": np.stack([r.position_ids for r in rows]),
    }


def seed_words(seed: int) -> int:
    """numpy seeds must be non-negative; any int seed maps to one."""
    return seed % 2**64


# ---------------------------------------------------------------- the dataset


class Dataset:
    """The endless micro-batch stream of one data config; see the module docstring."""

    def __init__(self, cfg: DataConfig, vocab_size: int, seed: int, files: list[Path], fmt: str,
                 encoder: TextEncoder | None):
        self.cfg, self.vocab_size, self.seed = cfg, vocab_size, seed_words(seed)
        self.files, self.format, self.encoder = files, fmt, encoder

    def describe(self) -> str:
        if self.format == "synthetic":
            return f"synthetic data, {self.cfg.synthetic_docs} documents per epoch"
        tok = f", tokenizer {self.encoder.path}" if self.encoder else ""
        return f"{len(self.files)} {self.format} file(s) from {self.cfg.source}{tok}"

    def documents(self, epoch: int) -> Iterator[Document]:
        """This epoch's documents, in this epoch's order."""
        if self.format == "synthetic":
            yield from synthetic_documents(self.cfg, self.vocab_size, self.seed, epoch)
            return
        files = list(self.files)
        if self.cfg.shuffle:
            order = np.random.default_rng([self.seed, epoch, 0]).permutation(len(files))
            files = [files[i] for i in order]
        docs = (doc for path in files for doc in self.file_documents(path))
        if self.cfg.shuffle:
            docs = shuffled(docs, max(1, self.cfg.shuffle_buffer), np.random.default_rng([self.seed, epoch, 1]))
        yield from docs

    def file_documents(self, path: Path) -> Iterator[Document]:
        columns = column_spec(self.format, self.cfg.text_column)
        for batch in read_rows(path, columns, max(1, self.cfg.read_batch_rows)):
            yield from self.to_documents(batch)

    def to_documents(self, batch: RowBatch) -> list[Document]:
        if self.format == "tokens":
            return [token_document(row, origin, self.vocab_size) for origin, row in batch]
        assert self.encoder is not None
        if self.format == "text":
            return text_documents(batch, self.cfg.text_column, self.encoder, self.vocab_size)
        return sft_documents(batch, self.format, self.encoder, self.vocab_size)

    def rows(self, epoch: int) -> Iterator[Row]:
        """This epoch's rows of exactly seq_len positions."""
        cfg = self.cfg
        splittable = self.format in SPLITTABLE_FORMATS
        docs = (fit_length(d, cfg.seq_len, cfg.truncate, splittable) for d in self.documents(epoch))
        docs = (d for d in docs if d.has_targets())
        if cfg.pack:
            return packed_rows(docs, cfg.seq_len, splittable)
        return unpacked_rows(docs, cfg.seq_len)

    def positioned_rows(self, start: DataPosition) -> Iterator[tuple[Row, DataPosition]]:
        """Rows from `start` on, each with the position after it; epochs follow one another forever."""
        epoch, skip = start.epoch, start.index
        while True:
            count = 0
            for row in self.rows(epoch):
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

    def batches(self, micro_batch_size: int, grad_accum: int, start: DataPosition | None = None
                ) -> Iterator[tuple[list[dict[str, np.ndarray]], DataPosition]]:
        """Per optimizer step: `grad_accum` micro-batches of [micro_batch_size, seq_len] arrays and the
        position after the step (resuming there yields the next step's batches)."""
        if micro_batch_size < 1 or grad_accum < 1:
            raise ValueError("micro_batch_size and grad_accum must be >= 1")
        rows = self.positioned_rows(start or DataPosition())
        while True:
            taken = [next(rows) for _ in range(micro_batch_size * grad_accum)]
            micro = [
                stack_rows([row for row, _ in taken[i * micro_batch_size:(i + 1) * micro_batch_size]])
                for i in range(grad_accum)
            ]
            yield micro, taken[-1][1]


def check_settings(cfg: DataConfig, vocab_size: int) -> None:
    if cfg.format not in FORMATS:
        raise DataError(f"unknown data.format {cfg.format!r}; expected one of {', '.join(FORMATS)}")
    if cfg.seq_len < 2:
        raise DataError(f"data.seq_len must be >= 2, got {cfg.seq_len}")
    if vocab_size < 2:
        raise DataError(f"vocab_size must be >= 2, got {vocab_size}")
    if cfg.source == "synthetic" and cfg.synthetic_docs < 1:
        raise DataError("data.synthetic_docs must be >= 1")


def build_dataset(cfg: DataConfig, vocab_size: int, seed: int) -> Dataset:
    """Check the settings, find the files and their format (reading one row), load the tokenizer: errors
    surface here, before training starts, where they can."""
    check_settings(cfg, vocab_size)
    if cfg.source == "synthetic":
        return Dataset(cfg, vocab_size, seed, [], "synthetic", None)
    files = resolve_files(cfg.source)
    first, names = first_row_columns(files)
    fmt = detect_format(first, names, cfg.text_column) if cfg.format == "auto" else cfg.format
    encoder = None if fmt == "tokens" else TextEncoder.load(cfg.tokenizer, cfg)
    return Dataset(cfg, vocab_size, seed, files, fmt, encoder)
