"""The documentation cannot rot: every Python block users copy runs, and the README stays a product page.

Every fenced Python block of the README and of the quickstart, integration, how-to and migration
pages is named (`<!-- snippet: NAME -->`) and has glue in `docs_snippets/glue.py`: what a user writes
around it and how it is launched. The snippets of all pages launched the same way run together in
one launch (2 CPU processes under torchrun or `accelerate launch`, or one process; starting them
costs more than most snippets), each rank printing a line per snippet that ran and passed its checks. The site itself is built with warnings as errors by `make docs`, which
`make test` runs before the suite.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable

import helpers.harness
import pytest
from docs_snippets.glue import GLUE
from docs_snippets.pages import PAGES, ROOT, free_names, names_bound, snippets, user_names
from helpers import TESTS

RUNNER = TESTS / "docs_snippets" / "run.py"
LAUNCHES = ("torchrun", "accelerate", "python", "skip")


def _launches() -> dict[str, list[tuple[str, str]]]:
    """launch ("torchrun", "python", "accelerate:CONFIG") -> its (page, snippet name)s, pages in order."""
    groups: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for (page, name), glue in GLUE.items():  # the glue's order: a page's later snippet may read an earlier one's files
        if glue.launch != "skip":
            groups[glue.launch if glue.launch != "accelerate" else f"accelerate:{glue.config}"].append((page, name))
    return groups


@pytest.fixture(scope="module")
def shared_launch(tmp_path_factory) -> Callable[[str], str]:
    """What the one launch of `launch` printed: the snippets of every page launched that way run
    together (`docs_snippets/run.py`), started on first use."""
    outputs: dict[str, str] = {}

    def output(launch: str) -> str:
        if launch not in outputs:
            kind, _, config = launch.partition(":")
            # In a scratch directory, with no FSDP_* / ACCELERATE_* from outside: the config file alone decides
            # (ACCELERATE_USE_CPU: Accelerate's FSDP launcher drops the file's `use_cpu: true`), whatever the launch.
            proc = helpers.harness.launch(
                kind,
                RUNNER,
                *(f"{page}:{name}" for page, name in _launches()[launch]),
                cwd=tmp_path_factory.mktemp("snippets"),
                config=TESTS / config if config else None,
                env={"TOKENIZERS_PARALLELISM": "false"},
                accelerate_cpu=True,
                timeout=900,
                check=False,
            )
            outputs[launch] = f"{proc.stdout}{proc.stderr}\n{RUNNER.name} exited with code {proc.returncode}"
        return outputs[launch]

    return output


def test_every_python_block_is_named_and_glued():
    found = {(page, name) for page in PAGES for name in snippets(page)}
    assert not found - set(GLUE), f"python blocks without glue in docs_snippets/glue.py: {sorted(found - set(GLUE))}"
    assert not set(GLUE) - found, f"glue for blocks that no page has: {sorted(set(GLUE) - found)}"
    for key, glue in GLUE.items():
        assert glue.launch in LAUNCHES, (key, glue.launch)
        assert glue.launch != "skip" or glue.reason, f"{key}: a skipped snippet says why (needs a GPU, a cluster)"
        assert glue.launch != "accelerate" or (TESTS / glue.config).is_file(), (
            f"{key}: an accelerate launch needs its config file"
        )


def test_unnamed_python_block_is_refused(tmp_path, monkeypatch):
    import docs_snippets.pages as pages

    (tmp_path / "page.md").write_text("text\n\n```python\nprint(1)\n```\n")
    monkeypatch.setattr(pages, "ROOT", tmp_path)
    with pytest.raises(ValueError, match="page.md:3: a python block without"):
        pages.snippets("page.md")


@pytest.mark.parametrize("page", sorted({p for p, _ in GLUE}))
def test_snippets_use_only_names_the_page_declares(page):
    """Run as displayed: what a snippet reads and neither imports nor defines is a name its page says is
    the user's ("`model` and `loader` are yours"), and the glue binds nothing else for it: no import, no
    `f2`, no `TrainingArguments`, no `f2.init_distributed()` done for the snippet."""
    declared = user_names(page)
    for (p, name), glue in GLUE.items():
        if p != page:
            continue
        free = free_names(snippets(page)[name])
        assert free <= declared, (
            f"{page}:{name} uses {sorted(free - declared)}, which it neither defines nor imports and the page "
            f"does not declare as the user's (declared: {sorted(declared)})"
        )
        supplied = {n for n in names_bound(glue.setup) if not n.startswith("_")}
        assert supplied <= declared, (
            f"the glue of {page}:{name} supplies {sorted(supplied - declared)}, which the page does not declare "
            "as the user's: import or define it in the snippet, or name it with a leading underscore"
        )
        assert "init_distributed" not in glue.setup and "init_process_group" not in glue.setup, (
            f"the glue of {page}:{name} starts the process group: the snippet shows it"
        )


def test_user_names_and_free_names():
    import docs_snippets.pages as pages

    text = "Text.\n\nHere `model` (any `nn.Module`) and `loader` are yours. Not `other`.\n\n```python\nx = 1\n```\n"
    assert pages.free_names("import torch\nmodel = f(model)\nfor x in loader:\n    g(x, torch)") == {
        "f",
        "model",
        "loader",
        "g",
    }
    assert pages.free_names("def step(m):\n    return m(batch)\n") == {"batch"}
    assert pages.names_bound("import os as _os\nmodel = 1\ndef loss_fn(out):\n    y = out\n") == {
        "_os",
        "model",
        "loss_fn",
    }
    assert pages._DECLARES.search("`model` is yours")
    sentences = pages._SENTENCE_END.split(" ".join(text.split()))
    assert [set(pages._IDENT.findall(t)) for t in sentences if pages._DECLARES.search(t)] == [{"model", "loader"}]


def _pages() -> list[tuple[str, str]]:
    return sorted({(page, launch) for launch, items in _launches().items() for page, _ in items})


@pytest.mark.parametrize(
    "page, launch",
    _pages(),
    ids=lambda v: v.replace("/", "-").replace(":", "-"),
)
def test_snippets_run(page, launch, shared_launch):
    out = shared_launch(launch)
    ranks = 1 if launch == "python" else 2
    names = [name for p, name in _launches()[launch] if p == page]
    missing = [
        f"{name} rank {r}" for name in names for r in range(ranks) if f"SNIPPET OK {page}:{name} rank {r}" not in out
    ]
    # The launch stops at the first snippet that fails: its traceback is in the output's end.
    failed = sorted({line.split()[2] for line in out.splitlines() if line.startswith("SNIPPET FAILED")})
    assert not missing, (
        f"{page} snippets {missing} did not pass in the {launch} launch (failed: {failed}):\n{out[-6000:]}"
    )


README_LIMIT = 250
NOTEBOOK = re.compile(
    # run letters, narration of past work, commit hashes (hex words with a digit and a letter)
    r"\brun [A-Z]\b|\bruns [A-Z]-[A-Z]\b|this round|not investigated|before it did|\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b"
)


# Narration of a session's work, on any page (results pages included): what was not done and when.
CHATTER = re.compile(
    r"looked into|out of time|not rerun|more runs|earlier runs?\b|\btoday\b|\byesterday\b|we have not|"
    r"have not yet been|has not yet been|this run prompted|run-to-run|from run to run|not investigated",
    re.I,
)
# Where a page names when something ran: results pages only (gpu.md, benchmarks.md, compatibility.md).
WHEN = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b|\b[0-2]\d:[0-5]\d(?::[0-5]\d)? ?UTC\b")
TEST_FILE = re.compile(r"\btests/[\w/.-]*\.py\b")
RESULTS_PAGES = {"docs/gpu.md", "docs/benchmarks.md", "docs/compatibility.md"}
# The reference is generated from the code and the tests (docs/hooks.py names the error tables);
# the architecture page is for contributors.
NOT_FOR_USERS = ("docs/reference/", "docs/concepts/architecture.md", "docs/changelog.md")

USER_PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("page", USER_PAGES)
def test_user_pages_hold_no_run_history(page):
    """User pages say what the software does; when and how often something ran, and which test file
    checks it, belong in benchmarks/results/ and the results pages (gpu.md, benchmarks.md,
    compatibility.md), which carry dates but no narration either."""
    text = (ROOT / page).read_text()
    hits = [line for line in text.splitlines() if NOTEBOOK.search(line) and "sha256" not in line]
    assert not hits, f"{page}: run history belongs in benchmarks/results/: {hits[:5]}"
    chatter = [m.group(0) for m in CHATTER.finditer(text)]
    assert not chatter, f"{page}: narration of past runs: {chatter[:8]}"
    if page not in RESULTS_PAGES and not page.startswith(NOT_FOR_USERS):
        when = [m.group(0) for m in WHEN.finditer(text)]
        assert not when, f"{page}: run dates and times belong on the results pages: {when[:8]}"
        tests = [m.group(0) for m in TEST_FILE.finditer(text)]
        assert not tests, f"{page}: a user page names no test file (say what is tested): {tests[:8]}"
    if page == "README.md":
        assert len(text.splitlines()) <= README_LIMIT, f"README.md has {len(text.splitlines())} lines"


def test_every_config_field_has_a_row_in_the_configuration_guide():
    """docs/guides/configuration.md's table names every `FSDP2Config` field with its default."""
    import dataclasses

    import fsdp2_strategy as f2

    text = (ROOT / "docs" / "guides" / "configuration.md").read_text()
    rows = {
        cell
        for line in text.splitlines()
        if line.startswith("| `")
        for cell in re.findall(r"`(\w+)`", line.split("|")[1])
    }
    missing = [f.name for f in dataclasses.fields(f2.FSDP2Config) if f.name not in rows]
    assert not missing, f"docs/guides/configuration.md has no row for FSDP2Config fields {missing}"


