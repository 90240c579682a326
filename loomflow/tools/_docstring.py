"""A small reader for Google-style docstrings: the summary and the ``Args:`` section.

Only the two pieces a tool schema needs are extracted; every other section is skipped.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field

__all__ = ["Docstring", "parse_docstring"]

# Headers that introduce per-parameter descriptions. Google style says "Args:"; the others
# are common variants that tools written for other frameworks already use.
_ARG_HEADERS = frozenset({"args", "arguments", "parameters", "params"})
# Any other "Word:" or "Two words:" line alone on its line starts a section we skip.
_SECTION = re.compile(r"^([A-Za-z][A-Za-z ]{0,30}):\s*$")
# "name: text", "name (type): text", "*args: text"; the type is ignored, hints are the truth.
_ENTRY = re.compile(r"^\*{0,2}([A-Za-z_]\w*)\s*(?:\(.*?\))?\s*:(?:\s+(.*))?$")


@dataclass(frozen=True, slots=True)
class Docstring:
    """What a docstring says about a function.

    Attributes:
        summary: The first paragraph, its lines joined by single spaces.
        params: Parameter name to description, from the ``Args:`` section.
    """

    summary: str = ""
    params: dict[str, str] = field(default_factory=dict)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def parse_docstring(doc: str | None) -> Docstring:
    """Read the summary paragraph and ``Args:`` entries of a Google-style docstring.

    Args:
        doc: The raw docstring, or ``None``.

    Returns:
        The summary and parameter descriptions; empty when ``doc`` is empty.
    """
    if not doc:
        return Docstring()
    lines = inspect.cleandoc(doc).splitlines()

    summary: list[str] = []
    for line in lines:
        if not line.strip() or _SECTION.match(line):
            break
        summary.append(line.strip())

    params: dict[str, str] = {}
    i = 0
    while i < len(lines):
        header = _SECTION.match(lines[i])
        i += 1
        if header is None or header.group(1).strip().lower() not in _ARG_HEADERS:
            continue
        base = _indent(lines[i - 1])
        entry_indent: int | None = None
        current: str | None = None
        while i < len(lines):
            line = lines[i]
            if not line.strip():
                i += 1
                continue
            indent = _indent(line)
            if indent <= base:
                break  # the next section (or unindented prose) ends the Args block
            if entry_indent is None:
                entry_indent = indent
            match = _ENTRY.match(line.strip()) if indent <= entry_indent else None
            if match is not None:
                current = match.group(1)
                params[current] = (match.group(2) or "").strip()
            elif current is not None:
                # A continuation line: more indented than the entry it belongs to.
                params[current] = f"{params[current]} {line.strip()}".strip()
            i += 1
    return Docstring(summary=" ".join(summary), params=params)
