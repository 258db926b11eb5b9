"""The prompts of a reinforcement-learning run: rows of jsonl/parquet/arrow files, each with a
`prompt` (text), chat `messages` (rendered by the model's chat template with the assistant's turn
opened) or `prompt_ids` (tokens), and any other columns the rewards read (a reference answer).
They are read once (prompt sets are small), tokenized, and dealt out in a shuffled order per epoch
that `position` (prompts consumed) fixes, so a resumed run takes the same prompts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megatrain_ray.config import Config
from megatrain_ray.data.chat_template import load_chat_template
from megatrain_ray.data.documents import BadRow, DataError
from megatrain_ray.data.readers import ColumnSpec, first_row_columns, read_rows, resolve_files
from megatrain_ray.data.tokenization import TextEncoder, tokenizer_file

PROMPT_COLUMNS = ("prompt", "messages", "prompt_ids")


@dataclass(frozen=True)
class Prompt:
    ids: np.ndarray  # the tokens the completion follows
    text: str  # what the rewards see as the prompt ("" for token prompts)
    columns: dict[str, Any]  # the row's other columns


class Tokens:
    """The tokenizer's side of a run: prompts to ids and completions back to text. Without a
    tokenizer (token prompts), completions are their ids written out and no EOS ends them."""

    def __init__(self, config: Config):
        d = config.data
        where = d.tokenizer or config.model.path  # a model's directory is the default (files/hub.py)
        where = where if where is not None and has_tokenizer(where) else None
        self.encoder = TextEncoder.load(where, d) if where else None
        self.template = load_chat_template(d.chat_template, tokenizer_file(where)) if where else None
        self.eos_id = d.eos_token_id if d.eos_token_id is not None else (self.encoder.eos_id if self.encoder else None)

    def prompt(self, row: dict[str, Any], where: str) -> tuple[np.ndarray, str]:
        if "prompt_ids" in row and row["prompt_ids"] is not None:
            return np.asarray(row["prompt_ids"], dtype=np.int64), ""
        if self.encoder is None:
            raise DataError(f"{where}: text prompts need a tokenizer (data.tokenizer or model.path); rows of token "
                            f"ids go in a prompt_ids column")
        if "messages" in row and row["messages"] is not None:
            if self.template is None:
                raise DataError(f"{where}: chat messages need the model's chat template (data.chat_template); "
                                f"{self.encoder.path} has none: give a .jinja file, or a plain prompt column")
            text = self.template.render(list(row["messages"]), add_generation_prompt=True)
            return self.encoder.encode([text])[0], text
        text = str(row["prompt"])
        return np.asarray(list(self.encoder.prefix) + self.encoder.encode([text])[0].tolist(), dtype=np.int64), text

    def completion_text(self, ids: list[int]) -> str:
        if self.encoder is None:
            return " ".join(str(i) for i in ids)
        known = self.encoder.tokenizer.get_vocab_size(with_added_tokens=True)  # a model's vocabulary may be larger
        return self.encoder.tokenizer.decode([i for i in ids if i < known], skip_special_tokens=True)


def has_tokenizer(path: str) -> bool:
    """Whether a tokenizer.json is there (a file, or a directory holding one): a model without one
    takes token prompts, and text prompts say they need one."""
    return Path(path).is_file() or (Path(path) / "tokenizer.json").is_file()


def read_prompts(config: Config, tokens: Tokens, vocab_size: int) -> list[Prompt]:
    """Every row of data.source as a prompt; a row without a prompt column, with a token outside
    the vocabulary or longer than data.seq_len less grpo.max_new_tokens is refused, naming it."""
    files = resolve_files(config.data.source)
    _, names = first_row_columns(files)
    if not any(c in names for c in PROMPT_COLUMNS):
        raise DataError(f"data.source {config.data.source}: a prompt set needs a column prompt, messages or prompt_ids "
                        f"(has: {', '.join(names)})")
    room = config.data.seq_len - config.grpo.max_new_tokens
    spec = ColumnSpec(any_of=PROMPT_COLUMNS, optional=tuple(c for c in names if c not in PROMPT_COLUMNS))
    prompts = []
    for path in files:
        for batch in read_rows(path, spec, config.data.read_batch_rows):
            for origin, row in batch:
                if isinstance(row, BadRow):
                    raise row
                ids, text = tokens.prompt(row, str(origin))
                if len(ids) == 0 or len(ids) > room or ids.min() < 0 or ids.max() >= vocab_size:
                    raise DataError(f"{origin}: a prompt of {len(ids)} tokens (ids {ids.min() if len(ids) else '-'}.."
                                    f"{ids.max() if len(ids) else '-'}) must have 1 to data.seq_len - "
                                    f"grpo.max_new_tokens = {room} tokens within the vocabulary ({vocab_size})")
                prompts.append(Prompt(ids, text, {k: v for k, v in row.items() if k not in PROMPT_COLUMNS}))
    return prompts


class PromptOrder:
    """The prompts in a fresh shuffled order each epoch (seeded by train.seed and the epoch), taken
    `n` at a time; `position` counts the prompts taken since the start."""

    def __init__(self, prompts: list[Prompt], seed: int, shuffle: bool, position: int = 0):
        self.prompts, self.seed, self.shuffle, self.position = prompts, seed, shuffle, position
        self.epoch_order: tuple[int, np.ndarray] | None = None

    def _order(self, epoch: int) -> np.ndarray:
        if self.epoch_order is None or self.epoch_order[0] != epoch:
            n = len(self.prompts)
            order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            self.epoch_order = (epoch, order)
        return self.epoch_order[1]

    def take(self, n: int) -> list[Prompt]:
        out = []
        for k in range(self.position, self.position + n):
            epoch, i = divmod(k, len(self.prompts))
            out.append(self.prompts[int(self._order(epoch)[i])])
        self.position += n
        return out
