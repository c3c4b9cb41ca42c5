"""mkdocs hooks: the reference pages that are generated from the code, so they cannot drift.

A page holding `<!-- generated: cli -->` gets the command line's reference, read from the argument
parser `fsdp2-strategy` runs (`fsdp2_strategy.cli.main.build_parser`): every subcommand and option
with its help text and default. A page holding `<!-- generated: errors -->` gets the catalogue of
error messages, read (with `ast`, nothing imported) from the bad-input tables the test suite
asserts: `tests/core/test_bad_inputs*.py` and `tests/core/cli/test_bad_inputs_cli.py`, one row per
bad input, with the call, the exception and the phrases its message must hold. A page holding
`<!-- generated: accelerate-keys -->` gets the table of accelerate config keys the Accelerate adapter
reads (`integrations/accelerate/keys.py`). The plots of benchmarks/results/ are published as `plots/*.png`.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ERROR_TABLES = ("core/test_bad_inputs.py", "core/test_bad_inputs_world.py", "core/cli/test_bad_inputs_cli.py")
TABLE_TITLES = {
    "CONFIG_ROWS": "FSDP2Config",
    "SHARDING_ROWS": "shard_model and fully_shard",
    "WEIGHTS_ROWS": "Full weights (load_full_weights)",
    "CHECKPOINT_ROWS": "Checkpoints",
    "LIGHTNING_ROWS": "Lightning Trainer",
    "ACCELERATE_ROWS": "Accelerate",
    "FABRIC_ROWS": "Lightning Fabric",
    "RAY_ROWS": "Ray Train",
    "WORLD_ROWS": "Inside a process group",
    "CLI_ROWS": "Command line (exit status, message on stderr)",
}


def on_files(files, config):
    """The plots under benchmarks/results/ become site files `plots/NAME.png`, so the pages show them
    where they explain (`![...](../plots/accumulation.png)`) without a copy under docs/."""
    from mkdocs.structure.files import File

    for png in sorted((ROOT / "benchmarks" / "results").glob("*.png")):
        files.append(File.generated(config, f"plots/{png.name}", abs_src_path=str(png)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 (mkdocs' signature)
    if "<!-- generated: cli -->" in markdown:
        markdown = markdown.replace("<!-- generated: cli -->", cli_reference())
    if "<!-- generated: errors -->" in markdown:
        markdown = markdown.replace("<!-- generated: errors -->", error_catalogue())
    if "<!-- generated: accelerate-keys -->" in markdown:
        from fsdp2_strategy.integrations.accelerate.keys import markdown_table

        markdown = markdown.replace("<!-- generated: accelerate-keys -->", markdown_table())
    return markdown


# ----- the command line ------------------------------------------------------------------------


def cli_reference() -> str:
    """Markdown for every subcommand of `fsdp2-strategy`: usage, description, one row per option."""
    from fsdp2_strategy.cli.main import build_parser

    parser = build_parser()
    parts = [_parser_section(parser, "fsdp2-strategy", level=2)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                parts.append(_parser_section(sub, f"fsdp2-strategy {name}", level=2, summary=helps.get(name)))
    return "\n\n".join(parts)


def _parser_section(parser: argparse.ArgumentParser, title: str, *, level: int, summary: str | None = None) -> str:
    usage = parser.format_usage().replace("usage: ", "").strip()
    lines = [f"{'#' * level} `{title}`", ""]
    if summary or parser.description:
        lines += [_escape(summary or parser.description or ""), ""]
    lines += ["```text", usage, "```", "", "| argument | meaning | default |", "|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            lines.append(f"| `{{{','.join(action.choices)}}}` | the subcommand (sections below) | |")
            continue
        names = ", ".join(f"`{n}`" for n in action.option_strings) or f"`{action.dest}`"
        if action.choices:
            names += " {" + ", ".join(str(c) for c in action.choices) + "}"
        default = "" if action.default in (None, argparse.SUPPRESS, False) or action.required else action.default
        lines.append(f"| {names} | {_escape(action.help or '')} | {_escape(str(default))} |")
    return "\n".join(lines)


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# ----- the error catalogue ---------------------------------------------------------------------


def error_catalogue() -> str:
    """Markdown tables of every bad input the tests assert: the call, the exception, the message's phrases."""
    sections = []
    for name in ERROR_TABLES:
        source = (ROOT / "tests" / name).read_text()
        for table, rows in _tables(source):
            title = TABLE_TITLES.get(table, table)
            lines = [f"## {title}", "", "| input | call | raises | the message says |", "|---|---|---|---|"]
            lines += [_row(source, row) for row in rows]
            sections.append("\n".join(lines))
    return "\n\n".join(sections)


def _tables(source: str):
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.List) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name) and target.id.endswith("ROWS"):
                rows = [
                    r
                    for r in node.value.elts
                    if isinstance(r, ast.Call) and _call_name(r) in ("Row", "CliRow", "WorldRow")
                ]
                if rows:
                    yield target.id, rows


def _call_name(node: ast.Call) -> str:
    return node.func.id if isinstance(node.func, ast.Name) else ""


def _row(source: str, row: ast.Call) -> str:
    row_id, call, raised, says = (row.args + [None] * 4)[:4]
    label = ast.literal_eval(row_id) if isinstance(row_id, ast.Constant) else "?"
    while isinstance(call, ast.Lambda):  # a WorldRow's call builds the call inside the world
        call = call.body
    code = ast.get_source_segment(source, call) or ""
    code = " ".join(code.split())
    raises = ast.get_source_segment(source, raised) if raised is not None else ""
    if _call_name(row) == "CliRow":
        raises = f"exit status {raises.lstrip('_').lower()}"  # _USAGE -> usage (2), _DAMAGED -> damaged (1)
    phrases = _phrases(source, says)
    return f"| {_escape(label)} | `{_escape(code)}` | {_escape(raises)} | {_escape(phrases)} |"


def _phrases(source: str, says: ast.AST | None) -> str:
    if isinstance(says, ast.Tuple):
        texts = []
        for element in says.elts:
            if isinstance(element, ast.Constant) and isinstance(element.value, str):
                texts.append(f"`{element.value}`" if "`" not in element.value else element.value)
            else:
                texts.append(f"`{ast.get_source_segment(source, element)}`")
        return ", ".join(texts)
    return ast.get_source_segment(source, says) if says is not None else ""