DOCS_PATH = re.compile(r"(?<![\w/.-])docs/[\w/.-]*\w\.(?:md|py|yml|png)\b")


def _files_citing_docs() -> list:
    roots = ["README.md", "CHANGELOG.md", "CONTRIBUTING.md", "pyproject.toml", "Makefile", "mkdocs.yml"]
    files = [ROOT / name for name in roots if (ROOT / name).is_file()]
    files += sorted((ROOT / "docs").rglob("*.md"))
    for folder in ("fsdp2_strategy", "integrations", "examples", "benchmarks", "tests", "docs"):
        files += sorted((ROOT / folder).rglob("*.py"))
    return files


def test_every_cited_docs_path_exists():
    """A `docs/...` path named anywhere in the repository (README, CHANGELOG, the docs, pyproject.toml,
    the Makefile, Python files) is a file that exists: pages move, citations follow."""
    missing = {
        f"{path.relative_to(ROOT)}: {cited}"
        for path in _files_citing_docs()
        for cited in sorted(set(DOCS_PATH.findall(path.read_text(errors="replace"))))
        if not (ROOT / cited).exists()
    }
    assert not missing, "cited docs paths that do not exist:\n" + "\n".join(sorted(missing))


def test_changelog_unreleased_says_what_changed_for_users():
    """The CHANGELOG's Unreleased entries say what changed for a user: no measurements' narration,
    device-suite parts, test layout or test files (those live in benchmarks/results/ and the commits)."""
    text = (ROOT / "CHANGELOG.md").read_text()
    unreleased = text.split("## [Unreleased]", 1)[1].split("\n## [", 1)[0]
    internal = re.compile(r"device suite|device_suite|\btests/|test layout|laid out like|Found on the GPU image", re.I)
    hits = [
        m.group(0) for m in (*CHATTER.finditer(unreleased), *WHEN.finditer(unreleased), *internal.finditer(unreleased))
    ]
    assert not hits, f"CHANGELOG.md, Unreleased: internal work or run history: {hits[:8]}"


