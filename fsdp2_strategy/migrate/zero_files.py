"""A DeepSpeed ZeRO checkpoint directory read without DeepSpeed: which files, what they hold.

`engine.save_checkpoint(save_dir)` writes `save_dir/latest` (the newest tag) and `save_dir/<tag>/`
(`global_step<N>` by default) with
- the model states: `mp_rank_00_model_states.pt` (ZeRO-1/2) or one `zero_pp_rank_<r>_mp_rank_00_model_states.pt`
  per rank (ZeRO-3): the parameter names and shapes per group (`param_shapes`), tied names
  (`shared_params`), frozen parameters, buffers (in `module`), the LR scheduler's state, the counters
  and the caller's `client_state` (merged into the top level);
- per data-parallel rank `[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`: that rank's flat fp32
  partition of each parameter group and the base optimizer's state over the same flat partition.

The optimizer files pickle a few DeepSpeed objects (`ZeroStageEnum`, `LossScaler`,
`fragment_address`); `load_file` unpickles those classes (`DEEPSPEED_GLOBALS`) as plain stand-ins, so
reading needs neither DeepSpeed nor its version. Everything else is read as torch's `weights_only`
reader reads (tensors, containers, primitives, NumPy arrays): a folder from someone else runs none of
its author's code; `trusted=True` unpickles any type (a `client_state` of your own types). Files are
memory-mapped: a tensor's bytes are read when a slice of it is used.
"""

from __future__ import annotations

import pickle
import re
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import load_small_file

