"""foremoe_jax: RL post-training of MoE LMs with routing foresight, in JAX.

Subpackages follow one RL step's data flow:
model -> rollout -> foresight -> planner -> transfer -> rl.
This top-level module imports nothing heavy, so `foremoe_jax.planner` stays
importable without jax.
"""