FLOOR = re.compile(
    r"\b(torch|Ray Train|Ray|Lightning|Accelerate|transformers|PEFT|TRL|bitsandbytes)"
    r"(?: \(| )?(?:>= ?(\d+\.\d+(?:\.\d+)?)|(\d+\.\d+(?:\.\d+)?) or newer)",
    re.I,
)


def _declared_floors() -> dict[str, str]:
    """{distribution (lower case): its floor} from pyproject.toml's dependencies and extras."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = [*project["dependencies"], *(s for extra in project["optional-dependencies"].values() for s in extra)]
    floors = {}
    for spec in specs:
        match = re.match(r"([A-Za-z0-9_-]+)(?:\[[^]]*\])?>=([\d.]+)", spec)
        if match:
            floors[match.group(1).lower()] = match.group(2)
    return floors


def _release(version: str) -> tuple[int, ...]:
    parts = [int(p) for p in version.split(".")]
    while len(parts) > 2 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def test_stated_version_floors_match_pyproject():
    """ "Ray Train >= 2.60", "torch 2.11 or newer": a floor a page states is the one pyproject.toml declares."""
    floors = _declared_floors()
    wrong = []
    for page in USER_PAGES:
        for match in FLOOR.finditer((ROOT / page).read_text()):
            name = match.group(1).lower().removesuffix(" train")
            stated = match.group(2) or match.group(3)
            if name in floors and _release(stated) != _release(floors[name]):
                wrong.append(f"{page}: {match.group(0)!r}, pyproject.toml says {name}>={floors[name]}")
    assert not wrong, "\n".join(wrong)


def test_pages_say_4bit_weights_are_sharded():
    """A 4-bit (QLoRA) base is sharded as packed bytes by default (`quantised_weights="shard"`): a page
    saying quantised weights are kept whole names the switch that does that (`"replicate"`) or means
    the small quantisation state."""
    stale = []
    for page in USER_PAGES:
        for block in re.split(r"\n\s*\n|\n(?=\|)", (ROOT / page).read_text()):
            text = " ".join(block.split())
            if re.search(r"quantis|4-bit|bitsandbytes", text, re.I) and re.search(
                r"kept whole|never (?:split|sharded)|not sharded", text, re.I
            ):
                if not re.search(r"replicate|quantisation state", text, re.I):
                    stale.append(f"{page}: {text[:160]}")
    assert not stale, "pages saying quantised weights are never sharded:\n" + "\n".join(stale)


def test_pages_say_what_gathered_does_over_its_budget():
    """`f2.gathered` over its memory budget holds the groups that fit (shard/gathered.py): every
    paragraph about its budget, on the pages and in the CHANGELOG, says so."""
    stale = []
    for page in [*USER_PAGES, "CHANGELOG.md"]:
        for block in re.split(r"\n\s*\n|\n(?=- )", (ROOT / page).read_text()):
            text = " ".join(block.split())
            if (
                "gathered" in text
                and re.search(r"over (?:the|its) (?:memory )?budget", text, re.I)
                and "fit" not in text
            ):
                stale.append(f"{page}: {text[:160]}")
    assert not stale, "f2.gathered over its budget holds the groups that fit:\n" + "\n".join(stale)
