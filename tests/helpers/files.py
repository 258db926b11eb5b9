"""Small files the tests write: JSONL rows, a word-level tokenizer, a run's metrics read back."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_documents(path: Path, vocab: int, seed: int, count: int = 48, pad: int | None = None,
                    distinct: int | None = None) -> Path:
    """`count` token documents of 3 to 11 tokens below `vocab` as JSONL rows of input_ids; `pad`, a
    token put second in each; with `distinct`, drawn from that many fixed documents (data a model
    can learn)."""
    rng = np.random.default_rng(seed)

    def one() -> list[int]:
        doc = rng.integers(0, vocab, size=int(rng.integers(3, 12))).tolist()
        if pad is not None:
            doc[1] = pad
        return doc

    pool = [one() for _ in range(distinct)] if distinct else None
    return write_jsonl(path, [{"input_ids": pool[int(rng.integers(0, distinct))] if pool else one()}
                              for _ in range(count)])


def word_tokenizer(directory: Path, vocab: dict[str, int]) -> str:
    """A tokenizer.json of one token a word (whitespace-split, `[UNK]` for the rest), in `directory`."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    return str(path)


def steps_of(out_dir: Path) -> list[int]:
    """The steps a run's metrics.jsonl records, in order."""
    rows = map(json.loads, (out_dir / "metrics.jsonl").read_text().splitlines())
    return [row["step"] for row in rows if "step" in row]  # not the row of a stop
