"""RL (GRPO): the rollout generator, tasks and rewards, advantages, and the RL trainer."""
