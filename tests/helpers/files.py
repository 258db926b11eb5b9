"""Small files the tests write: JSONL rows, a word-level tokenizer, a run's metrics read back."""

from __future__ import annotations

import json
from pathlib import Path


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


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
    return [json.loads(line)["step"] for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
