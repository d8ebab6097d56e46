"""Loads the named SQL statements in storage/queries/*.sql.

A statement starts at a `-- name: NAME` line; the comment lines right after
it say what it does. Nothing outside storage/ writes SQL.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

QUERIES_DIR = Path(__file__).with_name("queries")
_NAME = re.compile(r"^--\s*name:\s*([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


def parse(text: str) -> dict[str, str]:
    statements: dict[str, str] = {}
    marks = list(_NAME.finditer(text))
    for mark, following in zip(marks, [*marks[1:], None], strict=True):
        end = following.start() if following else len(text)
        body = text[mark.end():end].strip()
        if mark.group(1) in statements:
            raise ValueError(f"duplicate query name {mark.group(1)!r}")
        statements[mark.group(1)] = body
    return statements


@cache
def queries() -> dict[str, str]:
    """Every named statement of every file in storage/queries, by name."""
    merged: dict[str, str] = {}
    for path in sorted(QUERIES_DIR.glob("*.sql")):
        for name, body in parse(path.read_text()).items():
            if name in merged:
                raise ValueError(f"query {name!r} is defined twice ({path.name})")
            merged[name] = body
    return merged


def q(name: str) -> str:
    return queries()[name]
