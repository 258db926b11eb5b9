"""The README's commands as a user copies them: the bash block of a section, line by line."""

from __future__ import annotations


def shell_lines(readme: str, heading: str) -> list[str]:
    """The non-blank lines of the first ```bash block after `## heading`, as written (bash reads their comments)."""
    after = readme[readme.index(f"\n## {heading}\n"):]
    block = after[after.index("```bash\n") + len("```bash\n"):]
    return [line for line in block[:block.index("```")].splitlines() if line.strip()]
