"""A model's own chat template, rendered the way transformers' `apply_chat_template` renders it.

Where the template comes from (as transformers loads it, beside the tokenizer.json): a
`chat_template.jinja` file, else the `chat_template` of `tokenizer_config.json` (a string, or a
list of named templates of which "default" is taken). The template sees what transformers gives
it: `messages`, `tools` and `documents` (None here), `add_generation_prompt`, and the named
special tokens of tokenizer_config.json (`bos_token`, `eos_token`, ..., any `*_token`) as
strings; Jinja runs sandboxed with trim_blocks and lstrip_blocks, loop controls, a `tojson`
filter that does not escape HTML, and the globals `raise_exception` and `strftime_now`. The
rendered text is tokenized whole, special tokens recognised and none added (the template writes
its own BOS).

Which characters are the assistant's (the loss mask):
- a template with `{% generation %} ... {% endgeneration %}` blocks: exactly what they render,
  as in transformers' `return_assistant_tokens_mask`;
- any other template: found by rendering. For the k-th message, if it is the assistant's, the
  conversation up to it is rendered with `add_generation_prompt=True` (the prompt the model sees
  at inference) and up to and including it without: the characters between the two, less
  trailing whitespace, are the assistant's turn: its text and the end-of-turn token the template
  writes after it (`<|im_end|>`, `<|eot_id|>`, `</s>`), which is what teaches the model to stop.
  This needs a template that renders a conversation's beginning the same whether or not more
  follows (Qwen, Llama, Mistral, Gemma ... do); one that does not is refused, naming the row.

A token is trained when its characters overlap an assistant span.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

from megatrain_ray.data.documents import BadRow, DataError, Origin

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
# Marks the output of a {% generation %} block in the rendered text; removed before tokenizing.
GEN_START, GEN_END = "\ue000", "\ue001"
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment():
    """The sandboxed Jinja environment chat templates are written for (see the module docstring)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}body{% endgeneration %}`: the body, wrapped in markers."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller) -> str:
            return GEN_START + caller() + GEN_END

    class Namespace(jinja2.utils.Namespace):
        """namespace() that refuses underscore names, as transformers' does (no reach into internals)."""

        def __init__(*args, **kwargs):
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=Namespace)
    return env


def plain_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as transformers hands it to the template: keys holding None dropped, reasoning
    (under any of its names) also under `thinking` and `reasoning_content`."""
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in REASONING_FIELDS if k in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _token_text(value: Any) -> str | None:
    """A special token of tokenizer_config.json: a string, or an AddedToken dict with 'content'."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class ChatTemplate:
    """A compiled template and the special tokens it is rendered with."""

    def __init__(self, source: str, text: str, special_tokens: dict[str, str]):
        self.source, self.text, self.special_tokens = source, text, special_tokens
        self.has_generation_blocks = re.search(r"\{%-?\s*generation\s*-?%\}", text) is not None
        try:
            self.template = _environment().from_string(text)
        except Exception as e:  # jinja2.TemplateSyntaxError and friends
            raise DataError(f"the chat template of {source} does not compile: {e}") from None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """The template's text for these messages, generation markers still in."""
        return self.template.render(messages=messages, tools=None, documents=None,
                                    add_generation_prompt=add_generation_prompt, **self.special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], origin: Origin) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans of the assistant's turns."""
        import jinja2

        messages = [plain_message(m) for m in messages]
        try:
            if self.has_generation_blocks:
                return split_markers(self.render(messages), origin)
            return self._render_by_prefixes(messages, origin)
        except jinja2.TemplateError as e:
            raise BadRow(origin, "refused by the chat template",
                         f"the chat template of {self.source} refused this conversation: {e}") from None

    def _render_by_prefixes(self, messages: list[dict[str, Any]], origin: Origin) -> tuple[str, list[tuple[int, int]]]:
        full = self.render(messages)
        spans = []
        for k, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            prompt = self.render(messages[:k], add_generation_prompt=True)
            turn = self.render(messages[:k + 1]).rstrip()
            if not (full.startswith(prompt) and full.startswith(turn)):
                raise DataError(
                    f"{origin}: the chat template of {self.source} renders the conversation up to message {k} "
                    "differently from the whole conversation, so the assistant's tokens cannot be found by "
                    "rendering; give the template {% generation %} markers (data.chat_template: a .jinja file) "
                    "or set data.chat_template=fallback"
                )
            if len(turn) > len(prompt):
                spans.append((len(prompt), len(turn)))
        return full, spans


def split_markers(text: str, origin: Origin) -> tuple[str, list[tuple[int, int]]]:
    """Remove the generation markers; the spans they enclosed, in the cleaned text."""
    out, spans, start, pos = [], [], None, 0
    for ch in text:
        if ch == GEN_START and start is None:
            start = pos
        elif ch == GEN_END and start is not None:
            if pos > start:
                spans.append((start, pos))
            start = None
        elif ch in (GEN_START, GEN_END):
            raise DataError(f"{origin}: unbalanced {{% generation %}} blocks (or the data holds U+E000/U+E001)")
        else:
            out.append(ch)
            pos += 1
    if start is not None:
        raise DataError(f"{origin}: unbalanced {{% generation %}} blocks (or the data holds U+E000/U+E001)")
    return "".join(out), spans


def trained_tokens(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """Tokens (by character offsets) that overlap an assistant span."""
    mask = [False] * len(offsets)
    if not spans:
        return mask
    for i, (s, e) in enumerate(offsets):
        mask[i] = any(s < b and e > a for a, b in spans)
    return mask


def read_template_files(directory: Path) -> tuple[str, str] | None:
    """(where, template text) of the model's default chat template, or None when it has none."""
    file = directory / TEMPLATE_FILE
    if file.is_file():
        return str(file), file.read_text(encoding="utf-8")
    config = read_tokenizer_config(directory)
    template = config.get("chat_template")
    where = str(directory / CONFIG_FILE)
    if isinstance(template, str):
        return where, template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return where, named["default"]
        raise DataError(f"{where} has chat templates {sorted(map(str, named))} but none named 'default'; "
                        "set data.chat_template to a .jinja file")
    return None


def read_tokenizer_config(directory: Path) -> dict[str, Any]:
    file = directory / CONFIG_FILE
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:
        raise DataError(f"{file}: cannot read: {e}") from None
    return config if isinstance(config, dict) else {}


def special_tokens(directory: Path) -> dict[str, str]:
    """The named special tokens the template sees, from tokenizer_config.json (else
    special_tokens_map.json): bos_token, eos_token, ... and any model-specific `*_token`."""
    found: dict[str, str] = {}
    legacy = directory / "special_tokens_map.json"
    sources = [read_tokenizer_config(directory)]
    if legacy.is_file():
        try:
            sources.insert(0, json.loads(legacy.read_text(encoding="utf-8")))
        except (ValueError, OSError):
            pass
    for config in sources:
        for key, value in config.items():
            text = _token_text(value)
            if key.endswith("_token") and text is not None:
                found[key] = text
    return found



def load_chat_template(choice: str, tokenizer_file: Path) -> ChatTemplate | None:
    """data.chat_template: `auto` (the model's template if it has one, else the fallback), `model`
    (the model's, required), `fallback` (the project's plain template: None here) or a .jinja file."""
    directory = tokenizer_file.parent
    if choice == "fallback":
        return None
    if choice in ("auto", "model"):
        found = read_template_files(directory)
        if found is None:
            if choice == "model":
                raise DataError(
                    f"data.chat_template=model but {directory} has no chat template ({TEMPLATE_FILE}, or "
                    f"'chat_template' in {CONFIG_FILE}); set data.chat_template=fallback or to a .jinja file"
                )
            return None
        where, text = found
    else:
        file = Path(choice).expanduser()
        if not file.is_file():
            raise DataError(f"data.chat_template {choice!r}: expected auto, model, fallback or a .jinja file")
        where, text = str(file), file.read_text(encoding="utf-8")
    return ChatTemplate(where, text, special_tokens(directory))
