"""Device placement of model state: canonical experts over 'expert', rest replicated.

The functional boundary of the model: `split_model` gives (graphdef, state)
with the state laid out on the mesh, ready for `jax.jit` / `nnx.merge`.
"""
from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from foremoe_jax.model import expert_parallel, moe


def state_shardings(state, mesh):
  """NamedSharding per leaf: ExpertWeight leaves split along E over 'expert'."""
  def spec(path, leaf):
    del path
    if isinstance(leaf, moe.ExpertWeight):
      return NamedSharding(mesh, P(expert_parallel.EXPERT))
    return NamedSharding(mesh, P())
  return jax.tree.map_with_path(spec, state,
                                is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_state(state, mesh):
  # The shardings tree is a prefix of the state (one sharding per Variable).
  return jax.device_put(state, state_shardings(state, mesh))


def split_model(model, mesh):
  """(graphdef, state) with the state sharded on `mesh`."""
  graphdef, state = nnx.split(model)
  return graphdef, shard_state(state, mesh)
