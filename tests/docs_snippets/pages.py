"""The fenced Python blocks of the README and the docs pages users copy from, by name.

A block is named by the HTML comment on the line above it, `<!-- snippet: NAME -->` (invisible on
the rendered page); `glue.GLUE` says, per `(page, NAME)`, what a user would have written around it
(the model, the data) and how it is launched, or why it is skipped.
"""

from __future__ import annotations

import ast
import builtins
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


_IDENT = re.compile(r"`([A-Za-z_][A-Za-z0-9_]*)(?:\([^`]*\))?`")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z`(\[])")
_DECLARES = re.compile(r"\b(?:are|is) yours\b")


def user_names(page: str) -> set[str]:
    """The names `page` says are the user's: every `identifier` in backticks of a sentence (outside
    code blocks) saying "... are yours" or "... is yours", e.g. "`model` and `loader` are yours"."""
    text = re.sub(r"^```.*?^```\s*$", "", (ROOT / page).read_text(), flags=re.S | re.M)
    names: set[str] = set()
    for paragraph in re.split(r"\n\s*\n", text):
        for sentence in _SENTENCE_END.split(" ".join(paragraph.split())):
            if _DECLARES.search(sentence):
                names.update(_IDENT.findall(sentence))
    return names


def _stored(node: ast.AST) -> set[str]:
    """Every name `node` binds anywhere inside it (assignments, loop and `with` targets, imports,
    definitions and their arguments, comprehension variables, `except ... as`)."""
    out: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, (ast.Store, ast.Del)):
            out.add(sub.id)
        elif isinstance(sub, (ast.Import, ast.ImportFrom)):
            out.update((alias.asname or alias.name).split(".")[0] for alias in sub.names)
        elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(sub.name)
        elif isinstance(sub, ast.arg):
            out.add(sub.arg)
        elif isinstance(sub, ast.ExceptHandler) and sub.name:
            out.add(sub.name)
    return out


def _loaded(node: ast.AST) -> set[str]:
    return {sub.id for sub in ast.walk(node) if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load)}


def free_names(code: str) -> set[str]:
    """The names a snippet reads that it neither defines (before use, statement by statement) nor
    imports, builtins aside: what must come from the user."""
    bound = set(dir(builtins))
    free: set[str] = set()
    for stmt in ast.parse(code).body:
        if isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            value = stmt.value if stmt.value is not None else ast.Constant(None)
            # the right-hand side runs first: `model = f2.shard_model(model)` reads the user's `model`
            inner = _stored(value)
            free |= _loaded(value) - bound - inner
            if isinstance(stmt, ast.AugAssign):
                free |= _loaded(stmt.target) - bound
        else:
            free |= _loaded(stmt) - bound - _stored(stmt)
        bound |= _stored(stmt)
    return free


def names_bound(code: str) -> set[str]:
    """The module-level names a piece of glue set-up binds (what it could hand a snippet): not the
    arguments or locals of the functions and lambdas it defines."""
    out: set[str] = set()
    todo: list[ast.AST] = [ast.parse(code)]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
            continue
        if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        todo.extend(ast.iter_child_nodes(node))
    return out
