"""Run a function on N CPU ranks (gloo) from a test, with tracebacks and a hard timeout.

`run_distributed(fn, world_size, *args)` spawns `world_size` processes, initialises a gloo
process group in each (with a collective timeout), calls `fn(*args)` and returns the list of
per-rank return values. Each rank is judged on its own: one that raises (its traceback is shown),
exits with another code than expected (0, or the given `exit_codes`), exits without a result or
hangs (killed once the world times out, or soon after another rank went wrong) fails the test,
and the failure names every such rank and why.

Workers end with barrier, destroy, flush, `os._exit`: with torch 2.13 on gloo, a process
that ran a DCP save otherwise aborts at interpreter exit about 1 run in 5
(see fsdp2_strategy.distributed.shutdown).

Ranks are forked from a forkserver that imported torch and the core once (`PRELOAD`): a 2-rank
world starts in about 0.1 s instead of the 4 s two spawned interpreters take to import torch on
2 cores, which over the suite's worlds is minutes. Each rank still gets a fresh process, the
caller's environment and working directory (a forkserver's own would be those of its start).
"""

from __future__ import annotations

import faulthandler
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

PORT_TAKEN = 75
"""Rank 0's exit code when its store's port was taken before it could bind it (EX_TEMPFAIL)."""
PORT_ATTEMPTS = 3
"""Worlds started per `run_distributed` call while rank 0 finds its port taken."""

PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "fsdp2_strategy", "helpers.harness"]
"""Imported once by the forkserver. torch's import starts one thread (OpenBLAS's, which handles
fork); lightning's starts another, so lightning is left to the ranks that use it."""

_context: Any = None


def _forkserver() -> Any:
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


class DistributedTestError(AssertionError):
    """A rank failed or the world timed out."""


