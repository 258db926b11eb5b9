"""A tokenizer of one token a word (and one for ':'), so that tests can count tokens by splitting."""

from __future__ import annotations

from pathlib import Path


def write_word_tokenizer(path: Path, words: list[str]) -> str:
    """A WordLevel tokenizer.json over `words` (id = index; unknown words are [UNK]) at `path`."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tokenizer = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(path))
    return str(path)
