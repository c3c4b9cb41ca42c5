"""TRL's reinforcement-learning trainers through `fsdp2_trainer` on 2 CPU processes (`flows_rl.py` under
`accelerate launch`): GRPO generates inside one gather of the policy (no collective per token), both
GRPO's and DPO's reference models are sharded per block for forward only and never change, and the
loss of a training step equals TRL's own loss computed with unsharded models on the same inputs."""

from __future__ import annotations

from pathlib import Path

import pytest
from _harness import launch, rank_reports

SCRIPTS = Path(__file__).parent / "transformers_scripts"
TOL = 1e-5  # fp32: the sharded forward against the unsharded one (measured equal to the last digit)
QUIET = {"TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def rl(tmp_path_factory) -> list[dict]:
    pytest.importorskip("trl")
    work = tmp_path_factory.mktemp("trl_rl")
    config = SCRIPTS / "fsdp2_sharded.yaml"
    launch("accelerate", "flows_rl.py", work / "out.json", work, cwd=SCRIPTS, config=config, env=QUIET)
    return rank_reports(work / "out.json", 2)  # fails naming any flow that raised, with its rank


def test_grpo_generates_without_a_gather_per_token(rl):
    for report in rl:
        r = report["grpo"]
        assert r["backend"] == "GatheringBackend"
        # Two steps, one generate each, 6 new tokens: the groups were gathered before generate began
        # (TRL's summon_full_params is f2.gathered here) and no all-gather ran while decoding.
        assert r["generate_calls"] == [{"gathers": 0, "tokens": 6}] * 2, r["generate_calls"]


def test_grpo_and_dpo_reference_models_are_sharded_per_block_for_forward_only(rl):
    for report in rl:
        for flow in ("grpo", "dpo"):
            r = report[flow]
            # 3 decoder layers + the root, as the policy (TRL's own preparation: 1 group, the root).
            assert r["ref_groups"] == 4 and r["ref_trainable"] == 0 and r["ref_unchanged"], (flow, r)
        assert report["grpo"]["groups"] == 4
        assert report["grpo"]["resumed_ref_groups"] == 4


def test_a_training_step_loss_equals_trl_on_unsharded_models(rl):
    for report in rl:
        for flow in ("grpo", "dpo"):
            r = report[flow]
            # The second step (at the first, GRPO's loss is 0 and DPO's log 2 whatever the models compute).
            assert abs(r["loss"] - r["ref_loss"]) <= TOL * abs(r["ref_loss"]), (flow, r["loss"], r["ref_loss"])
        assert report["dpo"]["loss"] != pytest.approx(0.6931471805599453, abs=1e-6)
        assert report["grpo"]["loss"] != 0.0


def test_grpo_resumes_through_the_trainers_own_checkpoint(rl):
    for report in rl:
        assert report["grpo"]["resumed_step"] == 3  # checkpoint-2 restored, then one more step