def free_port() -> int:
    """A TCP port nobody listens on now (for a world's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    outdir: str,
    fn: Callable,
    args: tuple,
    parent_environ: dict,
    env: dict,
    pg_timeout: float,
) -> None:
    os.environ.clear()
    os.environ.update(parent_environ)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(env.pop("LOCAL_WORLD_SIZE", world_size)),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    os.environ.update({k: str(v) for k, v in env.items()})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # 2 cores shared by up to 4 ranks
    # A crash (SIGSEGV in a kernel or in gloo) or a hang leaves no Python traceback of its own: the
    # fault file gets every thread's stack on a fatal signal, or on SIGUSR1 before a hung rank is killed.
    fault_file = open(_fault_path(outdir, rank), "w")  # noqa: SIM115 - open until os._exit
    faulthandler.enable(fault_file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, fault_file, all_threads=True)
    code = 0
    try:
        try:
            dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout))
        except Exception as exc:
            if rank == 0 and "EADDRINUSE" in str(exc):
                os._exit(PORT_TAKEN)  # nothing ran: `run_distributed` starts the world again on another port
            raise
        with open(_joined_path(outdir, rank), "w"):
            pass
        result = fn(*args)
        payload = ("ok", result)
    except BaseException:  # DCP's CheckpointException is a BaseException
        payload = ("error", traceback.format_exc())
        code = 1
    try:
        data = pickle.dumps(payload)
    except Exception:
        data = pickle.dumps(("ok", repr(payload[1])))
    with open(_result_path(outdir, rank), "wb") as f:
        f.write(data)
    if code == 0 and dist.is_initialized():
        try:
            dist.barrier()
            dist.destroy_process_group()
        except Exception:
            code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_distributed(
    fn: Callable,
    world_size: int = 2,
    *args: Any,
    timeout: float = 180.0,
    env: dict | None = None,
    exit_codes: int | Sequence[int] | None = None,
    grace: float = 30.0,
) -> list[Any]:
    """Run `fn(*args)` on `world_size` gloo ranks; return each rank's result (rank order).

    By default every rank must return from `fn` and exit 0. `exit_codes` (one code for every rank,
    or one per rank) says instead that the ranks end their own processes (`os._exit`, `f2.shutdown`;
    `-N` for a signal N) with these codes; such a rank's result is None. Anything else fails the test
    with one paragraph per rank that went wrong: it raised (its traceback), exited with another code,
    exited without a result, or hung: still running `grace` seconds after another rank went wrong,
    or when the world timed out (`timeout`, the ranks' collective timeout, plus a little slack).
    """
    if exit_codes is None or isinstance(exit_codes, int):
        expected = [exit_codes or 0] * world_size
    else:
        expected = list(exit_codes)
        if len(expected) != world_size:
            raise ValueError(f"exit_codes={exit_codes!r} has {len(expected)} codes for {world_size} ranks")
    ctx = _forkserver()
    parent_environ = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="f2dist-") as outdir:

        def start() -> list:
            port = free_port()
            procs = []
            for rank in range(world_size):
                p = ctx.Process(
                    target=_worker,
                    args=(rank, world_size, port, outdir, fn, args, parent_environ, dict(env or {}), timeout),
                )
                p.start()
                procs.append(p)
            return procs

        procs = start()
        # The store's port can be taken between free_port() and the store binding it (another world's
        # connection got it): rank 0 then exits PORT_TAKEN before anything ran, and the world starts again.
        for _ in range(PORT_ATTEMPTS - 1):
            while all(p.exitcode is None for p in procs) and not _joined_all(outdir, procs):
                time.sleep(0.05)
            if procs[0].exitcode != PORT_TAKEN:
                break
            for p in procs:
                p.kill()
                p.join(10)
            procs = start()

        def ended_badly(rank: int) -> bool:
            """Whether `rank` ended with another code than expected, or (by default) without a result."""
            code = procs[rank].exitcode  # before looking for the result: a rank writes it, then exits
            if code is None:
                return False
            return code != expected[rank] or (exit_codes is None and not os.path.exists(_result_path(outdir, rank)))

        def problem(rank: int, written: tuple, hung_why: str | None) -> str | None:
            """What went wrong with `rank`, which wrote `written` (`_read`) and is still running if
            `hung_why` says why it was killed; None: nothing."""
            code, want = procs[rank].exitcode, expected[rank]
            status, value = written
            if hung_why is not None:
                then = "returned, then " if status == "ok" else ""
                return f"rank {rank} {then}hung: still running {hung_why}{_stacks(outdir, rank)}"
            if status == "error":
                return f"rank {rank} raised (exit code {code}):\n{value}"
            if code != want:
                what = "returned, then exited" if status == "ok" else "exited without a result"
                return (
                    f"rank {rank} {what} with code {_describe(code)}, expected {_describe(want)}{_stacks(outdir, rank)}"
                )
            if status is None and exit_codes is None:
                return f"rank {rank} exited with code 0 without a result (it ended its own process)"
            return None

        # Slack past the ranks' own collective timeout, so a rank can report its timeout first.
        limit = timeout + min(10.0, timeout)
        deadline, why = time.monotonic() + limit, f"when the world timed out after {limit:.0f}s"
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            bad = [r for r in range(world_size) if ended_badly(r)]
            if bad and deadline > time.monotonic() + grace:
                # The others get `grace` seconds to end on their own (and report their own errors).
                deadline, why = time.monotonic() + grace, f"{grace:.0f}s after rank {bad[0]} went wrong"
            time.sleep(0.05)
        hung = {r for r, p in enumerate(procs) if p.is_alive()}
        if hung:
            for r in hung:
                os.kill(procs[r].pid, signal.SIGUSR1)  # faulthandler writes its stacks to the fault file
            time.sleep(1.0)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
        written = [_read(outdir, r) for r in range(world_size)]
        problems = [problem(r, written[r], why if r in hung else None) for r in range(world_size)]
        if any(problems):
            raise DistributedTestError("\n".join(m for m in problems if m))
        return [value if status == "ok" else None for status, value in written]


def _fault_path(outdir: str, rank: int) -> str:
    return os.path.join(outdir, f"rank{rank}.fault")


def _stacks(outdir: str, rank: int) -> str:
    """The stacks faulthandler wrote for `rank` (a fatal signal, or SIGUSR1 when it hung), as an
    indented paragraph; empty when it wrote none."""
    try:
        text = Path(_fault_path(outdir, rank)).read_text().strip()
    except OSError:
        return ""
    return "\n  " + "\n  ".join(text.splitlines()) if text else ""


def _result_path(outdir: str, rank: int) -> str:
    return os.path.join(outdir, f"rank{rank}.pkl")


def _joined_path(outdir: str, rank: int) -> str:
    """Written by a rank once it joined the process group (the world's port served)."""
    return os.path.join(outdir, f"rank{rank}.joined")


def _joined_all(outdir: str, procs: list) -> bool:
    return all(os.path.exists(_joined_path(outdir, r)) for r in range(len(procs)))


def _read(outdir: str, rank: int) -> tuple[str | None, Any]:
    """What `rank` wrote: ("ok", its result), ("error", its traceback), or (None, None): nothing."""
    try:
        with open(_result_path(outdir, rank), "rb") as f:
            return pickle.load(f)
    except (FileNotFoundError, EOFError):  # not written (an EOFError: killed while writing it)
        return None, None


def _describe(code: int | None) -> str:
    """An exit code as multiprocessing gives it: -N is "killed by signal N"."""
    if code is not None and code < 0 and -code in signal.valid_signals():
        return f"{code} ({signal.Signals(-code).name})"
    return str(code)


def run_agreeing(fn: Callable, world_size: int = 2, *args: Any, **kwargs: Any) -> Any:
    """`run_distributed`, asserting that every rank returned the same result; returns that result.

    For worlds whose results are computed from collectively gathered values (full tensors,
    counts of symmetric collectives): a rank that diverged fails the test instead of being ignored.
    """
    results = run_distributed(fn, world_size, *args, **kwargs)
    for rank, result in enumerate(results[1:], start=1):
        difference = _first_difference(results[0], result)
        assert difference is None, f"rank {rank} disagrees with rank 0: {difference}"
    return results[0]


def _first_difference(a: Any, b: Any, path: str = "result") -> str | None:
    """Where `a` and `b` first differ (tensors compared by value), None when they are equal."""
    import torch

    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{path}: keys {sorted(map(repr, a.keys() ^ b.keys()))} on one side only"
        return next((d for k in a if (d := _first_difference(a[k], b[k], f"{path}[{k!r}]")) is not None), None)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and type(a) is type(b) and len(a) == len(b):
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := _first_difference(x, y, f"{path}[{i}]"))), None)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return None if a.dtype == b.dtype and torch.equal(a, b) else f"{path}: tensors differ"
    return None if a == b else f"{path}: {a!r} != {b!r}"


