"""Shapes and sizes of a model config without allocating weights.

Used by planning and simulation at real scale (Qwen3-30B-A3B, Mixtral, OLMoE):
`nnx.eval_shape` builds the abstract model, so counts come from the same code
that trains, not from a separate formula.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from foremoe_jax.model import expert_parallel, moe, transformer


def abstract_model(model_cfg, mesh=None):
  mesh = expert_parallel.make_mesh(1, 1) if mesh is None else mesh
  return nnx.eval_shape(
      lambda: transformer.Transformer(model_cfg, mesh, rngs=nnx.Rngs(0)))


def param_counts(model_cfg) -> dict:
  """Total and per-token active parameter counts, and bytes per expert."""
  model = abstract_model(model_cfg)
  _, experts, rest = nnx.split(model, moe.ExpertWeight, ...)
  size = lambda s: sum(math.prod(x.shape) for x in jax.tree.leaves(s))
  expert_params = size(experts)
  other_params = size(rest)
  num_moe = model_cfg.num_layers - model_cfg.first_dense_layers
  per_expert = expert_params // (num_moe * model_cfg.num_experts)
  itemsize = jnp.dtype(model_cfg.param_dtype).itemsize
  # The embedding table is looked up, not multiplied: tied or not, count the
  # output projection once as active compute.
  return dict(
      total=expert_params + other_params,
      active=other_params + num_moe * model_cfg.top_k * per_expert,
      params_per_expert=per_expert,
      bytes_per_expert=per_expert * itemsize,
      moe_layers=num_moe)
