"""Markdown reports from templates: ``templates/<name>.md`` with ``$field`` placeholders (string.Template).

The prose lives in the template; the code computes the fields: numbers formatted, tables and lists as
markdown. A field the template names and the code does not give is an error, not a silent blank.
"""

from __future__ import annotations

import time
from pathlib import Path
from string import Template

TEMPLATES = Path(__file__).resolve().parent / "templates"


def render(template: str, fields: dict[str, object]) -> str:
    """The template ``templates/<template>`` with its fields substituted."""
    return Template((TEMPLATES / template).read_text(encoding="utf-8")).substitute(fields)


def table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table (no trailing newline)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def today() -> str:
    return time.strftime("%Y-%m-%d")
