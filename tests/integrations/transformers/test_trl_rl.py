"""TRL's reinforcement-learning trainers through `fsdp2_trainer` on 2 CPU processes (`flows_rl.py` under
`accelerate launch`): GRPO generates inside one gather of the policy (no collective per token), both
GRPO's and DPO's reference models are sharded per block for forward only and never change, and the
loss of a training step equals TRL's own loss computed with unsharded models on the same inputs. The script
checks (`helpers.checks.Checks`, on every rank); this file launches it and reports its checks."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.checks import FlowReports
from helpers.harness import launch, rank_reports

SCRIPTS = Path(__file__).parent / "scripts"
PER_RANK = ["grpo.loss", "grpo.ref_loss"]
"""GRPO: each rank's own second-step loss (on its own completions) and TRL's recomputation of it."""
QUIET = {"TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def rl(tmp_path_factory) -> FlowReports:
    pytest.importorskip("trl")
    work = tmp_path_factory.mktemp("trl_rl")
    config = SCRIPTS / "fsdp2_sharded.yaml"
    launch("accelerate", "flows_rl.py", work / "out.json", work, cwd=SCRIPTS, config=config, env=QUIET)
    return FlowReports(rank_reports(work / "out.json", 2), PER_RANK)  # fails naming any flow that raised


def test_grpo_generates_in_one_gather_on_a_sharded_reference_matches_trl_and_resumes(rl):
    """GRPO: no all-gather while decoding, the reference model sharded per block for forward only, the
    second step's loss equals TRL's on unsharded models, the Trainer's own resume."""
    rl.assert_passed("grpo")


def test_dpo_reference_model_is_sharded_for_forward_only_and_the_loss_matches_trl(rl):
    rl.assert_passed("dpo")
