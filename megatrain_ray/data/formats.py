"""A data format guessed from a row's columns, for `data.format: auto` and for the hint in every
column error: tokens (input_ids), sharegpt (conversations, or messages), alpaca (instruction and
output), text (data.text_column)."""

from __future__ import annotations

from typing import Iterable


def guess_format(names: Iterable[str], text_column: str = "text") -> str | None:
    """The format these columns are written in; None when they fit none."""
    names = set(names)
    if "input_ids" in names:
        return "tokens"
    if ("conversations" in names or "messages" in names) and "images" in names:
        return "sharegpt_images"
    if "conversations" in names or "messages" in names:
        return "sharegpt"
    if "instruction" in names and "output" in names:
        return "alpaca"
    if text_column in names:
        return "text"
    return None


def format_hint(names: Iterable[str], fmt: str, text_column: str = "text", one_row: bool = False) -> str:
    """'; these columns are format sharegpt: ...' when the columns name another format than `fmt`;
    `one_row`: the columns of one row, in a source read as `fmt` (rows of mixed formats, maybe)."""
    guessed = guess_format(names, text_column)
    if guessed is None or guessed == fmt:
        return ""
    if one_row:
        return (f"; these columns are format {guessed}, and the source is read as {fmt} (data.format, or under "
                f"auto its first row's format): one source holds rows of one format")
    return (f"; these columns are format {guessed}: set it with --set data.format={guessed} "
            f"(or data.format=auto, which tells it from the columns)")
