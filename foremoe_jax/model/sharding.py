"""Device placement of model state: canonical experts over 'expert', the
rest replicated, or with `fsdp` sharded over 'data'.

The functional boundary of the model: `split_model` gives (graphdef, state)
with the state laid out on the mesh, ready for `jax.jit` / `nnx.merge`.
Under jit the layout carries over: the optimizer moments are built like the
parameters (`zeros_like` keeps the sharding) and the update's elementwise
optimizer math keeps it for its outputs, so one sharding serves every step.
"""
from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from foremoe_jax.model import expert_parallel, moe


def data_spec(shape, num_data: int, skip: int = 0) -> P:
  """FSDP spec of a non-expert leaf: its first axis after the first `skip`
  that splits evenly over 'data' (replicated when none does, or num_data
  is 1). A layer stack skips its layer axis: the scan slices it."""
  if num_data > 1:
    for axis, size in enumerate(shape):
      if axis >= skip and size >= num_data and size % num_data == 0:
        return P(*([None] * axis), expert_parallel.DATA)
  return P()


def is_stacked(path) -> bool:
  """Whether a state path lies in a layer stack (leading [n] layer axis)."""
  return bool(path) and getattr(path[0], 'key', path[0]) == 'segments'


def expert_spec(path) -> P:
  """Canonical experts: E over 'expert', after a stack's layer axis."""
  return (P(None, expert_parallel.EXPERT) if is_stacked(path)
          else P(expert_parallel.EXPERT))


def state_shardings(state, mesh, fsdp: bool = False):
  """NamedSharding per leaf: ExpertWeight leaves split along E over 'expert';
  the rest replicated, or with `fsdp` split over 'data' (`data_spec`).
  Leaves of a layer stack keep their layer axis whole."""
  num_data = mesh.shape[expert_parallel.DATA] if fsdp else 1

  def spec(path, leaf):
    if isinstance(leaf, moe.ExpertWeight):
      return NamedSharding(mesh, expert_spec(path))
    return NamedSharding(mesh, data_spec(leaf.shape, num_data,
                                         int(is_stacked(path))))
  return jax.tree.map_with_path(spec, state,
                                is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_state(state, mesh, fsdp: bool = False):
  # The shardings tree is a prefix of the state (one sharding per Variable).
  return jax.device_put(state, state_shardings(state, mesh, fsdp))


def split_model(model, mesh, fsdp: bool = False):
  """(graphdef, state) with the state sharded on `mesh` (see
  `state_shardings`)."""
  graphdef, state = nnx.split(model)
  return graphdef, shard_state(state, mesh, fsdp)
