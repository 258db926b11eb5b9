"""The configuration reference: every key of `config.Config`, its default and the comment that
follows it in config.py, as one Markdown table (`megatrain-ray config`).

The descriptions are the fields' trailing comments, read from config.py's source, so that a key is
documented where it is declared; the README's copy of the table is checked against this output by
a test. Regenerate the README's copy with `python -m megatrain_ray.config_reference README.md`.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import sys
import tokenize
from pathlib import Path
from typing import Any

from megatrain_ray import config

START = "<!-- config-reference:start -->"
END = "<!-- config-reference:end -->"


def field_comments(cls: type) -> dict[str, str]:
    """name -> the comment on the line where the dataclass field is declared ('' when none)."""
    source = inspect.getsource(cls)
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    body = ast.parse(source).body[0].body
    return {node.target.id: comments.get(node.lineno, "")
            for node in body if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}


def format_default(value: Any) -> str:
    """A default as it would be written in the YAML config."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(format_default(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {format_default(v)}" for k, v in value.items()) + "}"
    return str(value)


def default_of(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def reference_rows() -> list[tuple[str, str, str]]:
    """(section.key, default, description) for every key, in the order config.py declares them."""
    rows = []
    for section in dataclasses.fields(config.Config):
        cls = type(default_of(section))
        comments = field_comments(cls)
        for f in dataclasses.fields(cls):
            rows.append((f"{section.name}.{f.name}", format_default(default_of(f)), comments[f.name]))
    return rows


def markdown_cell(text: str) -> str:
    """Text safe inside a Markdown table cell: `|` escaped, `<name>` not read as an HTML tag."""
    return re.sub(r"<(?=[A-Za-z/])", "&lt;", text.replace("|", "\\|"))


def reference_table() -> str:
    """The Markdown table `megatrain-ray config` prints and the README holds."""
    lines = ["| key | default | what it does |", "|---|---|---|"]
    for key, default, description in reference_rows():
        lines.append(f"| `{key}` | `{default}` | {markdown_cell(description)} |")
    return "\n".join(lines) + "\n"


def readme_section(text: str) -> str:
    """The table between the README's config-reference markers."""
    if START not in text or END not in text:
        raise ValueError(f"no {START} ... {END} section")
    return text.split(START, 1)[1].split(END, 1)[0].lstrip("\n")


def update_readme(path: Path) -> None:
    """Put the current table between the markers of the README at `path`."""
    text = path.read_text()
    readme_section(text)  # both markers are there
    head, rest = text.split(START, 1)
    path.write_text(f"{head}{START}\n{reference_table()}{END}{rest.split(END, 1)[1]}")


if __name__ == "__main__":
    update_readme(Path(sys.argv[1] if len(sys.argv) > 1 else "README.md"))
