"""This package's version, the releases it was tested with, and the one message every compatibility
check raises.

`TESTED` is the version matrix of docs/compatibility.md ("Tested versions"), which
`make test-matrix` reruns: for each distribution, the oldest and the newest release the whole
suite passed on. The floors in `pyproject.toml` are the oldest of these. At import,
`fsdp2_strategy` logs one warning (rank 0, once) for each of torch, Lightning and Accelerate
that is newer than its tested range: the private-name checks (`_torch_compat`, the adapters'
`_compat.py`) still run, but a newer release may change behaviour they cannot see.

A leaf: imports only the standard library.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
from typing import Any

__version__ = "0.2.0"
"""This package's version: the one source (`pyproject.toml` reads it; `CHANGELOG.md` has its entry)."""

TESTED: dict[str, tuple[str, str]] = {
    "torch": ("2.11.0", "2.15.0"),
    "lightning": ("2.6.6", "2.6.6"),
    "accelerate": ("1.15.0", "1.16.0"),
    "transformers": ("5.17.0", "5.25.0"),
    "ray": ("2.60.0", "2.60.0"),
}
"""Per distribution: (oldest, newest) release the whole suite passed on (docs/compatibility.md,
"Tested versions"). A newer patch release of the newest minor counts as tested; a newer minor
release does not."""

LOCK_FILE = "requirements/lock.txt"
"""The repository's lock file: the exact releases `make test` and `make example` install (`make lock`)."""

WARNED_AT_IMPORT = ("torch", "lightning", "accelerate")
"""What `import fsdp2_strategy` checks against `TESTED` (the engine and the adapters' frameworks)."""

_logger = logging.getLogger("fsdp2_strategy")
_warned = False


def minor(version: str) -> tuple[int, int]:
    """(major, minor) of a version string: "2.15.0+cu132" -> (2, 15)."""
    parts = version.split("+")[0].split(".")
    return int(parts[0]), int("".join(c for c in (parts[1] if len(parts) > 1 else "0") if c.isdigit()) or 0)


def installed(distribution: str) -> str | None:
    """The installed version of `distribution`, None when it is not installed (nothing is imported)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def tested_range(distribution: str) -> str:
    """'2.13.0 to 2.15.0': the tested releases of `distribution`, for messages."""
    low, high = TESTED[distribution]
    return low if low == high else f"{low} to {high}"


def untested_newer(distributions: tuple[str, ...] = WARNED_AT_IMPORT) -> dict[str, str]:
    """The installed distributions (of `distributions`) newer than their tested range: name -> version."""
    found = {}
    for name in distributions:
        version = installed(name)
        if version is not None and minor(version) > minor(TESTED[name][1]):
            found[name] = version
    return found


def _launcher_rank() -> int:
    # At import no process group exists yet: the launchers' variables say which process this is.
    for variable in ("RANK", "LOCAL_RANK"):
        if os.environ.get(variable, "").isdigit():
            return int(os.environ[variable])
    return 0


def warn_untested_versions() -> None:
    """Log one warning, on rank 0 and once per process, naming what is newer than the tested range."""
    global _warned
    newer = untested_newer()
    if _warned or not newer or _launcher_rank() != 0:
        return
    _warned = True
    found = ", ".join(f"{name} {version} (tested {tested_range(name)})" for name, version in newer.items())
    _logger.warning(
        "fsdp2_strategy %s was tested up to the releases in its version matrix (docs/compatibility.md); this "
        "environment has newer ones: %s. Run your tests, or pin the tested releases.",
        _package_version(),
        found,
    )


def _package_version() -> str:
    return installed("fsdp2-strategy") or "(source tree)"


def private_api_error(component: str, distribution: str, version: str, missing: list[str]) -> ImportError:
    """The error every compatibility check raises when private names it relies on moved.

    `component` says who relies on them ("fsdp2_strategy's Lightning adapter"), `missing` what moved.
    """
    low, high = TESTED[distribution]
    return ImportError(
        f"{component} (tested with {distribution} {tested_range(distribution)}) cannot find {'; '.join(missing)} in "
        f"{distribution} {version}. The newest release tested is {distribution} {high} (the project's "
        f"{LOCK_FILE} pins the releases tested together): install {distribution}>={low},<{_next_minor(high)} "
        "or upgrade fsdp2-strategy."
    )


def find_private(path: str, missing: list[str]) -> Any:
    """The object at `path` ("package.module:Name.attr"), or None after adding `path` to `missing`.

    Each adapter's `_compat.py` reaches every private framework name through this, then raises
    `private_api_error` once for all of `missing`: a framework release that moved several names
    gets one error naming them all, at import, instead of an AttributeError mid-training.
    """
    module_name, _, attrs = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for attr in attrs.split(".") if attrs else ():
            obj = getattr(obj, attr)
    except (ImportError, AttributeError):
        missing.append(path)
        return None
    return obj


def _next_minor(version: str) -> str:
    major, minor_ = minor(version)
    return f"{major}.{minor_ + 1}"
