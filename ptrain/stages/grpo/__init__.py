"""The RL stage (`kind: grpo`), read top to bottom: generate, score, advantage, train, sync.

collector.py  prompts from the environments -> the rollout engine -> scored groups
              (the one place engines and environments meet; sync and async)
batch.py      scored trajectories -> the policy batch of a step (rows cut to a length bucket)
driver.py     the stage: rollout batches (reward shaping, group advantages, the
              epoch/mini-batch split, metrics and cost) -> the shared jitted update
              (ptrain.train.policy_objective's objective) -> weights to the engine
"""

from ptrain.stages.grpo.driver import RolloutBatches, groups_ahead, run_grpo_stage, shaped_rewards

__all__ = ["RolloutBatches", "groups_ahead", "run_grpo_stage", "shaped_rewards"]
