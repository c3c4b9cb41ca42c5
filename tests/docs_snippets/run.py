"""Run named snippets in this process, each inside its glue: `run.py PAGE:NAME [PAGE:NAME...]`.

Launched once per rank (torchrun, `accelerate launch`, or plain python for one process) by
`tests/project/test_docs.py` through `helpers.harness.launch`, which puts tests/ on PYTHONPATH (by hand:
`PYTHONPATH=tests python tests/docs_snippets/run.py PAGE:NAME`), in a scratch working directory.
One launch runs the snippets of every page that launches the same way (starting 2 ranks costs more
than most snippets), in the order given. Each snippet runs in a fresh namespace, in a folder of the
working directory named after its page (files one page writes never meet another's): the glue's set-up
(what a user has before the snippet), the snippet as the page shows it, then the glue's checks. A line
`SNIPPET OK <page>:<name> rank <r>` per snippet tells the test it ran; the first that fails ends the
launch after a line `SNIPPET FAILED <page>:<name> rank <r>` and its traceback.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from docs_snippets.glue import GLUE
from docs_snippets.pages import snippets


def main(items: list[str]) -> None:
    rank = os.environ.get("RANK", "0")
    start = Path.cwd()
    for item in items:
        page, _, name = item.partition(":")
        code = snippets(page)[name]
        glue = GLUE[(page, name)]
        where = start / page.replace("/", "-")
        where.mkdir(exist_ok=True)
        os.chdir(where)
        namespace: dict = {"__name__": "__main__"}
        try:
            exec(compile(glue.setup, f"<glue set-up {page}:{name}>", "exec"), namespace)
            exec(compile(code, f"{page}:{name}", "exec"), namespace)
            exec(compile(glue.check, f"<glue check {page}:{name}>", "exec"), namespace)
        except BaseException:
            print(f"SNIPPET FAILED {page}:{name} rank {rank}", flush=True)
            raise
        print(f"SNIPPET OK {page}:{name} rank {rank}", flush=True)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        import fsdp2_strategy as f2

        f2.shutdown()  # barrier, destroy, os._exit: no gloo abort at exit


if __name__ == "__main__":
    main(sys.argv[1:])
