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
from docs_snippets.pages import PAGES, ROOT, snippets
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


def _pages() -> list[tuple[str, str]]:
    return sorted({(page, launch) for launch, items in _launches().items() for page, _ in items})


@pytest.mark.parametrize("page, launch", _pages(), ids=lambda v: v.replace("/", "-").replace(":", "-"))
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


USER_PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("page", USER_PAGES)
def test_user_pages_hold_no_run_history(page):
    text = (ROOT / page).read_text()
    hits = [line for line in text.splitlines() if NOTEBOOK.search(line) and "sha256" not in line]
    assert not hits, f"{page}: run history belongs in benchmarks/results/: {hits[:5]}"
    if page == "README.md":
        assert len(text.splitlines()) <= README_LIMIT, f"README.md has {len(text.splitlines())} lines"
