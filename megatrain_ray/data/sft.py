"""SFT rows (alpaca, sharegpt) to documents with the loss on the assistant's turns only.

Rows become conversations, lists of messages {role, content}:
- alpaca: instruction / input (optional) / output, and an optional `system` column: one user turn
  `{instruction}\\n\\n{input}` (or just the instruction) and one assistant turn `{output}`.
- sharegpt: `conversations` [{from: system|human|gpt, value}] or `messages` [{role, content}];
  the role names of both spellings (human, gpt, model, ...) become system / user / assistant.

A conversation is rendered with the model's own chat template when it has one (chat_template.py;
`data.chat_template`), else with the fallback template of this project (plain text, each piece
tokenized on its own so that masks fall on token boundaries; loss on the assistant's text and
the EOS after it):

    ### System:\\n{system}\\n\\n              (when there is a system turn)
    ### User:\\n{user}\\n\\n
    ### Assistant:\\n{assistant}<EOS>      (the response; "\\n\\n" follows before a next turn)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megatrain_ray.data.chat_template import ChatTemplate, trained_tokens
from megatrain_ray.data.documents import (
    BadRow, Document, Origin, RowBatch, check_token_ids, masked_document, missing_column, text_of,
)
from megatrain_ray.data.tokenization import TextEncoder

ROLES = {
    "system": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "model": "assistant", "chatgpt": "assistant", "bing": "assistant",
}
FALLBACK_HEADINGS = {"system": "System", "user": "User", "assistant": "Assistant"}


def alpaca_messages(row: dict[str, Any], origin: Origin) -> list[dict[str, Any]]:
    instruction = text_of(row, "instruction", origin, "alpaca")
    messages = []
    for column in ("system", "input"):
        if row.get(column) is not None and not isinstance(row[column], str):
            raise BadRow(origin, f"{column!r} not a string",
                         f"column {column!r} must be a string, got {type(row[column]).__name__}")
    if row.get("system"):
        messages.append({"role": "system", "content": row["system"]})
    extra = row.get("input") or ""
    user = f"{instruction}\n\n{extra}" if extra else instruction
    return messages + [{"role": "user", "content": user},
                       {"role": "assistant", "content": text_of(row, "output", origin, "alpaca")}]


def sharegpt_messages(row: dict[str, Any], origin: Origin, strict: bool) -> list[dict[str, Any]]:
    """`conversations` [{from, value}] or `messages` [{role, content}], roles normalised. `strict`
    (the fallback template): text content and known roles only; otherwise the model's template
    judges (tool turns, structured content, extra keys pass through)."""
    if row.get("conversations") is not None:
        column, role_key, text_key = "conversations", "from", "value"
    elif row.get("messages") is not None:
        column, role_key, text_key = "messages", "role", "content"
    else:
        raise missing_column(origin, "conversations' or 'messages", row, "sharegpt")
    turns = row[column]
    if not isinstance(turns, list):
        raise BadRow(origin, f"{column} not a list", f"{column} must be a list of turns, got {type(turns).__name__}")
    out = []
    for i, turn in enumerate(turns):
        text_ok = isinstance(turn, dict) and (isinstance(turn.get(text_key), str)
                                              or (not strict and column == "messages"))
        if not text_ok or not isinstance(turn.get(role_key), str):
            raise BadRow(origin, f"malformed turn in {column}",
                         f"{column}[{i}] must be {{{role_key!r}: str, {text_key!r}: str}}, got {str(turn)[:80]}")
        role = ROLES.get(turn[role_key].lower())
        if role is None and strict:
            raise BadRow(origin, "unknown role",
                         f"{column}[{i}] has unknown role {turn[role_key]!r} (known: {', '.join(ROLES)})")
        message = dict(turn) if column == "messages" else {}
        message.pop(role_key, None)
        message.pop(text_key, None)
        out.append({"role": role or turn[role_key], "content": turn.get(text_key), **message})
    return out


def conversation(row: dict[str, Any], fmt: str, origin: Origin, strict: bool) -> list[dict[str, Any]]:
    return alpaca_messages(row, origin) if fmt == "alpaca" else sharegpt_messages(row, origin, strict)


def skip_reason(messages: list[dict[str, Any]]) -> str | None:
    """Why a conversation would train nothing: no turns, no assistant turn, or only empty answers."""
    if not messages:
        return "empty conversation"
    answers = [m.get("content") for m in messages if m.get("role") == "assistant"]
    if not answers:
        return "no assistant turn"
    if all(isinstance(a, str) and not a.strip() for a in answers):
        return "empty answer"
    return None


def fallback_pieces(messages: list[dict[str, Any]]) -> list[tuple[str, bool]]:
    """The fallback template (see the module docstring) as (text, trained) pieces; "" + True is the EOS."""
    pieces: list[tuple[str, bool]] = []
    for i, message in enumerate(messages):
        role, text = message["role"], message["content"]
        if role == "assistant":
            pieces += [("### Assistant:\n", False), (text, True), ("", True)]
            if i + 1 < len(messages):
                pieces.append(("\n\n", False))
        else:
            pieces.append((f"### {FALLBACK_HEADINGS[role]}:\n{text}\n\n", False))
    return pieces


def fallback_documents(batch: RowBatch, fmt: str, encoder: TextEncoder, vocab_size: int) -> list[Document]:
    chats = [conversation(row, fmt, origin, strict=True) for origin, row in batch]
    skips = [skip_reason(chat) for chat in chats]
    examples = [fallback_pieces(chat) if skip is None else [] for chat, skip in zip(chats, skips)]
    texts = [text for pieces in examples for text, _ in pieces if text]
    encoded = iter(encoder.encode(texts))
    eos = [] if encoder.eos_id is None else [encoder.eos_id]
    docs = []
    for (origin, _), pieces, skip in zip(batch, examples, skips):
        if skip is not None:
            docs.append(Document.skipped(origin, skip))
            continue
        tokens, trained = [list(encoder.prefix)], [[False] * len(encoder.prefix)]
        for text, train in pieces:
            ids = list(next(encoded)) if text else (eos if train else [])
            tokens.append(ids)
            trained.append([train] * len(ids))
        ids = np.asarray([t for part in tokens for t in part], dtype=np.int64)
        mask = np.asarray([m for part in trained for m in part], dtype=bool)
        check_token_ids(ids, vocab_size, origin, "tokens")
        docs.append(masked_document(ids, mask, origin))
    return docs


def template_documents(batch: RowBatch, fmt: str, encoder: TextEncoder, template: ChatTemplate,
                       vocab_size: int) -> list[Document]:
    """Render each conversation with the model's template, tokenize the text whole, and train on
    the tokens of the assistant's spans."""
    chats = [(origin, conversation(row, fmt, origin, strict=False)) for origin, row in batch]
    docs: list[Document | None] = [None if (skip := skip_reason(chat)) is None else Document.skipped(origin, skip)
                                   for origin, chat in chats]
    todo = [(i, origin, template.render_chat(chat, origin)) for i, (origin, chat) in enumerate(chats) if docs[i] is None]
    for (i, origin, (_, spans)), encoding in zip(todo, encoder.encodings([text for _, _, (text, _) in todo])):
        ids = np.asarray(encoding.ids, dtype=np.int64)
        check_token_ids(ids, vocab_size, origin, "tokens")
        docs[i] = masked_document(ids, np.asarray(trained_tokens(encoding.offsets, spans), dtype=bool), origin)
    return docs


def sft_documents(batch: RowBatch, fmt: str, encoder: TextEncoder, template: ChatTemplate | None,
                  vocab_size: int) -> list[Document]:
    if template is None:
        return fallback_documents(batch, fmt, encoder, vocab_size)
    return template_documents(batch, fmt, encoder, template, vocab_size)