def rank_reports(path: str | os.PathLike, world_size: int) -> list[dict]:
    """Every rank's report of a flow script (`helpers.collect.run_flows`: OUT.rank0.json, ...), in rank order.

    Fails naming each rank that wrote none and each flow that raised, with the rank it raised on."""
    from helpers.collect import rank_path

    reports, summary, tracebacks = [], [], []
    for rank in range(world_size):
        file = rank_path(path, rank)
        report = json.loads(file.read_text()) if file.is_file() else {}
        if not file.is_file():
            summary.append(f"rank {rank} wrote no report ({file.name} is missing)")
        for flow, entry in report.items():
            if isinstance(entry, dict) and "error" in entry:
                summary.append(f"flow {flow} raised on rank {rank}")
                tracebacks.append(f"--- flow {flow} raised on rank {rank}:\n{entry['error']}")
        reports.append(report)
    assert not summary, "\n".join(summary + tracebacks)
    return reports


def agreed_report(reports: list[dict], per_rank: Iterable[str] = ()) -> dict:
    """Rank 0's report, after asserting that every other rank's is equal to it (flows, keys and values),
    except at the dotted paths `per_rank` ("flow.key": what each rank measures on its own, such as a
    time), which the tests check on every rank."""
    skip = set(per_rank)
    for rank, report in enumerate(reports[1:], start=1):
        differences = _differences(reports[0], report, "", skip)
        assert not differences, f"rank {rank}'s report differs from rank 0's:\n" + "\n".join(differences)
    return reports[0]


def _differences(a: Any, b: Any, path: str, skip: set[str]) -> list[str]:
    """Every dotted path at which the JSON values `a` (rank 0's) and `b` differ, outside `skip`."""
    if path in skip:
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        where = {k: f"{path}.{k}" if path else str(k) for k in a.keys() | b.keys()}
        out = [f"{where[k]}: on one rank only" for k in sorted(a.keys() ^ b.keys()) if where[k] not in skip]
        for k in a.keys() & b.keys():
            out += _differences(a[k], b[k], where[k], skip)
        return sorted(out)
    return [] if a == b else [f"{path}: rank 0 {a!r}, this rank {b!r}"]


TESTS = Path(__file__).resolve().parents[1]
"""tests/: on PYTHONPATH for every process `launch` starts (the scripts import helpers.collect, helpers.models, ...)."""

ACCELERATE_PREFIXES = ("FSDP_", "ACCELERATE_", "PARALLELISM_CONFIG_")
"""The outer environment's variables that `launch(..., accelerate_cpu=True)` drops: the config file
(or the script) alone decides."""


