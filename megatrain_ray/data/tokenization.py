"""Tokens from rows: pre-tokenized rows as given, plain text through a `tokenizers` tokenizer.

Formats:
- tokens: an `input_ids` list column; optional `labels` (unshifted, Hugging Face style, -100 = no
  loss; wins over loss_mask) or `loss_mask` (1 = train on predicting this token). Used as given:
  no EOS is added.
- text: column `data.text_column`, tokenized with `data.tokenizer` (a tokenizer.json, or a
  directory holding one); the tokenizer's special prefix (e.g. BOS) goes first and EOS last when
  `data.add_eos`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megatrain_ray.config import DataConfig
from megatrain_ray.data.documents import (
    IGNORE_INDEX, BadRow, DataError, Document, Origin, RowBatch, as_int_array, check_token_ids, missing_column,
    shifted_document, text_of,
)

EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<|im_end|>", "<eos>", "<|eot_id|>")


def token_document(row: dict[str, Any], origin: Origin, vocab_size: int) -> Document:
    """Pre-tokenized row; `labels` (HF style, unshifted) wins over `loss_mask` when both are set."""
    if "input_ids" not in row:
        raise missing_column(origin, "input_ids", row, "tokens")
    ids = as_int_array(row["input_ids"], origin, "input_ids")
    check_token_ids(ids, vocab_size, origin, "input_ids")
    targets = ids
    for column in ("labels", "loss_mask"):
        if row.get(column) is None:
            continue
        values = as_int_array(row[column], origin, column)
        if len(values) != len(ids):
            raise BadRow(origin, f"{column} and input_ids of different lengths",
                         f"{column} has {len(values)} entries, input_ids has {len(ids)}")
        if column == "labels":
            check_token_ids(values, vocab_size, origin, "labels", allow_ignore=True)
            targets = values
        else:
            targets = np.where(values != 0, ids, IGNORE_INDEX)
        break
    return shifted_document(ids, targets, origin)


def tokenizer_file(path: str | None) -> Path:
    """data.tokenizer: a tokenizer.json or the directory holding one (a model directory, usually)."""
    if path is None:
        raise DataError("text and SFT data need data.tokenizer: a tokenizer.json (or a directory holding one)")
    file = Path(path).expanduser()
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise DataError(f"data.tokenizer {path!r}: no tokenizer.json there")
    return file


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

        file = tokenizer_file(path)
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
        return [np.asarray(e.ids, dtype=np.int64) for e in self.encodings(texts)]

    def encodings(self, texts: list[str]) -> list[Any]:
        """`tokenizers` Encodings (ids and character offsets), special tokens in the text recognised,
        none added: what transformers' apply_chat_template tokenizes a rendered chat with."""
        if not texts:
            return []
        return self.tokenizer.encode_batch(texts, add_special_tokens=False)


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


def text_documents(batch: RowBatch, column: str, encoder: TextEncoder, vocab_size: int) -> list[Document]:
    texts = [text_of(row, column, origin, "text") for origin, row in batch]
    kept = [(origin, text) for (origin, _), text in zip(batch, texts) if text.strip()]
    encoded = iter(encoder.encode([text for _, text in kept]))
    docs = []
    for (origin, _), text in zip(batch, texts):
        if not text.strip():
            docs.append(Document.skipped(origin, "empty text"))
            continue
        ids = next(encoded)
        pieces = [np.asarray(encoder.prefix, dtype=np.int64), ids]
        if encoder.eos_id is not None:
            pieces.append(np.asarray([encoder.eos_id], dtype=np.int64))
        tokens = np.concatenate(pieces)
        check_token_ids(tokens, vocab_size, origin, "tokens")
        docs.append(shifted_document(tokens, tokens, origin))
    return docs
