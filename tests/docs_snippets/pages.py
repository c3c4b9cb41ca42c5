"""The fenced Python blocks of the README and the docs pages users copy from, by name.

A block is named by the HTML comment on the line above it, `<!-- snippet: NAME -->` (invisible on
the rendered page); `glue.GLUE` says, per `(page, NAME)`, what a user would have written around it
(the model, the data) and how it is launched, or why it is skipped.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md"] + sorted(
    str(p.relative_to(ROOT))
    for folder in ("get-started", "integrations", "guides", "migration", "concepts")
    for p in (ROOT / "docs" / folder).glob("*.md")
)
"""The pages whose Python blocks must run: the README, quickstart, integration, how-to, migration and concept pages."""

_FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```\s*$", re.S | re.M)
_MARK = re.compile(r"<!-- snippet: ([a-z0-9-]+) -->\s*$")


def snippets(page: str) -> dict[str, str]:
    """`{NAME: code}` for every Python block of `page`; ValueError for a block without a name (or a name twice)."""
    text = (ROOT / page).read_text()
    found: dict[str, str] = {}
    for match in _FENCE.finditer(text):
        above = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        line = text[: match.start()].count("\n") + 1
        mark = _MARK.search(above)
        if mark is None:
            raise ValueError(f"{page}:{line}: a python block without `<!-- snippet: NAME -->` on the line above")
        if mark.group(1) in found:
            raise ValueError(f"{page}:{line}: snippet name {mark.group(1)!r} used twice")
        found[mark.group(1)] = match.group(1)
    return found
