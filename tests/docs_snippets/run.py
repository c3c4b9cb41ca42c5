"""Run named snippets in this process, each inside its glue: `run.py PAGE:NAME [PAGE:NAME...]`.

Launched once per rank (torchrun, `accelerate launch`, or plain python for one process) by
`tests/project/test_docs.py` through `helpers.harness.launch`, which puts tests/ on PYTHONPATH (by hand:
`PYTHONPATH=tests python tests/docs_snippets/run.py PAGE:NAME`), in a scratch working directory.
One launch runs the snippets of every page that launches the same way (starting 2 ranks costs more
than most snippets), in the order given. Each snippet runs in a fresh namespace, in a folder of the
working directory named after its page (files one page writes never meet another's): the glue's set-up
(what a user has before the snippet) in a namespace of its own, then the snippet as the page shows it,
given only the names its page declares as the user's (`pages.user_names`; a set-up that binds any
other public name, or starts the process group, fails), then the glue's checks. A snippet's own
`f2.shutdown()` (which ends the process) is held back until the launch's last snippet ran. A line
`SNIPPET OK <page>:<name> rank <r>` per snippet tells the test it ran; the first that fails ends the
launch after a line `SNIPPET FAILED <page>:<name> rank <r>` and its traceback.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch.distributed as dist

import fsdp2_strategy as f2
from docs_snippets.glue import GLUE
from docs_snippets.pages import snippets, user_names

_real_shutdown = f2.shutdown
_shutdowns: list[str] = []


def _held_shutdown(*args, **kwargs) -> None:
    """A snippet's `f2.shutdown()`: recorded; the launch ends with the real one after its last snippet."""
    _shutdowns.append(repr((args, kwargs)))


def _handed_on(setup: dict, page: str, name: str) -> dict:
    """The names the set-up made that the snippet receives: those its page declares as the user's."""
    declared = user_names(page)
    public = {k for k in setup if not k.startswith("_")}
    extra = public - declared
    if extra:
        raise AssertionError(
            f"the glue of {page}:{name} binds {sorted(extra)}, which the page does not declare as the user's"
        )
    return {k: setup[k] for k in public}


def main(items: list[str]) -> None:
    rank = os.environ.get("RANK", "0")
    start = Path.cwd()
    f2.shutdown = _held_shutdown
    for item in items:
        page, _, name = item.partition(":")
        code = snippets(page)[name]
        glue = GLUE[(page, name)]
        where = start / page.replace("/", "-")
        where.mkdir(exist_ok=True)
        os.chdir(where)
        setup: dict = {"__name__": "__main__"}
        try:
            group_before = dist.is_initialized()
            exec(compile(glue.setup, f"<glue set-up {page}:{name}>", "exec"), setup)
            assert dist.is_initialized() == group_before, f"the glue of {page}:{name} started the process group"
            namespace = {"__name__": "__main__", **_handed_on(setup, page, name)}
            exec(compile(code, f"{page}:{name}", "exec"), namespace)
            exec(compile(glue.check, f"<glue check {page}:{name}>", "exec"), {**setup, **namespace})
        except BaseException:
            print(f"SNIPPET FAILED {page}:{name} rank {rank}", flush=True)
            raise
        print(f"SNIPPET OK {page}:{name} rank {rank}", flush=True)

    if dist.is_available() and dist.is_initialized():
        _real_shutdown()  # barrier, destroy, os._exit: no gloo abort at exit


if __name__ == "__main__":
    main(sys.argv[1:])