def launch(
    kind: str,
    script: str | os.PathLike,
    *args: Any,
    cwd: str | os.PathLike,
    nproc: int | None = None,
    config: str | os.PathLike | None = None,
    env: dict[str, Any] | None = None,
    timeout: float = 300,
    reports: str | os.PathLike | None = None,
    check: bool = True,
    launcher_args: Sequence[str] | None = None,
    accelerate_cpu: bool | None = None,
    pythonpath: Sequence[str | os.PathLike] = (),
) -> subprocess.CompletedProcess:
    """Start `script ARGS...` in `cwd` as `kind` launches it and return the finished process (its
    output captured); through `run_script`, so a launch that fails (`check`) or runs past `timeout`
    fails the test naming the command, its exit code and the ends of its output.

    kind: "python" (`python SCRIPT`: one process, or a script that starts its own ranks; `script`
    may be "-m" and `args` a module and its arguments), "torchrun" (`python -m torch.distributed.run
    --standalone --nproc_per_node=NPROC`, 2 by default; `launcher_args` replace `--standalone`, e.g.
    for one agent of a 2-node world) or "accelerate" (`accelerate launch --config_file CONFIG
    --main_process_port FREE_PORT`, `--num_processes NPROC` only when given: the config file's
    otherwise; `launcher_args` are added before the script).

    Environment: the caller's, with OMP_NUM_THREADS=1 (2 cores shared by the ranks) and PYTHONPATH
    starting with tests/, the script's own folder and `pythonpath` (the scripts import helpers.collect,
    helpers.models, their folder's `common`, without editing sys.path). `accelerate_cpu` (the default for
    "accelerate"): the outer FSDP_*/ACCELERATE_*/PARALLELISM_CONFIG_* variables are dropped, so that
    the config file alone decides, and ACCELERATE_USE_CPU=true is set (Accelerate's FSDP launcher drops
    the file's `use_cpu: true`: on a GPU machine these CPU tests would ask for a GPU per rank). `env`
    is applied last; a None value removes the variable.

    reports=OUT.json: the script's ranks write `helpers.collect.run_flows` reports (NPROC of them, 2 by
    default); a failing launch adds the flows that raised on each rank.
    """
    if kind not in ("python", "torchrun", "accelerate"):
        raise ValueError(f"launch kind {kind!r}: expected 'python', 'torchrun' or 'accelerate'")
    if (config is None) == (kind == "accelerate"):
        raise ValueError(f"launch kind {kind!r} with config={config!r}: a config file is for 'accelerate' only")
    cmd = [sys.executable]
    if kind == "torchrun":
        cmd += ["-m", "torch.distributed.run", *(launcher_args or ["--standalone"]), f"--nproc_per_node={nproc or 2}"]
    elif kind == "accelerate":
        cmd += ["-m", "accelerate.commands.launch", "--config_file", str(config)]
        # On a free port: the default 29500 may still be held by the previous world's exiting processes.
        cmd += ["--main_process_port", str(free_port())]
        cmd += ["--num_processes", str(nproc)] if nproc is not None else []
        cmd += list(launcher_args or [])
    cmd += [str(script), *map(str, args)]

    full_env = dict(os.environ)
    if accelerate_cpu if accelerate_cpu is not None else kind == "accelerate":
        full_env = {k: v for k, v in full_env.items() if not k.startswith(ACCELERATE_PREFIXES)}
        full_env["ACCELERATE_USE_CPU"] = "true"
    full_env["OMP_NUM_THREADS"] = "1"
    path = Path(cwd, script)
    folders = [TESTS, *([path.parent] if path.is_file() else []), *pythonpath]
    full_env["PYTHONPATH"] = os.pathsep.join(
        [*dict.fromkeys(str(Path(f).resolve()) for f in folders), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    for key, value in (env or {}).items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = str(value)
    ranks = (Path(reports), nproc or 2) if reports is not None else None
    return run_script(cmd, cwd=cwd, env=full_env, timeout=timeout, reports=ranks, check=check)


def run_script(
    cmd: list[str],
    *,
    cwd: str | os.PathLike,
    env: dict,
    timeout: float,
    reports: tuple[Path, int] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run `cmd` (a launcher starting ranks, or one process) and return it, finished, with its output;
    fail with the ends of its output when it exits non-zero (unless `check` is false) or runs past
    `timeout` (then it is killed with every process under it: torchrun starts its ranks in sessions of
    their own, which would outlive it and keep its output open).
    `reports=(OUT.json, world_size)`: the flows that raised on each rank (what the ranks reported
    until then) are added to the failure."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        failure = f"exited with code {proc.returncode}" if proc.returncode != 0 and check else None
    except subprocess.TimeoutExpired:
        for pid in [proc.pid, *_descendants(proc.pid)]:  # found before any is killed (orphans move to init)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        stdout, stderr = proc.communicate()
        failure = f"ran past its timeout ({timeout:.0f}s), killed with the processes it started"
    if failure is None:
        return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    if reports is not None:
        try:
            rank_reports(*reports)
        except AssertionError as exc:
            failure += f"; what the ranks reported:\n{exc}"
    raise AssertionError(f"{cmd} {failure}\n--- stdout:\n{stdout[-3000:]}\n--- stderr:\n{stderr[-5000:]}")


def _descendants(pid: int) -> list[int]:
    """The processes under `pid` (children, their children, ...), from /proc (none where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # after "pid (name)": state, ppid
        except (OSError, IndexError, ValueError):  # ended meanwhile
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