MODEL_FILE = "mp_rank_00_model_states.pt"
OPTIM_FILE = re.compile(r"^(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
ZERO3_MODEL_FILE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
OTHER_MP_RANK = re.compile(r"mp_rank_(?!00_)\d+")
ENGINE_KEYS = frozenset(
    {
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "sparse_tensor_module_names",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "ds_config",
        "ds_version",
        "checkpoint_parallel_dimensions",
        "universal_checkpoint_info",
    }
)
"""Top-level keys of a model-states file that DeepSpeed's engine writes; every other key is the
caller's `client_state`."""


DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
"""The DeepSpeed classes DeepSpeed's ZeRO files pickle (0.14-0.19): read as `DeepSpeedObject` stand-ins."""


class DeepSpeedObject:
    """Stand-in for an object of a `deepspeed.*` class found in a checkpoint file: keeps the arguments
    it was built from (`args`) and its pickled state (`state`)."""

    args: tuple = ()
    state: Any = None

    def __new__(cls, *args: Any, **kwargs: Any) -> DeepSpeedObject:
        obj = super().__new__(cls)
        obj.args = args  # set here too: torch's weights_only reader builds objects by __new__ alone
        return obj

    def __init__(self, *args: Any, **kwargs: Any):
        self.args = args
        self.state = kwargs or None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<deepspeed {type(self).__name__} {self.args or ''}{self.state or ''}>"


def _stand_in(module: str, name: str) -> type[DeepSpeedObject]:
    return type(name, (DeepSpeedObject,), {"__module__": module})


_STAND_INS: list[Any] = [(_stand_in(*full.rsplit(".", 1)), full) for full in DEEPSPEED_GLOBALS]


class _Unpickler(pickle.Unpickler):
    """The full unpickler (`trusted=True`), DeepSpeed's classes as stand-ins."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "deepspeed" or module.startswith("deepspeed."):
            return _stand_in(module, name)
        return super().find_class(module, name)


_PICKLE = types.SimpleNamespace(
    Unpickler=_Unpickler, load=lambda f, **kw: _Unpickler(f, **kw).load(), __name__="fsdp2_deepspeed_pickle"
)


def load_file(path: Path, *, trusted: bool = False) -> dict[str, Any]:
    """One DeepSpeed `.pt` file, memory-mapped, DeepSpeed's classes as `DeepSpeedObject` stand-ins,
    read as data (see the module docstring) unless `trusted`.

    Raises:
        UntrustedCheckpointError: the file holds a type outside those read as data (not `trusted`).
        ValueError: naming the file when it cannot be read (a truncated or foreign file).
    """
    try:
        if trusted:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=False, pickle_module=_PICKLE)
        else:
            with torch.serialization.safe_globals(_STAND_INS):
                state = load_small_file(path, name=path, mmap=True)
    except ValueError:  # load_small_file's, naming the file (UntrustedCheckpointError among them)
        raise
    except Exception as exc:
        raise ValueError(f"{path} is not a readable DeepSpeed checkpoint file ({type(exc).__name__}: {exc})") from exc
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a DeepSpeed checkpoint's dict")
    return state


def plain_int(value: Any) -> int:
    """An int that may have been pickled as a DeepSpeed enum (`ZeroStageEnum(3)` -> 3)."""
    if isinstance(value, DeepSpeedObject):
        value = value.args[0] if value.args else value.state
    return int(value)


def resolve_step_dir(source: Path, tag: str | None) -> Path:
    """The folder of one save: `source/<tag>`, `source/<contents of source/latest>`, or `source` itself
    when it already holds the state files.

    Raises FileNotFoundError naming what is missing and what to pass instead.
    """
    source = Path(source)
    if not source.is_dir():
        raise FileNotFoundError(f"DeepSpeed checkpoint folder {source} does not exist")
    if tag is not None:
        step_dir = source / str(tag)
        if not step_dir.is_dir():
            tags = sorted(p.name for p in source.iterdir() if p.is_dir())
            raise FileNotFoundError(f"{source} has no tag folder {tag!r}; folders there: {tags or 'none'}")
        return step_dir
    if (source / "latest").is_file():
        latest = (source / "latest").read_text().strip()
        if not (source / latest).is_dir():
            raise FileNotFoundError(f"{source / 'latest'} names tag {latest!r}, but {source / latest} does not exist")
        return source / latest
    if any(OPTIM_FILE.match(p.name) for p in source.iterdir()):
        return source
    tags = sorted(p.name for p in source.iterdir() if p.is_dir())
    raise FileNotFoundError(
        f"{source} has no 'latest' file (DeepSpeed writes it beside the tag folders) and no "
        f"*_optim_states.pt files; pass the tag to convert (tag=... / --tag), one of: {tags or 'none'}"
    )


@dataclass
class ZeroFiles:
    """The files of one DeepSpeed save, by rank (data-parallel rank order)."""

    step_dir: Path
    model_files: list[Path]  # one for ZeRO-1/2, one per rank for ZeRO-3
    optim_files: list[Path]
    extra: list[str] = field(default_factory=list)  # names ignored (other files in the folder)


def find_files(step_dir: Path) -> ZeroFiles:
    """The model-state and optimizer-state files of `step_dir`, checked for a complete, convertible set.

    Raises ValueError for a tensor- or pipeline-parallel save (an `mp_rank_01` file), a save of
    ZeRO stage 0, or a missing rank's file, naming the files.
    """
    names = sorted(p.name for p in step_dir.iterdir() if p.is_file())
    other_mp = [n for n in names if OTHER_MP_RANK.search(n) or n.startswith("layer_")]
    if other_mp:
        raise ValueError(
            f"{step_dir} holds files of a tensor- or pipeline-parallel run ({', '.join(other_mp[:4])}): only "
            "data-parallel ZeRO checkpoints (mp_rank_00 only) can be converted. Convert the run to a DeepSpeed "
            "universal checkpoint first, or consolidate it with DeepSpeed's own tools."
        )
    optim = {int(m.group(1)): step_dir / n for n in names if (m := OPTIM_FILE.match(n))}
    zero3_models = {int(m.group(1)): step_dir / n for n in names if (m := ZERO3_MODEL_FILE.match(n))}
    if not optim:
        kind = (
            " (a ZeRO stage 0 save: the model states file holds a plain torch optimizer)" if MODEL_FILE in names else ""
        )
        raise ValueError(
            f"{step_dir} has no *_optim_states.pt files{kind}: not a DeepSpeed ZeRO checkpoint. "
            f"Files there: {names[:8] or 'none'}"
        )
    _check_ranks(step_dir, optim, "optimizer-state")
    if zero3_models:
        _check_ranks(step_dir, zero3_models, "model-state")
        model_files = [zero3_models[r] for r in sorted(zero3_models)]
    elif MODEL_FILE in names:
        model_files = [step_dir / MODEL_FILE]
    else:
        raise ValueError(f"{step_dir} has optimizer states but no {MODEL_FILE} (nor zero_pp_rank_*_model_states.pt)")
    used = {p.name for p in [*model_files, *optim.values()]}
    return ZeroFiles(step_dir, model_files, [optim[r] for r in sorted(optim)], [n for n in names if n not in used])


def _check_ranks(step_dir: Path, files: dict[int, Path], what: str) -> None:
    missing = sorted(set(range(max(files) + 1)) - set(files))
    if missing:
        raise ValueError(
            f"{step_dir} lacks the {what} files of rank(s) {missing} (found ranks {sorted(files)}): the save is "
            "incomplete (a rank died while saving, or files were not copied). Convert another tag."
        )


def client_state(model_states: dict[str, Any]) -> dict[str, Any]:
    """What the caller passed as `save_checkpoint(client_state=...)` (merged into the file's top level)."""
    return {k: v for k, v in model_states.items() if k not in ENGINE_KEYS}
