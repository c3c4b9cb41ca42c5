"""`fsdp2-strategy consolidate` / `inspect` with bad input: an exit status, a message naming the
file or option and the fix, no traceback, and nothing changed on disk (the table's CLI part)."""

from __future__ import annotations

import pytest
from helpers.bad_inputs import CliRow, Env, assert_unchanged
from helpers.harness import launch

from fsdp2_strategy.cli.main import main

_USAGE = 2  # argparse's status for a bad command line; main() uses it for bad input too
_DAMAGED = 1  # `inspect` found a file that does not match its checksum

CLI_ROWS = [
    CliRow(
        "consolidate missing checkpoint",
        lambda e: ["consolidate", f"{e.root}/nowhere", f"{e.root}/out"],
        _USAGE,
        ("consolidate: error:", "No committed checkpoint under", "nowhere", "check the path"),
    ),
    CliRow(
        "consolidate damaged shard",
        lambda e: ["consolidate", f"{e.root}/damaged", f"{e.root}/out"],
        _USAGE,
        ("damaged and was not exported", ".distcp: corrupted", "--step N"),
    ),
    CliRow(
        "consolidate unreadable .metadata",
        lambda e: ["consolidate", f"{e.root}/garbage", f"{e.root}/out"],
        _USAGE,
        (".metadata is unreadable", "earlier step"),
    ),
    CliRow(
        "consolidate missing shards",
        lambda e: ["consolidate", f"{e.root}/shardless", f"{e.root}/out"],
        _USAGE,
        ("Reading the shards of", "__0_0.distcp", "damaged or incomplete", "--step N"),
    ),
    CliRow(
        "consolidate out is a file",
        lambda e: ["consolidate", f"{e.root}/ckpt", f"{e.root}/a_file.txt"],
        _USAGE,
        ("a_file.txt is a file", "pass a folder"),
    ),
    CliRow(
        "consolidate --step not committed",
        lambda e: ["consolidate", f"{e.root}/ckpt", f"{e.root}/out", "--step", "9"],
        _USAGE,
        ("step 9 is not committed", "committed steps: [1]"),
    ),
    CliRow(
        "consolidate --dtype",
        lambda e: ["consolidate", f"{e.root}/ckpt", f"{e.root}/out", "--dtype", "int8"],
        _USAGE,
        ("--dtype", "'int8'", "'bf16', 'fp16', 'fp32'"),
    ),
    CliRow(
        "consolidate --format",
        lambda e: ["consolidate", f"{e.root}/ckpt", f"{e.root}/out", "--format", "onnx"],
        _USAGE,
        ("--format", "'onnx'", "'safetensors', 'torch'"),
    ),
    CliRow(
        "consolidate --max-shard-size",
        lambda e: ["consolidate", f"{e.root}/ckpt", f"{e.root}/out", "--max-shard-size", "lots"],
        _USAGE,
        ("--max-shard-size", "'lots' is not a size", "500MB"),
    ),
    CliRow(
        "consolidate without OUT",
        lambda e: ["consolidate", f"{e.root}/ckpt"],
        _USAGE,
        ("the following arguments are required: out",),
    ),
    CliRow("no command", lambda e: [], _USAGE, ("required: command", "consolidate", "inspect")),
    CliRow(
        "inspect missing checkpoint",
        lambda e: ["inspect", f"{e.root}/nowhere"],
        _USAGE,
        ("inspect: error:", "No committed checkpoint under", "nowhere"),
    ),
    CliRow(
        "inspect unreadable .metadata",
        lambda e: ["inspect", f"{e.root}/garbage"],
        _USAGE,
        (".metadata is unreadable", "earlier step"),
    ),
    CliRow(
        "inspect --step not committed",
        lambda e: ["inspect", f"{e.root}/ckpt", "--step", "9"],
        _USAGE,
        ("step 9 is not committed", "committed steps: [1]"),
    ),
    CliRow(
        "inspect --step not an int",
        lambda e: ["inspect", f"{e.root}/ckpt", "--step", "last"],
        _USAGE,
        ("--step", "invalid int value: 'last'"),
    ),
    CliRow(
        "convert-fsdp1 a file that runs code",
        lambda e: ["convert-fsdp1", f"{e.root}/crafted.pt", f"{e.root}/out"],
        _USAGE,
        ("crafted.pt holds the type posix.getcwd", "--trust"),
    ),
    CliRow(
        "inspect damaged shard",
        lambda e: ["inspect", f"{e.root}/damaged"],
        _DAMAGED,
        ("DAMAGED:", ".distcp: corrupted"),
    ),
]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Env:
    return Env(tmp_path_factory.mktemp("bad_cli"))


def _run(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own errors exit from inside parse_args
        return int(exc.code)


@pytest.mark.parametrize("row", CLI_ROWS, ids=[r.id for r in CLI_ROWS])
def test_bad_command_line_exits_with_a_message(row: CliRow, env: Env, capsys):
    before = env.snapshot()
    status = _run(row.argv(env))
    out, err = capsys.readouterr()
    assert status == row.status, (status, out, err)
    for phrase in row.says:
        assert phrase in out + err, (phrase, out, err)
    assert "Traceback" not in out + err
    assert_unchanged(before, env.snapshot())


def test_installed_command_prints_no_traceback(env: Env):
    """The real process: exit status 2 and one error line on stderr, for an error raised deep in
    DCP (a checkpoint whose shards are gone)."""
    done = launch(
        "python",
        "-m",
        "fsdp2_strategy.cli",
        "consolidate",
        env.root / "shardless",
        env.root / "out",
        cwd=env.root,
        timeout=120,
        check=False,
    )
    assert done.returncode == _USAGE, done
    assert "Traceback" not in done.stdout + done.stderr
    assert "fsdp2-strategy consolidate: error: Reading the shards of" in done.stderr
    assert not (env.root / "out").exists()
