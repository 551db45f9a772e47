"""Device placement of model state: canonical experts over 'expert', the
rest replicated, or with `fsdp` sharded over 'data' or over every device
('data' and 'expert' together: ZeRO over the EP group too).

The functional boundary of the model: `split_model` gives (graphdef, state)
with the state laid out on the mesh, ready for `jax.jit` / `nnx.merge`.
Under jit the layout carries over: the optimizer moments are built like the
parameters (`zeros_like` keeps the sharding) and the update's elementwise
optimizer math keeps it for its outputs, so one sharding serves every step.
"""
from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from foremoe_jax.model import expert_parallel, moe


FSDP_AXES = {'data': (expert_parallel.DATA,),
             'data+expert': (expert_parallel.DATA, expert_parallel.EXPERT)}


def fsdp_mesh_axes(fsdp_axes: str) -> tuple:
  """Mesh axes a `parallel.fsdp_axes` name shards the non-expert state over."""
  if fsdp_axes not in FSDP_AXES:
    raise ValueError(f'fsdp_axes must be one of {sorted(FSDP_AXES)}, got '
                     f'{fsdp_axes!r}')
  return FSDP_AXES[fsdp_axes]


def fsdp_options(parallel) -> dict:
  """The `fsdp` keywords of `split_model` from a config's `parallel`."""
  return dict(fsdp=bool(parallel.get('fsdp', False)),
              fsdp_axes=parallel.get('fsdp_axes', 'data'))


def data_spec(shape, num_data: int, skip: int = 0,
              axes=expert_parallel.DATA) -> P:
  """FSDP spec of a non-expert leaf: its first axis after the first `skip`
  that splits evenly into `num_data` shards over `axes` (a mesh axis or a
  tuple of them; replicated when no axis splits, or num_data is 1). A layer
  stack skips its layer axis: the scan slices it."""
  if num_data > 1:
    for axis, size in enumerate(shape):
      if axis >= skip and size >= num_data and size % num_data == 0:
        return P(*([None] * axis), axes)
  return P()


def is_stacked(path) -> bool:
  """Whether a state path lies in a layer stack (leading [n] layer axis)."""
  return bool(path) and getattr(path[0], 'key', path[0]) == 'segments'


def expert_spec(path) -> P:
  """Canonical experts: E over 'expert', after a stack's layer axis."""
  return (P(None, expert_parallel.EXPERT) if is_stacked(path)
          else P(expert_parallel.EXPERT))


def state_shardings(state, mesh, fsdp: bool = False,
                    fsdp_axes: str = 'data'):
  """NamedSharding per leaf: ExpertWeight leaves split along E over 'expert';
  the rest replicated, or with `fsdp` split over the mesh axes `fsdp_axes`
  names (`data_spec`). Leaves of a layer stack keep their layer axis whole.

  With fsdp_axes='data+expert' the non-expert master weights and their
  Adam moments are split over every device (ZeRO over the EP group as well
  as the data groups): the update gathers them once per step and its
  optimizer math runs on the local shard.
  """
  axes = fsdp_mesh_axes(fsdp_axes)
  num_data = int(np.prod([mesh.shape[a] for a in axes])) if fsdp else 1
  spec_axes = axes[0] if len(axes) == 1 else axes

  def spec(path, leaf):
    if isinstance(leaf, moe.ExpertWeight):
      return NamedSharding(mesh, expert_spec(path))
    return NamedSharding(mesh, data_spec(leaf.shape, num_data,
                                         int(is_stacked(path)), spec_axes))
  return jax.tree.map_with_path(spec, state,
                                is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_state(state, mesh, fsdp: bool = False, fsdp_axes: str = 'data'):
  # The shardings tree is a prefix of the state (one sharding per Variable).
  return jax.device_put(state, state_shardings(state, mesh, fsdp, fsdp_axes))


def split_model(model, mesh, fsdp: bool = False, fsdp_axes: str = 'data'):
  """(graphdef, state) with the state sharded on `mesh` (see
  `state_shardings`)."""
  graphdef, state = nnx.split(model)
  return graphdef, shard_state(state, mesh, fsdp, fsdp_axes)
