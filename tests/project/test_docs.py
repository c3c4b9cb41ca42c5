"""The documentation cannot rot: every Python block users copy runs, and the README stays a product page.

Every fenced Python block of the README and of the quickstart, integration, how-to and migration
pages is named (`<!-- snippet: NAME -->`) and has glue in `docs_snippets/glue.py`: what a user writes
around it and how it is launched. Each page's snippets run together in one launch (2 CPU processes
under torchrun or `accelerate launch`, or one process), each rank printing a line per snippet that
ran and passed its checks. The site itself is built with warnings as errors by `make docs`, which
`make test` runs before the suite.
"""

from __future__ import annotations

import re
from collections import defaultdict

import helpers.harness
import pytest
from docs_snippets.glue import GLUE
from docs_snippets.pages import PAGES, ROOT, snippets
from helpers import TESTS

RUNNER = TESTS / "docs_snippets" / "run.py"
LAUNCHES = ("torchrun", "accelerate", "python", "skip")


def _launches() -> dict[tuple[str, str], list[str]]:
    """(page, launch) -> snippet names, for every glued snippet that runs."""
    groups: dict[tuple[str, str], list[str]] = defaultdict(list)
    for (page, name), glue in GLUE.items():
        if glue.launch != "skip":
            groups[(page, glue.launch if glue.launch != "accelerate" else f"accelerate:{glue.config}")].append(name)
    return groups


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


@pytest.mark.parametrize("page, launch", sorted(_launches()), ids=lambda v: v.replace("/", "-").replace(":", "-"))
def test_snippets_run(page, launch, tmp_path):
    names = _launches()[(page, launch)]
    kind, _, config = launch.partition(":")
    # In a scratch directory, with no FSDP_* / ACCELERATE_* from outside: the config file alone decides
    # (ACCELERATE_USE_CPU: Accelerate's FSDP launcher drops the file's `use_cpu: true`), whatever the launch.
    proc = helpers.harness.launch(
        kind,
        RUNNER,
        page,
        *names,
        cwd=tmp_path,
        config=TESTS / config if config else None,
        env={"TOKENIZERS_PARALLELISM": "false"},
        accelerate_cpu=True,
        timeout=600,
        check=False,
    )
    out = proc.stdout + proc.stderr
    ranks = 1 if kind == "python" else 2
    missing = [
        f"{name} rank {r}" for name in names for r in range(ranks) if f"SNIPPET OK {page}:{name} rank {r}" not in out
    ]
    assert proc.returncode == 0 and not missing, (
        f"{page} snippets {missing} failed ({RUNNER.name} exited with code {proc.returncode}):\n{out[-6000:]}"
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
