"""Run named snippets of one page in this process, each inside its glue: `run.py PAGE NAME [NAME...]`.

Launched once per rank (torchrun, `accelerate launch`, or plain python for one process) by
`tests/project/test_docs.py` through `helpers.harness.launch`, which puts tests/ on PYTHONPATH (by hand:
`PYTHONPATH=tests python tests/docs_snippets/run.py PAGE NAME`), in a scratch working directory.
Each snippet gets a fresh namespace: the glue's set-up (what a user has before the snippet), the
snippet as the page shows it, then the glue's checks. A line `SNIPPET OK <page>:<name> rank <r>` per snippet tells the test it ran.
"""

from __future__ import annotations

import os
import sys

from docs_snippets.glue import GLUE
from docs_snippets.pages import snippets


def main(page: str, names: list[str]) -> None:
    code = snippets(page)
    rank = os.environ.get("RANK", "0")
    for name in names:
        glue = GLUE[(page, name)]
        namespace: dict = {"__name__": "__main__"}
        exec(compile(glue.setup, f"<glue set-up {page}:{name}>", "exec"), namespace)
        exec(compile(code[name], f"{page}:{name}", "exec"), namespace)
        exec(compile(glue.check, f"<glue check {page}:{name}>", "exec"), namespace)
        print(f"SNIPPET OK {page}:{name} rank {rank}", flush=True)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        import fsdp2_strategy as f2

        f2.shutdown()  # barrier, destroy, os._exit: no gloo abort at exit


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
