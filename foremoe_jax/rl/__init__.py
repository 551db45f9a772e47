"""The RL step: GRPO with routing replay, as pure functions."""
