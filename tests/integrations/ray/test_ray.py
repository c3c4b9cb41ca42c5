"""Ray Train adapter: a local Ray cluster (2 CPU workers, gloo) running fsdp2_strategy train functions.

One module-scoped cluster for every test here (starting Ray costs seconds). The train
functions live in tests/helpers/ray_fns.py and travel to the workers by value.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

if os.environ.get("CI"):  # CI installs the dev extra, which has Ray: a missing Ray must fail there, not skip
    import ray
    import ray.train.torch  # noqa: F401
else:
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.train.torch")

import ray.cloudpickle  # noqa: E402
from helpers import ROOT
from helpers import ray_fns as fns  # noqa: E402
from helpers.untrusted import plant  # noqa: E402
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402

import fsdp2_strategy as f2  # noqa: E402
from fsdp2_strategy.checkpoint.directory import committed_steps, is_committed  # noqa: E402
from fsdp2_strategy.integrations.accelerate.config_file import accelerate_config_env  # noqa: E402

RTOL = 1e-5


@pytest.fixture(scope="module")
def cluster():
    ray.cloudpickle.register_pickle_by_value(fns)
    # Ray Train reads these in its controller (propagated from here): give worker groups time to
    # start while other jobs load the machine; poll the workers every 0.5 s instead of 2 s, so a
    # finished or killed attempt is noticed sooner (each run here has 1 to 3 attempts).
    tuned = {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "300", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}
    saved = {k: os.environ.get(k) for k in tuned}
    os.environ.update(tuned)
    # Logical CPUs: 2 workers plus Ray's controller; the real machine has 2 shared cores.
    ray.init(
        num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}}
    )
    yield
    ray.shutdown()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _fit(fn, config: dict, tmp_path: Path, *, max_failures: int = 0):
    trainer = TorchTrainer(
        fn,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(
            name="run",
            storage_path=str(tmp_path / "ray_storage"),
            failure_config=FailureConfig(max_failures=max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=None),
        ),
    )
    return trainer.fit()


def _assert_close(got: dict, want: dict, prefix: str = "") -> None:
    assert sorted(k.removeprefix(prefix) for k in got) == sorted(want)
    for k, v in want.items():
        diff = (got[prefix + k] - v).norm() / v.norm()
        assert diff < RTOL, f"{k}: relative difference {diff:.2e}"


def test_core_resumes_after_sigkill_in_training_and_in_save(cluster, tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    config = {
        "root": str(tmp_path / "ckpt"),
        "marks": str(marks),
        "out": str(tmp_path / "final.pt"),
        "steps": 8,
        "every": 2,
        "kill_in_train": 5,
        "kill_in_save": 6,
    }
    result = _fit(fns.core_train, config, tmp_path, max_failures=2)
    assert result.error is None
    # Attempt 1 died at step 5, after committing and reporting step 4; attempt 2 died inside the
    # save of step 6. Each restart resumes from step 4, the newest committed step, even when Ray
    # lost its report (Ray registers a report when its controller polls, so a worker death
    # noticed first loses it: `resume` then reports the step again). A partial save is never
    # resumed nor reported, and nothing committed is removed.
    starts = [json.loads(line) for line in (marks / "starts.jsonl").read_text().splitlines()]
    assert [s["start"] for s in starts] == [0, 4, 4]
    assert all(s["world"] == 2 and s["backend"] == "gloo" for s in starts)  # Ray's group, not a new 1-rank one
    assert (marks / "killed-in-train").exists() and (marks / "killed-in-save").exists()
    assert sorted(committed_steps(Path(config["root"]))) == [4, 6, 8]  # keep_last=3
    # The metrics kept for re-reporting go with their steps.
    assert sorted(p.name for p in (Path(config["root"]) / ".ray-metrics").iterdir()) == [
        "step-000004.json",
        "step-000006.json",
        "step-000008.json",
    ]
    reported = [Path(c.path).name for c, _ in result.best_checkpoints]
    assert len(reported) == len(set(reported)) and {"step-000004", "step-000006", "step-000008"} <= set(reported)
    assert set(reported) <= {"step-000002", "step-000004", "step-000006", "step-000008"}
    assert all(is_committed(Path(c.path)) for c, _ in result.best_checkpoints)
    assert all(m["step"] == int(Path(c.path).name[5:]) for c, m in result.best_checkpoints)  # metrics kept on re-report
    assert Path(result.checkpoint.path).name == "step-000008"
    assert result.metrics["step"] == 8
    _assert_close(torch.load(config["out"]), fns.reference_weights(8, "adam"))


def test_lightning_strategy_through_prepare_trainer_reports_checkpoints_and_resumes(cluster, tmp_path):
    config = {"root": str(tmp_path / "ckpt"), "out": str(tmp_path / "final.pt"), "steps": 4, "every": 2, "kill_at": 3}
    result = _fit(fns.lightning_train, config, tmp_path, max_failures=1)
    assert result.error is None
    assert (tmp_path / "killed").exists()
    # The restart resumed from the step-2 checkpoint (Ray's, or the ModelCheckpoint folder's if Ray lost the report).
    assert (tmp_path / "starts.txt").read_text().split() == ["None", "epoch=0-step=2.ckpt"]
    names = [Path(c.path).name for c, _ in result.best_checkpoints]
    assert "epoch=1-step=4.ckpt" in names and set(names) <= {"epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"}
    assert all(is_committed(Path(c.path)) and (Path(c.path) / "meta.pt").is_file() for c, _ in result.best_checkpoints)
    assert "train_loss" in result.metrics
    _assert_close(torch.load(config["out"]), fns.reference_weights(4, "sgd"), prefix="net.")


def test_accelerate_from_config_file(cluster, tmp_path):
    config_file = tmp_path / "fsdp2.yaml"
    config_file.write_text(
        "distributed_type: FSDP\nuse_cpu: true\nmixed_precision: 'no'\nnum_processes: 2\n"
        "fsdp_config:\n  fsdp_version: 2\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
        "  fsdp_transformer_layer_cls_to_wrap: Linear\n  fsdp_reshard_after_forward: true\n"
        "  fsdp_state_dict_type: SHARDED_STATE_DICT\n"
    )
    config = {"config_file": str(config_file), "out": str(tmp_path / "final.pt"), "steps": 4, "root": str(tmp_path)}
    result = _fit(fns.accelerate_train, config, tmp_path)
    assert result.error is None
    _assert_close(torch.load(config["out"]), fns.reference_weights(4, "sgd"))
    # RayFSDP2Accelerator.save_state ("overlap" saves) reported each directory once committed, with its metrics.
    reported = {Path(c.path).name: m["step"] for c, m in result.best_checkpoints}
    assert reported == {"state-2": 2, "state-4": 4}
    assert all(is_committed(Path(c.path)) for c, _ in result.best_checkpoints)


def test_accelerate_config_env_maps_yaml_as_accelerate_launch_does(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "distributed_type: FSDP\nuse_cpu: true\nmixed_precision: bf16\nfsdp_config:\n"
        "  fsdp_version: 2\n  fsdp_offload_params: false\n  fsdp_transformer_layer_cls_to_wrap: [Block, Head]\n"
        "  fsdp_min_num_params: 100\n  fsdp_backward_prefetch: null\n"
    )
    assert accelerate_config_env(path) == {
        "FSDP_VERSION": "2",
        "FSDP_OFFLOAD_PARAMS": "false",
        "FSDP_TRANSFORMER_CLS_TO_WRAP": "Block,Head",
        "FSDP_MIN_NUM_PARAMS": "100",
        "ACCELERATE_USE_FSDP": "true",
        "ACCELERATE_MIXED_PRECISION": "bf16",
        "ACCELERATE_USE_CPU": "true",
    }
    deepspeed = tmp_path / "ds.yaml"
    deepspeed.write_text(
        "distributed_type: DEEPSPEED\nmixed_precision: bf16\ndeepspeed_config:\n  zero_stage: 3\n"
        "  offload_optimizer_device: cpu\n  gradient_clipping: 1.0\n  zero3_init_flag: true\n"
    )
    assert accelerate_config_env(deepspeed) == {  # what the engine then translates (not DeepSpeed's ImportError)
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
        "ACCELERATE_GRADIENT_CLIPPING": "1.0",
        "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true",
        "ACCELERATE_CONFIG_DS_FIELDS": "zero_stage,offload_optimizer_device,gradient_clipping,zero3_init_flag,mixed_precision",
        "ACCELERATE_MIXED_PRECISION": "bf16",
    }
    with pytest.raises(FileNotFoundError, match="accelerate config"):
        accelerate_config_env(tmp_path / "missing.yaml")
    path.write_text("fsdp_config: [1, 2]\n")
    with pytest.raises(ValueError, match="fsdp_config"):
        accelerate_config_env(path)
    path.write_text("fsdp_config:\n  version: 2\n")
    with pytest.raises(ValueError, match="'version'.*fsdp_"):
        accelerate_config_env(path)


def test_ray_train_example_runs_as_documented(tmp_path):
    """`python examples/ray_train.py` at a tiny size, starting its own local cluster as documented (the
    kill and resume it shows with `--kill-at` is the path the core test above checks)."""
    from helpers.harness import launch

    root = ROOT
    args = ["--steps", "6", "--ckpt-every", "2", "--storage", tmp_path]
    proc = launch("python", "examples/ray_train.py", *args, cwd=root, timeout=300)
    out = proc.stdout + proc.stderr
    assert "attempt starting at step 0" in out, out[-4000:]
    assert "'step': 6}; latest checkpoint" in out and "step-000006" in out, out[-4000:]
    assert sorted(committed_steps(tmp_path / "fsdp2_steps")) == [4, 6]  # keep_last=2


def test_the_restore_reads_lightnings_step_as_data(tmp_path):
    """Which checkpoint a restarted Ray run resumes is chosen by the step in its meta.pt, read as data:
    a meta.pt that runs code is refused naming it, and nothing runs."""
    from fsdp2_strategy.integrations.ray.lightning import _global_step

    marker = tmp_path / "ran"
    torch.save({"global_step": 7, "epoch": 1}, tmp_path / "meta.pt")
    assert _global_step(tmp_path) == 7
    plant(tmp_path / "meta.pt", marker, checksums=False)
    with pytest.raises(f2.UntrustedCheckpointError, match=r"meta\.pt holds the type (posix|os)\.system"):
        _global_step(tmp_path)
    assert not marker.exists()
